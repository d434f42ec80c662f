"""A checkpoint whose storage was resolved, and whose small files were read, once.

:class:`CheckpointLocation` is what every storage helper accepts wherever it takes a checkpoint
directory: ``storage_for`` returns its storage without resolving the path again, and the readers
of ``metadata.json``, ``manifest.json`` and ``.metadata`` (``checkpoint_dir.read_config``,
``read_manifest``, ``read_manifest_checked``, ``torch_dist.read_dcp_metadata``) return what it
holds instead of reading the file again. So an entry point that opened a checkpoint passes one
object down, and no helper below it turns back to storage for facts already read.

:class:`~.opened.OpenedCheckpoint` (the public object) is one; this base holds only the fields,
so that the modules below ``opened`` can honour them without importing it.
"""

from __future__ import annotations

import os
from typing import Any, Optional


class CheckpointLocation:
    """Storage and path of one checkpoint, plus what was read of it (``None``: not read).

    ``manifest_read`` tells a read manifest of ``None`` (a checkpoint of another writer) from one
    not read yet. ``str()`` gives the path, for messages. It is not a path (no ``__fspath__``):
    code that needs one asks :func:`path_of`, so an opened checkpoint is never turned back into a
    string by accident and re-read from storage below the entry point that opened it.
    """

    storage: Any  # filesystem.Storage (which imports this module)
    path: str
    config: Any = None
    manifest: Any = None
    manifest_read: bool = False
    dcp_metadata: Any = None
    # small whole files read and checked against the manifest (common.pt): name -> bytes; None:
    # not kept (set by the opened checkpoint, dropped when it is closed)
    file_cache: Optional[dict] = None

    def __str__(self) -> str:
        return self.path


def path_of(where: object) -> str:
    """The path (or fsspec URL) of a checkpoint given as a location or as a path."""
    return where.path if isinstance(where, CheckpointLocation) else os.fspath(where)  # type: ignore[arg-type]


def cached_config(where: object) -> Any:
    """``metadata.json`` as read at open, or ``None`` (not a location, or not read)."""
    return where.config if isinstance(where, CheckpointLocation) else None


def cached_manifest(where: object) -> "tuple[bool, Any]":
    """``(True, manifest)`` when ``where`` read its manifest already (``None`` for a checkpoint of
    another writer), else ``(False, None)``."""
    if isinstance(where, CheckpointLocation) and where.manifest_read:
        return True, where.manifest
    return False, None


def cached_dcp_metadata(where: object) -> Optional[Any]:
    return where.dcp_metadata if isinstance(where, CheckpointLocation) else None

