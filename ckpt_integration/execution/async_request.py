"""One background unit of work of an async save, and what runs after it (:class:`AsyncRequest`).

Megatron-Core's ``AsyncRequest``: the work runs on a queue's worker thread
(:class:`~.async_save.AsyncCallsQueue`), the finalize functions in the caller's thread once it
succeeded. Kept apart from the queue so that the memory tier and the queue share one request
type without the queue's machinery.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..errors import AsyncSaveAbandonedError
from .snapshot import Snapshot, maybe_remove_hook

_PENDING, _RUNNING, _DONE = "pending", "running", "done"


class AsyncRequest:
    """One unit of background work plus what to run after it succeeded.

    Args:
        async_fn: runs on the queue's worker thread with ``async_fn_args``.
        async_fn_args: positional arguments of ``async_fn``.
        finalize_fns: run in the caller's thread, in order, after ``async_fn``
            succeeded, when the request is finalized (``wait``/``finalize`` or the
            queue's ``maybe_finalize_async_calls``); local, no collectives.
        description: shown in errors and logs (e.g. the checkpoint directory).

    ``blocking_seconds`` (set by :func:`async_save_torch_dist`) is how long the
    caller was stalled to start the save; ``timings`` breaks it down. ``snapshot``
    is the background copy of the save's tensors (``None`` when the caller copied
    everything).
    """

    def __init__(
        self,
        async_fn: Callable[..., Any],
        async_fn_args: Sequence[Any] = (),
        finalize_fns: Optional[List[Callable[[], Any]]] = None,
        description: str = "",
    ):
        self.async_fn = async_fn
        self.async_fn_args = tuple(async_fn_args)
        self.finalize_fns: List[Callable[[], Any]] = list(finalize_fns or [])
        self.description = description
        self.call_idx: Optional[int] = None
        self.blocking_seconds: Optional[float] = None
        self.timings: Dict[str, float] = {}
        self.staging: Any = None  # an async save's StagingReport (bytes staged, waves, time blocked)
        self.snapshot: Optional[Snapshot] = None
        self._state = _PENDING
        self._event = threading.Event()
        self._exc: Optional[BaseException] = None
        self._finalized = False
        self._reported = False  # the failure was raised to the caller once
        self._finalize_lock = threading.Lock()
        self._cancel_reason: Optional[str] = None
        self._cancellable = False  # whether async_fn honours cancel() (the library's own saves do)

    # -- worker side -------------------------------------------------------------------
    def _run(self) -> None:
        self._state = _RUNNING
        t0 = time.perf_counter()
        try:
            self.async_fn(*self.async_fn_args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            self._exc = e
        finally:
            self.timings["background"] = time.perf_counter() - t0
            self.async_fn = None  # drop references to staged data early
            self.async_fn_args = ()
            self._state = _DONE
            self._event.set()

    # -- caller side -------------------------------------------------------------------
    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` in the caller's thread once the request succeeded."""
        self.finalize_fns.append(fn)

    def is_done(self) -> bool:
        """Whether the background work has ended (successfully or not); local, never blocks."""
        return self._event.is_set()

    def snapshot_done(self) -> bool:
        """Whether the snapshot is complete, so the saved tensors may be modified; never blocks."""
        return self.snapshot is None or self.snapshot.sealed() or self.snapshot.copied()

    def wait_for_snapshot(self, timeout: Optional[float] = None) -> bool:
        """Block until this save's snapshot is complete (not its write); local.

        After it the saved tensors may be modified in place. Returns ``False`` if
        ``timeout`` seconds passed first. Does not raise the save's failure.
        """
        if self.snapshot is None:
            return True
        ok = self.snapshot.wait(timeout)
        if ok:
            maybe_remove_hook()
        return ok

    def cancel(self, reason: str) -> bool:
        """Abandon the save if it is still running: its write stops before the next item and its
        commit fails on every rank (one rank's abandoned write fails the commit everywhere), so
        nothing is committed, the coordinator removes what was written and earlier checkpoints
        stay as they were. ``wait()`` then raises :class:`AsyncSaveAbandonedError` with ``reason``.
        Local; returns ``False`` when there is nothing to cancel (already done, or a request that
        cannot be cancelled). A save already past its write may still commit."""
        if self.is_done() or not self._cancellable:
            return False
        if self._cancel_reason is None:
            self._cancel_reason = reason
        return True

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called while the save was running."""
        return self._cancel_reason is not None

    def _check_cancelled(self, checkpoint_dir: str, rank: int) -> None:
        """The writer's stop check (called before each item it writes)."""
        if self._cancel_reason is not None:
            raise AsyncSaveAbandonedError(
                f"the async save to {checkpoint_dir} was abandoned on rank {rank}: {self._cancel_reason}. "
                "Nothing was committed there and what it wrote is removed; earlier checkpoints are untouched"
            )

    def exception(self) -> Optional[BaseException]:
        """The background failure, once done (``None`` if it succeeded or is still running)."""
        return self._exc if self.is_done() else None

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the background work ended, then finalize (see :meth:`finalize`).

        Raises the background failure (on every rank, since the commit step
        shares all ranks' errors) or ``TimeoutError`` after ``timeout`` seconds.
        """
        t0 = time.monotonic()
        if not self.wait_for_snapshot(timeout) or not self._event.wait(
            None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
        ):
            raise TimeoutError(f"async save {self.description} did not finish within {timeout}s")
        self.finalize()

    def finalize(self) -> None:
        """Wait for the background work and run the finalize functions once.

        Raises the background failure; calling again raises it again.
        """
        self.wait_for_snapshot()  # checked from this thread first (exact, see snapshot.py)
        self._event.wait()
        if self._exc is not None:
            self._reported = True
            raise self._exc
        with self._finalize_lock:
            if self._finalized:
                return
            self._finalized = True
            fns, self.finalize_fns = self.finalize_fns, []
        for fn in fns:
            fn()

    def __repr__(self) -> str:
        return f"AsyncRequest({self.description!r}, idx={self.call_idx}, state={self._state})"
