"""Callbacks: async-save finalization and ``ModelCheckpoint`` for directory checkpoints."""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from ..errors import CheckpointingException, CorruptCheckpointError
from ..checkpoints import abandoned_checkpoints, commit_order_of, ordered_checkpoints
from ..storage.checkpoint_dir import CONFIG_FILE
from ..storage.claim import remove_dead_partial
from ..storage.filesystem import is_remote, join, locate
from .io import DistCkptIO
from .memory import memory_candidate
from .paths import is_complete_checkpoint, is_last_name, latest_complete_checkpoint, run_of
from ..serialization import load_content_metadata

logger = logging.getLogger(__name__)


def _resolve_link(path: Any) -> str:
    """A local ``last.ckpt`` symlink's target (``save_last="link"``); URLs as given."""
    p = os.fspath(path)
    return p if is_remote(p) else os.path.realpath(p)


def _lightning_candidate(path: str) -> str:
    """How a "last" candidate is handed to Lightning, which picks among them by ``fs.modified(path)``.

    Object stores answer ``modified`` only for objects, not for directory prefixes, so a
    remote checkpoint is named by its ``metadata.json`` (the object committed last);
    :func:`~ckpt_integration.lightning.resolve_checkpoint_path` maps it back to the directory.
    """
    p = os.fspath(path)
    return join(p, CONFIG_FILE) if is_remote(p) else p


def _io(trainer: "pl.Trainer") -> Any:
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

    def _check(self, trainer: "pl.Trainer") -> None:
        io = _io(trainer)
        if io is not None and io.num_unfinalized:
            io.maybe_finalize(blocking=False, collective=True)

    def on_train_batch_end(self, trainer: "pl.Trainer", *args: Any, **kwargs: Any) -> None:
        self._check(trainer)

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._check(trainer)

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._check(trainer)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        io = _io(trainer)
        if io is not None:
            io.maybe_finalize(blocking=True, collective=False)


class DistCkptModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` for directory checkpoints: ``ckpt_path="last"`` never picks an
    incomplete one (no ``metadata.json``): it resumes from the newest complete checkpoint.

    ``last.ckpt`` is always the newest trained state: with ``save_last`` it is written at every
    checkpoint trigger (epoch end / validation end per ``every_n_epochs``, and the step / time
    triggers), whether or not the step made it into the top k (Lightning 2.6 rewrites it only
    when a top-k checkpoint was saved at that step, so a resume could silently redo steps). With
    ``save_last="link"`` it links to the checkpoint saved at this step, or is written itself when
    there is none.

    With memory snapshots (``DistCkptIO(memory_every_n_train_steps=N)``) the newest snapshot in
    the node's memory is a candidate too; the strategy then restores the newer of it and the
    newest complete checkpoint.

    ``dirpath`` may be an fsspec URL (``s3://bucket/run``); top-k deletions go through fsspec.
    ``save_last`` is refused there: ``last.ckpt`` is rewritten in place every epoch, and object
    stores cannot replace a checkpoint directory atomically. With ``save_last=False``,
    ``ckpt_path="last"`` still resumes from the newest complete checkpoint in ``dirpath``.
    """

    _last_written_at_step: int = -1

    def _save_last_checkpoint(self, trainer: "pl.Trainer", monitor_candidates: Any) -> None:
        if not self.save_last:
            return
        if self.save_last == "link" and self._last_global_step_saved != trainer.global_step:
            self._last_checkpoint_saved = ""  # nothing saved at this step to link to: write last.ckpt itself
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self._last_written_at_step = trainer.global_step
        # ``last.replaced-*`` left by a run killed before its save committed (one may have been resumed
        # from): a newer last is saved now, removed once it commits (as the strategy defers removals)
        if self.dirpath is not None and not is_remote(os.fspath(self.dirpath)):
            d, stem = os.fspath(self.dirpath), self.CHECKPOINT_NAME_LAST + ".replaced-"
            names = sorted(n for n in os.listdir(d) if n.startswith(stem) and n.endswith(self.FILE_EXTENSION)) \
                if trainer.is_global_zero and os.path.isdir(d) else []
            for name in trainer.strategy.broadcast(names):
                trainer.strategy.remove_checkpoint(os.path.join(d, name))

    def _should_remove_checkpoint(self, trainer: "pl.Trainer", previous: str, current: str) -> bool:
        """Lightning's, except that a top-k checkpoint that ``ckpt_path="last"`` resumed from is removed as any
        other once it falls out of the top k. Lightning keeps the checkpoint a run resumed from, which for
        "last" is its ``last.ckpt``; here "last" may pick a top-k checkpoint (the newest complete one), and
        each crash and resume kept one more for good."""
        if super()._should_remove_checkpoint(trainer, previous, current):
            return True
        if previous == current or trainer.ckpt_path is None or is_remote(os.fspath(previous)) or self.dirpath is None:
            return False
        prev, d = os.path.abspath(os.fspath(previous)), os.path.abspath(os.fspath(self.dirpath))
        return (prev == os.path.abspath(os.fspath(trainer.ckpt_path)) and prev in getattr(self, "_last_found", ())
                and prev.startswith(d.rstrip(os.sep) + os.sep))

    def _save_checkpoint(self, trainer: "pl.Trainer", filepath: str) -> None:
        """Lightning's, except that a symbolic link at ``filepath`` (a ``last.ckpt`` that ``save_last="link"``
        left, to an older checkpoint or dangling once top-k deleted it) is dropped first: the save replaces
        the link, never the checkpoint it names, and does not fail on one whose target is gone.

        The checkpoints that fell out of the top k and are to be removed, and still exist, are saved in the
        callback's state (``pending_removals``): Lightning removes one only after the save that replaced it
        (later still for an async save), and a run killed in between resumed that newer checkpoint, whose state
        no longer names it, so it stayed for good, one per such crash (found by a probe)."""
        due = [p for p in [*self._pending_removals, *(p for p in self._tracked if p not in self.best_k_models)]
               if self._should_remove_checkpoint(trainer, p, filepath)] if self.dirpath else []
        local = not is_remote(os.fspath(filepath))
        # (rank 0 decides. Each is named by the commit it was, since a later run may save another checkpoint
        # under its name, and with the save that replaced it, which may fail: then it must stay)
        link, pending = trainer.strategy.broadcast((local and os.path.islink(filepath), {
            p: self._pending_removals.get(p) or [commit_order_of(p).created, os.fspath(filepath), self._tracked.get(p)]
            for p in dict.fromkeys(due) if local and os.path.lexists(p)}) if trainer.is_global_zero else None)
        self._pending_removals, self._tracked = pending, dict(self.best_k_models)
        if link:
            if trainer.is_global_zero:
                os.remove(filepath)
            trainer.strategy.barrier()
        super()._save_checkpoint(trainer, filepath)

    # path -> [the commit time of the one meant, what replaced it, its score]
    _pending_removals: Dict[str, List[Any]] = {}
    _tracked: Dict[str, Any] = {}
    _debris: List[str] = []  # (incomplete checkpoints setup removed: saves that never committed)

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "pending_removals": dict(self._pending_removals)}

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Remove what the resumed checkpoint's state says had fallen out of the top k (see
        :meth:`_save_checkpoint`), unless it is back in the top k or is what this run resumed from."""
        super().on_train_start(trainer, pl_module)
        drop, back, phantom = trainer.strategy.broadcast(self._resume_removals(trainer) if trainer.is_global_zero
                                                         else None)
        for p in drop:  # (only once what replaced it committed: a failed save keeps it)
            logger.info("removing %s: it had fallen out of the top k when the checkpoint resumed from was saved", p)
            trainer.strategy.remove_checkpoint(p)
        if phantom or back:
            self._reconcile_top_k(phantom, {p: self._pending_removals[p][2] for p in back})
        self._pending_removals, self._tracked = {}, dict(self.best_k_models)

    def _resume_removals(self, trainer: "pl.Trainer") -> Tuple[List[str], List[str], List[str]]:
        """Rank 0, at resume: ``(checkpoints to remove, those to take back into the top k, top-k entries whose
        save never committed)`` from ``pending_removals`` and what ``setup`` found."""
        resumed = os.path.abspath(os.fspath(trainer.ckpt_path)) if trainer.ckpt_path else None
        d = os.path.abspath(os.fspath(self.dirpath)) + os.sep if self.dirpath else None
        same = [p for p, (created, _, _) in self._pending_removals.items() if d and os.path.abspath(p).startswith(d)
                and p not in self.best_k_models and os.path.abspath(p) != resumed and not is_last_name(os.path.basename(p))
                and created is not None and os.path.lexists(p) and commit_order_of(p).created == created]
        back = [p for p in same if not is_complete_checkpoint(self._pending_removals[p][1])]
        # top-k entries whose save never committed (a resume from a memory snapshot taken while it was written):
        # they held a place, and the next save pushed out a checkpoint that exists instead. (Not one committed
        # and removed since: a rollback's top k keeps those, as Lightning does)
        never = {os.path.abspath(p) for p in [*self._debris, *(self._pending_removals[p][1] for p in back)]}
        io = _io(trainer)
        phantom = [p for p in self.best_k_models if os.path.abspath(os.fspath(p)) in never
                   and not is_complete_checkpoint(p) and not (io is not None and io.saving(p))]
        return [p for p in same if p not in back], back, phantom

    def _reconcile_top_k(self, phantom: List[str], back: Dict[str, Any]) -> None:
        """Drop the top-k entries that never committed; take back those a failed save had pushed out."""
        for p in phantom:
            self.best_k_models.pop(p, None)
        self.best_k_models.update({p: v for p, v in back.items() if v is not None})
        logger.warning("top k after resume: %s never committed, %s taken back", phantom or "nothing", list(back) or "none")
        k = len(self.best_k_models) + 1 if self.save_top_k == -1 else self.save_top_k
        worst, best = (max, min) if self.mode == "min" else (min, max)
        if self.best_k_models and len(self.best_k_models) >= k:
            self.kth_best_model_path = worst(self.best_k_models, key=self.best_k_models.get)
            self.kth_value = self.best_k_models[self.kth_best_model_path]
        else:
            self.kth_best_model_path, self.kth_value = "", torch.tensor(float("inf") if self.mode == "min" else -float("inf"))
        if self.best_k_models:
            self.best_model_path = best(self.best_k_models, key=self.best_k_models.get)
            self.best_model_score = self.best_k_models[self.best_model_path]

    def load_state_dict(self, state_dict: dict) -> None:
        """Lightning's; then, with ``save_last="link"``, a run resumed from the first checkpoint its link was
        made to takes ``last.ckpt`` back: that checkpoint's state was saved before the link existed (no
        ``last_model_path``), so every resume wrote ``last-v<N>.ckpt`` beside a stale ``last.ckpt``."""
        super().load_state_dict(state_dict)
        same_dir = state_dict.get("dirpath", self.dirpath) == self.dirpath
        pending = state_dict.get("pending_removals")
        self._pending_removals = {str(p): list(v) for p, v in pending.items() if isinstance(v, (list, tuple)) and len(v) == 3} \
            if same_dir and isinstance(pending, dict) else {}
        if self.save_last != "link" or self.last_model_path or not self.dirpath or "{" in self.CHECKPOINT_NAME_LAST \
                or is_remote(os.fspath(self.dirpath)):
            return
        last = os.path.join(os.fspath(self.dirpath), self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)
        mine = {os.path.basename(os.fspath(p)) for p in [*self.best_k_models, self.best_model_path] if p}
        if os.path.islink(last) and os.path.basename(os.readlink(last).rstrip(os.sep)) in mine:
            self.last_model_path = last

    def _link_checkpoint(self, trainer: "pl.Trainer", filepath: str, linkpath: str) -> None:
        """Lightning's, except that a ``last.ckpt`` written as a checkpoint itself is moved aside, not
        deleted, before the link takes its name: the checkpoint linked to may still be being written
        (an async save), and until it commits the one it replaces is the newest state. The moved one
        (``last.replaced-<id>.ckpt``, still a candidate for ``ckpt_path="last"``) is removed as a
        replaced checkpoint is: after the commit, and never when the save fails.

        A ``last.ckpt`` this job's async save is still writing (``max_in_flight > 1``: a step that made no
        top-k save wrote it) is waited for first: moved aside, its save failed; overwriting it through a
        staging directory, its swap later put the older state over the link."""
        if os.path.abspath(filepath) != os.path.abspath(linkpath):
            io = _io(trainer)
            if io is not None:  # (a save of the name itself, not of what a link there names: every rank alike)
                io.wait_if_saving(linkpath, follow_links=False)
            aside = None
            if trainer.is_global_zero and os.path.isdir(linkpath) and not os.path.islink(linkpath):
                stem, ext = os.path.splitext(linkpath)
                aside = f"{stem}.replaced-{uuid.uuid4().hex[:8]}{ext}"
                os.replace(linkpath, aside)
            aside = trainer.strategy.broadcast(aside)
            if aside is not None:
                trainer.strategy.remove_checkpoint(aside)
        super()._link_checkpoint(trainer, filepath, linkpath)

    def _save_last_if_behind(self, trainer: "pl.Trainer") -> None:
        """At an epoch-level trigger: write ``last`` if this step's top-k decision did not."""
        from lightning.pytorch.trainer.states import TrainerFn

        if (not self.save_last or self._last_written_at_step == trainer.global_step or trainer.fast_dev_run
                or trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking
                or self._every_n_epochs < 1 or (trainer.current_epoch + 1) % self._every_n_epochs):
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_behind(trainer)

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_behind(trainer)

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        """Lightning's; then (rank 0, fitting, a local ``dirpath``) remove the checkpoint directories a
        killed run left incomplete: a resumed run that does not save the same step again kept them for
        good (``ckpt_path="last"`` never picks them; a running save's are locked, and kept). An incomplete
        ``last*`` stays: a resume given its path falls back from it (removed here first, that resume failed
        with "does not exist"), and the next save of ``last`` replaces it."""
        super().setup(trainer, pl_module, stage)
        self._debris = []  # (this fit's: a checkpoint an earlier fit removed as debris may have been saved again)
        if self.save_last and self.dirpath is not None and is_remote(os.fspath(self.dirpath)):
            raise ValueError(
                f"DistCkptModelCheckpoint(save_last={self.save_last!r}) is not supported on {self.dirpath}: "
                "last.ckpt is overwritten every save, and object stores cannot replace a checkpoint directory "
                "atomically. Pass save_last=False: ckpt_path=\"last\" then resumes from the newest complete "
                "checkpoint in dirpath."
            )
        if stage != "fit" or not trainer.is_global_zero or not self.dirpath or is_remote(os.fspath(self.dirpath)):
            return
        io = _io(trainer)
        depth = (self.filename or "").count("/")  # (a file name with "/" nests checkpoints deeper)
        for path in _checkpoint_dirs(os.fspath(self.dirpath), self.FILE_EXTENSION, depth):
            if is_last_name(os.path.basename(path)):
                continue  # (a resume given it falls back to the newest complete sibling, later: the next save replaces it)
            if not (io is not None and io.saving(path)) and remove_dead_partial(locate(path)):
                logger.warning("removed %s: an incomplete checkpoint a killed run left (never committed)", path)
                self._debris = [*self._debris, path]

    def file_exists(self, filepath: Any, trainer: "pl.Trainer") -> bool:
        """Only a complete checkpoint, or one this job's async save is writing, counts as existing
        (decided on rank 0, shared with all).

        A directory left by a save killed before its commit would otherwise make Lightning
        write the redone save as ``<name>-v1.ckpt`` next to the debris; treating it as absent
        lets the new save reuse the name (the save clears an incomplete directory first). A save
        still in flight is not debris: a second callback saving at the same step must get a name
        of its own, or both would keep (and one later delete) the same checkpoint.
        """
        local = False
        io = _io(trainer)
        if trainer.is_global_zero and io is not None and io.saving(filepath):
            local = True
        elif trainer.is_global_zero and self._fs.exists(filepath):
            local = is_complete_checkpoint(_resolve_link(filepath))
        return trainer.strategy.reduce_boolean_decision(local, all=False)

    def _find_last_checkpoints(self, trainer: "pl.Trainer") -> set:
        """The one candidate for ``ckpt_path="last"``: the newest committed checkpoint of ``dirpath``.

        Newest by what the job recorded (global step, then the commit number written at
        commit; see :mod:`ckpt_integration.checkpoints`), not by modification times as
        Lightning compares its candidates: object stores keep those to the second and nodes'
        clocks differ. Among every complete checkpoint of ``dirpath`` (``last*`` included), so a
        ``last.ckpt`` whose save was interrupted after a later top-k save committed gives way to
        that one; after a rollback, among those of the run that saved last (see
        :func:`~ckpt_integration.lightning.paths.run_of`). Which was chosen, and why, is logged.
        """
        found = {p for p in super()._find_last_checkpoints(trainer) if is_complete_checkpoint(_resolve_link(p))}
        io = _io(trainer)
        read_kw = io.read_kwargs() if io is not None else {}  # (the content metadata is in the common state)
        if self.dirpath is not None:
            try:
                # (a metric with "/" in the file name, "{epoch}-{train/loss:.2f}", nests the checkpoints)
                newest = latest_complete_checkpoint(self.dirpath, self.FILE_EXTENSION, why='ckpt_path="last"',
                                                    depth=(self.filename or "").count("/"), **read_kw)
            except CorruptCheckpointError:  # a committed checkpoint whose step is unknown (it may be the newest)
                if io is None or not io.memory_enabled:
                    raise
                newest = None  # (the memory tier's restore decides, and says why: lightning/memory.py)
            if newest is not None:  # (a fit resumes the full state, whichever callback asks)
                newest = _with_optimizer_states(newest, os.fspath(self.dirpath), self.FILE_EXTENSION,
                                                (self.filename or "").count("/"), read_kw)
            if newest is not None:  # (Lightning's ``last*`` names are in that listing: the listing's choice stands,
                found = {newest}     # also over a ``last.ckpt`` of a timeline a rollback left)
        if len(found) > 1:  # no listing to choose from (a damaged checkpoint under the memory tier)
            found = {max(found, key=lambda p: commit_order_of(p).key())}
        out = {_lightning_candidate(p) for p in found}
        self._last_found = {os.path.abspath(os.fspath(p)) for p in out if not is_remote(os.fspath(p))}
        if io is not None and io.memory_enabled:  # the memory tier's newest snapshot competes too
            io._memory_last_requested = True  # "last": the strategy restores the newest of memory and durable
            snap = memory_candidate(io, trainer)
            if snap is not None:
                out.add(snap)
        return out


__all__ = ["DistCkptAsyncFinalizer", "DistCkptModelCheckpoint"]


def _has_optimizer_states(path: str, kw: Dict[str, Any]) -> Optional[bool]:
    """What a checkpoint of the DistCkpt strategies recorded (``has_optimizer_states``); None: unknown."""
    try:
        meta = load_content_metadata(path, **kw)
    except (CheckpointingException, OSError):
        return None
    return meta.get("has_optimizer_states") if isinstance(meta, dict) else None


def _with_optimizer_states(newest: str, dirpath: str, ext: str, depth: int, kw: Dict[str, Any]) -> str:
    """``newest``, or, when it was saved weights-only (another callback's ``save_weights_only=True``), the
    newest checkpoint before it that holds the optimizer states (of the same step when there is one), on the
    same timeline (:func:`~ckpt_integration.checkpoints.abandoned_checkpoints`): a resume from a weights-only
    one fails ("contains only the model") though a full state is there."""
    if _has_optimizer_states(newest, kw) is not False:
        return newest
    order = ordered_checkpoints(dirpath, ext, depth)
    left = {c.path for c in abandoned_checkpoints(order, lambda p: run_of(p, **kw))}
    at = next((i for i, c in enumerate(order) if os.path.abspath(c.path) == os.path.abspath(newest)), None)
    for c in reversed(order[:at] if at is not None else []):
        if c.path not in left and _has_optimizer_states(c.path, kw) is not False:
            logger.info('ckpt_path="last": %s was saved weights-only; resuming from %s (%s), the newest full '
                        'checkpoint before it', newest, c.path, c.describe())
            return c.path
    return newest


def _checkpoint_dirs(d: str, ext: str, depth: int) -> List[str]:
    """The directories (not links) named ``*<ext>`` in ``d`` or up to ``depth`` directories below it."""
    out: List[str] = []
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        path = os.path.join(d, name)
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        if name.endswith(ext):
            out.append(path)
        elif depth > 0:
            out += _checkpoint_dirs(path, ext, depth - 1)
    return out
