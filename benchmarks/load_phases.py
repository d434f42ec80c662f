#!/usr/bin/env python
"""Where a load's time goes: each phase of ``load()`` timed on every rank.

Two (``--ranks``) gloo ranks save a sharded state, then load it ``--repeats`` times in the
same layout (or resharded: ``--layout row_to_col``, saved by rows and loaded by columns, or
``col_to_row``); the load's steps are wrapped with timers (metadata broadcast, common state,
request validation exchange, read plan, read-once decision, reads, final error agreement),
the load's own statistics are shown beside them (reads, checks, copies, mapping), and, between
the same barriers, each rank reads its own data files with plain ``readinto`` (no parsing, no
checks) and again hashing each 1 MiB right after it is read (the least a checked load can
take). A column per rank: best of the repeated loads per phase, and the first load (which
checks the request) apart.

    python benchmarks/load_phases.py --mib 512 --tensors 32 --dir /dev/shm --repeats 5
    python benchmarks/load_phases.py --small 10000 --dir /dev/shm --repeats 5      # 4 KiB tensors
    python benchmarks/load_phases.py --small 10000 --profile prof.out             # cProfile of rank 0's last load
    python benchmarks/load_phases.py --layout row_to_col --repeats 5              # a resharded (read-once) load
    python benchmarks/load_phases.py --layout col_to_row --repeats 5              # strided destinations
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import time
from collections import defaultdict
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import (  # noqa: E402
    add_state_args, keep_best, print_phase_table, run_ranks, start_rank, timed, with_slowest, write_per_rank,
)

PHASES = [
    ("read_shared", "metadata: one reader, one broadcast (`open_shared`)"),
    ("load_common", "common state (`load_common`)"),
    ("shards", "request cut into shards (`local_shards`)"),
    ("check_start", "request check: failures, reuse and whole chunks agreed (`exchange.start_load`)"),
    ("whole", "request check by counting whole saved chunks (`exchange.check_whole_chunks`)"),
    ("validation", "request validation exchange (`exchange.run`)"),
    ("prepare", "read plan (`_prepare_reads`)"),
    ("read_once", "read-once decision (`load_read_once`)"),
    ("read_all", "reads + checks (`read_all`)"),
    ("agree", "error agreements (`agree_on_errors`)"),
    ("split", "state dict split (`split_state_dict`)"),
    ("route", "request records built and routed (`build_routes`)"),
    ("metadata_for", "metadata of the requested keys (`metadata_for`)"),
    ("finish", "results assembled (`finish`)"),
]
# the load's own statistics (``last_load_stats``: seconds per step, summed over its threads; the
# plan and mapping only in read-once loads)
LOAD_STATS = {"plan_s": "stats: read-once decision and plan", "map_s": "stats: mapping and unmapping units (read-once)",
            "read_s": "stats: storage reads", "crc_s": "stats: checks", "copy_s": "stats: copies out",
            "exchange_s": "stats: waiting for exchanges (read-once)"}


def _install(timings: Dict[str, float]) -> None:
    from ckpt_integration.execution import dist as dist_mod
    from ckpt_integration.execution import exchange as exchange_mod
    from ckpt_integration.execution import load as load_mod
    from ckpt_integration.execution import shared_metadata as shared_mod
    from ckpt_integration.storage import checkpoint_dir as ckdir

    from ckpt_integration import serialization as ser_mod

    # the entry point opens the checkpoint once for the job (coordinator reads, one broadcast)
    ser_mod.open_shared = timed(timings, "read_shared", ser_mod.open_shared)
    ckdir.load_common = timed(timings, "load_common", ckdir.load_common)
    exchange_mod.run = timed(timings, "validation", exchange_mod.run)
    exchange_mod.start_load = timed(timings, "check_start", exchange_mod.start_load)
    exchange_mod.check_whole_chunks = timed(timings, "whole", exchange_mod.check_whole_chunks)
    load_mod.local_shards = timed(timings, "shards", load_mod.local_shards)
    load_mod._prepare_reads = timed(timings, "prepare", load_mod._prepare_reads)
    load_mod.load_read_once = timed(timings, "read_once", load_mod.load_read_once)
    load_mod._LoadJob.read_all = timed(timings, "read_all", load_mod._LoadJob.read_all)
    dist_mod.agree_on_errors = timed(timings, "agree", dist_mod.agree_on_errors)
    load_mod.split_state_dict = timed(timings, "split", load_mod.split_state_dict)
    exchange_mod.build_routes = timed(timings, "route", exchange_mod.build_routes)
    shared_mod.SharedMetadata.metadata_for = timed(timings, "metadata_for", shared_mod.SharedMetadata.metadata_for)
    load_mod._LoadJob.finish = timed(timings, "finish", load_mod._LoadJob.finish)


def _plain_checked_read(paths: List[str], mv: memoryview) -> float:
    """Seconds to read ``paths`` into ``mv`` in 2 MiB pieces, each 1 MiB hashed (XXH3-64) right
    after its piece is read: the least a load that checks every byte can take (no parsing, no
    planning, the blocks not even those the files record)."""
    import xxhash

    digest, piece, block = xxhash.xxh3_64_intdigest, 2 << 20, 1 << 20
    t0 = time.perf_counter()
    pos = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            n = os.fstat(fd).st_size
            for i in range(0, n, piece):
                view = mv[pos + i : pos + min(n, i + piece)]
                os.preadv(fd, [view], i)
                for j in range(0, len(view), block):
                    digest(view[j : j + block])
            pos += n
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    local = start_rank(rank, world, port, args)  # (a gloo rank on one node, and its state)
    import torch
    import torch.distributed as tdist

    import ckpt_integration as ci
    from ckpt_integration import ShardedTensor
    from ckpt_integration.execution import load as load_mod

    d = os.path.join(args.dir, f"ckpt_phases_{port}")
    try:
        axis = 1 if args.layout == "col_to_row" else 0  # the saved split
        sd = lambda ts: {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", t, (axis, rank, world)) for i, t in enumerate(ts)}  # noqa: E731
        if args.layout == "col_to_row":  # saved split by columns, loaded split by rows (strided destinations)
            (R, C), W = local[0].shape, world
            r0, rr = rank * (R // W), (R - (W - 1) * (R // W)) if rank == W - 1 else R // W
            dst = [torch.zeros(rr, W * C) for _ in local]
            request_of = lambda ts: {f"t{i}": ShardedTensor.from_global_offsets(f"t{i}", t, (R, W * C), (r0, 0))  # noqa: E731
                                     for i, t in enumerate(ts)}
        elif args.layout == "row_to_col":  # saved split by rows, loaded split by columns (a read-once load)
            (R, C), G = local[0].shape, world * local[0].shape[0]
            c0, cw = rank * (C // world), (C - (world - 1) * (C // world)) if rank == world - 1 else C // world
            dst = [torch.zeros(G, cw) for _ in local]
            request_of = lambda ts: {f"t{i}": ShardedTensor.from_global_offsets(f"t{i}", t, (G, C), (0, c0))  # noqa: E731
                                     for i, t in enumerate(ts)}
        else:
            dst = [torch.zeros_like(t) for t in local]
            request_of = sd
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
            plain_checked = _plain_checked_read([os.path.join(d, f) for f in files], mv)
            tdist.barrier()
            request = request_of(dst)  # built outside the timing (bench.py times it with the load)
            gc.collect()  # (untimed, as in bench.py: no run pays for collecting what an earlier one left)
            prof = None
            if args.profile and rank == 0 and rep == args.repeats - 1:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            t0 = time.perf_counter()
            ci.load(request, d, **({"load_strategy": args.strategy} if args.strategy else {}),
                    **({"strict": args.strict} if args.strict else {}))
            total = time.perf_counter() - t0
            if prof is not None:
                prof.disable()
                prof.dump_stats(args.profile)
            tdist.barrier()
            stats = {f"ro_{k}": v for k, v in load_mod.last_load_stats.items() if k in LOAD_STATS}
            rec = with_slowest(dict(timings, **stats, total=total, plain=plain, plain_checked=plain_checked), world)
            if rep == 0:  # the first load of the request checks it (later ones reuse that check): apart
                first = rec
                if args.repeats > 1:
                    continue
            keep_best(best, rec)
        best["first"] = first
        if args.layout == "col_to_row":
            assert all(torch.equal(d_[:, rank * C : (rank + 1) * C], t[r0 : r0 + rr]) for d_, t in zip(dst, local)), "bad load"
        elif args.layout == "row_to_col":
            assert all(torch.equal(d_[rank * R : (rank + 1) * R], t[:, c0 : c0 + cw]) for d_, t in zip(dst, local)), "bad load"
        else:
            assert all(torch.equal(a, b) for a, b in zip(local, dst)), "bad load"
        write_per_rank(best, world, rank, out_path)
    finally:
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
        tdist.destroy_process_group()


def main(argv=None) -> List[Dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_state_args(p)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--strategy", default=None, help="load_strategy= (default: the load's default)")
    p.add_argument("--strict", default=None, help="strict= (e.g. return_all, as Lightning's resume loads)")
    p.add_argument("--layout", default="same", choices=("same", "row_to_col", "col_to_row"),
                   help="row_to_col: the row-split save loaded split by columns (a read-once load); "
                        "col_to_row: a column-split save loaded split by rows")
    p.add_argument("--profile", default=None, metavar="OUT", help="cProfile rank 0's last load into OUT")
    args = p.parse_args(argv)
    per_rank = run_ranks(_worker, args)
    again = max(args.repeats - 1, 1)
    cols = [(f"rank {r}", b) for r, b in enumerate(per_rank)] + [(f"first, rank {r}", b["first"]) for r, b in enumerate(per_rank)]
    print_phase_table(f"phase ({{unit}}: best of {again} repeated loads; the first load, which checks the request)", cols,
                      PHASES + [(f"ro_{k}", v) for k, v in LOAD_STATS.items()] + [("total", "total `load()`"), ("total_max", "total, slowest rank"), ("plain", "plain read"),
                   ("plain_checked", "plain read, each 1 MiB hashed after its 2 MiB piece (the floor with checks)")],
                      args.small)
    return per_rank


if __name__ == "__main__":
    main()
