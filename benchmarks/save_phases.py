#!/usr/bin/env python
"""Where a save's time goes: each phase of ``save()`` timed on every rank.

``--ranks`` gloo ranks save the same state ``--repeats`` times, each into a new directory; the
save's steps are wrapped with timers: the state dict split, the routing of the shard records,
the plan agreement (``exchange.start``; the full exchange ``exchange.run`` only when the plan
is not reused: the first save of a structure), the common-state check, the write requests, the
data file writes, and the finalize step (rank 0 gathers what every rank wrote and commits:
``.metadata``, the chunk index, the manifest; the others wait for it). Best of ``--repeats`` per
phase and rank, after one untimed collection per save (as ``bench.py``); the first save (its
plan exchanged) is reported apart.

    python benchmarks/save_phases.py --small 10000 --dir /dev/shm --repeats 7     # 4 KiB tensors
    python benchmarks/save_phases.py --mib 512 --tensors 32 --dir /dev/shm --repeats 3
    python benchmarks/save_phases.py --small 10000 --profile prof.out             # cProfile of rank 0's last save
"""

from __future__ import annotations

import argparse
import dataclasses
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
    ("split", "state dict split (`split_state_dict`)"),
    ("route", "shard records built and routed (`build_routes`)"),
    ("plan_start", "plan agreed or reused (`exchange.start`)"),
    ("plan_run", "plan exchanged (`exchange.run`)"),
    ("common", "common state compared (`check_common_consistency`)"),
    ("requests", "write requests (`_requests_for`)"),
    ("prepare", "all of phase 1 (`prepare_save`)"),
    ("write", "data files written (`write`)"),
    ("commit", "commit, rank 0 (`commit`)"),
    ("finalize", "finalize: gather + commit + agreement (`finalize_save`)"),
]


def _install(timings: Dict[str, float]) -> None:
    from ckpt_integration.execution import exchange as exchange_mod
    from ckpt_integration.execution import save as save_mod

    for mod, attr, name in [(save_mod, "split_state_dict", "split"), (exchange_mod, "build_routes", "route"),
                            (exchange_mod, "start", "plan_start"), (exchange_mod, "run", "plan_run"),
                            (save_mod, "check_common_consistency", "common"), (save_mod, "_requests_for", "requests"),
                            (save_mod, "prepare_save", "prepare"), (save_mod, "finalize_save", "finalize")]:
        setattr(mod, attr, timed(timings, name, getattr(mod, attr)))
    be = save_mod.SAVE_BACKENDS["torch_dist"]  # (its functions are held by the backend record)
    save_mod.SAVE_BACKENDS["torch_dist"] = dataclasses.replace(
        be, write=timed(timings, "write", be.write), commit=timed(timings, "commit", be.commit))


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    local = start_rank(rank, world, port, args)  # (a gloo rank on one node, and its state)
    import torch.distributed as tdist

    import ckpt_integration as ci
    from ckpt_integration import ShardedTensor

    root = os.path.join(args.dir, f"ckpt_save_phases_{port}")
    try:
        sd = lambda: {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", t, (0, rank, world)) for i, t in enumerate(local)}  # noqa: E731
        timings: Dict[str, float] = defaultdict(float)
        _install(timings)
        best: Dict[str, float] = {}
        for rep in range(args.repeats):
            d = os.path.join(root, str(rep))
            request = sd()  # built outside the timing (bench.py times it with the save)
            gc.collect()
            timings.clear()
            tdist.barrier()
            prof = None
            if args.profile and rank == 0 and rep == args.repeats - 1:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            t0 = time.perf_counter()
            ci.save(request, d)
            total = time.perf_counter() - t0
            if prof is not None:
                prof.disable()
                prof.dump_stats(args.profile)
            tdist.barrier()
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
            rec = with_slowest(dict(timings, total=total), world)
            if rep == 0:  # the first save of a structure exchanges its plan; later ones reuse it: apart
                first = rec
                continue
            keep_best(best, rec)
        best["first"] = first
        write_per_rank(best, world, rank, out_path)
    finally:
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        tdist.destroy_process_group()


def main(argv=None) -> List[Dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_state_args(p)
    p.add_argument("--repeats", type=int, default=5, help="saves (the first, whose plan is exchanged, reported apart)")
    p.add_argument("--profile", default=None, metavar="OUT", help="cProfile rank 0's last save into OUT")
    args = p.parse_args(argv)
    if args.repeats < 2:
        p.error("--repeats must be at least 2 (the first save is reported apart)")
    per_rank = run_ranks(_worker, args)
    rows = PHASES + [("total", "total `save()`"), ("total_max", "total, slowest rank")]
    cols = [(f"rank {r}", b) for r, b in enumerate(per_rank)] + [(f"first, rank {r}", b["first"]) for r, b in enumerate(per_rank)]
    print_phase_table(f"phase ({{unit}}: best of {args.repeats - 1} repeated saves; the first save, whose plan is "
                      "exchanged)", cols, rows, args.small)
    return per_rank


if __name__ == "__main__":
    main()
