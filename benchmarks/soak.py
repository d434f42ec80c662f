"""Weeks of saves in minutes: many sync and async saves with top-k retention in one process group.

Each of 2 gloo ranks saves a small sharded state again and again (alternately sync and async,
async ones waited for before the next save), keeps the newest ``top_k`` checkpoints (rank 0
deletes older ones, as ``ModelCheckpoint`` does) and samples, every ``every`` saves: open file
descriptors, threads, the library's private process groups, staging bytes held by the async
queue and RSS. At the end every retained checkpoint is verified (checksums of every byte) and the
directory must hold nothing else (no staging or partial directories).

Reported: the slope of each quantity per 100 saves (least squares over the samples after the
warm-up, the first quarter), per rank. A leak shows as a positive slope; flat is 0.

    python benchmarks/soak.py --saves 1000            # the long mode (docs/benchmarks.md)
    tests/test_soak.py runs the same function with 40 saves and asserts flat counts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ckpt_integration as ci  # noqa: E402


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _staging_bytes() -> int:
    from ckpt_integration.execution.staging import StateDictStager

    import warnings

    with warnings.catch_warnings():  # isinstance() on every object touches deprecated torch names
        warnings.simplefilter("ignore")
        return sum(o.cached_bytes for o in gc.get_objects() if isinstance(o, StateDictStager))


def sample() -> Dict[str, int]:
    """What a leak would grow: fds, threads, private groups, staging bytes, RSS (KiB)."""
    from ckpt_integration.execution import dist as cdist

    gc.collect()
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(),
            "groups": len(cdist._private_groups), "staging": _staging_bytes(), "rss_kib": _rss_kib()}


def slope_per_100(xs: List[int], ys: List[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return 100.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def soak(rank: int, world: int, directory: str, saves: int, top_k: int = 3, every: int = 10,
         numel: int = 1 << 14) -> Dict[str, Any]:
    """The soak on this rank (call on every rank of an initialised gloo group); returns its samples."""
    from ckpt_integration.lightning import DistCkptIO

    remover = DistCkptIO()
    rows = numel // 64
    samples: List[Dict[str, int]] = []
    kept: List[str] = []
    t0 = time.perf_counter()
    for i in range(saves):
        w = torch.full((rows, 64), float(i))
        state = {"w": ci.ShardedTensor.from_rank_offsets("w", w[rank * rows // world:(rank + 1) * rows // world],
                                                         (0, rank, world)),
                 "b": ci.ShardedTensor.from_rank_offsets("b", torch.arange(16.0) + i, replica_id=rank),
                 "step": i}
        path = os.path.join(directory, f"step={i:06d}")
        if i % 2:
            ci.save(state, path, async_sharded_save=True).wait()
        else:
            ci.save(state, path)
        kept.append(path)
        while len(kept) > top_k:  # the library's own top-k deletion (DistCkptIO.remove_checkpoint)
            old = kept.pop(0)
            if rank == 0:
                remover.remove_checkpoint(old)
        dist.barrier()
        if i % every == 0 or i == saves - 1:
            samples.append({"save": i, **sample()})
    elapsed = time.perf_counter() - t0
    # every retained checkpoint verifies; nothing else is left in the directory
    for path in kept:
        i = int(path.rsplit("=", 1)[1])
        got = ci.load_plain_tensors(path)
        assert torch.equal(got["w"], torch.full((rows, 64), float(i))) and torch.equal(got["b"], torch.arange(16.0) + i), path
    dist.barrier()
    left = sorted(os.listdir(directory))
    assert left == sorted(os.path.basename(p) for p in kept), left
    return {"rank": rank, "samples": samples, "seconds": elapsed, "left": left}


def slopes(result: Dict[str, Any]) -> Dict[str, float]:
    s = result["samples"]
    warm = s[len(s) // 4:]
    xs = [r["save"] for r in warm]
    return {k: slope_per_100(xs, [r[k] for r in warm]) for k in ("fds", "threads", "groups", "staging", "rss_kib")}


def _rank(rank: int, world: int, port: int, directory: str, saves: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = soak(rank, world, directory, saves)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=1000)
    ap.add_argument("--json", help="write the samples and slopes here")
    args = ap.parse_args()
    from bench_util import _free_port as free_port  # type: ignore[import-not-found]

    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix="soak-")
    try:
        directory, out = os.path.join(tmp, "ck"), os.path.join(tmp, "out")
        os.makedirs(directory)
        mp.spawn(_rank, args=(2, free_port(), directory, args.saves, out), nprocs=2)
        results = [json.load(open(f"{out}.{r}")) for r in range(2)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report = {"saves": args.saves, "ranks": 2, "per_rank": []}
    for res in results:
        first, last = res["samples"][len(res["samples"]) // 4], res["samples"][-1]
        report["per_rank"].append({"rank": res["rank"], "seconds": round(res["seconds"], 1), "slope_per_100_saves": {
            k: round(v, 3) for k, v in slopes(res).items()}, "after_warmup": first, "end": last})
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report, "samples": [r["samples"] for r in results]}, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
