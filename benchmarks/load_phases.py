#!/usr/bin/env python
"""Where a same-layout load's time goes: each phase of ``load()`` timed on every rank.

Two (``--ranks``) gloo ranks save a row-sharded state, then load it ``--repeats`` times in
the same layout; the load's steps are wrapped with timers (metadata broadcast, common
state, request validation exchange, read plan, read-once decision, reads, final error
agreement) and, between the same barriers, each rank reads its own data files with plain
``readinto`` (no parsing, no checks). Best of ``--repeats`` per phase, rank 0's figures
(the slowest rank's total is printed too).

    python benchmarks/load_phases.py --mib 512 --tensors 32 --dir /dev/shm --repeats 5
    python benchmarks/load_phases.py --small 10000 --dir /dev/shm --repeats 5      # 4 KiB tensors
    python benchmarks/load_phases.py --small 10000 --profile prof.out             # cProfile of rank 0's last load
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import _free_port  # noqa: E402

PHASES = [
    ("read_shared", "metadata: one reader, one broadcast (`open_shared`)"),
    ("load_common", "common state (`load_common`)"),
    ("shards", "request cut into shards (`local_shards`)"),
    ("check_start", "request check: failures and reuse agreed (`exchange.start`)"),
    ("validation", "request validation exchange (`exchange.run`)"),
    ("prepare", "read plan (`_prepare_reads`)"),
    ("read_once", "read-once decision (`load_read_once`)"),
    ("read_all", "reads + checks (`read_all`)"),
    ("agree", "error agreements (`agree_on_errors`)"),
    ("split", "state dict split (`split_state_dict`)"),
    ("route", "request records routed (`route_shards`)"),
    ("metadata_for", "metadata of the requested keys (`metadata_for`)"),
    ("finish", "results assembled (`finish`)"),
]


def _wrap(timings: Dict[str, float], name: str, fn):
    def inner(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            timings[name] += time.perf_counter() - t0

    return inner


def _install(timings: Dict[str, float]) -> None:
    from ckpt_integration.execution import dist as dist_mod
    from ckpt_integration.execution import exchange as exchange_mod
    from ckpt_integration.execution import load as load_mod
    from ckpt_integration.execution import shared_metadata as shared_mod
    from ckpt_integration.storage import checkpoint_dir as ckdir

    from ckpt_integration import serialization as ser_mod

    # the entry point opens the checkpoint once for the job (coordinator reads, one broadcast)
    ser_mod.open_shared = _wrap(timings, "read_shared", ser_mod.open_shared)
    ckdir.load_common = _wrap(timings, "load_common", ckdir.load_common)
    exchange_mod.run = _wrap(timings, "validation", exchange_mod.run)
    exchange_mod.start = _wrap(timings, "check_start", exchange_mod.start)
    load_mod.local_shards = _wrap(timings, "shards", load_mod.local_shards)
    load_mod._prepare_reads = _wrap(timings, "prepare", load_mod._prepare_reads)
    load_mod.load_read_once = _wrap(timings, "read_once", load_mod.load_read_once)
    load_mod._LoadJob.read_all = _wrap(timings, "read_all", load_mod._LoadJob.read_all)
    dist_mod.agree_on_errors = _wrap(timings, "agree", dist_mod.agree_on_errors)
    load_mod.split_state_dict = _wrap(timings, "split", load_mod.split_state_dict)
    load_mod.route_shards = _wrap(timings, "route", load_mod.route_shards)
    shared_mod.SharedMetadata.metadata_for = _wrap(timings, "metadata_for", shared_mod.SharedMetadata.metadata_for)
    load_mod._LoadJob.finish = _wrap(timings, "finish", load_mod._LoadJob.finish)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))  # one node, as torchrun would say
    import torch
    import torch.distributed as tdist

    import ckpt_integration as ci
    from ckpt_integration import ShardedTensor

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    d = os.path.join(args.dir, f"ckpt_phases_{port}")
    try:
        if args.small:
            local = [torch.rand(args.small_bytes // 4) for _ in range(args.small)]
        else:
            per = args.mib * (1 << 20) // args.tensors // (args.cols * 4)
            local = [torch.rand(per, args.cols) for _ in range(args.tensors)]
        dst = [torch.zeros_like(t) for t in local]
        sd = lambda ts: {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", t, (0, rank, world)) for i, t in enumerate(ts)}  # noqa: E731
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
        tdist.barrier()
        ci.save(sd(local), d)
        tdist.barrier()
        files = sorted(f for f in os.listdir(d) if f.startswith(f"__{rank}_") and f.endswith(".distcp"))
        state_bytes = sum(t.numel() * t.element_size() for t in local)
        plain_buf = torch.empty(state_bytes + (64 << 20), dtype=torch.uint8)
        timings: Dict[str, float] = defaultdict(float)
        _install(timings)
        best: Dict[str, float] = {}
        for rep in range(args.repeats):
            timings.clear()
            tdist.barrier()
            t0 = time.perf_counter()
            pos = 0
            mv = memoryview(plain_buf.numpy())
            for f in files:
                with open(os.path.join(d, f), "rb", buffering=0) as fh:
                    n = os.fstat(fh.fileno()).st_size
                    fh.readinto(mv[pos : pos + n])
                    pos += n
            plain = time.perf_counter() - t0
            tdist.barrier()
            prof = None
            if args.profile and rank == 0 and rep == args.repeats - 1:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            request = sd(dst)  # built outside the timing (bench.py times it with the load)
            gc.collect()  # (untimed, as in bench.py: no run pays for collecting what an earlier one left)
            t0 = time.perf_counter()
            ci.load(request, d, **({"load_strategy": args.strategy} if args.strategy else {}))
            total = time.perf_counter() - t0
            if prof is not None:
                prof.disable()
                prof.dump_stats(args.profile)
            tdist.barrier()
            rec = dict(timings, total=total, plain=plain)
            allrec: List[Any] = [None] * world
            tdist.all_gather_object(allrec, rec)
            rec["total_max"] = max(r["total"] for r in allrec)
            if rep == 0:  # the first load of the request checks it; later ones reuse that check
                best["first_total_max"] = rec["total_max"]
            for k, v in rec.items():
                best[k] = min(best.get(k, v), v)
        assert all(torch.equal(a, b) for a, b in zip(local, dst)), "bad load"
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(best, f)
        tdist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
        tdist.destroy_process_group()


def main(argv=None) -> Dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--mib", type=int, default=512, help="state per rank (MiB)")
    p.add_argument("--tensors", type=int, default=32)
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--small", type=int, default=0, metavar="N", help="N tensors of --small-bytes per rank instead")
    p.add_argument("--small-bytes", type=int, default=4096)
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--strategy", default=None, help="load_strategy= (default: the load's default)")
    p.add_argument("--profile", default=None, metavar="OUT", help="cProfile rank 0's last load into OUT")
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    out = tempfile.mktemp(suffix=".json")
    mp.start_processes(_worker, args=(args.ranks, _free_port(), args, out), nprocs=args.ranks, start_method="spawn")
    with open(out) as f:
        best = json.load(f)
    os.unlink(out)
    n = args.small
    print(f"| phase (rank 0, best of {args.repeats}) | seconds |" + (" us/tensor |" if n else ""))
    print("|---|---:|" + ("---:|" if n else ""))
    for k, label in PHASES + [("total", "total `load()`"), ("total_max", "total, slowest rank"),
                              ("first_total_max", "first load (its request checked), slowest rank"), ("plain", "plain read")]:
        v = best.get(k, 0.0)
        print(f"| {label} | {v:.4f} |" + (f" {1e6 * v / n:.1f} |" if n else ""))
    return best


if __name__ == "__main__":
    main()
