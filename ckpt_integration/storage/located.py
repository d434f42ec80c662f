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

The storage operations on the directory's files are its methods (``ck.read(name)``,
``ck.open(name)``, ``ck.exists(name)``, ``ck.write(name, data)``, ``ck.remove(name)``,
``ck.listdir()``, ``ck.file(name)`` for a message or a primitive that wants a path), so nothing
above the storage layer joins a directory and a file name by hand: the containment checks of
``filesystem.checked_path`` apply to every read through them.

This base holds only the fields and those methods, so that the modules below ``opened`` can
honour them without importing it; ``filesystem`` (whose ``Storage`` the methods call) imports it.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional, Union


def is_remote(path: Union[str, "os.PathLike[str]"]) -> bool:
    """True for URLs handled by fsspec (anything with a scheme except ``file://``)."""
    p = os.fspath(path) if not isinstance(path, str) else path
    return "://" in p and not p.startswith("file://")


def join(base: str, *names: str) -> str:
    """``base/name/...``: ``/`` for URLs, ``os.path.join`` for local paths (path arithmetic, no I/O)."""
    if is_remote(base):
        return "/".join([base.rstrip("/"), *names])
    return os.path.join(base, *names)


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

    # ------------------------------------------------------------------ the directory's files
    def file(self, name: str) -> str:
        """The path of ``name`` in this directory (for messages, and primitives that take a path)."""
        return join(self.path, name)

    def exists(self, name: str) -> bool:
        return self.storage.exists(self.file(name))

    def read(self, name: str, what: str = "file", nested: bool = False, source: str = "") -> bytes:
        """All bytes of ``name``, after the containment checks (``filesystem.checked_path``: no
        ``..``, no absolute path, no link out of the directory; ``nested`` allows sub-directories;
        ``source`` names the file that named it, for the error)."""
        return self.storage.read_in(self.path, name, what, nested, source)

    def open(self, name: str, what: str = "file", nested: bool = False, source: str = "") -> Any:
        """A positional reader (``readers.FileReader``) of ``name``, after the same checks as :meth:`read`."""
        return self.storage.open_in(self.path, name, what, nested, source)

    def write(self, name: str, data: bytes, durable: bool = True, exclusive: bool = False) -> None:
        """Write ``name`` whole and atomically (``Storage.write_atomic``)."""
        self.storage.write_atomic(self.file(name), data, durable, exclusive=exclusive)

    def remove(self, name: str) -> None:
        self.storage.remove(self.file(name))

    def listdir(self) -> List[str]:
        """The names in this directory."""
        return self.storage.listdir(self.path)

    def __str__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"CheckpointLocation({self.path!r})"
