"""Checkpoint directories on disk or fsspec URLs: complete or not, the newest, what ``ckpt_path`` means.

No Lightning objects here: the strategies, the plugin and ``DistCkptModelCheckpoint`` all use these.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from typing import Any, Iterable, Optional, Tuple

from .. import serialization
from ..checkpoints import newest_checkpoint
from ..errors import CheckpointingException, IncompleteCheckpointError
from ..storage.checkpoint_dir import CONFIG_FILE
from ..storage.filesystem import base_name, locate, parent_of, storage_for

logger = logging.getLogger(__name__)

# names whose incomplete directory falls back to the newest complete sibling: ``last`` (ModelCheckpoint)
# and ``hpc_ckpt_<n>`` (Lightning's SLURM requeue save, which a restart on SLURM picks by its number)
_LAST_RE = re.compile(r"^(last(-v\d+)?|hpc_ckpt_\d+)(\.ckpt)?$")


def is_last_name(name: str) -> bool:
    """Whether ``name`` is one whose incomplete directory a resume falls back from (``last*.ckpt``, ``hpc_ckpt_<n>``)."""
    return bool(_LAST_RE.match(name))


def is_complete_checkpoint(path: Any) -> bool:
    """True if ``path`` (local path, fsspec URL or opened checkpoint) is a committed checkpoint directory
    (has ``metadata.json``)."""
    ck = locate(path)
    meta = ck.file(CONFIG_FILE)
    return ck.storage.exists(meta) and not ck.storage.isdir(meta)


def latest_complete_checkpoint(dirpath: Any, suffix: str = ".ckpt", why: str = "", depth: int = 0,
                               left_by: Optional[Tuple[int, float]] = None, trusted: bool = False,
                               allowed_globals: Optional[Iterable[Any]] = None) -> Optional[str]:
    """The newest committed checkpoint directory in ``dirpath`` (local or fsspec URL), or ``None``.

    "Newest" is what the jobs recorded at commit (global step, then commit number; see
    :mod:`ckpt_integration.checkpoints`), timestamps only for remaining ties; the choice and
    its reason are logged. After a rollback (a run resumed from an earlier checkpoint) the
    checkpoints of the timeline it left are not candidates (:func:`run_of`; ``left_by``: the memory
    tier's newest snapshot, see :func:`~ckpt_integration.checkpoints.abandoned_checkpoints`).
    ``depth``: directories below ``dirpath`` to look in too (a file name with ``/``); ``trusted`` /
    ``allowed_globals``: as the job's loads (the run records are in the checkpoints' common state).
    """
    return newest_checkpoint(dirpath, suffix, why=why, depth=depth, left_by=left_by,
                             run_of=functools.partial(run_of, trusted=trusted, allowed_globals=allowed_globals))


def run_of(path: str, trusted: bool = False, allowed_globals: Optional[Iterable[Any]] = None
           ) -> Optional[Tuple[int, float]]:
    """The run that saved a checkpoint of the DistCkpt strategies: ``(global step it started from, time it
    started)``, or None (not recorded, or unreadable: then no timeline is left out). ``trusted`` /
    ``allowed_globals``: as the job's loads (the content metadata is read with the common state)."""
    try:
        meta = serialization.load_content_metadata(path, trusted=trusted, allowed_globals=allowed_globals)
    except (CheckpointingException, OSError):
        return None
    run = meta.get("run") if isinstance(meta, dict) else None
    if not isinstance(run, dict):
        return None
    step, started = run.get("from_step"), run.get("started")
    if not isinstance(step, int) or isinstance(step, bool) or not isinstance(started, (int, float)):
        return None
    return step, float(started)


def resolve_checkpoint_path(path: str, trusted: bool = False, allowed_globals: Optional[Iterable[Any]] = None) -> str:
    """``path`` if complete; for an incomplete ``last*.ckpt`` or ``hpc_ckpt_<n>.ckpt`` the newest complete
    sibling; else raise.

    Works for local paths and fsspec URLs (``s3://...``, ``memory://...``). ``trusted`` / ``allowed_globals``: as
    the job's loads (the choice after a rollback reads the checkpoints' content metadata).
    """
    if is_complete_checkpoint(path):
        return path
    storage, p = storage_for(path)
    if base_name(p) == CONFIG_FILE and is_complete_checkpoint(parent_of(p)):
        return parent_of(p)  # how DistCkptModelCheckpoint names remote "last" candidates for Lightning
    if not storage.remote:  # ``last.ckpt`` may be a symlink (``save_last="link"``)
        real = os.path.realpath(p)
        if real != p and is_complete_checkpoint(real):
            return real
    if _LAST_RE.match(base_name(p)) and storage.exists(p):
        alt = latest_complete_checkpoint(parent_of(p), why=f"{path} is incomplete", trusted=trusted,
                                         allowed_globals=allowed_globals)
        if alt is not None:
            logger.warning("%s is incomplete (interrupted save); resuming from %s instead", path, alt)
            return alt
    if storage.isdir(p):
        raise IncompleteCheckpointError(
            f"{path} is not a complete checkpoint (no {CONFIG_FILE}: the save was interrupted or is still "
            "running); pass a committed checkpoint directory"
        )
    return path  # let ci.load raise its specific error (missing path, a file, ...)


__all__ = ["is_complete_checkpoint", "is_last_name", "latest_complete_checkpoint", "resolve_checkpoint_path", "run_of"]
