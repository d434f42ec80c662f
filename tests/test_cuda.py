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


def _zero_on_gpu(rank, world, root):
    import torch.distributed as tdist

    from ckpt_integration.optimizer import ZeroShardedOptimizer

    alone = [tdist.new_group([r]) for r in range(world)][rank]  # every rank makes every group, in order

    def net(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3)).cuda()

    def sharded(model):
        return {k: ShardedTensor.from_rank_offsets(k, p, replica_id=rank) for k, p in model.named_parameters()}

    model, ref = net(0), net(0)
    zero = ZeroShardedOptimizer(model.parameters(), torch.optim.Adam, lr=0.1)  # DP=2 over the world
    whole = ZeroShardedOptimizer(ref.parameters(), torch.optim.Adam, dp_group=alone, lr=0.1)  # DP=1
    assert zero.main_param.is_cuda and zero.end - zero.start < sum(zero.numels)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).cuda()
    for _ in range(2):
        for m, opt in ((model, zero), (ref, whole)):
            opt.zero_grad()
            m(x).square().sum().backward()
            opt.step()  # the DP=2 one all-gathers CUDA slices
    assert all(p.is_cuda and torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    msd = sharded(model)
    ci.save({"model": msd, "optimizer": zero.sharded_state_dict(msd)}, root + "/z")
    back = net(2)
    again = ZeroShardedOptimizer(back.parameters(), torch.optim.Adam, lr=0.1)
    ci.load({"model": sharded(back)}, root + "/z")
    assert again.load_checkpoint(sharded(back), root + "/z")
    assert again.main_param.is_cuda and torch.equal(again.main_param, zero.main_param)
    mine, theirs = again.optimizer.state[again.main_param], zero.optimizer.state[zero.main_param]
    assert all(torch.equal(mine[k], theirs[k]) for k in ("exp_avg", "exp_avg_sq"))


def test_zero1_on_gpu_tensors_steps_saves_and_resumes(tmp_path):
    run_distributed(_zero_on_gpu, 2, str(tmp_path), timeout=240)


def test_large_gpu_tensors_stream_through_pinned_chunks_into_the_bytes_of_a_host_save(tmp_path, monkeypatch):
    from ckpt_integration.storage import torch_dist

    streamed = []

    def counting(t, chunk=None):
        streamed.append(t.nbytes)
        return host_chunks(t, (1 << 20) + 512)  # chunks not aligned to the checksum blocks

    host_chunks = torch_dist.host_chunks
    monkeypatch.setattr(torch_dist, "host_chunks", counting)
    g = torch.Generator().manual_seed(5)
    src = {"big": torch.randn(1100, 1024, generator=g).to(torch.bfloat16),  # 2.1 MiB: 2 chunks and a bit
           "f32": torch.randn(3, 700, 512, generator=g)}  # 4.1 MiB
    ci.save(_sharded({k: t.cuda() for k, t in src.items()}), str(tmp_path / "gpu"))
    assert sorted(streamed) == sorted(src[k].nbytes for k in ("big", "f32"))
    ci.save(_sharded(src), str(tmp_path / "cpu"))
    files = sorted(p.name for p in (tmp_path / "cpu").glob("*.distcp"))
    assert files == sorted(p.name for p in (tmp_path / "gpu").glob("*.distcp"))
    for name in files:  # the same archives and items, byte for byte
        assert (tmp_path / "gpu" / name).read_bytes() == (tmp_path / "cpu" / name).read_bytes(), name
    out = ci.load(_sharded({k: torch.zeros_like(t, device="cuda") for k, t in src.items()}), str(tmp_path / "gpu"))
    assert all(torch.equal(out[k].cpu(), t) for k, t in src.items())
