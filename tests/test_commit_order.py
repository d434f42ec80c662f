"""Which checkpoint is the newest: what the job recorded (global step, commit number), not clocks.

Object stores keep ``LastModified`` to the second, so two commits in one second tie, and the
nodes of a shared filesystem have clocks that differ. Both are reproduced here by giving an
older checkpoint's ``metadata.json`` a later time: on S3 (moto) by uploading it again, on a
local filesystem with ``os.utime``. ``list_checkpoints``, ``latest_complete_checkpoint`` and
Lightning's ``ckpt_path="last"`` must still pick the checkpoint of the latest step.
"""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration.storage import checkpoint_dir as ckdir
from ckpt_integration.storage import opened as commits
from tests.s3_faults import s3_fixture
from ckpt_integration.storage.filesystem import locate

s3 = s3_fixture(bucket="bkt")


def _save(path, **kw):
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(3)), **kw.pop("common", {})}, path,
            durable=False, **kw)


def test_order_by_recorded_step_then_commit_not_clock(tmp_path):
    d = tmp_path / "run"
    _save(str(d / "b"), common={"global_step": 4})
    _save(str(d / "a"), common={"global_step": 8})  # newer step, name sorts first
    _save(str(d / "c"), step=8)  # same step, committed later: newer
    # clocks that differ between nodes: the oldest commit looks newest
    later = time.time() + 3600
    os.utime(d / "b" / "metadata.json", (later, later))
    assert [os.path.basename(p) for p in ci.list_checkpoints(d)] == ["b", "a", "c"]
    m = ckdir.read_manifest(locate(d / "c"))
    assert m.step == 8 and m.commit_seq == ckdir.read_manifest(locate(d / "a")).commit_seq + 1


def test_overwrite_siblings_are_not_listed(tmp_path):
    """An overwrite save stages the new checkpoint at ``last.ckpt.tmp-<id>`` and (without an atomic
    exchange) moves the old one to ``last.ckpt.old-<id>``: both carry a commit marker for a moment
    and then vanish, so a reader looking for the newest checkpoint must not pick them (before: the
    staged copy, the newest commit, was listed last and chosen as "newest")."""
    import shutil

    d = tmp_path / "run"
    _save(str(d / "epoch=0.ckpt"), step=4)
    _save(str(d / "last.ckpt"), step=4)
    _save(str(d / "last.ckpt.tmp-0123abcd"), step=8)  # as a swap in progress leaves it
    shutil.copytree(d / "last.ckpt", d / "last.ckpt.old-89abcdef")
    assert [os.path.basename(p) for p in ci.list_checkpoints(d)] == ["epoch=0.ckpt", "last.ckpt"]
    assert os.path.basename(ci.checkpoints.newest_checkpoint(str(d))) == "last.ckpt"


@pytest.mark.parametrize("damage", ["deleted", "emptied", "newer_format", "step_bit_flipped"])
def test_a_newest_checkpoint_that_cannot_be_ordered_is_not_skipped(tmp_path, damage):
    """Before: a committed checkpoint whose manifest.json was deleted or emptied sorted as the oldest,
    and ``ckpt_path="last"`` resumed from an older checkpoint without a word (its steps lost). The
    same for one flipped bit that turned its recorded step 8 into 0 (format 7 seals the manifest's
    head, which listings read: ``checksum.sealed_json``)."""
    import json
    import shutil

    d = tmp_path / "run"
    _save(str(d / "epoch=0.ckpt"), step=4)
    _save(str(d / "last.ckpt"), step=8)
    manifest = d / "last.ckpt" / "manifest.json"
    if damage == "deleted":
        manifest.unlink()
    elif damage == "emptied":
        manifest.write_bytes(b"")
    elif damage == "step_bit_flipped":  # "8" (0x38) -> "0" (0x30): valid JSON, an older step
        data = bytearray(manifest.read_bytes())
        data[data.index(b'"step": 8') + len(b'"step": ')] ^= 0x08
        manifest.write_bytes(bytes(data))
    else:  # (written by a newer version: its head does not have the layout this one reads)
        raw = json.loads(manifest.read_text())
        manifest.write_text(json.dumps({"version": 99, **{k: v for k, v in raw.items() if k != "version"}}))
    assert [os.path.basename(p) for p in ci.list_checkpoints(d)] == ["last.ckpt", "epoch=0.ckpt"]  # (listed)
    with pytest.raises(ci.errors.CorruptCheckpointError, match=r"last\.ckpt is committed but cannot be ordered.*"
                       r"the newest readable one is .*epoch=0\.ckpt \(global step 4"):
        ci.checkpoints.newest_checkpoint(str(d), why='ckpt_path="last"')
    from ckpt_integration.lightning import latest_complete_checkpoint

    with pytest.raises(ci.errors.CorruptCheckpointError, match="cannot be ordered"):
        latest_complete_checkpoint(str(d))  # (what Lightning's ckpt_path="last" and the memory tier ask)
    # a checkpoint of another writer (no manifest, no marker) is ordered by time, as before
    shutil.rmtree(d / "last.ckpt")
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(d / "dcp.ckpt"))
    (d / "dcp.ckpt" / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    assert os.path.basename(ci.checkpoints.newest_checkpoint(str(d))) in ("epoch=0.ckpt", "dcp.ckpt")


def test_commit_numbers_continue_across_processes(tmp_path):
    """A new job (no cached counter) numbers its commits after every checkpoint already there."""
    d = tmp_path / "run"
    for name in ("iter_3", "iter_2", "iter_1"):  # no step recorded: commit order decides
        _save(str(d / name))
    commits._last_seq.clear()  # as in a restarted job
    _save(str(d / "iter_0"))
    assert [os.path.basename(p) for p in ci.list_checkpoints(d)] == ["iter_3", "iter_2", "iter_1", "iter_0"]
    assert ckdir.read_manifest(locate(d / "iter_0")).commit_seq == 4


def test_commit_numbers_of_one_directory_however_it_is_spelled(tmp_path):
    """The counter was kept per parent path as spelled: a save through a symlinked parent numbered on
    from that spelling's own count, and two checkpoints of one directory got the same number (the
    clock then decided which was newest)."""
    d = tmp_path / "run"
    d.mkdir()
    os.symlink(d, tmp_path / "link")
    for i, parent in enumerate((d, tmp_path / "link", d, tmp_path / "link")):
        _save(str(parent / f"c{i}"))
    seqs = [ckdir.read_manifest(locate(d / f"c{i}")).commit_seq for i in range(4)]
    assert seqs == sorted(set(seqs)) and len(seqs) == 4, seqs


def _fit(dirpath, epochs, ckpt_path=None):
    import lightning as L

    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint
    from tests.lightning_helpers import TinyModule, loader

    cb = DistCkptModelCheckpoint(dirpath=dirpath, save_last=False, save_top_k=-1)
    m = TinyModule()
    t = L.Trainer(accelerator="cpu", devices=1, plugins=[DistCkptIO()], max_epochs=epochs, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, callbacks=[cb], limit_val_batches=0,
                  num_sanity_val_steps=0, enable_checkpointing=True)
    t.fit(m, loader(), ckpt_path=ckpt_path)  # 16 samples, batch 4: 4 steps per epoch
    return m, t


def test_lightning_last_on_s3_resumes_from_latest_step(s3, caplog):
    """docs/lightning.md on an object store: 2 epochs of 4 steps, then ``fit(ckpt_path="last")``."""
    import fsspec

    url = "s3://bkt/ck"
    fs = fsspec.filesystem("s3")
    _fit(url, 2)
    assert sorted(n.rsplit("/", 1)[-1] for n in fs.ls(url)) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    # the same second, or a clock behind: the older commit marker has the later LastModified
    meta0 = f"{url}/epoch=0-step=4.ckpt/metadata.json"
    time.sleep(1.1)
    fs.pipe_file(meta0, fs.cat_file(meta0))
    assert fs.modified(meta0) > fs.modified(f"{url}/epoch=1-step=8.ckpt/metadata.json")
    with caplog.at_level(logging.INFO, logger="ckpt_integration"):
        m, t = _fit(url, 3, ckpt_path="last")
    assert t.ckpt_path.rstrip("/").rsplit("/", 2)[-2:] == ["epoch=1-step=8.ckpt", "metadata.json"]
    assert m.counter.history == list(range(12)) and t.global_step == 12  # resumed at step 8, no step redone
    names = sorted(n.rsplit("/", 1)[-1] for n in fs.ls(url, refresh=True))
    assert names == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]  # no "-v1" copy
    why = [r.getMessage() for r in caplog.records if "newest of" in r.getMessage()]
    assert why and "epoch=1-step=8.ckpt" in why[0] and "global step 8" in why[0] and "step 4" in why[0], why


def test_lightning_last_refuses_a_newest_checkpoint_whose_manifest_is_gone(tmp_path):
    """``fit(ckpt_path="last")`` after the newest checkpoint's manifest.json was deleted: an error naming
    it and the newest readable one (before: epoch 0's checkpoint was resumed, epoch 1 redone without a word)."""
    d = str(tmp_path / "ck")
    _fit(d, 2)
    os.remove(os.path.join(d, "epoch=1-step=8.ckpt", "manifest.json"))
    with pytest.raises(ci.errors.CorruptCheckpointError, match=r"epoch=1-step=8\.ckpt is committed but cannot be "
                       r"ordered.*the newest readable one is .*epoch=0-step=4\.ckpt"):
        _fit(d, 3, ckpt_path="last")


def test_checkpoints_of_a_timeline_a_rollback_left_are_not_the_newest(tmp_path, caplog):
    """``newest_checkpoint(run_of=...)``: the run that committed last started from step 4 after run 1 had saved
    steps 2..8; run 1's steps above 4 are left out, the rest of the order stands. A checkpoint of a lower step
    committed later by the same run (a memory persist after a durable save) is not a rollback."""
    from ckpt_integration.checkpoints import newest_checkpoint

    runs = {}
    for step in (2, 4, 6, 8):
        _save(f"{tmp_path}/r1-{step}", step=step)
        runs[f"{tmp_path}/r1-{step}"] = (0, 0.0)
    started = time.time()
    for step in (5, 6):
        _save(f"{tmp_path}/r2-{step}", step=step)
        runs[f"{tmp_path}/r2-{step}"] = (4, started)
    assert newest_checkpoint(tmp_path).endswith("r1-8")  # (nothing recorded: by step)
    with caplog.at_level(logging.INFO, logger="ckpt_integration.checkpoints"):
        assert newest_checkpoint(tmp_path, run_of=runs.get, why="test").endswith("r2-6")
    assert "left out 2 checkpoint(s)" in caplog.text and "r1-8" in caplog.text, caplog.text
    _save(f"{tmp_path}/r2-persist-5", step=5)  # (committed after step 6, by the same run)
    runs[f"{tmp_path}/r2-persist-5"] = (4, started)
    assert newest_checkpoint(tmp_path, run_of=runs.get).endswith("r2-6")
    assert newest_checkpoint(tmp_path, run_of=lambda p: None).endswith("r1-8")  # (the last run recorded nothing)
    # a run known otherwise (the memory tier's snapshot of step 7, taken by a run that started then)
    assert newest_checkpoint(tmp_path, left_by=(7, started)).endswith("r2-6")
    assert newest_checkpoint(tmp_path, left_by=(1, time.time())) is None  # (every one left: none to offer)
