#!/usr/bin/env python
"""GPU checkpoint benchmark: the table of ``bench.py`` with CUDA-resident state.

Every rank owns ``--gib-per-rank`` of tensors on the GPU (``--tensors`` tensors of
``rows x --cols``, dtypes taken in turn from ``--dtypes``: bf16 and fp32 by default, as
mixed-precision training holds them), row-sharded. ``--ranks`` processes (2 by default)
share the one GPU over gloo (NCCL refuses two ranks on one device). One run measures, per
target directory (``--dir``, default ``/dev/shm``, and ``--disk-dir``):

* ``plain write`` / ``plain read``: the physical limit for the same bytes. Write: device->host
  copies into two pinned 64 MiB bounce buffers, each written (unbuffered) while the next copy
  runs, then fsync; read: ``readinto`` the bounce buffers, each copied to the device while the
  next is read;
* ``torch.save`` / ``torch.load`` per rank, as users call them (``torch.load`` restores the
  tensors to the GPU: new device tensors);
* PyTorch DCP ``save`` / ``load`` (DTensors on a CUDA mesh, defaults), ``load row->col``
  (saved split by rows, loaded split by columns) and ``async_save`` with DCP's pinned-memory
  stager (``DefaultStager(StagingOptions(...))`` with async staging where torch has it, one
  reused for every save; torch 2.11's cannot be reused (pytorch/pytorch#183413): there a new one
  per save, as its users must; the stager that ran is printed);
* Megatron-Core ``dist_checkpointing.save`` / ``load`` with the ``torch_dist`` strategy in the
  fully-parallel wrappers (``FullyParallelSaveStrategyWrapper`` /
  ``FullyParallelLoadStrategyWrapper`` over the data-parallel group, here all ranks), as
  Megatron-LM runs them with ``--ckpt-fully-parallel-save/load``, and its ``row->col`` load;
* ours: ``save``, ``load`` into the GPU tensors (same layout; also without CRC checks),
  ``row->col`` and ``ws change`` (each rank loads its rows as two shards, as twice the ranks
  would), and async save (blocking = how long the call stalls the training loop, averaged from
  the 2nd save on; ``staged`` = until the snapshot is taken and the tensors may change).

An untimed pass of every phase on a tiny state comes first (imports, thread pools, first
pinned allocations). Each phase ends with ``torch.cuda.synchronize()`` inside the timed region.
Time = slowest rank between barriers, best of ``--repeats``; GiB/s = whole state / time. Memory, as the extra over
the phase relative to a rank's state (max over ranks and repeats): ``host +`` = peak RSS
(VmHWM, reset before the phase) minus the RSS at its start; ``dev +`` = peak allocated device
memory (``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``) minus the memory
allocated at its start. Every phase checks the first and last tensor it loaded with
``torch.equal``. A line per phase is printed as it completes (a run cut short keeps them); a
method that fails (or is not installed) is reported and the others still run.

Helpers: ``gpu_measure.py`` (state, measuring), ``gpu_peers.py`` (torch.save, DCP, Megatron-Core);
``bench.py`` / ``bench_report.py`` / ``bench_util.py`` as for the CPU benchmark.
``benchmarks/gpu_run.sh`` runs this (tmpfs and disk) with the CUDA tests on a GPU machine.

``--device cpu`` runs the same on CPU tensors (a smoke run on a machine without a GPU).

Usage::

    python benchmarks/gpu_bench.py --gib-per-rank 4 --disk-dir /var/tmp/gb --json gpu.json
    python benchmarks/gpu_bench.py --device cpu --gib-per-rank 0.05 --repeats 1   # smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import _barrier, _fresh  # noqa: E402
from bench_report import _fmt, format_load_details  # noqa: E402
from bench_util import _drop_cache, _free_port, _is_tmpfs, all_gather  # noqa: E402
from gpu_measure import CHUNK, DTYPES, GiB, GpuCtx, _async_done, _col_slices, _host_and_device_peaks, _zero, measure  # noqa: E402
from gpu_peers import run_dcp, run_megatron, run_torch_save  # noqa: E402


# --------------------------------------------------------------------------- phases
def _plain(ctx: GpuCtx, root: str, cache: Callable[[str], None]) -> None:
    import torch

    d = os.path.join(root, "plain")
    _fresh(d, ctx.rank)
    path = os.path.join(d, f"rank{ctx.rank}.bin")
    flat = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731  (the bytes of any dtype)

    def write():
        with open(path, "wb", buffering=0) as f:
            if not ctx.cuda:
                for t in ctx.local:
                    _write_all(f, memoryview(flat(t).numpy()))
            else:
                _pipelined_d2h_write(ctx, f, [flat(t) for t in ctx.local])
            os.fsync(f.fileno())

    def read():
        with open(path, "rb", buffering=0) as f:
            if not ctx.cuda:
                for t in ctx.dst:
                    _readinto_all(f, memoryview(flat(t).numpy()))
            else:
                _pipelined_read_h2d(ctx, f, [flat(t) for t in ctx.dst])

    measure(ctx, "plain_write", write)
    measure(ctx, "plain_read", read, setup=lambda: (_zero(ctx.dst), cache(d)), check=lambda: ctx.check(ctx.dst, what="plain read"))
    _fresh(d, ctx.rank)


def _write_all(f, mv: memoryview) -> None:
    while len(mv):
        n = f.write(mv)
        mv = mv[n:]


def _readinto_all(f, mv: memoryview) -> None:
    while len(mv):
        n = f.readinto(mv)
        if not n:
            raise EOFError("short read")
        mv = mv[n:]


def _pipelined_d2h_write(ctx: GpuCtx, f, flats) -> None:
    """Device->pinned copy of chunk i+1 runs while chunk i is written."""
    import torch

    ev = [torch.cuda.Event(), torch.cuda.Event()]
    pending = None
    k = 0
    for src in flats:
        for off in range(0, src.numel(), CHUNK):
            n = min(CHUNK, src.numel() - off)
            ctx.bounce[k][:n].copy_(src[off:off + n], non_blocking=True)
            ev[k].record()
            if pending is not None:
                ev[pending[0]].synchronize()
                _write_all(f, memoryview(ctx.bounce[pending[0]][:pending[1]].numpy()))
            pending, k = (k, n), k ^ 1
    if pending is not None:
        ev[pending[0]].synchronize()
        _write_all(f, memoryview(ctx.bounce[pending[0]][:pending[1]].numpy()))


def _pipelined_read_h2d(ctx: GpuCtx, f, flats) -> None:
    """Chunk i+1 is read while chunk i is copied to the device."""
    import torch

    ev = [torch.cuda.Event(), torch.cuda.Event()]
    used = [False, False]
    k = 0
    for dst in flats:
        for off in range(0, dst.numel(), CHUNK):
            n = min(CHUNK, dst.numel() - off)
            if used[k]:
                ev[k].synchronize()  # its previous host->device copy is done
            _readinto_all(f, memoryview(ctx.bounce[k][:n].numpy()))
            dst[off:off + n].copy_(ctx.bounce[k][:n], non_blocking=True)
            ev[k].record()
            used[k], k = True, k ^ 1


def _ours_same(ctx: GpuCtx, root: str, cache: Callable[[str], None]) -> None:
    """Our save and same-layout loads; the checkpoint stays for :func:`_ours_resharded`."""
    import ckpt_integration as ci

    args, rank = ctx.args, ctx.rank
    threads = args.threads or None  # None: the library's default, as users get it
    d = os.path.join(root, "ours")
    measure(ctx, "ours_save", lambda: ci.save(ctx.ours_sd(ctx.local), d, thread_count=threads), setup=lambda: _fresh(d, rank))
    measure(ctx, "ours_load", lambda: ci.load(ctx.ours_sd(ctx.dst), d, thread_count=threads),
            setup=lambda: (_zero(ctx.dst), cache(d)), load=True, check=lambda: ctx.check(ctx.dst, what="ours load"))
    if not args.skip_noverify:
        measure(ctx, "ours_load_noverify", lambda: ci.load(ctx.ours_sd(ctx.dst), d, thread_count=threads, verify_checksums=False),
                setup=lambda: (_zero(ctx.dst), cache(d)), load=True, check=lambda: ctx.check(ctx.dst, what="ours load (no CRC)"))


def _ours_resharded(ctx: GpuCtx, root: str, cache: Callable[[str], None]) -> None:
    """row->col and world-size change from the checkpoint of :func:`_ours_same`, into device tensors."""
    import torch

    import ckpt_integration as ci
    from ckpt_integration import ShardedTensor

    args, rank, W = ctx.args, ctx.rank, ctx.world
    threads = args.threads or None
    d = os.path.join(root, "ours")
    if not os.path.isdir(d):
        raise RuntimeError("our save failed: nothing to load resharded")
    cols = [torch.zeros(W * ctx.rows, ctx.cols // W, dtype=t.dtype, device=ctx.device) for t in ctx.local]
    want = _col_slices(ctx, cols)
    measure(ctx, "ours_load_row_to_col", lambda: ci.load(ctx.ours_sd(cols, axis=1), d, thread_count=threads),
            setup=lambda: (_zero(cols), cache(d)), load=True,
            check=lambda: ctx.check([c[0] for c in want], [c[1] for c in want], "ours row->col"))
    del cols, want
    # world-size change: each rank's rows as two shards (what twice the ranks would each load)
    R, h, G = ctx.rows, ctx.rows // 2, W * ctx.rows
    halves = [(torch.zeros(h, ctx.cols, dtype=t.dtype, device=ctx.device), torch.zeros(R - h, ctx.cols, dtype=t.dtype, device=ctx.device))
              for t in ctx.local]

    def ws_sd():
        return {f"t{i}_{j}": ShardedTensor.from_global_offsets(f"t{i}", hv[j], (G, ctx.cols), (rank * R + j * h, 0))
                for i, hv in enumerate(halves) for j in (0, 1)}

    measure(ctx, "ours_load_ws_change", lambda: ci.load(ws_sd(), d, thread_count=threads),
            setup=lambda: (_zero([t for hv in halves for t in hv]), cache(d)), load=True,
            check=lambda: ctx.check([torch.cat(halves[0]), torch.cat(halves[-1])], what="ours ws change"))
    del halves
    _fresh(d, rank)


def _ours_async(ctx: GpuCtx, root: str, info: Dict[str, Any]) -> None:
    """Async saves in a row: call time, time to the snapshot, total; the last one checked."""
    import torch

    import ckpt_integration as ci
    from ckpt_integration import ShardedTensor
    from ckpt_integration.execution.async_save import AsyncCallsQueue

    args, rank, W = ctx.args, ctx.rank, ctx.world
    threads = args.threads or None
    blocking, staged, total, stage, prepare, peaks = [], [], [], [], [], [0, 0]
    last = None
    with _host_and_device_peaks(ctx, peaks), AsyncCallsQueue() as q:
        for i in range(args.async_saves):
            di = os.path.join(root, f"ours_async{i}")
            _fresh(di, rank)
            t0 = time.perf_counter()
            req = ci.save(ctx.ours_sd(ctx.local), di, async_sharded_save=True, async_queue=q, thread_count=threads)
            blocking.append(time.perf_counter() - t0)
            req.wait_for_snapshot()
            staged.append(time.perf_counter() - t0)
            stage.append(req.timings["stage"])
            prepare.append(req.timings["prepare"])
            while not req.is_done():
                time.sleep(0.002)
            total.append(time.perf_counter() - t0)
            req.wait()
            _barrier()
            if rank == 0 and last is not None:
                shutil.rmtree(last, ignore_errors=True)
            last = di
        allocs = q.stagers[0].stats.allocations
        info["ours_stager"] = f"StateDictStager(pin_memory={q.stagers[0].pin_memory})"
    _async_done(ctx, "ours_async_save", blocking, staged, total, peaks, stage=stage, prepare=prepare, allocations=allocs)
    part = [torch.zeros_like(ctx.local[0]), torch.zeros_like(ctx.local[-1])]
    ci.load({"t0": ShardedTensor.from_rank_offsets("t0", part[0], (0, rank, W)),
             f"t{ctx.n - 1}": ShardedTensor.from_rank_offsets(f"t{ctx.n - 1}", part[1], (0, rank, W))}, last)
    ctx.check(part, what="ours async save")
    _barrier()
    if rank == 0:
        shutil.rmtree(last, ignore_errors=True)


def _run_target(ctx: GpuCtx, root: str, is_tmpfs: bool, info: Dict[str, Any]) -> Dict[str, Any]:

    args = ctx.args
    ctx.results = {}
    cache = (lambda d: None) if is_tmpfs else _drop_cache
    steps = [("plain", lambda: _plain(ctx, root, cache))]
    if not args.skip_torch_save:
        steps.append(("torch.save", lambda: run_torch_save(ctx, root, cache)))
    if not args.skip_dcp:
        steps.append(("DCP", lambda: run_dcp(ctx, root, cache, info)))
    if not args.skip_megatron:
        steps.append(("Megatron-Core", lambda: run_megatron(ctx, root, cache, info)))
    steps.append(("ours save/load", lambda: _ours_same(ctx, root, cache)))
    steps.append(("ours resharded", lambda: _ours_resharded(ctx, root, cache)))
    if not args.skip_async:
        steps.append(("ours async", lambda: _ours_async(ctx, root, info)))
    for label, step in steps:
        why = None
        try:
            step()
        except Exception as e:  # a peer that is missing or fails here: said, the rest still runs
            why = f"rank {ctx.rank}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            print(f"  {'warm-up: ' if ctx.quiet else ''}{label}: failed on {why}", flush=True)
            if not isinstance(e, ImportError):
                traceback.print_exc()
        # every rank learns of any rank's failure (a rank left waiting in a collective of the step
        # gets the group's timeout) and the step's files go
        errors: List[Any] = all_gather(why)
        if any(errors):
            info.setdefault("failed", {})[label] = "; ".join(e for e in errors if e)
            _fresh(root, ctx.rank)
    return ctx.results


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import torch
    import torch.distributed as dist

    # Megatron-Core's import-time notes (no Transformer Engine / Apex) and deprecations, once per rank: noise here
    warnings.filterwarnings("ignore", module=r"megatron(\.|$)")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.pg_timeout))
    try:
        ctx = GpuCtx(rank, world, args)
        from ckpt_integration.serialization import default_thread_count

        info: Dict[str, Any] = {"threads": args.threads or default_thread_count()}
        results = {"state_bytes_per_rank": ctx.state_bytes, "tensors_per_rank": ctx.n, "tensor_shape": [ctx.rows, ctx.cols],
                   "dtypes": [str(d).replace("torch.", "") for d in ctx.dtypes], "info": info, "targets": {}}
        if ctx.cuda:
            info["gpu"] = torch.cuda.get_device_name()
        if not args.no_warmup:
            _warmup(rank, world, args, os.path.join(_targets(args)[0][0], f"gpu_bench_{port}_warmup"))
        if rank == 0:  # the results so far after every phase: a run cut short still prints its table
            ctx.on_result = lambda: _dump(out_path, {**results, "partial": True,
                                                     "targets": {**results["targets"], ctx.target: ctx.results}})
        for target, is_tmpfs in _targets(args):
            ctx.target = target
            root = os.path.join(target, f"gpu_bench_{port}")
            need = int(ctx.state_bytes * world * 1.3)
            os.makedirs(target, exist_ok=True)
            free = shutil.disk_usage(target).free
            if free < need:
                if rank == 0:
                    print(f"  {target}: skipped, {free / GiB:.1f} GiB free < {need / GiB:.1f} GiB needed", flush=True)
                results["targets"][target] = {"skipped": f"{free / GiB:.1f} GiB free, {need / GiB:.1f} GiB needed"}
                continue
            try:
                results["targets"][target] = _run_target(ctx, root, is_tmpfs, info)
            finally:
                _barrier()
                if rank == 0:
                    shutil.rmtree(root, ignore_errors=True)
        if rank == 0:
            _dump(out_path, results)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _dump(path: str, results: Dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(path + ".tmp", path)


def _warmup(rank: int, world: int, args: argparse.Namespace, root: str) -> None:
    """Every phase once on a tiny state, results dropped: imports (Megatron-Core's take seconds),
    thread pools, CUDA kernels and the first pinned allocations are not charged to the first
    method measured."""
    tiny = argparse.Namespace(**{**vars(args), "gib_per_rank": 1 / 1024, "repeats": 1, "async_saves": 2})
    ctx = GpuCtx(rank, world, tiny)
    ctx.quiet = True
    t0 = time.perf_counter()
    try:
        _run_target(ctx, root, True, {})
    finally:
        _barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
            print(f"  warm-up (every phase once on {ctx.state_bytes / 2**20:.1f} MiB per rank): {time.perf_counter() - t0:.1f}s",
                  flush=True)


def _targets(args):
    out = [(args.dir, _is_tmpfs(args.dir))] if args.dir else []
    if args.disk_dir:
        out.append((args.disk_dir, _is_tmpfs(args.disk_dir)))
    return out


# --------------------------------------------------------------------------- report
ROWS = (  # label, key, DCP row it is compared with, plain row it is compared with
    ("plain write (limit)", "plain_write", None, "plain_write"),
    ("plain read (limit)", "plain_read", None, "plain_read"),
    ("torch.save", "torch_save", "dcp_save", "plain_write"),
    ("torch.load", "torch_load", "dcp_load", "plain_read"),
    ("DCP save", "dcp_save", "dcp_save", "plain_write"),
    ("DCP load", "dcp_load", "dcp_load", "plain_read"),
    ("DCP load row->col", "dcp_load_row_to_col", "dcp_load_row_to_col", "plain_read"),
    ("DCP async_save (total)", "dcp_async_save", "dcp_save", "plain_write"),
    ("MCore save (fully par.)", "megatron_save", "dcp_save", "plain_write"),
    ("MCore load (fully par.)", "megatron_load", "dcp_load", "plain_read"),
    ("MCore load row->col", "megatron_load_row_to_col", "dcp_load_row_to_col", "plain_read"),
    ("ours save", "ours_save", "dcp_save", "plain_write"),
    ("ours load", "ours_load", "dcp_load", "plain_read"),
    ("ours load (no CRC check)", "ours_load_noverify", "dcp_load", "plain_read"),
    ("ours load row->col", "ours_load_row_to_col", "dcp_load_row_to_col", "plain_read"),
    ("ours load ws change", "ours_load_ws_change", "dcp_load", "plain_read"),
    ("ours async (total)", "ours_async_save", "dcp_save", "plain_write"),
)


def format_gpu_table(results: Dict[str, Any]) -> str:
    lines = []
    for target, res in results["targets"].items():
        lines.append(f"target: {target}")
        if "skipped" in res:
            lines += [f"  skipped: {res['skipped']}", ""]
            continue
        hdr = f"{'method':<26}{'time s':>9}{'GiB/s':>8}{'x DCP':>8}{'% plain':>9}{'host +':>8}{'dev +':>7}"
        lines += [hdr, "-" * len(hdr)]
        for label, key, dcp_key, plain_key in ROWS:
            r = res.get(key)
            if r is None:
                continue
            d, p = res.get(dcp_key) if dcp_key else None, res.get(plain_key)
            lines.append(
                f"{label:<26}{r['seconds']:>9.3f}{r['gib_s']:>8.2f}{_fmt(r['gib_s'] / d['gib_s'] if d else None, '{:.2f}x'):>8}"
                f"{_fmt(100 * r['gib_s'] / p['gib_s'] if p else None, '{:.0f}%'):>9}"
                f"{_fmt(r.get('host_overhead')):>8}{_fmt(r.get('dev_overhead')):>7}")
        sync = res.get("ours_save", {}).get("seconds")
        for label, key in (("ours async", "ours_async_save"), ("DCP async", "dcp_async_save")):
            r = res.get(key)
            if r is None:
                continue
            frac = f" = {100 * r['blocking_s'] / sync:.1f}% of ours sync save" if sync else ""
            extra = f" (prepare {r['prepare_s']:.3f}s; staging buffers allocated: {r['staging_allocations']})" if "stage_s" in r else ""
            lines.append(f"{label}: call blocks {r['blocking_s']:.3f}s{frac}, snapshot taken after {r['staged_s']:.3f}s "
                         f"(2nd save on; 1st call {r['blocking_first_s']:.3f}s){extra}")
        same = res.get("ours_load", {}).get("gib_s")
        parts = [f"{lab} {res[k]['gib_s'] / same:.2f}x" for lab, k in (("row->col", "ours_load_row_to_col"), ("ws change", "ours_load_ws_change"))
                 if k in res and same]
        if parts:
            lines.append("ours resharded / same-layout load: " + ", ".join(parts))
        lines += ["", format_load_details(res, results["state_bytes_per_rank"] * results["config"]["ranks"]), ""]
    lines.append("host + / dev + = peak extra host RSS / device memory allocated during the phase, per rank, "
                 "/ rank state (max over ranks and repeats); x DCP vs the DCP row of the same kind; % plain vs plain write/read")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the state lives (cpu: smoke run)")
    p.add_argument("--gib-per-rank", type=float, default=4.0, help="state per rank (GiB)")
    p.add_argument("--ranks", type=int, default=2, help="processes sharing the GPU over gloo (1 or more)")
    p.add_argument("--tensors", type=int, default=16, help="tensors per rank")
    p.add_argument("--cols", type=int, default=8192, help="columns of every tensor (a multiple of --ranks)")
    p.add_argument("--dtypes", default="bf16,fp32", help="dtypes taken in turn by the tensors (bf16, fp32, fp16)")
    p.add_argument("--dir", default="/dev/shm", help="target directory ('' for none; default /dev/shm)")
    p.add_argument("--disk-dir", default=None, help="also run on this (disk) directory")
    p.add_argument("--repeats", type=int, default=2, help="runs per measurement (best kept)")
    p.add_argument("--async-saves", type=int, default=3, help="async saves in a row (>=2)")
    p.add_argument("--threads", type=int, default=0, help="our I/O threads per rank (0: the library's default)")
    p.add_argument("--skip-dcp", action="store_true")
    p.add_argument("--skip-megatron", action="store_true")
    p.add_argument("--skip-torch-save", action="store_true")
    p.add_argument("--skip-async", action="store_true")
    p.add_argument("--skip-noverify", action="store_true", help="leave out our load without CRC checks")
    p.add_argument("--no-warmup", action="store_true", help="leave out the untimed warm-up pass on a tiny state")
    p.add_argument("--pg-timeout", type=int, default=600,
                   help="seconds a rank waits in a collective (a peer that fails on one rank ends it on the others)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    a = p.parse_args(argv)
    try:
        a.dtypes = [v.strip() for v in a.dtypes.split(",") if v.strip()]
        assert a.dtypes and all(v in DTYPES for v in a.dtypes)
    except AssertionError:
        p.error(f"--dtypes: a comma list of {', '.join(DTYPES)}")
    if a.ranks < 1 or a.tensors < 2 or a.repeats < 1:
        p.error("--ranks and --repeats must be >= 1, --tensors >= 2")
    if a.cols % a.ranks:
        p.error("--cols must be a multiple of --ranks (the row->col loads split the columns evenly)")
    if not a.dir and not a.disk_dir:
        p.error("no target: give --dir or --disk-dir")
    a.async_saves = max(2, a.async_saves)
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: no CUDA device here (use --device cpu for a smoke run)")
    return a


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    port = _free_port()
    t0 = time.perf_counter()
    print(f"gpu_bench: {args.ranks} ranks x {args.gib_per_rank} GiB on {args.device} ({','.join(args.dtypes)}), "
          f"targets {[t for t, _ in _targets(args)]}, best of {args.repeats}, torch {torch.__version__}", flush=True)
    cut_short = None
    # a `timeout` (SIGTERM) ends the ranks and this process: print what was measured before that
    signal.signal(signal.SIGTERM, _raise_terminated)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "results.json")
        try:
            mp.spawn(_worker, args=(args.ranks, port, args, out_path), nprocs=args.ranks, join=True)
        except (Exception, _Terminated) as e:
            cut_short = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            if not os.path.exists(out_path):
                raise
        with open(out_path) as f:
            results = json.load(f)
    if cut_short:
        results["cut_short"] = cut_short
    results["config"] = {**{k: v for k, v in vars(args).items() if k != "json"}, "torch": torch.__version__,
                         "wall_s": time.perf_counter() - t0}
    info = results["info"]
    sb = results["state_bytes_per_rank"]
    print(f"\nGPU checkpoint benchmark: {args.ranks} ranks x {sb / GiB:.3f} GiB on {info.get('gpu', args.device)} "
          f"({results['tensors_per_rank']} tensors of {results['tensor_shape']} {'/'.join(sorted(set(results['dtypes'])))} per rank), "
          f"best of {args.repeats}, our threads/rank {info['threads']}, torch {torch.__version__}, "
          f"Megatron-Core {info.get('megatron', '-')}; wall {results['config']['wall_s']:.0f}s")
    print(f"DCP async stager: {info.get('dcp_stager', '-')}; ours: {info.get('ours_stager', '-')}")
    if cut_short:
        print(f"CUT SHORT ({cut_short}): the table holds the phases measured before")
    for label, why in info.get("failed", {}).items():
        print(f"FAILED {label}: {why}")
    print(format_gpu_table(results), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if cut_short:
        sys.exit(1)
    return results


class _Terminated(BaseException):
    pass


def _raise_terminated(signum, frame):
    raise _Terminated(f"signal {signum}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
