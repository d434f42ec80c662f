"""Checkpoints written by earlier versions keep loading, exactly and verified (tests/corpus.py).

Every set under ``tests/data/corpus/format<N>/`` was written once, by the version that introduced
format N, and is never rewritten: each test here reads the committed files (copied, so a
failed test cannot damage the corpus) and compares every value exactly with the arithmetic
that produced it.
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

CORPUS = sorted(str(p.relative_to(CORPUS_DIR)) for p in CORPUS_DIR.glob("format*/*") if p.is_dir())
# the first format whose saves record fingerprints (verify_state checks them)
FINGERPRINTED = 5


def test_the_corpus_holds_every_set_of_the_current_format():
    """A format change without a corpus set of its own fails here (``python -m tests.corpus write``)."""
    from ckpt_integration.storage.checkpoint_dir import MANIFEST_VERSION

    for name in SETS:
        assert f"format{MANIFEST_VERSION}/{name}" in CORPUS, (name, CORPUS)
    assert "format4/torch_dist-sync" in CORPUS  # written by 1714cad, the first corpus


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
