"""Interoperability of the torch_dist backend with PyTorch DCP and Megatron-Core.

* our checkpoint (2 gloo ranks, sharded + replicated, bf16 + fp32, stacked layers,
  ShardedObjects) is read by ``torch.distributed.checkpoint.load`` (one process, and
  2 ranks into DTensors with a different sharding) and by ``dcp_to_torch_save``;
* Megatron-Core (skipped only when ``megatron.core`` cannot be imported) writes a
  checkpoint from 2 ranks that we load resharded (2 ranks and 1 process), and loads
  ours resharded on 2 ranks. Its common state holds an ``argparse.Namespace``, which
  our loader refuses by default and accepts with ``allowed_globals`` / ``trusted``.

Multi-process launches are few and batched: each worker records the outcome of every
scenario in a JSON file, and one test per scenario asserts on it.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback

import pytest
import torch
import torch.distributed as dist

import ckpt_integration as ci
from tests.dist_utils import run_distributed
from tests.megatron_import import import_megatron

WORLD = 2


# --------------------------------------------------------------------------- reference data
def full_tensors() -> dict:
    """The global tensors every layout below is cut from (deterministic, no RNG)."""
    return {
        "dense.weight": torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6) / 7,  # fp32, column split
        "embedding.weight": (torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4) - 5).to(torch.bfloat16),  # bf16, row split
        "dense.bias": torch.linspace(-1, 1, 5),  # fp32, replicated
        "norm.weight": torch.tensor([1.5, -2.0, 0.25], dtype=torch.bfloat16),  # bf16, replicated
        "decoder.layers.w": torch.arange(4 * 4, dtype=torch.float32).reshape(4, 4).to(torch.bfloat16),  # 4 stacked layers
    }


def _ours_state(rank: int, world: int) -> dict:
    """Our sharded state dict for ``rank`` of ``world`` (layout A)."""
    f = full_tensors()
    ST = ci.ShardedTensor
    per = 4 // world  # layers per rank (pipeline-style split of the stack)
    return {
        "dense": {
            "weight": ST.from_rank_offsets("dense.weight", f["dense.weight"].chunk(world, 1)[rank].clone(), (1, rank, world)),
            "bias": ST.from_rank_offsets("dense.bias", f["dense.bias"].clone(), replica_id=rank),
        },
        "embedding": ST.from_rank_offsets("embedding.weight", f["embedding.weight"].chunk(world, 0)[rank].clone(), (0, rank, world)),
        "norm": ST.from_rank_offsets("norm.weight", f["norm.weight"].clone(), replica_id=rank),
        "layers": [
            ST.from_rank_offsets(
                "decoder.layers.w", f["decoder.layers.w"][rank * per + i].clone(), (0, rank * per + i, 4), prepend_axis_num=1
            )
            for i in range(per)
        ],
        "rng": ci.ShardedObject("rng_state", {"seed": 100 + rank}, (world,), (rank,), replica_id=0),
        "iteration": 42,
    }


def _record(results: dict, name: str, fn) -> None:
    try:
        fn()
        results[name] = None
    except BaseException:  # noqa: BLE001 - recorded and asserted by the test
        results[name] = traceback.format_exc()


def _write_results(path: str, rank: int, results: dict) -> None:
    with open(os.path.join(path, f"results_rank{rank}.json"), "w") as f:
        json.dump(results, f)


def _read_results(path: str) -> dict:
    out = {}
    for r in range(WORLD):
        with open(os.path.join(path, f"results_rank{r}.json")) as f:
            for k, v in json.load(f).items():
                out[f"{k}@rank{r}"] = v
    return out


def _assert_ok(results: dict, scenario: str) -> None:
    entries = {k: v for k, v in results.items() if k.split("@")[0] == scenario}
    assert len(entries) == WORLD, f"scenario {scenario} did not run on every rank: {sorted(results)}"
    failed = {k: v for k, v in entries.items() if v}
    assert not failed, "\n".join(f"--- {k} ---\n{v}" for k, v in failed.items())


# --------------------------------------------------------------------------- ours -> DCP
def _ours_then_dcp_worker(rank: int, world: int, ckpt: str, out: str) -> None:
    ci.save(_ours_state(rank, world), ckpt)
    results: dict = {}
    f = full_tensors()

    def dcp_dtensor_load():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard

        mesh = init_device_mesh("cpu", (world,))
        # A different sharding than saved: dense.weight by rows (saved by columns),
        # embedding by columns (saved by rows), stacked layers by columns.
        specs = {
            "dense.weight": [Shard(0)],
            "embedding.weight": [Shard(1)],
            "decoder.layers.w": [Shard(1)],
            "dense.bias": [Replicate()],
            "norm.weight": [Replicate()],
        }
        sd = {}
        for k, pl in specs.items():
            full = f[k]
            local = full.chunk(world, pl[0].dim)[rank] if isinstance(pl[0], Shard) else full
            sd[k] = DTensor.from_local(torch.full_like(local, -123), mesh, pl, run_check=False)
        dcp.load(sd, checkpoint_id=ckpt)
        for k, t in sd.items():
            assert t.to_local().dtype == f[k].dtype, k
            assert torch.equal(t.full_tensor(), f[k]), k

    def dcp_plain_load_on_ranks():
        import torch.distributed.checkpoint as dcp

        sd = {k: torch.zeros_like(v) for k, v in f.items()}
        dcp.load(sd, checkpoint_id=ckpt)
        for k, v in f.items():
            assert torch.equal(sd[k], v), k

    _record(results, "dcp_dtensor_load", dcp_dtensor_load)
    _record(results, "dcp_plain_load_on_ranks", dcp_plain_load_on_ranks)
    _write_results(out, rank, results)


@pytest.fixture(scope="module")
def ours_ckpt(tmp_path_factory):
    base = tmp_path_factory.mktemp("ours")
    ckpt = str(base / "ckpt")
    run_distributed(_ours_then_dcp_worker, WORLD, ckpt, str(base), timeout=150)
    return ckpt, _read_results(str(base))


def test_our_checkpoint_layout_is_dcp(ours_ckpt):
    ckpt, _ = ours_ckpt
    names = set(os.listdir(ckpt))
    assert {".metadata", "metadata.json", "common.pt"} <= names
    assert any(n.startswith("__0_") and n.endswith(".distcp") for n in names)
    assert any(n.startswith("__1_") and n.endswith(".distcp") for n in names)
    with open(os.path.join(ckpt, "metadata.json")) as fh:
        assert json.load(fh)["sharded_backend"] == "torch_dist"


def test_dcp_load_single_process(ours_ckpt):
    import torch.distributed.checkpoint as dcp

    ckpt, _ = ours_ckpt
    f = full_tensors()
    sd = {k: torch.zeros_like(v) for k, v in f.items()}
    dcp.load(sd, checkpoint_id=ckpt, no_dist=True)
    for k, v in f.items():
        assert sd[k].dtype == v.dtype
        assert torch.equal(sd[k], v), k


def test_dcp_load_two_ranks_dtensor_resharded(ours_ckpt):
    _, results = ours_ckpt
    _assert_ok(results, "dcp_dtensor_load")


def test_dcp_load_two_ranks_plain(ours_ckpt):
    _, results = ours_ckpt
    _assert_ok(results, "dcp_plain_load_on_ranks")


def test_dcp_to_torch_save(ours_ckpt, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt, _ = ours_ckpt
    out = tmp_path / "model.pt"
    dcp_to_torch_save(ckpt, str(out))
    sd = torch.load(out, weights_only=False)
    f = full_tensors()
    for k, v in f.items():
        assert sd[k].dtype == v.dtype, k
        assert torch.equal(sd[k], v), k
    # ShardedObjects come out as DCP decodes our torch.save'd payload: Megatron's [obj] list
    obj_keys = sorted(k for k in sd if k.startswith("rng_state/"))
    assert obj_keys == ["rng_state/shard_0_2", "rng_state/shard_1_2"]
    assert sd["rng_state/shard_0_2"] == [{"seed": 100}]
    assert sd["rng_state/shard_1_2"] == [{"seed": 101}]


def test_ours_loads_back_single_process(ours_ckpt):
    """Sanity for the fixtures above: our own loader, one process, everything whole."""
    ckpt, _ = ours_ckpt
    f = full_tensors()
    plain = ci.load_plain_tensors(ckpt)
    for k, v in f.items():
        assert torch.equal(plain[k], v), k
    assert ci.load_common_state_dict(ckpt)["iteration"] == 42


# --------------------------------------------------------------------------- Megatron-Core
def _import_megatron():
    """``megatron.core`` through the suite's one import helper (tests/megatron_import.py)."""
    return import_megatron()


def _patch_cuda_for_megatron() -> None:
    """Megatron-Core calls CUDA APIs unconditionally; make them harmless on CPU-only torch.

    Only ever called inside spawned workers or under monkeypatch in this process.
    ``current_device`` returns ``"cpu"``: Megatron builds a flag tensor with
    ``device=torch.cuda.current_device()`` (an int 0 would mean ``cuda:0``).
    """
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    # Megatron's writer process measures its RSS with psutil, which may be absent.
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._process_memory = lambda: 0


def _megatron_state(rank: int, world: int) -> dict:
    """Megatron-Core sharded state dict, layout A (same cut as :func:`_ours_state`)."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    f = full_tensors()
    per = 4 // world
    return {
        "dense": {
            "weight": ShardedTensor.from_rank_offsets("dense.weight", f["dense.weight"].chunk(world, 1)[rank].clone(), (1, rank, world)),
            "bias": ShardedTensor.from_rank_offsets("dense.bias", f["dense.bias"].clone(), replica_id=rank),
        },
        "embedding": ShardedTensor.from_rank_offsets(
            "embedding.weight", f["embedding.weight"].chunk(world, 0)[rank].clone(), (0, rank, world)
        ),
        "norm": ShardedTensor.from_rank_offsets("norm.weight", f["norm.weight"].clone(), replica_id=rank),
        "layers": [
            ShardedTensor.from_rank_offsets(
                "decoder.layers.w", f["decoder.layers.w"][rank * per + i].clone(), (0, rank * per + i, 4), prepend_axis_num=1
            )
            for i in range(per)
        ],
        "rng": ShardedObject("rng_state", {"seed": 100 + rank}, (world,), (rank,), replica_id=0),
        "iteration": 42,
        "args": argparse.Namespace(lr=0.5, tp=world),  # not on the safe allow-list
    }


def _resharded_request(rank: int, world: int, make_st, make_obj) -> dict:
    """Layout B: rows <-> columns swapped, every layer split by columns, replicated bits split."""
    f = full_tensors()
    empty = lambda t: torch.full_like(t, -7)  # noqa: E731
    req = {
        "dense": {
            "weight": make_st("dense.weight", empty(f["dense.weight"].chunk(world, 0)[rank]), (0, rank, world)),
            "bias": make_st("dense.bias", empty(f["dense.bias"]), replica_id=rank),
        },
        "embedding": make_st("embedding.weight", empty(f["embedding.weight"].chunk(world, 1)[rank]), (1, rank, world)),
        "norm": make_st("norm.weight", empty(f["norm.weight"]), replica_id=rank),
        "layers": [
            make_st("decoder.layers.w", empty(f["decoder.layers.w"][i].chunk(world, 0)[rank]), (0, i, 4), (1, rank, world), prepend_axis_num=1)
            for i in range(4)
        ],
        # every rank reads both objects (each rank reads the other rank's object too)
        "rng": [make_obj("rng_state", None, (world,), (i,), replica_id=rank) for i in range(world)],
    }
    return req


def _check_resharded(loaded: dict, rank: int, world: int) -> None:
    f = full_tensors()
    assert torch.equal(loaded["dense"]["weight"], f["dense.weight"].chunk(world, 0)[rank])
    assert loaded["dense"]["weight"].dtype == torch.float32
    assert torch.equal(loaded["dense"]["bias"], f["dense.bias"])
    assert torch.equal(loaded["embedding"], f["embedding.weight"].chunk(world, 1)[rank])
    assert loaded["embedding"].dtype == torch.bfloat16
    assert torch.equal(loaded["norm"], f["norm.weight"])
    for i in range(4):
        assert torch.equal(loaded["layers"][i], f["decoder.layers.w"][i].chunk(world, 0)[rank]), i
    assert [loaded["rng"][i] for i in range(world)] == [{"seed": 100 + i} for i in range(world)]
    assert loaded["iteration"] == 42


def _megatron_worker(rank: int, world: int, mck: str, ours: str, out: str) -> None:
    _import_megatron()
    _patch_cuda_for_megatron()
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import ShardedObject as MObj
    from megatron.core.dist_checkpointing import ShardedTensor as MST

    mdc.save(_megatron_state(rank, world), mck)  # torch_dist is Megatron's default backend
    ci.save(_ours_state(rank, world), ours)
    dist.barrier()
    results: dict = {}

    def ours_loads_megatron_resharded():
        req = _resharded_request(rank, world, ci.ShardedTensor.from_rank_offsets, ci.ShardedObject)
        # Megatron's common state holds an argparse.Namespace: refused by default ...
        try:
            ci.load(req, mck)
        except ci.errors.UnsafeCheckpointError as e:
            assert "argparse.Namespace" in str(e), str(e)
        else:
            raise AssertionError("common.pt with argparse.Namespace was loaded without opting in")
        # ... and accepted when allowed explicitly.
        req = _resharded_request(rank, world, ci.ShardedTensor.from_rank_offsets, ci.ShardedObject)
        loaded = ci.load(req, mck, allowed_globals=[argparse.Namespace], strict=ci.StrictHandling.RAISE_ALL)
        _check_resharded(loaded, rank, world)
        assert loaded["args"].lr == 0.5

    def megatron_loads_ours_resharded():
        req = _resharded_request(rank, world, MST.from_rank_offsets, MObj)
        loaded = mdc.load(req, ours)
        _check_resharded(loaded, rank, world)

    def megatron_loads_ours_metadata():
        meta = mdc.load_tensors_metadata(ours)
        f = full_tensors()
        for k, v in f.items():
            assert tuple(meta[k].global_shape) == tuple(v.shape), k
            assert meta[k].dtype == v.dtype, k
        assert mdc.load_common_state_dict(ours)["iteration"] == 42

    _record(results, "ours_loads_megatron_resharded", ours_loads_megatron_resharded)
    _record(results, "megatron_loads_ours_resharded", megatron_loads_ours_resharded)
    _record(results, "megatron_loads_ours_metadata", megatron_loads_ours_metadata)
    _write_results(out, rank, results)


@pytest.fixture(scope="module")
def megatron_ckpts(tmp_path_factory):
    _import_megatron()  # skips when megatron.core cannot be imported
    base = tmp_path_factory.mktemp("megatron")
    mck, ours = str(base / "megatron_ckpt"), str(base / "ours_ckpt")
    os.makedirs(mck)  # Megatron expects the directory to exist
    run_distributed(_megatron_worker, WORLD, mck, ours, str(base), timeout=240)
    return mck, ours, _read_results(str(base))


def test_megatron_checkpoint_is_megatron_layout(megatron_ckpts):
    mck, _, _ = megatron_ckpts
    names = set(os.listdir(mck))
    assert {".metadata", "metadata.json", "common.pt"} <= names
    assert "manifest.json" not in names  # written by Megatron, not by us


def test_ours_loads_megatron_resharded_two_ranks(megatron_ckpts):
    _assert_ok(megatron_ckpts[2], "ours_loads_megatron_resharded")


def test_megatron_loads_ours_resharded_two_ranks(megatron_ckpts):
    _assert_ok(megatron_ckpts[2], "megatron_loads_ours_resharded")


def test_megatron_reads_our_metadata(megatron_ckpts):
    _assert_ok(megatron_ckpts[2], "megatron_loads_ours_metadata")


def test_ours_loads_megatron_single_process(megatron_ckpts):
    """2 ranks -> 1 process: everything whole, plus each layer as its own tensor."""
    mck, _, _ = megatron_ckpts
    f = full_tensors()
    ST = ci.ShardedTensor
    req = {
        "dense": {"weight": ST.from_rank_offsets("dense.weight", torch.empty(4, 6)), "bias": ST.from_rank_offsets("dense.bias", torch.empty(5))},
        "embedding": ST.from_rank_offsets("embedding.weight", torch.empty(6, 4, dtype=torch.bfloat16)),
        "norm": ST.from_rank_offsets("norm.weight", torch.empty(3, dtype=torch.bfloat16)),
        "layers": [ST.from_rank_offsets("decoder.layers.w", torch.empty(4, dtype=torch.bfloat16), (0, i, 4), prepend_axis_num=1) for i in range(4)],
        "rng": [ci.ShardedObject("rng_state", None, (2,), (i,), replica_id=0) for i in range(2)],
    }
    loaded = ci.load(req, mck, trusted=True, strict=ci.StrictHandling.RAISE_ALL)
    assert torch.equal(loaded["dense"]["weight"], f["dense.weight"])
    assert torch.equal(loaded["dense"]["bias"], f["dense.bias"])
    assert torch.equal(loaded["embedding"], f["embedding.weight"])
    assert torch.equal(loaded["norm"], f["norm.weight"])
    for i in range(4):
        assert torch.equal(loaded["layers"][i], f["decoder.layers.w"][i])
    assert loaded["rng"] == [{"seed": 100}, {"seed": 101}]
    assert loaded["iteration"] == 42 and isinstance(loaded["args"], argparse.Namespace)


def test_megatron_common_state_refused_by_default(megatron_ckpts):
    mck, _, _ = megatron_ckpts
    with pytest.raises(ci.errors.UnsafeCheckpointError, match=r"argparse\.Namespace"):
        ci.load_common_state_dict(mck)
    assert ci.load_common_state_dict(mck, trusted=True)["args"].lr == 0.5
    assert ci.load_common_state_dict(mck, allowed_globals=[argparse.Namespace])["args"].tp == 2


def test_megatron_metadata_and_plain_tensors(megatron_ckpts):
    mck, _, _ = megatron_ckpts
    f = full_tensors()
    meta = ci.load_sharded_metadata(mck)
    for k, v in f.items():
        assert meta[k].global_shape == tuple(v.shape) and meta[k].dtype == v.dtype, k
    assert {"rng_state/shard_0_2", "rng_state/shard_1_2"} <= set(meta)
    # load_plain_tensors reads tensors only: Megatron's common.pt (a Namespace) is not unpickled.
    plain = ci.load_plain_tensors(mck)
    for k, v in f.items():
        assert torch.equal(plain[k], v), k


def test_a_plain_dcp_tensor_saved_as_a_conjugate_view_loads_conjugated(tmp_path):
    """``dcp.save`` of a lazily conjugated complex tensor stores its bytes unconjugated and the conjugate
    bit in the archive's metadata; ``dcp.load`` applies it. Ours read the bytes and returned the
    unconjugated values without a word (``load`` and ``load_plain_tensors``)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    c = torch.tensor([1 + 2j, 3 - 1j, -0.5 + 0.25j])
    want = {"cplx": c.conj().resolve_conj(), "plain": c, "neg": c.conj().imag.resolve_neg()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"cplx": c.conj(), "plain": c, "neg": c.conj().imag}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
        plain = ci.load_plain_tensors(str(tmp_path / "d"))
        got = ci.load({k: ci.ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in want.items()},
                      str(tmp_path / "d"))
    for k, v in want.items():
        assert torch.equal(plain[k], v), (k, plain[k], v)
        assert torch.equal(got[k], v), (k, got[k], v)
