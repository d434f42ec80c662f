"""Behaviours that differed from Megatron-Core's dist_checkpointing (found by running its own tests' ideas
against this package), each compared with Megatron-Core 0.16.1 itself where it can run in one process:

* missing / unexpected keys of a ShardedObject are reported under the object's key (``'ObjB'``), not
  under each shard's storage key (``'ObjB/shard_0_2'``), in ``StrictHandling`` results and messages;
* strict-mode messages read as Megatron-Core's (its ``maybe_report_missing_and_unexpected_keys``
  text, then our explanation on a line of its own);
* ``TorchDistSaveShardedStrategy(..., separation_hint=prefix)`` writes the hinted keys to data files of
  their own, named with the prefix, so ``remove_sharded_tensors(dir, prefix)`` deletes those files;
* data files are named ``__<rank>_<n>.distcp`` (``<hint>__<rank>_<n>.distcp``), as DCP / Megatron-Core name them.
(The common-state difference warning is compared with Megatron-Core's on 2 ranks in test_megatron_compat.py.)
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import ShardedObject, ShardedTensor, StrictHandling
from ckpt_integration.errors import MismatchError
from ckpt_integration.strategies import TorchDistSaveShardedStrategy
from ckpt_integration.storage.filesystem import locate


def _megatron_validation():
    from tests.test_interop import _import_megatron

    _import_megatron()
    from megatron.core.dist_checkpointing import validation

    return validation


@pytest.fixture
def objects_ckpt(tmp_path):
    """``ObjA`` (one cell) and ``ObjB`` (two cells along a grid of 2), saved from one process, and a tensor."""
    sd = {"a": ShardedObject("ObjA", {"v": 1}, (1,), (0,)),
          "b": [ShardedObject("ObjB", {"part": i}, (2,), (i,)) for i in range(2)],
          "w": ShardedTensor.from_rank_offsets("w", torch.ones(3))}
    ci.save(sd, tmp_path / "c")
    return tmp_path / "c"


def _request(with_b=True, extra=True):
    req = {"a": ShardedObject("ObjA", None, (1,), (0,)), "w": ShardedTensor.from_rank_offsets("w", torch.empty(3))}
    if with_b:
        req["b"] = [ShardedObject("ObjB", None, (2,), (i,)) for i in range(2)]
    if extra:
        req["c"] = ShardedObject("ObjC", None, (2,), (1,))
    return req


def test_sharded_object_keys_reported_under_the_object_key(objects_ckpt):
    out, missing, unexpected = ci.load(_request(with_b=False), objects_ckpt, strict=StrictHandling.RETURN_ALL)
    assert missing == {"ObjB"} and unexpected == {"ObjC"}
    assert out["a"] == {"v": 1} and "c" not in out and torch.equal(out["w"], torch.ones(3))
    out, missing, unexpected = ci.load(_request(), objects_ckpt, strict=StrictHandling.RETURN_UNEXPECTED)
    assert missing == set() and unexpected == {"ObjC"} and [x["part"] for x in out["b"]] == [0, 1]
    # Megatron-Core's own key comparison on the same metadata gives the same sets
    validation = _megatron_validation()
    from megatron.core.dist_checkpointing.mapping import ShardedObject as MObject
    from megatron.core.dist_checkpointing.mapping import ShardedTensor as MTensor

    ckpt_meta = {k: (MObject(v.key, None, v.global_shape, v.global_offset, 0) if isinstance(v, ShardedObject) else v)
                 for k, v in ci.load_sharded_metadata(objects_ckpt).items()}
    local = [MObject("ObjA", None, (1,), (0,)), MObject("ObjC", None, (2,), (1,)),
             MTensor.from_rank_offsets("w", torch.empty(3))]
    assert validation._determine_missing_and_unexpected_keys(ckpt_meta, local, [local]) == ({"ObjB"}, {"ObjC"})


@pytest.mark.parametrize("mode", [StrictHandling.RAISE_ALL, StrictHandling.RAISE_UNEXPECTED])
def test_strict_messages_read_as_megatrons(objects_ckpt, mode):
    validation = _megatron_validation()
    with pytest.raises(MismatchError) as ours:
        ci.load(_request(with_b=False), objects_ckpt, strict=mode)
    missing = {"ObjB"} if mode == StrictHandling.RAISE_ALL else set()
    with pytest.raises(Exception) as theirs:
        validation.maybe_report_missing_and_unexpected_keys(missing, {"ObjC"}, raise_error=True)
    text = str(ours.value)
    assert text.startswith(str(theirs.value)), (text, str(theirs.value))
    # then, on a line of its own, where and what the words mean
    tail = text[len(str(theirs.value)):]
    assert tail.startswith("\nrank 0, ") and str(objects_ckpt) in tail and "unexpected = requested but not in" in tail


def test_log_modes_log_megatrons_words(objects_ckpt, caplog):
    with caplog.at_level("WARNING", logger="ckpt_integration"):
        ci.load(_request(with_b=False), objects_ckpt, strict=StrictHandling.LOG_ALL)
    assert ("Some keys found in the checkpoint are missing in the provided sharded state dict. Unexpected keys (not "
            "found in the checkpoint) encountered in the provided sharded state dict. \nMissing keys (for all ranks): "
            "{'ObjB'}. Unexpected keys (for this rank): {'ObjC'}. \n") in caplog.text


DATA_FILE = re.compile(r"^(?P<hint>.*)__(?P<rank>\d+)_(?P<n>\d+)\.distcp$")


def _sd(step=3):
    return {"model": {"w": ShardedTensor.from_rank_offsets("model.w", torch.arange(64.0))},
            "optimizer": {"exp_avg": ShardedTensor.from_rank_offsets("optimizer.state.exp_avg.model.w", torch.ones(64)),
                          "step": ShardedObject("optimizer.state.step.model.w", step, (1,), (0,))}}


def test_separation_hint_files_are_removed_with_the_prefix(tmp_path):
    path = tmp_path / "c"
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=2, separation_hint="optimizer.")
    ci.save(_sd(step=1), path, strategy)
    ci.save(_sd(), path, strategy, overwrite=True)  # the hinted files count as the checkpoint's own, not foreign
    files = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    hinted = [f for f in files if f.startswith("optimizer.")]
    assert hinted and all(DATA_FILE.match(f)["hint"] == "optimizer." for f in hinted), files
    assert all(DATA_FILE.match(f)["hint"] == "" for f in files if f not in hinted), files
    # the hinted files hold only hinted keys: removing the prefix deletes them, the rest still loads
    ci.remove_sharded_tensors(path, "optimizer.")
    assert sorted(f for f in os.listdir(path) if f.endswith(".distcp")) == [f for f in files if f not in hinted]
    out = ci.load({"w": ShardedTensor.from_rank_offsets("model.w", torch.empty(64))}, path)
    assert torch.equal(out["w"], torch.arange(64.0))
    assert not any(k.startswith("optimizer.") for k in ci.load_sharded_metadata(path))
    from ckpt_integration.tools import verify_checkpoint

    assert verify_checkpoint(str(path)).ok
    from ckpt_integration.storage import checkpoint_dir as ckdir

    kept = ckdir.read_manifest(locate(path)).checksums()  # (format 4: the binary table, rewritten)
    assert kept and not any(f in hinted for f, _ in kept)
    # without a hint both kinds share files: nothing is deleted, only the metadata entries go
    ci.save(_sd(), tmp_path / "d", thread_count=1)
    before = sorted(os.listdir(tmp_path / "d"))
    ci.remove_sharded_tensors(tmp_path / "d", "optimizer.")
    assert [f for f in before if f.endswith(".distcp")] == [f for f in os.listdir(tmp_path / "d") if f.endswith(".distcp")]


def test_separation_hint_not_a_file_name(tmp_path):
    with pytest.raises(ci.CheckpointingException, match="separation_hint 'a/b'"):
        ci.save(_sd(), tmp_path / "c", TorchDistSaveShardedStrategy(separation_hint="a/b"))


def test_data_files_named_as_dcp_names_them(tmp_path):
    """``__<rank>_<n>.distcp``, numbered from 0 per rank, read by torch.distributed.checkpoint itself."""
    import torch.distributed.checkpoint as dcp

    ci.save(_sd(), tmp_path / "c", thread_count=2)
    files = sorted(f for f in os.listdir(tmp_path / "c") if f.endswith(".distcp"))
    assert files == ["__0_0.distcp", "__0_1.distcp"], files
    out = {"model.w": torch.empty(64)}
    dcp.load(out, checkpoint_id=str(tmp_path / "c"))
    assert torch.equal(out["model.w"], torch.arange(64.0))


def _object_grid_with_a_hole(rank, world, root):
    # 2 ranks save cells 0 and 1 of a grid of 3: Megatron-Core refuses this save ("Invalid access
    # pattern: 1 ShardedObject are missing"); ours committed it, and only a load of cell 2 failed
    sd = {"o": ShardedObject("o", {"r": rank}, (3,), (rank,), replica_id=0),
          "w": ShardedTensor.from_rank_offsets("w", torch.ones(2), replica_id=rank)}
    with pytest.raises(ci.errors.ShardingIntegrityError, match=r"'o': 1 of 3 object cells .* \(2,\)"):
        ci.save(sd, root + "/c")
    assert not os.path.exists(root + "/c/metadata.json")
    # a load may ask for some of the cells (a smaller job reading its own): still allowed
    full = {"o": ShardedObject("o", {"r": rank}, (2,), (rank,), replica_id=0), "w": sd["w"]}
    ci.save(full, root + "/ok")
    out = ci.load({"o": ShardedObject("o", None, (2,), (1,), replica_id=rank)}, root + "/ok")
    assert out["o"] == {"r": 1}


def test_a_save_with_object_cells_no_rank_saves_is_refused(tmp_path):
    from tests.dist_utils import run_distributed

    run_distributed(_object_grid_with_a_hole, 2, str(tmp_path))
