"""zarr backend layout: bounded chunk counts for uneven shards, and keys that are safe paths.

Uneven shards (a 50257-row vocabulary over TP=2 or 3) used to make the chunk
shape the gcd of all shard borders, i.e. one chunk file per row. Chunks are now
coarsened to about ``min(1 MiB, tensor / 64)``; a chunk on a shard border is
assembled and written by one owner rank. Keys become paths, so keys that would
leave the checkpoint or collide are refused on save, and an index whose keys
point outside the checkpoint is refused on load.
"""

from __future__ import annotations

import itertools
import json
import math
import os

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import CorruptCheckpointError, ShardedObject, ShardedTensor
from ckpt_integration.errors import UnsafeCheckpointError
from ckpt_integration.cli import main
from ckpt_integration.planning.boxes import Box
from tests.damage import write_zarr_index
from tests.dist_utils import run_distributed

zb = pytest.importorskip("ckpt_integration.storage.zarr_backend")
pytest.importorskip("zarr")

SHAPE = (20001, 8)
FULL = torch.arange(math.prod(SHAPE), dtype=torch.float32).reshape(SHAPE)
SPLIT = (0, 10001, 20001)  # 2 ranks, uneven: the old chunk shape was (1, 8) -> 20001 chunk files


def _rows(bounds, i, full=FULL, key="w"):
    lo, hi = bounds[i], bounds[i + 1]
    return ShardedTensor.from_global_offsets(key, full[lo:hi].clone(), tuple(full.shape), (lo, 0))


def _even_bounds(n, parts):
    """Row bounds of ``parts`` nearly equal parts (first ones one row longer), as TP splits a vocabulary."""
    sizes = [n // parts + (i < n % parts) for i in range(parts)]
    return [0] + list(itertools.accumulate(sizes))


def _chunk_files(path, key="w"):
    return sorted(
        os.path.relpath(os.path.join(d, f), os.path.join(path, key))
        for d, _, fs in os.walk(os.path.join(path, key))
        for f in fs
        if f != "zarr.json"
    )


# --------------------------------------------------------------------------- chunk shape rule
def test_aligned_shards_keep_the_shard_grid():
    boxes = [Box((4 * r, 3 * c), (4, 3)) for r in range(2) for c in range(2)]
    assert zb.chunk_shape_for((8, 6), boxes, 4) == (4, 3)
    big = [Box((r * 4096, 0), (4096, 4096)) for r in range(2)]
    assert zb.chunk_shape_for((8192, 4096), big, 2) == (4096, 4096)  # no coarsening, no border chunks


@pytest.mark.parametrize("rows,cols,tp,itemsize", [(20001, 8, 2, 4), (50257, 64, 2, 2), (50257, 64, 3, 2), (50257, 1024, 3, 4)])
def test_uneven_row_split_has_a_bounded_chunk_count(rows, cols, tp, itemsize):
    bounds = _even_bounds(rows, tp)
    boxes = [Box((bounds[i], 0), (bounds[i + 1] - bounds[i], cols)) for i in range(tp)]
    assert zb.aligned_chunk_shape((rows, cols), boxes) == (1, cols)  # the old rule: one row per chunk
    chunks = zb.chunk_shape_for((rows, cols), boxes, itemsize)
    total = rows * cols * itemsize
    count = math.prod(math.ceil(n / c) for n, c in zip((rows, cols), chunks))
    assert count <= max(64, math.ceil(total / zb.MIN_CHUNK_BYTES)) + 1, (chunks, count)
    assert math.prod(chunks) * itemsize >= min(zb.MIN_CHUNK_BYTES, total / 64)
    # only the chunks on the tp - 1 shard borders are shared
    plan = zb.plan_chunk_writes((rows, cols), chunks, [(b, i) for i, b in enumerate(boxes)])
    assert len(plan) <= tp - 1


def test_uneven_column_split_and_2d_grid_chunk_only_along_cut_axes():
    b = _even_bounds(50257, 3)
    cols = [Box((0, b[i]), (64, b[i + 1] - b[i])) for i in range(3)]
    assert zb.chunk_shape_for((64, 50257), cols, 4)[0] == 64  # the uncut axis stays whole
    grid = [Box((r0, c0), (r1 - r0, c1 - c0)) for r0, r1 in [(0, 1001), (1001, 2001)] for c0, c1 in [(0, 999), (999, 2001)]]
    chunks = zb.chunk_shape_for((2001, 2001), grid, 4)
    assert 100 < chunks[0] < 2001 and 100 < chunks[1] < 2001  # square-ish: few chunks on the borders


def test_border_chunks_and_interiors_tile_the_array_exactly():
    """Every chunk is either wholly inside one shard's interior or a border chunk with full pieces."""
    shape, chunks = (23, 17, 5), (4, 6, 5)
    cuts = [(0, 7, 11, 23), (0, 5, 17), (0, 5)]
    boxes = [Box((a0, b0, c0), (a1 - a0, b1 - b0, c1 - c0))
             for (a0, a1), (b0, b1), (c0, c1) in itertools.product(*[list(zip(c, c[1:])) for c in cuts])]
    writers = [(box, i % 3) for i, box in enumerate(boxes)]
    plan = zb.plan_chunk_writes(shape, chunks, writers)
    seen = {}
    for box, rank in writers:
        inner = zb.interior_box(box, shape, chunks)
        if inner is not None:
            first = [o // c for o, c in zip(inner.offsets, chunks)]
            last = [-(-e // c) for e, c in zip(inner.ends, chunks)]
            for coords in itertools.product(*[range(f, l) for f, l in zip(first, last)]):
                assert coords not in seen and coords not in plan
                seen[coords] = rank
    for coords, chunk in plan.items():
        assert sum(p.numel for p, _ in chunk.pieces) == chunk.box.numel
        owner_piece = [p for p, r in chunk.pieces if p.offsets == chunk.box.offsets]
        assert owner_piece and chunk.owner in {r for p, r in chunk.pieces if p.offsets == chunk.box.offsets}
        seen[coords] = chunk.owner
    grid = [range(math.ceil(n / c)) for n, c in zip(shape, chunks)]
    assert set(seen) == set(itertools.product(*grid))


# --------------------------------------------------------------------------- saves and loads
def test_single_process_uneven_save_round_trips(tmp_path):
    path = str(tmp_path / "one")
    bounds = (0, 7000, 13001, 20001)  # gcd 1: border chunks written by the one process
    ci.save({f"w{i}": _rows(bounds, i) for i in range(3)}, path, sharded_strategy="zarr")
    assert len(_chunk_files(path)) == 64
    out = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(SHAPE))}, path)
    assert torch.equal(out["w"], FULL)
    assert main(["verify", path, "-q"]) == 0


# border pieces of every dtype travel between the writers (pickling a float8 or uint16/32/64
# tensor fails in torch: the save died on one rank with AttributeError, the other with a gloo error)
ODD = {f"w_{dt}": FULL.to(getattr(torch, dt)) for dt in ("float8_e5m2", "uint16", "uint64", "bool")}


def _save_two_ranks(rank, world, path):
    ci.save({"w": _rows(SPLIT, rank), "obj": ShardedObject("obj", rank, (world,), (rank,)),
             **{k: _rows(SPLIT, rank, full=v, key=k) for k, v in ODD.items()}}, path, sharded_strategy="zarr")


def _load_three_ranks(rank, world, path):
    bounds = _even_bounds(SHAPE[0], world)
    lo, hi = bounds[rank], bounds[rank + 1]
    req = {"w": ShardedTensor.from_global_offsets("w", torch.full((hi - lo, SHAPE[1]), -1.0), SHAPE, (lo, 0))}
    out = ci.load(req, path)
    assert torch.equal(out["w"], FULL[lo:hi]), rank


def test_two_rank_uneven_save_has_few_chunk_files_and_reshards_exactly(tmp_path):
    path = str(tmp_path / "two")
    run_distributed(_save_two_ranks, 2, path)
    files = _chunk_files(path)
    assert len(files) == 64, len(files)  # was 20001 (one per row)
    with open(os.path.join(path, "zarr_index.json")) as f:
        index = json.load(f)
    chunks = index["tensors"]["w"]["chunks"]
    assert chunks[1] == 8 and chunks[0] > 1 and all(f"w/{name}" in index["files"] for name in files)
    out = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(SHAPE))}, path)  # 1 process
    assert torch.equal(out["w"], FULL)
    odd = ci.load({k: ShardedTensor.from_rank_offsets(k, torch.empty(SHAPE, dtype=v.dtype)) for k, v in ODD.items()}, path)
    assert all(torch.equal(odd[k].view(torch.uint8), v.view(torch.uint8)) for k, v in ODD.items())
    run_distributed(_load_three_ranks, 3, path)
    assert main(["verify", path, "-q"]) == 0


def _save_vocab_three_ranks(rank, world, path, full):
    bounds = _even_bounds(full.shape[0], world)
    ci.save({"emb": _rows(bounds, rank, full, "emb")}, path, sharded_strategy="zarr")


def test_vocabulary_over_tp3_round_trips_in_bf16(tmp_path):
    path = str(tmp_path / "vocab")
    full = torch.randn(50257, 16).to(torch.bfloat16)
    run_distributed(_save_vocab_three_ranks, 3, path, full)
    assert len(_chunk_files(path, "emb")) <= 64
    out = ci.load({"emb": ShardedTensor.from_rank_offsets("emb", torch.empty(50257, 16, dtype=torch.bfloat16))}, path)
    assert torch.equal(out["emb"], full)


def test_checkpoint_with_the_old_row_chunks_still_loads(tmp_path, monkeypatch):
    """Written as before (shard-aligned gcd chunks, format-2 index without zarr.json records)."""
    path = str(tmp_path / "old")
    monkeypatch.setattr(zb.index, "MIN_CHUNK_BYTES", 0)  # min(0, ...): always the aligned grid, as the old rule
    small = FULL[:301]
    ci.save({f"w{i}": _rows((0, 151, 301), i, small) for i in range(2)}, path, sharded_strategy="zarr")
    monkeypatch.undo()
    index_path = os.path.join(path, "zarr_index.json")
    with open(index_path) as f:
        index = json.load(f)
    assert index["tensors"]["w"]["chunks"] == [1, 8]
    index["format"] = 2
    index["files"] = {k: v for k, v in index["files"].items() if not k.endswith("zarr.json")}
    write_zarr_index(path, index, recorded=False)
    req = {"w": ShardedTensor.from_global_offsets("w", torch.empty(100, 8), (301, 8), (120, 0))}
    assert torch.equal(ci.load(req, path, validate_access_integrity=False)["w"], small[120:220])
    assert main(["verify", path, "-q"]) == 0


# --------------------------------------------------------------------------- keys as paths
@pytest.mark.parametrize("key", ["decoder.layers.0.weight", "optimizer.state.exp_avg.x", "model/layer.w"])
def test_ordinary_keys_are_stored_as_directories(tmp_path, key):
    path = str(tmp_path / "ok")
    t = torch.arange(6.0).reshape(2, 3)
    ci.save({"t": ShardedTensor.from_rank_offsets(key, t)}, path, sharded_strategy="zarr")
    assert os.path.isfile(os.path.join(path, *key.split("/"), "zarr.json"))
    assert torch.equal(ci.load({"t": ShardedTensor.from_rank_offsets(key, torch.empty(2, 3))}, path)["t"], t)


@pytest.mark.parametrize(
    "keys,why",
    [
        (["../esc"], r"'\.\.'"),
        (["a/../../esc"], r"'\.\.'"),
        (["/abs/w"], "absolute"),
        (["a//b"], "empty path segment"),
        (["a\\b"], "backslash"),
        (["metadata.json"], "file of the checkpoint directory"),
        (["zarr_index.json/x"], "file of the checkpoint directory"),
        (["x", "x/c/0"], r"inside the directory of tensor 'x'"),
        (["model/" + "k" * 300], "300 bytes long"),  # (was a raw OSError "File name too long")
    ],
)
def test_unsafe_or_colliding_keys_are_refused_before_writing(tmp_path, keys, why):
    path = tmp_path / "ck"
    state = {f"t{i}": ShardedTensor.from_rank_offsets(k, torch.ones(2)) for i, k in enumerate(keys)}
    with pytest.raises(ci.CheckpointingException, match=why) as e:
        ci.save(state, str(path), sharded_strategy="zarr")
    assert repr(keys[-1]) in str(e.value) or repr(keys[0]) in str(e.value)
    assert not (tmp_path / "esc").exists() and not os.path.exists("/abs")
    assert not path.exists() or not any(f.endswith("zarr.json") for _, _, fs in os.walk(path) for f in fs)


def test_unsafe_object_key_is_refused(tmp_path):
    with pytest.raises(ci.CheckpointingException, match=r"object key '\.\./obj/shard_0_1'"):
        ci.save({"o": ShardedObject("../obj", 1, (1,), (0,))}, str(tmp_path / "ck"), sharded_strategy="zarr")
    assert not (tmp_path / "obj").exists()


@pytest.fixture
def small_ckpt(tmp_path):
    path = tmp_path / "ck"
    ci.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(3)), "o": ShardedObject("o", 5, (1,), (0,))},
            str(path), sharded_strategy="zarr")
    return path


def _edit_index(path, edit):
    p = path / "zarr_index.json"
    index = json.loads(p.read_text())
    edit(index)
    write_zarr_index(path, index)


@pytest.mark.parametrize("section", ["tensors", "objects"])
def test_index_pointing_outside_the_checkpoint_is_refused(small_ckpt, tmp_path, capsys, section):
    outside = tmp_path / "outside"
    (outside / "c").mkdir(parents=True)

    def edit(index):
        if section == "tensors":
            index["tensors"]["../outside"] = index["tensors"].pop("w")
        else:
            index["objects"] = ["../outside/secret"]

    _edit_index(small_ckpt, edit)
    with pytest.raises(UnsafeCheckpointError, match=r"zarr_index\.json.*'\.\./outside"):
        ci.load_plain_tensors(str(small_ckpt))
    assert main(["verify", str(small_ckpt)]) == 1
    assert "outside the checkpoint directory" in capsys.readouterr().out


def test_index_key_through_a_symlink_out_of_the_checkpoint_is_refused(small_ckpt, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", small_ckpt / "link")
    _edit_index(small_ckpt, lambda index: index["tensors"].__setitem__("link/w", index["tensors"].pop("w")))
    with pytest.raises(UnsafeCheckpointError, match="resolves to"):
        ci.load_plain_tensors(str(small_ckpt))


def test_damaged_index_entry_is_a_corrupt_checkpoint(small_ckpt):
    _edit_index(small_ckpt, lambda index: index["tensors"]["w"].__setitem__("dtype", "load"))
    with pytest.raises(CorruptCheckpointError, match=r"zarr_index\.json is damaged.*'w'"):
        ci.load_plain_tensors(str(small_ckpt))


def test_object_file_symlinked_out_of_the_checkpoint_is_refused(small_ckpt, tmp_path):
    os.remove(small_ckpt / "o" / "shard_0_1.pt")
    (tmp_path / "secret.pt").write_bytes(b"x")
    os.symlink(tmp_path / "secret.pt", small_ckpt / "o" / "shard_0_1.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"object key 'o/shard_0_1' resolves to"):
        ci.load({"o": ShardedObject("o", None, (1,), (0,))}, str(small_ckpt))
