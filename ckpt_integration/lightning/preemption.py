"""Preemption under ``Trainer.fit`` with :class:`DistCkptIO`: SIGTERM and SLURM's requeue signal.

Schedulers send SIGTERM (and SLURM, with ``--signal``, the requeue signal, SIGUSR1 by default) to
**every** rank at about the same time, then SIGKILL after their grace period. Lightning's handlers
act inside the signal handler: the SIGTERM handler (Lightning 2.6) broadcasts a flag on the default
process group, the SLURM requeue handler saves a checkpoint (``hpc_ckpt_<n>.ckpt``, a collective
save with this plugin) and runs ``scontrol requeue``. A Python signal handler runs wherever the main
thread happens to be, so one rank's in-handler collective can meet another rank's unrelated
collective (a save's metadata exchange, a gradient all-reduce) and the job hangs until it is killed
(reproduced with 2 gloo ranks: 2 hangs in 3 SIGTERMs that arrived while a save was being prepared).

:class:`DistCkptPreemption` (added by the DistCkpt strategies) keeps Lightning's handlers and what
they do, and changes only *when* they run: from ``on_train_start`` on, the SIGTERM and requeue
handlers Lightning installed are wrapped so that a signal is only recorded (with its time); at the
end of every training batch the ranks agree (one 2-int all-reduce on the plugin's private group)
whether any of them received one, and then every rank runs Lightning's handler at the same point,
so its collectives (the flag broadcast, the requeue save) meet on all ranks. Lightning then stops
every rank at that batch as usual (``SIGTERMException``). A rank that was not signalled itself
acts too (one rank's notice stops the job).

The SIGTERM's time starts the plugin's grace period (``DistCkptIO(sigterm_grace_s=...)``): the
plugin's teardown lets the async save in flight commit if it can within it, otherwise abandons
it cleanly (:meth:`ckpt_integration.AsyncCallsQueue.close` with a time limit), so the process
exits before the scheduler's SIGKILL with the newest complete checkpoint committed.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from ..execution import dist
from .io import DistCkptIO

logger = logging.getLogger(__name__)


def _io(trainer: "pl.Trainer") -> Optional[DistCkptIO]:
    io = getattr(trainer.strategy, "_checkpoint_io", None)
    return io if isinstance(io, DistCkptIO) else None


def _requeue_signal(trainer: "pl.Trainer") -> Optional[int]:
    """The SLURM requeue signal when Lightning handles it (``SLURMEnvironment(auto_requeue=True)``)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    env = getattr(trainer._accelerator_connector, "cluster_environment", None)
    if isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal is not None:
        return int(env.requeue_signal)
    return None


class _Deferred:
    """Installed in place of a signal's handler: records the signal; :meth:`run` calls the handler."""

    def __init__(self, signum: int, handler: Any, on_record: Any):
        self.signum = signum
        self.handler = handler
        self.on_record = on_record
        self.pending: Optional[Tuple[float, Any]] = None  # (time.monotonic() of the first one, frame)
        self.acted = False  # Lightning's handler ran (for this fit, once per signal)

    def __call__(self, signum: int, frame: Any) -> None:
        if self.acted:  # this rank's copy of a notice the job already acted on (another rank's came first)
            logger.info("signal %d received again after the job acted on it; ignored", signum)
            return
        if self.pending is None:
            self.pending = (time.monotonic(), frame)
        self.on_record(signum)

    def run(self) -> None:
        frame = self.pending[1] if self.pending is not None else None
        self.pending, self.acted = None, True
        self.handler(self.signum, frame)


class DistCkptPreemption(Callback):
    """Runs Lightning's SIGTERM and SLURM-requeue handlers on every rank at the same training batch end.

    Added automatically by the DistCkpt strategies; see :mod:`ckpt_integration.lightning.preemption`.
    Signals received before ``on_train_start`` or outside ``fit`` are handled by Lightning as usual.
    """

    def __init__(self) -> None:
        self._deferred: Dict[int, _Deferred] = {}

    def _record(self, trainer: "pl.Trainer", signum: int) -> None:
        io = _io(trainer)
        if signum == signal.SIGTERM and io is not None:
            io.note_preemption()  # the grace period starts at the scheduler's notice

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (Lightning has none either)
        self._deferred = {}
        io = _io(trainer)
        if io is not None and not trainer.received_sigterm:
            io.preempted_at = None  # a new fit with the same plugin starts without a notice
        for signum in (signal.SIGTERM, _requeue_signal(trainer)):
            if signum is None:
                continue
            current = signal.getsignal(signum)
            if isinstance(current, _Deferred) or not callable(current):
                continue  # nothing installed by Lightning (or already wrapped)
            wrapper = _Deferred(signum, current, lambda s, t=trainer: self._record(t, s))
            signal.signal(signum, wrapper)
            self._deferred[signum] = wrapper
            # Lightning's teardown restores the handlers it found before fit, dropping this wrapper

    def _agreed(self, trainer: "pl.Trainer") -> List[int]:
        """The signals some rank received, in the order their handlers run (requeue before SIGTERM)."""
        order = sorted(self._deferred, key=lambda s: s == signal.SIGTERM)
        flags = [1 if self._deferred[s].pending is not None else 0 for s in order]
        io = _io(trainer)
        if io is not None and trainer.world_size > 1:
            group = io.ensure_check_group()
            if group is not None:
                flags = dist.all_reduce_ints(flags, "max", group)
        return [s for s, f in zip(order, flags) if f]

    def _deliver(self, trainer: "pl.Trainer") -> None:
        if not self._deferred:
            return
        for signum in self._agreed(trainer):
            wrapper = self._deferred[signum]
            if wrapper.pending is None:  # another rank's notice: this rank acts on it too
                wrapper.pending = (time.monotonic(), None)
                self._record(trainer, signum)
            logger.info("rank %d: acting on signal %d at global step %d (every rank at this batch end)",
                        trainer.global_rank, signum, trainer.global_step)
            wrapper.run()

    def on_train_batch_end(self, trainer: "pl.Trainer", *args: Any, **kwargs: Any) -> None:
        self._deliver(trainer)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._deliver(trainer)


__all__ = ["DistCkptPreemption"]
