"""Async save on the torch_dist backend (capability 7).

``async_save_torch_dist`` blocks the caller only for

1. waiting for room (at most ``max_in_flight`` unfinished saves; default 1, so a
   new save first waits for the previous one),
2. ``prepare_save`` (collective, small metadata only) and
3. preparing the snapshot: the staged structure (non-tensor state copied, tensors
   as views of host buffers reused from save to save, :class:`StateDictStager`)
   and the copies of small tensors.

The large tensors are then copied into the buffers by a background thread
**while training goes on** (``snapshot="background"``, the default; see
:mod:`~ckpt_integration.execution.snapshot`): the next ``torch.optim`` optimizer
step waits for that copy by itself, anything else that modifies saved tensors in
place calls :func:`~ckpt_integration.execution.snapshot.wait_for_snapshot` (or
``request.wait_for_snapshot()``) first, and a modification made too early fails
the save loudly instead of writing a torn tensor. ``snapshot="caller"`` copies
everything before returning (the state may then be modified at once).

Writing (``write_local``) and the commit (``finalize_save``) then run on one background worker
thread per queue, saves strictly in order. The commit's collectives use a **dedicated gloo group**
made once per process group, so they never interleave with the training loop's collectives and the
caller never enters a collective to finalize: every rank's worker runs every save it started
(``prepare_save`` was collective, so all ranks did), hence the collectives always match and no rank
hangs because another skipped a "finalize" call. ``wait()``, ``is_done()``,
``wait_for_snapshot()`` and ``maybe_finalize_async_calls()`` are purely local.

That group is the library's own (:class:`~.dist.PrivateGroup`), outside
``torch.distributed``'s registry: a script may call ``destroy_process_group()`` right
after starting an async save and exit, and the save still completes and commits
(``close()`` of the queue, or the exit handler, waits for it on every rank, then closes the
group before the interpreter tears down, so no thread is left in a collective). **The rule:**
every rank must let its async saves finish - ``request.wait()``, ``queue.close()`` or a
normal interpreter exit. A rank that is killed or leaves with ``os._exit`` abandons the
save: the other ranks' commit fails with :class:`~ckpt_integration.errors.AsyncSaveAbandonedError`
naming the path, nothing is committed there and earlier checkpoints stay as they were. At
exit the wait is bounded by ``CKPT_INTEGRATION_EXIT_TIMEOUT`` seconds (default 600).

Errors: a failure on any rank (snapshot, write, commit) makes ``finalize_save`` fail on every
rank and commit nothing (no ``metadata.json``); it is raised from ``wait()`` / ``finalize()``, the
next save or ``schedule_async_request`` on the queue (waiting for room), ``maybe_finalize_async_calls``
once the save is done and ``close()`` (once: not again after ``wait()``), on all ranks at one call.

Example (every rank)::

    queue = AsyncCallsQueue()
    for step in range(...):
        loss = model(batch).sum(); loss.backward()  # overlaps the last save's snapshot
        optimizer.step()                             # waits for that snapshot if needed
        if step % 100 == 0:
            async_save_torch_dist(model_sharded_sd, f"ckpt/iter_{step}", queue=queue)
        queue.maybe_finalize_async_calls(blocking=False)   # local, no collective
    queue.close()                                           # waits; raises a failed save
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread as _executors
import logging
import os
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple, Type

import torch
import weakref

from ..errors import AsyncSaveAbandonedError, CheckpointingException, PeerLostError
from . import dist
from .dist import Group, describe_error as _describe
from .save import SavePlan, cleanup_failed, finalize_save, prepare_save, write_local
from .async_request import AsyncRequest
from .snapshot import Snapshot, common_tensor_names, maybe_remove_hook, wait_for_snapshot
from .staging import StateDictStager
from .staging_budget import StagingArena, StagingReport, check_fits, write_in_waves

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncRequest",
    "AsyncCallsQueue",
    "async_save_torch_dist",
    "get_default_async_queue",
    "wait_for_snapshot",
]

SNAPSHOT_MODES = ("background", "caller")
DEFAULT_COPY_NOW_BYTES = 1 << 18  # smaller storages are copied before the save returns
DEFAULT_WRITER_NICE = 10  # CPU weight about 1/10 of the training thread's when they compete
EXIT_TIMEOUT_ENV = "CKPT_INTEGRATION_EXIT_TIMEOUT"
DEFAULT_EXIT_TIMEOUT_S = 600.0


def _lower_thread_priority(increment: int) -> None:
    """Raise the calling thread's nice value (Linux: per thread, inherited by threads it starts)."""
    if increment <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except OSError as e:  # never fatal: the save works at any priority
        logger.debug("could not lower the async writer's priority: %s", e)

class AsyncCallsQueue:
    """Runs :class:`AsyncRequest` s one after another on a background thread.

    Args:
        max_in_flight: most requests scheduled and not yet finalized; scheduling
            one more first waits for (and finalizes) the oldest. Default 1.
        pin_memory: pin staging buffers (default: when CUDA is available).
        snapshot: default of :func:`async_save_torch_dist`'s ``snapshot``:
            ``"background"`` (copy the tensors while training goes on) or
            ``"caller"`` (copy everything before the save returns).
        copy_now_bytes: storages smaller than this are copied before the save
            returns even in ``"background"`` mode (state that forward passes modify,
            like BatchNorm statistics, is small and changes without a version bump).
        writer_nice: added to the nice value of the writer thread and the write
            threads it starts (Linux; 0 keeps the priority). Where cores are scarce
            the training thread then wins them, and the write, which has until the
            next save, takes what is left (the snapshot copy, which the next
            optimizer step may wait for, keeps its priority).

    Holds one :class:`StateDictStager` per in-flight slot, so host buffers are
    allocated by the first saves and reused afterwards (``stagers[i].stats``).
    Use as a context manager or call :meth:`close` at teardown.
    """

    def __init__(
        self,
        max_in_flight: int = 1,
        *,
        pin_memory: Optional[bool] = None,
        snapshot: str = "background",
        copy_now_bytes: int = DEFAULT_COPY_NOW_BYTES,
        writer_nice: int = DEFAULT_WRITER_NICE,
    ):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if snapshot not in SNAPSHOT_MODES:
            raise ValueError(f"snapshot must be one of {SNAPSHOT_MODES}, got {snapshot!r}")
        self.max_in_flight = int(max_in_flight)
        self.snapshot = snapshot
        self.copy_now_bytes, self.writer_nice = int(copy_now_bytes), int(writer_nice)
        learned: set = set()  # (slots share what they learn: a save fails once, not once per slot)
        self.stagers = [StateDictStager(pin_memory, copy_now=learned) for _ in range(self.max_in_flight)]
        self._unfinalized: Deque[AsyncRequest] = deque()
        self._jobs: Deque[Optional[AsyncRequest]] = deque()
        self._cv = threading.Condition()
        # scheduling (room, a stager slot, staging, submit) and finalizing, one thread at a time: two
        # threads saving on one queue took the same slot and staged into each other's buffers
        self._schedule_lock = threading.RLock()
        self._worker: Optional[threading.Thread] = None
        self._next_idx = 0
        self._closed = False
        self._groups: Dict[int, Tuple[Any, Any]] = {}  # id(process group) -> (that group, its private group)
        self._abandoned_at: Optional[float] = None  # time.monotonic() of the first abandon()
        _queues.add(self)

    # -- worker ------------------------------------------------------------------------
    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._loop, name="ckpt-async-save", daemon=True)
            self._worker.start()

    def _loop(self) -> None:
        _lower_thread_priority(self.writer_nice)
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                req = self._jobs.popleft()
            if req is None:
                return
            req._run()

    # -- scheduling --------------------------------------------------------------------
    def _finalize_oldest(self) -> AsyncRequest:
        with self._schedule_lock:
            req = self._unfinalized[0]
            try:
                if not req._reported:  # a failure already raised by req.wait() is not raised again
                    req.finalize()  # counts as in flight while we wait for it
            finally:
                if self._unfinalized and self._unfinalized[0] is req:
                    self._unfinalized.popleft()
            return req

    def _make_room(self, slots: int = 1) -> None:
        while len(self._unfinalized) > self.max_in_flight - slots:
            self._finalize_oldest()

    def _next_stager(self) -> StateDictStager:
        return self.stagers[self._next_idx % self.max_in_flight]

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start ``async_request`` in the background; returns its call index.

        Waits first for the oldest request if ``max_in_flight`` are unfinalized
        (raising its error, if it failed; the new request is then not scheduled).
        A request that is already scheduled (``save(..., async_sharded_save=True)``
        schedules its own on the default queue; Megatron-Core code schedules it again on its own)
        keeps its index and is tracked here too: this queue's ``maybe_finalize_async_calls`` and
        ``close`` wait for it and run its finalize functions (once, whichever queue comes first).
        """
        if async_request.call_idx is not None:
            with self._schedule_lock:
                if not async_request._finalized and all(r is not async_request for r in self._unfinalized):
                    self._unfinalized.append(async_request)
            return async_request.call_idx
        if self._closed:
            raise RuntimeError("AsyncCallsQueue is closed")
        with self._schedule_lock:
            self._make_room()
            return self._submit(async_request)

    def _submit(self, req: AsyncRequest) -> int:
        req.call_idx = self._next_idx
        self._next_idx += 1
        self._unfinalized.append(req)
        self._ensure_worker()
        with self._cv:
            self._jobs.append(req)
            self._cv.notify()
        return req.call_idx

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = True) -> List[int]:
        """Finalize the requests that are done, oldest first; return their call indices.

        ``blocking=True`` waits for all of them. Local (no collectives) in both
        modes, so ranks may call it at different points. Raises the first failure
        met (that request is dropped from the queue; later ones stay queued).
        ``no_dist`` is accepted for Megatron-Core compatibility.
        """
        for req in list(self._unfinalized):  # check finished snapshots from this thread (exact)
            if req.snapshot is not None and req.snapshot.copied():
                req.snapshot.wait(0)
        done: List[int] = []
        with self._schedule_lock:
            while self._unfinalized and (blocking or self._unfinalized[0].is_done()):
                done.append(self._finalize_oldest().call_idx)
        maybe_remove_hook()
        return done

    def wait_for_snapshot(self, timeout: Optional[float] = None) -> bool:
        """Block until the snapshots of this queue's saves are complete (not their writes); local."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for req in list(self._unfinalized):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not req.wait_for_snapshot(left):
                return False
        return True

    def get_num_unfinalized_calls(self) -> int:
        """Requests scheduled and not yet finalized."""
        return len(self._unfinalized)

    def close(self, timeout: Optional[float] = None, abandon_wait_s: float = 5.0) -> None:
        """Wait for and finalize every request, stop the worker; raise the first failure.

        ``timeout`` bounds the wait (a preemption's grace period): saves still running after
        ``timeout`` seconds are abandoned (:meth:`abandon`, which may take ``abandon_wait_s`` more)
        and raise :class:`AsyncSaveAbandonedError`; nothing is committed for them and earlier
        checkpoints are untouched. Every rank should close with the same bound, as every rank
        takes part in each commit. ``None`` waits as long as the saves take.
        """
        stuck: List[AsyncRequest] = []
        if timeout is not None and not self._idle(timeout):
            self.abandon(f"still running {timeout:.0f}s after the queue was closed with a time limit",
                         wait_s=abandon_wait_s)
            stuck = [r for r in self._unfinalized if not r.is_done()]
            for r in stuck:  # a write blocked in the filesystem: leave it to the (daemon) worker
                self._unfinalized.remove(r)
        first: Optional[BaseException] = None
        if stuck:
            since = time.monotonic() - (self._abandoned_at or time.monotonic())
            first = AsyncSaveAbandonedError(
                f"the async save(s) to {', '.join(r.description for r in stuck)} had not ended "
                f"{since:.0f}s after being abandoned (a write blocked in the filesystem); nothing is committed "
                "there, a directory may be left behind without metadata.json (never loaded as a checkpoint)"
            )
        while self._unfinalized:
            req = self._unfinalized[0]
            try:
                self._finalize_oldest()
            except BaseException as e:  # noqa: BLE001
                if first is None:
                    first = e
                else:
                    logger.error("async save %s also failed: %s", req.description, _describe(e))
        maybe_remove_hook()
        if not self._closed:
            self._closed = True
            if self._worker is not None:
                with self._cv:
                    self._jobs.append(None)
                    self._cv.notify()
                self._worker.join(None if not stuck else 1.0)
            self._close_groups("the async queue was closed")
        if first is not None:
            raise first

    def abandon(self, reason: str, wait_s: float = 5.0) -> bool:
        """Abandon every save of this queue that is still running (see :meth:`AsyncRequest.cancel`).

        Each one's write stops before its next item and its commit fails on every rank, so
        nothing is committed, rank 0 removes what was written and earlier checkpoints stay as
        they were. When some save has not ended ``wait_s`` seconds later (a write blocked in the
        filesystem, or another rank that does not take part), the queue's process groups are
        aborted so no commit can wait on them any longer. Returns ``True`` if every save ended
        within ``wait_s``. Local; call it on every rank (e.g. all ranks' grace periods end).
        """
        if self._abandoned_at is None:
            self._abandoned_at = time.monotonic()
        for req in list(self._unfinalized):
            first = not req.cancelled
            if req.cancel(reason) and first:
                logger.warning("abandoning the async save to %s: %s", req.description, reason)
        if self._idle(wait_s):
            return True
        for _, g in self._groups.values():
            if isinstance(g, dist.PrivateGroup):
                g.abort(f"async saves abandoned ({reason})")
        return self._idle(1.0)

    def _close_groups(self, reason: str) -> None:
        groups, self._groups = self._groups, {}
        for _, g in groups.values():
            if isinstance(g, dist.PrivateGroup):
                g.close(reason)

    def _idle(self, timeout: float) -> bool:
        """Wait until every scheduled request's background work has ended; False on timeout."""
        deadline = time.monotonic() + timeout
        for req in list(self._unfinalized):
            if not req._event.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def _close_at_exit(self, timeout: float) -> None:
        """The exit handler's part: let the saves in flight finish (on every rank they do, since
        every rank's handler waits), then close. After ``timeout`` the queue's groups are aborted,
        so the worker's collective fails (the save is abandoned and reported) instead of leaving a
        thread inside a collective while the interpreter tears down."""
        if self._closed:
            return
        if not self._idle(timeout):
            self.abandon(f"interpreter exit: still running after {timeout:.0f}s ({EXIT_TIMEOUT_ENV})")
        if any(not r.is_done() for r in self._unfinalized):
            self.close(timeout=0.0, abandon_wait_s=0.0)  # what did not end is left to its daemon thread
        else:
            self.close()

    def __enter__(self) -> "AsyncCallsQueue":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:  # do not hide the original error
            try:
                self.close()
            except BaseException as e:  # noqa: BLE001
                logger.error("async save failed during teardown: %s", _describe(e))

    # -- groups ------------------------------------------------------------------------
    def private_group(self, process_group: Group = None) -> Any:
        """The queue's own gloo group with the members of ``process_group`` (made once, collectively
        over them; ``process_group`` itself without ``torch.distributed``). Commits of this queue's
        saves run on it; it stays usable after ``destroy_process_group()`` until :meth:`close`."""
        if not dist.is_distributed():
            return process_group
        # keyed by the process group object itself (held, so its id cannot be reused): after
        # destroy_process_group() and a new init_process_group(), the default group is a new
        # object, maybe of another world, and gets a private group of its own
        owner = process_group if process_group is not None else torch.distributed.group.WORLD
        key = id(owner)
        held, group = self._groups.get(key, (None, None))
        if held is not owner:
            group = dist.new_private_group(process_group)
            self._groups[key] = (owner, group)
        return group



_default_queue: Optional[AsyncCallsQueue] = None
_default_lock = threading.Lock()
_queues: "weakref.WeakSet[AsyncCallsQueue]" = weakref.WeakSet()


def get_default_async_queue() -> AsyncCallsQueue:
    """The process-wide queue used when ``queue`` is not given (closed at exit)."""
    global _default_queue
    with _default_lock:
        if _default_queue is None or _default_queue._closed:
            _default_queue = AsyncCallsQueue()
        return _default_queue


def _exit_timeout() -> float:
    try:
        return float(os.environ.get(EXIT_TIMEOUT_ENV, DEFAULT_EXIT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_EXIT_TIMEOUT_S


def register_exit_hook(fn: Callable[[], Any]) -> None:
    """Run ``fn`` at interpreter exit *before* ``concurrent.futures`` shuts its executors down.

    Python stops accepting work in every ``ThreadPoolExecutor`` (its ``threading`` exit hook) before
    it runs ``atexit`` handlers, so a save still writing then fails with "cannot schedule new futures
    after interpreter shutdown" as soon as it hands a file to a thread. ``threading``'s own exit hooks
    run last registered first, and this module imported ``concurrent.futures.thread`` already, so
    ``fn`` runs before that shutdown; ``atexit`` as well, as a fallback (a second call finds nothing
    left to do)."""
    register = getattr(threading, "_register_atexit", None)
    if register is not None and hasattr(_executors, "_python_exit"):  # (the hook it registered when imported)
        try:
            register(fn)
        except RuntimeError:  # (the interpreter is shutting down already)
            pass
    atexit.register(fn)


def _close_queues_at_exit() -> None:
    """Before the interpreter tears down: finish (or, past the deadline, abandon) every queue's saves
    in flight, stop the workers and close the library's process groups.

    Threads left inside a collective or a tensor copy at interpreter teardown abort the process
    (``terminate called without an active exception``): nothing of ours may run past this point.
    """
    timeout = _exit_timeout()
    for q in list(_queues):
        if q._closed:
            continue
        try:
            q._close_at_exit(timeout)
        except BaseException as e:  # noqa: BLE001
            logger.error("an async checkpoint save failed: %s", _describe(e))
    dist.close_private_groups("interpreter exit")


register_exit_hook(_close_queues_at_exit)


def _stage_plan(plan: SavePlan, stager: StateDictStager, defer_from_bytes: Optional[int],
                tensors: bool = True) -> Optional[Snapshot]:
    """Replace the plan's tensors (and common state) by staged host copies (only the common state
    with ``tensors=False``: a save in waves staged its tensors already).

    Returns the :class:`Snapshot` still to copy in the background, or ``None`` when
    everything was copied here.
    """
    idx = [i for i, r in enumerate(plan.requests) if tensors and isinstance(r.data, torch.Tensor)]
    names: Dict[int, str] = common_tensor_names(plan.common)
    for i in idx:
        r = plan.requests[i]
        at = f" at {tuple(r.offsets)}" if r.offsets and any(r.offsets) else ""
        names[id(r.data)] = r.storage_key + at
    pending = stager.prepare(
        {"tensors": [plan.requests[i].data for i in idx], "common": plan.common}, defer_from_bytes=defer_from_bytes
    )
    staged, pending.state = pending.state, None  # the plan holds what is needed from here on
    for i, t in zip(idx, staged["tensors"]):
        plan.requests[i].data = t
    plan.common = staged["common"]
    if pending.done.is_set():
        return None
    return Snapshot(pending, names, plan.checkpoint_dir)


def _arena_of(stager: StateDictStager) -> StagingArena:
    """The staging buffer of a queue slot for saves in waves (made on first use, then reused)."""
    arena = getattr(stager, "arena", None)
    if arena is None:
        arena = stager.arena = StagingArena()  # type: ignore[attr-defined]
    return arena


def _write_and_commit(plan: SavePlan, snap: Optional[Snapshot] = None) -> None:
    if snap is not None and not plan.failure.failed:
        if snap.wait_copied() is not None:  # the copy failed or saw a modification
            snap.seal_in_writer()  # final; no longer in flight
            plan.failure.record(snap.error)
            plan.requests = []
    write_local(plan)
    if snap is not None and not plan.failure.failed:
        err = snap.seal_in_writer()  # unless the training thread has checked it already
        if err is not None:
            plan.failure.record(err)
    try:
        finalize_save(plan)
    except Exception as e:
        if isinstance(e, CheckpointingException) and not isinstance(e, PeerLostError) or e is plan.failure.exc:
            raise  # the save's own outcome (every rank's errors, or this rank's write error)
        # a collective of the commit failed: another rank is gone, or the group was aborted
        why = getattr(plan.group, "reason", "") or "another rank left before the save was finalized"
        if not dist.is_distributed():  # say so: a user reading "abandoned" after destroy_process_group() blames it
            why += (" (this rank had called destroy_process_group() before wait()/close(); that alone does not "
                    "abandon a save, whose commit runs on the library's own group, but every rank must let it finish)")
        cause = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'collective failed'}"
        if plan.committed:  # rank 0 committed it; only telling the other ranks failed
            logger.warning("the async save to %s is committed, but the other ranks could not be told (%s; %s)",
                           plan.checkpoint_dir, why, cause)
            return
        if plan.rank == 0:
            cleanup_failed(plan.target, plan.staging)
        outcome = ("Nothing was committed there; earlier checkpoints are untouched" if plan.rank == 0 or not plan.commit_started
                   else f"rank 0 was committing it when the group failed: it is committed if and only if "
                        f"{plan.checkpoint_dir}/metadata.json exists; earlier checkpoints are untouched")
        raise AsyncSaveAbandonedError(
            f"the async save to {plan.checkpoint_dir} was abandoned on rank {dist.own_global_rank(plan.group)}: {why} "
            f"({cause}). {outcome}. Every rank must let its async saves "
            "finish (request.wait(), queue.close() or a normal exit) - see docs/strategies.md, 'Exiting with a save in flight'"
        ) from e


def async_save_torch_dist(
    sharded_state_dict: Dict[str, Any],
    checkpoint_dir: str,
    *,
    queue: Optional[AsyncCallsQueue] = None,
    finalize_fns: Optional[List[Callable[[], Any]]] = None,
    snapshot: Optional[str] = None,
    staging_budget: Optional[int] = None,
    **save_kwargs: object,
) -> AsyncRequest:
    """Start saving ``sharded_state_dict`` in the background; collective (call on every rank).

    Returns after ``prepare_save`` and the start of the snapshot. With
    ``snapshot="background"`` (the queue's default) the large tensors are copied
    while training goes on: modify saved tensors in place only after the snapshot
    (``torch.optim`` optimizer steps wait for it by themselves; otherwise call
    ``request.wait_for_snapshot()`` or :func:`wait_for_snapshot`); an earlier
    modification fails the save with ``SnapshotModifiedError``. With
    ``snapshot="caller"`` everything is copied before returning.
    ``save_kwargs`` are those of :func:`prepare_save` (``validate_access_integrity``, ``content_metadata``,
    ``thread_count``, ``balance``, ``overwrite``, ``durable``, ``process_group``). ``queue`` defaults to
    :func:`get_default_async_queue`. Call ``request.wait()`` (or the queue's ``maybe_finalize_async_calls`` /
    ``close``) to learn the outcome; the background worker commits once every rank's data is written.
    ``staging_budget`` (bytes, torch_dist only): stage at most this much tensor data in host memory, in waves
    (:mod:`.staging_budget`); without it, a save whose staging cannot fit fails with ``StagingMemoryError``.
    ``request.staging`` reports the bytes staged, the waves and the time the caller was blocked.
    """
    t0 = time.perf_counter()
    if staging_budget is not None and save_kwargs.get("backend", "torch_dist") != "torch_dist":  # (zarr stages all)
        raise CheckpointingException(f"async save to {checkpoint_dir}: staging_budget needs the torch_dist backend, "
                                     f"not {save_kwargs['backend']!r}")
    q = queue if queue is not None else get_default_async_queue()
    if q._closed:
        raise RuntimeError("AsyncCallsQueue is closed")
    mode = q.snapshot if snapshot is None else snapshot
    if mode not in SNAPSHOT_MODES:
        raise ValueError(f"snapshot must be one of {SNAPSHOT_MODES}, got {mode!r}")
    with q._schedule_lock:  # (see AsyncCallsQueue: the stager slot is this save's until it is finalized)
        q._make_room()  # may raise the previous save's error (on every rank)
        t1 = time.perf_counter()
        # planned first: its first collective is where the ranks agree to save asynchronously (a rank that
        # saves synchronously meets it there and both raise), before the private group, whose making
        # would wait for every member
        plan = prepare_save(sharded_state_dict, checkpoint_dir, asynchronous=True, **save_kwargs)
        group = q.private_group(save_kwargs.get("process_group"))
        t2 = time.perf_counter()
        stager = q._next_stager()
        snap: Optional[Snapshot] = None
        report = StagingReport()
        bounded = staging_budget is not None
        if bounded and not plan.failure.failed:
            report = write_in_waves(plan, _arena_of(stager), int(staging_budget))
        if not plan.failure.failed:
            try:
                if staging_budget is None:
                    report.bytes = sum(r.data.numel() * r.data.element_size() for r in plan.requests
                                       if isinstance(r.data, torch.Tensor))
                    check_fits(max(0, report.bytes - stager.cached_bytes), checkpoint_dir, plan.rank)
                snap = _stage_plan(plan, stager, None if bounded or mode != "background" else q.copy_now_bytes,
                                   tensors=not bounded)
            except Exception as e:  # reported by finalize_save on every rank
                plan.failure.record(e)
                plan.requests = []
        plan.group = group
        t3 = time.perf_counter()
        req = AsyncRequest(_write_and_commit, (plan, snap), finalize_fns, description=plan.final_path or str(checkpoint_dir))
        req.snapshot = snap
        req._cancellable = True
        rank = dist.own_global_rank(group)
        plan.stop = lambda: req._check_cancelled(str(checkpoint_dir), rank)
        if snap is not None:
            snap.start()
        q._submit(req)
    t4 = time.perf_counter()
    req.timings.update(wait_previous=t1 - t0, prepare=t2 - t1, stage=t3 - t2, submit=t4 - t3)
    req.blocking_seconds = t4 - t0
    report.blocked_s = req.blocking_seconds
    req.staging = report
    maybe_remove_hook()  # left installed by earlier saves, if nothing is in flight any more
    return req
