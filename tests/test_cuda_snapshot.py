"""Background snapshot of CUDA tensors: side-stream copy into pinned buffers, optimizer step waits.

Skipped where no GPU is present (CI has none); run on a GPU machine with
``python -m pytest -q tests/test_cuda_snapshot.py``.
"""

from __future__ import annotations

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import ShardedTensor
from ckpt_integration.execution.async_save import AsyncCallsQueue, async_save_torch_dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_gpu_state_snapshot_in_background_and_optimizer_step_waits(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 1024).cuda()  # 8 MiB weight: copied in the background
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 2048, device="cuda")
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()

    def state():
        return {"w": ShardedTensor.from_rank_offsets("w", model.weight),
                "m": ShardedTensor.from_rank_offsets("m", opt.state[model.weight]["exp_avg"])}

    ref = (model.weight.detach().cpu().clone(), opt.state[model.weight]["exp_avg"].cpu().clone())
    with AsyncCallsQueue() as q:
        used = torch.cuda.memory_allocated()
        req = async_save_torch_dist(state(), str(tmp_path / "c"), queue=q)
        assert torch.cuda.memory_allocated() == used  # host buffers only
        model(x).pow(2).mean().backward()  # queued behind nothing: the copy runs on a side stream
        opt.step()  # waits for the snapshot (global pre-hook)
        req.wait()
        assert q.stagers[0].pin_memory
        # an in-place change before the snapshot was complete is detected, nothing committed
        req = async_save_torch_dist(state(), str(tmp_path / "bad"), queue=q)
        with torch.no_grad():
            model.weight.mul_(2.0)
        with pytest.raises(ci.errors.SnapshotModifiedError, match="w"):
            req.wait()
    out = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(1024, 2048)),
                   "m": ShardedTensor.from_rank_offsets("m", torch.empty(1024, 2048))}, str(tmp_path / "c"))
    assert torch.equal(out["w"], ref[0]) and torch.equal(out["m"], ref[1])
    assert not (tmp_path / "bad" / "metadata.json").exists()
