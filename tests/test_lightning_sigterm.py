"""Preemption (issue 23 item 5): SIGTERM while an async save is being written under ``Trainer.fit``.

A child process runs ``Trainer(plugins=[DistCkptIO(async_save=True)])`` with
``DistCkptModelCheckpoint(save_top_k=2, save_last=True)``; the background write of the epoch-1
save is slowed down and, while it writes, the process gets SIGTERM (what a scheduler sends before
it kills a job). Lightning's own SIGTERM handling stays in charge with the plugin: it stops the
loop at the next step, and the plugin's teardown lets the save in flight finish and commits it
before the process exits. The newest checkpoint is then complete and ``fit(ckpt_path="last")`` in
a new process resumes from it and finishes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    sys.path.insert(0, {root!r})
    import torch
    import lightning as L
    import ckpt_integration as ci
    from ckpt_integration.execution import save as save_mod
    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint

    ckdir, mode = sys.argv[1], sys.argv[2]
    record = {{"steps": []}}

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(32, 32)
        def training_step(self, batch, i):
            record["steps"].append(int(self.global_step))
            loss = self.lin(batch[0]).pow(2).mean()
            self.log("train_loss", loss)
            return loss
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    if mode == "preempt":
        real, calls = save_mod.write_data_files, []

        def slow_then_sigterm(directory, *args, **kwargs):
            calls.append(directory)
            if os.path.basename(directory) == "epoch=1-step=8.ckpt":  # the epoch-1 top-k save
                record["signalled_from"] = threading.current_thread().name
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice, mid-write
                time.sleep(2)  # still writing when the loop notices it
            return real(directory, *args, **kwargs)

        save_mod.write_data_files = slow_then_sigterm

    L.seed_everything(0, verbose=False)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 32)), batch_size=4)
    cb = DistCkptModelCheckpoint(dirpath=ckdir, save_top_k=2, monitor="train_loss", save_last=True, every_n_epochs=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[DistCkptIO(async_save=True)], max_epochs=4,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                        num_sanity_val_steps=0, limit_val_batches=0)
    try:
        trainer.fit(Net(), data, ckpt_path=None if mode == "preempt" else "last")
    finally:
        record["received_sigterm"] = bool(trainer.received_sigterm)
        record["end_step"] = int(trainer.global_step)
        with open(os.path.join(os.path.dirname(ckdir), mode + ".json"), "w") as f:
            json.dump(record, f)
    """
)


@pytest.mark.slow
def test_sigterm_during_async_save_commits_it_and_restart_resumes(tmp_path):
    import ckpt_integration as ci

    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=ROOT))
    ckdir = tmp_path / "ck"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}

    def run(mode):
        return subprocess.run([sys.executable, str(script), str(ckdir), mode], capture_output=True, text=True,
                              cwd=ROOT, timeout=600, env=env)

    proc = run("preempt")
    first = json.loads((tmp_path / "preempt.json").read_text())
    assert first["received_sigterm"] and first["signalled_from"] == "ckpt-async-save", (first, proc.stderr[-3000:])
    assert proc.returncode != -signal.SIGTERM, proc.stderr[-3000:]  # Lightning handled it, not the default action
    # stopped early (epoch 2 of 4), with the save that was being written committed: step 8 is complete
    assert 8 <= first["end_step"] < 16, first
    names = sorted(os.listdir(ckdir))
    assert "epoch=1-step=8.ckpt" in names and "last.ckpt" in names, names
    assert all(ci.check_is_distributed_checkpoint(str(ckdir / n)) for n in names), names
    assert ci.load_common_state_dict(str(ckdir / "epoch=1-step=8.ckpt"))["global_step"] == 8
    ci.load_plain_tensors(str(ckdir / "epoch=1-step=8.ckpt"))  # verified
    newest = max(ci.load_common_state_dict(str(ckdir / n))["global_step"] for n in names)

    proc = run("resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = json.loads((tmp_path / "resume.json").read_text())
    assert second["steps"][0] == newest and second["end_step"] == 16, (newest, second)
