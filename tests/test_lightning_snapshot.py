"""Lightning with async save: the snapshot is copied during the next training_step/backward,
and the optimizer step waits for it (``WaitForSnapshot``); every checkpoint equals the state
at its save exactly. One process, a few steps of a tiny model."""

from __future__ import annotations

import os
import threading

import torch

import ckpt_integration as ci
from ckpt_integration.execution import snapshot as snap_mod
from ckpt_integration.execution.staging import PendingCopy
from tests.dist_utils import scaled_timeout

IN, OUT = 1024, 128  # weight 512 KiB: copied in the background


def test_wait_for_snapshot_callback_in_a_trainer_run(tmp_path, monkeypatch):
    import lightning as L

    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint, DistCkptSingleDeviceStrategy
    from ckpt_integration.lightning.snapshot import WaitForSnapshot

    # every background copy is held until the next optimizer step is about to run
    gate = threading.Semaphore(0)
    real = PendingCopy.run

    def gated(self):
        gate.acquire(timeout=scaled_timeout(60))
        return real(self)

    monkeypatch.setattr(PendingCopy, "run", gated)

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(IN, OUT)

        def training_step(self, batch, idx):
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.05)

    class Recorder(L.Callback):
        """Runs before WaitForSnapshot: sees whether forward/backward overlapped a pending copy."""

        def __init__(self):
            self.at_save, self.overlapped = {}, []

        def on_train_batch_end(self, trainer, pl_module, *args):  # before ModelCheckpoint saves
            opt = trainer.optimizers[0]
            st = opt.state[pl_module.lin.weight]
            self.at_save[trainer.global_step] = (pl_module.lin.weight.detach().clone(), st["exp_avg"].clone())

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            pending = snap_mod.snapshots_in_flight()
            if pending:
                self.overlapped.append(all(not s.copied() for s in pending))
                gate.release()

        def on_train_end(self, trainer, pl_module):
            gate.release(4)  # the last save has no optimizer step after it

    L.seed_everything(0, verbose=False)
    ds = torch.utils.data.TensorDataset(torch.randn(24, IN))
    rec, waiter = Recorder(), WaitForSnapshot()
    ck = DistCkptModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=2, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=DistCkptSingleDeviceStrategy(),
                        plugins=[DistCkptIO(async_save=True)], callbacks=[rec, waiter, ck], max_steps=5,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(Net(), torch.utils.data.DataLoader(ds, batch_size=4))

    # saves after steps 2 and 4; the next step's forward/backward ran while the copy was pending
    assert rec.overlapped == [True, True] and waiter.waits == 2
    assert not snap_mod.snapshots_in_flight() and not snap_mod.hook_installed()
    saved = sorted(d for d in os.listdir(tmp_path) if d.endswith(".ckpt"))
    assert len(saved) == 2
    for name in saved:
        step = int(name.split("step=")[1].split(".")[0])
        tensors = ci.load_plain_tensors(os.path.join(tmp_path, name))
        w, m = rec.at_save[step]
        wkey = next(k for k in tensors if k.endswith("lin.weight") and not k.startswith("optimizer"))
        mkey = next(k for k in tensors if "exp_avg" in k and "exp_avg_sq" not in k and k.endswith("lin.weight"))
        assert torch.equal(tensors[wkey], w), (name, wkey)
        assert torch.equal(tensors[mkey], m), (name, mkey)
