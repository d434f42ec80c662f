"""Default sharded_state_dict (plain + DTensor) and the hand-written TP mixin helpers."""

import os
import sys

import pytest
import torch
from torch import nn

import ckpt_integration as ci
from ckpt_integration.modules import (ParallelLayout, ShardedModuleMixin, default_sharded_state_dict,
                                      load_into_module, module_sharded_state_dict, stack_layers)
from tests.dist_utils import run_distributed

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))


def test_default_plain_module_roundtrip(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    m.register_buffer("steps", torch.tensor([5]))
    m.register_buffer("scratch", torch.ones(2), persistent=False)
    sd = default_sharded_state_dict(m, prefix="net.")
    assert set(sd) == {"net.0.weight", "net.0.bias", "net.1.weight", "net.1.bias", "net.steps"}
    assert all(st.replica_id == 0 and st.key == k for k, st in sd.items())
    ci.save(sd, str(tmp_path / "c"))
    m2 = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    m2.register_buffer("steps", torch.tensor([0]))
    loaded = ci.load(default_sharded_state_dict(m2, prefix="net."), str(tmp_path / "c"))
    load_into_module(m2, loaded, prefix="net.")
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), k


def test_mixin_column_row_fused_and_stacked(tmp_path):
    import gpt

    full = gpt.GPT(11, 8, 2, 2, 6, ParallelLayout(), seed=1)
    # TP=2 "ranks" built in one process: their shards together must equal the full model
    lays = [ParallelLayout(tp_size=2, tp_rank=r) for r in range(2)]
    parts = [gpt.GPT(11, 8, 2, 2, 6, lay, seed=1) for lay in lays]
    sds = [module_sharded_state_dict(p, "", {"layout": lay}) for p, lay in zip(parts, lays)]
    qkv = sds[1]["blocks.0.qkv.weight"]
    assert isinstance(qkv, ci.ShardedTensorFactory)
    fc2 = sds[1]["blocks.0.fc2.weight"]
    assert (fc2.global_shape, fc2.global_offset) == ((8, 32), (0, 16))
    assert sds[1]["ln_f.weight"].replica_id == 1 and sds[0]["ln_f.weight"].replica_id == 0
    # save each rank's shards by hand (as one process) via from the factories' parts
    flat = {}
    for r, sd in enumerate(sds):
        for k, v in sd.items():
            if isinstance(v, ci.ShardedTensorFactory):
                for n, st in v.build().items():
                    flat[f"{k}.{n}.r{r}"] = st
            elif ci.is_main_replica(v.replica_id) or "ln" in k or "tok" in k:
                flat[f"{k}.r{r}"] = v
    flat = {k: v for k, v in flat.items() if ci.is_main_replica(v.replica_id)}
    ci.save(flat, str(tmp_path / "tp2"))
    # load into TP=1: equals the full model
    m1 = gpt.GPT(11, 8, 2, 2, 6, ParallelLayout(), seed=99)
    loaded = ci.load(module_sharded_state_dict(m1), str(tmp_path / "tp2"))
    load_into_module(m1, loaded)
    for (k, a), b in zip(full.state_dict().items(), m1.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), k

    # stacked layers: 4 layers saved as 2 stages of 2, loaded as 1 stage of 4
    class Layer(ShardedModuleMixin, nn.Module):
        def __init__(self, v):
            super().__init__()
            self.w = nn.Parameter(torch.full((2, 3), float(v)))

    stages = [[Layer(2 * s + i) for i in range(2)] for s in range(2)]
    flat = {}
    for s, layers in enumerate(stages):
        st = stack_layers([module_sharded_state_dict(l, f"layers.{i}.") for i, l in enumerate(layers)], 2 * s, 4, "layers.")
        flat.update({f"s{s}.{k}": v for k, v in st.items()})
    assert flat["s1.layers.1.w"].key == "layers.w" and flat["s1.layers.1.w"].global_offset == (3, 0, 0)
    ci.save(flat, str(tmp_path / "stacked"))
    four = [Layer(0) for _ in range(4)]
    req = stack_layers([module_sharded_state_dict(l, f"layers.{i}.") for i, l in enumerate(four)], 0, 4, "layers.")
    ci.load(req, str(tmp_path / "stacked"))
    assert [float(l.w[0, 0]) for l in four] == [0.0, 1.0, 2.0, 3.0]


def _dtensor_worker(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(7 * 4, dtype=torch.float32).view(7, 4)  # 7 rows over 2 ranks: uneven 4/3
    m = nn.Module()
    m.a = nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    m.b = nn.Parameter(distribute_tensor(full.T.contiguous(), mesh, [Shard(1)]))
    m.c = nn.Parameter(distribute_tensor(torch.ones(3), mesh, [Replicate()]))
    sd = default_sharded_state_dict(m)
    assert sd["a"].global_offset == ((0, 0) if rank == 0 else (4, 0))
    assert sd["c"].replica_id == (rank,)
    assert sd["a"].data.data_ptr() == m.a.to_local().data_ptr()  # loads fill the DTensor in place
    ci.save(sd, path)
    out = ci.load({"a": ci.ShardedTensor.from_global_offsets("a", torch.empty(7, 4), (7, 4), (0, 0)),
                   "b": ci.ShardedTensor.from_global_offsets("b", torch.empty(4, 7), (4, 7), (0, 0))},
                  path, validate_access_integrity=False)
    assert torch.equal(out["a"], full)
    assert torch.equal(out["b"], full.T)
    with torch.no_grad():
        m.a.to_local().zero_()
    ci.load(default_sharded_state_dict(m), path)
    assert torch.equal(m.a.full_tensor(), full)


def test_dtensor_default_sharded_state_dict(tmp_path):
    run_distributed(_dtensor_worker, 2, str(tmp_path / "dt"), timeout=120)


@pytest.mark.parametrize("strict", ["return_all", "return_unexpected", "log_unexpected", "log_all", "ignore_all"])
def test_a_fused_layer_added_since_the_save_is_skipped_in_lenient_strict_modes(tmp_path, strict):
    """A fused QKV (a ShardedTensorFactory) that the checkpoint does not hold, e.g. a layer added since the
    save: the strict modes that skip such keys raised "nothing was loaded for ShardedTensorFactory"
    (or, with some of its parts saved, its merge_fn's KeyError), so no missing/unexpected lists came back.
    Now the factory is left out of the result and its parts are reported as unexpected."""
    from ckpt_integration.modules import fused_column_parallel

    ci.save({"a": ci.ShardedTensor.from_rank_offsets("a", torch.ones(2)),
             "old": fused_column_parallel("old.qkv", torch.arange(24.0).view(6, 4), 0, 1, 3)}, tmp_path / "c")
    request = {"a": ci.ShardedTensor.from_rank_offsets("a", torch.zeros(2)),
               "old": fused_column_parallel("old.qkv", torch.zeros(6, 4), 0, 1, 3),
               "layers": {"9": {"qkv": fused_column_parallel("layer9.qkv", torch.zeros(6, 4), 0, 1, 3)}}}
    out = ci.load(request, tmp_path / "c", strict=strict)
    if strict.startswith("return"):
        out, missing, unexpected = out
        assert missing == set() and unexpected == {f"layer9.qkv.part{i}" for i in range(3)}
    assert torch.equal(out["a"], torch.ones(2)) and torch.equal(out["old"], torch.arange(24.0).view(6, 4))
    assert "9" not in out.get("layers", {})
    with pytest.raises(ci.errors.KeyNotInCheckpointError, match="layer9.qkv.part0"):
        ci.load(request, tmp_path / "c", strict="raise_unexpected")


def test_a_failing_build_fn_is_named(tmp_path):
    """An exception in a factory's build_fn reached the caller as it was (a bare ZeroDivisionError); a
    failing merge_fn was already named. Now both are a CheckpointingException naming the factory."""
    def build(key, data, replica_id, flattened_range):
        return 1 / 0

    factory = ci.ShardedTensorFactory("broken.qkv", torch.zeros(2), build, lambda x: x)
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(2))}, tmp_path / "ok")
    for call in (lambda: ci.save({"f": factory}, tmp_path / "c"), lambda: ci.load({"f": factory}, tmp_path / "ok")):
        with pytest.raises(ci.CheckpointingException, match="build_fn of ShardedTensorFactory 'broken.qkv' failed: "
                                                            "ZeroDivisionError"):
            call()
