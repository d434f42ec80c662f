"""Flattened shards (``flattened_range``), as a distributed optimizer describes its slices.

A flattened ShardedTensor holds ``flattened_range`` of its row-major flattened local
shard. It is saved as the rectangles it covers, so the checkpoint is an ordinary one:
it loads back into flat shards of any other split, into non-flat shards of any layout,
and DCP reads it (Megatron-Core reading it: tests/test_megatron_compat.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import ShardedTensor as ST
from ckpt_integration.errors import CheckpointingException
from tests.megatron_import import import_megatron

W = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 3  # global [4, 6], TP-split by columns into [4, 3]


def _local(t: int) -> torch.Tensor:
    return W[:, 3 * t:3 * t + 3]


def _flat_request(ranges, tp=2, fill=None, key="w"):
    """Flat shards of every TP local shard, cut at ``ranges`` (a list of (start, stop))."""
    out = []
    for t in range(tp):
        local = W[:, (6 // tp) * t:(6 // tp) * (t + 1)]
        for a, b in ranges:
            data = local.flatten()[a:b].clone() if fill is None else torch.full((b - a,), fill)
            out.append(ST.from_rank_offsets_flat(key, data, tuple(local.shape), (1, t, tp), flattened_range=slice(a, b)))
    return out


@pytest.fixture(scope="module")
def flat_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("flat") / "c")
    ci.save({"w": _flat_request([(0, 5), (5, 12)]), "iteration": 7}, path)
    return path


def test_constructor_checks():
    with pytest.raises(CheckpointingException, match="needs flattened_range"):
        ST.from_rank_offsets_flat("w", torch.ones(5), (4, 3), (1, 0, 2))
    with pytest.raises(CheckpointingException, match="1-D"):
        ST.from_rank_offsets_flat("w", torch.ones(5, 1), (4, 3), flattened_range=slice(0, 5))
    with pytest.raises(CheckpointingException, match="flattened_range length"):
        ST.from_rank_offsets_flat("w", torch.ones(4), (4, 3), flattened_range=slice(0, 5))
    with pytest.raises(CheckpointingException, match=r"0 <= start <= stop <= 12"):
        ST.from_rank_offsets_flat("w", torch.ones(5), (4, 3), flattened_range=slice(10, 15))
    with pytest.raises(CheckpointingException, match="from_rank_offsets_flat"):
        ST.from_rank_offsets("w", torch.ones(3), flattened_range=slice(0, 3))
    st = ST.from_rank_offsets_flat("w", torch.ones(5), (4, 3), (1, 1, 2), flattened_range=slice(3, 8))
    assert st.local_shape == (4, 3) and st.global_shape == (4, 6) and st.global_offset == (0, 3)
    empty = st.without_data()
    empty.init_data("cpu")
    assert empty.data.shape == (5,)


def test_unflattened_boxes_are_views_covering_the_range():
    data = torch.arange(7.0)
    st = ST.from_rank_offsets_flat("w", data, (4, 3), (1, 1, 2), flattened_range=slice(2, 9))
    boxes = st.unflattened()
    assert [(b.global_offset, b.local_shape) for b in boxes] == [((0, 5), (1, 1)), ((1, 3), (2, 3))]
    boxes[1].data.fill_(-1)  # a view into the flat data
    assert torch.equal(data, torch.tensor([0.0, -1, -1, -1, -1, -1, -1]))


def test_saved_as_an_ordinary_checkpoint(flat_ckpt):
    meta = ci.load_tensors_metadata(flat_ckpt)
    assert meta["w"].global_shape == (4, 6) and meta["w"].dtype == torch.float32
    assert torch.equal(ci.load_plain_tensors(flat_ckpt)["w"], W)
    assert ci.load_common_state_dict(flat_ckpt) == {"iteration": 7}


def test_loads_into_non_flat_layouts(flat_ckpt):
    out = ci.load({"whole": ST.from_rank_offsets("w", torch.empty(4, 6)),
                   "rows": ST.from_rank_offsets("w", torch.empty(2, 6), (0, 1, 2), replica_id=1)}, flat_ckpt,
                  validate_access_integrity=False)
    assert torch.equal(out["whole"], W) and torch.equal(out["rows"], W[2:])


@pytest.mark.parametrize("tp, ranges", [(2, [(0, 7), (7, 12)]), (2, [(0, 1), (1, 11), (11, 12)]), (1, [(0, 13), (13, 24)])])
def test_loads_into_other_flat_splits(flat_ckpt, tp, ranges):
    request = _flat_request(ranges, tp=tp, fill=-5.0)
    out = ci.load({"w": request}, flat_ckpt)
    for got, want in zip(out["w"], _flat_request(ranges, tp=tp)):
        assert got.shape == want.data.shape and torch.equal(got, want.data)
    assert all(got is req.data for got, req in zip(out["w"], request))  # filled in place


def test_loads_into_flat_parameter_in_place(flat_ckpt):
    p = torch.nn.Parameter(torch.zeros(10))
    out = ci.load({"p": ST.from_rank_offsets_flat("w", p, (4, 6), flattened_range=slice(7, 17))}, flat_ckpt,
                  validate_access_integrity=False)
    assert out["p"] is p and torch.equal(p.detach(), W.flatten()[7:17])


def test_dcp_reads_it(flat_ckpt):
    import torch.distributed.checkpoint as dcp

    sd = {"w": torch.zeros(4, 6)}
    dcp.load(sd, checkpoint_id=flat_ckpt, no_dist=True)
    assert torch.equal(sd["w"], W)


def test_stacked_layers_flattened(tmp_path):
    layers = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    sd = [ST.from_rank_offsets_flat("l", layers[i].flatten()[a:b].clone(), (3, 4), (0, i, 2), prepend_axis_num=1,
                                    flattened_range=slice(a, b))
          for i in range(2) for a, b in ((0, 6), (6, 12))]
    ci.save({"l": sd}, tmp_path / "c")
    out = ci.load({"l": ST.from_rank_offsets("l", torch.empty(2, 3, 4))}, tmp_path / "c")
    assert torch.equal(out["l"], layers)


def test_empty_range_saves_nothing_for_it(tmp_path):
    full = ST.from_rank_offsets_flat("w", W.flatten().clone(), (4, 6), flattened_range=slice(0, 24))
    empty = ST.from_rank_offsets_flat("w", torch.empty(0), (4, 6), flattened_range=slice(24, 24), replica_id=0)
    assert empty.unflattened() == []
    ci.save({"a": full, "b": empty}, tmp_path / "c")
    assert torch.equal(ci.load_plain_tensors(tmp_path / "c")["w"], W)


# ------------------------------------------------------------------------------------ narrow
def test_narrow_non_flat_like_swiglu_halves(tmp_path):
    # fused [gate; up] weight of 2 TP ranks: each rank's [4, 3] holds 2 gate rows and 2 up rows
    fused = [ST.from_rank_offsets("fc1", torch.arange(12.0).reshape(4, 3) + 100 * t, (0, t, 2)) for t in range(2)]
    gate = [st.narrow(0, 0, 2) for st in fused]
    up = [st.narrow(0, 2, 2) for st in fused]
    assert all(len(g) == 1 for g in gate)
    assert (gate[1][0].local_shape, gate[1][0].global_shape, gate[1][0].global_offset) == ((2, 3), (4, 3), (2, 0))
    assert gate[0][0].data.data_ptr() == fused[0].data.data_ptr()  # a view
    ci.save({"g": [replace(g[0], key="fc1.gate") for g in gate], "u": [replace(u[0], key="fc1.up") for u in up]},
            tmp_path / "c")
    plain = ci.load_plain_tensors(tmp_path / "c")
    rows = [torch.arange(12.0).reshape(4, 3) + 100 * t for t in range(2)]
    assert torch.equal(plain["fc1.gate"], torch.cat([r[:2] for r in rows]))
    assert torch.equal(plain["fc1.up"], torch.cat([r[2:] for r in rows]))


def test_narrow_matches_megatron_for_non_flat():
    mcore = import_megatron("megatron.core.dist_checkpointing")
    t = torch.arange(24.0).reshape(4, 6)
    ours = ST.from_rank_offsets("w", t, (1, 1, 3), (0, 0, 2), replica_id=(0, 1)).narrow(1, 2, 3)[0]
    theirs = mcore.ShardedTensor.from_rank_offsets("w", t, (1, 1, 3), (0, 0, 2), replica_id=(0, 1)).narrow(1, 2, 3)[0]
    for f in ("local_shape", "global_shape", "global_offset", "axis_fragmentations", "replica_id"):
        assert tuple(getattr(ours, f)) == tuple(getattr(theirs, f)), f
    assert torch.equal(ours.data, theirs.data)


@pytest.mark.parametrize("dim, start, length", [(0, 1, 2), (1, 1, 2), (1, 0, 1), (0, 3, 1)])
def test_narrow_flat_pieces_hold_the_overlap(dim, start, length):
    local = torch.arange(12.0).reshape(4, 3)
    a, b = 2, 9
    st = ST.from_rank_offsets_flat("w", local.flatten()[a:b].clone(), (4, 3), (0, 1, 2), flattened_range=slice(a, b))
    pieces = st.narrow(dim, start, length)
    narrowed = local.narrow(dim, start, length).flatten()
    in_range = {int(v) for v in local.flatten()[a:b]}
    expected = [i for i, v in enumerate(narrowed.tolist()) if int(v) in in_range]  # new flat indices in range
    got = []
    for p in pieces:
        assert p.local_shape == tuple(local.narrow(dim, start, length).shape)
        assert torch.equal(p.data, narrowed[p.flattened_range])
        got += list(range(p.flattened_range.start, p.flattened_range.stop))
    assert got == expected
    if dim == 0:
        assert len(pieces) <= 1


def test_narrow_refuses_irregular_grid_and_bad_ranges():
    uneven = ST.from_global_offsets("w", torch.ones(3, 2), (10, 2), (3, 0))
    with pytest.raises(CheckpointingException, match="regular grid"):
        uneven.narrow(0, 0, 1)
    with pytest.raises(CheckpointingException, match="outside the local size"):
        ST.from_rank_offsets("w", torch.ones(3, 2)).narrow(1, 1, 2)
