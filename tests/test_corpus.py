"""Checkpoints written by earlier versions keep loading, exactly and verified (tests/corpus.py).

Every set under ``tests/data/corpus/format<N>/`` was written once and is never rewritten: each
test here reads the committed files (copied, so a failed test cannot damage the corpus) and
compares every value exactly with the arithmetic that produced it. Formats 4 and 5 load as
they are; formats 1-3 (JSON item tables; written by 99bfb91's writer through its format switches,
format 1 as the format-2 set without block records and save token) are refused by every load
with an error naming ``ckpt-integration convert``, which turns them into the current format.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import ShardedObject, ShardedTensor
from ckpt_integration.execution.load import last_load_stats
from ckpt_integration.tools.verify import verify_checkpoint
from tests.corpus import COMMON, CONTENT_METADATA, CORPUS_DIR, SHAPES, SETS, expected_full, expected_object, format_of
from tests.dist_utils import run_distributed

ALL_SETS = sorted(str(p.relative_to(CORPUS_DIR)) for p in CORPUS_DIR.glob("format*/*") if p.is_dir())
# manifest formats loads refuse (converted by ``ckpt-integration convert``)
LEGACY = (1, 2, 3)
CORPUS = [n for n in ALL_SETS if format_of(CORPUS_DIR / n) not in LEGACY]
LEGACY_SETS = [n for n in ALL_SETS if format_of(CORPUS_DIR / n) in LEGACY]
# the first format whose saves record fingerprints (verify_state checks them)
FINGERPRINTED = 5


def test_the_corpus_holds_every_set_of_the_current_format():
    """A format change without a corpus set of its own fails here (``python -m tests.corpus write``)."""
    from ckpt_integration.storage.checkpoint_dir import MANIFEST_VERSION, ZARR_MANIFEST_VERSION

    for name, (backend, _) in SETS.items():  # (zarr checkpoints are written in format 5: zarr_index.json)
        fmt = ZARR_MANIFEST_VERSION if backend == "zarr" else MANIFEST_VERSION
        assert f"format{fmt}/{name}" in CORPUS, (name, CORPUS)
    assert "format4/torch_dist-sync" in CORPUS  # written by 1714cad, the first corpus
    assert [format_of(CORPUS_DIR / n) for n in LEGACY_SETS] == [1, 2, 3]


def _copy(name: str, tmp_path) -> str:
    dst = tmp_path / name.replace("/", "-")
    shutil.copytree(CORPUS_DIR / name, dst)
    return str(dst)


@pytest.mark.parametrize("name", CORPUS)
def test_corpus_loads_whole_exactly_and_verifies(name, tmp_path):
    path = _copy(name, tmp_path)
    fmt = format_of(CORPUS_DIR / name)
    tensors = ci.load_plain_tensors(path, verify_state=fmt >= FINGERPRINTED)
    assert sorted(tensors) == sorted(SHAPES)
    for key in SHAPES:
        want = expected_full(key)
        assert tensors[key].dtype == want.dtype and torch.equal(tensors[key], want), key
    if fmt >= FINGERPRINTED:
        assert last_load_stats["state_checked_keys"] == len(SHAPES) and last_load_stats["state_unchecked_keys"] == 0
    common = ci.load_common_state_dict(path)
    assert {k: common[k] for k in COMMON} == COMMON
    assert ci.load_content_metadata(path) == CONTENT_METADATA
    report = verify_checkpoint(path, state=fmt >= FINGERPRINTED)
    assert report.ok, report.format()
    assert report.checksums_available


def _request(rank: int) -> dict:
    """Another layout than the saved one: 2 ranks, no DP; rows and columns swapped, two layers a
    rank, ZeRO-1 over the whole (un-split) tensor."""
    sd = {
        "embedding.weight": ShardedTensor.from_rank_offsets("embedding.weight", torch.full((64, 8), -1.0), (1, rank, 2)),
        "decoder.linear.weight": ShardedTensor.from_rank_offsets(
            "decoder.linear.weight", torch.full((12, 32), -1.0, dtype=torch.bfloat16), (0, rank, 2)),
        "decoder.norm.weight": ShardedTensor.from_rank_offsets("decoder.norm.weight", torch.zeros(24), replica_id=rank),
        "decoder.stack": ShardedTensor.from_rank_offsets(
            "decoder.stack", torch.zeros(2, 8, 8, dtype=torch.float16), (0, rank, 2)),
        "counts": ShardedTensor.from_rank_offsets("counts", torch.zeros(10, dtype=torch.int64), replica_id=rank),
        "rng0": ShardedObject("rng", None, (2,), (0,), replica_id=rank),
        "rng1": ShardedObject("rng", None, (2,), (1,), replica_id=rank),
        "optimizer.exp_avg": ShardedTensor.from_rank_offsets_flat(
            "optimizer.state.exp_avg.embedding.weight", torch.zeros(512), (64, 16),
            flattened_range=slice(rank * 512, (rank + 1) * 512), replica_id=0),
    }
    return sd


def _expected(rank: int) -> dict:
    return {
        "embedding.weight": expected_full("embedding.weight")[:, rank * 8:(rank + 1) * 8],
        "decoder.linear.weight": expected_full("decoder.linear.weight")[rank * 12:(rank + 1) * 12],
        "decoder.norm.weight": expected_full("decoder.norm.weight"),
        "decoder.stack": expected_full("decoder.stack")[rank * 2:(rank + 1) * 2],
        "counts": expected_full("counts"),
        "rng0": expected_object(0),
        "rng1": expected_object(1),
        "optimizer.exp_avg": expected_full("optimizer.state.exp_avg.embedding.weight").reshape(-1)[rank * 512:(rank + 1) * 512],
    }


def _resharded_worker(rank, world, paths):
    for path in paths:
        fingerprinted = format_of(__import__("pathlib").Path(path)) >= FINGERPRINTED
        for strategy in ("auto", "local", "fully_parallel"):
            out = ci.load(_request(rank), path, load_strategy=strategy, verify_state=fingerprinted)
            want = _expected(rank)
            for key, value in want.items():
                got = out[key]
                if isinstance(value, torch.Tensor):
                    assert got.dtype == value.dtype and torch.equal(got, value), (path, strategy, key)
                else:
                    assert got == value, (path, strategy, key, got)
            assert {k: out[k] for k in COMMON} == COMMON, (path, strategy)
            if fingerprinted:
                assert last_load_stats["state_unchecked_keys"] == 0, (path, strategy, last_load_stats)


@pytest.mark.slow
def test_corpus_loads_resharded_exactly_with_every_strategy(tmp_path):
    """Saved by 4 ranks (TP2 x DP2, ZeRO-1), loaded by 2 ranks in another layout, every set, three
    strategies: every tensor, object and common value exact, fingerprints checked where recorded."""
    paths = [_copy(name, tmp_path) for name in CORPUS]
    run_distributed(_resharded_worker, 2, paths, timeout=300)


def test_a_corpus_set_with_a_flipped_byte_is_refused(tmp_path):
    """The corpus test is not vacuous: a flipped data byte in a committed set fails the load."""
    path = _copy("format5/torch_dist-sync", tmp_path)
    data = os.path.join(path, "__0_0.distcp")
    raw = bytearray(open(data, "rb").read())
    raw[len(raw) // 2] ^= 0x40
    open(data, "wb").write(bytes(raw))
    with pytest.raises(ci.CorruptCheckpointError, match="__0_0.distcp"):
        ci.load_plain_tensors(path)


def _tree_bytes(path: str) -> dict:
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}


@pytest.mark.parametrize("name", LEGACY_SETS)
def test_an_older_manifest_format_is_refused_naming_convert_which_turns_it_into_the_current_one(name, tmp_path):
    """Manifest formats 1-3: every way in refuses with UnsupportedCheckpointError naming the command
    (load, the tensors, the common state, verify, a collective open); ``ckpt-integration convert OLD
    NEW --to torch_dist`` reads it (every byte checked against the digests it records: whole-item
    CRC32s in format 1, block CRC32s in 2, XXH3-64 in 3), leaves it byte for byte unchanged and writes
    the current format, which then loads exactly, with fingerprints, and verifies."""
    from ckpt_integration.cli import main
    from ckpt_integration.errors import UnsupportedCheckpointError
    from ckpt_integration.storage.checkpoint_dir import MANIFEST_VERSION

    path = _copy(name, tmp_path)
    before = _tree_bytes(path)
    refused = rf"manifest format {format_of(CORPUS_DIR / name)}.*ckpt-integration convert {path} NEW_DIR --to torch_dist"
    for attempt in (lambda: ci.load_plain_tensors(path), lambda: ci.load_common_state_dict(path),
                    lambda: ci.load({"counts": ShardedTensor.from_rank_offsets("counts", torch.zeros(10, dtype=torch.int64))}, path),
                    lambda: ci.open_checkpoint(path)):
        with pytest.raises(UnsupportedCheckpointError, match=refused):
            attempt()
    report = verify_checkpoint(path)  # (verify reports instead of raising)
    assert not report.ok and [p["file"] for p in report.problems] == ["manifest.json"], report.format()
    assert "ckpt-integration convert" in report.problems[0]["message"]
    out = str(tmp_path / "converted")
    assert main(["convert", path, out, "--to", "torch_dist"]) == 0
    assert _tree_bytes(path) == before
    assert format_of(__import__("pathlib").Path(out)) == MANIFEST_VERSION
    tensors = ci.load_plain_tensors(out, verify_state=True)
    assert sorted(tensors) == sorted(SHAPES)
    for key in SHAPES:
        want = expected_full(key)
        assert tensors[key].dtype == want.dtype and torch.equal(tensors[key], want), key
    assert last_load_stats["state_checked_keys"] == len(SHAPES)
    common = ci.load_common_state_dict(out)
    assert {k: common[k] for k in COMMON} == COMMON
    assert ci.load_content_metadata(out) == CONTENT_METADATA
    objs = ci.load({f"rng{t}": ShardedObject("rng", None, (2,), (t,)) for t in (0, 1)}, out)
    assert [objs["rng0"], objs["rng1"]] == [expected_object(0), expected_object(1)]
    report = verify_checkpoint(out, state=True)
    assert report.ok, report.format()


@pytest.mark.parametrize("name", LEGACY_SETS)
def test_converting_a_damaged_older_checkpoint_fails_naming_the_damage(name, tmp_path):
    """The conversion is no way around the checks: a flipped data byte (format 1: found by the
    whole-item CRC32; 2 and 3: by the block digest) or a malformed record of the old JSON tables
    fails it with CorruptCheckpointError naming the file, and no output is left."""
    import json

    from ckpt_integration.cli import main
    from ckpt_integration.tools import convert_checkpoint

    path = _copy(name, tmp_path)
    data = os.path.join(path, "__1_0.distcp")
    raw = bytearray(open(data, "rb").read())
    raw[len(raw) // 2] ^= 0x10
    open(data, "wb").write(bytes(raw))
    out = str(tmp_path / "converted")
    with pytest.raises(ci.CorruptCheckpointError, match="__1_0.distcp"):
        convert_checkpoint(path, "torch_dist", out)
    assert not os.path.exists(out)
    fresh = _copy(name, tmp_path / "again")
    man_path = os.path.join(fresh, "manifest.json")
    man = json.loads(open(man_path).read())
    table = "blocks" if man.get("blocks") else "items"
    first = sorted(man[table])[0]
    man[table][first] = [1, 2] if table == "blocks" else "not a digest"
    open(man_path, "w").write(json.dumps(man))
    with pytest.raises(ci.CorruptCheckpointError, match=rf"manifest.json is damaged: .*{first}"):
        convert_checkpoint(fresh, "torch_dist", out)
    assert main(["convert", fresh, out, "--to", "torch_dist"]) != 0
    assert not os.path.exists(out)
