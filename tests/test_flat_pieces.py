"""Row-aligned ZeRO-1 saves (planning.flat_pieces), every DP rank simulated in one process."""

import math
import random

import pytest

from ckpt_integration.mapping import flat_range_to_boxes
from ckpt_integration.planning.flat_pieces import boxes_per_rank, row_aligned_save, row_unit


def _simulate(shapes, dp):
    numels = [math.prod(s) for s in shapes]
    units = [row_unit(s) for s in shapes]
    total = sum(numels)
    S = max(1, math.ceil(total / dp))
    return numels, S, [row_aligned_save(numels, units, S, r) for r in range(dp)]


def _check(shapes, dp):
    numels, S, plans = _simulate(shapes, dp)
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + n)
    sends = sorted((t.pid, t.src, t.dst, t.lo, t.hi) for p in plans for t in p.sends)
    receives = sorted((t.pid, t.src, t.dst, t.lo, t.hi) for p in plans for t in p.receives)
    assert sends == receives  # every transfer has both ends, computed independently
    for pid, shape in enumerate(shapes):
        ranges = sorted(p.saved[pid] for p in plans if pid in p.saved)
        # the saved ranges tile the param exactly, whole rows each
        pos = 0
        for lo, hi in ranges:
            assert lo == pos and hi > lo
            assert lo % row_unit(shape) == 0 and (hi % row_unit(shape) == 0 or hi == numels[pid])
            pos = hi
        assert pos == numels[pid]
    for r, plan in enumerate(plans):
        held = (min(starts[-1], r * S), min(starts[-1], (r + 1) * S))
        for pid, (lo, hi) in plan.saved.items():
            shape = shapes[pid]
            # one box per rank and 2-D param (at most 2*ndim-3 for N-D), against up to 3 (2*ndim-1) unaligned
            assert boxes_per_rank(shape, lo, hi) <= max(1, 2 * len(shape) - 3)
            # what it saves = what it holds of [lo, hi) + exactly what it receives
            own = max(0, min(hi, held[1] - starts[pid]) - max(lo, held[0] - starts[pid]))
            got = sum(t.hi - t.lo for t in plan.receives if t.pid == pid)
            assert own + got == hi - lo
            assert all(t.src > r for t in plan.receives)
        for t in plan.sends:
            assert t.dst < r and t.hi - t.lo < row_unit(shapes[t.pid])  # less than one row moves
            assert held[0] <= starts[t.pid] + t.lo < starts[t.pid] + t.hi <= held[1]
    return plans


def test_gpt_like_stage_rows_align_and_boxes_drop_to_one():
    h = 64
    layer = [(1, 3 * h // 2, h), (1, 3 * h // 2), (1, h), (1, h, h // 2), (1, h), (1, 2 * h, h), (1, h, 2 * h), (1, h)]
    shapes = layer * 3
    for dp in (1, 2, 3, 7, 16, 64, 300):
        plans = _check(shapes, dp)
        numels, S, _ = _simulate(shapes, dp)
        # before: flat_range_to_boxes of every held range
        starts = [0]
        for n in numels:
            starts.append(starts[-1] + n)
        before = after = 0
        for r in range(dp):
            a, b = min(starts[-1], r * S), min(starts[-1], (r + 1) * S)
            for pid, s in enumerate(shapes):
                lo, hi = max(a, starts[pid]) - starts[pid], min(b, starts[pid + 1]) - starts[pid]
                if hi > lo:
                    before += len(flat_range_to_boxes(s[1:], lo, hi))
            after += sum(boxes_per_rank(shapes[pid][1:], lo, hi) for pid, (lo, hi) in plans[r].saved.items())
        assert after <= before
        if dp >= 64:  # slices much smaller than the params: ~3 boxes each before, ~1 after
            assert after * 2 < before, (dp, before, after)


def test_slices_narrower_than_a_row_gather_onto_the_row_owner():
    # 40 DP ranks over a 3 x 100 param: several ranks hold parts of one row and save nothing
    plans = _check([(3, 100), (7,)], 40)
    savers = [r for r, p in enumerate(plans) if 0 in p.saved]
    assert len(savers) == 3  # one per row
    assert any(len(p.receives) > 1 for p in plans)


@pytest.mark.parametrize("seed", range(30))
def test_random_layouts(seed):
    rng = random.Random(seed)
    shapes = []
    for _ in range(rng.randint(1, 12)):
        nd = rng.randint(0, 4)
        shapes.append(tuple(rng.randint(0 if rng.random() < 0.05 else 1, 9) for _ in range(nd)))
    _check(shapes, rng.randint(1, 50))


def test_empty_ranks_and_bad_shard_size():
    plans = _check([(2, 2)], 9)  # 4 elements, 9 ranks: ranks 4..8 hold nothing
    assert not any(p.saved or p.sends or p.receives for p in plans[4:])
    with pytest.raises(ValueError, match="shard_size"):
        row_aligned_save([4], [2], 0, 0)


def test_compact_dcp_metadata_pickle_rebuilds_the_same_objects(tmp_path):
    """``.metadata`` written by :func:`dumps_dcp_metadata`: the same DCP objects through plain
    ``pickle.load`` (as DCP reads it) and our restricted unpickler, in about half the bytes."""
    import io
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )

    from ckpt_integration.storage.safe_pickle import load_dcp_metadata
    from ckpt_integration.storage.torch_dist import dumps_dcp_metadata

    sd, st = {}, {}
    for j in range(5):
        key = f"optimizer.state.exp_avg.layers.{j}.weight"
        chunks = []
        for i in range(200):
            off = torch.Size((j, i * 3, 0))
            chunks.append(ChunkStorageMetadata(off, torch.Size((1, 3, 64))))
            st[MetadataIndex(key, off, index=i % 2)] = _StorageInfo(f"__{i}_0.distcp", i * 1000 + j, 777 + i)
        sd[key] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size((5, 600, 64)), chunks)
    sd["obj"] = BytesStorageMetadata()
    st[MetadataIndex("obj")] = _StorageInfo("__0_0.distcp", 5, 6)
    md = Metadata(state_dict_metadata=sd, storage_data=st, planner_data={k: (k,) for k in sd})
    data = dumps_dcp_metadata(md)
    assert len(data) * 1.6 < len(pickle.dumps(md))
    for back in (pickle.loads(data), load_dcp_metadata(io.BytesIO(data))):
        assert back.state_dict_metadata == md.state_dict_metadata and back.planner_data == md.planner_data
        assert list(back.storage_data.items()) == list(md.storage_data.items())
        assert [i.index for i in back.storage_data] == [i.index for i in md.storage_data]
        chunk = back.state_dict_metadata["optimizer.state.exp_avg.layers.3.weight"].chunks[7]
        assert type(chunk.offsets) is torch.Size and type(chunk.sizes) is torch.Size
        assert all(type(i.offset) is torch.Size for i in back.storage_data if i.offset is not None)


@pytest.mark.parametrize("seed", range(40))
def test_overlap_fast_path_agrees_with_the_sweep(seed):
    """find_overlaps' flat-range shortcut only ever answers "disjoint" when the sweep agrees."""
    from ckpt_integration.planning import integrity
    from ckpt_integration.planning.shards import ShardMeta

    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
    boxes = []
    # row-range pieces (optionally per column block), some of them overlapping or out of line
    ncol = rng.choice([1, 2, 3]) if len(shape) >= 2 and shape[-1] % 3 == 0 else 1
    width = shape[-1] // ncol
    for c in range(ncol):
        flat = math.prod(shape[:-1]) * width if len(shape) >= 2 else shape[0]
        cuts = sorted(rng.sample(range(flat + 1), min(flat + 1, rng.randint(2, 5))))
        for lo, hi in zip(cuts, cuts[1:]):
            if len(shape) >= 2:
                lo, hi = lo // width * width, hi // width * width  # whole rows of the column block
                sub = shape[:-1] + (width,)
            else:
                sub = shape
            for off, size in flat_range_to_boxes(sub, lo, hi):
                if len(shape) >= 2:
                    off, size = off[:-1] + (c * width,), size[:-1] + (width,)
                boxes.append((off, size))
    if rng.random() < 0.5 and boxes:  # a stray box somewhere
        o = tuple(rng.randint(0, s - 1) for s in shape)
        boxes.append((o, tuple(rng.randint(1, s - x) for s, x in zip(shape, o))))
    metas = [ShardMeta("k", "tensor", i, "float32", shape, o, n, (0,), 0) for i, (o, n) in enumerate(boxes)]
    found: list = []
    items = [(m.offsets, tuple(a + b for a, b in zip(m.offsets, m.sizes)), m) for m in metas]
    integrity._sweep(items, tuple(range(len(shape))), 1000, found)
    fast = integrity._disjoint_flat_ranges(metas, shape)
    assert not (fast and found), (shape, boxes, found)
    assert bool(integrity.find_overlaps(metas)) == bool(found)
