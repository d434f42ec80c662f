"""Where checkpoint files live: the local filesystem or any fsspec URL.

Everything above this module addresses files by ``(filesystem, path)`` and uses only the small set
of operations here, so the same save/load code runs on a local or shared filesystem (fast path:
``os.pwrite``/``os.preadv``, fsync) and on object stores or remote filesystems through fsspec
(``s3://``, ``gs://``, ``memory://`` ...). A local path is made absolute when it is resolved.

Atomicity on object stores: an object appears only once its upload is complete, and
``metadata.json`` is uploaded last, after every data object, so the commit protocol is the same as
on a local filesystem. Renames are copies there, so replacing an existing checkpoint
(``overwrite=True``) is refused for remote URLs rather than done non-atomically.

Containment (readers): every file a reader opens is named relative to the checkpoint directory and
goes through :func:`checked_path` (no absolute paths, no ``..``, no path separators where a plain
file name is expected, and - locally - no symbolic link that resolves outside the directory unless
``CKPT_INTEGRATION_ALLOW_SYMLINKS=1``), and is opened only if it is a regular file (``stat`` before
opening, ``fstat`` after a non-blocking open), so a FIFO, device or directory gives an error instead
of a hang. Writes that fail with an ``OSError`` (disk full, permissions) raise
:class:`~ckpt_integration.errors.CheckpointWriteError` naming the file.

**The handle** (:class:`CheckpointLocation`): what the storage functions take in place of a directory
string, one checkpoint directory's storage and path, resolved once: the readers of ``metadata.json``,
``manifest.json``, ``.metadata`` and the small whole files (``checkpoint_dir.read_config``,
``read_manifest``, ``read_verified_file``, ``load_common``, ``torch_dist.read_dcp_metadata``,
``opened.read_metadata``) and the save's claim, writers and commit (``claim.claim_new``,
``torch_dist.write_data_files``, ``checkpoint_dir.write_manifest`` ...). An entry point given a path
makes one with :func:`locate` and passes it down, so no function below it resolves the path again.
Where it holds what was read already (an :class:`~.opened.OpenedCheckpoint`, the public subclass),
the readers return that instead of reading again; a plain location holds nothing. Example::

    ck = locate("s3://bucket/ckpt/iter_100")          # fsspec resolved here, once
    manifest = checkpoint_dir.read_manifest(ck)
    md = torch_dist.read_dcp_metadata(ck, manifest=manifest)

The storage operations on the directory's files are its methods (``ck.read(name)``, ``ck.open(name)``,
``ck.exists(name)``, ``ck.write(name, data)``, ``ck.remove(name)``, ``ck.listdir()``, ``ck.file(name)``
for a message or a primitive that wants a path), so nothing above the storage layer joins a directory
and a file name by hand: :func:`checked_path` applies to every read through them. The base holds only
the fields and those methods, so the modules below ``opened`` honour them without importing it.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import os
import re
import shutil
import logging
import threading
from typing import IO, TYPE_CHECKING, Any, BinaryIO, Callable, Iterator, List, Optional, Tuple, Type, Union

from ..errors import CheckpointingException, CheckpointWriteError, CorruptCheckpointError, UnsafeCheckpointError
from .fs import atomic_write_bytes, exchange_paths, fsync_dir
from .readers import (FileReader, FsspecReader, LocalReader, exception_chain, is_exists_error, open_regular, reading, retried,
                      stream_failed)

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

logger = logging.getLogger(__name__)

# Opt-in for checkpoints whose files are symbolic links to storage elsewhere (deduplication).
ALLOW_SYMLINKS_ENV = "CKPT_INTEGRATION_ALLOW_SYMLINKS"


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

    def __init__(self, storage: Storage, path: str) -> None:
        self.storage = storage
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

    def open(self, name: str, what: str = "file", nested: bool = False, source: str = "") -> FileReader:
        """A positional reader (:class:`~.readers.FileReader`) of ``name``, after the same checks as :meth:`read`."""
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


_GLOB = re.compile(r"[*?\[]")  # what fsspec's rm/copy/expand_path read as a glob pattern


def canonical(path: Union[str, os.PathLike, CheckpointLocation]) -> str:
    """The form of a checkpoint path that two ranks compare (no I/O): URLs without a trailing ``/``,
    local paths absolute and normalized."""
    p = path.path if isinstance(path, CheckpointLocation) else os.fspath(path)
    return p.rstrip("/") if is_remote(p) else os.path.abspath(p)


def parent_of(path: Union[str, os.PathLike]) -> str:
    """The directory holding ``path`` (URLs split on ``/``; local paths made absolute first)."""
    p = os.fspath(path)
    if is_remote(p):
        return p.rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(p.rstrip(os.sep)))


def base_name(path: Union[str, os.PathLike]) -> str:
    """The last component of ``path`` (a local path or a URL)."""
    p = os.fspath(path)
    return p.rstrip("/").rsplit("/", 1)[-1] if is_remote(p) else os.path.basename(p.rstrip(os.sep))


# --------------------------------------------------------------------------- containment
def symlinks_allowed() -> bool:
    """Whether links leading outside a checkpoint may be followed (``CKPT_INTEGRATION_ALLOW_SYMLINKS=1``)."""
    return os.environ.get(ALLOW_SYMLINKS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def name_problem(name: object, nested: bool = False) -> Optional[str]:
    """Why ``name`` cannot name a file inside a checkpoint directory, or None.

    ``nested``: ``/``-separated relative paths are allowed (zarr chunk files
    ``<key>/c/0/1``); otherwise the name must be a single file name (``.metadata``
    entries, ``common.pt``). Never allowed: absolute paths, ``.``/``..`` segments,
    backslashes, NUL and other control characters.
    """
    if not isinstance(name, str) or not name:
        return "it is empty or not a string"
    if any(ord(ch) < 32 for ch in name):
        return "it contains a control character"
    if "\\" in name:
        return "it contains a backslash (a path separator on Windows)"
    if name.startswith("/") or os.path.isabs(name):
        return "it is an absolute path"
    segments = name.split("/")
    if any(seg in ("", ".", "..") for seg in segments):
        return "it has an empty, '.' or '..' path segment (it would leave its directory)"
    if not nested and len(segments) > 1:
        return "it contains a path separator (data files lie directly in the checkpoint directory)"
    return None


def checked_path(directory: str, name: str, what: str = "file", nested: bool = False, source: str = "") -> str:
    """``directory/name`` after refusing names that could lead outside ``directory``.

    Raises :class:`UnsafeCheckpointError` for unsafe names (always, trusted or not) and,
    for local checkpoints, for symbolic links that resolve outside the directory (unless
    :func:`symlinks_allowed`). ``source`` names where the name came from (for the message).
    """
    problem = name_problem(name, nested)
    where = f" (named in {source})" if source else ""
    if problem:
        raise UnsafeCheckpointError(
            f"refusing to open {what} {name!r}{where} of checkpoint {directory}: {problem}; "
            "a checkpoint may only name files inside its own directory"
        )
    path = join(directory, name)
    if not is_remote(directory) and not symlinks_allowed():
        root = os.path.realpath(directory)
        real = os.path.realpath(path)
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            raise UnsafeCheckpointError(
                f"refusing to open {what} {path}{where}: it is a symbolic link leading outside the checkpoint "
                f"directory (to {real}). If you deduplicate checkpoint storage with links on purpose, set "
                f"{ALLOW_SYMLINKS_ENV}=1 to follow them"
            )
    return path


# --------------------------------------------------------------------------- write errors
def _os_error_in(e: BaseException) -> Optional[OSError]:
    return next((x for x in exception_chain(e) if isinstance(x, OSError) and x.errno), None)


def write_error(e: BaseException, path: str) -> BaseException:
    """The library error for a failed write of ``path`` (``e`` itself if it is not an OS error; torch's
    zip writer wraps a full disk's ``OSError`` in a ``RuntimeError``: the chain is searched)."""
    if isinstance(e, CheckpointingException):
        return e
    err = _os_error_in(e)
    if err is None:
        if "No space left on device" not in str(e):
            return e
        code, reason = _errno.ENOSPC, "no space left on device"
    else:
        code, reason = err.errno, err.strerror or os.strerror(err.errno)
        reason = reason[:1].lower() + reason[1:]  # ("No space..." reads on; a path in it keeps its case)
        near = os.path.dirname(path.rstrip(os.sep)) + os.sep  # (a file elsewhere: an import's EMFILE)
        path = err.filename if isinstance(err.filename, str) and err.filename.startswith(near) else path
    out = CheckpointWriteError(f"{reason} while writing {path}")
    out.errno = code  # (strerror/filename left unset: they would replace the message in str())
    out.path = path
    return out


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """Raise :class:`CheckpointWriteError` naming ``path`` for OS errors of the block."""
    try:
        yield
    except (CheckpointingException, FileExistsError):  # FileExistsError: exclusive creates, handled by callers
        raise
    except Exception as e:
        converted = write_error(e, path)
        if converted is e:
            raise
        raise converted from e


class Storage:
    """File operations used by the backends, on one filesystem."""

    def __init__(self, fs: Optional[AbstractFileSystem] = None):
        self.fs = fs  # None: local filesystem through os
        self._lock = threading.Lock()

    @property
    def remote(self) -> bool:
        return self.fs is not None

    # -- queries -------------------------------------------------------------------
    # Remote answers never come from fsspec's listing cache: a listing cached while a save was in progress
    # (here, or in a lagging process) would hide its commit marker, or a file's size, for good.
    def _fresh(self, path: str) -> str:
        self.fs.invalidate_cache(path)
        return path

    def exists(self, path: str) -> bool:
        if not self.fs:
            return os.path.exists(path)
        self._fresh(path)
        return retried(self.fs, "exists", path)

    def isdir(self, path: str) -> bool:
        if not self.fs:
            return os.path.isdir(path)
        self._fresh(path)
        return retried(self.fs, "isdir", path)

    def listdir(self, path: str) -> List[str]:
        if self.fs:
            self._fresh(path)
            try:
                entries = retried(self.fs, "ls", path, detail=False)
            except FileNotFoundError:
                return []  # object stores have no empty directories: an unused prefix is empty
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in entries)
        return sorted(os.listdir(path))

    def size(self, path: str) -> int:
        return int(retried(self.fs, "size", self._fresh(path))) if self.fs else os.path.getsize(path)

    # -- writing -------------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        if self.fs:
            retried(self.fs, "makedirs", path, exist_ok=True, write=True)
        else:
            os.makedirs(path, exist_ok=True)

    def open_write(self, path: str, exclusive: bool = False) -> BinaryIO:
        """A new file for writing; ``exclusive`` (local): ``FileExistsError`` if it exists, so a
        save never overwrites a file another save created (object stores: overwritten).

        Remote: an object of up to one block (the filesystem's block size, 50 MiB for S3) is
        uploaded whole at ``close`` with a single, retried request; a larger one is streamed
        (multipart on S3, with the client's own retries per part). Leaving the ``with`` block
        with an exception uploads nothing (an unfinished multipart upload is aborted).
        """
        with writing(path):
            if self.fs:
                return _RemoteWriter(self.fs, path)  # type: ignore[return-value]
            return open(path, "xb" if exclusive else "wb")

    def link(self, src: str, dst: str) -> bool:
        """Put the file ``src`` at the new path ``dst`` without sending its bytes: a hard link on a
        local filesystem (both names then share one inode: deleting either leaves the other whole),
        a server-side copy on an object store. False where neither is possible (another
        filesystem, links not supported, ``src`` gone); ``FileExistsError`` if ``dst`` exists."""
        if not self.fs:
            try:
                os.link(src, dst)
            except FileExistsError:
                raise
            except OSError:  # EXDEV, EPERM, ENOTSUP, EMLINK, ENOENT: the caller writes the bytes
                return False
            return True
        try:  # cp_file: one object, named literally ("copy" reads "[", "*", "?" as a pattern)
            retried(self.fs, "cp_file", src, dst, write=True)
        except Exception:  # (no such method, no permission, source gone) - the caller writes the bytes
            return False
        return True

    def sync(self, f: BinaryIO, durable: bool) -> None:
        """Flush a file opened with :meth:`open_write` (and fsync it locally when ``durable``)."""
        f.flush()
        if durable and not self.fs:
            os.fsync(f.fileno())

    def write_atomic(self, path: str, data: bytes, durable: bool = True, exclusive: bool = False) -> None:
        """Readers see all of ``data`` or nothing (temp + rename locally, one PUT remotely).

        ``exclusive``: fail with ``FileExistsError`` if ``path`` exists (local: ``link``
        of the temporary file, atomic; remote: a conditional PUT where the filesystem
        supports one, else a check before the upload).
        """
        with writing(path):
            if self.fs:
                if exclusive:
                    self._pipe_exclusive(path, data)
                else:
                    retried(self.fs, "pipe_file", path, data, write=True)
            else:
                atomic_write_bytes(path, data, durable, exclusive=exclusive)

    def _pipe_exclusive(self, path: str, data: bytes) -> None:
        try:
            retried(self.fs, "pipe_file", path, data, mode="create", write=True)
            return
        except FileExistsError:
            raise
        except (TypeError, NotImplementedError, ValueError):
            pass  # no conditional writes here: check, then write (a small window remains)
        except OSError as e:  # (a CheckpointingException is one too: not an "exists" answer)
            if is_exists_error(e) and not isinstance(e, CheckpointingException):
                raise FileExistsError(_errno.EEXIST, "already exists", path) from None
            raise
        if self.exists(path):
            raise FileExistsError(_errno.EEXIST, "already exists", path)
        retried(self.fs, "pipe_file", path, data, write=True)

    def read_bytes(self, path: str, what: str = "file") -> bytes:
        """All bytes of a regular file (a FIFO, device or directory raises instead of blocking)."""
        if self.fs:
            try:
                # one request: objects are regular files (a "directory" is a missing key); start=0
                # asks for a ranged read, which s3fs makes without a size query first
                return retried(self.fs, "cat_file", path, start=0, what=what)
            except (FileNotFoundError, IsADirectoryError):
                if self.isdir(path):
                    raise CorruptCheckpointError(f"{what} {path} is a directory, not a regular file: refusing to read it") from None
                raise
        with reading(path):
            fd = open_regular(path, what)
            with os.fdopen(fd, "rb") as f:
                return f.read()

    def open_reader(self, path: str, what: str = "file") -> FileReader:  # (opening asks for the size, too)
        return FsspecReader(self.fs, self._fresh(path), what) if self.fs else LocalReader(path, what)

    def read_in(self, directory: str, name: str, what: str = "file", nested: bool = False, source: str = "") -> bytes:
        """:meth:`read_bytes` of ``directory/name`` after the containment checks of :func:`checked_path`."""
        return self.read_bytes(checked_path(directory, name, what, nested, source), what)

    def open_in(self, directory: str, name: str, what: str = "file", nested: bool = False, source: str = "") -> FileReader:
        """:meth:`open_reader` of ``directory/name`` after the containment checks of :func:`checked_path`."""
        return self.open_reader(checked_path(directory, name, what, nested, source), what)

    def remove(self, path: str) -> None:
        if self.fs:
            with writing(path):  # rm_file: the object named literally ("rm" expands "[", "*", "?" as a pattern)
                retried(self.fs, "rm_file", path, write=True)
        else:
            os.remove(path)

    def remove_any(self, path: str) -> None:
        """Remove a file or a whole directory."""
        if self.isdir(path):
            self.rmtree(path)
        else:
            self.remove(path)

    def rmtree(self, path: str) -> None:
        # a checkpoint is un-committed first (its commit marker goes before its data), so a
        # reader never finds a committed-looking directory with files missing: an opened
        # checkpoint then reports it removed, not damaged (storage/opened.py)
        marker = path.rstrip("/") + "/metadata.json"
        try:
            if self.exists(marker):
                self.remove(marker)
        except OSError:
            pass
        if self.fs and self.exists(path):
            with writing(path):
                if _GLOB.search(path):  # fsspec's rm would expand it as a pattern: other checkpoints'
                    files = retried(self.fs, "find", path)
                    for name in files:  # one by one, named literally
                        retried(self.fs, "rm_file", name, write=True)
                    dirs = set(retried(self.fs, "find", path, withdirs=True)) - set(files) | {path}
                    for name in sorted(dirs, key=len, reverse=True):  # (pseudo-directories: memory://)
                        try:
                            self.fs.rmdir(name)
                        except (OSError, NotImplementedError):
                            pass
                else:
                    retried(self.fs, "rm", path, recursive=True, write=True)
        elif not self.fs:
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


class _RemoteWriter:
    """A file being written to an object store (see :meth:`Storage.open_write`).

    Bytes are collected up to one block and uploaded whole at ``close`` (one idempotent
    request, retried with a deadline per attempt); past one block the object is streamed
    through the filesystem's own file object. Leaving a ``with`` block on an exception
    discards the object: nothing is uploaded, a multipart upload is aborted (closing would
    complete it with the parts sent so far).
    """

    def __init__(self, fs: AbstractFileSystem, path: str):
        self.fs, self.path = fs, path
        self.block = int(getattr(fs, "default_block_size", None) or getattr(fs, "blocksize", None) or 50 * 2**20)
        self._buf = bytearray()
        self._stream: Any = None
        self._pos = 0
        self.closed = False

    def write(self, data: Union[bytes, bytearray, memoryview]) -> int:
        n = memoryview(data).nbytes
        if self._stream is not None:
            self._streamed(self._stream.write, data)
        else:
            self._buf += data
            if len(self._buf) > self.block:
                self._stream = self._streamed(self.fs.open, self.path, "wb")
                self._streamed(self._stream.write, bytes(self._buf))
                self._buf = bytearray()
        self._pos += n
        return n

    def _streamed(self, fn: Callable[..., Any], *args: object) -> Any:
        """A step of a streamed (multipart) upload: parts are retried by the client itself (s3fs,
        botocore) and cannot be repeated from here; what still fails is an error naming the object."""
        try:
            return fn(*args)
        except CheckpointingException:
            raise
        except Exception as e:  # noqa: BLE001 - any client error: the upload of this object failed
            if isinstance(e, (PermissionError, FileNotFoundError)):
                raise
            raise stream_failed(e, self.path) from e

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        if self._stream is not None:
            self._stream.flush()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._stream is not None:
            stream, self._stream = self._stream, None
            try:
                self._streamed(stream.close)
            except BaseException:
                self._abort(stream)  # a completion that failed leaves the upload open: abort it
                raise
        else:
            data, self._buf = bytes(self._buf), bytearray()
            retried(self.fs, "pipe_file", self.path, data, write=True)

    def discard(self) -> None:
        """Upload nothing (abort a multipart upload in progress)."""
        if self.closed:
            return
        self.closed = True
        self._buf = bytearray()
        stream, self._stream = self._stream, None
        if stream is not None:
            self._abort(stream)

    def _abort(self, stream: IO[bytes]) -> None:
        try:
            if hasattr(stream, "discard"):
                stream.discard()  # s3fs: aborts the multipart upload
                stream.closed = True  # or its finaliser would try to complete the upload
            else:
                stream.close()
        except Exception as e:  # noqa: BLE001 - the original error is the one to report
            logger.warning("could not abort the upload of %s: %s (the store may keep its parts "
                           "until a lifecycle rule removes them)", self.path, e)

    def __enter__(self) -> "_RemoteWriter":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], *args: object) -> None:
        if exc_type is not None:
            self.discard()
        else:
            self.close()


_LOCAL = Storage()


def storage_for(path: Union[str, os.PathLike]) -> Tuple[Storage, str]:
    """The storage and the path to use with it: a local path made absolute, an fsspec URL kept as given.
    Entry points call it once, through :func:`locate` (a location is not a path: ``os.fspath`` refuses it)."""
    p = os.fspath(path)
    if p.startswith("file://"):
        p = p[len("file://") :]
    if not p:
        raise CheckpointingException("no checkpoint path: an empty string was given")
    if not is_remote(p):  # absolute now: a background save must not follow a later chdir (Hydra's)
        return _LOCAL, p if os.path.isabs(p) else os.path.join(_cwd(p), p)
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec is a dependency
        raise ImportError(f"{p} is a URL: install fsspec (and the filesystem's package, e.g. s3fs)") from None
    fs, _ = fsspec.core.url_to_fs(p)
    return Storage(fs), p.rstrip("/")


def _cwd(relative: str) -> str:
    try:  # (os.getcwd's own error names nothing)
        return os.getcwd()
    except FileNotFoundError:
        raise CheckpointingException(f"{relative}: a relative path, and the working directory was removed") from None


def locate(where: Union[str, os.PathLike, CheckpointLocation]) -> CheckpointLocation:
    """The handle the storage helpers take for the checkpoint at ``where``: ``where`` itself when
    it is one (an opened checkpoint keeps what it read), else one with its storage resolved here."""
    return where if isinstance(where, CheckpointLocation) else CheckpointLocation(*storage_for(where))
