"""Device (CUDA) paths: save from and load into GPU tensors, async save with pinned staging.

Skipped where no GPU is present (CI has none); run on a GPU machine with
``python -m pytest -q tests/test_cuda.py``. Everything is compared exactly.
"""

from __future__ import annotations

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import ShardedTensor
from ckpt_integration.execution.async_save import AsyncCallsQueue, async_save_torch_dist
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _state(device):
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 32, generator=g).to(device),
        "b16": torch.randn(16, 8, generator=g).to(torch.bfloat16).to(device),
        "v": torch.arange(10.0).to(device),
    }


def _sharded(tensors):
    return {k: ShardedTensor.from_rank_offsets(k, t) for k, t in tensors.items()}


def test_save_from_gpu_and_load_into_gpu_cpu_and_resharded(tmp_path):
    src = _state("cuda")
    ci.save({**_sharded(src), "step": 7}, str(tmp_path / "c"))
    dst = {k: torch.zeros_like(t) for k, t in src.items()}
    out = ci.load({**_sharded(dst)}, str(tmp_path / "c"))
    for k, t in src.items():
        assert out[k] is dst[k] and out[k].is_cuda and torch.equal(out[k], t), k
    cpu = ci.load(_sharded({k: torch.zeros_like(t, device="cpu") for k, t in src.items()}), str(tmp_path / "c"))
    assert all(torch.equal(cpu[k], src[k].cpu()) for k in src)
    col = torch.zeros(64, 16, device="cuda")  # a column half, read with strided runs
    part = ci.load({"w": ShardedTensor.from_global_offsets("w", col, (64, 32), (0, 16))}, str(tmp_path / "c"),
                   validate_access_integrity=False)
    assert torch.equal(part["w"], src["w"][:, 16:])


def test_async_save_from_gpu_stages_into_reused_pinned_buffers(tmp_path):
    src = _state("cuda")
    expected = {k: t.clone() for k, t in src.items()}
    with AsyncCallsQueue(max_in_flight=1) as q:
        used_before = torch.cuda.memory_allocated()
        req = async_save_torch_dist(_sharded(src), str(tmp_path / "a0"), queue=q)
        # staging copies to host buffers: no extra device memory, and the GPU tensors can change at once
        assert torch.cuda.memory_allocated() == used_before
        for t in src.values():
            t.add_(1)
        req.wait()
        stager = q.stagers[0]
        assert stager.pin_memory and stager.stats.allocations > 0
        first = stager.stats.allocations
        req = async_save_torch_dist(_sharded(src), str(tmp_path / "a1"), queue=q)
        req.wait()
        assert stager.stats.allocations == first and stager.stats.last_allocations == 0  # buffers reused
    out = ci.load(_sharded({k: torch.zeros_like(t) for k, t in src.items()}), str(tmp_path / "a0"))
    assert all(torch.equal(out[k], expected[k]) for k in src)
    out = ci.load(_sharded({k: torch.zeros_like(t) for k, t in src.items()}), str(tmp_path / "a1"))
    assert all(torch.equal(out[k], expected[k] + 1) for k in src)


def test_public_async_save_keeps_tied_gpu_tensors_tied(tmp_path):
    base = torch.arange(24.0, device="cuda").reshape(4, 6)
    sd = {"emb": ShardedTensor.from_rank_offsets("emb", base), "head": ShardedTensor.from_rank_offsets("head", base[:2])}
    req = ci.save(sd, str(tmp_path / "t"), async_sharded_save=True)
    base.zero_()
    req.wait()
    out = ci.load_plain_tensors(str(tmp_path / "t"))
    ref = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(out["emb"], ref) and torch.equal(out["head"], ref[:2])


def _two_rank_gpu_load(rank, world, root, strategy):
    full = torch.arange(32 * 8.0).reshape(32, 8)
    mine = full[rank * 16:(rank + 1) * 16].cuda()
    ci.save({"w": ShardedTensor.from_rank_offsets("w", mine, (0, rank, world)),
             "r": ShardedTensor.from_rank_offsets("r", torch.ones(5, device="cuda") * 3, replica_id=rank)}, root + "/c")
    # resharded: columns instead of rows, into GPU destinations
    cols = torch.zeros(32, 4, device="cuda")
    rep = torch.zeros(5, device="cuda")
    out = ci.load({"w": ShardedTensor.from_rank_offsets("w", cols, (1, rank, world)),
                   "r": ShardedTensor.from_rank_offsets("r", rep, replica_id=rank)}, root + "/c", load_strategy=strategy)
    assert out["w"] is cols and torch.equal(cols.cpu(), full[:, rank * 4:(rank + 1) * 4])
    assert torch.equal(rep.cpu(), torch.ones(5) * 3)


@pytest.mark.parametrize("strategy", ["auto", "read_once", "local", "fully_parallel", "two_stage"])
def test_two_ranks_load_strategies_into_gpu_tensors(tmp_path, strategy):
    run_distributed(_two_rank_gpu_load, 2, str(tmp_path), strategy, timeout=240)
