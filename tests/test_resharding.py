"""Save under one parallel layout, load under another; every loaded element compared exactly.

Saves run once per module (world sizes 4 and 3); loads run on 4 ranks, 2 ranks
and in a single process without torch.distributed.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import ckpt_integration as ci
from ckpt_integration import LocalNonpersistentObject, ShardedObject, ShardedTensor
from tests.dist_utils import run_distributed
from tests.layouts import (
    empty_like_request,
    expected_fused,
    expected_grid,
    fused_qkv_factory,
    global_tensor,
    grid_shard,
    layer_stack,
    uneven_bounds,
)
from ckpt_integration.storage.filesystem import locate

GRID = (8, 12)
ROWS = (8, 12)
LAYERS, LAYER_SHAPE = 4, (3, 5)
UNEVEN = (10, 4)
HIDDEN = 4


def state_world4(rank: int) -> dict:
    stage, dp = rank // 2, rank % 2
    return {
        "grid": grid_shard("grid.w", GRID, rank, (2, 2)),
        "rows": grid_shard("rows.w", ROWS, rank, (4, 1), dtype=torch.bfloat16),
        "pp": layer_stack("pp.layers", LAYERS, LAYER_SHAPE, stage, 2, replica_id=dp),
        "bias": ShardedTensor.from_rank_offsets("dp.bias", global_tensor("dp.bias", (6,)), replica_id=rank),
        "rng": ShardedObject("rng", {"stage": stage, "state": global_tensor(f"rng{stage}", (3,))}, (2,), (stage,), replica_id=dp),
        "qkv": fused_qkv_factory("attn.qkv", HIDDEN, rank % 2, 2, replica_id=rank // 2),
        "iteration": 7,
        "config": {"lr": 0.1, "layers": [1, 2]},
        "local": LocalNonpersistentObject(f"saved-by-{rank}"),
        "list_of_shards": [grid_shard("list.a", (4, 4), rank, (4, 1)), "plain"],
    }


def uneven_state(rank: int) -> dict:
    start, size = uneven_bounds([4, 3, 3])[rank]
    full = global_tensor("uneven.emb", UNEVEN)
    return {"emb": ShardedTensor.from_global_offsets("uneven.emb", full[start : start + size].clone(), UNEVEN, (start, 0))}


def _save4(rank, world, root):
    ci.save(state_world4(rank), os.path.join(root, "main"))
    # the same state saved with balance=False (main replicas write) must be identical on load
    ci.save(state_world4(rank), os.path.join(root, "main_unbalanced"), balance=False)
    # the same matrix on the second backend
    ci.save(state_world4(rank), os.path.join(root, "main_zarr"), sharded_strategy="zarr")


def _save3(rank, world, root):
    ci.save(uneven_state(rank), os.path.join(root, "uneven"))
    ci.save(uneven_state(rank), os.path.join(root, "uneven_zarr"), sharded_strategy="zarr")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("resharding"))
    run_distributed(_save4, 4, root)
    run_distributed(_save3, 3, root)
    return root


def check_common(out, rank_label):
    assert out["iteration"] == 7
    assert out["config"] == {"lr": 0.1, "layers": [1, 2]}
    assert out["local"] == rank_label


def _load4(rank, world, root):
    # 2x2 grid -> 1x4 grid; rows -> columns; PP 2 stages -> 4 stages; TP2 qkv -> TP4
    for name in ("main", "main_unbalanced", "main_zarr"):
        req = {
            "grid": empty_like_request(grid_shard("grid.w", GRID, rank, (1, 4))),
            "rows": empty_like_request(grid_shard("rows.w", ROWS, rank, (1, 4), dtype=torch.bfloat16)),
            "pp": empty_like_request(layer_stack("pp.layers", LAYERS, LAYER_SHAPE, rank, 4)),
            "bias": ShardedTensor.from_rank_offsets("dp.bias", torch.zeros(6), replica_id=rank),
            "rng": ShardedObject("rng", None, (2,), (rank // 2,), replica_id=rank % 2),
            "qkv": fused_qkv_factory("attn.qkv", HIDDEN, rank, 4),
            "local": LocalNonpersistentObject("mine"),
            "list_of_shards": [grid_shard("list.a", (4, 4), rank, (1, 4)), "plain"],
        }
        req["qkv"].data = torch.zeros_like(req["qkv"].data)
        grid_tensor = req["grid"].data
        out = ci.load(req, os.path.join(root, name))
        assert out["grid"] is grid_tensor, "load must fill the caller's tensor in place"
        assert torch.equal(out["grid"], expected_grid("grid.w", GRID, rank, (1, 4)))
        assert torch.equal(out["rows"], expected_grid("rows.w", ROWS, rank, (1, 4), torch.bfloat16))
        assert torch.equal(out["pp"]["layer0"], global_tensor("pp.layers", (LAYERS, *LAYER_SHAPE))[rank])
        assert torch.equal(out["bias"], global_tensor("dp.bias", (6,)))
        assert out["rng"]["stage"] == rank // 2
        assert torch.equal(out["rng"]["state"], global_tensor(f"rng{rank // 2}", (3,)))
        assert torch.equal(out["qkv"], expected_fused("attn.qkv", HIDDEN, rank, 4))
        assert isinstance(out["list_of_shards"], list) and out["list_of_shards"][1] == "plain"
        assert torch.equal(out["list_of_shards"][0], expected_grid("list.a", (4, 4), rank, (1, 4)))
        check_common(out, "mine")


def _load2(rank, world, root):
    for suffix in ("", "_zarr"):
        _load2_one(rank, root, suffix)


def _load2_one(rank, root, suffix):
    # rows -> columns, 2x2 grid -> 2x1, PP 2 stages (with DP) -> 2 stages without DP,
    # 3 uneven shards -> 2 shards, TP2 qkv -> TP1 replicated
    req = {
        "grid": empty_like_request(grid_shard("grid.w", GRID, rank, (2, 1))),
        "rows": empty_like_request(grid_shard("rows.w", ROWS, rank, (1, 2), dtype=torch.bfloat16)),
        "pp": empty_like_request(layer_stack("pp.layers", LAYERS, LAYER_SHAPE, rank, 2)),
        "qkv": fused_qkv_factory("attn.qkv", HIDDEN, 0, 1, replica_id=rank),
    }
    out = ci.load(req, os.path.join(root, "main" + suffix))
    assert torch.equal(out["grid"], expected_grid("grid.w", GRID, rank, (2, 1)))
    assert torch.equal(out["rows"], expected_grid("rows.w", ROWS, rank, (1, 2), torch.bfloat16))
    full_pp = global_tensor("pp.layers", (LAYERS, *LAYER_SHAPE))
    assert torch.equal(out["pp"]["layer0"], full_pp[2 * rank])
    assert torch.equal(out["pp"]["layer1"], full_pp[2 * rank + 1])
    assert torch.equal(out["qkv"], expected_fused("attn.qkv", HIDDEN, 0, 1))
    full = global_tensor("uneven.emb", UNEVEN)
    emb = ShardedTensor.from_global_offsets("uneven.emb", torch.zeros(5, 4), UNEVEN, (5 * rank, 0))
    out = ci.load({"emb": emb}, os.path.join(root, "uneven" + suffix))
    assert torch.equal(out["emb"], full[5 * rank : 5 * rank + 5])


def test_reshard_to_4_ranks(saved):
    run_distributed(_load4, 4, saved)


def test_reshard_to_2_ranks(saved):
    run_distributed(_load2, 2, saved)


@pytest.mark.parametrize("suffix", ["", "_zarr"], ids=["torch_dist", "zarr"])
def test_reshard_to_single_process(saved, suffix):
    """Without torch.distributed: one process loads whole tensors from any layout."""
    assert not dist.is_initialized()
    root = saved
    req = {
        "grid": ShardedTensor.from_rank_offsets("grid.w", torch.zeros(GRID)),
        "rows": ShardedTensor.from_rank_offsets("rows.w", torch.zeros(ROWS, dtype=torch.bfloat16)),
        "pp": layer_stack("pp.layers", LAYERS, LAYER_SHAPE, 0, 1),
        "bias": ShardedTensor.from_rank_offsets("dp.bias", torch.zeros(6)),
        "rng": [ShardedObject("rng", None, (2,), (s,)) for s in range(2)],
        "qkv": fused_qkv_factory("attn.qkv", HIDDEN, 0, 1),
        "list_of_shards": [ShardedTensor.from_rank_offsets("list.a", torch.zeros(4, 4)), "plain"],
    }
    out = ci.load(req, os.path.join(root, "main" + suffix))
    assert torch.equal(out["grid"], global_tensor("grid.w", GRID))
    assert torch.equal(out["rows"], global_tensor("rows.w", ROWS, torch.bfloat16))
    full_pp = global_tensor("pp.layers", (LAYERS, *LAYER_SHAPE))
    for i in range(LAYERS):
        assert torch.equal(out["pp"][f"layer{i}"], full_pp[i])
    assert torch.equal(out["bias"], global_tensor("dp.bias", (6,)))
    assert [o["stage"] for o in out["rng"]] == [0, 1]
    assert torch.equal(out["qkv"], expected_fused("attn.qkv", HIDDEN, 0, 1))
    assert torch.equal(out["list_of_shards"][0], global_tensor("list.a", (4, 4)))
    assert out["iteration"] == 7 and out["config"] == {"lr": 0.1, "layers": [1, 2]}
    assert "local" not in out  # non-persistent values are never saved
    # uneven 3 shards -> one whole tensor, and -> a differently uneven split read piecewise
    full = global_tensor("uneven.emb", UNEVEN)
    out = ci.load({"emb": ShardedTensor.from_rank_offsets("uneven.emb", torch.zeros(UNEVEN))}, os.path.join(root, "uneven" + suffix))
    assert torch.equal(out["emb"], full)
    pieces = {f"p{i}": ShardedTensor.from_global_offsets("uneven.emb", torch.zeros(s, 2), UNEVEN, (o, 2))
              for i, (o, s) in enumerate(uneven_bounds([1, 6, 3]))}
    out = ci.load(pieces, os.path.join(root, "uneven" + suffix), validate_access_integrity=False)
    for i, (o, s) in enumerate(uneven_bounds([1, 6, 3])):
        assert torch.equal(out[f"p{i}"], full[o : o + s, 2:])


def test_replicated_shards_written_once(saved):
    from ckpt_integration.storage.torch_dist import read_dcp_metadata

    for name in ("main", "main_unbalanced"):
        md = read_dcp_metadata(locate(os.path.join(saved, name)))
        bias_items = [i for i in md.storage_data if i.fqn == "dp.bias"]
        assert len(bias_items) == 1
        pp_chunks = md.state_dict_metadata["pp.layers"].chunks
        assert len(pp_chunks) == LAYERS  # one per layer although each stage had 2 DP replicas
        assert sum(1 for i in md.storage_data if i.fqn.startswith("rng/")) == 2


def test_balanced_save_spreads_replicated_writes(saved):
    """With balance=True the DP replicas share the writing; without, main replicas do it all."""
    def bytes_per_rank(name):
        out = {}
        for f in os.listdir(os.path.join(saved, name)):
            if f.endswith(".distcp"):
                r = int(f.split("_")[2])
                out[r] = out.get(r, 0) + os.path.getsize(os.path.join(saved, name, f))
        return out

    balanced, unbalanced = bytes_per_rank("main"), bytes_per_rank("main_unbalanced")
    assert len(balanced) == 4
    assert max(balanced.values()) < max(unbalanced.values())


@pytest.mark.parametrize("name", ["main", "main_zarr"])
def test_load_tensors_metadata_and_plain_tensors(saved, name):
    meta = ci.load_tensors_metadata(os.path.join(saved, name))
    assert meta["grid.w"].global_shape == GRID and meta["rows.w"].dtype == torch.bfloat16
    assert meta["pp.layers"].global_shape == (LAYERS, *LAYER_SHAPE)
    sharded = ci.load_sharded_metadata(os.path.join(saved, name))
    assert {"rng/shard_0_2", "rng/shard_1_2"} <= set(sharded)
    plain = ci.load_plain_tensors(os.path.join(saved, name))
    assert torch.equal(plain["grid.w"], global_tensor("grid.w", GRID))
    assert torch.equal(plain["attn.qkv.k"], global_tensor("attn.qkv.k", (HIDDEN, HIDDEN)))
    common = ci.load_common_state_dict(os.path.join(saved, name))
    assert common["iteration"] == 7 and "local" not in common


def test_allow_shape_mismatch_zero_fills(tmp_path):
    w = global_tensor("vocab", (10, 3))
    ci.save({"w": ShardedTensor.from_rank_offsets("vocab", w)}, tmp_path / "c")
    padded = ShardedTensor.from_global_offsets("vocab", torch.full((12, 3), 5.0), (12, 3), (0, 0), allow_shape_mismatch=True)
    out = ci.load({"w": padded}, tmp_path / "c")
    assert torch.equal(out["w"][:10], w) and torch.equal(out["w"][10:], torch.zeros(2, 3))
    smaller = ShardedTensor.from_global_offsets("vocab", torch.zeros(8, 3), (8, 3), (0, 0), allow_shape_mismatch=True)
    assert torch.equal(ci.load({"w": smaller}, tmp_path / "c")["w"], w[:8])


def test_content_metadata_and_remove(tmp_path):
    sd = {"a": ShardedTensor.from_rank_offsets("a", torch.ones(3)), "opt": {"m": ShardedTensor.from_rank_offsets("optimizer.m", torch.ones(3))}}
    ci.save(sd, tmp_path / "c", content_metadata={"format": "v2"})
    assert ci.load_content_metadata(tmp_path / "c") == {"format": "v2"}
    ci.remove_sharded_tensors(tmp_path / "c", "optimizer.")
    assert set(ci.load_tensors_metadata(tmp_path / "c")) == {"a"}
    out = ci.load({"a": ShardedTensor.from_rank_offsets("a", torch.zeros(3))}, tmp_path / "c")
    assert torch.equal(out["a"], torch.ones(3))


def test_strided_column_read_reads_only_needed_runs(tmp_path, monkeypatch):
    """A column slice of large rows: unverified, only the requested runs are read; verified (the
    default), every block the request touches is read and checked once - here all of them."""
    from ckpt_integration.storage import readers

    w = global_tensor("big", (64, 8192))  # 32 KiB rows
    ci.save({"w": ShardedTensor.from_rank_offsets("big", w)}, tmp_path / "c")
    reads = []
    real = readers.LocalReader.readv

    def counting(self, buffers, offset):
        reads.extend(len(b) for b in buffers)
        return real(self, buffers, offset)

    monkeypatch.setattr(readers.LocalReader, "readv", counting)
    half = ShardedTensor.from_global_offsets("big", torch.zeros(64, 4096), (64, 8192), (0, 4096))
    out = ci.load({"w": half}, tmp_path / "c", validate_access_integrity=False, verify_checksums=False)
    assert torch.equal(out["w"], w[:, 4096:])
    assert sum(reads) == 64 * 4096 * 4  # exactly the requested bytes
    reads.clear()
    half = ShardedTensor.from_global_offsets("big", torch.zeros(64, 4096), (64, 8192), (0, 4096))
    out = ci.load({"w": half}, tmp_path / "c", validate_access_integrity=False)
    assert torch.equal(out["w"], w[:, 4096:])
    # the two 1 MiB data blocks the request touches, each read once (not per row)
    assert sum(reads) == 64 * 8192 * 4


def test_reshard_demo_example_runs():
    """``examples/reshard_demo.py`` (the README quickstart's runnable version) runs as a user runs it."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, os.path.join(repo, "examples", "reshard_demo.py")], env=env, cwd=repo,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("fc1 split along the other axis matches") == 2, res.stdout
    assert "OK: saved with TP=2, loaded with TP=1 and with a transposed split" in res.stdout
