"""Deterministic global tensors and the shards different parallel layouts take of them.

Every process can rebuild the same global tensor from its key, so a test can
check any loaded shard exactly against the corresponding slice.
"""

from __future__ import annotations

import zlib
from typing import Dict, List, Sequence, Tuple

import torch

from ckpt_integration import ShardedTensor, ShardedTensorFactory


def global_tensor(key: str, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(*shape, generator=g).to(dtype)


def even_split(n: int, parts: int, index: int) -> Tuple[int, int]:
    size = n // parts
    return index * size, size


def uneven_bounds(sizes: Sequence[int]) -> List[Tuple[int, int]]:
    out, start = [], 0
    for s in sizes:
        out.append((start, s))
        start += s
    return out


def grid_shard(key, shape, rank, grid, dtype=torch.float32, replica_id=0) -> ShardedTensor:
    """Shard of an even 2-D grid ``grid=(rows, cols)``; rank r takes cell (r // cols, r % cols)."""
    rows, cols = grid
    r, c = rank // cols, rank % cols
    full = global_tensor(key, shape, dtype)
    ro, rs = even_split(shape[0], rows, r)
    co, cs = even_split(shape[1], cols, c)
    local = full[ro : ro + rs, co : co + cs].clone()
    return ShardedTensor.from_rank_offsets(key, local, (0, r, rows), (1, c, cols), replica_id=replica_id)


def expected_grid(key, shape, rank, grid, dtype=torch.float32) -> torch.Tensor:
    return grid_shard(key, shape, rank, grid, dtype).data


def layer_stack(key, layers_total, layer_shape, stage, stages, dtype=torch.float32, replica_id=0) -> Dict[str, ShardedTensor]:
    """Per-layer ShardedTensors of one pipeline stage, stacked along a prepended layer axis."""
    full = global_tensor(key, (layers_total, *layer_shape), dtype)
    per = layers_total // stages
    out = {}
    for i in range(per):
        layer = stage * per + i
        out[f"layer{i}"] = ShardedTensor.from_rank_offsets(
            key, full[layer].clone(), (0, layer, layers_total), replica_id=replica_id, prepend_axis_num=1
        )
    return out


def empty_like_request(sd):
    """Same structure with zeroed tensors (so a test sees whether load filled them)."""
    def z(v):
        if isinstance(v, ShardedTensor):
            return ShardedTensor(v.key, torch.zeros_like(v.data), v.dtype, v.local_shape, v.global_shape,
                                 v.global_offset, v.axis_fragmentations, v.replica_id, v.prepend_axis_num,
                                 v.allow_shape_mismatch)
        if isinstance(v, dict):
            return {k: z(x) for k, x in v.items()}
        return v
    return z(sd)


def fused_qkv_factory(key: str, hidden: int, tp_rank: int, tp: int, replica_id=0) -> ShardedTensorFactory:
    """A fused [3*h/tp, hidden] QKV weight stored as separate q/k/v tensors split over TP."""
    parts = {n: global_tensor(f"{key}.{n}", (hidden, hidden)) for n in "qkv"}
    rows = hidden // tp
    local = torch.cat([parts[n][tp_rank * rows : (tp_rank + 1) * rows] for n in "qkv"])

    def build(k, t, rid, _flat):
        q, kk, v = t.chunk(3)
        return {
            n: ShardedTensor.from_rank_offsets(f"{k}.{n}", x, (0, tp_rank, tp), replica_id=rid)
            for n, x in zip("qkv", (q, kk, v))
        }

    def merge(sd):
        return torch.cat([sd["q"], sd["k"], sd["v"]])

    return ShardedTensorFactory(key, local, build, merge, replica_id)


def expected_fused(key: str, hidden: int, tp_rank: int, tp: int) -> torch.Tensor:
    rows = hidden // tp
    return torch.cat([global_tensor(f"{key}.{n}", (hidden, hidden))[tp_rank * rows : (tp_rank + 1) * rows] for n in "qkv"])


def assert_same_state(a, b, where: str = "") -> None:
    """Nested state (dicts, lists, tensors, values) equal exactly: tensors by dtype and ``torch.equal``."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            assert_same_state(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)
