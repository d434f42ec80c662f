"""Loads of many small replicated tensors beside a resharded matrix, with every load strategy.

A model's norms and biases are small and usually replicated over the data-parallel ranks. This
saves, on ``--ranks`` gloo processes, a ``--rows`` x ``--rows`` float32 matrix split by rows and
``--small`` replicated float32 tensors of 64 elements, then loads the matrix split by columns
(a TP change: ``auto`` reads it once) with the small tensors beside it, twice per strategy,
checking every value. Prints seconds per load (slowest rank) and what the load ran.

Usage::

    python benchmarks/small_beside_large.py                      # 2 ranks, 3,000 small, 2048 rows, /dev/shm
    python benchmarks/small_beside_large.py --small 50 --rows 256  # smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import _free_port  # noqa: E402

STRATEGIES = ("local", "auto", "read_once", "fully_parallel", "two_stage")


def _state(rank: int, world: int, n: int, rows: int, load: bool):
    import ckpt_integration as ci

    sd = {f"small.{i}": ci.ShardedTensor.from_rank_offsets(
        f"small.{i}", torch.empty(64) if load else torch.full((64,), float(i)), replica_id=rank) for i in range(n)}
    if load:
        sd["w"] = ci.ShardedTensor.from_rank_offsets("w", torch.empty(rows, rows // world), (1, rank, world))
    else:
        full = torch.arange(rows * rows, dtype=torch.float32).view(rows, rows)
        sd["w"] = ci.ShardedTensor.from_rank_offsets("w", full[rank * rows // world:(rank + 1) * rows // world].clone(),
                                                     (0, rank, world))
    return sd


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, path: str) -> None:
    import ckpt_integration as ci
    from ckpt_integration.execution.load import last_load_stats

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ci.save(_state(rank, world, args.small, args.rows, False), path)
        full = torch.arange(args.rows * args.rows, dtype=torch.float32).view(args.rows, args.rows)
        cols = slice(rank * args.rows // world, (rank + 1) * args.rows // world)
        for strategy in STRATEGIES:
            times = []
            for _ in range(args.repeats):
                req = _state(rank, world, args.small, args.rows, True)
                dist.barrier()
                t0 = time.perf_counter()
                out = ci.load(req, path, load_strategy=strategy)
                t = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times.append(float(t))
                assert torch.equal(out["w"], full[:, cols]), strategy
                assert all(torch.equal(out[f"small.{i}"], torch.full((64,), float(i))) for i in range(args.small)), strategy
            if rank == 0:
                print(f"{strategy:<15} {' '.join(f'{x:.3f}' for x in times)} s   (ran: {last_load_stats.get('strategy')})",
                      flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--small", type=int, default=3000, help="small replicated tensors")
    p.add_argument("--rows", type=int, default=2048, help="rows (and columns) of the resharded matrix")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = p.parse_args()
    root = tempfile.mkdtemp(dir=args.dir, prefix="ckpt-small-large-")
    try:
        print(f"{args.ranks} ranks, {args.small} small replicated tensors beside a {args.rows}x{args.rows} float32 "
              f"matrix saved by rows, loaded by columns; seconds per load (slowest rank)", flush=True)
        mp.spawn(_worker, args=(args.ranks, _free_port(), args, os.path.join(root, "c")), nprocs=args.ranks)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
