"""Waiting until a process group's worker threads let go of a collective's tensors (see :func:`settle`).

Split from :mod:`.dist`, whose collective helpers call these after every collective on host tensors
(and re-exports them): a tensor that a gloo worker thread frees itself, during the interpreter's
teardown, aborts the process.
"""

from __future__ import annotations

import atexit
import sys
import time
from typing import List, Optional, Sequence

import torch

SETTLE_TIMEOUT_S = 0.2
#: CPU buffers of collectives that a backend thread still held when :func:`settle` stopped waiting
#: (the newest few): waited for once more at interpreter exit, before the teardown
_unsettled: List[torch.Tensor] = []
_UNSETTLED_KEPT = 64


def python_refs(tensors: Sequence[torch.Tensor]) -> List[int]:
    """The reference counts of ``tensors``' Python objects, taken before a collective on them and
    handed to :func:`settle` after it, in a list built the same way (so the counts compare)."""
    return [sys.getrefcount(t) for t in tensors]


def _held_in_cpp(tensors: Sequence[torch.Tensor]) -> bool:
    return any(t.device.type == "cpu" and getattr(t, "_use_count", lambda: 1)() > 1 for t in tensors)


def _held_objects(tensors: Sequence[torch.Tensor], before: Sequence[int]) -> bool:
    now = python_refs(tensors)
    return any(now[i] > before[i] for i, t in enumerate(tensors) if t.device.type == "cpu")


def settle(tensors: Sequence[torch.Tensor], before: Optional[Sequence[int]] = None,
           timeout: float = SETTLE_TIMEOUT_S) -> None:
    """Return once the process group's worker threads hold none of ``tensors`` any more.

    A gloo collective's ``wait()`` returns when its result is ready, while the worker thread
    that ran it still holds the operation (and so the tensors) for a moment (measured: after
    13-28 % of small broadcasts on 2 ranks). While C++ holds a tensor, its C++ side also holds
    its Python object, and the worker lets go in two steps: its C++ reference first
    (``_use_count()`` falls to 1), then, *under the GIL*, that reference to the Python object
    (which frees it, if Python dropped it meanwhile). If the interpreter is finalizing by the
    second step (a script that saves and exits), the worker cannot take the GIL, is torn down
    inside a destructor and the process aborts (``terminate called without an active
    exception``, SIGABRT: about 1 run in 60-150 of ``tests/test_exit.py``'s case while only the
    first step was waited for). So this waits for both: only our own C++ reference left (up to
    ``timeout``), then the Python objects' reference counts back to ``before``
    (:func:`python_refs` taken before the collective), with the GIL released meanwhile (up to
    20 ms: a count still higher then is a reference of someone else's). CPU tensors only: device
    backends keep finished work for their watchdog. What is still held then is waited for
    again at interpreter exit.
    """
    if _unsettled:  # (the ones let go since: nothing to wait for at exit)
        _unsettled[:] = [t for t in _unsettled if t._use_count() > 1]
    deadline = time.monotonic() + timeout
    while _held_in_cpp(tensors):
        if time.monotonic() > deadline:
            return _keep_for_exit(tensors)
        time.sleep(0)  # let the worker thread run
    if before is None:
        return None
    deadline = time.monotonic() + 0.02
    while _held_objects(tensors, before):
        if time.monotonic() > deadline:
            return _keep_for_exit(tensors)
        time.sleep(1e-4)  # the GIL free for the worker's second step
    return None


def _keep_for_exit(tensors: Sequence[torch.Tensor]) -> None:
    _unsettled.extend(t for t in tensors if t.device.type == "cpu")
    del _unsettled[:-_UNSETTLED_KEPT]


def _settle_at_exit(timeout: float = 5.0) -> None:
    """At interpreter exit (before the teardown): let the backend's threads let go of the buffers
    :func:`settle` stopped waiting for, so that none of them frees a Python object during the teardown."""
    if not _unsettled:
        return
    deadline = time.monotonic() + timeout
    while any(t._use_count() > 1 for t in _unsettled) and time.monotonic() < deadline:
        time.sleep(1e-3)
    time.sleep(0.05)  # the GIL free for the workers' second step (see settle)
    _unsettled.clear()


atexit.register(_settle_at_exit)
