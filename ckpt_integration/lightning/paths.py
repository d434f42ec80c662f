"""Checkpoint directories on disk or fsspec URLs: complete or not, the newest, what ``ckpt_path`` means.

No Lightning objects here: the strategies, the plugin and ``DistCkptModelCheckpoint`` all use these.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Optional

from ..errors import IncompleteCheckpointError
from ..storage.checkpoint_dir import CONFIG_FILE
from ..storage.filesystem import is_remote, join, storage_for

logger = logging.getLogger(__name__)

_LAST_RE = re.compile(r"^last(-v\d+)?(\.ckpt)?$")


def is_complete_checkpoint(path: Any) -> bool:
    """True if ``path`` (local path or fsspec URL) is a committed checkpoint directory (has ``metadata.json``)."""
    storage, p = storage_for(path)
    meta = join(p, CONFIG_FILE)
    return storage.exists(meta) and not storage.isdir(meta)


def _parent(path: str) -> str:
    """The directory holding ``path`` (URLs split on ``/``; local paths made absolute first)."""
    if is_remote(path):
        return path.rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(path.rstrip(os.sep)))


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if is_remote(path) else os.path.basename(path.rstrip(os.sep))


def _mtime(storage: Any, path: str) -> float:
    """Modification time of ``path`` in seconds since the epoch, locally or through fsspec."""
    if not storage.remote:
        return os.path.getmtime(path)
    try:
        return storage.fs.modified(path).timestamp()
    except (NotImplementedError, AttributeError):
        # filesystems without ``modified()`` usually report a time in ``info()``, under varying keys
        info = storage.fs.info(path)
        for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
            v = info.get(key)
            if v is not None:
                return v.timestamp() if hasattr(v, "timestamp") else float(v)
        raise NotImplementedError(
            f"cannot tell when {path} was written: {type(storage.fs).__name__} reports no modification time"
        ) from None


def latest_complete_checkpoint(dirpath: Any, suffix: str = ".ckpt") -> Optional[str]:
    """The most recently committed checkpoint directory in ``dirpath`` (local or fsspec URL), or ``None``.

    "Most recent" is the modification time of ``metadata.json``, written last by every save.
    """
    storage, d = storage_for(dirpath)
    if not storage.isdir(d):
        return None
    cands = [join(d, n) for n in storage.listdir(d) if n.endswith(suffix)]
    cands = [c for c in cands if is_complete_checkpoint(c)]
    if not cands:
        return None
    return max(cands, key=lambda c: _mtime(storage, join(c, CONFIG_FILE)))


def resolve_checkpoint_path(path: str) -> str:
    """``path`` if complete; for an incomplete ``last*.ckpt`` the newest complete sibling; else raise.

    Works for local paths and fsspec URLs (``s3://...``, ``memory://...``).
    """
    if is_complete_checkpoint(path):
        return path
    storage, p = storage_for(path)
    if _basename(p) == CONFIG_FILE and is_complete_checkpoint(_parent(p)):
        return _parent(p)  # how DistCkptModelCheckpoint names remote "last" candidates for Lightning
    if not storage.remote:  # ``last.ckpt`` may be a symlink (``save_last="link"``)
        real = os.path.realpath(p)
        if real != p and is_complete_checkpoint(real):
            return real
    if _LAST_RE.match(_basename(p)) and storage.exists(p):
        alt = latest_complete_checkpoint(_parent(p))
        if alt is not None:
            logger.warning("%s is incomplete (interrupted save); resuming from %s instead", path, alt)
            return alt
    if storage.isdir(p):
        raise IncompleteCheckpointError(
            f"{path} is not a complete checkpoint (no {CONFIG_FILE}: the save was interrupted or is still "
            "running); pass a committed checkpoint directory"
        )
    return path  # let ci.load raise its specific error (missing path, a file, ...)


__all__ = ["is_complete_checkpoint", "latest_complete_checkpoint", "resolve_checkpoint_path"]
