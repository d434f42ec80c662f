"""save(..., async_sharded_save=True) through the public entry point."""

import torch

import ckpt_integration as ci


def test_public_async_save_returns_request_and_snapshots(tmp_path):
    w = torch.arange(12.0).reshape(3, 4)
    req = ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", w), "step": 3}, tmp_path / "c", async_sharded_save=True)
    w.add_(100)  # modified right after the call returns: must not change what is saved
    req.wait()
    out = ci.load({"w": ci.ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))}, tmp_path / "c")
    assert torch.equal(out["w"], torch.arange(12.0).reshape(3, 4)) and out["step"] == 3
