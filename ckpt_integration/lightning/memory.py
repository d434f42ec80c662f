"""The memory tier in Lightning: ``DistCkptIO(memory_every_n_train_steps=N, ...)``.

* :class:`DistCkptMemorySnapshots` (added by the DistCkpt strategies when the plugin enables
  memory snapshots) takes a snapshot of Lightning's whole checkpoint (what ``ModelCheckpoint``
  would save: model, optimizers, schedulers, loops, callbacks, RNG states) every N optimizer
  steps, at ``on_train_batch_end`` like ``ModelCheckpoint(every_n_train_steps=N)``; optionally
  makes every M-th snapshot durable (:meth:`MemoryCheckpoints.persist`, in the background);
  on a SIGTERM (Lightning stops every rank at the same batch) makes the newest complete
  snapshot durable within ``memory_sigterm_grace_s`` (default: what is left of the plugin's
  ``sigterm_grace_s``); removes the job's snapshots when ``fit``
  finishes.
* :func:`restore_newest` (called by the strategy's ``load_checkpoint``, collective) for
  ``ckpt_path="last"`` (which also offers the memory tier as a candidate, see
  :func:`memory_candidate`) compares the newest complete step in memory with the newest complete
  checkpoint and restores the newer (an explicit checkpoint path is loaded as given),
  falling back to the durable checkpoint when memory has no usable copy or the layout changed.
  Every rank logs where its state came from.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from typing import Any, Dict, List, Optional, Tuple

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from ..checkpoints import ordered_checkpoints, save_base
from ..errors import CheckpointingException, CorruptCheckpointError, MemoryCheckpointError
from ..execution.dist import local_world_size
from ..execution.save import CONTENT_METADATA_KEY
from ..mapping import ShardedObject
from ..memory import MemoryCheckpoints
from ..optimizer import fill_empty_shards, optimizer_key, optimizer_sharded_state_dict, sharding_state_to_optim_state
from ..storage import checkpoint_dir as ckdir
from ..storage.filesystem import is_remote, locate
from ..serialization import load_common_state_dict
from .entries import RNG_KEY, rng_from_safe, sharded_keys
from .io import MARKER, DistCkptIO
from .paths import is_complete_checkpoint, latest_complete_checkpoint, run_of

logger = logging.getLogger(__name__)

DEFAULT_MEMORY_DIR = "/dev/shm/ckpt_integration"


def _dir(io: DistCkptIO) -> str:
    return os.path.abspath(io.memory_dir or DEFAULT_MEMORY_DIR)


def memory_job_id(io: DistCkptIO, trainer: "pl.Trainer") -> str:
    """The job's name in the memory directory: ``memory_job_id``, or one derived from the trainer's
    ``default_root_dir`` (the same for a restart of the same run)."""
    if io.memory_job_id:
        return io.memory_job_id
    digest = hashlib.sha1(os.path.abspath(os.fspath(trainer.default_root_dir)).encode()).hexdigest()[:12]
    return f"lightning-{digest}"


def tier_for(strategy: Any) -> Any:
    """The plugin's :class:`MemoryCheckpoints`, made on first use (collective)."""
    io = strategy.dist_checkpoint_io()
    if io.memory_tier is None:
        trainer = strategy.lightning_module.trainer
        rpn = io.memory_ranks_per_node or local_world_size() or trainer.num_devices
        io.memory_tier = MemoryCheckpoints(_dir(io), memory_job_id(io, trainer), replicas=io.memory_replicas,
                                           ranks_per_node=rpn, **io.read_kwargs())
    return io.memory_tier


def memory_candidate(io: DistCkptIO, trainer: "pl.Trainer") -> Optional[str]:
    """For ``ckpt_path="last"``: the newest snapshot record of this job on this node (its
    modification time is when it was committed), or ``None``."""
    root = os.path.join(_dir(io), memory_job_id(io, trainer))
    newest: Tuple[float, Optional[str]] = (-1.0, None)
    try:
        owners = os.listdir(root)
    except FileNotFoundError:
        return None
    for d in owners:
        for n in ("s0.rec", "s1.rec"):
            p = os.path.join(root, d, n)
            try:
                newest = max(newest, (os.path.getmtime(p), p))
            except OSError:
                continue
    return newest[1]


def _is_memory_path(io: DistCkptIO, path: str) -> bool:
    return os.path.abspath(path).startswith(_dir(io) + os.sep)


def _persisted_step(path: str, kind: str = "memory") -> int:
    """The step of a ``<kind>-step=<step>.ckpt`` path (``memory``, ``preempted``), -1 for any other name."""
    name, head = os.path.basename(path), f"{kind}-step="
    digits = name[len(head):-len(".ckpt")] if name.startswith(head) and name.endswith(".ckpt") else ""
    return int(digits) if digits.isdigit() else -1


def _checkpoint_dir(trainer: "pl.Trainer") -> str:
    cb = trainer.checkpoint_callback
    d = getattr(cb, "dirpath", None)
    return os.fspath(d) if d else os.path.join(trainer.default_root_dir, "checkpoints")


def restore_newest(strategy: Any, path: str) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """Collective: ``(loaded checkpoint, None)`` when the memory tier had the newest state, else
    ``(None, durable path)`` for the strategy to load."""
    io = strategy.dist_checkpoint_io()
    last, io._memory_last_requested = io._memory_last_requested, False
    if not last and not _is_memory_path(io, path):
        return None, path  # an explicit checkpoint path is loaded as given
    trainer = strategy.lightning_module.trainer
    rank = strategy.global_rank
    tier = tier_for(strategy)
    mem_step = tier.latest()
    durable: Optional[str] = None if _is_memory_path(io, path) else path
    unordered: Optional[str] = None  # (a committed checkpoint whose step is unknown: none is called the newest)
    # (a run that took the snapshot went on from before a later step committed before it started: a rollback)
    left_by = None if mem_step is None or tier.latest_started is None else (mem_step, tier.latest_started)
    if durable is None and strategy.is_global_zero:
        try:
            durable = latest_complete_checkpoint(_checkpoint_dir(trainer), left_by=left_by, **io.read_kwargs())
        except CorruptCheckpointError as e:
            unordered = str(e)
    durable, unordered = strategy.broadcast((durable, unordered))
    if unordered is not None and mem_step is None:
        raise CorruptCheckpointError(unordered)
    step, why = -1, unordered
    if durable is not None and strategy.is_global_zero:
        step, why = _durable_step(durable, io)
    durable_step, why = strategy.broadcast((step, why))
    if why is not None and mem_step is not None:
        # not a guess made silently: memory is taken because the durable checkpoint cannot be
        # read (its load would fail the same way), and every rank says so
        logger.warning("rank %d: the durable checkpoint %s cannot be read (%s), so its step is unknown; resuming from "
                       "the memory tier's step %d instead", rank, durable or "(the newest)", why, mem_step)
    if mem_step is not None and (durable is None or why is not None or mem_step >= durable_step):
        try:
            loaded = _load_memory(strategy, tier, mem_step)
            if durable is not None and why is None and durable_step == mem_step:
                _callback_states_of_step(strategy, loaded, io, mem_step, tier.latest_started)
            logger.info("rank %d: resumed from the memory tier, step %d (%s)", rank, mem_step, tier.last_restore.source)
            return loaded, None
        except MemoryCheckpointError as e:
            if durable is None:
                if unordered is not None:  # (neither memory nor the durable checkpoints: say both)
                    raise CorruptCheckpointError(f"{unordered}; and the memory tier cannot serve step {mem_step}: "
                                                 f"{e}") from None
                raise
            logger.warning("rank %d: cannot resume from memory step %d (%s); falling back to the durable "
                           "checkpoint %s", rank, mem_step, e, durable)
    if durable is None:
        raise MemoryCheckpointError(f"no checkpoint to resume from: {path} is a memory snapshot that is not "
                                    "complete and there is no durable checkpoint")
    logger.info("rank %d: resuming from the durable checkpoint %s (step %d; newest in memory: %s)", rank, durable,
                durable_step, mem_step)
    return None, durable


def callback_states_of_copy(strategy: Any, loaded: Dict[str, Any], path: str) -> None:
    """Collective: when ``path`` (loaded into ``loaded``) is a durable copy of a memory snapshot
    (``memory-step=<n>.ckpt``, ``preempted-step=<n>.ckpt``), the callbacks' states of the checkpoint of its
    step, as for a restore from memory (:func:`_callback_states_of_step`): the copy holds the snapshot's, taken
    before ``ModelCheckpoint`` saved that step, and a resume from it after the memory was lost kept that
    step's checkpoint for good (found by a probe)."""
    step = loaded.get("global_step")
    if _is_snapshot_copy(path) and isinstance(step, int):
        _callback_states_of_step(strategy, loaded, strategy.dist_checkpoint_io(), step, None, copy=path)


def _callback_states_of_step(strategy: Any, loaded: Dict[str, Any], io: DistCkptIO, step: int,
                             started: Optional[float], copy: Optional[str] = None) -> None:
    """Collective: the callbacks' states of the newest checkpoint a callback saved at ``step`` (in this run,
    the one that took the snapshot), into ``loaded`` (a memory snapshot of that step; ``copy``: its durable
    copy, whose run record says when that run started).

    The snapshot is taken at the batch end before ``ModelCheckpoint`` saves that step, so its callback state
    lacks that save: restored from it, the checkpoint was never in ``best_k_models``, never deleted (one more
    kept for good per restore from memory). The checkpoint of the step holds the state after its save."""
    states = None
    if strategy.is_global_zero:
        try:
            if copy is not None:  # (a checkpoint of the step that an earlier run, left by a rollback, saved is not it)
                run = run_of(copy, **io.read_kwargs())
                started = run[1] if run is not None else None
            found = [c for d, ext, depth in _checkpoint_dirs_of(strategy.lightning_module.trainer)
                     for c in ordered_checkpoints(d, ext, depth) if c.step == step and not _is_snapshot_copy(c.path)
                     and (started is None or (c.created or 0) >= started)]
            if found:  # (the one committed last: the callbacks that saved the step before it are in its state)
                newest = max(found, key=lambda c: c.created or 0)
                states = load_common_state_dict(newest.path, **io.read_kwargs()).get("callbacks")
        except (CheckpointingException, OSError) as e:  # (memory's own states stand: one extra checkpoint at worst)
            logger.warning("the callbacks' states of step %d's checkpoint cannot be read (%s): those of the memory "
                           "snapshot are restored", step, e)
    states = strategy.broadcast(states)
    if isinstance(states, dict):
        loaded["callbacks"] = states


def _checkpoint_dirs_of(trainer: "pl.Trainer") -> List[Tuple[str, str, int]]:
    """``(dirpath, extension, depth)`` of every local checkpoint callback (a file name with "/" nests deeper)."""
    out: List[Tuple[str, str, int]] = []
    for cb in getattr(trainer, "checkpoint_callbacks", None) or [trainer.checkpoint_callback]:
        d = getattr(cb, "dirpath", None)
        where = (os.fspath(d), getattr(cb, "FILE_EXTENSION", ".ckpt"), (getattr(cb, "filename", "") or "").count("/")) \
            if d else None
        if where is not None and not is_remote(where[0]) and where not in out:
            out.append(where)
    return out


def _prune_preempted(trainer: "pl.Trainer", below: Optional[int]) -> None:
    """Rank 0: remove the ``preempted-step=<n>.ckpt`` copies of steps before ``below`` (a step a newer durable
    checkpoint holds). Each preemption wrote one, and none was ever removed."""
    d = _checkpoint_dir(trainer)
    if below is None or not trainer.is_global_zero or is_remote(d) or not os.path.isdir(d):
        return
    for name in os.listdir(d):
        path = os.path.join(d, name)
        if 0 <= _persisted_step(name, "preempted") < below and is_complete_checkpoint(path):
            DistCkptIO._remove_now(path)


def _newest_step_committed_since(trainer: "pl.Trainer") -> Optional[int]:
    """Rank 0: the newest step of a checkpoint this run committed (after the run started, so not one of a
    timeline it left) in the directory of the snapshots' copies; None when it committed none."""
    started = (getattr(trainer.strategy, "_run_record", None) or {}).get("started")
    d = _checkpoint_dir(trainer)
    if started is None or not trainer.is_global_zero or is_remote(d):
        return None
    steps = [c.step for c in ordered_checkpoints(d) if c.step is not None and (c.created or 0) >= started]
    return max(steps, default=None)


def _is_snapshot_copy(path: str) -> bool:
    """A memory snapshot made durable (``memory-step=<n>.ckpt``, ``preempted-step=<n>.ckpt``): its callback
    states are the snapshot's."""
    return _persisted_step(path) >= 0 or _persisted_step(path, "preempted") >= 0


def _durable_step(path: str, io: DistCkptIO) -> Tuple[int, Optional[str]]:
    """``(step, None)`` of a durable checkpoint (the step its manifest records, else its
    ``global_step``), or ``(-1, why)`` when it cannot be read."""
    if not is_complete_checkpoint(path):
        return -1, "it is not a complete checkpoint"
    try:
        manifest = ckdir.read_manifest(locate(path))
        if manifest is not None and manifest.step is not None:
            return int(manifest.step), None
        return int(load_common_state_dict(path, **io.read_kwargs()).get("global_step", -1)), None
    except Exception as e:  # noqa: BLE001 - reported by the caller, and by the load if it is tried
        return -1, f"{type(e).__name__}: {e}"


def _load_memory(strategy: Any, tier: Any, step: int) -> Dict[str, Any]:
    """Restore Lightning's checkpoint dict from memory: model and optimizers in place, RNG states set."""
    from lightning.fabric.utilities.seed import _set_rng_states

    model_sd = strategy._module_sharded_state_dict()
    strategy._loaded_sharded_keys = sharded_keys(model_sd)
    rank, world = strategy.global_rank, strategy.world_size
    request: Dict[str, Any] = {"state_dict": model_sd}
    if tier.saved_world_size(step) in (None, world):  # (RNG states are per rank: as a durable load, kept only
        request["rng_states"] = ShardedObject(RNG_KEY, None, (world,), (rank,))  # when the job size is the same)
    optimizers = list(strategy.optimizers) if strategy._fitting() else []
    for i, opt in enumerate(optimizers):
        request[optimizer_key(i)] = optimizer_sharded_state_dict(opt, model_sd, prefix=optimizer_key(i), init_state=True,
                                                                 module=strategy.lightning_module)
    loaded = dict(tier.load(request, step))
    meta = loaded.pop(CONTENT_METADATA_KEY, None) or {}
    num_opt = int(meta.get("num_optimizers", 0))
    if optimizers and meta.get("has_optimizer_states"):
        if len(optimizers) != num_opt:
            raise ValueError(f"the memory snapshot holds {num_opt} optimizer(s), the module configures {len(optimizers)}")
        for i, opt in enumerate(optimizers):
            osd = sharding_state_to_optim_state(loaded.pop(optimizer_key(i)))
            osd.pop("extracted", None)
            fill_empty_shards([p for g in opt.param_groups for p in g["params"]], osd["state"])  # (DTensor params)
            opt.load_state_dict(osd)
        loaded["optimizer_states"] = [opt.state_dict() for opt in optimizers]
    for i in range(num_opt):
        loaded.pop(optimizer_key(i), None)
    rng = loaded.pop("rng_states", None)
    if isinstance(rng, dict):
        _set_rng_states(rng_from_safe(rng))
    loaded["state_dict"] = dict(loaded.get("state_dict", {}))
    strategy._load_report = ([], [])
    return loaded


class DistCkptMemorySnapshots(Callback):
    """Memory snapshots for ``DistCkptIO(memory_every_n_train_steps=N)`` (added automatically)."""

    def __init__(self) -> None:
        self._last_step = -1
        self._count = 0
        self._persist_next: Optional[int] = None
        self._persists: List[Tuple[str, Any]] = []

    @staticmethod
    def _io(trainer: "pl.Trainer") -> Optional[DistCkptIO]:
        io = getattr(trainer.strategy, "_checkpoint_io", None)
        return io if isinstance(io, DistCkptIO) and io.memory_enabled else None

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        io = self._io(trainer)
        if io is not None:  # (after any restore) snapshots of later steps that earlier runs took are a timeline
            # this run left: a rollback to an older checkpoint, or a fresh start, must not be undone by the next restart
            tier_for(trainer.strategy).discard_newer(int(trainer.global_step))

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *args: Any, **kwargs: Any) -> None:
        io = self._io(trainer)
        if io is None:
            return
        step = int(trainer.global_step)
        if self._persist_next is not None:  # the snapshot of the last batch end is complete by now
            self._persist(trainer, io, self._persist_next, "memory")
            self._persist_next = None
        if step == self._last_step or step % io.memory_every_n_train_steps:
            return
        tier = tier_for(trainer.strategy)
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        state = trainer.strategy.sharded_checkpoint(checkpoint, main_replica_only=False)
        state[CONTENT_METADATA_KEY] = state.pop(MARKER)  # what a durable save stores as content metadata
        tier.save(state, step)
        self._last_step = step
        self._count += 1
        if io.memory_persist_every_n and self._count % io.memory_persist_every_n == 0:
            self._persist_next = step

    def _persist(self, trainer: "pl.Trainer", io: DistCkptIO, step: int, kind: str) -> Any:
        path = os.path.join(_checkpoint_dir(trainer), f"{kind}-step={step}.ckpt")
        incremental = {"base": save_base("auto", path)} if io.incremental and io.backend == "torch_dist" else {}
        req = tier_for(trainer.strategy).persist(step, path, thread_count=io.thread_count, overwrite=True,
                                                 durable=io.durable, backend=io.backend, **incremental)
        if kind == "memory":
            self._persists.append((path, req))
            self._prune(trainer)
        return req

    def _prune(self, trainer: "pl.Trainer", final: bool = False) -> None:
        """Keep the two newest ``memory-step=*`` checkpoints (``final``: at the end of ``fit``, also when this run
        made fewer than two); failures are logged here and raised at fit end."""
        done = [(p, r) for p, r in self._persists if r.is_done()]
        for p, r in done[:-2]:
            if r.exception() is None and trainer.is_global_zero and is_complete_checkpoint(p):
                DistCkptIO._remove_now(p)
            self._persists.remove((p, r))
        for p, r in done[-2:]:
            if r.exception() is not None:
                logger.error("making memory snapshot %s durable failed: %s", p, r.exception())
        kept = [p for p, r in done[-2:] if r.exception() is None]
        d = os.path.dirname(kept[0]) if kept else _checkpoint_dir(trainer)
        if (len(kept) == 2 or (final and self._persists_enabled(trainer))) and trainer.is_global_zero \
                and not is_remote(d) and os.path.isdir(d):
            # those of earlier runs of the job (a crash, a restart): older than the two kept, else each restart added
            # its two for good; at the end, the newest of them make up the two when this run made fewer (its last
            # persist starts after the snapshot, so a short run makes one), and any of a later step are of a
            # timeline this run left
            floor = min((_persisted_step(p) for p in kept), default=None)
            earlier = sorted(((_persisted_step(os.path.join(d, n)), os.path.join(d, n)) for n in os.listdir(d)),
                             reverse=True)
            mine = {p for p, _ in self._persists}  # (this run's, also those still being written)
            earlier = [(st, path) for st, path in earlier if st > -1 and path not in mine and is_complete_checkpoint(path)]
            older = [path for st, path in earlier if floor is None or st < floor]
            for path in [path for st, path in earlier if path not in older] + older[2 - len(kept):]:
                DistCkptIO._remove_now(path)
            if len(kept) == 2:
                _prune_preempted(trainer, below=floor)

    def _persists_enabled(self, trainer: "pl.Trainer") -> bool:
        io = self._io(trainer)
        return io is not None and bool(io.memory_persist_every_n)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        io = self._io(trainer)
        if io is None or io.memory_tier is None or not isinstance(exception, SIGTERMException):
            return
        tier = io.memory_tier
        outcome: Dict[str, Any] = {}
        io.note_preemption()  # (already noted when the plugin saw the signal)
        grace = io.memory_sigterm_grace_s if io.memory_sigterm_grace_s is not None else io.grace_left()

        def work() -> None:  # every rank is here (Lightning stops all ranks at the same batch)
            try:
                tier.wait()
            except Exception as e:  # noqa: BLE001 - the snapshot in flight failed: the previous one is complete
                logger.warning("the memory snapshot in flight failed: %s", e)
            step = tier.last_complete_step
            if step is None:
                return
            self._persist(trainer, io, step, "preempted").wait()
            outcome["step"] = step
            _prune_preempted(trainer, below=step)  # (the copies of earlier preemptions: this one is newer)

        th = threading.Thread(target=work, name="ckpt-memory-preempt", daemon=True)
        th.start()
        th.join(grace)
        if th.is_alive():  # the grace period is over: stop what is in flight (nothing half-written commits)
            tier.abandon(f"preempted: not durable within the grace period ({grace:.0f}s after the SIGTERM)")
        if "step" in outcome:
            logger.info("rank %d: SIGTERM: memory snapshot of step %d is durable in %s", trainer.global_rank,
                        outcome["step"], _checkpoint_dir(trainer))
        else:
            logger.error("rank %d: SIGTERM: the newest memory snapshot could not be made durable within %s",
                         trainer.global_rank, "the grace period" if grace is None else f"{grace:.0f}s")

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        io = self._io(trainer)
        if io is None or io.memory_tier is None:
            return
        failed = None
        for p, r in self._persists:
            try:
                r.wait()
            except Exception as e:  # noqa: BLE001
                failed = failed or e
        self._prune(trainer, final=True)  # every persist is done now: the two newest are kept, as during the run
        _prune_preempted(trainer, below=_newest_step_committed_since(trainer))
        self._persists = []
        tier, io.memory_tier = io.memory_tier, None
        tier.close(remove=True)  # the job is finished: free the nodes' memory
        if failed is not None:
            raise failed


__all__ = ["DistCkptMemorySnapshots", "memory_candidate", "memory_job_id", "restore_newest", "tier_for"]
