"""Large loads with every strategy that shares reads: data-parallel replicas and a rows -> columns change.

On ``--ranks`` gloo processes (sharing one GPU with ``--device cuda``), saves ``--tensors`` float32
matrices of ``--cols`` columns, ``--gib`` GiB per checkpoint, twice: every rank holding all of them
(data-parallel replicas) and split by rows; then loads the replicas as replicas and the row split by
columns with ``local``, ``auto``, ``read_once``, ``fully_parallel`` and ``two_stage`` (best of
``--repeats``, slowest rank), checking every value. ``--backend zarr`` saves zarr instead (where
only ``fully_parallel`` and ``two_stage`` share reads). Prints seconds per load and what it ran.

Usage::

    python benchmarks/shared_reads.py                          # 2 ranks, 1 GiB, CPU tensors, /dev/shm
    python benchmarks/shared_reads.py --device cuda --gib 4    # on a GPU machine
    python benchmarks/shared_reads.py --gib 0.01 --repeats 1   # smoke run
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


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import ckpt_integration as ci
        from ckpt_integration.execution.load import last_load_stats

        dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
        rows = max(world, int(args.gib * 2**30 / 4 / args.tensors / args.cols) // world * world)
        gen = torch.Generator().manual_seed(0)
        full = [torch.rand(rows, args.cols, generator=gen).to(dev) for _ in range(args.tensors)]
        sd = lambda ts, axis: {f"t{i}": ci.ShardedTensor.from_rank_offsets(  # noqa: E731
            f"t{i}", t, *(() if axis is None else ((axis, rank, world),)), replica_id=rank if axis is None else 0)
            for i, t in enumerate(ts)}
        cases = (("replicas", None, None, full),
                 ("rows->cols", 0, 1, [t.chunk(world, 1)[rank] for t in full]))
        if rank == 0:
            print(f"{world} ranks, {args.device} tensors, {args.backend}, {args.tensors} x {rows} x {args.cols} float32 "
                  f"({rows * args.cols * args.tensors * 4 / 2**30:.2f} GiB per checkpoint); seconds per load "
                  "(slowest rank, best of {})".format(args.repeats), flush=True)
        for case, saved_axis, load_axis, want in cases:
            path = os.path.join(root, case.replace("->", "_"))
            parts = full if saved_axis is None else [t.chunk(world, saved_axis)[rank].contiguous() for t in full]
            ci.save(sd(parts, saved_axis), path, sharded_strategy=args.backend)
            for strategy in STRATEGIES:
                best = float("inf")
                for _ in range(args.repeats):
                    req = sd([torch.empty_like(w) for w in want], load_axis)
                    dist.barrier()
                    t0 = time.perf_counter()
                    out = ci.load(req, path, load_strategy=strategy)
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    t = torch.tensor([time.perf_counter() - t0])
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    best = min(best, float(t))
                assert all(torch.equal(out[f"t{i}"], w) for i, w in enumerate(want)), (case, strategy)
                if rank == 0:
                    print(f"{case:<11} {strategy:<15} {best:7.3f} s   (ran: {last_load_stats.get('strategy')})", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--backend", choices=("torch_dist", "zarr"), default="torch_dist")
    p.add_argument("--gib", type=float, default=1.0, help="bytes of each checkpoint (GiB)")
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--cols", type=int, default=4096, help="columns (a multiple of --ranks)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = p.parse_args()
    root = tempfile.mkdtemp(dir=args.dir, prefix="ckpt-shared-reads-")
    try:
        mp.spawn(_worker, args=(args.ranks, _free_port(), args, root), nprocs=args.ranks)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
