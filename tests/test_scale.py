"""Metadata traffic per rank stays flat as the world grows; a rank failing in the exchange fails every rank.

Real gloo ranks (4 and 16) with the same per-rank state (TP=2, data parallelism
growing): the bytes each rank receives through the collective helpers
(``execution.dist.traffic``) during a save, a repeated save and a load must not
grow with the world size (before the owner exchange they grew about x4 from 4
to 16 ranks: every rank received every rank's pickled records).
"""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch
import torch.distributed as dist

import ckpt_integration as ci
from ckpt_integration import ShardedTensor
from ckpt_integration.errors import DistributedCheckpointingError
from ckpt_integration.execution import dist as cdist
from ckpt_integration.execution import exchange as ex_mod
from tests.dist_utils import run_distributed

TP = 2
KEYS = 12  # tensor-parallel weights per rank; plus as many replicated biases


def _state(rank: int, world: int, step: float):
    tp, dp = rank % TP, rank // TP
    sd = {}
    for i in range(KEYS):
        full = torch.arange(8 * 4 * TP, dtype=torch.float32).reshape(8, 4 * TP) + i + step
        sd[f"w{i}"] = ShardedTensor.from_rank_offsets(f"layer{i}.weight", full[:, tp * 4 : tp * 4 + 4].clone(), (1, tp, TP), replica_id=dp)
        sd[f"b{i}"] = ShardedTensor.from_rank_offsets(f"layer{i}.bias", torch.full((4,), float(i) + step), replica_id=rank)
    return sd


def _traffic_worker(rank, world, base):
    out = {}

    def measure(name, fn):
        dist.barrier()
        cdist.traffic.reset()
        fn()
        out[name] = cdist.traffic.snapshot()["received"]

    path = os.path.join(base, f"w{world}")
    measure("save", lambda: ci.save(_state(rank, world, 0.0), path))
    measure("save_again", lambda: ci.save(_state(rank, world, 1.0), path + "_2"))

    def load():
        loaded = ci.load(_state(rank, world, 5.0), path, strict="raise_all")
        expected = _state(rank, world, 0.0)
        for k, v in expected.items():
            assert torch.equal(loaded[k], v.data), k

    measure("load", load)
    with open(os.path.join(base, f"traffic_{world}_{rank}.json"), "w") as f:
        json.dump(out, f)


@pytest.mark.slow  # 4 + 16 spawned ranks on a 2-core machine: ~1-2 minutes
def test_metadata_bytes_received_per_rank_do_not_grow_with_world_size(tmp_path):
    per_world = {}
    for world in (4, 16):
        run_distributed(_traffic_worker, world, str(tmp_path), timeout=600)
        per_world[world] = [json.loads((tmp_path / f"traffic_{world}_{r}.json").read_text()) for r in range(world)]
    for phase in ("save", "save_again", "load"):
        small = [t[phase] for t in per_world[4]]
        large = [t[phase] for t in per_world[16]]
        # mean: every rank's share stays the same; max: the busiest chunk/key owner
        assert statistics.mean(large) <= 1.25 * statistics.mean(small) + 512, (phase, small, large)
        assert max(large) <= 2.0 * max(small) + 512, (phase, small, large)
    # the repeated save reuses the plan: a few small all-reduces/broadcasts (under 256 bytes), no
    # records (rank 0 still receives the written items for its commit)
    for world, ranks in per_world.items():
        assert all(t["save_again"] <= 256 < t["save"] for t in ranks[1:]), (world, ranks)
        assert ranks[0]["save_again"] < ranks[0]["save"], (world, ranks)


def _failing_owner_worker(rank, world, base):
    real = ex_mod.chunk_owner_step
    if rank == 1:
        def broken(*a, **k):
            raise RuntimeError("simulated failure while processing received records")

        ex_mod.chunk_owner_step = broken
    outcome = "ok"
    try:
        ci.save(_state(rank, world, 0.0), os.path.join(base, "ck"))
    except RuntimeError as e:  # rank 1: its own error
        outcome = f"{type(e).__name__}: {e}"
    except DistributedCheckpointingError as e:
        outcome = f"{type(e).__name__}: {e}"
    finally:
        ex_mod.chunk_owner_step = real
    with open(os.path.join(base, f"fail_{rank}.json"), "w") as f:
        json.dump(outcome, f)


def test_a_rank_failing_during_the_exchange_fails_every_rank(tmp_path):
    world = 3
    run_distributed(_failing_owner_worker, world, str(tmp_path), timeout=150)
    outcomes = [json.loads((tmp_path / f"fail_{r}.json").read_text()) for r in range(world)]
    assert outcomes[1].startswith("RuntimeError: simulated failure"), outcomes
    for r in (0, 2):
        assert outcomes[r].startswith("DistributedCheckpointingError"), outcomes
        assert "rank 1" in outcomes[r] and "simulated failure" in outcomes[r], outcomes
    assert not (tmp_path / "ck" / "metadata.json").exists()


@pytest.mark.slow  # ~20-40 s: a tiny layout at 8 and 16 simulated ranks, with both anchors
def test_scale_benchmark_smoke(tmp_path):
    import sys

    from tests import forked  # the benchmark's process forked with torch and ckpt_integration imported

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "scale.json"
    cmd = [
        sys.executable, os.path.join(root, "benchmarks", "scale.py"), "--worlds", "8,16", "--tp", "2", "--pp", "2",
        "--layers", "4", "--hidden", "64", "--anchor-max-records", "5000", "--json", str(out), "--dir", str(tmp_path),
    ]
    proc = forked.run(cmd, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    runs = {(r["world"], r["zero"]): r for r in res["runs"]}
    assert set(runs) == {(8, False), (16, False), (8, True), (16, True)}
    for r in runs.values():
        assert r["save"]["commit"]["sizes"][".metadata"] > 0 and r["load"]["broadcast_bytes"] > 0
    # same model, twice the ranks: the same unique chunks, the same metadata file
    assert runs[(8, False)]["save"]["unique_chunks"] == runs[(16, False)]["save"]["unique_chunks"]
    assert all(a["megatron"] and a["dcp"] for a in res["anchors"])
    assert "| ZeRO | ranks |" in proc.stdout


def test_repeated_save_with_the_same_structure_reuses_the_plan(tmp_path, monkeypatch):
    calls = []
    real = ex_mod.chunk_owner_step
    monkeypatch.setattr(ex_mod, "chunk_owner_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    routed = []  # saves that built and routed their shard records (a reused plan needs none)
    real_route = ex_mod.build_routes
    monkeypatch.setattr(ex_mod, "build_routes", lambda *a, **k: routed.append(1) or real_route(*a, **k))
    ex_mod.forget_plans()

    def state(value, rows=4):
        return {"w": ShardedTensor.from_rank_offsets("w", torch.full((rows, 2), value)), "it": int(value)}

    ci.save(state(1.0), str(tmp_path / "a"))
    ci.save(state(2.0), str(tmp_path / "b"))  # same keys, shapes, offsets: no exchange, no records
    assert len(calls) == 1 and len(routed) == 1
    ci.save(state(3.0, rows=6), str(tmp_path / "c"))  # another structure: planned again
    assert len(calls) == 2
    ci.save(state(4.0, rows=6), str(tmp_path / "d"), validate_access_integrity=False)  # other options: again
    assert len(calls) == 3
    for name, value, rows in (("a", 1.0, 4), ("b", 2.0, 4), ("c", 3.0, 6), ("d", 4.0, 6)):
        out = ci.load(state(0.0, rows), str(tmp_path / name))
        assert torch.equal(out["w"], torch.full((rows, 2), value)) and out["it"] == int(value)
