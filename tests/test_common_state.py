"""Exact round trip of the common (non-sharded) state and of factory structures.

Whatever a training job hands to ``save`` comes back equal from ``load``: empty
containers anywhere, None, tuples, OrderedDicts, mixed lists of sharded and plain
values; and a factory's ``merge_fn`` receives exactly what its ``build_fn`` returned.
"""

from __future__ import annotations

import collections
import enum
import functools
from dataclasses import dataclass

import torch

import ckpt_integration as ci
from ckpt_integration import ShardedObject, ShardedTensor, ShardedTensorFactory

from .dist_utils import run_distributed


class Phase(enum.Enum):
    WARMUP = "warmup"
    DECAY = "decay"


@dataclass
class Hyper:
    lr: float
    betas: tuple


def _warmup(step: int, total: int) -> float:
    return min(1.0, step / total)


def _st(key: str, t: torch.Tensor) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, t)


def test_empty_containers_survive_exactly(tmp_path):
    common = {"a": {}, "b": [], "c": [{}], "d": {"x": {"y": {}}}}
    ci.save({**common, "w": _st("w", torch.arange(4.0))}, tmp_path / "c")
    out = ci.load({"w": _st("w", torch.empty(4))}, tmp_path / "c")
    assert {k: out[k] for k in common} == common
    assert type(out["b"]) is list and type(out["c"]) is list and type(out["c"][0]) is dict
    assert ci.load_common_state_dict(tmp_path / "c") == common


def test_whole_common_state_round_trips_with_types(tmp_path):
    common = {
        "none": None,
        "tuple": (1, [], {}, None),
        "ordered": collections.OrderedDict([("z", 1), ("y", {}), ("x", [])]),
        "list": [1, {}, [], None, [[]]],
        "nested": {"l": [{"m": {}}, {"n": [1, 2]}], "e": {}},
        "enum": Phase.DECAY,
        "dataclass": Hyper(0.1, (0.9, 0.95)),
        "scalar_tensor": torch.tensor(3),
        "str": "", "int": 0, "float": 0.0, "bool": False,
    }
    sd = {**common, "w": _st("w", torch.arange(6.0))}
    ci.save(sd, tmp_path / "c")
    out = ci.load({"w": _st("w", torch.empty(6))}, tmp_path / "c", allowed_globals=[Phase, Hyper])
    for k, v in common.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(out[k], v)
        else:
            assert out[k] == v, k
            assert type(out[k]) is type(v), k
    assert list(out["ordered"]) == ["z", "y", "x"]


def test_sharded_values_inside_lists_and_dicts_with_empties(tmp_path):
    def request(fill):
        return {
            "layers": [
                {"w": _st("l0.w", fill(2, 3)), "extra": {}, "note": None},
                {},
                {"w": _st("l1.w", fill(2, 3)), "hist": []},
                "plain",
            ],
            "opt": {"state": {}, "groups": [{"lr": 0.1, "params": []}]},
            "obj": ShardedObject("obj", {"k": []} if fill is torch.ones else None, (1,), (0,)),
        }

    ci.save(request(torch.ones), tmp_path / "c")
    out = ci.load(request(torch.empty), tmp_path / "c")
    assert isinstance(out["layers"], list) and len(out["layers"]) == 4
    assert torch.equal(out["layers"][0]["w"], torch.ones(2, 3))
    assert out["layers"][0]["extra"] == {} and out["layers"][0]["note"] is None
    assert out["layers"][1] == {}
    assert out["layers"][2]["hist"] == [] and out["layers"][3] == "plain"
    assert out["opt"] == {"state": {}, "groups": [{"lr": 0.1, "params": []}]}
    assert out["obj"] == {"k": []}


def test_hf_style_lambda_lr_state_round_trips(tmp_path):
    """HF schedulers build LambdaLR on functools.partial: state_dict()["lr_lambdas"] == [{}]."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(_warmup, total=10))
    for _ in range(3):
        opt.step()
        sched.step()
    state = sched.state_dict()
    assert state["lr_lambdas"] == [{}]
    ci.save({"lr_schedulers": [state], "w": _st("w", torch.zeros(2))}, tmp_path / "c")
    out = ci.load({"w": _st("w", torch.empty(2))}, tmp_path / "c", allowed_globals=[functools.partial, _warmup])
    assert out["lr_schedulers"] == [state]
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, functools.partial(_warmup, total=10))
    sched2.load_state_dict(out["lr_schedulers"][0])  # KeyError: 'lr_lambdas' before the fix
    assert sched2.last_epoch == 3 and sched2.get_last_lr() == sched.get_last_lr()


def _list_factory(key, t, replica_id, flattened_range):
    return [
        ShardedTensor.from_rank_offsets(f"{key}.part{i}", x.clone(), replica_id=replica_id)
        for i, x in enumerate(t.chunk(3))
    ]


def _nested_factory(key, t, replica_id, flattened_range):
    a, b = t.chunk(2)
    return {"outer": {"a": _st(f"{key}.a", a.clone())}, "parts": [_st(f"{key}.b", b.clone())]}


def test_factory_merge_receives_what_build_returned(tmp_path):
    seen = []

    def merge_sum(parts):
        seen.append(type(parts))
        return sum(parts)  # a list sum: a tensor; on a dict it would be the sum of the keys

    def merge_nested(sd):
        seen.append((type(sd), type(sd["outer"]), type(sd["parts"])))
        return torch.cat([sd["outer"]["a"], sd["parts"][0]])

    data = torch.arange(6.0)
    sd = {
        "f": ShardedTensorFactory("f", data, _list_factory, merge_sum),
        "g": ShardedTensorFactory("g", data, _nested_factory, merge_nested),
        "in_list": [ShardedTensorFactory("h", data, _list_factory, merge_sum), 7],
    }
    ci.save(sd, tmp_path / "c")
    req = {
        "f": ShardedTensorFactory("f", torch.empty(6), _list_factory, merge_sum),
        "g": ShardedTensorFactory("g", torch.empty(6), _nested_factory, merge_nested),
        "in_list": [ShardedTensorFactory("h", torch.empty(6), _list_factory, merge_sum), 7],
    }
    out = ci.load(req, tmp_path / "c")
    assert torch.equal(out["f"], data[0:2] + data[2:4] + data[4:6])
    assert torch.equal(out["g"], data)
    assert isinstance(out["in_list"], list) and out["in_list"][1] == 7
    assert torch.equal(out["in_list"][0], data[0:2] + data[2:4] + data[4:6])
    assert seen == [list, (dict, dict, list), list]


def _two_rank_common(rank, world, path):
    w = torch.arange(8.0).reshape(4, 2)[rank * 2:(rank + 1) * 2]
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", w.clone(), (0, rank, world)),
        "sched": {"lr_lambdas": [{}], "base_lrs": [0.1], "last_epoch": 3},
        "callbacks": {"EarlyStopping": {}}, "hparams": {},
        "mixed": [ShardedTensor.from_rank_offsets("m", w.clone(), (0, rank, world)), {}, None],
    }
    ci.save(sd, path)
    req = {
        "w": ShardedTensor.from_rank_offsets("w", torch.empty(2, 2), (0, rank, world)),
        "mixed": [ShardedTensor.from_rank_offsets("m", torch.empty(2, 2), (0, rank, world)), {}, None],
    }
    out = ci.load(req, path)
    assert out["sched"] == {"lr_lambdas": [{}], "base_lrs": [0.1], "last_epoch": 3}
    assert out["callbacks"] == {"EarlyStopping": {}} and out["hparams"] == {}
    assert isinstance(out["mixed"], list) and out["mixed"][1:] == [{}, None]
    assert torch.equal(out["mixed"][0], w) and torch.equal(out["w"], w)


def test_common_state_round_trips_on_two_ranks(tmp_path):
    run_distributed(_two_rank_common, 2, str(tmp_path / "c"))
