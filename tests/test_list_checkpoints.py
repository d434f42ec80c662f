"""``ci.list_checkpoints``: the committed checkpoints of a directory, local or fsspec URL."""

from __future__ import annotations

import os
import uuid

import torch

import ckpt_integration as ci


def _save(path):
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(3)), "step": 1}, path, durable=False)


def test_lists_committed_checkpoints_only(tmp_path):
    d = tmp_path / "run"
    assert ci.list_checkpoints(d) == []  # no directory yet
    _save(str(d / "epoch=1.ckpt"))
    _save(str(d / "last.ckpt"))
    _save(str(d / "partial.ckpt"))
    os.remove(d / "partial.ckpt" / "metadata.json")  # an interrupted save: data files, no commit marker
    (d / "notes.txt").write_text("x")
    (d / "empty").mkdir()
    assert ci.list_checkpoints(d) == [str(d / "epoch=1.ckpt"), str(d / "last.ckpt")]
    out = ci.load({"w": ci.ShardedTensor.from_rank_offsets("w", torch.empty(3))}, ci.list_checkpoints(d)[-1])
    assert torch.equal(out["w"], torch.ones(3)) and out["step"] == 1


def test_lists_checkpoints_behind_a_url():
    root = f"memory://list-{uuid.uuid4().hex[:8]}"
    _save(f"{root}/a.ckpt")
    _save(f"{root}/b.ckpt")
    assert ci.list_checkpoints(root) == [f"{root}/a.ckpt", f"{root}/b.ckpt"]
    assert ci.list_checkpoints(f"{root}/missing") == []
