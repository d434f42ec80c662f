"""Putting a finished file or directory in place of another: the library's one atomic-replace rule.

``save(overwrite=True)`` writes the new checkpoint into a staging sibling ``<dir>.tmp-*`` and,
once it is committed, puts it at ``<dir>``; ``convert``, ``export`` and the Lightning import write
their output beside ``OUT`` and put it there when complete. Both go through :func:`replace`, so
both keep the same promise: at every instant, and after a crash at any point, the old content or
the new one is complete (at the path, or - only on filesystems without an atomic exchange, between
the two renames - at the names the error and ``docs/format.md`` give).

The durability rule, in this order (``durable=True``):

1. **the new content is durable first**: every data file fsync'ed, then its directories (a save
   that wrote with ``durable=True`` has done so already and says ``data_synced=True``; the tools'
   writers have not, and :func:`sync_tree` does it here);
2. **one rename puts it in place**: a file over a file with ``rename(2)`` (atomic); where a
   directory is involved, an atomic exchange (Linux ``renameat2(RENAME_EXCHANGE)``), else two
   renames: the old one aside to ``<target>.old-<id>``, the new one in; if the second rename
   fails, the old one is moved back before the error is raised;
3. **the parent directory is fsync'ed**, so the rename itself survives a power loss;
4. only then is the old content removed (its commit marker first, see ``Storage.rmtree``).

On fsspec storage the same order holds where it means anything: an object is durable when its
PUT is acknowledged, and there is no directory to fsync; but object stores have no rename, so a
replacement there is refused (:func:`supports_replace`) instead of being emulated by copies that a
crash could leave half done.
"""

from __future__ import annotations

import logging
import os
import re
import uuid

from ..errors import CheckpointingException, CheckpointWriteError
from .filesystem import Storage
from .fs import fsync_dir, fsync_file

logger = logging.getLogger(__name__)

__all__ = ["replace", "supports_replace", "sync_tree", "old_name"]


def supports_replace(storage: Storage) -> bool:
    """Whether :func:`replace` can put one entry in place of another atomically on ``storage``."""
    return not storage.remote


def old_name(target: str) -> str:
    """Where the two-rename fallback moves the old ``target`` aside (``<target>.old-<id>``)."""
    return f"{target.rstrip(os.sep)}.old-{uuid.uuid4().hex[:8]}"


def staging_name(target: str, token: str) -> str:
    """Where an overwrite save writes the new ``target`` before it is put in place (``<target>.tmp-<id>``)."""
    return f"{target.rstrip(os.sep)}.tmp-{token[:8]}"


# the two names above: both can hold a committed checkpoint for a moment, then vanish
_SIBLING = re.compile(r"\.(tmp|old)-[0-9a-f]{8}$")


def is_replace_sibling(name: str) -> bool:
    """Whether ``name`` is a :func:`staging_name` or :func:`old_name` (a reader must not pick it)."""
    return _SIBLING.search(name) is not None


def sync_tree(path: str) -> None:
    """fsync every regular file below ``path`` (or ``path`` itself, a file), then every directory
    bottom-up, so that the whole tree is durable before a rename makes it visible."""
    if not os.path.isdir(path) or os.path.islink(path):
        fsync_file(path)
        return
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            fsync_file(os.path.join(root, name))
        fsync_dir(root)


def replace(storage: Storage, staged: str, target: str, *, durable: bool = True, data_synced: bool = False) -> None:
    """Put ``staged`` (a complete file or directory, a sibling of ``target`` on the same
    filesystem) at ``target``, replacing what is there, by the rule of this module.

    ``durable=False`` skips every fsync (throwaway data, as ``save(durable=False)``);
    ``data_synced``: the caller already fsync'ed the files and directories of ``staged``.
    After a failure ``target`` holds the old content (or, if the failure came after the
    rename, the new one) and ``staged`` whatever did not end up at ``target``, for the caller
    to discard; only if the old content cannot be moved back after a failed second rename
    does the error name where it is instead.

    Example::

        storage, out = storage_for("out.safetensors")
        replace(storage, ".out.safetensors.tmp", out)
    """
    if not supports_replace(storage):
        raise CheckpointingException(
            f"cannot replace {target} atomically: object stores have no rename; write to a new location "
            "and delete the old one afterwards")
    if durable and not data_synced:
        sync_tree(staged)
    parent = os.path.dirname(os.path.abspath(target))
    if not os.path.lexists(target):
        storage.rename(staged, target)  # nothing to keep: one rename
        _sync_parent(storage, parent, durable)
        return
    if not _is_dir(staged) and not _is_dir(target):
        storage.rename(staged, target)  # rename(2) replaces a file atomically
        _sync_parent(storage, parent, durable)
        return
    if storage.exchange(staged, target):
        _sync_parent(storage, parent, durable)
        _remove_old(storage, staged)  # the exchange left the old content at the staged name
        return
    old = old_name(target)
    storage.rename(target, old)
    try:
        storage.rename(staged, target)
    except BaseException as e:
        _move_back(storage, old, target, e)
        raise
    _sync_parent(storage, parent, durable)
    _remove_old(storage, old)


def _is_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


def _sync_parent(storage: Storage, parent: str, durable: bool) -> None:
    if durable:
        storage.sync_dir(parent)


def _move_back(storage: Storage, old: str, target: str, cause: BaseException) -> None:
    """The second rename of the fallback failed: the old content goes back to ``target`` (the
    caller discards ``staged``, the unfinished replacement, as after any other failure)."""
    try:
        storage.rename(old, target)
    except OSError as e:
        out = CheckpointWriteError(
            f"replacing {target} failed between its two renames ({type(cause).__name__}: {cause}) and the old "
            f"content could not be moved back ({e}): it is complete at {old}; rename it back to {target}")
        out.errno = e.errno  # (strerror left unset: it would replace the message in str())
        raise out from cause


def _remove_old(storage: Storage, old: str) -> None:
    """Delete the replaced content. The new one is in place already: a failure here leaves debris
    with a recognisable name, which is logged, not raised."""
    try:
        if _is_dir(old):
            storage.rmtree(old)
        else:
            storage.remove(old)
    except OSError as e:
        logger.warning("replaced %s, but could not delete the old content at %s: %s", old, old, e)
