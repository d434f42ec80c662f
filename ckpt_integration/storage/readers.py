"""Reading checkpoint files: the reader interface, the local reader (``preadv``), the remote one
(fsspec) with the bounded retries every remote request goes through. (Shared mappings of local data
files: :mod:`.fs`.)

:class:`FileReader` is what the backends read through. :class:`LocalReader` reads a local regular
file (opened by :func:`open_regular`: never a FIFO or a device).
:class:`FsspecReader` reads objects of any fsspec filesystem with ranged requests, retried
(:func:`retried`) and coalesced through read-ahead windows shared by the reading threads.

**Retries of remote requests** (:func:`retried`; :func:`retry_delay` for zarr's asynchronous stores; every
remote operation of :class:`~ckpt_integration.storage.filesystem.Storage`). Object stores fail in
passing (500/503 answers, ``SlowDown`` throttling, reset connections, requests that hang). Clients
retry some of that themselves (s3fs and botocore, with their own counts); what they cannot give is
a bound on a request that hangs, an error that names the checkpoint file, and a retry of a request
that failed after their own retries. So:

* each attempt has a deadline (``CKPT_INTEGRATION_IO_TIMEOUT`` seconds, default 120; enforced
  for asynchronous fsspec filesystems such as s3fs, gcsfs, adlfs, whose request is cancelled);
* transient failures (timeouts, connection errors, throttling, 5xx answers) are retried up to
  ``CKPT_INTEGRATION_IO_ATTEMPTS`` attempts in all (default 4), waiting a random time up to
  ``CKPT_INTEGRATION_IO_BACKOFF`` seconds (default 1) doubled after every attempt, at most 30 s;
* then :class:`CheckpointWriteError` / :class:`CheckpointReadError` names the object, the
  number of attempts and the time spent. Permanent failures (missing object, access denied,
  invalid request) are not retried.

Only idempotent whole-object requests are retried (read a range, list, stat, put a whole object, delete). A
write that timed out may still take effect later: a late data object is in no commit; a late ``metadata.json``
of a failed save names files the manifest check finds missing (damaged, never wrong data); an exclusive create
whose answer was lost finds the object on the retry: its callers check whether it is their own.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import inspect
import logging
import os
import random
import stat
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from ..errors import CheckpointingException, CheckpointReadError, CheckpointWriteError, CorruptCheckpointError
from .fs import pread_exact, tensor_buffer

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

logger = logging.getLogger(__name__)


class FileReader:
    """Random-access reads of one file, safe to share between threads."""

    size: int
    path: str

    def read(self, offset: int, length: int) -> bytes:  # pragma: no cover - interface
        raise NotImplementedError

    def read_into(self, buf: memoryview, offset: int) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def readv(self, buffers: Sequence[memoryview], offset: int) -> None:
        """Fill ``buffers`` in order from consecutive bytes starting at ``offset``."""
        for b in buffers:
            self.read_into(b, offset)
            offset += len(b)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- local files
_KINDS = (
    (stat.S_ISDIR, "directory"),
    (stat.S_ISFIFO, "FIFO (named pipe)"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
)


def not_regular(mode: int, path: str, what: str) -> CorruptCheckpointError:
    kind = next((k for test, k in _KINDS if test(mode)), "special file")
    return CorruptCheckpointError(
        f"{what} {path} is a {kind}, not a regular file: refusing to read it (a checkpoint holds only regular files)"
    )


def open_regular(path: str, what: str = "file") -> int:
    """A read-only fd of ``path`` if it is a regular file; never blocks on FIFOs or devices.

    ``stat`` first (a device is never opened: opening some has side effects), then a
    non-blocking open and ``fstat`` of what was actually opened.
    """
    st = os.stat(path)  # FileNotFoundError passes through: callers name the missing file
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(st.st_mode, path, what)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(st.st_mode, path, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def reading(path: str) -> Iterator[None]:
    """Raise :class:`CheckpointReadError` naming ``path`` for OS errors of the block (a missing
    file passes through as ``FileNotFoundError``: callers say which checkpoint file is missing)."""
    try:
        yield
    except (CheckpointingException, FileNotFoundError):
        raise
    except OSError as e:
        reason = e.strerror or str(e)  # (first letter lowered: a path in it keeps its case)
        out = CheckpointReadError(f"{reason[:1].lower() + reason[1:]} while reading {path}")
        out.errno = e.errno
        raise out from e



# iovecs per preadv call (Linux IOV_MAX is 1024)
_IOV_MAX = 1024


class LocalReader(FileReader):
    """Positional reads of one local regular file (``preadv`` on a descriptor opened by
    :func:`open_regular`)."""

    def __init__(self, path: str, what: str = "file"):
        self.path = path
        with reading(path):
            self.fd = open_regular(path, what)
            self.size = os.fstat(self.fd).st_size

    def read(self, offset: int, length: int) -> bytes:
        with reading(self.path):
            return os.pread(self.fd, length, offset)

    def read_into(self, buf: memoryview, offset: int) -> None:
        with reading(self.path):
            pread_exact(self.fd, buf, offset, self.path)

    def readv(self, buffers: Sequence[memoryview], offset: int) -> None:
        """One ``preadv`` per up to 1024 buffers (a short read at the file end raises)."""
        with reading(self.path):
            self._readv(buffers, offset)

    def _readv(self, buffers: Sequence[memoryview], offset: int) -> None:
        buffers = [b for b in buffers if len(b)]
        i = 0
        while i < len(buffers):
            group = buffers[i : i + _IOV_MAX]
            want = sum(len(b) for b in group)
            n = os.preadv(self.fd, group, offset)
            if n == want:
                offset += n
                i += len(group)
                continue
            # rare: an interrupted or short read; finish this group buffer by buffer
            for b in group:
                if n >= len(b):
                    n -= len(b)
                else:
                    pread_exact(self.fd, b[n:], offset + n, self.path)
                    n = 0
                offset += len(b)
            i += len(group)

    def close(self) -> None:
        os.close(self.fd)


# --------------------------------------------------------------------------- retries of remote requests
ATTEMPTS_ENV = "CKPT_INTEGRATION_IO_ATTEMPTS"
TIMEOUT_ENV = "CKPT_INTEGRATION_IO_TIMEOUT"
BACKOFF_ENV = "CKPT_INTEGRATION_IO_BACKOFF"
MAX_BACKOFF_S = 30.0

# errnos of transient failures (s3fs: SlowDown / ServiceUnavailable -> EBUSY, InternalError -> EREMOTEIO)
_TRANSIENT_ERRNOS = {_errno.EBUSY, _errno.EAGAIN, _errno.ETIMEDOUT, _errno.ECONNRESET, _errno.ECONNABORTED,
                     _errno.ECONNREFUSED, _errno.EPIPE, _errno.EHOSTUNREACH, _errno.ENETUNREACH,
                     getattr(_errno, "EREMOTEIO", 121)}
_TRANSIENT_WORDS = ("slowdown", "slow down", "reduce your request rate", "throttl", "serviceunavailable",
                    "service unavailable", "internalerror", "internal error", "timed out", "timeout",
                    "connection reset", "connection aborted", "server disconnected", "connection closed",
                    "broken pipe", "too many requests", "requesttimeout")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long a remote request is tried (see the module doc for the defaults)."""

    attempts: int = 4
    timeout: float = 120.0
    backoff: float = 1.0

    @staticmethod
    def from_env() -> "RetryPolicy":
        def number(name: str, default: float, cast: Callable[[str], Any]) -> Any:
            raw = os.environ.get(name, "").strip()
            if not raw:
                return default
            try:
                value = cast(raw)
            except ValueError:
                raise CheckpointingException(f"{name}={raw!r} is not a number") from None
            if value < (1 if cast is int else 0):
                raise CheckpointingException(f"{name}={raw!r} is out of range")
            return value

        return RetryPolicy(number(ATTEMPTS_ENV, 4, int), number(TIMEOUT_ENV, 120.0, float), number(BACKOFF_ENV, 1.0, float))

    def wait(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based): full jitter, exponential, capped."""
        return random.uniform(0, min(MAX_BACKOFF_S, self.backoff * 2 ** (attempt - 1)))


def exception_chain(e: BaseException) -> Iterator[BaseException]:
    """``e`` and its causes (``__cause__``, else ``__context__``), at most 16."""
    seen = 0
    while e is not None and seen < 16:
        yield e
        e = e.__cause__ or e.__context__
        seen += 1


def is_transient(e: BaseException) -> bool:
    """Whether a failed request may succeed when repeated (timeout, connection, throttling, 5xx)."""
    if isinstance(e, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError,
                      CheckpointingException)):
        return False
    for x in exception_chain(e):
        if isinstance(x, (TimeoutError, ConnectionError)):
            return True
        response = getattr(x, "response", None)  # botocore ClientError
        if isinstance(response, dict):
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            code = str((response.get("Error") or {}).get("Code", ""))
            if (isinstance(status, int) and (status >= 500 or status == 429)) or "Throttl" in code or code in (
                    "SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable"):
                return True
        if isinstance(x, OSError) and x.errno in _TRANSIENT_ERRNOS:
            return True
        name = type(x).__name__
        if name in ("ClientConnectionError", "ClientOSError", "ServerDisconnectedError", "ClientPayloadError",
                    "ConnectionClosedError", "EndpointConnectionError", "ReadTimeoutError", "ConnectTimeoutError",
                    "ResponseStreamingError", "IncompleteRead", "ServerTimeoutError"):
            return True
        text = str(x).lower()
        if any(w in text for w in _TRANSIENT_WORDS):
            return True
    return False


def _supports_timeout(fs: AbstractFileSystem, fn: Callable[..., object]) -> bool:
    """The blocking methods that fsspec derives from an asynchronous filesystem's coroutines
    (s3fs, gcsfs, adlfs ...) take ``timeout=`` (the coroutine is cancelled when it passes)."""
    return not getattr(fs, "asynchronous", False) and inspect.iscoroutinefunction(getattr(fn, "__wrapped__", None))


def retried(fs: AbstractFileSystem, method: str, path: str, *args: object, write: bool = False, what: str = "",
            **kwargs: object) -> Any:
    """``getattr(fs, method)(path, *args, **kwargs)`` with per-attempt deadlines and bounded retries (the error
    when they are spent: :func:`retry_delay`; ``what`` says what the object is, for the message)."""
    policy = RetryPolicy.from_env()
    fn = getattr(fs, method)
    if policy.timeout > 0 and _supports_timeout(fs, fn):
        kwargs["timeout"] = policy.timeout
    start, attempt = time.monotonic(), 0
    while True:
        attempt += 1
        try:
            return fn(path, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - classified by retry_delay
            time.sleep(retry_delay(e, policy, attempt, start, method, path, write, what))


def is_exists_error(e: BaseException) -> bool:  # (an exclusive create refused: the object exists; S3's 412)
    return isinstance(e, FileExistsError) or (isinstance(e, OSError) and (
        e.errno == _errno.EEXIST or "PreconditionFailed" in str(e) or "412" in str(e)))


def retry_delay(e: Exception, policy: "RetryPolicy", attempt: int, start: float, method: str, path: str,
                write: bool = False, what: str = "") -> float:
    """After attempt ``attempt`` (the first began at ``start``) of ``method`` on ``path`` failed with ``e``: the
    seconds to wait before the next one (logged). Raises ``e`` when it is not transient, and :func:`gave_up`'s
    error (``CheckpointWriteError`` if ``write``, else ``CheckpointReadError``) when the attempts are spent."""
    if not is_transient(e):
        raise e
    if attempt >= policy.attempts:
        raise gave_up(e, path, attempt, time.monotonic() - start, write, what) from e
    delay = policy.wait(attempt)
    logger.warning("%s %s failed (attempt %d of %d): %s; retrying in %.1fs", method, path, attempt,
                   policy.attempts, _reason(e), delay)
    return delay


def _reason(e: BaseException) -> str:
    if type(e).__name__ == "FSTimeoutError" or (isinstance(e, TimeoutError) and not str(e)):
        return "no answer within the deadline (timed out)"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def gave_up(e: BaseException, path: str, attempts: int, seconds: float, write: bool,
            what: str = "") -> CheckpointingException:
    """The error raised when every attempt of a request to ``path`` failed."""
    cls = CheckpointWriteError if write else CheckpointReadError
    verb = "writing" if write else "reading"
    label = f"{what} " if what else ""
    out = cls(f"{verb} {label}{path} failed after {attempts} attempt(s) in {seconds:.1f}s "
              f"({ATTEMPTS_ENV}, {TIMEOUT_ENV}): {_reason(e)}")
    out.errno = getattr(e, "errno", None) or _errno.EIO
    out.path = path
    out.transient = True  # (the store did not answer: nothing says the object is damaged)
    return out


def stream_failed(e: BaseException, path: str) -> CheckpointingException:
    """The error raised when a streamed (multipart) upload of ``path`` failed: its parts are
    retried by the storage client (s3fs, botocore: their own retry settings), not here."""
    out = CheckpointWriteError(f"writing {path} failed (a streamed multipart upload, whose parts the storage "
                               f"client retries by its own settings; the upload was aborted): {_reason(e)}")
    out.errno = getattr(e, "errno", None) or _errno.EIO
    out.path = path
    return out


# --------------------------------------------------------------------------- remote objects
class Window:
    """Bytes ``[start, end)`` of one object, fetched once for every thread (``data`` is None
    while the request is in flight; ``ready`` is set when it arrived or failed)."""

    __slots__ = ("reader", "start", "end", "data", "ready")

    def __init__(self, reader: "FsspecReader", start: int, end: int):
        self.reader, self.start, self.end = reader, start, end
        self.data: Optional[memoryview] = None
        self.ready = threading.Event()


class ReadAheadWindows:
    """The read-ahead windows of every remote object being read, at most ``limit`` bytes in all
    (oldest dropped first), so memory stays bounded however many objects a load opens."""

    def __init__(self, limit: int):
        self.limit = limit
        self.lock = threading.Lock()
        self.windows: List[Window] = []  # oldest first
        self.nbytes = 0

    def _holding(self, reader: "FsspecReader", pos: int) -> Optional[Window]:
        for w in reversed(self.windows):  # under self.lock
            if w.reader is reader and w.start <= pos < w.end:
                return w
        return None

    def holding(self, reader: "FsspecReader", pos: int) -> Optional[Window]:
        """The window of ``reader``'s object holding byte ``pos`` (fetched or in flight), if any."""
        with self.lock:
            return self._holding(reader, pos)

    def claim(self, reader: "FsspecReader", start: int, end: int) -> Tuple[Window, bool]:
        """The window holding byte ``start`` (fetched or in flight), or a new one up to ``end``
        (cut where another window of the object begins, so no byte is fetched twice) that the
        caller must fill; second value: whether it is new. Atomic, so two threads starting at
        once do not both fetch the same range."""
        with self.lock:
            w = self._holding(reader, start)
            if w is not None:
                return w, False
            end = min([end] + [w.start for w in self.windows if w.reader is reader and w.start > start])
            w = Window(reader, start, end)
            self.windows.append(w)
            self.nbytes += end - start
            while self.nbytes > self.limit and len(self.windows) > 1:
                old = self.windows.pop(0)
                self.nbytes -= old.end - old.start
        return w, True

    def drop(self, reader: "FsspecReader", w: Optional[Window] = None) -> None:
        with self.lock:
            keep = [x for x in self.windows if not (x.reader is reader and (w is None or x is w))]
            self.nbytes -= sum(x.end - x.start for x in self.windows if x not in keep)
            self.windows = keep


class FsspecReader(FileReader):
    """Ranged reads of one object (each a request, retried, see :func:`retried`), coalesced.

    A load reads each stored item as a few ranges in file order: the archive header (a few
    hundred bytes), the data, the trailer, then the next item's header, often from several
    threads at once. Sent as they come that is three requests per tensor (56 GETs for 16 tensors
    of 1 MiB, where PyTorch DCP's reader made 4). So a read shorter than :attr:`READ_AHEAD` that
    finds no fetched (or in-flight) window holding it fetches ``READ_AHEAD`` bytes from its start
    and leaves them as a window that every thread reading this object uses; a thread whose bytes
    are in flight waits for them instead of asking again. Windows of all objects together are
    bounded (:attr:`WINDOW_BYTES`). Longer reads (the data of large items) are one request each,
    in pieces of :attr:`piece_bytes`. Every byte is still verified by the caller's checksums.
    """

    # Objects up to this size are fetched whole by the first read, and later reads are served
    # from memory: one request instead of one per range (archive header, data, trailer, ...).
    WHOLE_OBJECT_BYTES = 4 * 2**20
    # Bytes fetched for a short read that misses every window (see the class docstring) ...
    READ_AHEAD = 8 * 2**20
    # ... and the windows of all objects kept at once.
    WINDOW_BYTES = 64 * 2**20
    # Direct reads into a destination go in pieces of this size (region_read): a request each,
    # so far larger than the cache-sized pieces of local reads.
    piece_bytes = 64 * 2**20

    _windows = ReadAheadWindows(WINDOW_BYTES)

    def __init__(self, fs: AbstractFileSystem, path: str, what: str = "file"):
        self.fs, self.path, self.what = fs, path, what
        self._whole: Optional[memoryview] = None
        self._lock = threading.Lock()
        info = retried(fs, "info", path, what=what)
        if info.get("type", "file") != "file":
            raise CorruptCheckpointError(f"{what} {path} is a {info.get('type')}, not a regular file: refusing to read it")
        self.size = int(info.get("size") if info.get("size") is not None else retried(fs, "size", path, what=what))

    def _fetch(self, start: int, end: int) -> bytes:
        return retried(self.fs, "cat_file", self.path, start=start, end=end, what=self.what)

    def read(self, offset: int, length: int) -> bytes:
        end = min(offset + length, self.size)
        if end <= offset:
            return b""
        if self.size <= self.WHOLE_OBJECT_BYTES:
            with self._lock:
                if self._whole is None:
                    self._whole = memoryview(self._fetch(0, self.size))
            return bytes(self._whole[offset:end])
        parts: List[bytes] = []
        while offset < end:
            w = self._windows.holding(self, offset)
            if w is None:
                if end - offset >= self.READ_AHEAD:  # long: one request of its own, no window
                    parts.append(self._fetch(offset, end))
                    break
                stop = offset + self.READ_AHEAD
                if self.size - stop < self.READ_AHEAD // 2:  # a short rest of the object comes along
                    stop = self.size
                w, new = self._windows.claim(self, offset, stop)  # cut where a later window begins
                if new:
                    self._fill(w)
            w.ready.wait()  # another thread may be fetching it
            if w.data is None:  # that fetch failed (and raised there): ask for these bytes directly
                parts.append(self._fetch(offset, end))
                break
            have = min(end, w.start + len(w.data))
            if have <= offset:  # the object ended early: the callers' length checks report it
                break
            parts.append(bytes(w.data[offset - w.start : have - w.start]))
            offset = have  # the rest, if any, from the next window or request
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _fill(self, w: Window) -> None:
        """Fetch a window this thread claimed; a failed fetch leaves no window behind."""
        try:
            w.data = memoryview(self._fetch(w.start, w.end))
        except BaseException:
            self._windows.drop(self, w)
            raise
        finally:
            w.ready.set()

    def close(self) -> None:
        self._whole = None
        self._windows.drop(self)

    def read_into(self, buf: memoryview, offset: int) -> None:
        data = self.read(offset, len(buf))
        if len(data) != len(buf):
            raise CorruptCheckpointError(
                f"{self.path} is truncated: needed bytes [{offset}, {offset + len(buf)}) but the file ends at "
                f"{offset + len(data)}"
            )
        buf[:] = data

    def readv(self, buffers: Sequence[memoryview], offset: int) -> None:
        total = sum(len(b) for b in buffers)
        data = memoryview(self.read(offset, total))
        if len(data) != total:
            raise CorruptCheckpointError(
                f"{self.path} is truncated: needed bytes [{offset}, {offset + total}) but the file ends at {offset + len(data)}"
            )
        pos = 0
        for b in buffers:
            b[:] = data[pos : pos + len(b)]
            pos += len(b)

# --------------------------------------------------------------------------- shared mappings of local data files

def read_bytes(file_reader: FileReader, start: int, length: int) -> torch.Tensor:
    """``length`` bytes of a file from ``start`` into a new byte tensor (files that are not mapped)."""
    buf = torch.empty(length, dtype=torch.uint8)
    if length:
        file_reader.readv([tensor_buffer(buf)], start)
    return buf


