"""``DistCkptIO``: a Lightning ``CheckpointIO`` writing ckpt_integration directory checkpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from enum import Enum
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import torch.distributed as tdist
from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO

from .. import serialization
from ..checkpoints import save_base
from ..errors import CheckpointingException
from ..execution import dist
from ..execution.async_save import SNAPSHOT_MODES, AsyncCallsQueue, async_save_torch_dist
from ..execution.shared_metadata import open_shared
from ..optimizer import is_optimizer_state_key, load_optimizer_state
from ..storage import checkpoint_dir as ckdir
from ..storage.filesystem import canonical, is_remote, storage_for
from ..storage.opened import OpenedCheckpoint, opened
from ..strategies import LoadStrategy

logger = logging.getLogger(__name__)

#: key of the marker our strategies put into the state they hand to the plugin
MARKER = "_ckpt_integration_lightning"
LOAD_STRATEGIES = serialization.LOAD_STRATEGIES


class UnsupportedStrategyError(ValueError):
    """``DistCkptIO`` was combined with a strategy that would bypass it or save on rank 0 only."""


def _plain(value: Any) -> Any:
    """An Enum member's value, anything else as given.

    Hydra's structured configs (:mod:`ckpt_integration.hydra_config`) hand over Enum members;
    plain strings are kept from here on (messages, metadata, the async worker).
    """
    return value.value if isinstance(value, Enum) else value


_MEMORY_KEYS = ("every_n_train_steps", "replicas", "dir", "job_id", "ranks_per_node", "persist_every_n", "sigterm_grace_s")


def _memory_options(memory: Any) -> Dict[str, Any]:
    """``DistCkptIO(memory=...)`` as a plain dict (a dict, a Hydra DictConfig or a dataclass)."""
    if dataclasses.is_dataclass(memory) and not isinstance(memory, type):
        memory = dataclasses.asdict(memory)
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(memory, DictConfig):
            memory = OmegaConf.to_container(memory, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    memory = dict(memory)
    unknown = sorted(set(memory) - set(_MEMORY_KEYS))
    if unknown:
        raise ValueError(f"DistCkptIO: unknown memory option(s) {unknown}; known: {list(_MEMORY_KEYS)}")
    return memory


def _omegaconf_globals() -> List[Any]:
    """What a pickled OmegaConf container is made of (Hydra's ``save_hyperparameters(cfg)``): the containers,
    their metadata and value nodes, and the types that metadata names. Data classes and types only: nothing
    here runs code when unpickled. (The containers alone were refused: ``ContainerMetadata``, then ``typing.Any``,
    then ``dict``; a structured config's own classes still need ``allowed_globals``.)"""
    try:
        from omegaconf import DictConfig, ListConfig, nodes
        from omegaconf.base import ContainerMetadata, Metadata
    except ImportError:  # pragma: no cover
        return []
    import collections
    import typing

    value_nodes = [getattr(nodes, n) for n in ("AnyNode", "BooleanNode", "BytesNode", "EnumNode", "FloatNode",
                                               "IntegerNode", "PathNode", "StringNode") if hasattr(nodes, n)]
    return [DictConfig, ListConfig, ContainerMetadata, Metadata, *value_nodes, typing.Any, collections.defaultdict,
            dict, list, tuple, int, float, str, bool, bytes]


class DistCkptIO(CheckpointIO):
    """Lightning ``CheckpointIO`` plugin saving sharded, reshardable directory checkpoints.

    ``Trainer(plugins=[DistCkptIO()])`` is enough: when Lightning connects the plugin to its strategy,
    a stock ``SingleDeviceStrategy`` (``"auto"`` on one device, ``"single_device"``), ``DDPStrategy``
    (``"auto"`` on several devices, ``"ddp"``, ``"ddp_spawn"``, ``"ddp_fork"``) or
    ``ModelParallelStrategy`` becomes its DistCkpt variant (:mod:`ckpt_integration.lightning.connect`),
    so every rank saves its part. ``DistCkptDDPStrategy(tensor_parallel_size=...)``,
    ``DistCkptModelParallelStrategy(...)`` and ``DistCkptSingleDeviceStrategy()`` can be given directly.
    Other strategies (FSDP1, DeepSpeed, subclasses of the stock ones) raise
    :class:`UnsupportedStrategyError` at ``Trainer(...)`` saying what to use instead.

    Args:
        async_save: write in the background (training continues after staging);
            finalized by :class:`DistCkptAsyncFinalizer` (added automatically) and at teardown.
        load_strategy: ``"auto"`` (default), ``"read_once"``, ``"local"``, ``"fully_parallel"`` or ``"two_stage"`` (see docs/strategies.md).
        thread_count: I/O threads per rank for save and load.
        backend: sharded backend, ``"torch_dist"`` (default) or ``"zarr"``.
        max_in_flight: async saves in flight at once (older ones are waited for).
        trusted: allow arbitrary pickled objects on load (only for trusted checkpoints).
        verify_state: every resume proves that the loaded state (weights, optimizer state,
            resharded or not, from storage or from memory) equals what was saved, position by
            position, with the fingerprints recorded at save (``ci.load(..., verify_state=True)``;
            docs/reliability.md); about one extra pass over the loaded bytes. Default on.
        allowed_globals: extra classes allowed in the common state on load.
        durable: fsync before commit.
        balance: spread writes of replicated tensors over DP replicas (fully-parallel save).
        memory_every_n_train_steps: take a snapshot of the whole training state in host shared
            memory every N optimizer steps (:class:`ckpt_integration.MemoryCheckpoints`; see
            docs/memory.md). ``trainer.fit(ckpt_path="last")`` then resumes from the newest of the
            memory tier and the durable checkpoints; a SIGTERM makes the newest snapshot durable;
            the snapshots are removed when ``fit`` finishes.
        memory_replicas: copies of each rank's snapshot on distinct nodes (its own included).
        memory_dir: the node's shared-memory directory (default ``/dev/shm/ckpt_integration``).
        memory_job_id: the job's name in ``memory_dir`` (default: derived from the trainer's
            ``default_root_dir``, so a restarted job finds its snapshots).
        memory_ranks_per_node: ranks per node (default ``LOCAL_WORLD_SIZE``, else Lightning's
            devices per node).
        memory_persist_every_n: also write every M-th snapshot as a durable checkpoint
            (``memory-step=<step>.ckpt`` next to ``ModelCheckpoint``'s, the two newest kept),
            in the background, from the snapshot.
        memory_sigterm_grace_s: on SIGTERM, how long to wait for the newest snapshot to become
            durable (``preempted-step=<step>.ckpt``) before the process exits anyway (default: what is
            left of ``sigterm_grace_s``).
        sigterm_grace_s: after a SIGTERM (a scheduler's preemption notice), the longest the plugin
            takes before the process may exit: the async save in flight is committed if it completes
            within it, otherwise it is abandoned (its writes stop, nothing is committed there, what it
            wrote is removed, earlier checkpoints and top-k bookkeeping stay as they were). Counted
            from the signal; choose it below the scheduler's own grace before SIGKILL (SLURM's
            ``KillWait``, Kubernetes' ``terminationGracePeriodSeconds``, torchrun's 30 s), which is
            why the default is 25 s. ``None`` waits for the save however long it takes. See
            docs/lightning.md, "Preemption".
        incremental: each save is incremental against the newest committed checkpoint in its
            directory (``ModelCheckpoint``'s ``dirpath``): data files whose every item is unchanged
            are hard-linked (server-side copied on object stores) instead of written, and frozen
            parameters (``requires_grad=False``) are kept in files of their own, so a fine-tuning
            run writes its frozen base once (docs/incremental.md). torch_dist only. Default on.
        staging_budget: with ``async_save``, the most bytes of tensor data an async save stages in
            host memory (the rest in waves, written before the save returns; see
            ``ci.save(staging_budget=...)``). Default: the whole state, refused with a message naming
            the bytes needed when it cannot fit in the host memory available.
        snapshot: with ``async_save``, when large tensors are copied: ``"background"`` (while training
            goes on; the next optimizer step waits for the copy) or ``"caller"`` (before the save
            returns). A model that changes a large buffer in place in ``forward`` (a MoCo-style
            queue) needs ``"caller"``: in the background its save fails with ``SnapshotModifiedError``.
        memory: the ``memory_*`` options as one mapping without the prefix (``{"every_n_train_steps":
            10, "replicas": 2}``): what Hydra's ``checkpoint.memory.*`` group passes.
    """

    def __init__(
        self,
        async_save: bool = False,
        load_strategy: Union[str, LoadStrategy] = "auto",
        thread_count: int = 2,
        backend: str = "torch_dist",
        max_in_flight: int = 1,
        trusted: bool = False,
        allowed_globals: Optional[List[Any]] = None,
        durable: bool = True,
        balance: bool = True,
        validate_access_integrity: bool = True,
        memory_every_n_train_steps: Optional[int] = None,
        memory_replicas: int = 2,
        memory_dir: Optional[str] = None,
        memory_job_id: Optional[str] = None,
        memory_ranks_per_node: Optional[int] = None,
        memory_persist_every_n: Optional[int] = None,
        memory_sigterm_grace_s: Optional[float] = None,
        memory: Optional[Any] = None,
        sigterm_grace_s: Optional[float] = 25.0,
        verify_state: bool = True,
        incremental: bool = True,
        staging_budget: Optional[int] = None,
        snapshot: str = "background",
    ):
        if memory is not None:
            given = _memory_options(memory)
            memory_every_n_train_steps = given.get("every_n_train_steps", memory_every_n_train_steps)
            memory_replicas = given.get("replicas", memory_replicas)
            memory_dir = given.get("dir", memory_dir)
            memory_job_id = given.get("job_id", memory_job_id)
            memory_ranks_per_node = given.get("ranks_per_node", memory_ranks_per_node)
            memory_persist_every_n = given.get("persist_every_n", memory_persist_every_n)
            memory_sigterm_grace_s = given.get("sigterm_grace_s", memory_sigterm_grace_s)
        load_strategy, backend = LoadStrategy.parse(load_strategy, "DistCkptIO: ").value, _plain(backend)
        if backend not in ckdir.SUPPORTED_BACKENDS:
            raise ValueError(f"DistCkptIO: unknown backend {backend!r}; supported: {sorted(ckdir.SUPPORTED_BACKENDS)}")
        if thread_count < 1 or max_in_flight < 1:
            raise ValueError("DistCkptIO: thread_count and max_in_flight must be >= 1")
        self.async_save = bool(async_save)
        self.load_strategy = load_strategy
        self.thread_count = int(thread_count)
        self.backend = backend
        self.max_in_flight = int(max_in_flight)
        self.trusted = trusted
        self.allowed_globals = list(allowed_globals or [])
        self.durable = durable
        self.balance = balance
        self.validate_access_integrity = validate_access_integrity
        self.verify_state = bool(verify_state)
        self.incremental = bool(incremental)
        if staging_budget is not None and int(staging_budget) < 1:
            raise ValueError(f"DistCkptIO: staging_budget must be >= 1 byte (or None), got {staging_budget}")
        self.staging_budget = None if staging_budget is None else int(staging_budget)
        if self.staging_budget is not None and backend != "torch_dist":
            raise ValueError(f"DistCkptIO: staging_budget is supported by the torch_dist backend only, not {backend!r}")
        if _plain(snapshot) not in SNAPSHOT_MODES:
            raise ValueError(f"DistCkptIO: snapshot must be one of {SNAPSHOT_MODES}, got {snapshot!r}")
        self.snapshot = str(_plain(snapshot))
        self._queue: Any = None
        self._requests: List[Any] = []
        # path -> the saves in flight when its removal was asked (the one that replaced it among them)
        self._deferred_removals: Dict[str, List[Any]] = {}
        self._check_group: Any = None
        self.save_fn: Callable[..., Any] = start_async_save
        for name, v in (("memory_every_n_train_steps", memory_every_n_train_steps),
                        ("memory_persist_every_n", memory_persist_every_n)):
            if v is not None and int(v) < 1:
                raise ValueError(f"DistCkptIO: {name} must be >= 1 (or None), got {v}")
        if int(memory_replicas) < 1:
            raise ValueError(f"DistCkptIO: memory_replicas must be >= 1, got {memory_replicas}")
        self.memory_every_n_train_steps = None if memory_every_n_train_steps is None else int(memory_every_n_train_steps)
        self.memory_replicas = int(memory_replicas)
        self.memory_dir = memory_dir
        self.memory_job_id = memory_job_id
        self.memory_ranks_per_node = memory_ranks_per_node
        self.memory_persist_every_n = None if memory_persist_every_n is None else int(memory_persist_every_n)
        self.memory_sigterm_grace_s = None if memory_sigterm_grace_s is None else float(memory_sigterm_grace_s)
        if sigterm_grace_s is not None and float(sigterm_grace_s) < 0:
            raise ValueError(f"DistCkptIO: sigterm_grace_s must be >= 0 (or None), got {sigterm_grace_s}")
        self.sigterm_grace_s = None if sigterm_grace_s is None else float(sigterm_grace_s)
        self.preempted_at: Optional[float] = None  # time.monotonic() of the first SIGTERM (DistCkptPreemption)
        self._grace_timer: Optional[threading.Timer] = None
        self.memory_tier: Any = None  # the MemoryCheckpoints, made collectively when first needed
        self._memory_last_requested = False  # set while resolving ckpt_path="last"

    def note_preemption(self, at: Optional[float] = None) -> None:
        """Start the grace period (the first SIGTERM's time; later ones do not extend it).

        Safe in a signal handler. When the grace period is bounded, a timer abandons the async
        saves still running shortly before it ends (:meth:`_abandon_in_flight`), wherever the
        training thread is then (it may itself be waiting for such a save to make room).
        """
        if self.preempted_at is not None:
            return
        self.preempted_at = time.monotonic() if at is None else at
        if self.sigterm_grace_s is not None:
            delay = max(0.0, self.preempted_at + self.sigterm_grace_s - self._grace_reserve() - time.monotonic())
            self._grace_timer = threading.Timer(delay, self._abandon_in_flight)
            self._grace_timer.name = "ckpt-sigterm-grace"
            self._grace_timer.daemon = True
            self._grace_timer.start()

    def _grace_reserve(self) -> float:
        """The end of the grace period kept for stopping, agreeing and cleaning up an abandoned save."""
        return min(5.0, 0.2 * (self.sigterm_grace_s or 0.0))

    def _abandon_in_flight(self) -> None:
        queue = self._queue
        if queue is not None and not queue._closed:
            queue.abandon(f"preempted: not finished within sigterm_grace_s={self.sigterm_grace_s:g}s of the SIGTERM",
                          wait_s=max(0.5, self._grace_reserve()))

    def grace_left(self, cap: Optional[float] = None) -> Optional[float]:
        """Seconds left of ``sigterm_grace_s`` since the SIGTERM (``cap`` if smaller); ``None``: no
        bound (no SIGTERM, or ``sigterm_grace_s=None``, and no ``cap``)."""
        left = None
        if self.preempted_at is not None and self.sigterm_grace_s is not None:
            left = max(0.0, self.preempted_at + self.sigterm_grace_s - time.monotonic())
        if cap is not None:
            left = cap if left is None else min(left, cap)
        return left

    @property
    def memory_enabled(self) -> bool:
        """Whether memory snapshots are configured (``memory_every_n_train_steps``)."""
        return self.memory_every_n_train_steps is not None

    # -- low-level API used by the strategies ----------------------------------------------------
    def load_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of this plugin's loads (``allowed_globals`` with Lightning's and
        OmegaConf's containers, ``trusted``, strategy options), for the strategies and Fabric."""
        return dict(**self.read_kwargs(), thread_count=self.thread_count, load_strategy=self.load_strategy,
                    verify_state=self.verify_state)

    def read_kwargs(self) -> Dict[str, Any]:
        """``trusted`` and ``allowed_globals`` (with Lightning's and OmegaConf's containers) of this plugin's loads:
        what every read of a checkpoint's common state takes (content metadata, callback states, run records)."""
        from lightning.fabric.utilities.data import AttributeDict

        return dict(trusted=self.trusted, allowed_globals=[AttributeDict, *self.allowed_globals, *_omegaconf_globals()])

    def save_sharded(self, state: Dict[str, Any], path: str, content_metadata: Optional[dict] = None) -> None:
        """Save a sharded state dict (collective); async if configured."""
        kwargs = dict(thread_count=self.thread_count, balance=self.balance, overwrite=True, durable=self.durable,
                      validate_access_integrity=self.validate_access_integrity, content_metadata=content_metadata)
        path = os.fspath(path)
        if self.incremental and self.backend == "torch_dist":
            kwargs["base"] = save_base("auto", path)
        self._deferred_removals.pop(path, None)
        if not self.async_save:
            serialization.save(state, path, sharded_strategy=self.backend, **kwargs)
            return
        if self._queue is None:
            self._queue = AsyncCallsQueue(max_in_flight=self.max_in_flight)
        self.ensure_check_group()
        self.wait_if_saving(path)  # (max_in_flight > 1) the same path again: after the save still writing it
        if not self._make_room(path):
            return
        self._run_removals_due()  # (the saves before it may have committed while it waited)
        extra = {"staging_budget": self.staging_budget} if self.staging_budget is not None else {}
        extra["snapshot"] = self.snapshot
        req = self.save_fn(state, path, self._queue, {**kwargs, "backend": self.backend, **extra})
        self._requests.append(req)

    def _make_room(self, path: str) -> bool:
        """Wait for room in the queue (``max_in_flight``) as the save would. The earlier save's failure is
        raised, except after a SIGTERM (which may arrive during this wait): then the grace period may have
        abandoned it; that is logged and this save is not started. Every rank decides alike, since a
        save's outcome is agreed by its commit."""
        try:
            self._queue._make_room()
        except CheckpointingException as e:
            if self.preempted_at is None:
                raise
            self._deferred_removals.clear()
            logger.error("SIGTERM: not starting the save to %s: the save before it was not committed (%s)", path, e)
            return False
        return True

    @contextlib.contextmanager
    def opened_for_load(self, path: Any) -> Iterator[OpenedCheckpoint]:
        """``path`` opened once for a resume (collective: the coordinator reads ``metadata.json``, the
        manifest and ``.metadata``, every rank gets them in one broadcast); the content metadata,
        the state and every optimizer are then read from that one commit. An opened checkpoint
        given is used as it is."""
        if isinstance(path, OpenedCheckpoint):
            yield path
            return
        self.wait_if_saving(path)
        ck, _ = open_shared(os.fspath(path), None, self.trusted)
        try:
            yield ck
        finally:
            ck.close()

    def load_sharded(self, request: Dict[str, Any], path: Any, **overrides: Any) -> Dict[str, Any]:
        """Load ``request`` (collective) with this plugin's load strategy and safety settings."""
        kwargs = {**self.load_kwargs(), **overrides}
        return serialization.load(request, path, **kwargs)  # (a path or an opened checkpoint)

    def load_optimizer(self, optimizer: Any, model_sd: Dict[str, Any], path: str, prefix: str, module: Any = None) -> None:
        """Load one optimizer's state resharded for the current layout (collective)."""
        load_optimizer_state(optimizer, model_sd, path, prefix=prefix, module=module, **self.load_kwargs())

    # -- async bookkeeping -----------------------------------------------------------------------
    def ensure_check_group(self) -> Any:
        # A private gloo group of the library (not registered with torch: closed in teardown(),
        # nothing left for the interpreter's teardown). Not the queue's own: the queue's worker
        # runs the commit's collectives on that one concurrently with this check. Collective the
        # first time (every rank calls it at the same point: a save, a batch end).
        if self._check_group is None and tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
            self._check_group = dist.new_private_group(None)
        return self._check_group

    def wait_if_saving(self, path: Any, follow_links: bool = True) -> None:
        """A load of a checkpoint this job's async save is still writing waits for its commit (and
        raises its failure) instead of refusing an incomplete checkpoint. Every rank loads alike."""
        if self.saving(path, follow_links):
            self.maybe_finalize(blocking=True, collective=False)

    def saving(self, path: Any, follow_links: bool = True) -> bool:
        """True while an async save of this plugin to ``path`` is not finalized (this rank); with
        ``follow_links``, also when ``path`` is a symbolic link to it (``last.ckpt`` of ``save_last="link"``)."""
        if not self._requests:
            return False
        p = canonical(os.fspath(path))
        if is_remote(p) or not follow_links:
            return any(canonical(r.description) == p for r in self._requests)
        p = os.path.realpath(p)
        return any(os.path.realpath(canonical(r.description)) == p for r in self._requests)

    @property
    def num_unfinalized(self) -> int:
        """Async saves started and not yet finalized on this rank."""
        return len(self._requests)

    def maybe_finalize(self, blocking: bool = False, collective: bool = True) -> int:
        """Finalize finished async saves; returns how many were finalized.

        ``collective=True`` (call it at a point every rank reaches with the same saves
        started, e.g. a callback hook) finalizes only when *every* rank's saves are done
        (a tiny all-reduce, made only while saves are pending), so a failure is raised on
        all ranks at the same step. ``blocking=True`` waits for all of them.
        """
        if not self._requests:
            self._run_deferred_removals()
            return 0
        if blocking:
            done = True
        else:
            done = all(r.is_done() for r in self._requests)
            if collective and self._check_group is not None:
                done = dist.all_reduce_ints([0 if done else 1], "max", self._check_group)[0] == 0
        if not done:
            self._run_removals_due()
            return 0
        reqs, self._requests = self._requests, []
        first: Optional[BaseException] = None
        for r in reqs:
            try:
                r.wait()
            except BaseException as e:  # noqa: BLE001
                first = first or e
        if self._queue is not None:
            try:
                self._queue.maybe_finalize_async_calls(blocking=True)
            except BaseException as e:  # noqa: BLE001
                first = first or e
        if first is not None:
            self._deferred_removals.clear()  # keep older checkpoints when the newer one failed
            if self.preempted_at is not None:  # going down for the preemption: say it, do not crash the exit
                logger.error("SIGTERM: an async save was not committed: %s", first)
                return len(reqs)
            raise first
        self._run_deferred_removals()
        return len(reqs)

    def _run_deferred_removals(self) -> None:
        while self._deferred_removals:
            path = next(iter(self._deferred_removals))
            del self._deferred_removals[path]
            self._remove_now(path)

    def _run_removals_due(self) -> None:
        """The deferred removals whose saves in flight all committed (local: a commit is agreed by every rank).
        Waiting for every save of the job instead kept them while newer saves kept starting: with a save each
        step slower than a step, none was removed until training paused, and a run killed meanwhile left them
        (found by a probe)."""
        for path, waits in list(self._deferred_removals.items()):
            if all(r.is_done() and r.exception() is None for r in waits):
                del self._deferred_removals[path]
                self._remove_now(path)

    # -- Lightning CheckpointIO API --------------------------------------------------------------
    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        """Save a state prepared by a DistCkpt strategy (on every rank)."""
        if storage_options is not None:
            raise TypeError("DistCkptIO.save_checkpoint does not take storage_options")
        if MARKER not in checkpoint:
            if os.path.basename(os.fspath(path)).startswith(".temp"):  # Lightning's spawn launcher hand-off
                return TorchCheckpointIO().save_checkpoint(checkpoint, path)
            raise UnsupportedStrategyError(
                "DistCkptIO.save_checkpoint got a plain Lightning checkpoint: the strategy calling it bypassed the "
                "connection that turns it into a DistCkpt strategy (DistCkptDDPStrategy / DistCkptModelParallelStrategy "
                "/ DistCkptSingleDeviceStrategy), which save on every rank. Pass the strategy to Trainer(strategy=...) "
                "with plugins=[DistCkptIO()]"
            )
        state = dict(checkpoint)
        meta = state.pop(MARKER)
        self.save_sharded(state, os.fspath(path), content_metadata=meta)

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Outside a DistCkpt strategy (one process, e.g. a script inspecting a checkpoint): Lightning's
        checkpoint dict with the common state and ``state_dict`` as whole tensors keyed by their saved
        keys (fused parts stay parts; :func:`ckpt_integration.lightning.load_from_checkpoint` rebuilds
        a module). The DistCkpt strategies load through :meth:`load_sharded` instead."""
        if not isinstance(path, OpenedCheckpoint):
            path = os.fspath(path)
            if os.path.isfile(path) and os.path.basename(path).startswith(".temp"):
                return TorchCheckpointIO().load_checkpoint(path, map_location=map_location)
            self.wait_if_saving(path)
        with opened(path, self.trusted, verified=True) as ck:  # both reads below are of one commit
            common = dict(serialization.load_common_state_dict(ck, **self.read_kwargs()))
            tensors = serialization.load_plain_tensors(ck, trusted=self.trusted, verify_state=self.verify_state)
        common["state_dict"] = {k: v for k, v in tensors.items() if not is_optimizer_state_key(k)}
        return common

    def remove_checkpoint(self, path: Any) -> None:
        """Remove a checkpoint directory; deferred while an async save is in flight."""
        path = storage_for(path)[1]  # (absolute: a deferred removal must not follow a later chdir)
        if self._requests:
            self._deferred_removals.setdefault(path, list(self._requests))
            return
        self._remove_now(path)

    @staticmethod
    def _remove_now(path: str) -> None:
        """Delete a checkpoint directory (or file), locally or through fsspec (``s3://``, ``memory://`` ...)."""
        storage, p = storage_for(path)
        if not storage.remote and os.path.islink(p):  # ``save_last="link"``: drop the link, not its target
            os.remove(p)
        elif storage.exists(p):
            storage.remove_any(p)

    def teardown(self) -> None:
        """Wait for and finalize every async save (raises a failed one), then stop the worker.

        After a SIGTERM the wait is bounded by what is left of ``sigterm_grace_s``: a save that
        cannot commit in time is abandoned, and its outcome is logged, not raised (the process
        is exiting for the preemption; the earlier checkpoints are what a restart resumes from).
        """
        left = self.grace_left()
        timer, self._grace_timer = self._grace_timer, None
        if timer is not None:
            timer.cancel()
        try:
            if left is None:
                self.maybe_finalize(blocking=True, collective=False)
            else:
                self._finish_within(left)
        finally:
            try:
                if self._queue is not None:
                    q, self._queue = self._queue, None
                    q.close()
            finally:
                group, self._check_group = self._check_group, None
                if group is not None:
                    group.close("DistCkptIO.teardown()")
                if self.memory_tier is not None:  # snapshots stay in memory for a restart
                    tier, self.memory_tier = self.memory_tier, None
                    tier.close()

    def _finish_within(self, left: float) -> None:
        """Preempted: commit the saves in flight that finish within ``left`` seconds, abandon the rest."""
        reqs, self._requests = self._requests, []
        queue, self._queue = self._queue, None
        if queue is None:
            self._run_deferred_removals()
            return
        reserve = self._grace_reserve()
        t0 = time.monotonic()
        failed: Optional[BaseException] = None
        try:
            queue.close(timeout=max(0.0, left - reserve), abandon_wait_s=max(0.5, reserve))
        except BaseException as e:  # noqa: BLE001 - logged below; the process is exiting
            failed = e
        for r in reqs:
            exc = r.exception() if r.is_done() else failed
            if exc is None:
                logger.info("SIGTERM: the async save to %s is committed (%.1fs after the notice)", r.description,
                            time.monotonic() - (self.preempted_at or t0))
            else:
                logger.error("SIGTERM: the async save to %s was not committed: %s", r.description, exc)
        if failed is not None or any(r.exception() is not None or not r.is_done() for r in reqs):
            self._deferred_removals.clear()  # keep the checkpoints it would have replaced
            return
        self._run_deferred_removals()


def start_async_save(state: Dict[str, Any], path: str, queue: Any, save_kwargs: Dict[str, Any]) -> Any:
    """The one place async saving goes through: ``ckpt_integration.execution.async_save``.

    Returns a request with ``is_done()`` and ``wait()`` (raises the failure).
    """
    return async_save_torch_dist(state, path, queue=queue, **save_kwargs)
