#!/usr/bin/env python
"""Incremental saves and the async staging budget, one process, same state, best of ``--repeats``.

State: a fine-tuning job's, ``--frozen-gib`` of frozen fp32 parameters (``requires_grad=False``, 16
tensors) and ``--trained-mib`` of trained parameters with twice that of optimizer state (Adam's two
moments). Rows, every save ``durable`` (fsync) into ``--dir``:

* ``torch.save`` of the whole state (one file), PyTorch DCP ``dcp.save``, our full save (no base);
* our incremental save after one training step (``base=`` the previous checkpoint): seconds, and
  the bytes it wrote, counted from the files (inodes not in the base);
* async saves of the same state: blocked seconds, seconds until committed, and the process's peak
  extra resident memory (sampled from ``/proc/self/status``), unbounded and with
  ``staging_budget=--budget-mib``.

Usage::

    python benchmarks/incremental.py                     # 2 GiB frozen, 32 MiB trained
    python benchmarks/incremental.py --frozen-gib 0.1 --repeats 1   # smoke run
    python benchmarks/incremental.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed.checkpoint as dcp

import ckpt_integration as ci
from ckpt_integration import ShardedTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import _rss_bytes  # noqa: E402

MiB = 1 << 20


def _peak_extra(fn: Callable[[], Any]) -> tuple:
    """``(fn's result, peak extra resident bytes while it ran)``, sampled every millisecond."""
    start, peak, stop = _rss_bytes(), [0], [False]

    def watch() -> None:
        while not stop[0]:
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.001)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    try:
        out = fn()
    finally:
        stop[0] = True
        th.join()
    return out, max(peak[0], _rss_bytes()) - start


def _new_bytes(path: str, base: str) -> int:
    seen = {os.stat(os.path.join(base, n)).st_ino for n in os.listdir(base) if n.endswith(".distcp")}
    return sum(os.stat(os.path.join(path, n)).st_size for n in os.listdir(path)
               if n.endswith(".distcp") and os.stat(os.path.join(path, n)).st_ino not in seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frozen-gib", type=float, default=2.0)
    ap.add_argument("--trained-mib", type=float, default=32.0)
    ap.add_argument("--budget-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory on /tmp)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-incremental-", dir=args.dir)
    g = torch.Generator().manual_seed(0)
    n_frozen = int(args.frozen_gib * 1024 * MiB / 4 / 16)
    frozen = [torch.nn.Parameter(torch.randn(n_frozen, generator=g), requires_grad=False) for _ in range(16)]
    n_trained = int(args.trained_mib * MiB / 4 / 4)
    trained = [torch.nn.Parameter(torch.randn(n_trained, generator=g)) for _ in range(4)]
    moments = [torch.zeros(n_trained) for _ in range(8)]

    def step() -> None:
        with torch.no_grad():
            for t in trained:
                t.add_(0.01)
            for m in moments:
                m.add_(0.001)

    def sharded() -> Dict[str, Any]:
        out = {f"base.{i}": ShardedTensor.from_rank_offsets(f"base.{i}", t) for i, t in enumerate(frozen)}
        out.update({f"adapter.{i}": ShardedTensor.from_rank_offsets(f"adapter.{i}", t) for i, t in enumerate(trained)})
        out.update({f"opt.{i}": ShardedTensor.from_rank_offsets(f"opt.{i}", t) for i, t in enumerate(moments)})
        return out

    def plain() -> Dict[str, torch.Tensor]:
        out = {f"base.{i}": t.detach() for i, t in enumerate(frozen)}
        out.update({f"adapter.{i}": t.detach() for i, t in enumerate(trained)})
        out.update({f"opt.{i}": t for i, t in enumerate(moments)})
        return out

    total = sum(t.numel() * 4 for t in plain().values())
    rows: Dict[str, List[float]] = {}
    written: Dict[str, int] = {}
    counter = [0]

    def fresh(name: str) -> str:
        counter[0] += 1
        return os.path.join(root, f"{name}-{counter[0]}")

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        rows.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    def torch_save() -> None:
        path = fresh("torch") + ".pt"
        with open(path, "wb") as f:
            torch.save(plain(), f)
            f.flush()
            os.fsync(f.fileno())

    for _ in range(args.repeats):
        timed("torch.save (whole state, fsync)", torch_save)
        timed("dcp.save", lambda: dcp.save(plain(), checkpoint_id=fresh("dcp"), no_dist=True))
        base = fresh("full")
        timed("ci.save, full", lambda: ci.save(sharded(), base))
        step()
        inc = fresh("inc")
        timed("ci.save, incremental (base=previous)", lambda: ci.save(sharded(), inc, base=base))
        written["ci.save, incremental (base=previous)"] = _new_bytes(inc, base)
        written["ci.save, full"] = sum(os.path.getsize(os.path.join(base, n)) for n in os.listdir(base)
                                       if n.endswith(".distcp"))
        for p in os.listdir(root):
            shutil.rmtree(os.path.join(root, p), ignore_errors=True) if os.path.isdir(os.path.join(root, p)) \
                else os.remove(os.path.join(root, p))

    asyncs: Dict[str, Dict[str, float]] = {}
    for label, budget in (("async, unbounded", None), (f"async, staging_budget={args.budget_mib} MiB",
                                                       args.budget_mib * MiB)):
        queue = ci.execution.async_save.AsyncCallsQueue()
        best: Dict[str, float] = {}
        for r in range(args.repeats + 1):  # the first call allocates the buffers that later saves reuse
            path = fresh("async")

            def run() -> Any:
                t0 = time.perf_counter()
                req = ci.save(sharded(), path, async_sharded_save=True, async_queue=queue, staging_budget=budget)
                blocked = time.perf_counter() - t0
                req.wait()
                return blocked, time.perf_counter() - t0, req.staging

            (blocked, done, report), extra = _peak_extra(run)
            shutil.rmtree(path, ignore_errors=True)
            if r == 0:
                first_extra = extra
                continue
            for k, v in (("blocked_s", blocked), ("committed_s", done), ("peak_extra_mib", extra / MiB)):
                best[k] = min(best.get(k, v), v)
            best["waves"] = report.waves
        best["first_save_peak_extra_mib"] = first_extra / MiB
        asyncs[label] = best
        queue.close()
    shutil.rmtree(root, ignore_errors=True)

    print(f"state: {total / MiB:.0f} MiB ({args.frozen_gib} GiB frozen, {args.trained_mib} MiB trained + 2x optimizer "
          f"state); best of {args.repeats}; {root}")
    ref = min(rows["torch.save (whole state, fsync)"])
    for name, times in rows.items():
        extra = f", wrote {written[name] / MiB:.1f} MiB" if name in written else ""
        print(f"  {name:40s} {min(times):7.3f} s  ({ref / min(times):5.2f}x torch.save){extra}")
    for label, b in asyncs.items():
        print(f"  {label:40s} blocked {b['blocked_s']:.3f} s, committed after {b['committed_s']:.3f} s, "
              f"{b['waves']} wave(s), peak extra memory {b['peak_extra_mib']:.0f} MiB "
              f"(first save: {b['first_save_peak_extra_mib']:.0f} MiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"state_mib": total / MiB, "saves": {k: min(v) for k, v in rows.items()},
                       "written_mib": {k: v / MiB for k, v in written.items()}, "async": asyncs}, f, indent=1)


if __name__ == "__main__":
    main()
