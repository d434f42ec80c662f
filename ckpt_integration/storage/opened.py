"""A checkpoint opened once: storage, commit marker, manifest and tensor metadata read one time,
pinned to the commit they belong to.

Every commit records a random ``commit_id`` in ``manifest.json``. An :class:`OpenedCheckpoint`
remembers the id it opened; each read through it checks, before it starts and after it
finished (and when it failed), that the directory still holds that commit. A directory replaced
(``last.ckpt`` rewritten by another save) or removed (top-k deletion) meanwhile makes the read
fail with :class:`~ckpt_integration.errors.CheckpointReplacedError` naming the path, instead of
returning data of two commits or reporting the other commit's files as damage
(``CorruptCheckpointError``). See docs/reading.md for what a reader may rely on.
"""

from __future__ import annotations

import functools
import inspect
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, TypeVar

from ..errors import CheckpointReplacedError
from . import checkpoint_dir as ckdir
from .filesystem import Storage, storage_for
from .torch_dist import read_dcp_metadata

F = TypeVar("F", bound=Callable[..., Any])


class OpenedCheckpoint:
    """One committed checkpoint, read once and pinned (use :func:`open_checkpoint`).

    Attributes: ``path`` (as given, fsspec URLs kept), ``storage``, ``config`` (``metadata.json``),
    ``backend``, ``manifest`` (``None`` for checkpoints of other writers), ``commit_id`` and
    ``metadata`` (the DCP ``.metadata``, verified against the manifest; ``None`` for zarr).
    Every ``ckpt_integration`` entry point that takes a checkpoint path accepts this object too.
    """

    def __init__(self, path: Any, trusted: bool = False):
        self.storage: Storage
        self.storage, self.path = storage_for(path)
        self.trusted = trusted
        self.commit_id: Optional[str] = None
        self.config = ckdir.read_config(self.path)  # a specific error for every way it is not a checkpoint
        self.backend = self.config.sharded_backend
        self.closed = False
        try:
            self.manifest = ckdir.read_manifest_checked(self.path)
            self.commit_id = ckdir.identity_of(self.manifest)  # the commit pinned: the manifest's
            self.metadata = None
            if self.backend == "torch_dist":
                self.metadata = read_dcp_metadata(self.path, trusted=trusted, manifest=self.manifest)
        except Exception as e:
            self._raise_if_replaced(e)
            raise
        self.check()  # what was read belongs to the commit that was pinned

    # ------------------------------------------------------------------ pinning
    def check(self) -> None:
        """Raise :class:`CheckpointReplacedError` unless the directory still holds the opened commit."""
        self._raise_if_replaced(None)

    def _raise_if_replaced(self, cause: Optional[BaseException]) -> None:
        now = ckdir.commit_identity(self.path)
        if now == self.commit_id and self.commit_id is not None:
            return
        what = "removed" if now is None else "replaced by another commit"
        err = CheckpointReplacedError(
            f"{self.path} was {what} while it was being read (opened commit {self.commit_id or 'unknown'}"
            f"{'' if now is None else ', now ' + now}); nothing read from it is returned: open it again "
            "to read what it holds now")
        if cause is not None:
            raise err from cause
        raise err

    @contextmanager
    def reading(self) -> Iterator[str]:
        """A read of this commit: yields the path; fails with :class:`CheckpointReplacedError` if the
        directory no longer holds the commit after the block (or when the block failed).

        One check after the read suffices: every commit has its own id, so a directory that holds
        the opened commit after the read held it during the read (a replacement in between would
        have left another id or no commit marker: a save rewriting in place removes
        ``metadata.json`` first)."""
        if self.closed:
            raise ValueError(f"{self.path}: the opened checkpoint is closed")
        try:
            yield self.path
        except Exception as e:
            self._raise_if_replaced(e)
            raise
        self.check()

    # ------------------------------------------------------------------ context manager
    def close(self) -> None:
        """Drop the cached metadata; later reads through this object are refused."""
        self.closed, self.metadata = True, None

    def __enter__(self) -> "OpenedCheckpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __fspath__(self) -> str:
        # the location, for code that only needs where it is (reads there are not pinned)
        return self.path

    def __repr__(self) -> str:
        return f"OpenedCheckpoint({self.path!r}, backend={self.backend!r}, commit_id={self.commit_id!r})"


def open_checkpoint(path: Any, trusted: bool = False) -> OpenedCheckpoint:
    """Open the committed checkpoint at ``path`` once (a local path or an fsspec URL).

    Use it as a context manager and pass it to any entry point instead of the path::

        with ci.open_checkpoint("ckpt/last.ckpt") as ck:
            state = ci.load(request, ck)
            step = ci.load_common_state_dict(ck)["global_step"]

    ``trusted`` as for :func:`~ckpt_integration.load` (used for ``.metadata``). Reads through it
    return data of the opened commit only, or raise :class:`CheckpointReplacedError`.
    """
    return OpenedCheckpoint(path, trusted=trusted)


@contextmanager
def reading(checkpoint: Any) -> Iterator[str]:
    """The path to read: pinned reads (see :meth:`OpenedCheckpoint.reading`) for an opened
    checkpoint, the plain path otherwise."""
    if isinstance(checkpoint, OpenedCheckpoint):
        with checkpoint.reading() as path:
            yield path
    else:
        yield checkpoint if checkpoint is None else os.fspath(checkpoint)


def accepts_opened(*names: str) -> Callable[[F], F]:
    """Decorator: the arguments ``names`` (checkpoint paths) may be :class:`OpenedCheckpoint`\\ s;
    the call then runs as a pinned read of each (the function sees the path)."""

    def wrap(fn: F) -> F:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind_partial(*args, **kwargs)
            opened = [n for n in names if isinstance(bound.arguments.get(n), OpenedCheckpoint)]
            if not opened:
                return fn(*args, **kwargs)
            return _pinned_call(fn, bound, opened)

        return inner  # type: ignore[return-value]

    return wrap


def _pinned_call(fn: Callable[..., Any], bound: inspect.BoundArguments, opened: list) -> Any:
    name, rest = opened[0], opened[1:]
    with bound.arguments[name].reading() as path:
        bound.arguments[name] = path
        if rest:
            return _pinned_call(fn, bound, rest)
        return fn(*bound.args, **bound.kwargs)
