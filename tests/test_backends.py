"""The typed storage backends (storage/opened.py): capabilities instead of name comparisons,
one reader interface, and a clear error for a backend this library cannot read."""

from __future__ import annotations

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration.errors import CheckpointingException
from ckpt_integration.planning.boxes import Box
from ckpt_integration.storage import opened as backends
from ckpt_integration.tools import inspect_checkpoint
from ckpt_integration.storage.filesystem import locate


@pytest.mark.parametrize("name", ["torch_dist", "zarr"])
def test_every_backend_gives_the_same_reader_interface(tmp_path, name):
    w = torch.arange(48.0).reshape(6, 8)
    path = tmp_path / name
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", w), "o": ci.ShardedObject("o", {"x": 1}, (1,), (0,))},
            str(path), sharded_strategy=name)
    ck = locate(path)
    be = backends.backend_of(ck)
    assert be is backends.BACKENDS[name] and be.name == name
    assert be.dcp_metadata == (name == "torch_dist") and be.mapped_chunks == (name == "torch_dist")
    md = be.read_metadata(ck, False)
    assert sorted(md.state_dict_metadata) == ["o/shard_0_1", "w"]
    with be.open_reader(ck, md) as reader:
        for member in ("metadata", "chunks", "validate_tensor", "read_region", "read_bytes", "close"):
            assert hasattr(reader, member), member
        reader.validate_tensor("w")
        out = torch.zeros(3, 4)
        region = Box((2, 4), (3, 4))
        for chunk in reader.chunks["w"]:
            reader.read_region("w", chunk, region, out, torch.float32)
        assert torch.equal(out, w[2:5, 4:8])
    # inspect reports the block digests each backend records
    report = inspect_checkpoint(str(path))
    assert report["backend"] == name
    assert report["manifest"]["block_hash"] == ("crc32" if name == "zarr" else "xxh3_64")
    assert {s["offsets"][0] for s in report["tensors"]["w"]["shards"]} == {0}


def test_unknown_backend_is_refused_by_name():
    with pytest.raises(CheckpointingException, match="unknown checkpoint backend 'tensorstore'"):
        backends.backend_named("tensorstore")


def test_every_backend_reads_what_it_writes():
    """The read side (storage.opened) and the save side (execution.save) name the same backends,
    and what the save plans for each agrees with what the reader can do."""
    from ckpt_integration.execution.save import SAVE_BACKENDS

    assert sorted(SAVE_BACKENDS) == sorted(backends.BACKENDS)
    for name, be in SAVE_BACKENDS.items():
        assert be.name == name
        # chunks the planner tiles (torch_dist) are the ones the reader maps for read-once loads
        assert be.check_layout == backends.BACKENDS[name].mapped_chunks
