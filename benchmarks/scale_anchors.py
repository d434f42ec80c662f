"""Anchors for ``benchmarks/scale.py``: Megatron-Core's and DCP's global metadata steps on the same layout.

* Megatron-Core 0.16 ``validate_sharding_integrity``: every rank's ShardedTensors
  (metadata only) are all-gathered with ``all_gather_object`` (what each rank
  receives) and global rank 0 validates them all.
* PyTorch DCP ``DefaultSavePlanner``: every rank's local save plan is gathered to
  rank 0 (what it receives), which deduplicates replicas and builds the metadata
  (``_create_global_plan``: dedup, global plan, validation of the global plan).

Both are timed with the thread CPU clock (like the simulated ranks) and their Python
heap peak is taken with tracemalloc, building the inputs included.
"""

from __future__ import annotations

import gc
import pickle
import statistics
import time
import tracemalloc
from typing import Any, Dict

from ckpt_integration.planning.shards import object_storage_key


def anchor_megatron(layout: Any) -> Dict[str, Any]:
    """Megatron-Core 0.16: all_gather_object of every rank's ShardedTensors, rank 0 validates."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.validation import validate_sharding_integrity

    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    W = layout.world

    def build():
        out = []
        for r in range(W):
            local = []
            for m in layout.rank_metas(r):
                if m.kind == "object":
                    local.append(ShardedObject(m.key, None, m.global_shape, m.offsets, m.replica_id[0]))
                    continue
                pre = 1 if "decoder.layers." in m.key else 0
                frag = tuple(g // s for g, s in zip(m.global_shape, m.sizes))
                local.append(ShardedTensor(m.key, None, dtypes[m.dtype], m.sizes[pre:], m.global_shape, m.offsets, frag,
                                           m.replica_id, pre))
            out.append(local)
        return out

    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    global_md = build()
    t_build = time.perf_counter() - t0
    per_rank_bytes = [len(pickle.dumps(l)) for l in global_md[: min(W, 64)]]
    received = int(statistics.mean(per_rank_bytes) * (W - 1))
    # it validates on global rank 0 only; play rank 0 without a process group
    real_get_rank = torch.distributed.get_rank
    torch.distributed.get_rank = lambda group=None: 0
    try:
        t1 = time.thread_time()
        validate_sharding_integrity(global_md)
        t_val = time.thread_time() - t1
    finally:
        torch.distributed.get_rank = real_get_rank
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del global_md
    return {"validate_time": t_val, "build_time": t_build, "received_per_rank": received, "peak_mem_rank0": peak}


def anchor_dcp(layout: Any) -> Dict[str, Any]:
    """PyTorch DCP: every rank's local save plan gathered to rank 0, which dedups and builds the metadata."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    W = layout.world

    def plans():
        out = []
        for r in range(W):
            items = []
            for m in layout.rank_metas(r):
                if m.kind == "object":
                    items.append(WriteItem(MetadataIndex(object_storage_key(m.key, m.offsets, m.global_shape)), WriteItemType.BYTE_IO))
                    continue
                off = torch.Size(m.offsets)
                items.append(WriteItem(
                    MetadataIndex(m.key, off), WriteItemType.SHARD,
                    tensor_data=TensorWriteData(ChunkStorageMetadata(off, torch.Size(m.sizes)),
                                                TensorProperties(dtype=dtypes[m.dtype]), torch.Size(m.global_shape)),
                ))
            # planner_data: the flattening map DefaultSavePlanner's local plan carries
            out.append(SavePlan(items, planner_data={it.index.fqn: (it.index.fqn,) for it in items}))
        return out

    gc.collect()
    tracemalloc.start()
    all_plans = plans()
    per_rank_bytes = [len(pickle.dumps(p)) for p in all_plans[: min(W, 64)]]
    received = int(statistics.mean(per_rank_bytes) * (W - 1))
    t0 = time.thread_time()
    _, md = DefaultSavePlanner()._create_global_plan(all_plans)
    dt = time.thread_time() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"global_plan_time": dt, "received_rank0": received, "peak_mem_rank0": peak,
            "metadata_bytes": len(pickle.dumps(md))}
