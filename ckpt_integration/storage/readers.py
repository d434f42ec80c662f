"""Random-access readers of checkpoint files: the interface, and the remote one (fsspec).

:class:`FileReader` is what the backends read through (the local reader, ``preadv`` on a file
descriptor, lives with the rest of the local file operations in :mod:`.filesystem`).
:class:`FsspecReader` reads objects of any fsspec filesystem with ranged requests, retried
(:mod:`.retry`) and coalesced through read-ahead windows shared by the reading threads.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

from ..errors import CorruptCheckpointError
from . import retry

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem


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
    """Ranged reads of one object (each a request, retried, see :mod:`.retry`), coalesced.

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
        info = retry.call(fs, "info", path, what=what)
        if info.get("type", "file") != "file":
            raise CorruptCheckpointError(f"{what} {path} is a {info.get('type')}, not a regular file: refusing to read it")
        self.size = int(info.get("size") if info.get("size") is not None else retry.call(fs, "size", path, what=what))

    def _fetch(self, start: int, end: int) -> bytes:
        return retry.call(self.fs, "cat_file", self.path, start=start, end=end, what=self.what)

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
