"""Edge cases of the core engine and the optimizer helpers found in review.

Each test fails on the behaviour it guards against: silent corruption (optimizer states shaped
unlike their param under TP, sharded values hidden in tuples, gaps hidden by out-of-shape shards),
late raw errors (group count, optimizer kind, Parameters as load targets) or needless refusals
(DCP ``.metadata`` holding a ``pathlib`` path, metadata-only non-main replicas with balancing).
"""

from __future__ import annotations

import json
import pathlib
import pickle
import random

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import ShardedTensor
from ckpt_integration.errors import CheckpointingException, ShardingIntegrityError
from ckpt_integration.optimizer import (
    OptimizerStateMismatchError,
    ZeroShardedOptimizer,
    load_optimizer_state,
    optimizer_sharded_state_dict,
    sharding_state_to_optim_state,
)
from ckpt_integration.planning.save_plan import plan_writers
from ckpt_integration.planning.shards import ShardMeta
from tests.damage import write_zarr_index
from tests.dist_utils import run_distributed


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 4)
        self.b = torch.nn.Linear(4, 2)

    def sharded(self):
        return {k: ShardedTensor.from_rank_offsets(k, v) for k, v in self.state_dict().items()}


def _train(model, opt, steps=2):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        model.b(model.a(torch.randn(5, 3, generator=g))).sum().backward()
        opt.step()
        opt.zero_grad()


def _saved(tmp_path, opt_factory, name="c"):
    torch.manual_seed(0)
    m = _Net()
    o = opt_factory(m)
    _train(m, o)
    msd = m.sharded()
    path = str(tmp_path / name)
    ci.save({"model": msd, "optimizer": optimizer_sharded_state_dict(o, msd)}, path)
    return path


# ------------------------------------------------------------------------------------------
# optimizer helpers
# ------------------------------------------------------------------------------------------
def test_request_without_optimizer_state_is_warned_about(tmp_path, caplog):
    # scalars are saved in place, so a request from an optimizer without state asks for nothing
    # (as in Megatron-Core): building it warns, and load_optimizer_state / init_state=True load it all
    path = _saved(tmp_path, lambda m: torch.optim.Adam(m.parameters(), lr=0.01))
    m = _Net()
    o = torch.optim.Adam(m.parameters(), lr=0.01)  # no state yet, init_state not asked for
    with caplog.at_level("WARNING", logger="ckpt_integration"):
        request = optimizer_sharded_state_dict(o, m.sharded())
    assert "has no state yet" in caplog.text and "init_state=True" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="ckpt_integration"):  # once per optimizer (a stateless SGD saved
        optimizer_sharded_state_dict(o, m.sharded())  # every epoch said it every time)
    assert "has no state yet" not in caplog.text
    assert not ci.load({"optimizer": request}, path)["optimizer"].get("state")
    loaded = ci.load({"optimizer": optimizer_sharded_state_dict(o, m.sharded(), init_state=True)}, path)
    o.load_state_dict(sharding_state_to_optim_state(loaded["optimizer"]))
    assert {"step", "exp_avg", "exp_avg_sq"} == set(o.state[m.a.weight])


def test_param_group_count_mismatch_names_both_counts(tmp_path):
    path = _saved(tmp_path, lambda m: torch.optim.Adam(m.parameters(), lr=0.01))
    m = _Net()
    o = torch.optim.Adam([{"params": m.a.parameters()}, {"params": m.b.parameters(), "lr": 0.5}])
    with pytest.raises(OptimizerStateMismatchError, match="has 1 param groups, this optimizer 2"):
        load_optimizer_state(o, m.sharded(), path)


def test_state_of_another_optimizer_kind_is_refused(tmp_path):
    path = _saved(tmp_path, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), "sgd")
    m = _Net()
    o = torch.optim.Adam(m.parameters())
    with pytest.raises(OptimizerStateMismatchError, match=r"(?s)does not fit Adam.*'a.weight'.*no exp_avg, exp_avg_sq"):
        load_optimizer_state(o, m.sharded(), path)
    # the same kind loads exactly the state that was saved (_saved trains from seed 0: rebuild it)
    o2 = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    load_optimizer_state(o2, m.sharded(), path)
    torch.manual_seed(0)
    ref = _Net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    _train(ref, ref_opt)
    for p2, pr in zip(m.parameters(), ref.parameters()):
        assert torch.equal(o2.state[p2]["momentum_buffer"], ref_opt.state[pr]["momentum_buffer"])
    assert o2.state_dict()["param_groups"] == ref_opt.state_dict()["param_groups"]


def test_zero_size_param_needs_no_sharded_tensor(tmp_path):
    class Z(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.empty = torch.nn.Parameter(torch.zeros(0, 3))
            self.v = torch.nn.Parameter(torch.ones(2))

    z = Z()
    o = torch.optim.Adam(z.parameters(), lr=0.1)
    z.v.sum().backward()
    o.step()
    msd = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in z.state_dict().items() if v.numel()}
    ci.save({"model": msd, "optimizer": optimizer_sharded_state_dict(o, msd)}, str(tmp_path / "z"))
    z2 = Z()
    o2 = torch.optim.Adam(z2.parameters(), lr=0.1)
    load_optimizer_state(o2, {k: ShardedTensor.from_rank_offsets(k, v) for k, v in z2.state_dict().items() if v.numel()},
                         str(tmp_path / "z"))
    assert torch.equal(o2.state[z2.v]["exp_avg"], o.state[z.v]["exp_avg"])


def _adafactor_under_tp(rank, world, root):
    p = torch.nn.Parameter(torch.randn(4, 6))  # rows [4r, 4r+4) of (8, 6)
    opt = torch.optim.Adafactor([p], lr=0.01)
    (p ** 2).sum().backward()
    opt.step()
    msd = {"w": ShardedTensor.from_rank_offsets("w", p.detach(), (0, rank, world))}
    with pytest.raises(CheckpointingException, match=r"'row_var' of param 'w'.*sharded across ranks.*exclude_keys"):
        optimizer_sharded_state_dict(opt, msd)
    # excluding the factored states saves the rest, and it loads back exactly
    sd = optimizer_sharded_state_dict(opt, msd, exclude_keys=("row_var", "col_var"))
    ci.save({"model": msd, "optimizer": sd}, root + "/c")
    loaded = ci.load({"model": {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 6), (0, rank, world))}}, root + "/c")
    assert torch.equal(loaded["model"]["w"], p.detach())


def test_optimizer_state_shaped_unlike_a_sharded_param_is_refused(tmp_path):
    if not hasattr(torch.optim, "Adafactor"):
        pytest.skip("torch without Adafactor")
    run_distributed(_adafactor_under_tp, 2, str(tmp_path), timeout=120)


def test_zero_refuses_an_integer_replica_id_it_cannot_split():
    w = torch.nn.Parameter(torch.randn(4, 6))
    z = ZeroShardedOptimizer([w], torch.optim.Adam, lr=0.1)  # no torch.distributed: DP rank 0
    assert z.replica_id_fn(0) == 0 and z.replica_id_fn((1, 0)) == (1, 0) and z.replica_id_fn((1, 3)) == (1, 0)
    with pytest.raises(CheckpointingException, match="replica_id 1 on data-parallel rank 0.*tuple replica_ids"):
        z.replica_id_fn(1)


# ------------------------------------------------------------------------------------------
# core engine
# ------------------------------------------------------------------------------------------
def test_sharded_value_in_a_tuple_is_refused(tmp_path):
    sd = {"t": (ShardedTensor.from_rank_offsets("tt", torch.ones(2)),)}
    with pytest.raises(CheckpointingException, match=r"ShardedTensor 'tt' at .*not in a dict or list"):
        ci.save(sd, str(tmp_path / "c"))
    assert not (tmp_path / "c" / "metadata.json").exists()


def test_shard_outside_the_global_shape_cannot_hide_a_gap(tmp_path):
    # [0:6) + [8:12) of a (10,) tensor sum to 10 elements, but [6:8) is a gap
    sd = {
        "a": ShardedTensor.from_global_offsets("k", torch.ones(6), (10,), (0,)),
        "b": ShardedTensor.from_global_offsets("k", torch.ones(4), (10,), (8,), allow_shape_mismatch=True),
    }
    with pytest.raises(ShardingIntegrityError, match=r"'k'.*\[8:12\].*outside the global shape"):
        ci.save(sd, str(tmp_path / "c"))


@pytest.mark.parametrize("strategy", ["local", "fully_parallel", "two_stage"])
def test_parameters_as_load_targets_under_resharding(tmp_path, strategy):
    full = torch.arange(64 * 8.0).reshape(64, 8)
    ci.save({"w": ShardedTensor.from_rank_offsets("w", full)}, str(tmp_path / "c"))
    col = torch.nn.Parameter(torch.zeros(64, 4))  # a column half: strided reads into the Parameter
    out = ci.load({"w": ShardedTensor.from_global_offsets("w", col, (64, 8), (0, 4))}, str(tmp_path / "c"),
                  validate_access_integrity=False, load_strategy=strategy, thread_count=2)
    assert out["w"] is col and col.requires_grad
    assert torch.equal(col.detach(), full[:, 4:])
    padded = torch.nn.Parameter(torch.full((70, 8), 5.0))  # allow_shape_mismatch zero-fills the rest
    ci.load({"w": ShardedTensor.from_rank_offsets("w", padded, allow_shape_mismatch=True)}, str(tmp_path / "c"),
            load_strategy=strategy)
    assert torch.equal(padded.detach()[:64], full) and not padded.detach()[64:].any()


def test_dcp_metadata_with_a_pathlib_checkpoint_id_loads(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, storage_writer=dcp.FileSystemWriter(tmp_path / "dcp"))
    md = pickle.loads((tmp_path / "dcp" / ".metadata").read_bytes())
    md.storage_meta.checkpoint_id = pathlib.PosixPath(tmp_path / "dcp")  # as a Path-given writer keeps it
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(md))
    # a plain DCP directory becomes loadable with the torch_dist backend's commit marker
    (tmp_path / "dcp" / "metadata.json").write_text(json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}
    ))
    out = ci.load_plain_tensors(str(tmp_path / "dcp"))
    assert torch.equal(out["w"], torch.arange(6.0).reshape(2, 3))


def test_load_content_metadata_accepts_trust_arguments(tmp_path):
    ci.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, str(tmp_path / "c"),
            content_metadata={"format": 2})
    assert ci.load_content_metadata(str(tmp_path / "c"), trusted=False) == {"format": 2}


def test_balancing_skips_replicas_without_data():
    def meta(rank, has_data):
        return ShardMeta("k", "tensor", rank, "float32", (1000,), (0,), (1000,), (rank,), 4000, has_data=has_data)

    chosen = plan_writers([meta(0, True), meta(1, False), meta(2, False)], balance=True)
    assert [s.rank for s in chosen.values()] == [0]
    chosen = plan_writers(
        [ShardMeta(f"k{i}", "tensor", r, "float32", (10,), (0,), (10,), (r,), 40) for i in range(4) for r in range(2)]
    )
    assert sorted(s.rank for s in chosen.values()) == [0, 0, 1, 1]  # with data everywhere: balanced



def test_remove_sharded_tensors_never_deletes_outside_a_zarr_checkpoint(tmp_path):
    pytest.importorskip("zarr")
    from ckpt_integration.errors import UnsafeCheckpointError

    d = tmp_path / "ck"
    ci.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, str(d), sharded_strategy="zarr")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("x")
    index_path = d / "zarr_index.json"
    index = json.loads(index_path.read_text())
    index["tensors"]["../victim"] = index["tensors"]["w"]  # a crafted index naming a path outside
    write_zarr_index(d, index)
    with pytest.raises(UnsafeCheckpointError, match=r"\.\./victim.*outside the checkpoint"):
        ci.remove_sharded_tensors(str(d), "../")
    assert (victim / "keep.txt").exists()


def test_checksum_matches_zlib_whatever_the_implementation():
    import os
    import zlib

    from ckpt_integration.storage import checksum

    data = os.urandom(1 << 20)
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(data[1000:], checksum.crc32(data[:1000])) == zlib.crc32(data)  # continued
    assert checksum.crc32(memoryview(data)) == zlib.crc32(data)
    try:
        import zlib_ng  # noqa: F401
    except ImportError:
        assert checksum.IMPLEMENTATION == "zlib"
    else:
        assert checksum.IMPLEMENTATION == "zlib-ng"


def test_from_rank_offsets_builds_what_the_dataclass_builds():
    """``from_rank_offsets`` sets the fields directly (its shapes are tuples of ints already):
    the same object as the dataclass constructor makes, equal field by field, and the same
    checks (a bad shard still raises naming its key); a subclass or extra fields take the
    constructor."""
    import dataclasses

    from ckpt_integration import ShardedTensor
    from ckpt_integration.errors import CheckpointingException

    t = torch.zeros(4, 6)
    cases = [((), {}), (((1, 1, 2),), {}), (((0, 2, 3), (1, 0, 2)), {"replica_id": (0, 1)}),
             (((0, 1, 4),), {"prepend_axis_num": 1}), (((1, 1, 2),), {"allow_shape_mismatch": True})]
    for offsets, kw in cases:
        got = ShardedTensor.from_rank_offsets("k", t, *offsets, **kw)
        pre = kw.get("prepend_axis_num", 0)
        gs, go, fr = [1] * pre + list(t.shape), [0] * (pre + 2), [1] * (pre + 2)
        for axis, r, n in offsets:
            local = 1 if axis < pre else t.shape[axis - pre]
            gs[axis], go[axis], fr[axis] = local * n, local * r, n
        want = ShardedTensor("k", t, t.dtype, tuple(t.shape), tuple(gs), tuple(go), tuple(fr), kw.get("replica_id", 0),
                             pre, kw.get("allow_shape_mismatch", False))
        assert got == want and got.__dict__ == want.__dict__
        assert list(got.__dict__) == [f.name for f in dataclasses.fields(ShardedTensor)]
    with pytest.raises(CheckpointingException, match="key must be a non-empty str"):
        ShardedTensor.from_rank_offsets("", t)
    with pytest.raises(CheckpointingException, match="key must be a non-empty str"):
        ShardedTensor.from_rank_offsets(7, t)
    # the fast path checks only the key: everything else the full check looks at holds by
    # construction, on any grid (random shapes, prepended axes, fragments and positions)
    rng = random.Random(19)
    for _ in range(300):
        shape = tuple(rng.randint(0, 5) for _ in range(rng.randint(0, 3)))
        pre = rng.randint(0, 2)
        axes = rng.sample(range(len(shape) + pre), rng.randint(0, len(shape) + pre))
        offsets = []
        for axis in axes:
            n = rng.randint(1, 4)
            offsets.append((axis, rng.randrange(n), n))
        got = ShardedTensor.from_rank_offsets("k", torch.zeros(shape), *offsets, prepend_axis_num=pre)
        got.validate_metadata_integrity()
    for bad in [(2, 0, 2), (0, 2, 2), (0, -1, 2), (0, 0, 0), (0, 0)]:
        with pytest.raises(CheckpointingException, match="'k'"):
            ShardedTensor.from_rank_offsets("k", t, bad)

    class Mine(ShardedTensor):
        pass

    assert type(Mine.from_rank_offsets("k", t, (0, 0, 2))) is Mine


@pytest.mark.parametrize("value", ["", "2", " 2 ", "0", "-1", "four", "2.0"])
def test_local_world_size_is_read_one_way_and_a_bad_value_breaks_nothing(tmp_path, monkeypatch, value):
    """``LOCAL_WORLD_SIZE`` (ranks on the node, as torchrun says) is parsed in one place: a positive
    integer or nothing. A value that is not one (set by hand, mistyped) made every save and load
    raise ``ValueError`` from the thread count; now it counts as unset there, in the load's
    one-node test and in the node of read-once loads."""
    from ckpt_integration.execution import dist as dist_mod
    from ckpt_integration.execution.read_once import node_of
    from ckpt_integration.execution.shared_metadata import one_node
    from ckpt_integration.serialization import default_thread_count

    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    want = int(value) if value.strip().isdigit() and int(value) > 0 else None
    assert dist_mod.local_world_size() == want
    assert one_node() == (want is not None)  # (one process: a group of 1)
    assert 1 <= default_thread_count() <= 4 and isinstance(node_of(0), int)
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}
    ci.save(sd, tmp_path / "c")
    assert torch.equal(ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6))}, tmp_path / "c")["w"],
                       torch.arange(6.0))


@pytest.mark.parametrize("strategy", ["auto", "local", "fully_parallel"])
def test_a_destination_on_the_meta_device_is_refused_not_left_empty(tmp_path, strategy):
    """A module built on the meta device and not materialized has no memory to load into: a copy into
    it does nothing, so the load returned meta tensors without an error. It names the key now."""
    from ckpt_integration.errors import MismatchError

    for backend in ("torch_dist", "zarr"):
        d = str(tmp_path / backend)
        ci.save({"w": ShardedTensor.from_rank_offsets("layer.w", torch.randn(4, 4))}, d, sharded_strategy=backend,
                overwrite=True)
        with pytest.raises(MismatchError, match="'layer.w' is on the meta device"):
            ci.load({"w": ShardedTensor.from_rank_offsets("layer.w", torch.empty(4, 4, device="meta"))}, d,
                    load_strategy=strategy, verify_state=True)


def test_conjugate_and_negative_views_are_saved_as_their_values(tmp_path):
    """A tensor's memory under a conjugate or negative view holds the values before the flip: every
    save path wrote that memory (x.conj() stored as x, -x as x), sync and async, both backends and the
    DCP door's Writer. They store the values now; as destinations such views are refused (the bytes
    written into them would read back flipped), naming the key."""
    import torch.distributed.checkpoint as dcp
    from ckpt_integration.errors import MismatchError

    c = torch.tensor([1 + 2j, 3 - 4j, 5 + 0.5j, -1j], dtype=torch.complex64)
    r = torch.tensor([-1.5, 2.0, -3.0, 0.25])
    values = {"c": c.conj().resolve_conj(), "r": -r}
    for backend in ("torch_dist", "zarr"):
        for asynchronous in (False, True):
            d = str(tmp_path / f"{backend}{asynchronous}")
            req = ci.save({"c": ShardedTensor.from_rank_offsets("c", c.conj()),
                           "r": ShardedTensor.from_rank_offsets("r", torch._neg_view(r))}, d, sharded_strategy=backend,
                          async_sharded_save=asynchronous)
            if asynchronous:
                req.wait()
            out = ci.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in values.items()}, d,
                          verify_state=True)
            assert all(torch.equal(out[k], v) for k, v in values.items()), (backend, asynchronous, out)
    d = str(tmp_path / "door")
    dcp.save({"c": c.conj(), "r": torch._neg_view(r)}, storage_writer=ci.dcp.Writer(d), no_dist=True)
    got = {k: torch.zeros_like(v) for k, v in values.items()}
    dcp.load(got, checkpoint_id=d, no_dist=True)
    assert all(torch.equal(got[k], v) for k, v in values.items()), got
    for name, dest in (("conjugate or negative view", torch.zeros(4, dtype=torch.complex64).conj()),
                       ("conjugate or negative view", torch._neg_view(torch.zeros(4))),
                       ("expanded tensor", torch.zeros(1).expand(4)), ("sparse_coo", torch.zeros(4).to_sparse())):
        key = "c" if dest.is_complex() else "r"
        with pytest.raises(MismatchError, match=f"destination of '{key}' is .*{name}"):
            ci.load({key: ShardedTensor.from_rank_offsets(key, dest)}, str(tmp_path / "torch_distFalse"))


def test_tensors_a_save_cannot_store_as_they_are_are_refused_by_key(tmp_path):
    """Data replaced after the ShardedTensor was built (another dtype or shape: its bytes would be
    recorded as the old dtype's, and zarr returned bf16 bit patterns as float32 numbers), sparse,
    quantized and MKL-DNN tensors: refused before anything is written, naming the key."""
    for backend in ("torch_dist", "zarr"):
        for i, (make, why) in enumerate((
                (lambda sh: setattr(sh, "data", sh.data.bfloat16()), r"built for torch.float32 .* now torch.bfloat16"),
                (lambda sh: setattr(sh, "data", sh.data.reshape(4, 3)), r"shape \(3, 4\), but its data is now .* \(4, 3\)"),
                (lambda sh: setattr(sh, "data", sh.data.to_sparse()), "sparse_coo tensor"),
                (lambda sh: setattr(sh, "data", torch.quantize_per_tensor(sh.data, 0.1, 0, torch.qint8)), "quantized"),
                (lambda sh: setattr(sh, "data", sh.data.to_mkldnn()), "mkldnn"))):
            sh = ShardedTensor.from_rank_offsets("layer.w", torch.arange(12.0).reshape(3, 4))
            make(sh)
            d = tmp_path / f"{backend}{i}"
            with pytest.raises(CheckpointingException, match=f"'layer.w'.*{why}"):
                ci.save({"w": sh}, str(d), sharded_strategy=backend)
            assert not (d / "metadata.json").exists()
        # sub-byte dtypes (torch.uint4, int2, ...): torch.save knows none, so the save failed deep inside (sync
        # and async) with a bare KeyError or NotImplementedError that named no key
        for dtype in (torch.uint4, torch.int2):
            for asynchronous in (False, True):
                d = tmp_path / f"{backend}{dtype}{asynchronous}"
                sh = ShardedTensor.from_rank_offsets("layer.q", torch.zeros(4, dtype=torch.uint8).view(dtype))
                with pytest.raises(CheckpointingException, match=rf"'layer.q'.*{dtype}, whose elements are smaller"):
                    ci.save({"q": sh}, str(d), sharded_strategy=backend, async_sharded_save=asynchronous)
                assert not (d / "metadata.json").exists()


def _gather_odd_dtypes(rank, world):
    from ckpt_integration.execution import dist as cdist

    mine = {dt: (torch.arange(6) % 3 + rank).to(getattr(torch, dt)).reshape(2, 3)
            for dt in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64", "bfloat16")}
    for r, theirs in enumerate(cdist.all_gather_object(mine)):
        for dt, t in theirs.items():
            expected = (torch.arange(6) % 3 + r).to(getattr(torch, dt)).reshape(2, 3)
            assert t.dtype == expected.dtype and torch.equal(t.view(torch.uint8), expected.view(torch.uint8)), (r, dt)


def test_object_collectives_carry_tensors_of_every_dtype():
    """torch's pickling of float8 and uint16/32/64 tensors fails on load (``UntypedStorage has no
    attribute dtype``): an object collective carrying one (optimizer states of such dtypes) raised on
    the receiving ranks. They travel as their bytes now."""
    run_distributed(_gather_odd_dtypes, 2, timeout=60)


def test_a_nested_tensor_is_refused_naming_the_key():
    nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    with pytest.raises(CheckpointingException, match="'layer.w': a nested tensor"):
        ShardedTensor.from_rank_offsets("layer.w", nested)



def _misused_groups(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh

    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 2), (0, rank, world))}
    ci.save(sd, f"{root}/ok")
    alone = torch.distributed.new_group([1])  # rank 0 is not a member
    mesh = init_device_mesh("cpu", (world,))
    cases = [(list(range(world)), "got list; make one of those ranks with torch.distributed.new_group"),
             (0, "got int"), (mesh, "got DeviceMesh; pass one of its dimensions' groups: mesh.get_group")]
    if rank == 0:
        cases.append((alone, "rank 0 is not a member of the process_group passed"))
    for group, why in cases:
        with pytest.raises(CheckpointingException, match=f"save: .*{why}"):
            ci.save(sd, f"{root}/bad", process_group=group)
        with pytest.raises(CheckpointingException, match=f"load: .*{why}"):
            ci.load(sd, f"{root}/ok", process_group=group)
    if rank == 1:  # a member of a group of one saves and loads alone
        ci.save({"v": ShardedTensor.from_rank_offsets("v", torch.arange(3.0))}, f"{root}/alone", process_group=alone)
        got = ci.load({"v": ShardedTensor.from_rank_offsets("v", torch.empty(3))}, f"{root}/alone", process_group=alone)
        assert torch.equal(got["v"], torch.arange(3.0))
    torch.distributed.barrier()


def test_a_process_group_a_rank_cannot_use_is_refused_saying_what_to_pass(tmp_path):
    """A list of ranks, an int, a DeviceMesh, or a group the rank is not a member of (what
    ``new_group`` returns on the other ranks) raised bare TypeError / AttributeError / ValueError from
    deep inside a save or load; now a CheckpointingException says what to pass, before any collective."""
    run_distributed(_misused_groups, 2, str(tmp_path), timeout=90)


def test_a_factory_built_by_a_factory_is_merged_before_it(tmp_path):
    """A ``build_fn`` may return another factory (save builds both levels), but load called only the
    outer ``merge_fn``: it got the inner factory's raw parts and load returned them, no error."""
    def halves(key, t, replica_id, _):
        return {"p0": ShardedTensor.from_rank_offsets(f"{key}.p0", t[:1], replica_id=replica_id),
                "p1": ShardedTensor.from_rank_offsets(f"{key}.p1", t[1:], replica_id=replica_id)}

    def outer(key, t, replica_id, _):
        return {"inner": ci.ShardedTensorFactory(key + ".in", t, halves, lambda sd: torch.cat([sd["p0"], sd["p1"]]),
                                                 replica_id=replica_id)}

    def direct(key, t, replica_id, _):  # a build_fn returning the factory itself
        return ci.ShardedTensorFactory(key + ".d", t, halves, lambda sd: torch.cat([sd["p0"], sd["p1"]]))

    def state(t):
        return {"w": ci.ShardedTensorFactory("w", t, outer, lambda sub: sub["inner"]),
                "v": [ci.ShardedTensorFactory("v", t + 10, direct, lambda x: x * 1)]}

    x = torch.arange(4.0).reshape(2, 2)
    ci.save(state(x.clone()), str(tmp_path / "c"))
    assert sorted(ci.load_tensors_metadata(str(tmp_path / "c"))) == ["v.d.p0", "v.d.p1", "w.in.p0", "w.in.p1"]
    out = ci.load(state(torch.zeros(2, 2)), str(tmp_path / "c"))
    assert torch.equal(out["w"], x) and torch.equal(out["v"][0], x + 10)


def test_a_key_utf8_cannot_encode_is_refused_where_it_is_made():
    """A key with a lone surrogate saved, loaded with "auto", and failed parallel loads (both ranks)
    with a bare UnicodeEncodeError: keys are stored and exchanged as UTF-8."""
    for make in (lambda k: ShardedTensor.from_rank_offsets(k, torch.ones(2)),
                 lambda k: ShardedTensor.from_global_offsets(k, torch.ones(2), (4,), (0,)),
                 lambda k: ci.ShardedObject(k, 1, (1,), (0,))):
        with pytest.raises(CheckpointingException, match=r"key must be a non-empty str of encodable characters, got 's\\ud800'"):
            make("s\ud800")
        make("ü/ß 🙂")


def test_an_object_named_like_the_embedded_common_state_is_refused_with_common_state_in_data(tmp_path):
    """``common_state_in_data=True`` stores the common state as the object ``common_state``: a user's
    object of that name gave a confusing "2 main replicas" error."""
    sd = {"t": ShardedTensor.from_rank_offsets("t", torch.ones(2)), "o": ci.ShardedObject("common_state", 1, (1,), (0,))}
    with pytest.raises(CheckpointingException, match="ShardedObject named 'common_state' cannot be saved with "
                                                     "common_state_in_data=True"):
        ci.save(sd, str(tmp_path / "c"), common_state_in_data=True)
    ci.save(sd, str(tmp_path / "d"))  # (without it the name is free)
    assert ci.load({"o": ci.ShardedObject("common_state", None, (1,), (0,))}, str(tmp_path / "d"))["o"] == 1


def _empty_axis_resharded(rank, world, root):
    sd = {"e": ShardedTensor.from_rank_offsets("e", torch.zeros(5, 0, 3), (0, rank, world)),
          "w": ShardedTensor.from_rank_offsets("w", torch.full((3, 2), float(rank)), (0, rank, world)),
          "z": ShardedTensor.from_rank_offsets("z", torch.empty(0, 3), (0, rank, world))}  # (every piece at offset 0)
    ci.save(sd, f"{root}/c")
    # an empty tensor split over the ranks loads in the same layout (the request check took every rank's empty
    # piece at offset 0 for a main replica of one saved chunk: "requested as main replica by [2] ranks")
    assert ci.load({"z": ShardedTensor.from_rank_offsets("z", torch.empty(0, 3), (0, rank, world))}, f"{root}/c")["z"].shape == (0, 3)
    for strategy in ("auto", "local", "read_once", "fully_parallel"):
        for r in range(5):  # rows 2r..2r+2 of a (10, 0, 3) tensor: inside one saved chunk or across two
            req = {"e": ShardedTensor.from_global_offsets("e", torch.ones(2, 0, 3), (10, 0, 3), (2 * r, 0, 0)),
                   "w": ShardedTensor.from_rank_offsets("w", torch.empty(3, 2), (0, rank, world))}
            out = ci.load(req, f"{root}/c", load_strategy=strategy)
            assert out["e"].shape == (2, 0, 3) and torch.equal(out["w"], torch.full((3, 2), float(rank)))
        for at in range(7):  # no rows at all, inside a saved chunk or at its border (an uneven split's empty piece)
            req = {"w": ShardedTensor.from_global_offsets("w", torch.empty(0, 2), (6, 2), (at, 0))}
            assert ci.load(req, f"{root}/c", load_strategy=strategy, validate_access_integrity=False)["w"].shape == (0, 2)


def test_a_tensor_with_an_empty_axis_loads_into_any_layout(tmp_path):
    """An empty request (no rows: an uneven split's empty piece) inside a saved chunk of a tensor saved
    in several chunks passed the chunk index's overlap test, had no intersection, and every rank
    failed with a bare AttributeError ('NoneType' object has no attribute 'numel')."""
    run_distributed(_empty_axis_resharded, 2, str(tmp_path), timeout=90)


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
@pytest.mark.parametrize("pieces", [[(0, 0), (0, 4)], [(0, 2), (2, 0), (2, 2)], [(0, 4), (0, 0)]])
def test_an_empty_piece_at_the_offset_of_another_does_not_take_its_place(tmp_path, backend, pieces):
    """An uneven split's empty piece (rows [0:0)) placed before a real piece at the same offset took that
    piece's place in the save's plan: torch_dist committed a checkpoint without its data (every load then
    failed: "do not cover"), zarr refused the save saying part of the tensor was saved by no rank."""
    g = torch.arange(12.0).reshape(4, 3)
    sd = {f"p{i}": ShardedTensor.from_global_offsets("w", g[o:o + n].clone(), (4, 3), (o, 0)) for i, (o, n) in enumerate(pieces)}
    ci.save(sd, str(tmp_path / "c"), sharded_strategy=backend)
    out = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), -1.0))}, str(tmp_path / "c"))
    assert torch.equal(out["w"], g)



def test_remove_sharded_tensors_keeps_the_common_state_of_common_state_in_data(tmp_path):
    """``common_state_in_data=True`` keeps the common state as an item ``common_state/shard_0_1`` (no common.pt):
    ``remove_sharded_tensors(dir, "common")`` removed it with the tensors of that prefix, and the checkpoint no longer
    loaded ("no common state"). Without it, an object of that name is the user's and is removed."""
    sd = {"commons": ShardedTensor.from_rank_offsets("commons", torch.ones(2)),
          "t": ShardedTensor.from_rank_offsets("t", torch.ones(2)), "step": 7}
    ci.save(sd, str(tmp_path / "c"), common_state_in_data=True)
    ci.remove_sharded_tensors(str(tmp_path / "c"), "common")
    assert ci.load_common_state_dict(str(tmp_path / "c"))["step"] == 7
    assert set(ci.load_tensors_metadata(str(tmp_path / "c"))) == {"t"}
    mine = {"t": ShardedTensor.from_rank_offsets("t", torch.ones(2)), "o": ci.ShardedObject("common_state", 1, (1,), (0,))}
    ci.save(mine, str(tmp_path / "d"))
    ci.remove_sharded_tensors(str(tmp_path / "d"), "common")
    assert set(ci.load_sharded_metadata(str(tmp_path / "d"))) == {"t"}
