"""The peers of benchmarks/gpu_bench.py on the same device state: torch.save/torch.load per rank,
PyTorch DCP (save, load, row->col load, async_save with its pinned-memory stager) and Megatron-Core
dist_checkpointing (torch_dist in the fully-parallel wrappers)."""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import sys
import time
from typing import Any, Callable, Dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import _barrier, _fresh  # noqa: E402
from gpu_measure import GpuCtx, _async_done, _col_slices, _host_and_device_peaks, _zero, measure  # noqa: E402


def run_torch_save(ctx: GpuCtx, root: str, cache: Callable[[str], None]) -> None:
    import torch

    d = os.path.join(root, "torch_save")
    _fresh(d, ctx.rank)
    path = os.path.join(d, f"rank{ctx.rank}.pt")
    measure(ctx, "torch_save", lambda: torch.save({f"t{i}": t for i, t in enumerate(ctx.local)}, path))
    got: Dict[str, Any] = {}
    measure(ctx, "torch_load", lambda: got.update(sd=torch.load(path, weights_only=True)),
            setup=lambda: (got.clear(), cache(d)),
            check=lambda: ctx.check([got["sd"]["t0"], got["sd"][f"t{ctx.n - 1}"]], what="torch.load"))
    got.clear()
    _fresh(d, ctx.rank)


def _dcp_stager_factory(cuda: bool):
    """DCP's pinned-memory stager where this torch has it, else the older ones:
    ``(make, reuse, name)``; ``make()`` builds one, ``reuse`` says whether one may serve every save.

    torch 2.11's ``DefaultStager`` cannot be reused: its second ``stage`` raises
    ``KeyError: <class 'type'>`` (pytorch/pytorch#183413, fixed in a later release). A user of
    such a torch makes a new stager (new pinned buffers) per save; so do we there, found by a
    probe on a tiny CPU dict, and say so in the stager's name.
    """
    import inspect

    import torch
    import torch.distributed.checkpoint as dcp

    if "async_stager" not in inspect.signature(dcp.async_save).parameters:
        return None, True, "none (async_save has no async_stager argument)"
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        return (lambda: BlockingAsyncStager(cache_staged_state_dict=True)), True, \
            "BlockingAsyncStager(cache_staged_state_dict=True), reused"
    probe = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                                         use_non_blocking_copy=False))
    try:
        for _ in range(2):
            probe.stage({"x": torch.zeros(4)})
        reuse = True
    except Exception:
        reuse = False
    finally:
        probe.close()
    opts = dict(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda)
    name = "DefaultStager(StagingOptions(" + ", ".join(f"{k}={v}" for k, v in opts.items()) + "))"
    name += ", one reused for every save" if reuse else \
        ", a new one per save (reusing one fails on this torch: pytorch/pytorch#183413)"
    return (lambda: DefaultStager(StagingOptions(**opts))), reuse, name


def run_dcp(ctx: GpuCtx, root: str, cache: Callable[[str], None], info: Dict[str, Any]) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    args, rank, W = ctx.args, ctx.rank, ctx.world
    mesh = init_device_mesh(ctx.device.type, (W,))

    def dsd(tensors, axis=0, keys=None):
        keys = range(len(tensors)) if keys is None else keys
        return {f"t{i}": DTensor.from_local(t, mesh, [Shard(axis)], run_check=False) for i, t in zip(keys, tensors)}

    d = os.path.join(root, "dcp")
    measure(ctx, "dcp_save", lambda: dcp.save(dsd(ctx.local), checkpoint_id=d), setup=lambda: _fresh(d, rank))
    measure(ctx, "dcp_load", lambda: dcp.load(dsd(ctx.dst), checkpoint_id=d), setup=lambda: (_zero(ctx.dst), cache(d)),
            check=lambda: ctx.check(ctx.dst, what="DCP load"))
    cw = ctx.cols // W
    cols = [torch.zeros(W * ctx.rows, cw, dtype=t.dtype, device=ctx.device) for t in ctx.local]
    want = _col_slices(ctx, cols)
    measure(ctx, "dcp_load_row_to_col", lambda: dcp.load(dsd(cols, axis=1), checkpoint_id=d),
            setup=lambda: (_zero(cols), cache(d)), check=lambda: ctx.check([c[0] for c in want], [c[1] for c in want], "DCP row->col"))
    del cols, want
    _fresh(d, rank)
    if args.skip_async:
        return
    make, reuse, info["dcp_stager"] = _dcp_stager_factory(ctx.cuda)
    blocking, staged, total, peaks = [], [], [], [0, 0]
    last = None
    stager = make() if make is not None and reuse else None
    with _host_and_device_peaks(ctx, peaks):
        for i in range(args.async_saves):
            di = os.path.join(root, f"dcp_async{i}")
            _fresh(di, rank)
            t0 = time.perf_counter()
            this = stager if reuse else make() if make is not None else None
            kw = {"async_stager": this} if this is not None else {}
            resp = dcp.async_save(dsd(ctx.local), checkpoint_id=di, **kw)
            blocking.append(time.perf_counter() - t0)
            if getattr(resp, "staging_completion", None) is not None:
                resp.staging_completion.result()
            staged.append(time.perf_counter() - t0)
            getattr(resp, "upload_completion", resp).result()
            total.append(time.perf_counter() - t0)
            if this is not None and this is not stager and hasattr(this, "close"):
                this.close()
            _barrier()
            if rank == 0 and last is not None:
                shutil.rmtree(last, ignore_errors=True)
            last = di
    if stager is not None and hasattr(stager, "close"):
        stager.close()
    _async_done(ctx, "dcp_async_save", blocking, staged, total, peaks)
    # the last async checkpoint holds the state: its first and last tensor, checked
    part = [torch.zeros_like(ctx.local[0]), torch.zeros_like(ctx.local[-1])]
    dcp.load(dsd(part, keys=[0, ctx.n - 1]), checkpoint_id=last)
    ctx.check(part, what="DCP async_save")
    _barrier()
    if rank == 0:
        shutil.rmtree(last, ignore_errors=True)


@contextlib.contextmanager
def _megatron(cuda: bool):
    """``megatron.core.dist_checkpointing``; its process-wide safe-globals additions undone (they would
    widen what our restricted unpickler accepts). On CPU, the CUDA calls Megatron makes unconditionally
    are made harmless for the block (``current_device`` -> ``"cpu"``: where it allocates buffers)."""
    import torch

    before = list(torch.serialization.get_safe_globals())
    try:
        mdc = importlib.import_module("megatron.core.dist_checkpointing")
        importlib.import_module("megatron.core.dist_checkpointing.strategies.fully_parallel")
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
    saved = (torch.cuda.synchronize, torch.cuda.current_device)
    fa = importlib.import_module("megatron.core.dist_checkpointing.strategies.filesystem_async")
    saved_mem = getattr(fa, "_process_memory", None)
    if not cuda:
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"
        if saved_mem is not None:
            fa._process_memory = lambda: 0  # psutil of the writer process; no GPU involved
    try:
        yield mdc
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved
        if saved_mem is not None:
            fa._process_memory = saved_mem


def run_megatron(ctx: GpuCtx, root: str, cache: Callable[[str], None], info: Dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    with _megatron(ctx.cuda) as mdc:
        from megatron.core.dist_checkpointing import ShardedTensor as MST
        from megatron.core.dist_checkpointing.serialization import (
            get_default_load_sharded_strategy, get_default_save_sharded_strategy)
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper)

        info["megatron"] = importlib.import_module("megatron.core").__version__
        rank, W = ctx.rank, ctx.world
        group = dist.group.WORLD  # the data-parallel group: every rank here

        def msd(tensors, axis=0):
            return {f"t{i}": MST.from_rank_offsets(f"t{i}", t, (axis, rank, W)) for i, t in enumerate(tensors)}

        def save(d):
            strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), group)
            mdc.save(msd(ctx.local), d, sharded_strategy=strategy)

        def load(sd, d):
            strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(d), group)
            return mdc.load(sd, d, sharded_strategy=strategy)

        d = os.path.join(root, "megatron")
        measure(ctx, "megatron_save", lambda: save(d), setup=lambda: _fresh(d, rank))
        got: Dict[str, Any] = {}
        measure(ctx, "megatron_load", lambda: got.update(sd=load(msd(ctx.dst), d)), setup=lambda: (_zero(ctx.dst), cache(d)),
                check=lambda: ctx.check([got["sd"]["t0"], got["sd"][f"t{ctx.n - 1}"]], what="Megatron load"))
        cols = [torch.zeros(W * ctx.rows, ctx.cols // W, dtype=t.dtype, device=ctx.device) for t in ctx.local]

        def check_cols():
            loaded = [got["sd"][f"t{i}"] for i in range(ctx.n)]
            pairs = _col_slices(ctx, loaded)
            ctx.check([p[0] for p in pairs], [p[1] for p in pairs], "Megatron row->col")

        measure(ctx, "megatron_load_row_to_col", lambda: got.update(sd=load(msd(cols, axis=1), d)),
                setup=lambda: (_zero(cols), cache(d)), check=check_cols)
        got.clear()
        del cols
        _fresh(d, rank)
