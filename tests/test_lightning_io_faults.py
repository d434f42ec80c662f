"""Faults inside the Lightning loop (issue 23 item 6): a full disk and a permission error during an
async save under ``Trainer.fit`` with top-k and ``save_last``.

One child process (``Trainer(plugins=[DistCkptIO(async_save=True)])``, ``DistCkptModelCheckpoint(
save_top_k=2, save_last=True)``) on a small tmpfs of its own (a private mount namespace), without
capabilities (so a read-only directory refuses root too). Epochs 0 and 1 save normally; at the start
of epoch 2 (once epoch 1's saves are done) the disk is filled (scenario ``full``) or the checkpoint
directory made read-only (``perm``). Expected, and checked here:

* ``fit`` raises the save's ``CheckpointWriteError`` naming the file and the cause, at a defined
  point: the first hook after the background write ended (next batch end / epoch end), at the
  latest the end of ``fit``;
* the checkpoints saved before (the top-k ones and ``last.ckpt``) are complete, unchanged and load;
  ``ckpt_path="last"`` names the epoch-1 state; nothing of the failed save is committed;
* once the fault is gone, ``fit(ckpt_path="last")`` resumes from epoch 1 and finishes, and the
  directory then holds exactly the top 2 and ``last.ckpt`` (top-k bookkeeping intact).

A rank that dies during an async save under Lightning is covered by ``tests/test_lightning_kill.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent(
    """
    import hashlib, json, os, sys
    sys.path.insert(0, {root!r})
    import torch
    import lightning as L
    import ckpt_integration as ci
    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint, resolve_checkpoint_path

    root, scenario = sys.argv[1], sys.argv[2]
    ckdir = os.path.join(root, "ck")

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(32, 32)
        def training_step(self, batch, i):
            loss = self.lin(batch[0]).pow(2).mean()
            self.log("train_loss", loss)
            return loss
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    class Fault(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch != 2 or scenario == "none":
                return
            trainer.strategy.checkpoint_io.maybe_finalize(blocking=True)  # epoch 1's saves are done: the next one fails
            if scenario == "full":  # leave less than a checkpoint's worth of space
                st = os.statvfs(root)
                with open(os.path.join(root, "ballast"), "wb") as f:
                    f.write(b"x" * max(0, st.f_bavail * st.f_frsize - 2048))
            else:
                os.chmod(ckdir, 0o555)

    def digest(p):
        h = hashlib.sha256()
        for d, _, fs in sorted(os.walk(p)):
            for n in sorted(fs):
                h.update(n.encode()); h.update(open(os.path.join(d, n), "rb").read())
        return h.hexdigest()

    def fit(epochs, resume, fault):
        L.seed_everything(0, verbose=False)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 32)), batch_size=4)
        cb = DistCkptModelCheckpoint(dirpath=ckdir, save_top_k=2, monitor="train_loss", save_last=True, every_n_epochs=1)
        trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[DistCkptIO(async_save=True)], max_epochs=epochs,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[Fault()] if fault else [], num_sanity_val_steps=0, limit_val_batches=0)
        trainer.callbacks.append(cb)
        trainer.fit(Net(), data, ckpt_path=resume)
        return trainer

    out = {{}}
    try:
        fit(4, None, True)
        out["error"] = None
    except Exception as e:
        import traceback
        traceback.print_exc()
        out["error"] = [type(e).__name__, str(e), isinstance(e, ci.CheckpointingException)]
    if scenario == "full":
        os.remove(os.path.join(root, "ballast"))
    else:
        os.chmod(ckdir, 0o755)
    names = sorted(os.listdir(ckdir))
    out["names"] = names
    out["complete"] = sorted(n for n in names if ci.check_is_distributed_checkpoint(os.path.join(ckdir, n)))
    out["last_step"] = ci.load_common_state_dict(os.path.join(ckdir, "last.ckpt"))["global_step"]
    out["resolved_last"] = os.path.basename(resolve_checkpoint_path(os.path.join(ckdir, "last.ckpt")))
    out["steps"] = {{n: ci.load_common_state_dict(os.path.join(ckdir, n))["global_step"] for n in out["complete"]}}
    for n in out["complete"]:
        ci.load_plain_tensors(os.path.join(ckdir, n))  # verified
    before = {{n: digest(os.path.join(ckdir, n)) for n in out["complete"]}}
    print("before resume:", json.dumps(out), file=sys.stderr, flush=True)
    trainer = fit(4, "last", False)  # the fault is gone: resume and finish
    out["resumed_to"] = int(trainer.global_step)
    out["resumed_from"] = os.path.basename(str(trainer.ckpt_path))
    after = sorted(os.listdir(ckdir))
    out["final_names"] = after
    out["final_complete"] = all(ci.check_is_distributed_checkpoint(os.path.join(ckdir, n)) for n in after)
    out["final_last_step"] = ci.load_common_state_dict(os.path.join(ckdir, "last.ckpt"))["global_step"]
    out["unchanged_before_resume"] = before
    print(json.dumps(out))
    """
)


def _run(tmp_path, scenario):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=ROOT))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if not (shutil.which("unshare") and shutil.which("setpriv")):
        pytest.skip("needs unshare and setpriv (a private tmpfs, a process without capabilities)")
    # 2 MiB tmpfs of its own; no capabilities, so permissions hold for root too
    cmd = (f"mount -t tmpfs -o size=2m tmpfs {mnt} && exec setpriv --inh-caps=-all --bounding-set=-all "
           f"{sys.executable} {script} {mnt} {scenario}")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True, cwd=ROOT,
                          timeout=600, env=env)
    if proc.returncode != 0 and "mount" in proc.stderr and "Traceback" not in proc.stderr:
        pytest.skip(f"no private tmpfs here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr[-6000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("scenario,cause", [("full", "no space left on device"), ("perm", "permission denied")])
def test_async_save_fault_under_fit_reaches_the_user_and_keeps_checkpoints(tmp_path, scenario, cause):
    out = _run(tmp_path, scenario)
    kind, message, ours = out["error"]
    assert ours and kind == "CheckpointWriteError", (out["error"], out["stderr"])
    assert cause in message.lower() and "/mnt/ck/" in message, message  # the file is named
    # The fault strikes at the start of epoch 2, after epoch 1's saves finished: epoch 2's fails,
    # the ones before it stand
    steps = out["steps"]
    assert steps.get("epoch=0-step=4.ckpt") == 4 and steps.get("epoch=1-step=8.ckpt") == 8, json.dumps(out)
    assert out["last_step"] == 8 and out["resolved_last"] == "last.ckpt", json.dumps(out)  # complete
    assert set(out["complete"]) == {"epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"}, json.dumps(out)
    # what the failed save left is not a checkpoint (its directory, uncommitted; reused by the redo)
    leftover = set(out["names"]) - set(out["complete"])
    assert all(n == "epoch=2-step=12.ckpt" or n.startswith("last.ckpt.tmp-") for n in leftover), json.dumps(out)
    # ckpt_path="last" resumed from the newest complete checkpoint (step 8) and finished; the
    # directory holds the top 2, last.ckpt and the checkpoint resumed from (Lightning never deletes that)
    assert out["resumed_from"] in ("epoch=1-step=8.ckpt", "last.ckpt") and out["resumed_to"] == 16, json.dumps(out)
    assert out["final_last_step"] == 16 and out["final_complete"], json.dumps(out)
    kept = set(out["final_names"]) - {"last.ckpt", out["resumed_from"]}
    assert len(kept) == 2 and "epoch=3-step=16.ckpt" in kept, json.dumps(out)
