"""``load_into_module`` (used by the Lightning strategies on load) never skips a loaded tensor silently."""

import pytest
import torch
from torch import nn

import ckpt_integration as ci
from ckpt_integration.modules import load_into_module


def _module(seed):
    torch.manual_seed(seed)
    m = nn.Module()
    m.l = nn.Linear(3, 2)
    return m


def _hook_sd(m, transposed_copy):
    """A hand-written ``sharded_state_dict``: the weight under a key of its own."""
    w = m.l.weight.t().contiguous() if transposed_copy else m.l.weight.detach().view(-1)
    key = "l.w_t" if transposed_copy else "l.w_flat"
    return {key: ci.ShardedTensor.from_global_offsets(key, w, tuple(w.shape), (0,) * w.dim()),
            "l.bias": ci.ShardedTensor.from_global_offsets("l.bias", m.l.bias.detach(), (2,), (0,))}


def test_copy_under_unknown_key_raises(tmp_path):
    src = _module(0)
    ci.save(_hook_sd(src, True), str(tmp_path / "c"))
    dst = _module(1)
    loaded = ci.load(_hook_sd(dst, True), str(tmp_path / "c"))
    # the loaded copy does not share the parameter's memory: the weight would silently stay as it was
    with pytest.raises(ValueError, match=r"could not be put back.*'l\.w_t'"):
        load_into_module(dst, loaded)


def test_view_under_unknown_key_is_filled_in_place(tmp_path):
    src = _module(0)
    ci.save(_hook_sd(src, False), str(tmp_path / "c"))
    dst = _module(1)
    loaded = ci.load(_hook_sd(dst, False), str(tmp_path / "c"))
    assert load_into_module(dst, loaded) == []  # everything was loaded in place
    assert torch.equal(dst.l.weight, src.l.weight)
    assert torch.equal(dst.l.bias, src.l.bias)
