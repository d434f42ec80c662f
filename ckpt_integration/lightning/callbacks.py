"""Callbacks: async-save finalization and ``ModelCheckpoint`` for directory checkpoints."""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from .io import DistCkptIO
from .strategy import is_complete_checkpoint, latest_complete_checkpoint


def _io(trainer: Any) -> Any:
    io = getattr(trainer.strategy, "_checkpoint_io", None)
    return io if isinstance(io, DistCkptIO) else None


class DistCkptAsyncFinalizer(Callback):
    """Finalizes async saves at hooks every rank reaches.

    At ``on_train_batch_end``, ``on_train_epoch_end`` and ``on_validation_end`` (all
    ranks, same number of saves started), a save is finalized only when every rank's
    background write is done: a one-int all-reduce, made only while saves are pending,
    so no rank finalizes (or raises) alone. Deferred checkpoint deletions run then.
    ``teardown`` waits for everything. Added automatically when ``async_save=True``.
    """

    def _check(self, trainer: Any) -> None:
        io = _io(trainer)
        if io is not None and io.num_unfinalized:
            io.maybe_finalize(blocking=False, collective=True)

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._check(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._check(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._check(trainer)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        io = _io(trainer)
        if io is not None:
            io.maybe_finalize(blocking=True, collective=False)


class DistCkptModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` for directory checkpoints: ``ckpt_path="last"`` never picks an
    incomplete one (no ``metadata.json``); it falls back to the newest complete checkpoint."""

    def _find_last_checkpoints(self, trainer: Any) -> set:
        found = {p for p in super()._find_last_checkpoints(trainer) if is_complete_checkpoint(os.path.realpath(p))}
        if not found and self.dirpath is not None:
            alt = latest_complete_checkpoint(self.dirpath, self.FILE_EXTENSION)
            if alt is not None:
                found.add(alt)
        return found


__all__ = ["DistCkptAsyncFinalizer", "DistCkptModelCheckpoint"]
