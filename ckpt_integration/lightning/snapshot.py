"""Lightning: wait for an async save's background snapshot right before the optimizer step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from ..execution.snapshot import snapshots_in_flight, wait_for_snapshot

__all__ = ["WaitForSnapshot"]


class WaitForSnapshot(Callback):
    """Waits in ``on_before_optimizer_step`` until the snapshots of async saves are complete.

    With ``DistCkptIO(async_save=True)`` a save returns before its tensors are copied;
    the copy runs while the next ``training_step`` and backward run, and this
    callback makes the optimizer step (the first thing that modifies the saved
    parameters and optimizer state) wait for it. Lightning calls the hook after the
    closure (forward, backward, gradient clipping), in automatic and manual
    optimization alike, so the forward and backward overlap the copy. Local: no
    collectives. ``waits`` counts the steps that found a snapshot still in flight.

    ``torch.optim`` optimizers also wait by themselves (a global step pre-hook,
    :mod:`ckpt_integration.execution.snapshot`); this callback covers optimizers that
    are not ``torch.optim.Optimizer`` subclasses and makes the wait point explicit.

    Example::

        trainer = L.Trainer(strategy=DistCkptDDPStrategy(), plugins=[DistCkptIO(async_save=True)],
                            callbacks=[WaitForSnapshot()])
    """

    def __init__(self) -> None:
        self.waits = 0

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        if snapshots_in_flight():
            self.waits += 1
            wait_for_snapshot()
