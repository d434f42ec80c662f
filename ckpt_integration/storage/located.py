"""The handle the storage functions take: one checkpoint directory's storage and path, resolved once.

:class:`CheckpointLocation` is what the storage functions take in place of a directory string:
the readers of ``metadata.json``, ``manifest.json``, ``.metadata`` and the small whole files
(``checkpoint_dir.read_config``, ``read_manifest``, ``read_verified_file``, ``load_common``,
``torch_dist.read_dcp_metadata``, ``backends.read_metadata``) and the save's claim, writers and
commit (``claim.claim_new``, ``torch_dist.write_data_files``, ``checkpoint_dir.write_manifest``
...). An entry point given a path makes one with :func:`~.filesystem.locate` and passes it down,
so no function below it resolves the path again. Where the location holds what was read already
(an :class:`~.opened.OpenedCheckpoint`, the public subclass), the readers return that instead of
reading the file again; a plain location holds nothing, and every reader reads.

Example::

    ck = locate("s3://bucket/ckpt/iter_100")          # fsspec resolved here, once
    manifest = checkpoint_dir.read_manifest(ck)
    md = torch_dist.read_dcp_metadata(ck, manifest=manifest)

This base holds only the fields, so that the modules below ``opened`` can honour them without
importing it.
"""

from __future__ import annotations

from typing import Any, Optional


class CheckpointLocation:
    """Storage and path of one checkpoint, plus what was read of it (``None``: not read).

    ``manifest_read`` tells a read manifest of ``None`` (a checkpoint of another writer) from one
    not read yet. ``str()`` gives the path, for messages. It is not a path (no ``__fspath__``),
    so it is never turned back into a string by accident and re-read from storage below the
    entry point that made it.
    """

    config: Any = None
    manifest: Any = None
    manifest_read: bool = False
    dcp_metadata: Any = None
    # small whole files read and checked against the manifest (common.pt): name -> bytes; None:
    # not kept (set by the opened checkpoint, dropped when it is closed)
    file_cache: Optional[dict] = None

    def __init__(self, storage: Any, path: str) -> None:
        self.storage = storage  # filesystem.Storage (which imports this module)
        self.path = path

    def at(self, path: str) -> "CheckpointLocation":
        """The checkpoint at ``path`` on the same storage (a sibling, a sub-directory), nothing read of
        it: no path resolved again."""
        return CheckpointLocation(self.storage, path)

    def afresh(self) -> "CheckpointLocation":
        """This directory with nothing read: its readers read what storage holds now, never what an
        opened checkpoint kept (the commit identity, ``verify``'s file checks)."""
        return self.at(self.path)

    def __str__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"CheckpointLocation({self.path!r})"
