"""Fully-parallel and two-stage loads: same bytes as a local load, each chunk read once per group."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import ckpt_integration as ci
import ckpt_integration.storage.torch_dist as td
from tests.dist_utils import run_distributed
from tests.layouts import expected_grid, global_tensor, grid_shard


def _state(rank, world):
    # TP=2 x DP=2: grid split over tp, replicated over dp; plus a fully replicated bf16 tensor
    tp, dp = rank % 2, rank // 2
    return {
        "w": grid_shard("w", (16, 8), tp, (2, 1), replica_id=dp),
        "e": ci.ShardedTensor.from_rank_offsets("e", global_tensor("e", (32, 4), torch.bfloat16), replica_id=rank),
        "u": grid_shard("u", (8, 8), rank, (4, 1)),  # needed by one rank each: never broadcast
    }


def _worker(rank, world, root):
    from ckpt_integration.storage.zarr_backend import ZarrReader

    for backend, reader_cls in (("torch_dist", td.TorchDistReader), ("zarr", ZarrReader)):
        _check_strategies(rank, world, f"{root}/{backend}", backend, reader_cls)


def _check_strategies(rank, world, path, backend, reader_cls):
    ci.save(_state(rank, world), path, sharded_strategy=backend)
    counts = {}
    real = reader_cls.read_region

    def counting(self, key, chunk, overlap, out, dtype):
        counts[(key, chunk.box.offsets, overlap)] = counts.get((key, chunk.box.offsets, overlap), 0) + 1
        return real(self, key, chunk, overlap, out, dtype)

    reader_cls.read_region = counting
    try:
        results = {}
        for strategy in ("local", "fully_parallel", "two_stage"):
            counts.clear()
            req = _state(rank, world)
            for v in req.values():
                v.data.zero_()
            out = ci.load(req, path, load_strategy=strategy, memory_budget=600, thread_count=1)  # small budget: many rounds
            assert torch.equal(out["w"], expected_grid("w", (16, 8), rank % 2, (2, 1)))
            assert torch.equal(out["e"], global_tensor("e", (32, 4), torch.bfloat16))
            assert torch.equal(out["u"], expected_grid("u", (8, 8), rank, (4, 1)))
            all_counts = [None] * world
            dist.all_gather_object(all_counts, dict(counts))
            results[strategy + "_readers"] = {r for r, c in enumerate(all_counts) if c}
            total = {}
            for c in all_counts:
                for k, v in c.items():
                    total[k] = total.get(k, 0) + v
            results[strategy] = total
        # local: every rank that needs a region reads it; parallel strategies: each once per group
        e_reads = {k: v for k, v in results["local"].items() if k[0] == "e"}
        assert sum(e_reads.values()) == world
        for strategy in ("fully_parallel", "two_stage"):
            assert all(v == 1 for v in results[strategy].values()), results[strategy]
            assert {k[:2] for k in results[strategy]} == {k[:2] for k in results["local"]}
        # reads are spread over the group, not all done by the lowest rank
        assert len(results["fully_parallel_readers"]) >= 3
    finally:
        reader_cls.read_region = real


def test_parallel_strategies_read_each_chunk_once(tmp_path):
    run_distributed(_worker, 4, str(tmp_path))


def test_unknown_strategy(tmp_path):
    ci.save({"a": ci.ShardedTensor.from_rank_offsets("a", torch.ones(2))}, tmp_path / "c")
    with pytest.raises(ValueError, match="unknown load_strategy"):
        ci.load({"a": ci.ShardedTensor.from_rank_offsets("a", torch.zeros(2))}, tmp_path / "c", load_strategy="magic")


def test_parallel_strategy_single_process_falls_back(tmp_path):
    ci.save({"a": ci.ShardedTensor.from_rank_offsets("a", torch.ones(2))}, tmp_path / "c")
    out = ci.load({"a": ci.ShardedTensor.from_rank_offsets("a", torch.zeros(2))}, tmp_path / "c", load_strategy="two_stage")
    assert torch.equal(out["a"], torch.ones(2))
