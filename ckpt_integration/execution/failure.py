"""This rank's failure in a collective operation, carried until every rank agrees on it.

See :class:`Failure`; docs/architecture.md ("Failures across ranks") shows where it is used.
"""

from __future__ import annotations

from types import TracebackType
from typing import Optional, Type

from .dist import Group, agree_on_errors, describe_error, raise_if_any_failed


class Failure:
    """This rank's first failure in a collective operation, held until every rank agrees.

    A collective step must not raise on one rank alone (the others would wait for it), so local
    work runs under :meth:`capture`, later steps ask :attr:`failed` to skip work, and
    :meth:`agree` raises on every rank when any rank failed: the failing rank its own exception,
    the others :class:`DistributedCheckpointingError` naming it.

    Example::

        failure = Failure()
        with failure.capture():
            plan = make_plan()
        failure.agree(group, "save failed")
    """

    __slots__ = ("exc",)

    def __init__(self, exc: Optional[BaseException] = None) -> None:
        self.exc = exc

    @property
    def failed(self) -> bool:
        return self.exc is not None

    @property
    def message(self) -> Optional[str]:
        """The one line the other ranks see (:func:`describe_error`), or None."""
        return describe_error(self.exc) if self.exc is not None else None

    def record(self, e: BaseException) -> None:
        """Keep ``e`` unless an earlier failure is kept (the first cause is the one reported)."""
        if self.exc is None:
            self.exc = e

    def capture(self) -> "_Capture":
        """A ``with`` block whose exception (an ``Exception``, not an interrupt) is recorded, not raised."""
        return _Capture(self)

    def agree(self, group: Group, context: str) -> None:
        """Collective: raise on every rank when any rank failed (see :func:`raise_if_any_failed`)."""
        raise_if_any_failed(self.exc, agree_on_errors(self.message, group), context)


class _Capture:
    __slots__ = ("failure",)

    def __init__(self, failure: Failure) -> None:
        self.failure = failure

    def __enter__(self) -> Failure:
        return self.failure

    def __exit__(self, kind: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        self.failure.record(exc)
        return True
