"""Background snapshots for async save: copied while training runs, waited for before the next optimizer step.

An async save returns once the collective planning is done and the structure of
the snapshot exists (small tensors already copied, see
:meth:`~ckpt_integration.execution.staging.StateDictStager.prepare`); the large
tensors are copied into the host buffers by a background thread while the next
forward and backward run. Parameters and optimizer state do not change until the
next optimizer step, so the wait is put right before it:

* **automatically for every** ``torch.optim.Optimizer`` **step**: while a snapshot is
  in flight, a global optimizer step pre-hook
  (``torch.optim.optimizer.register_optimizer_step_pre_hook``) waits for it. When
  ``step`` gets a closure (LBFGS, Lightning's automatic optimization, which runs
  forward and backward inside ``step``), the wait runs after the closure returns,
  so forward and backward still overlap the copy;
* **automatically before a storage being copied is resized** (freed: FSDP frees parameters with
  ``untyped_storage().resize_(0)``): ``UntypedStorage.resize_`` waits for that copy while a
  snapshot is in flight (a freed or resized storage the copy has not reached fails the save);
* **automatically before a module whose buffer is being copied runs** (a global module
  forward pre-hook, while a snapshot is in flight): a forward updates buffers in place, and
  some kernels do it without bumping version counters (BatchNorm's running statistics), so
  the checks below could not see it. Only modules with a buffer among the storages still
  being copied wait (buffers under 256 KiB are copied before the save returns);
* **for anything else** that modifies the saved tensors in place (a hand-written
  update, EMA weights, weight clipping outside the optimizer): call
  :func:`wait_for_snapshot` (or ``request.wait_for_snapshot()``) first;
* in Lightning, :class:`ckpt_integration.lightning.snapshot.WaitForSnapshot`
  waits in ``on_before_optimizer_step``.

**Early modification is detected, never written.** Every watched source tensor's
version counter (``Tensor._version``, bumped by each in-place op) is recorded at the
save call and compared (1) right after the copy, (2) by the training thread at the
next wait point (no op of that thread can be running then, so this check is exact)
and (3) by the writer before the commit if (2) has not happened yet. A change means
the copy may be torn or newer: the save fails on every rank with
:class:`SnapshotModifiedError` naming the tensors, nothing is committed, and the
next saves copy those tensors before returning (so the failure does not repeat).
Modifications that bypass version counters (through ``.data``, ``set_``, NumPy views
or raw storage, or an in-place kernel of another thread) are seen when they happen while
the copy runs: right after the copy, each staged storage is compared with its source (byte
for byte on the CPU, by fingerprints computed on the device otherwise), so a copy that mixes
the bytes of two states - one that never existed - fails the save the same way. A change of
that kind made after the copy and before the wait point leaves the snapshot of the state at
the copy's end (a state that existed) and cannot be seen: make such changes after
:func:`wait_for_snapshot`, or use ``snapshot="caller"`` (everything copied before the save
returns). The fingerprint the checkpoint records for each tensor is computed from the staged
bytes, the ones written.

Errors of the copy itself are not raised at the wait points (a rank raising alone
would leave its peers in the next collective); like every async save failure they
are raised on all ranks by ``request.wait()``, the next save on the queue,
``maybe_finalize_async_calls`` or ``close()``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from ..errors import SnapshotModifiedError
from .staging import PendingCopy

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["Snapshot", "snapshots_in_flight", "wait_for_snapshot"]


class Snapshot:
    """The background copy of one async save (made by ``async_save_torch_dist``).

    Args:
        pending: the deferred copies (:meth:`StateDictStager.prepare`).
        names: ``id(source tensor) -> name`` used in errors.
        description: the checkpoint directory (errors, logs).
    """

    def __init__(self, pending: PendingCopy, names: Dict[int, str], description: str):
        self.pending = pending
        self.description = description
        self.error: Optional[BaseException] = None
        self.copy_seconds: Optional[float] = None
        self.waited_seconds = 0.0  # how long callers were blocked at wait points
        self._names = names
        self._copied = threading.Event()
        self._lock = threading.Lock()
        self._sealed = False
        self._thread: Optional[threading.Thread] = None

    # -- copy (background thread) -----------------------------------------------------------
    def start(self) -> None:
        """Run the copy on a new thread and track the snapshot as in flight (call from the training thread)."""
        _register(self)
        self._thread = threading.Thread(target=self._run, name="ckpt-snapshot", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.pending.run()
            self._check("before the snapshot was complete")  # check 1: before anyone may go on
        except BaseException as e:  # noqa: BLE001 - reported through the save's commit step
            self.error = e
        finally:
            self.copy_seconds = time.perf_counter() - t0
            self._copied.set()

    # -- state ------------------------------------------------------------------------------
    def copied(self) -> bool:
        """Whether the copy has ended (successfully or not); never blocks."""
        return self._copied.is_set()

    def sealed(self) -> bool:
        """Whether the snapshot is final (copied and checked); the live tensors are then free."""
        return self._sealed

    # -- waiting ----------------------------------------------------------------------------
    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for the copy, then check the tensors from this (the training) thread.

        Returns ``False`` if ``timeout`` seconds passed first. Never raises the save's
        failure (see the module docstring); the failure is logged at once.
        """
        if not self._copied.is_set():
            t0 = time.perf_counter()
            ok = self._copied.wait(timeout)
            self.waited_seconds += time.perf_counter() - t0
            if not ok:
                return False
        self._seal("before the snapshot was complete")  # check 2: exact (this thread runs no op now)
        return True

    def wait_copied(self) -> Optional[BaseException]:
        """Writer thread: wait for the copy (no check); the error found so far, if any."""
        self._copied.wait()
        return self.error

    def seal_in_writer(self) -> Optional[BaseException]:
        """Writer thread, before the commit: the last check unless the training thread sealed already."""
        self._copied.wait()
        self._seal("before the commit, with no wait_for_snapshot() or optimizer step first")  # check 3
        return self.error

    def _seal(self, when: str) -> None:
        with self._lock:
            if self._sealed:
                return
            if self.error is None:
                self._check(when)
            self._sealed = True
            self.pending.release()
        _unregister(self)

    def _check(self, when: str) -> None:
        changed = self.pending.changed()
        if not changed:
            return
        names = sorted({id(t): self._names.get(id(t), f"<tensor of shape {tuple(t.shape)}>") for t in changed}.values())
        self.error = SnapshotModifiedError(
            f"async save to {self.description}: {len(names)} tensor(s) were modified in place {when} (their "
            "version counter moved, or their copy differs from them: a change that bypassed the counters), "
            f"so the snapshot may be torn; nothing is committed: {', '.join(names[:10])}"
            f"{' ...' if len(names) > 10 else ''}. Modify saved tensors only after "
            "ckpt_integration.wait_for_snapshot() (done automatically before torch.optim optimizer steps), or save "
            "with snapshot=\"caller\" (DistCkptIO(snapshot=\"caller\") in Lightning), which copies everything "
            "before the save returns; later saves of this process copy these tensors before returning."
        )
        logger.error("%s", self.error)

    def __repr__(self) -> str:
        state = "sealed" if self._sealed else ("copied" if self.copied() else "copying")
        return f"Snapshot({self.description!r}, {state}, {self.pending.nbytes} bytes)"


# --------------------------------------------------------------------------- in-flight registry
_lock = threading.Lock()
_in_flight: List[Snapshot] = []
_hook_handle: Any = None
_forward_handle: Any = None
_tls = threading.local()


def common_tensor_names(value: Any, path: str = "") -> Dict[int, str]:
    """``id(tensor) -> "common state 'a.b'"`` for the tensors in ``value``'s dicts, lists and tuples
    (the names a :class:`Snapshot` gives in its error; tensors elsewhere are named by their shape)."""
    import torch

    if isinstance(value, torch.Tensor):
        return {id(value): f"common state {path!r}"}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    out: Dict[int, str] = {}
    for k, v in items:
        out.update(common_tensor_names(v, f"{path}.{k}" if path else str(k)))
    return out


def snapshots_in_flight() -> List[Snapshot]:
    """Snapshots of this process not yet sealed (oldest first)."""
    with _lock:
        return list(_in_flight)


def _register(snap: Snapshot) -> None:
    global _hook_handle, _forward_handle
    with _lock:
        _in_flight.append(snap)
        if _hook_handle is None:
            from torch.nn.modules.module import register_module_forward_pre_hook
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _hook_handle = register_optimizer_step_pre_hook(_before_optimizer_step)
            _forward_handle = register_module_forward_pre_hook(_before_forward)
            import torch

            torch.UntypedStorage.resize_ = _resize_after_copy  # (removed with the hooks)


def _unregister(snap: Snapshot) -> None:
    with _lock:
        if snap in _in_flight:
            _in_flight.remove(snap)


def maybe_remove_hook() -> None:
    """Remove the optimizer hook when nothing is in flight.

    Only from the training thread outside the hook: torch iterates the global hook
    dict while calling the hooks, so the hook must not remove itself.
    """
    global _hook_handle, _forward_handle
    if getattr(_tls, "in_hook", False):
        return
    with _lock:
        if _hook_handle is not None and not _in_flight:
            _hook_handle.remove()
            _forward_handle.remove()
            _hook_handle = _forward_handle = None
            import torch

            if torch.UntypedStorage.__dict__.get("resize_") is _resize_after_copy:
                del torch.UntypedStorage.resize_  # (torch's own, inherited, again)


def hook_installed() -> bool:
    """Whether the global optimizer step pre-hook is installed now."""
    return _hook_handle is not None


def _wait_all(snaps: List[Snapshot], timeout: Optional[float] = None) -> bool:
    deadline = None if timeout is None else time.monotonic() + timeout
    for s in snaps:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not s.wait(left):
            return False
    return True


def wait_for_snapshot(timeout: Optional[float] = None) -> bool:
    """Block until every async save snapshot of this process is complete; local, no collectives.

    Call it before modifying saved tensors in place outside a ``torch.optim``
    optimizer step (those wait by themselves). Returns ``False`` if ``timeout``
    seconds passed first. A failed snapshot is not raised here (the save's error
    surfaces on every rank at ``wait()``, the next save or ``close()``).

    Example::

        req = ci.save(state, "ckpt/iter_100", async_sharded_save=True)
        loss = model(batch).sum(); loss.backward()   # overlaps the snapshot
        ci.wait_for_snapshot()                       # before a hand-written in-place update
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    """
    ok = _wait_all(snapshots_in_flight(), timeout)
    if ok:
        maybe_remove_hook()
    return ok


def _before_forward(module: Any, args: tuple) -> None:
    """Global module forward pre-hook: wait for the snapshots still copying one of this module's own
    buffers (a forward may change them in place, BatchNorm's without a version bump)."""
    if not _in_flight or not module._buffers:  # (every module call while a snapshot is in flight: no lock here)
        return None
    ptrs = {b.untyped_storage().data_ptr() for b in module._buffers.values() if b is not None}
    waiting = [s for s in snapshots_in_flight() if not s.copied() and not ptrs.isdisjoint(s.pending.sources)]
    if waiting:
        _tls.in_hook = True
        try:
            _wait_all(waiting)
        finally:
            _tls.in_hook = False
    return None


def _resize_after_copy(storage: Any, *args: Any, **kwargs: Any) -> Any:
    """``UntypedStorage.resize_`` while a snapshot is in flight: a storage still being copied is
    resized (freed, as FSDP frees parameters with ``resize_(0)``) once its copy has ended; the copy
    would read freed memory (a crash) or a regrown, zeroed storage."""
    if _in_flight:
        ptr = storage.data_ptr()
        waiting = [s for s in snapshots_in_flight() if not s.copied() and ptr in s.pending.sources]
        if waiting:
            _wait_all(waiting)
    import torch

    return torch._C.StorageBase.resize_(storage, *args, **kwargs)


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
    """Global optimizer step pre-hook: wait for in-flight snapshots (after the closure, if any)."""
    snaps = snapshots_in_flight()
    if not snaps:
        return None
    closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
    if callable(closure) and not all(s.copied() for s in snaps):
        # step() runs forward/backward inside the closure: let them overlap the copy, and wait
        # when the closure returns, i.e. before the step modifies anything
        def closure_then_wait(*a: object, **k: object) -> Any:
            out = closure(*a, **k)
            _wait_all(snaps)
            return out

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_wait}
        return (args[0], closure_then_wait, *args[2:]), kwargs
    _tls.in_hook = True
    try:
        _wait_all(snaps)
    finally:
        _tls.in_hook = False
    return None
