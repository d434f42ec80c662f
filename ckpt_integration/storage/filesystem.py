"""Where checkpoint files live: the local filesystem or any fsspec URL.

Everything above this module addresses files by ``(filesystem, path)`` and
uses only the small set of operations here, so the same save/load code runs on
a local or shared filesystem (fast path: ``os.pwrite``/``os.preadv``, fsync) and
on object stores or remote filesystems through fsspec (``s3://``, ``gs://``,
``memory://`` ...).

Atomicity on object stores: an object appears only once its upload is
complete, and ``metadata.json`` is uploaded last, after every data object, so
the commit protocol is the same as on a local filesystem. Renames are copies
there, so replacing an existing checkpoint (``overwrite=True``) is refused
for remote URLs rather than done non-atomically.
"""

from __future__ import annotations

import os
import shutil
import threading
from typing import Any, BinaryIO, List, Tuple

from .fs import atomic_write_bytes, exchange_paths, fsync_dir, pread_exact


def is_remote(path: Any) -> bool:
    """True for URLs handled by fsspec (anything with a scheme except ``file://``)."""
    p = os.fspath(path) if not isinstance(path, str) else path
    return "://" in p and not p.startswith("file://")


def join(base: str, *names: str) -> str:
    if is_remote(base):
        return "/".join([base.rstrip("/"), *names])
    return os.path.join(base, *names)


class FileReader:
    """Random-access reads of one file, safe to share between threads."""

    size: int
    path: str

    def read(self, offset: int, length: int) -> bytes:  # pragma: no cover - interface
        raise NotImplementedError

    def read_into(self, buf: memoryview, offset: int) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        pass


class _LocalReader(FileReader):
    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size

    def read(self, offset: int, length: int) -> bytes:
        return os.pread(self.fd, length, offset)

    def read_into(self, buf: memoryview, offset: int) -> None:
        pread_exact(self.fd, buf, offset, self.path)

    def close(self) -> None:
        os.close(self.fd)


class _FsspecReader(FileReader):
    def __init__(self, fs: Any, path: str):
        self.fs, self.path = fs, path
        self.size = int(fs.size(path))

    def read(self, offset: int, length: int) -> bytes:
        end = min(offset + length, self.size)
        if end <= offset:
            return b""
        return self.fs.cat_file(self.path, start=offset, end=end)

    def read_into(self, buf: memoryview, offset: int) -> None:
        data = self.read(offset, len(buf))
        if len(data) != len(buf):
            from ..errors import CorruptCheckpointError

            raise CorruptCheckpointError(
                f"{self.path} is truncated: needed bytes [{offset}, {offset + len(buf)}) but the file ends at "
                f"{offset + len(data)}"
            )
        buf[:] = data


class Storage:
    """File operations used by the backends, on one filesystem."""

    def __init__(self, fs: Any = None):
        self.fs = fs  # None: local filesystem through os
        self._lock = threading.Lock()

    @property
    def remote(self) -> bool:
        return self.fs is not None

    # -- queries -------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        return self.fs.exists(path) if self.fs else os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return self.fs.isdir(path) if self.fs else os.path.isdir(path)

    def listdir(self, path: str) -> List[str]:
        if self.fs:
            try:
                entries = self.fs.ls(path, detail=False)
            except FileNotFoundError:
                return []  # object stores have no empty directories: an unused prefix is empty
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in entries)
        return sorted(os.listdir(path))

    def size(self, path: str) -> int:
        return int(self.fs.size(path)) if self.fs else os.path.getsize(path)

    # -- writing -------------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        if self.fs:
            self.fs.makedirs(path, exist_ok=True)
        else:
            os.makedirs(path, exist_ok=True)

    def open_write(self, path: str) -> BinaryIO:
        return self.fs.open(path, "wb") if self.fs else open(path, "wb")

    def sync(self, f: BinaryIO, durable: bool) -> None:
        """Flush a file opened with :meth:`open_write` (and fsync it locally when ``durable``)."""
        f.flush()
        if durable and not self.fs:
            os.fsync(f.fileno())

    def write_atomic(self, path: str, data: bytes, durable: bool = True) -> None:
        """Readers see all of ``data`` or nothing (temp + rename locally, one PUT remotely)."""
        if self.fs:
            self.fs.pipe_file(path, data)
        else:
            atomic_write_bytes(path, data, durable)

    def read_bytes(self, path: str) -> bytes:
        if self.fs:
            return self.fs.cat_file(path)
        with open(path, "rb") as f:
            return f.read()

    def open_reader(self, path: str) -> FileReader:
        return _FsspecReader(self.fs, path) if self.fs else _LocalReader(path)

    def remove(self, path: str) -> None:
        if self.fs:
            self.fs.rm(path)
        else:
            os.remove(path)

    def remove_any(self, path: str) -> None:
        """Remove a file or a whole directory."""
        if self.isdir(path):
            self.rmtree(path)
        else:
            self.remove(path)

    def rmtree(self, path: str) -> None:
        if self.fs:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        else:
            shutil.rmtree(path, ignore_errors=True)

    def rename(self, src: str, dst: str) -> None:
        if self.fs:
            raise OSError(f"cannot rename {src} on a remote filesystem atomically")
        os.rename(src, dst)

    def exchange(self, a: str, b: str) -> bool:
        """Swap two local directories atomically; False where this filesystem cannot."""
        if self.fs:
            return False
        return exchange_paths(a, b)

    def sync_dir(self, path: str) -> None:
        if not self.fs:
            fsync_dir(path)


_LOCAL = Storage()


def storage_for(path: Any) -> Tuple[Storage, str]:
    """The storage and the path to use with it, for a local path or an fsspec URL.

    fsspec filesystems accept full URLs, so remote paths are kept as given.
    """
    p = os.fspath(path)
    if p.startswith("file://"):
        p = p[len("file://") :]
    if not is_remote(p):
        return _LOCAL, p
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec is a dependency
        raise ImportError(f"{p} is a URL: install fsspec (and the filesystem's package, e.g. s3fs)") from None
    fs, _ = fsspec.core.url_to_fs(p)
    return Storage(fs), p.rstrip("/")
