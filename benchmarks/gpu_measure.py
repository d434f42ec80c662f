"""Measuring one phase of benchmarks/gpu_bench.py: the per-rank state (GpuCtx), ``measure`` (bench.py's
``_measure`` with the device synchronized in the timed region and host/device memory peaks) and the
async-series aggregation."""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import _async_result, _measure  # noqa: E402
from bench_report import _fmt  # noqa: E402
from bench_util import _peak_bytes, _reset_peak, _rss_bytes, all_gather  # noqa: E402

GiB = 1 << 30
CHUNK = 64 << 20  # bounce buffer of the plain I/O limit
DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


# --------------------------------------------------------------------------- state
_BOUNCE: List[Any] = []


def _bounce_buffers() -> List[Any]:
    """Two pinned host buffers of the plain I/O limit, allocated once per process."""
    import torch

    if not _BOUNCE:
        _BOUNCE.extend(torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    return _BOUNCE


class GpuCtx:
    """One rank's state: ``n`` tensors (rows, cols) on ``device``, dtypes in turn; what
    ``bench._measure`` / ``bench._async_result`` need (world, state_bytes, results)."""

    def __init__(self, rank: int, world: int, args: argparse.Namespace):
        import torch

        self.rank, self.world, self.args = rank, world, args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.n, self.cols = args.tensors, args.cols
        self.dtypes = [getattr(torch, DTYPES[args.dtypes[i % len(args.dtypes)]]) for i in range(self.n)]
        row_bytes = self.cols * sum(torch.empty((), dtype=d).element_size() for d in self.dtypes)
        self.rows = max(2, int(args.gib_per_rank * GiB) // row_bytes)
        self.rows -= self.rows % 2
        g = torch.Generator(device=self.device).manual_seed(1234 + rank)
        self.local = [torch.rand(self.rows, self.cols, generator=g, device=self.device).to(d) for d in self.dtypes]
        self.state_bytes = sum(t.numel() * t.element_size() for t in self.local)
        self.dst = [torch.zeros_like(t) for t in self.local]
        self.results: Dict[str, Dict[str, Any]] = {}
        self.bounce = _bounce_buffers() if self.cuda else []
        self.target = ""
        self.quiet = False  # warm-up: no progress lines
        self.on_result: Optional[Callable[[], None]] = None  # after every phase (partial results)
        self.t_start = time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def ours_sd(self, tensors, axis: int = 0) -> Dict[str, Any]:
        from ckpt_integration import ShardedTensor

        return {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", t, (axis, self.rank, self.world))
                for i, t in enumerate(tensors)}

    def check(self, got: List[Any], want: Optional[List[Any]] = None, what: str = "") -> None:
        import torch

        want = self.local if want is None else want
        for a, b in ((got[0], want[0]), (got[-1], want[-1])):
            assert a.device.type == b.device.type, f"{what}: loaded onto {a.device}, expected {b.device}"
            assert torch.equal(a, b), f"{what}: bad data read back on rank {self.rank}"


# --------------------------------------------------------------------------- measuring
def measure(ctx: GpuCtx, name: str, fn: Callable[[], Any], setup: Optional[Callable[[], Any]] = None,
            load: bool = False, check: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
    """``bench._measure`` with the device synchronized inside the timed region, plus host and
    device memory peaks (max over repeats and ranks); ``check`` runs once after the repeats."""
    import torch

    peaks = [0, 0]
    dev0 = [0]

    def dev_setup():
        if setup is not None:
            setup()
        if ctx.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            dev0[0] = torch.cuda.memory_allocated()

    def timed():
        rss0 = _rss_bytes()  # bench._measure reset VmHWM just before
        fn()
        ctx.sync()
        peaks[0] = max(peaks[0], _peak_bytes() - rss0)
        if ctx.cuda:
            peaks[1] = max(peaks[1], torch.cuda.max_memory_allocated() - dev0[0])

    best = _measure(ctx, name, timed, setup=dev_setup, repeats=ctx.args.repeats, load=load)
    allp: List[List[int]] = all_gather(peaks)
    _add_peaks(ctx, best, max(p[0] for p in allp), max(p[1] for p in allp))
    if check is not None:
        check()
    _progress(ctx, name, best)
    return best


def _add_peaks(ctx: GpuCtx, rec: Dict[str, Any], host: int, dev: int) -> None:
    rec["host_extra_gib"] = host / GiB
    rec["host_overhead"] = host / ctx.state_bytes
    rec["dev_extra_gib"] = dev / GiB if ctx.cuda else None
    rec["dev_overhead"] = dev / ctx.state_bytes if ctx.cuda else None


def _progress(ctx: GpuCtx, name: str, r: Dict[str, Any]) -> None:
    if ctx.on_result is not None:
        ctx.on_result()
    if ctx.rank == 0 and not ctx.quiet:
        extra = f" blocking {r['blocking_s']:.3f}s staged {r.get('staged_s', 0):.3f}s" if "blocking_s" in r else ""
        print(f"  [{os.path.basename(ctx.target.rstrip('/')) or ctx.target} +{time.perf_counter() - ctx.t_start:6.1f}s] "
              f"{name:<24} {r['seconds']:8.3f}s {r['gib_s']:8.2f} GiB/s  host +{r['host_overhead']:.2f}"
              f"  dev {_fmt(r['dev_overhead'], '+{:.2f}')}{extra}", flush=True)


@contextlib.contextmanager
def _host_and_device_peaks(ctx: GpuCtx, out: List[int]):
    """Peak extra host RSS and device memory over a block (async saves: the whole series)."""
    import torch

    ctx.sync()
    have = _reset_peak()
    rss0 = _rss_bytes()
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
        d0 = torch.cuda.memory_allocated()
    yield
    ctx.sync()
    out[0] = (_peak_bytes() - rss0) if have else 0
    out[1] = (torch.cuda.max_memory_allocated() - d0) if ctx.cuda else 0


def _async_done(ctx: GpuCtx, name: str, blocking, staged, total, peaks: List[int], **more) -> None:
    """``bench._async_result`` (blocking/total, 2nd save on, slowest rank) plus the time until the
    snapshot was taken and the memory peaks over the series."""
    import statistics


    _async_result(ctx, name, blocking, total, **more)
    allrec: List[Any] = all_gather({"staged": staged, "peaks": peaks})
    steady = range(1, len(staged)) if len(staged) > 1 else range(1)
    rec = ctx.results[name]
    rec["staged_s"] = statistics.mean(max(r["staged"][i] for r in allrec) for i in steady)
    _add_peaks(ctx, rec, max(r["peaks"][0] for r in allrec), max(r["peaks"][1] for r in allrec))
    _progress(ctx, name, rec)


def _zero(tensors) -> None:
    for t in tensors:
        t.zero_()


def _col_slices(ctx: GpuCtx, cols):
    """(loaded, expected) pairs of a row->col load: this rank's rows of its column slice."""
    R, c0, cw = ctx.rows, ctx.rank * (ctx.cols // ctx.world), ctx.cols // ctx.world
    return [(cols[i][ctx.rank * R:(ctx.rank + 1) * R], ctx.local[i][:, c0:c0 + cw]) for i in (0, ctx.n - 1)]
