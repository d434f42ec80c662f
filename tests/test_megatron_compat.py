"""Drop-in behaviour for code written for Megatron-Core's ``dist_checkpointing``.

* Megatron-Core's own ShardedTensor / ShardedObject / ShardedTensorFactory /
  LocalNonpersistentObject (what a Megatron model's ``sharded_state_dict()`` returns) are
  saved and loaded by their fields; anything that only looks sharded is refused, never
  pickled into the common state;
* a checkpoint we write from Megatron's classes (also from flattened shards) is read by
  Megatron-Core, and one Megatron-Core writes is read with Megatron's classes as the request;
* the optimizer flow ``optim_state_to_sharding_state -> save -> load ->
  optimizer.load_state_dict`` works with no extra call, also through Megatron-Core's own
  optimizer wrapper (``exclude_keys="step"`` + ``common_step``);
* common state that differs between ranks is reported as Megatron-Core does;
* messages and exception types: "is not a distributed checkpoint", DCP's
  ``CheckpointException`` for a key not in the checkpoint, "Missing keys"/"Unexpected keys".

Multi-process scenarios share one 2-rank launch; each records its outcome, one test
per scenario asserts on it (as in tests/test_interop.py).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

import ckpt_integration as ci
from ckpt_integration import ShardedTensor as ST
from ckpt_integration.errors import CheckpointingException, KeyNotInCheckpointError, MismatchError
from ckpt_integration.optimizer import get_param_id_to_sharded_param_map, init_optimizer_state, optim_state_to_sharding_state
from tests.dist_utils import run_distributed
from tests.test_interop import WORLD, _assert_ok, _import_megatron, _patch_cuda_for_megatron, _read_results, _record, _write_results


def _m():
    """Megatron-Core's mapping classes (skips without megatron.core)."""
    _import_megatron()
    from megatron.core.dist_checkpointing import mapping

    return mapping


def _split(t: torch.Tensor, parts: int, dim: int = 0):
    return list(t.chunk(parts, dim))


FULL = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6) / 5
QKV = torch.arange(3 * 4, dtype=torch.float32).reshape(3, 4) - 6
BIAS = torch.tensor([0.5, -1.5, 2.5])


def _megatron_state(m, rank: int, world: int) -> dict:
    """A Megatron-Core sharded state dict of rank ``rank``: TP-split weight, replicated bias, a
    factory storing a fused tensor as three row tensors (build_fn returns a list), an object
    per rank, a local non-persistent value and common state."""
    ST_, SO, STF, LNO = m.ShardedTensor, m.ShardedObject, m.ShardedTensorFactory, m.LocalNonpersistentObject

    def build(key, t, replica_id, flattened_range):
        return [ST_.from_rank_offsets(f"{key}.{i}", row, replica_id=replica_id) for i, row in enumerate(t.clone())]

    return {
        "w": ST_.from_rank_offsets("w", _split(FULL, world, 1)[rank].clone(), (1, rank, world)),
        "b": ST_.from_rank_offsets("b", BIAS.clone(), replica_id=rank),
        "qkv": STF("qkv", QKV.clone(), build, lambda rows: torch.stack(list(rows)), replica_id=rank),
        "rng": SO("rng", {"seed": 10 + rank}, (world,), (rank,)),
        "local": LNO(f"rank-{rank}"),
        "iteration": 9,
    }


def _request(m, rank: int, world: int) -> dict:
    """The same keys as a load request in another layout (rows instead of columns)."""
    sd = _megatron_state(m, rank, world)
    sd["w"] = m.ShardedTensor.from_rank_offsets("w", torch.full_like(_split(FULL, world, 0)[rank], -1), (0, rank, world))
    sd["b"] = m.ShardedTensor.from_rank_offsets("b", torch.zeros(3), replica_id=rank)
    sd["qkv"] = m.ShardedTensorFactory("qkv", torch.zeros(3, 4), sd["qkv"].build_fn, sd["qkv"].merge_fn, replica_id=rank)
    sd["rng"] = [m.ShardedObject("rng", None, (world,), (i,), replica_id=rank) for i in range(world)]
    del sd["iteration"]
    return sd


def _check(loaded: dict, rank: int, world: int) -> None:
    assert torch.equal(loaded["w"], _split(FULL, world, 0)[rank])
    assert torch.equal(loaded["b"], BIAS) and torch.equal(loaded["qkv"], QKV)
    assert loaded["rng"] == [{"seed": 10 + i} for i in range(world)]
    assert loaded["local"] == f"rank-{rank}" and loaded["iteration"] == 9


# ======================================================================= item 2, one process
def test_megatron_classes_round_trip_single_process(tmp_path):
    m = _m()
    ci.save(_megatron_state(m, 0, 1), tmp_path / "c")
    common = ci.load_common_state_dict(tmp_path / "c")
    assert common == {"iteration": 9}  # nothing of Megatron's classes pickled into common.pt
    plain = ci.load_plain_tensors(tmp_path / "c")
    assert sorted(plain) == ["b", "qkv.0", "qkv.1", "qkv.2", "w"] and torch.equal(plain["w"], FULL)
    for request in (_request(m, 0, 1), {**_request(m, 0, 1), "w": ST.from_rank_offsets("w", torch.empty(4, 6))}):
        loaded = ci.load(request, tmp_path / "c", strict=ci.StrictHandling.RAISE_ALL)
        _check(loaded, 0, 1)


class ShardedTensor:  # noqa: D101 - a class of that name without the fields (like torch's legacy one)
    def __init__(self):
        self.local_shards = [torch.ones(2)]


class _LooksSharded:
    def __init__(self):
        self.key, self.global_shape, self.global_offset, self.data = "k", (4,), (0,), torch.ones(2)


@pytest.mark.parametrize("value, match", [
    (ShardedTensor(), r"'bad'.*test_megatron_compat\.ShardedTensor.*named like a sharded value"),
    (_LooksSharded(), r"bad: .*_LooksSharded is an object with key, global_shape and global_offset"),
])
def test_sharded_looking_values_are_refused(tmp_path, value, match):
    with pytest.raises(CheckpointingException, match=match.replace("'bad'", "bad")):
        ci.save({"bad": value, "w": ST.from_rank_offsets("w", torch.ones(1))}, tmp_path / "c")
    assert not ci.check_is_distributed_checkpoint(tmp_path / "c")


def test_megatron_value_inside_a_tuple_is_refused(tmp_path):
    m = _m()
    with pytest.raises(CheckpointingException, match=r"ShardedTensor 'w' at t\[1\] is not in a dict or list"):
        ci.save({"t": (1, m.ShardedTensor.from_rank_offsets("w", torch.ones(1)))}, tmp_path / "c")


def test_megatron_factory_building_megatron_tensors_merges(tmp_path):
    m = _m()
    sd = _megatron_state(m, 0, 1)
    ci.save({"qkv": sd["qkv"]}, tmp_path / "c")
    req = m.ShardedTensorFactory("qkv", torch.zeros(3, 4), sd["qkv"].build_fn, lambda rows: sum(rows))
    out = ci.load({"qkv": req}, tmp_path / "c")
    assert torch.equal(out["qkv"], QKV.sum(0))  # merge_fn got the list build_fn returned


# ======================================================================= items 4 and 7
def test_content_metadata_empty_dict_round_trips(tmp_path):
    ci.save({"w": ST.from_rank_offsets("w", torch.ones(1))}, tmp_path / "c", content_metadata={})
    assert ci.load_content_metadata(tmp_path / "c") == {}
    ci.save({"w": ST.from_rank_offsets("w", torch.ones(1))}, tmp_path / "d")
    assert ci.load_content_metadata(tmp_path / "d") is None
    # Megatron-Core drops the process group its sharded_state_dict metadata may carry
    ci.save({"w": ST.from_rank_offsets("w", torch.ones(1))}, tmp_path / "e",
            content_metadata={"dp_cp_group": torch.distributed.group.WORLD, "singleton_local_shards": True})
    assert ci.load_content_metadata(tmp_path / "e") == {"singleton_local_shards": True}


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_not_a_distributed_checkpoint_message(tmp_path, make):
    path = tmp_path / "x"
    if make == "empty":
        path.mkdir()
    for call in (lambda: ci.load({}, path), lambda: ci.load_common_state_dict(path), lambda: ci.load_tensors_metadata(path)):
        with pytest.raises(ci.CheckpointNotFoundError, match=f"{path} is not a distributed checkpoint"):
            call()


def test_key_not_in_checkpoint_is_dcp_checkpoint_exception(tmp_path):
    ci.save({"w": ST.from_rank_offsets("w", torch.ones(2))}, tmp_path / "c")
    for request in ({"v": ST.from_rank_offsets("v", torch.ones(2))}, {"o": ci.ShardedObject("o", None, (1,), (0,))}):
        with pytest.raises(CheckpointException) as e:  # what Megatron-Core users catch
            ci.load(request, tmp_path / "c")
        assert isinstance(e.value, KeyNotInCheckpointError) and isinstance(e.value, MismatchError)
        assert isinstance(e.value, CheckpointingException) and "is not in the checkpoint" in str(e.value)


def test_raise_all_in_megatrons_words(tmp_path):
    ci.save({"w": ST.from_rank_offsets("w", torch.ones(2)), "u": ST.from_rank_offsets("u", torch.ones(2))}, tmp_path / "c")
    with pytest.raises(KeyNotInCheckpointError) as e:
        ci.load({"w": ST.from_rank_offsets("w", torch.ones(2)), "v": ST.from_rank_offsets("v", torch.ones(2))},
                tmp_path / "c", strict=ci.StrictHandling.RAISE_ALL)
    msg = str(e.value)
    assert "Missing keys (for all ranks): {'u'}. Unexpected keys (for this rank): {'v'}. " in msg
    assert "Some keys found in the checkpoint are missing in the provided sharded state dict" in msg
    with pytest.raises(MismatchError, match=r"Missing keys \(for all ranks\): \{'u'\}"):
        ci.load({"w": ST.from_rank_offsets("w", torch.ones(2))}, tmp_path / "c", strict="raise_all")


# ======================================================================= item 5: optimizer flow
class _Net(torch.nn.Module):
    def __init__(self, mcore=None):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(3, 5), torch.nn.Linear(5, 2)
        self.mcore = mcore

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))

    def sharded_state_dict(self, prefix=""):
        make = (self.mcore.ShardedTensor if self.mcore else ST).from_rank_offsets
        return {f"{prefix}{k}": make(f"{prefix}{k}", v) for k, v in self.state_dict(prefix="", keep_vars=True).items()}


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 3, generator=g)).pow(2).sum().backward()
        opt.step()


def _megatron_style_state(model, opt):
    msd = model.sharded_state_dict()
    osd = opt.state_dict()
    optim_state_to_sharding_state(osd, get_param_id_to_sharded_param_map(msd, [p for g in opt.param_groups for p in g["params"]]))
    return {"model": msd, "optimizer": osd, "iteration": 3}


@pytest.mark.parametrize("classes", ["ours", "megatron"])
def test_training_loop_optimizer_loads_directly(tmp_path, classes):
    mcore = _m() if classes == "megatron" else None
    torch.manual_seed(0)
    a = _Net(mcore)
    opt_a = torch.optim.AdamW(a.parameters(), lr=0.05)
    _train(a, opt_a, 3, seed=1)
    ci.save(_megatron_style_state(a, opt_a), tmp_path / "c")

    b = _Net(mcore)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1.0)
    init_optimizer_state(opt_b)  # Megatron-Core's init_state_fn before building a load request
    loaded = ci.load(_megatron_style_state(b, opt_b), tmp_path / "c")
    opt_b.load_state_dict(loaded["optimizer"])  # no extra call
    assert loaded["iteration"] == 3 and opt_b.param_groups[0]["lr"] == 0.05
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        assert all(torch.equal(opt_a.state[p][k], opt_b.state[q][k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    _train(a, opt_a, 2, seed=2)
    _train(b, opt_b, 2, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _megatron_fp32_optimizer(model, lr):
    """Megatron-Core's FP32Optimizer around torch AdamW; its __init__ allocates a CUDA tensor,
    so it is assembled by hand (sharded_state_dict / load_state_dict need no CUDA)."""
    _m()
    from megatron.core.optimizer import FP32Optimizer, OptimizerConfig

    groups = [{"params": list(model.parameters()), "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False,
               "is_decoupled_lr": False}]
    wrapper = object.__new__(FP32Optimizer)
    wrapper.optimizer = torch.optim.AdamW(groups, lr=lr)
    wrapper.config = OptimizerConfig(optimizer="adam", lr=lr)
    wrapper.init_state_fn = lambda opt, config: init_optimizer_state(opt)
    wrapper.is_stub_optimizer = False
    return wrapper


def test_megatron_optimizer_wrapper_through_our_save_load(tmp_path):
    mcore = _m()
    torch.manual_seed(0)
    a = _Net(mcore)
    wa = _megatron_fp32_optimizer(a, 0.05)
    _train(a, wa.optimizer, 3, seed=1)
    msd = a.sharded_state_dict()
    # Megatron's own optimizer helpers (exclude_keys="step" + common_step), our save
    ci.save({"model": msd, "optimizer": wa.sharded_state_dict(msd)}, tmp_path / "c")

    b = _Net(mcore)
    wb = _megatron_fp32_optimizer(b, 1.0)
    msd_b = b.sharded_state_dict()
    loaded = ci.load({"model": msd_b, "optimizer": wb.sharded_state_dict(msd_b, is_loading=True)}, tmp_path / "c")
    wb.load_state_dict(loaded["optimizer"])
    # ... and our high-level loader reads the same checkpoint into a plain optimizer (step from common_step)
    c = _Net()
    c.load_state_dict(a.state_dict())
    opt_c = torch.optim.AdamW(c.parameters(), lr=1.0)
    from ckpt_integration.optimizer import load_optimizer_state

    load_optimizer_state(opt_c, c.sharded_state_dict(), tmp_path / "c")
    for p, q, r in zip(a.parameters(), b.parameters(), c.parameters()):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(wa.optimizer.state[p][k], wb.optimizer.state[q][k]), k
            assert torch.equal(wa.optimizer.state[p][k], opt_c.state[r][k]), k
    _train(a, wa.optimizer, 2, seed=2)
    _train(b, wb.optimizer, 2, seed=2)
    _train(c, opt_c, 2, seed=2)
    assert all(torch.equal(p, q) and torch.equal(p, r) for p, q, r in zip(a.parameters(), b.parameters(), c.parameters()))


def test_exclude_step_and_common_step_with_our_helpers(tmp_path):
    torch.manual_seed(0)
    a = _Net()
    opt_a = torch.optim.Adam(a.parameters(), lr=0.05)
    _train(a, opt_a, 2, seed=1)

    def state(model, opt):
        msd = model.sharded_state_dict()
        osd = opt.state_dict()
        step = osd["state"][0]["step"]
        optim_state_to_sharding_state(osd, get_param_id_to_sharded_param_map(msd, list(model.parameters())), exclude_keys="step")
        osd["state"]["common_step"] = step
        return {"model": msd, "optimizer": osd}

    ci.save(state(a, opt_a), tmp_path / "c")
    assert not any("step" in k for k in ci.load_sharded_metadata(tmp_path / "c"))
    b = _Net()
    opt_b = torch.optim.Adam(b.parameters(), lr=0.05)
    init_optimizer_state(opt_b)
    loaded = ci.load(state(b, opt_b), tmp_path / "c")
    from ckpt_integration.optimizer import sharding_state_to_optim_state

    opt_b.load_state_dict(sharding_state_to_optim_state(loaded["optimizer"]))  # common_step -> every param's step
    assert all(opt_b.state[q]["step"] == opt_a.state[p]["step"] for p, q in zip(a.parameters(), b.parameters()))


# ======================================================================= 2 ranks, one launch
class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _worker(rank: int, world: int, base: str, out: str) -> None:
    _import_megatron()
    _patch_cuda_for_megatron()
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import mapping as m

    results: dict = {}
    ours = os.path.join(base, "ours")
    ci.save(_megatron_state(m, rank, world), ours, content_metadata={})
    mck = os.path.join(base, "megatron")
    if rank == 0:
        os.makedirs(mck)
    dist.barrier()
    mdc.save(_megatron_state(m, rank, world), mck)
    # Megatron-Core 0.19's layout, written by Megatron-Core's own save: the common state as the
    # ``common_state`` ShardedObject inside the DCP data, and no common.pt
    m19 = os.path.join(base, "megatron-0.19-layout")
    if rank == 0:
        os.makedirs(m19)
    dist.barrier()
    st = _megatron_state(m, rank, world)
    common = {"iteration": st.pop("iteration"), "args": {"lr": 0.5}}
    st["common_state"] = m.ShardedObject("common_state", common, (1,), (0,), replica_id=rank)
    mdc.save(st, m19)
    dist.barrier()
    if rank == 0:
        os.remove(os.path.join(m19, "common.pt"))  # (0.16 still writes the rest of the common state there: {})
    dist.barrier()

    _record(results, "megatron_loads_ours_written_from_megatron_classes",
            lambda: _check(mdc.load(_request(m, rank, world), ours), rank, world))
    _record(results, "ours_loads_ours_with_megatron_request",
            lambda: _check(ci.load(_request(m, rank, world), ours), rank, world))
    _record(results, "ours_loads_megatron_with_megatron_request",
            lambda: _check(ci.load(_request(m, rank, world), mck, trusted=True), rank, world))

    def factory_merge_like_megatron():  # item 1, against Megatron itself
        req = lambda: {"qkv": _request(m, rank, world)["qkv"]}  # noqa: E731
        theirs, mine = mdc.load(req(), mck)["qkv"], ci.load(req(), mck, trusted=True)["qkv"]
        assert torch.equal(theirs, QKV) and torch.equal(mine, theirs)

    _record(results, "factory_merge_like_megatron", factory_merge_like_megatron)
    _record(results, "megatron_reads_empty_content_metadata", lambda: _assert_eq(mdc.load_content_metadata(ours), {}))

    def flat_shards_read_by_megatron():
        # DP-style flat slices of one replicated [4, 6] tensor: rank r owns elements [10r, 10r+14)
        a, b = (0, 10) if rank == 0 else (10, 24)
        flat = ST.from_rank_offsets_flat("flat", FULL.flatten()[a:b].clone(), (4, 6), flattened_range=slice(a, b))
        ci.save({"flat": flat}, os.path.join(base, "flat"))
        req = m.ShardedTensor.from_rank_offsets("flat", torch.empty(2, 6), (0, rank, world))
        assert torch.equal(mdc.load({"x": req}, os.path.join(base, "flat"))["x"], _split(FULL, world, 0)[rank])
        mine = ST.from_rank_offsets_flat("flat", torch.empty(12), (4, 6), flattened_range=slice(12 * rank, 12 * rank + 12))
        assert torch.equal(ci.load({"x": mine}, os.path.join(base, "flat"))["x"], FULL.flatten()[12 * rank:12 * rank + 12])

    _record(results, "flat_shards_read_by_megatron", flat_shards_read_by_megatron)

    def common_state_differences_logged():
        handler = _Records()
        logging.getLogger("ckpt_integration").addHandler(handler)
        try:
            same = {"w": ST.from_rank_offsets("w", torch.ones(2), replica_id=rank), "a": 1, "t": torch.ones(2)}
            ci.save(same, os.path.join(base, "same"))
            assert not handler.messages, handler.messages
            differs = {**same, "b": {"only": rank}, "t": torch.ones(2) * rank, f"r{rank}": 1}
            ci.save(differs, os.path.join(base, "differs"))
        finally:
            logging.getLogger("ckpt_integration").removeHandler(handler)
        if rank == 0:
            assert not handler.messages, handler.messages
        else:
            (msg,) = handler.messages
            assert "Rank 1 common state dict differs from rank 0 common state dict" in msg, msg
            assert "Keys only on rank 0: [('r0',)]" in msg and "Keys only on 1: [('r1',)]" in msg, msg
            assert "(('b', 'only'), <class 'int'>, <class 'int'>)" in msg and "('t',)" in msg, msg
        # what is saved is rank 0's
        assert ci.load_common_state_dict(os.path.join(base, "differs"))["b"] == {"only": 0}
        # Megatron-Core's own check on the same (non-tensor) differences: its sentence is our first line
        from megatron.core.dist_checkpointing.validation import _validate_common_state_dict

        common = {"a": 1, "b": {"only": rank}, f"r{rank}": 1}
        theirs = _Records()
        logging.getLogger("megatron.core.dist_checkpointing.validation").addHandler(theirs)
        logging.getLogger("ckpt_integration").addHandler(handler)
        handler.messages.clear()
        try:
            _validate_common_state_dict(common)
            ci.save({"w": ST.from_rank_offsets("w", torch.ones(2), replica_id=rank), **common}, os.path.join(base, "differs2"))
        finally:
            logging.getLogger("megatron.core.dist_checkpointing.validation").removeHandler(theirs)
            logging.getLogger("ckpt_integration").removeHandler(handler)
        if rank == 1:
            (mine,), (megatron,) = handler.messages, theirs.messages
            assert mine.split("\n")[0] == megatron and mine.split("\n")[1] == "(only rank 0's common state is saved)", (mine, megatron)

    _record(results, "common_state_differences_logged", common_state_differences_logged)

    def key_missing_on_one_rank_is_dcp_exception():
        req = {"w": m.ShardedTensor.from_rank_offsets("w", torch.empty(4, 3), (1, rank, world))}
        if rank == 1:
            req["nope"] = ST.from_rank_offsets("nope", torch.empty(2))
        try:
            ci.load(req, ours)
        except CheckpointException as e:  # Megatron-Core users' except clause, on every rank
            assert isinstance(e, CheckpointingException)
            assert isinstance(e, KeyNotInCheckpointError if rank == 1 else ci.errors.DistributedCheckpointingError), type(e)
            assert "'nope'" in str(e)
        else:
            raise AssertionError("no exception")

    _record(results, "key_missing_on_one_rank_is_dcp_exception", key_missing_on_one_rank_is_dcp_exception)

    def sharded_dtensor_in_common_state_refused():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard

        mesh = init_device_mesh("cpu", (world,))
        split = DTensor.from_local(torch.ones(2), mesh, [Shard(0)], run_check=False)
        try:
            ci.save({"d": split}, os.path.join(base, "dtensor"))
        except CheckpointingException as e:
            assert "DTensor with placements" in str(e) and "split across ranks" in str(e), str(e)
        else:
            raise AssertionError("a sharded DTensor was pickled into the common state")
        replicated = DTensor.from_local(torch.ones(2), mesh, [Replicate()], run_check=False)
        ci.save({"d": replicated}, os.path.join(base, "dtensor_replicated"))  # one copy is all there is

    _record(results, "sharded_dtensor_in_common_state_refused", sharded_dtensor_in_common_state_refused)
    _record(results, "optimizer_flow_two_ranks", lambda: _optimizer_flow(m, rank, world, os.path.join(base, "optim")))
    _write_results(out, rank, results)


def _optimizer_flow(m, rank: int, world: int, path: str) -> None:
    """TP-style: rank r holds columns [3r, 3r+3) of a [4, 6] weight (Megatron's classes) and a
    replicated bias; AdamW state goes through optim_state_to_sharding_state -> save -> load ->
    load_state_dict with no other call, same layout and resharded (rows), exactly."""
    torch.manual_seed(rank)
    w = torch.nn.Parameter(_split(FULL, world, 1)[rank].clone())
    b = torch.nn.Parameter(BIAS.clone())

    def model_sd(w, b, rows=False):
        spec = (0, rank, world) if rows else (1, rank, world)
        return {"w": m.ShardedTensor.from_rank_offsets("w", w, spec), "b": m.ShardedTensor.from_rank_offsets("b", b, replica_id=rank)}

    def request(w, b, opt, rows=False):
        msd = model_sd(w, b, rows)
        osd = opt.state_dict()
        optim_state_to_sharding_state(osd, get_param_id_to_sharded_param_map(msd, [w, b]))
        return {"model": msd, "optimizer": osd}

    opt = torch.optim.AdamW([w, b], lr=0.1)
    for step in range(3):
        opt.zero_grad()
        ((w * (step + 1)).sum() ** 2 + (b ** 2).sum()).backward()
        opt.step()
    ci.save(request(w, b, opt), path)
    # same layout: a fresh optimizer with placeholder state, loaded directly
    w2, b2 = torch.nn.Parameter(torch.zeros_like(w)), torch.nn.Parameter(torch.zeros(3))
    opt2 = torch.optim.AdamW([w2, b2], lr=1.0)
    init_optimizer_state(opt2)
    opt2.load_state_dict(ci.load(request(w2, b2, opt2), path)["optimizer"])
    assert torch.equal(w2, w) and opt2.param_groups[0]["lr"] == 0.1
    for p, q in ((w, w2), (b, b2)):
        assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    # resharded: rows instead of columns; compare with the gathered global state
    full = [torch.empty_like(opt.state[w]["exp_avg"]) for _ in range(world)]
    dist.all_gather(full, opt.state[w]["exp_avg"].contiguous())
    w3 = torch.nn.Parameter(torch.zeros(4 // world, 6))
    opt3 = torch.optim.AdamW([w3, torch.nn.Parameter(torch.zeros(3))], lr=1.0)
    init_optimizer_state(opt3)
    opt3.load_state_dict(ci.load(request(w3, opt3.param_groups[0]["params"][1], opt3, rows=True), path)["optimizer"])
    assert torch.equal(opt3.state[w3]["exp_avg"], _split(torch.cat(full, 1), world, 0)[rank])
    assert torch.equal(w3, _split(torch.cat([x.detach() for x in _gather(w)], 1), world, 0)[rank])


def _gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.detach().contiguous())
    return out


def _assert_eq(a, b):
    assert a == b, (a, b)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    _import_megatron()
    base = tmp_path_factory.mktemp("compat")
    run_distributed(_worker, WORLD, str(base), str(base), timeout=300)
    out = _read_results(str(base))
    out["_base"] = str(base)  # (the checkpoints, for the tests that read them again)
    return out


SCENARIOS = [
    "megatron_loads_ours_written_from_megatron_classes",
    "ours_loads_ours_with_megatron_request",
    "ours_loads_megatron_with_megatron_request",
    "factory_merge_like_megatron",
    "megatron_reads_empty_content_metadata",
    "flat_shards_read_by_megatron",
    "common_state_differences_logged",
    "key_missing_on_one_rank_is_dcp_exception",
    "sharded_dtensor_in_common_state_refused",
    "optimizer_flow_two_ranks",
]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_two_ranks(two_ranks, scenario):
    _assert_ok(two_ranks, scenario)


def test_async_request_scheduled_again_megatron_style(tmp_path):
    # Megatron-Core: request = save(..., async_sharded_save=True); queue.schedule_async_request(request)
    from ckpt_integration.execution.async_save import AsyncCallsQueue

    queue = AsyncCallsQueue()
    try:
        req = ci.save({"w": ST.from_rank_offsets("w", torch.ones(2))}, tmp_path / "c", async_sharded_save=True,
                      async_queue=queue)
        assert queue.schedule_async_request(req) == req.call_idx
        queue.maybe_finalize_async_calls(blocking=True)
        assert queue.get_num_unfinalized_calls() == 0
    finally:
        queue.close()
    assert torch.equal(ci.load_plain_tensors(tmp_path / "c")["w"], torch.ones(2))


def _write_integrity_json(path: str) -> None:
    """``integrity.json`` as Megatron-Core 0.18's ``save_integrity_manifest`` writes it: the SHA-256 of
    every file of the directory, sorted by name, under ``{"algorithm": "sha256", "files": ...}``."""
    import hashlib
    import json

    files = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full) and name != "integrity.json":
            with open(full, "rb") as f:
                files[name] = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(path, "integrity.json"), "w") as f:
        json.dump({"algorithm": "sha256", "files": files}, f, indent=2)


def test_megatron_integrity_manifest_is_checked_when_present(two_ranks, tmp_path):
    """A Megatron-Core checkpoint with core 0.18's integrity.json: it loads (every listed file's SHA-256
    checked first), verify says so; a flipped byte or a missing file is refused naming the file."""
    import shutil

    from ckpt_integration.tools import verify_checkpoint

    src = os.path.join(two_ranks["_base"], "megatron")
    good = str(tmp_path / "good")
    shutil.copytree(src, good)
    _write_integrity_json(good)
    report = verify_checkpoint(good)
    assert report.ok and any("integrity.json" in n for n in report.notes), (report.problems, report.notes)
    plain = ci.load_plain_tensors(good)
    assert torch.equal(plain["w"], FULL) and torch.equal(plain["b"], BIAS)
    data = sorted(n for n in os.listdir(good) if n.endswith(".distcp"))[0]
    for damage in ("flip", "missing"):
        bad = str(tmp_path / damage)
        shutil.copytree(good, bad)
        if damage == "flip":
            with open(os.path.join(bad, data), "r+b") as f:
                f.seek(10)
                b = f.read(1)
                f.seek(10)
                f.write(bytes([b[0] ^ 1]))
        else:
            os.remove(os.path.join(bad, data))
        with pytest.raises(ci.CorruptCheckpointError, match=data):
            ci.load_plain_tensors(bad)
        report = verify_checkpoint(bad)
        assert not report.ok and any(data in str(p) for p in report.problems), report.problems


def test_megatron_0_19_layout_common_state_inside_the_data_is_read(two_ranks, tmp_path):
    """Megatron-Core 0.19 keeps the common state as the ``common_state`` ShardedObject in the DCP data and
    writes no common.pt: ``load``, ``load_common_state_dict`` and ``verify`` read it from there; our own
    ``save(common_state_in_data=True)`` writes that layout and reads it back."""
    from ckpt_integration.tools import verify_checkpoint

    m19 = os.path.join(two_ranks["_base"], "megatron-0.19-layout")
    assert not os.path.exists(os.path.join(m19, "common.pt"))
    assert ci.load_common_state_dict(m19) == {"iteration": 9, "args": {"lr": 0.5}}
    out = ci.load({"w": ST.from_rank_offsets("w", torch.zeros_like(FULL))}, m19)
    assert torch.equal(out["w"], FULL) and out["iteration"] == 9 and out["args"] == {"lr": 0.5}
    report = verify_checkpoint(m19)
    assert report.ok and any("common_state" in n for n in report.notes), (report.problems, report.notes)
    ours = str(tmp_path / "ours")
    ci.save({"w": ST.from_rank_offsets("w", FULL.clone()), "iteration": 3}, ours, common_state_in_data=True,
            content_metadata={"format": "x"})
    assert not os.path.exists(os.path.join(ours, "common.pt"))
    assert ci.load_common_state_dict(ours) == {"iteration": 3, "content_metadata": {"format": "x"}}
    assert ci.load_content_metadata(ours) == {"format": "x"} and verify_checkpoint(ours).ok
    # the embedded common state is not a checkpoint key the request left out (strict modes)
    for path in (m19, ours):
        got, missing, unexpected = ci.load({"w": ST.from_rank_offsets("w", torch.zeros_like(FULL))}, path,
                                           strict="return_all")
        assert "common_state" not in missing and not unexpected and torch.equal(got["w"], FULL), (path, missing)
    ci.load({"w": ST.from_rank_offsets("w", torch.zeros_like(FULL))}, ours, strict="raise_all")
