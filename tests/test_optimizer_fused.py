"""Optimizer state follows the weights between a fused parameter and its unfused counterpart.

A fused QKV (one parameter, stored through a ShardedTensorFactory as ``qkv.weight.part0/1/2``) and
three separate q/k/v parameters keyed like those parts (examples/gpt.py ``Block`` and
``DTensorBlock``) load each other's weights; their optimizer state (Adam moments, ``step``, param
groups) must follow in both directions, exactly, also from checkpoints whose fused scalars were
saved once under the fused key (earlier versions); a real mismatch is an OptimizerStateMismatchError
naming the parameters, never a KeyError from torch. One process, no torch.distributed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ckpt_integration as ci
from ckpt_integration import ShardedObject, ShardedTensor, ShardedTensorFactory
from ckpt_integration.modules import fused_column_parallel
from ckpt_integration.optimizer import (
    OptimizerStateMismatchError,
    load_optimizer_state,
    optimizer_sharded_state_dict,
    sharding_state_to_optim_state,
)

D = 4


def _init():
    g = torch.Generator().manual_seed(0)
    return {"qkv.weight": torch.randn(3 * D, D, generator=g), "qkv.bias": torch.randn(3 * D, generator=g),
            "out.weight": torch.randn(1, 3 * D, generator=g), "out.bias": torch.zeros(1)}


class Fused(nn.Module):
    """One qkv parameter, stored as three parts (like examples/gpt.py ``Block`` with TP=1)."""

    def __init__(self):
        super().__init__()
        w = _init()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(3 * D, 1)
        with torch.no_grad():
            for n, p in self.named_parameters():
                p.copy_(w[n])

    def forward(self, x):
        return self.out(self.qkv(x)).squeeze(-1)

    def sharded_state_dict(self, prefix="", metadata=None):
        sd = {f"qkv.{n}": fused_column_parallel(f"qkv.{n}", getattr(self.qkv, n).detach(), 0, 1, 3)
              for n in ("weight", "bias")}
        sd.update({f"out.{n}": ShardedTensor.from_rank_offsets(f"out.{n}", getattr(self.out, n).detach())
                   for n in ("weight", "bias")})
        return sd


class Unfused(nn.Module):
    """Separate q, k, v parameters keyed like the fused parts (like ``DTensorBlock``)."""

    def __init__(self):
        super().__init__()
        w = _init()
        self.q, self.k, self.v = (nn.Linear(D, D) for _ in range(3))
        self.out = nn.Linear(3 * D, 1)
        with torch.no_grad():
            for i, lin in enumerate((self.q, self.k, self.v)):
                lin.weight.copy_(w["qkv.weight"].chunk(3)[i])
                lin.bias.copy_(w["qkv.bias"].chunk(3)[i])
            self.out.weight.copy_(w["out.weight"])
            self.out.bias.copy_(w["out.bias"])

    def forward(self, x):
        return self.out(torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)).squeeze(-1)

    def sharded_state_dict(self, prefix="", metadata=None):
        sd = {}
        for i, lin in enumerate((self.q, self.k, self.v)):
            for n in ("weight", "bias"):
                sd[f"qkv.{n}.part{i}"] = ShardedTensor.from_rank_offsets(f"qkv.{n}.part{i}", getattr(lin, n).detach())
        sd.update({f"out.{n}": ShardedTensor.from_rank_offsets(f"out.{n}", getattr(self.out, n).detach())
                   for n in ("weight", "bias")})
        return sd


def _make(kind, lr=1e-2):
    model = kind()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model, opt, sched, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, D, generator=g), torch.randn(8, generator=g)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def _by_part(model, opt):
    """Every per-param state as ``{(part key, state name): value}`` (fused states cut into parts)."""
    out = {}
    params = dict(model.named_parameters())
    for n, p in params.items():
        st = opt.state[p]
        if isinstance(model, Fused) and n.startswith("qkv."):
            keys = [f"{n}.part{i}" for i in range(3)]
        elif isinstance(model, Unfused) and n[0] in "qkv":
            keys = [f"qkv.{n[2:]}.part{'qkv'.index(n[0])}"]
        else:
            keys = [n]
        for name, v in st.items():
            chunks = v.chunk(len(keys)) if v.dim() else [v] * len(keys)
            for key, c in zip(keys, chunks):
                out[(key, name)] = c
    return out


def _params_by_part(model):
    out = {}
    for n, p in model.named_parameters():
        if isinstance(model, Fused) and n.startswith("qkv."):
            out.update({f"{n}.part{i}": c for i, c in enumerate(p.detach().chunk(3))})
        elif isinstance(model, Unfused) and n[0] in "qkv":
            out[f"qkv.{n[2:]}.part{'qkv'.index(n[0])}"] = p.detach()
        else:
            out[n] = p.detach()
    return out


def _save(model, opt, sched, path, old_format=False):
    msd = model.sharded_state_dict()
    osd = optimizer_sharded_state_dict(opt, msd)
    if old_format:  # as earlier versions wrote a fused param's scalars: one object under the fused key
        for entry in osd["state"].values():
            for name, v in list(entry.items()):
                if isinstance(v, ShardedTensorFactory) and ".state.step." in v.key:
                    entry[name] = ShardedObject(v.key, v.data, (1,), (0,), replica_id=0)
    ci.save({"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict()}, path)


def _load(kind, path):
    model, opt, sched = _make(kind, lr=1.0)  # other hyper-parameters: they come from the checkpoint
    msd = model.sharded_state_dict()
    loaded = ci.load({"model": msd}, path)
    model.load_state_dict({n: v for n, v in _merge_model(kind, loaded["model"]).items()})
    load_optimizer_state(opt, model.sharded_state_dict(), path, module=model)
    sched.load_state_dict(ci.load_common_state_dict(path)["lr_scheduler"])
    return model, opt, sched


def _merge_model(kind, loaded):
    if kind is Fused:
        return loaded  # factories merged back
    out = {}
    for k, v in loaded.items():
        if k.startswith("qkv."):
            n, i = k[4:].rsplit(".part", 1)
            out[f"{'qkv'[int(i)]}.{n}"] = v
        else:
            out[k] = v
    return out


def _assert_same_state(a, b, exact=True):
    (ma, oa, sa), (mb, ob, sb) = a, b
    sa_, sb_ = _by_part(ma, oa), _by_part(mb, ob)
    assert sorted(sa_) == sorted(sb_)
    for k in sa_:
        assert sa_[k].dtype == sb_[k].dtype, k
        if exact:
            assert torch.equal(sa_[k], sb_[k]), k
        else:
            torch.testing.assert_close(sa_[k], sb_[k], rtol=1e-5, atol=1e-6, msg=str(k))
    for (na, pa), (nb, pb) in zip(sorted(_params_by_part(ma).items()), sorted(_params_by_part(mb).items())):
        assert na == nb and (torch.equal(pa, pb) if exact else torch.allclose(pa, pb, rtol=1e-5, atol=1e-6)), na
    assert len(oa.param_groups) == len(ob.param_groups)
    for ga, gb in zip(oa.param_groups, ob.param_groups):
        assert {k: v for k, v in ga.items() if k != "params"} == {k: v for k, v in gb.items() if k != "params"}
    assert sa.state_dict() == sb.state_dict()


_PAIRS = [(Fused, Unfused), (Unfused, Fused), (Fused, Fused), (Unfused, Unfused)]


# the old format (scalars under the fused key) exists only for checkpoints saved from a fused param
@pytest.mark.parametrize("src,dst,old_format",
                         [(s, d, False) for s, d in _PAIRS] + [(s, d, True) for s, d in _PAIRS if s is Fused],
                         ids=lambda v: v.__name__ if isinstance(v, type) else
                         ("fused-scalars-under-fused-key" if v else "current"))
def test_optimizer_state_follows_fused_parts(tmp_path, src, dst, old_format):
    run = _make(src)
    _train(*run, 3, seed=1)
    _save(*run, tmp_path / "c", old_format=old_format)
    resumed = _load(dst, tmp_path / "c")
    _assert_same_state(run, resumed)
    assert all(float(v) == 3 for (k, n), v in _by_part(*resumed[:2]).items() if n == "step")
    # training continues as the uninterrupted run (one matmul vs three: fp32 rounding apart)
    _train(*run, 2, seed=2)
    _train(*resumed, 2, seed=2)
    _assert_same_state(run, resumed, exact=src is dst)


def test_fused_scalar_objects_are_per_part(tmp_path):
    """A fused param's ``step`` is saved once per part, keyed like the parts' moments."""
    run = _make(Fused)
    _train(*run, 1, seed=1)
    _save(*run, tmp_path / "c")
    keys = set(ci.load_sharded_metadata(tmp_path / "c"))
    for i in range(3):
        assert f"optimizer.state.exp_avg.qkv.weight.part{i}" in keys
        assert f"optimizer.state.step.qkv.weight.part{i}/shard_0_1" in keys
    assert not any(k.startswith("optimizer.state.step.qkv.weight/") for k in keys)
    # Megatron-style in-place flow: the request of the other structure loads straight into torch
    model, opt, _ = _make(Unfused)
    msd = model.sharded_state_dict()
    loaded = ci.load({"optimizer": optimizer_sharded_state_dict(opt, msd, init_state=True)}, tmp_path / "c")
    opt.load_state_dict(sharding_state_to_optim_state(loaded["optimizer"]))
    assert float(opt.state[model.k.weight]["step"]) == 1
    assert torch.equal(opt.state[model.k.weight]["exp_avg"], run[1].state[run[0].qkv.weight]["exp_avg"].chunk(3)[1])


def test_parts_with_different_steps_refused(tmp_path):
    """Separate q/k/v stepped differently cannot become one fused param: refused, naming the parts."""
    run = _make(Unfused)
    _train(*run, 2, seed=1)
    run[1].state[run[0].k.weight]["step"] = torch.tensor(7.0)
    _save(*run, tmp_path / "c")
    with pytest.raises(OptimizerStateMismatchError, match=r"(?s)qkv\.weight.*part0.*= tensor\(2\.\).*part1.*= tensor\(7\.\)"):
        _load(Fused, tmp_path / "c")


def test_part_without_state_refused(tmp_path):
    """One of the parts has no optimizer state (frozen): the fused param cannot be filled."""
    run = _make(Unfused)
    run[0].v.weight.requires_grad_(False)
    _train(*run, 1, seed=1)
    _save(*run, tmp_path / "c")
    with pytest.raises(OptimizerStateMismatchError) as e:
        _load(Fused, tmp_path / "c")
    assert "'optimizer.state.exp_avg.qkv.weight.part2' is not in the checkpoint" in str(e.value)
    assert "parts it is fused from have different scalar states" in str(e.value)


def test_missing_step_is_a_mismatch_not_a_keyerror(tmp_path):
    """A checkpoint without ``step`` (saved with exclude_keys): torch's AdamW would raise KeyError('step')."""
    run = _make(Fused)
    _train(*run, 1, seed=1)
    msd = run[0].sharded_state_dict()
    ci.save({"model": msd, "optimizer": optimizer_sharded_state_dict(run[1], msd, exclude_keys=("step",))},
            tmp_path / "c")
    model, opt, _ = _make(Unfused)
    with pytest.raises(OptimizerStateMismatchError, match=r"(?s)does not fit AdamW.*'qkv\.weight\.part0' \(q\.weight\): no step"):
        load_optimizer_state(opt, model.sharded_state_dict(), tmp_path / "c", module=model)
