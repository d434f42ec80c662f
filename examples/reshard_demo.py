"""Save a tensor-parallel model from 2 processes, then load it with a different layout.

Run: ``python examples/reshard_demo.py`` (spawns its own gloo processes, CPU only).

1. Two ranks hold a column-parallel and a row-parallel weight (TP=2) and save.
2. One process loads the same checkpoint with TP=1 (whole tensors).
3. Two ranks load it again with the split along the other axis.
Each load is checked element by element against the saved values.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ckpt_integration as ci

HIDDEN, FFN = 8, 16


def full_weights():
    g = torch.Generator().manual_seed(0)
    return {"fc1": torch.randn(FFN, HIDDEN, generator=g), "fc2": torch.randn(HIDDEN, FFN, generator=g)}


def sharded_state(rank: int, tp: int, weights=None, step: int = 0):
    w = weights or {k: torch.zeros_like(v) for k, v in full_weights().items()}
    rows, cols = FFN // tp, FFN // tp
    fc1 = w["fc1"][rank * rows : (rank + 1) * rows].clone()  # column-parallel: split outputs
    fc2 = w["fc2"][:, rank * cols : (rank + 1) * cols].clone()  # row-parallel: split inputs
    return {
        "model": {
            "fc1.weight": ci.ShardedTensor.from_rank_offsets("model.fc1.weight", fc1, (0, rank, tp)),
            "fc2.weight": ci.ShardedTensor.from_rank_offsets("model.fc2.weight", fc2, (1, rank, tp)),
        },
        "step": step,
    }


def worker(rank: int, world: int, port: int, ckpt: str, mode: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if mode == "save":
            ci.save(sharded_state(rank, world, full_weights(), step=100), ckpt)
            if rank == 0:
                print(f"[save] TP={world}: saved {ckpt}")
        else:
            # rows <-> columns: fc1 split along its input axis instead
            full = full_weights()
            cols = HIDDEN // world
            req = {"fc1.weight": ci.ShardedTensor.from_rank_offsets(
                "model.fc1.weight", torch.zeros(FFN, cols), (1, rank, world))}
            out = ci.load(req, ckpt)
            assert torch.equal(out["fc1.weight"], full["fc1"][:, rank * cols : (rank + 1) * cols])
            print(f"[load] rank {rank}: fc1 split along the other axis matches")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ckpt = os.path.join(tempfile.mkdtemp(prefix="ckpt_demo_"), "iter_0000100")
    mp.spawn(worker, args=(2, free_port(), ckpt, "save"), nprocs=2)
    # a single process, no torch.distributed: TP=1
    out = ci.load(sharded_state(0, 1), ckpt)
    full = full_weights()
    assert torch.equal(out["model"]["fc1.weight"], full["fc1"]) and torch.equal(out["model"]["fc2.weight"], full["fc2"])
    print(f"[load] TP=1 single process: whole tensors match, step={out['step']}")
    mp.spawn(worker, args=(2, free_port(), ckpt, "load"), nprocs=2)
    print("OK: saved with TP=2, loaded with TP=1 and with a transposed split")
    return 0


if __name__ == "__main__":
    sys.exit(main())
