#!/usr/bin/env python
"""Side-by-side checkpoint benchmark: ckpt_integration vs torch.save vs PyTorch DCP vs plain I/O.

One run measures, on the same synthetic sharded state (every rank owns
``total_gib / ranks`` of float32 tensors, row-sharded ShardedTensors / DTensors):

* ``plain write`` / ``plain read`` - the same bytes per rank with buffered file
  I/O (write + fsync; ``readinto`` preallocated tensors): the physical limit;
* ``torch.save`` / ``torch.load`` per rank (no fsync, as users call it);
* PyTorch DCP ``save`` / ``load`` (defaults) and ``async_save``;
* ours: ``save``, ``load`` (same layout), ``load`` into a different layout
  (uneven row boundaries shifted by half a shard, so every rank reads from two
  saved chunks), and async save (blocking time = how long the training loop is
  stalled, averaged from the 2nd save on; the loop "trains" until the previous
  save is done before starting the next);
* more resharded loads, each rank reading as many bytes as in the same-layout load:
  ``row->col`` (saved split by rows, loaded split by columns: a TP change of a
  column-parallel layer; every rank reads a column slice of every saved chunk),
  ``col->row`` (a checkpoint saved split by columns, loaded split by rows) and
  ``ws change`` (each rank loads its rows as two shards, as twice the ranks would).
  With checksums every byte read is verified: a column slice touches every checksum
  block of the rows it spans, so ``row->col`` reads and checks those rows whole.

Throughput = bytes of the whole state / wall time (slowest rank, between
barriers). Peak memory per rank: VmHWM (reset with ``/proc/self/clear_refs``
before each phase, stdlib only) compared with the RSS before the phase; the
``mem`` column is ``(state + extra peak) / state``.

Usage::

    python benchmarks/bench.py --total-gib 2 --ranks 2            # /dev/shm
    python benchmarks/bench.py --total-gib 2 --disk-dir /var/tmp  # also a disk dir
    python benchmarks/bench.py --quick --json out.json            # smoke run
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

GiB = 1 << 30

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import _drop_cache, _free_port, _is_tmpfs, _peak_bytes, _reset_peak, _rss_bytes, _status_kib, all_gather  # noqa: E402,F401
from bench_report import STAT_TIMES, format_load_details, format_small, format_table, summary_rows  # noqa: E402,F401


# --------------------------------------------------------------------------- per-rank work
class Ctx:
    def __init__(self, rank: int, world: int, args: argparse.Namespace):
        import torch

        self.rank, self.world, self.args = rank, world, args
        per_rank = int(args.total_gib * GiB) // world
        self.n = args.tensors
        self.cols = args.cols
        self.rows = max(2, per_rank // (self.n * self.cols * 4))
        self.rows -= self.rows % 2
        g = torch.Generator().manual_seed(1234 + rank)
        self.local = [torch.rand(self.rows, self.cols, generator=g) for _ in range(self.n)]
        self.state_bytes = sum(t.numel() * 4 for t in self.local)
        self.dst = [torch.zeros_like(t) for t in self.local]  # touched: loads do not count page faults
        self.results: Dict[str, Dict[str, Any]] = {}

    # global layout: key t{i}, shape (world*rows, cols), rank r owns rows [r*rows, (r+1)*rows)
    def sharded(self, tensors) -> Dict[str, Any]:
        from ckpt_integration import ShardedTensor

        return {
            f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", t, (0, self.rank, self.world))
            for i, t in enumerate(tensors)
        }

    def reshard_bounds(self):
        r, R, W = self.rank, self.rows, self.world
        b = [0] + [k * R + R // 2 for k in range(1, W)] + [W * R]
        return b[r], b[r + 1]


def _barrier():
    import torch.distributed as dist

    dist.barrier()


STAT_SUMS = ("bytes_read", "bytes_sent", "bytes_received", "bytes_copied", "separate_bytes", "union_bytes")


def _load_stats(allrec: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """One load's statistics over the ranks (``execution.load.last_load_stats``): bytes summed
    (``separate_bytes``/``union_bytes`` are already totals: taken from rank 0), seconds max."""
    stats = [r.get("load") for r in allrec]
    if any(s is None for s in stats):
        return None
    out: Dict[str, Any] = {"strategy": stats[0].get("strategy", "local")}
    for k in STAT_SUMS:
        vals = [float(s.get(k, 0)) for s in stats]
        out[k] = vals[0] if k in ("separate_bytes", "union_bytes") else sum(vals)
    for k in STAT_TIMES:
        out[k] = max(float(s.get(k, 0)) for s in stats)
    return out


def _measure(ctx: Ctx, name: str, fn: Callable[[], Any], setup: Optional[Callable[[], Any]] = None, repeats: int = 1,
             load: bool = False, env: Optional[Dict[str, str]] = None):
    """Run ``fn`` ``repeats`` times between barriers; keep the best wall time (slowest rank).

    ``load``: also gather the load's statistics (bytes read/exchanged, seconds per phase);
    ``env``: environment variables set around ``fn`` (e.g. ``LOCAL_WORLD_SIZE=1``: every rank
    its own node).
    """

    best = None
    for _ in range(repeats):
        if setup is not None:
            setup()
        # a collection before each run (not timed): a run is not charged for walking the objects
        # an earlier run or method left (a full collection of this process's heap takes ~0.2 s
        # with 20,000 request objects alive, and starts whenever the allocation counts say so)
        gc.collect()
        _barrier()
        have_peak = _reset_peak()
        rss0 = _rss_bytes()
        saved_env = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        t0 = time.perf_counter()
        try:
            fn()
        finally:
            t_local = time.perf_counter() - t0
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _barrier()
        peak = _peak_bytes() if have_peak else None
        rec = {"t": t_local, "extra_rss": (peak - rss0) if peak is not None else None}
        if load:
            from ckpt_integration.execution import load as load_mod

            rec["load"] = dict(load_mod.last_load_stats)
        allrec: List[Dict[str, Any]] = all_gather(rec)
        t = max(r["t"] for r in allrec)
        extras = [r["extra_rss"] for r in allrec if r["extra_rss"] is not None]
        out = {
            "seconds": t,
            "gib_s": ctx.state_bytes * ctx.world / GiB / t if t > 0 else float("inf"),
            "extra_rss_gib": max(extras) / GiB if extras else None,
            "mem_ratio": (ctx.state_bytes + max(extras)) / ctx.state_bytes if extras else None,
        }
        if load:
            out["load"] = _load_stats(allrec)
        if best is None or out["seconds"] < best["seconds"]:
            best = out
    ctx.results[name] = best
    return best


def _fresh(path: str, rank: int) -> None:
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path, exist_ok=True)
    _barrier()


def _run_target(ctx: Ctx, root: str, is_tmpfs: bool) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    import ckpt_integration as ci
    from ckpt_integration import ShardedTensor
    from ckpt_integration.execution.async_save import AsyncCallsQueue, async_save_torch_dist

    args, rank, world = ctx.args, ctx.rank, ctx.world
    rep = args.repeats
    ctx.results = {}
    cache = (lambda d: None) if is_tmpfs else _drop_cache

    def check(tensors):
        assert torch.equal(tensors[0], ctx.local[0]) and torch.equal(tensors[-1], ctx.local[-1]), "bad data read back"

    # ---- plain buffered I/O: the physical limit
    d = os.path.join(root, "plain")
    _fresh(d, rank)
    path = os.path.join(d, f"rank{rank}.bin")

    def plain_write():
        with open(path, "wb") as f:
            for t in ctx.local:
                f.write(memoryview(t.numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())

    def plain_read():
        with open(path, "rb") as f:
            for t in ctx.dst:
                f.readinto(memoryview(t.numpy()).cast("B"))

    _measure(ctx, "plain_write", plain_write, repeats=rep)
    _measure(ctx, "plain_read", plain_read, setup=lambda: cache(d), repeats=rep)
    check(ctx.dst)
    _fresh(d, rank)

    if not args.loads_only:  # ---- torch.save / torch.load per rank
        d = os.path.join(root, "torch_save")
        _fresh(d, rank)
        path = os.path.join(d, f"rank{rank}.pt")
        _measure(ctx, "torch_save", lambda: torch.save({f"t{i}": t for i, t in enumerate(ctx.local)}, path), repeats=rep)
        loaded = {}

        def tload():
            loaded["sd"] = torch.load(path, weights_only=True)

        _measure(ctx, "torch_load", tload, setup=lambda: (loaded.clear(), cache(d)), repeats=rep)
        check([loaded["sd"][f"t{i}"] for i in range(ctx.n)])
        loaded.clear()
        _fresh(d, rank)

    # ---- PyTorch DCP (DTensor, row-sharded)
    if not args.skip_dcp and not args.loads_only:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (world,))

        def dsd(tensors):
            return {f"t{i}": DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for i, t in enumerate(tensors)}

        d = os.path.join(root, "dcp")
        _measure(ctx, "dcp_save", lambda: dcp.save(dsd(ctx.local), checkpoint_id=d), setup=lambda: _fresh(d, rank), repeats=rep)
        _measure(ctx, "dcp_load", lambda: dcp.load(dsd(ctx.dst), checkpoint_id=d), setup=lambda: cache(d), repeats=rep)
        check(ctx.dst)
        blocking = []
        total = []
        for i in range(0 if args.skip_async else args.async_saves):
            di = os.path.join(root, f"dcp_async{i}")
            _fresh(di, rank)
            _barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save(dsd(ctx.local), checkpoint_id=di)
            blocking.append(time.perf_counter() - t0)
            fut = getattr(fut, "upload_completion", fut)
            fut.result()
            total.append(time.perf_counter() - t0)
            _barrier()
            if rank == 0:
                shutil.rmtree(di, ignore_errors=True)
        if blocking:
            _async_result(ctx, "dcp_async_save", blocking, total)
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
        _barrier()

    # ---- ours
    d = os.path.join(root, "ours")
    kw = dict(thread_count=args.threads)
    _measure(ctx, "ours_save", lambda: ci.save(ctx.sharded(ctx.local), d, **kw), setup=lambda: _fresh(d, rank), repeats=rep)
    for t in ctx.dst:
        t.zero_()
    _measure(ctx, "ours_load", lambda: ci.load(ctx.sharded(ctx.dst), d, thread_count=args.threads), setup=lambda: cache(d),
             repeats=rep, load=True)
    check(ctx.dst)
    # the same load proving the loaded state equals the saved one (fingerprints, verify_state=True)
    _measure(ctx, "ours_load_verify_state",
             lambda: ci.load(ctx.sharded(ctx.dst), d, thread_count=args.threads, verify_state=True),
             setup=lambda: cache(d), repeats=rep, load=True)
    check(ctx.dst)
    # the same load without checksum verification (verify_checksums=False): the cost of the safety check
    _measure(ctx, "ours_load_noverify",
             lambda: ci.load(ctx.sharded(ctx.dst), d, thread_count=args.threads, verify_checksums=False),
             setup=lambda: cache(d), repeats=rep, load=True)
    check(ctx.dst)
    _resharded_loads(ctx, root, d, cache)
    if rank == 0:
        shutil.rmtree(d, ignore_errors=True)
    _barrier()

    if args.skip_async or args.loads_only:
        return ctx.results
    blocking, total, stage, prepare = [], [], [], []
    have_peak = _reset_peak()
    rss0 = _rss_bytes()
    with AsyncCallsQueue() as q:
        for i in range(args.async_saves):
            di = os.path.join(root, f"ours_async{i}")
            _fresh(di, rank)
            t0 = time.perf_counter()
            req = async_save_torch_dist(ctx.sharded(ctx.local), di, queue=q, **kw)
            blocking.append(time.perf_counter() - t0)
            stage.append(req.timings["stage"])
            prepare.append(req.timings["prepare"])
            # "training" (in place updates would be safe here) until the save is done
            while not req.is_done():
                time.sleep(0.002)
            total.append(time.perf_counter() - t0)
            req.wait()
            _barrier()
            if rank == 0:
                shutil.rmtree(di, ignore_errors=True)
        allocs = q.stagers[0].stats.allocations
    peak = _peak_bytes() if have_peak else None
    _async_result(ctx, "ours_async_save", blocking, total, extra_rss=(peak - rss0) if peak is not None else None,
                  stage=stage, prepare=prepare, allocations=allocs)
    return ctx.results


# variants of every resharded load: the default ("auto": read-once when it reads fewer bytes),
# forced "local" (every rank reads and checks the blocks it touches) and read-once with every
# rank its own node (LOCAL_WORLD_SIZE=1: slices travel over the process group, as across nodes)
VARIANTS = (("", {}, None), ("_local", {"load_strategy": "local"}, None),
            ("_nodes", {"load_strategy": "read_once"}, {"LOCAL_WORLD_SIZE": "1"}))


def _resharded_loads(ctx: Ctx, root: str, d: str, cache: Callable[[str], None]) -> None:
    """uneven, row->col, ws change (from the row-split checkpoint ``d``) and col->row (a column-split one),
    each in every variant; all with the library's defaults otherwise (access validation on)."""
    import torch

    import ckpt_integration as ci
    from ckpt_integration import ShardedTensor

    args, rank, W = ctx.args, ctx.rank, ctx.world
    R, C, G = ctx.rows, ctx.cols, ctx.world * ctx.rows
    threads = args.threads

    def run(name, make_sd, directory, verify):
        for suffix, kw, env in VARIANTS:
            _measure(ctx, name + suffix, lambda: ci.load(make_sd(), directory, thread_count=threads, **kw),
                     setup=lambda: (dst_zero(), cache(directory)), repeats=args.repeats, load=True, env=env)
            verify()

    # uneven: row boundaries shifted by half a shard; rows [lo, hi) come from two saved chunks
    lo, hi = ctx.reshard_bounds()
    dst = [torch.zeros(hi - lo, C) for _ in range(ctx.n)]
    dst_zero = lambda: [t.zero_() for t in dst]  # noqa: E731

    def check_uneven():
        n_own = (rank + 1) * R - lo
        if 0 < n_own <= hi - lo and lo >= rank * R:
            assert torch.equal(dst[0][:n_own], ctx.local[0][lo - rank * R :]), "bad uneven read"

    run("ours_load_resharded",
        lambda: {f"t{i}": ShardedTensor.from_global_offsets(f"t{i}", t, (G, C), (lo, 0)) for i, t in enumerate(dst)},
        d, check_uneven)
    # row -> column: every rank wants a column slice of every saved (row) chunk
    cw = C // W
    c0 = rank * cw
    cw = C - c0 if rank == W - 1 else cw
    dst = [torch.zeros(G, cw) for _ in range(ctx.n)]
    run("ours_load_row_to_col",
        lambda: {f"t{i}": ShardedTensor.from_global_offsets(f"t{i}", t, (G, C), (0, c0)) for i, t in enumerate(dst)},
        d, lambda: None)
    assert torch.equal(dst[0][rank * R : (rank + 1) * R], ctx.local[0][:, c0 : c0 + cw]), "bad row->col read"
    # world-size change: each rank's rows as two shards (what twice the ranks would each load)
    h = R // 2
    halves = [(torch.zeros(h, C), torch.zeros(R - h, C)) for _ in range(ctx.n)]
    dst = [t for hv in halves for t in hv]
    run("ours_load_ws_change",
        lambda: {f"t{i}_{j}": ShardedTensor.from_global_offsets(f"t{i}", hv[j], (G, C), (rank * R + j * h, 0))
                 for i, hv in enumerate(halves) for j in (0, 1)},
        d, lambda: None)
    assert torch.equal(torch.cat(halves[0]), ctx.local[0]), "bad world-size-change read"
    del halves
    # column -> row: a checkpoint saved split by columns (rank r holds columns [r*C, (r+1)*C)), loaded by rows
    dc = os.path.join(root, "ours_cols")
    _fresh(dc, rank)
    ci.save({f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", t, (1, rank, W)) for i, t in enumerate(ctx.local)},
            dc, thread_count=threads)
    rr = R // W
    r0 = rank * rr
    rr = R - r0 if rank == W - 1 else rr
    dst = [torch.zeros(rr, W * C) for _ in range(ctx.n)]
    run("ours_load_col_to_row",
        lambda: {f"t{i}": ShardedTensor.from_global_offsets(f"t{i}", t, (R, W * C), (r0, 0)) for i, t in enumerate(dst)},
        dc, lambda: None)
    assert torch.equal(dst[0][:, rank * C : (rank + 1) * C], ctx.local[0][r0 : r0 + rr]), "bad col->row read"
    del dst
    _barrier()
    if rank == 0:
        shutil.rmtree(dc, ignore_errors=True)
    _barrier()


def _run_small(ctx: Ctx, root: str) -> Dict[str, Any]:
    """Many small tensors: ``--small`` float32 tensors of ``--small-bytes`` per rank, ours and DCP,
    save and same-layout load; microseconds per tensor (slowest rank, best of ``--repeats``)."""
    import torch

    import ckpt_integration as ci
    from ckpt_integration import ShardedTensor

    args, rank, world = ctx.args, ctx.rank, ctx.world
    n, numel = args.small, max(1, args.small_bytes // 4)
    local = [torch.rand(numel) for _ in range(n)]
    dst = [torch.zeros(numel) for _ in range(n)]
    saved_results, ctx.results = ctx.results, {}
    sd = lambda ts: {f"s{i}": ShardedTensor.from_rank_offsets(f"s{i}", t, (0, rank, world)) for i, t in enumerate(ts)}  # noqa: E731
    d = os.path.join(root, "small_ours")
    _measure(ctx, "ours_save", lambda: ci.save(sd(local), d, thread_count=args.threads), setup=lambda: _fresh(d, rank),
             repeats=args.repeats)
    # the first load of a request checks it (the validation exchange); loads repeating the same
    # request reuse that check, as saves reuse their plan: both are reported
    _measure(ctx, "ours_load_first", lambda: ci.load(sd(dst), d, thread_count=args.threads), load=True)
    _measure(ctx, "ours_load", lambda: ci.load(sd(dst), d, thread_count=args.threads), repeats=args.repeats, load=True)
    assert torch.equal(dst[-1], local[-1]), "bad small-tensor load"
    _measure(ctx, "ours_load_verify_state", lambda: ci.load(sd(dst), d, thread_count=args.threads, verify_state=True),
             repeats=args.repeats, load=True)
    # the same tensors as data-parallel replicas (every rank holds all of them: norms and biases),
    # loaded by every rank, with the strategies that share reads
    rep = lambda ts: {f"s{i}": ShardedTensor.from_rank_offsets(f"s{i}", t, replica_id=rank) for i, t in enumerate(ts)}  # noqa: E731
    same = torch.arange(n * numel, dtype=torch.float32).view(n, numel)  # (replicas: the same on every rank)
    dr = os.path.join(root, "small_replicas")
    _measure(ctx, "ours_save_replicas", lambda: ci.save(rep(list(same)), dr, thread_count=args.threads),
             setup=lambda: _fresh(dr, rank))
    for strategy in ("auto", "fully_parallel", "two_stage"):
        _measure(ctx, f"ours_load_replicas_{strategy}", lambda: ci.load(rep(dst), dr, thread_count=args.threads,
                                                                         load_strategy=strategy),
                 repeats=args.repeats, load=True)
        assert torch.equal(torch.stack(dst), same), f"bad small-tensor load ({strategy})"
    if not args.skip_dcp:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (world,))
        dsd = lambda ts: {f"s{i}": DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for i, t in enumerate(ts)}  # noqa: E731
        dd = os.path.join(root, "small_dcp")
        _measure(ctx, "dcp_save", lambda: dcp.save(dsd(local), checkpoint_id=dd), setup=lambda: _fresh(dd, rank),
                 repeats=args.repeats)
        _measure(ctx, "dcp_load", lambda: dcp.load(dsd(dst), checkpoint_id=dd), repeats=args.repeats)
    out = {k: dict(v, us_per_tensor=1e6 * v["seconds"] / n) for k, v in ctx.results.items()}
    ctx.results = saved_results
    return {"tensors_per_rank": n, "bytes_per_tensor": numel * 4, "results": out}


def _async_result(ctx: Ctx, name: str, blocking: List[float], total: List[float], extra_rss=None, **more) -> None:
    rec = {"blocking": blocking, "total": total, "extra_rss": extra_rss, **more}
    allrec: List[Dict[str, Any]] = all_gather(rec)

    def worst(key, i):
        return max(r[key][i] for r in allrec)

    n = len(blocking)
    steady = list(range(1, n)) if n > 1 else [0]
    b = statistics.mean(worst("blocking", i) for i in steady)
    tt = statistics.mean(worst("total", i) for i in steady)
    out = {
        "blocking_first_s": worst("blocking", 0),
        "blocking_s": b,
        "total_s": tt,
        "seconds": tt,
        "gib_s": ctx.state_bytes * ctx.world / GiB / tt,
    }
    if "stage" in rec:
        out["stage_s"] = statistics.mean(worst("stage", i) for i in steady)
        out["prepare_s"] = statistics.mean(worst("prepare", i) for i in steady)
        out["staging_allocations"] = max(r["allocations"] for r in allrec)
    extras = [r["extra_rss"] for r in allrec if r["extra_rss"] is not None]
    out["extra_rss_gib"] = max(extras) / GiB if extras else None
    out["mem_ratio"] = (ctx.state_bytes + max(extras)) / ctx.state_bytes if extras else None
    ctx.results[name] = out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # one node, as torchrun would say (a load then broadcasts its metadata uncompressed)
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=1800))
    try:
        ctx = Ctx(rank, world, args)
        results = {"state_bytes_per_rank": ctx.state_bytes, "tensors_per_rank": ctx.n,
                   "tensor_shape": [ctx.rows, ctx.cols], "targets": {}}
        if args.small:
            results["small"] = {"targets": {}}
        for target, is_tmpfs in _targets(args):
            root = os.path.join(target, f"ckpt_bench_{port}")
            try:
                if args.small:
                    sm = _run_small(ctx, root)
                    results["small"]["targets"][target] = sm
                    results["small"].update(tensors_per_rank=sm["tensors_per_rank"], bytes_per_tensor=sm["bytes_per_tensor"])
                if args.small_only:
                    continue
                results["targets"][target] = _run_target(ctx, root, is_tmpfs)
            finally:
                _barrier()
                if rank == 0:
                    shutil.rmtree(root, ignore_errors=True)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _targets(args):
    out = [(args.dir, _is_tmpfs(args.dir))]
    if args.disk_dir:
        out.append((args.disk_dir, _is_tmpfs(args.disk_dir)))
    return out


# --------------------------------------------------------------------------- reporting
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--total-gib", type=float, default=2.0, help="state size over all ranks (GiB)")
    p.add_argument("--ranks", type=_int_list, default=[2],
                   help="gloo CPU processes; a comma list (e.g. 2,4,8) runs each in turn")
    p.add_argument("--tensors", type=_int_list, default=[32],
                   help="tensors per rank; a comma list (e.g. 8,512) runs each in turn")
    p.add_argument("--cols", type=int, default=4096, help="columns of every tensor (float32)")
    p.add_argument("--dir", default="/dev/shm", help="target directory (default: /dev/shm)")
    p.add_argument("--disk-dir", default=None, help="also run on this (disk) directory")
    p.add_argument("--repeats", type=int, default=2, help="runs per measurement (best kept)")
    p.add_argument("--async-saves", type=int, default=3, help="async saves in a row (>=2)")
    p.add_argument("--threads", type=int, default=0,
                   help="our writer/reader threads per rank (0: cores // ranks, at least 1)")
    p.add_argument("--skip-dcp", action="store_true", help="leave PyTorch DCP out")
    p.add_argument("--skip-async", action="store_true", help="leave the async saves out")
    p.add_argument("--small", type=int, default=0, metavar="N",
                   help="also the many-small-tensors case: N tensors per rank (e.g. 10000), ours and DCP")
    p.add_argument("--small-bytes", type=int, default=4096, help="bytes per small tensor (default 4 KiB)")
    p.add_argument("--small-only", action="store_true", help="only the many-small-tensors case")
    p.add_argument("--loads-only", action="store_true",
                   help="plain I/O, our save and our loads only (no torch.save, DCP or async): for iterating on loads")
    p.add_argument("--quick", action="store_true", help="small smoke run (64 MiB, 1 repeat)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    a = p.parse_args(argv)
    if a.quick:
        a.total_gib = min(a.total_gib, 1 / 16)
        a.tensors = [min(t, 8) for t in a.tensors]
        a.cols = min(a.cols, 1024)
        a.repeats = 1
        a.async_saves = 2
    a.async_saves = max(2, a.async_saves)
    if not all(1 <= r <= 64 for r in a.ranks):
        p.error("--ranks must be between 1 and 64")
    if not all(t >= 1 for t in a.tensors):
        p.error("--tensors must be >= 1")
    return a


def _int_list(text: str) -> List[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or a comma list of integers, got {text!r}") from None


def run_one(args: argparse.Namespace, ranks: int, tensors: int) -> Dict[str, Any]:
    """One configuration (``ranks`` processes, ``tensors`` per rank): every method, every target."""
    import torch.multiprocessing as mp

    cfg = argparse.Namespace(**{**vars(args), "ranks": ranks, "tensors": tensors})
    if cfg.threads <= 0:  # I/O threads per rank: the cores shared out among the ranks
        cfg.threads = max(1, (os.cpu_count() or 1) // ranks)
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "results.json")
        t0 = time.perf_counter()
        mp.spawn(_worker, args=(ranks, port, cfg, out_path), nprocs=ranks, join=True)
        with open(out_path) as f:
            results = json.load(f)
    results["config"] = {k: v for k, v in vars(cfg).items() if k != "json"}
    results["config"]["wall_s"] = time.perf_counter() - t0
    return results


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    import torch

    runs = []
    for ranks in args.ranks:
        for tensors in args.tensors:
            results = run_one(args, ranks, tensors)
            results["config"]["torch"] = torch.__version__
            sb = results["state_bytes_per_rank"]
            print(
                f"ckpt benchmark: {ranks} ranks x {sb / GiB:.3f} GiB "
                f"({results['tensors_per_rank']} tensors of {results['tensor_shape']} float32 per rank), "
                f"best of {args.repeats}, our threads/rank {results['config']['threads']}, torch {torch.__version__}"
            )
            if results.get("targets"):
                print(format_table(results), flush=True)
            if "small" in results:
                print(format_small(results["small"]), flush=True)
            runs.append(results)
    if len(runs) > 1:
        print("summary (ratios; targets: save >= 3x DCP and >= 70% plain, load >= 3x DCP, "
              "reshard/same >= 0.8, async block <= 10%, save mem <= 1.2)")
        print(summary_rows(runs))
    out = runs[0] if len(runs) == 1 else {"runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
