"""Megatron-Core ``dist_checkpointing`` names provided here: ``utils``, ``dict_utils.diff``,
``core``, the strategy getters, and the top-level ``check_is_distributed_checkpoint``.

Where Megatron-Core is installed, results are compared with its own functions on the
same inputs; the ``utils`` helpers are checked on our classes and on Megatron's.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import core, utils
from ckpt_integration.dict_utils import diff
from ckpt_integration.errors import CorruptCheckpointError, KeyPrefixError
from tests.megatron_import import import_megatron


def _megatron():
    return import_megatron("megatron.core.dist_checkpointing")


def _classes(which):
    if which == "ours":
        return ci.ShardedTensor, ci.ShardedObject, ci.ShardedTensorFactory, ci.LocalNonpersistentObject
    m = _megatron()
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    return m.ShardedTensor, m.ShardedObject, ShardedTensorFactory, m.LocalNonpersistentObject


def _state(which):
    ST, SO, STF, LNO = _classes(which)
    t = ST.from_rank_offsets("dec.w", torch.ones(2, 2))
    f = STF("dec.qkv", torch.ones(3), lambda k, d, r, fr: [ST.from_rank_offsets(f"{k}.q", d)], lambda x: x[0])
    return {
        "model": {"w": t, "qkv": f, "extra": [SO("dec.rng", 1, (1,), (0,)), 5]},
        "opt": {"params": LNO([0, 1]), "lr": 0.1},
    }


@pytest.mark.parametrize("which", ["ours", "megatron"])
def test_extract_helpers(which):
    sd = _state(which)
    tensors, rest = utils.extract_sharded_tensors(sd)
    assert list(tensors) == ["model"] and list(tensors["model"]) == ["w"]
    assert rest["opt"]["lr"] == 0.1 and "qkv" in rest["model"]
    tf, _ = utils.extract_sharded_tensors_and_factories(sd)
    assert sorted(tf["model"]) == ["qkv", "w"]
    tfn, rest = utils.extract_sharded_tensors_or_nonpersistent(sd)
    assert sorted(tfn["model"]) == ["qkv", "w"] and "params" in tfn["opt"] and rest["opt"] == {"lr": 0.1}
    base, rest = utils.extract_sharded_base(sd)
    assert sorted(base["model"]) == ["extra", "qkv", "w"] and rest["model"]["extra"] == [5]
    nonp, rest = utils.extract_nonpersistent(sd)
    assert list(nonp) == ["opt"] and "params" not in rest["opt"]


@pytest.mark.parametrize("which", ["ours", "megatron"])
def test_prefix_helpers(which):
    sd = _state(which)
    utils.add_prefix_for_sharding(sd, "m.")
    keys = lambda: sorted(v.key for v in (sd["model"]["w"], sd["model"]["qkv"], sd["model"]["extra"][0]))  # noqa: E731
    assert keys() == ["m.dec.qkv", "m.dec.rng", "m.dec.w"]
    utils.replace_prefix_for_sharding(sd, "m.dec.", "decoder.")
    assert keys() == ["decoder.qkv", "decoder.rng", "decoder.w"]
    with pytest.raises(KeyPrefixError, match=r"'decoder\.w'.*'x\.'") as e:
        utils.replace_prefix_for_sharding(sd, "x.", "y.")
    assert isinstance(e.value, ValueError)  # what Megatron-Core raises
    utils.apply_prefix_mapping(sd, {"decoder.q": "attn.q", "decoder.": "never.", "zzz": "no"})
    assert keys() == ["attn.qkv", "never.rng", "never.w"]


def test_megatron_and_our_helpers_agree():
    _megatron()
    import megatron.core.dist_checkpointing.utils as mutils

    which = "megatron"  # Megatron's helpers recognise Megatron's classes only
    for name in ("extract_sharded_tensors", "extract_sharded_tensors_and_factories", "extract_sharded_base",
                 "extract_nonpersistent", "extract_sharded_tensors_or_nonpersistent"):
        a, b = getattr(utils, name)(_state(which)), getattr(mutils, name)(_state(which))
        assert repr(_shape(a)) == repr(_shape(b)), name


def _shape(x):
    if isinstance(x, dict):
        return {k: _shape(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_shape(v) for v in x)
    return type(x).__name__


DIFF_CASES = [
    ({"a": 1, "b": {"c": 2}}, {"a": 1, "b": {"c": 2}}),
    ({"a": 1, "b": 2}, {"a": 1, "c": 3, "b": 5}),
    ({"t": torch.ones(3), "n": {"x": "s"}}, {"t": torch.tensor([1.0, 2, 1]), "n": {"x": "s", "y": None}}),
    ({"l": [1, {"k": 2}], "o": 4}, {"l": [1, {"k": 3}], "p": 4}),
]


@pytest.mark.parametrize("x1, x2", DIFF_CASES)
def test_diff_matches_megatron(x1, x2):
    only_left, only_right, mismatch = diff(x1, x2)
    mdict = import_megatron("megatron.core.dist_checkpointing.dict_utils")
    ml, mr, mm = mdict.diff(x1, x2)
    assert sorted(only_left) == sorted(ml) and sorted(only_right) == sorted(mr)
    assert sorted((m[0], m[1], m[2]) for m in mismatch) == sorted((m[0], m[1], m[2]) for m in mm)


def test_diff_lists_tuples_and_sharded():
    assert diff([1, 2, 3], [1, 2]) == ([(2,)], [], [])
    assert diff({"t": (1, 2)}, {"t": (1, 3)})[2] == [(("t", 1), int, int)]
    assert diff({"a": [1]}, {"a": (1,)})[2] == [(("a",), list, tuple)]
    a = ci.ShardedObject("o", {"x": 1}, (1,), (0,))
    b = ci.ShardedObject("o", {"x": 2, "y": 0}, (1,), (0,))
    assert diff(a, b) == ([], [(ci.ShardedObject, "y")], [((ci.ShardedObject, "x"), int, int)])


def test_check_is_distributed_checkpoint_and_config(tmp_path):
    assert not ci.check_is_distributed_checkpoint(tmp_path / "missing")
    assert not ci.check_is_distributed_checkpoint(tmp_path)  # empty
    assert core.maybe_load_config(tmp_path) is None and core.maybe_load_config("") is None
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(2))}, tmp_path / "c", sharded_strategy="zarr")
    assert ci.check_is_distributed_checkpoint(tmp_path / "c")
    cfg = core.maybe_load_config(str(tmp_path / "c"))
    assert cfg == core.CheckpointingConfig("zarr", 1, "torch", 1) and core.CONFIG_FNAME == "metadata.json"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metadata.json").write_text("{nope")
    with pytest.raises(CorruptCheckpointError):  # damaged: not passed off as "not a checkpoint"
        core.maybe_load_config(tmp_path / "bad")
    core.save_config(core.CheckpointingConfig("torch_dist"), tmp_path / "bad")
    assert json.loads((tmp_path / "bad" / "metadata.json").read_text())["sharded_backend"] == "torch_dist"


def test_megatron_reads_our_config_the_same(tmp_path):
    mcore = import_megatron("megatron.core.dist_checkpointing.core")
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(2))}, tmp_path / "c")
    assert mcore.check_is_distributed_checkpoint(str(tmp_path / "c")) == ci.check_is_distributed_checkpoint(tmp_path / "c")
    assert mcore.maybe_load_config(str(tmp_path / "c")).__dict__ == core.maybe_load_config(tmp_path / "c").__dict__


def test_default_strategies(tmp_path):
    s = ci.get_default_save_sharded_strategy()
    assert (s.backend, s.version, s.can_handle_sharded_objects) == ("torch_dist", 1, True)
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(2))}, tmp_path / "c",
            ci.get_default_save_sharded_strategy("zarr"))
    loader = ci.get_default_load_sharded_strategy(tmp_path / "c")
    assert (loader.backend, loader.version) == ("zarr", 1)
    out = ci.load({"w": ci.ShardedTensor.from_rank_offsets("w", torch.empty(2))}, tmp_path / "c", loader)
    assert torch.equal(out["w"], torch.ones(2))
    with pytest.raises(ci.CheckpointingException, match="'torch_dist'"):
        ci.load({}, tmp_path / "c", ci.get_default_save_sharded_strategy())
    with pytest.raises(ci.errors.UnsupportedCheckpointError, match="version 2"):
        ci.get_default_save_sharded_strategy("torch_dist", 2)


def test_megatron_strategy_object_is_accepted(tmp_path):
    _megatron()
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(2))}, tmp_path / "c", get_default_save_sharded_strategy())
    assert ci.get_default_load_sharded_strategy(tmp_path / "c").backend == "torch_dist"


def test_a_wrapped_megatron_strategy_keeps_its_options(tmp_path):
    """Megatron-LM wraps its save strategy in ``FullyParallelSaveStrategyWrapper``: its ``separation_hint`` (and
    ``thread_count``) sit on the wrapped strategy, and were dropped, so ``remove_sharded_tensors(dir, hint)`` could
    free nothing; Megatron's own save keeps them."""
    _megatron()
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from ckpt_integration.strategies import save_strategy_options, strategy_option

    inner = TorchDistSaveShardedStrategy("torch_dist", 1, separation_hint="optimizer.", thread_count=1)
    wrapped = FullyParallelSaveStrategyWrapper(inner)
    assert save_strategy_options(wrapped)["separation_hint"] == "optimizer."
    assert strategy_option(wrapped, "thread_count") == 1
    state = {k: ci.ShardedTensor.from_rank_offsets(k, torch.ones(2, 4)) for k in ("model.w", "optimizer.m")}
    ci.save(state, tmp_path / "c", wrapped)
    assert sorted(n for n in os.listdir(tmp_path / "c") if n.endswith(".distcp")) == ["__0_0.distcp",
                                                                                      "optimizer.__0_1.distcp"]


def test_megatron_strict_handling_is_accepted(tmp_path):
    _megatron()
    from megatron.core.dist_checkpointing.validation import StrictHandling as MStrict

    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(2))}, tmp_path / "c")
    req = {"w": ci.ShardedTensor.from_rank_offsets("w", torch.empty(2)), "v": ci.ShardedTensor.from_rank_offsets("v", torch.empty(1))}
    out, missing, unexpected = ci.load(req, tmp_path / "c", strict=MStrict.RETURN_ALL)
    assert unexpected == {"v"} and missing == set() and torch.equal(out["w"], torch.ones(2))
    assert {m.value for m in MStrict} == {m.value for m in ci.StrictHandling}


def test_sharded_tensor_grid_methods_match_megatron():
    """``local_chunk_offset_in_global``, ``max_allowed_chunks`` and ``global_slice`` gave other values than
    Megatron-Core's on the same shard (element offsets for chunk indices, the fragmentation for the chunk size,
    a slice for a prepended axis, so ``full[sh.global_slice()]`` had an extra dimension)."""
    m = _megatron()
    full = torch.arange(2 * 6 * 8, dtype=torch.float32).view(2, 6, 8)
    cases = [(((0, 1, 2), (1, 1, 2)), {}, full[0]),  # rows and columns of a (6, 8) tensor, 2 x 2
             (((0, 1, 2), (1, 0, 2), (2, 1, 2)), {"prepend_axis_num": 1}, full)]  # a (2, 6, 8) stack, layer 1
    for offsets, kw, whole in cases:
        data = torch.zeros(3, 4)
        ours = ci.ShardedTensor.from_rank_offsets("w", data, *offsets, **kw)
        theirs = m.ShardedTensor.from_rank_offsets("w", data, *offsets, **kw)
        for name in ("local_chunk_offset_in_global", "max_allowed_chunks", "global_slice"):
            assert getattr(ours, name)() == getattr(theirs, name)(), (name, offsets, kw)
        assert tuple(whole[ours.global_slice()].shape) == (3, 4)
    uneven = ci.ShardedTensor.from_global_offsets("u", torch.zeros(4, 3), (10, 3), (6, 0))
    with pytest.raises(ci.CheckpointingException, match="no regular grid"):
        uneven.local_chunk_offset_in_global()


def test_validation_names_at_megatrons_import_paths():
    """``ckpt_integration.validation`` did not exist, nor ``serialization.parse_strict_flag``: code switched from
    Megatron-Core by changing the import failed there."""
    from ckpt_integration import serialization, validation

    mval = import_megatron("megatron.core.dist_checkpointing.validation")
    assert serialization.parse_strict_flag is validation.parse_strict_flag
    for flag in ("assume_ok_unexpected", "log_all", "raise_unexpected", "return_all", "raise_all"):
        assert validation.parse_strict_flag(flag).value == mval.parse_strict_flag(flag).value, flag
    assert validation.StrictHandling.RAISE_ALL.value == mval.StrictHandling.RAISE_ALL.value
