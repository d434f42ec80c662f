"""Reading a region of one stored tensor chunk: verified, each byte read once, bounded buffers.

A stored chunk is a row-major array of ``shape`` at byte ``data_start`` of its item; a request
is the box ``starts``/``lens`` of it. The bytes that must be read are those of the *blocks*
the request touches (block digests recorded at save, see ``checksum.py``): a ranged read
reads and checks only those, a strided read that touches every block reads the covering
span once. Without block records (checkpoints saved before them) the item is one block,
checked whole, and without checksums (foreign checkpoints, ``verify_checksums=False``) only
the requested runs are read (gaps below ``GAP_READ`` read through).

How the bytes get into ``out``:

* **direct**: the request is one contiguous run and ``out`` has the stored dtype:
  ``preadv`` places the run straight into ``out`` - as one buffer if ``out`` is contiguous,
  or as one buffer per row of ``out`` if its rows are contiguous and at least
  ``SCATTER_MIN`` long (e.g. a row split loaded into column slices of the destination).
  Bytes of partly needed blocks go to a small scratch buffer, only to be checksummed;
* **window**: anything else (strided requests such as a column slice of a row-major chunk,
  short rows, a different ``out`` dtype): pieces of at most ``PIECE`` bytes go into a
  per-thread scratch buffer and the request's rows are copied (and cast) out of it with one
  strided ``copy_`` per piece, while the piece is still in cache.

Either way the bytes are read in pieces in file order, each piece is checksummed right
after it was read (cache-hot; XXH3 and zlib-ng's CRC32 release the GIL for large inputs, so
threads reading other chunks proceed meanwhile), a block split across pieces is hashed with a
running digest, and a mismatch raises
:class:`CorruptCheckpointError` naming the file, the byte range and the tensor.
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
import threading
import time
from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import CorruptCheckpointError
from .checksum import BlockHash
from .fs import tensor_buffer
from .readers import FileReader

if TYPE_CHECKING:
    from typing_extensions import Buffer

# Bytes read (and checksummed) per step: small enough to stay in cache between the read,
# the checksum and the copy out of the scratch buffer (window reads) ...
PIECE = 8 << 20
# ... and for reads straight into the destination, where the checksum reads what was just
# written there: a few blocks, so they are still in the core's cache.
DIRECT_PIECE = 2 << 20
# Without checksums, gaps between runs below this are read rather than skipped: a read call
# per run (and its bookkeeping) costs more than copying a few pages.
GAP_READ = 16 << 10
# Room in the reused scratch buffers beyond a piece: the touched blocks' bytes around it.
SLACK = 4 << 20

_scratch = threading.local()


def scratch_buffer(nbytes: int, which: int = 0) -> torch.Tensor:
    """A uint8 buffer of at least ``nbytes``: reused per thread (``which``: 0 for windows,
    1 for the head/tail bytes of direct reads) up to ``PIECE + SLACK`` bytes (a piece plus
    the parts of blocks around it).

    Larger (rare: blocks larger than usual, or gaps inside a row) is a fresh allocation,
    whose pages never read into stay untouched and cost no memory.
    """
    if nbytes > PIECE + SLACK:
        return torch.empty(nbytes, dtype=torch.uint8)
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = [None, None]
    if bufs[which] is None or bufs[which].numel() < nbytes:  # PIECE or SLACK grew since it was made
        bufs[which] = torch.empty(PIECE + SLACK, dtype=torch.uint8)
    return bufs[which]


@dataclass
class ReadStats:
    """What a reader did: bytes read from storage, seconds in reads, in checksums and in copies
    out of scratch buffers (summed over threads). Shared by a reader's threads."""

    bytes_read: int = 0
    read_s: float = 0.0
    crc_s: float = 0.0
    copy_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int = 0, read_s: float = 0.0, crc_s: float = 0.0, copy_s: float = 0.0) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.read_s += read_s
            self.crc_s += crc_s
            self.copy_s += copy_s

    def as_dict(self) -> dict:
        return {"bytes_read": self.bytes_read, "read_s": self.read_s, "crc_s": self.crc_s, "copy_s": self.copy_s}


_NO_STATS = ReadStats()


@dataclass
class Blocks:
    """Checksummed blocks of one item: ``bounds`` (item-relative, len m+1) and ``digests`` (len m)
    of the algorithm ``hash``."""

    bounds: np.ndarray
    digests: Any
    hash: BlockHash

    def lists(self) -> Tuple[List[int], List[int]]:
        """``bounds`` and ``digests`` as Python lists (made once: a checker looks up a few entries
        per piece, and indexing a list costs a fraction of a numpy scalar lookup)."""
        cached = self.__dict__.get("_lists")
        if cached is None:
            cached = self.__dict__["_lists"] = ([int(v) for v in self.bounds], [int(v) for v in self.digests])
        return cached

    def index(self, pos: int) -> int:
        return bisect.bisect_right(self.lists()[0], pos) - 1


class _Checker:
    """Digests of the blocks, fed with consecutive byte segments in file order: a block that a
    segment holds whole is hashed in one call, one split across segments with a running digest."""

    def __init__(self, blocks: Blocks, path: str, base: int, what: str):
        self.blocks, self.path, self.base, self.what = blocks, path, base, what
        self.bounds, self.digests = blocks.lists()
        self.digest, self.hasher = blocks.hash.digest, blocks.hash.hasher
        self.block = -1  # block being accumulated (-1: none, the next segment starts a block)
        self.pos = 0  # next expected item-relative byte
        self.running: Any = None  # running digest of the block being accumulated

    def feed(self, pos: int, data: memoryview) -> None:
        bounds = self.bounds
        n = len(data)
        i = 0
        while i < n:
            p = pos + i
            if self.block < 0 or p != self.pos:
                b = self.blocks.index(p)
                if self.block >= 0 and self.pos < bounds[self.block + 1]:
                    raise AssertionError("internal error: a checksummed block was not read whole")
                if p != bounds[b]:
                    raise AssertionError("internal error: a checksummed block was read from its middle")
                self.block, self.running = b, None
            end = bounds[self.block + 1]
            take = min(n - i, end - p)
            if self.running is None and p + take == end:  # the whole block is in this segment
                self._check(self.block, self.digest(data[i : i + take]))
                self.block = -1
            else:
                if self.running is None:
                    self.running = self.hasher()
                self.running.update(data[i : i + take])
                if p + take == end:
                    self._check(self.block, self.running.intdigest())
                    self.block, self.running = -1, None
            i += take
            self.pos = p + take

    def feed_views(self, pos: int, views: Sequence[memoryview]) -> None:
        """:meth:`feed` for views of consecutive bytes starting at ``pos``: a tight loop for
        the common case (a view inside the block being accumulated), the general path else."""
        bounds = self.bounds
        q = pos  # file position of the current view
        end = bounds[self.block + 1] if self.block >= 0 else -1
        for v in views:
            n = len(v)
            if self.running is not None and q == self.pos and q + n < end:
                self.running.update(v)
                q += n
                self.pos = q
                continue
            self.feed(q, v)  # starts or ends a block
            q += n
            end = bounds[self.block + 1] if self.block >= 0 else -1

    def _check(self, b: int, got: int) -> None:
        expected = self.digests[b]
        if got != expected:
            lo, hi = self.bounds[b], self.bounds[b + 1]
            show = self.blocks.hash.show
            raise CorruptCheckpointError(
                f"{self.path}: checksum mismatch for {self.what} (bytes [{self.base + lo}, {self.base + hi}) "
                f"of the file: {show(got)}, recorded at save time {show(expected)}): the file is damaged"
            )

    def finish(self) -> None:
        if self.block >= 0:
            raise AssertionError("internal error: the last checksummed block was not read whole")


def verify_blocks(blocks: Blocks, path: str, base: int, what: str, pos: int, data: Buffer) -> None:
    """Check the whole blocks held by ``data`` (item-relative bytes ``[pos, pos + len(data))``,
    starting and ending at block boundaries); a mismatch raises :class:`CorruptCheckpointError`
    naming the file, the block's byte range and ``what``."""
    checker = _Checker(blocks, path, base, what)
    checker.feed(pos, memoryview(data).cast("B") if not isinstance(data, memoryview) else data)
    checker.finish()


def _merge(lo: np.ndarray, hi: np.ndarray, gap: int) -> List[Tuple[int, int]]:
    """Sorted intervals ``[lo, hi)`` merged where they overlap or are less than ``gap`` apart
    (``gap=1``: also where they touch)."""
    if len(lo) == 0:
        return []
    reach = np.maximum.accumulate(hi)
    new = np.empty(len(lo), dtype=bool)
    new[0] = True
    new[1:] = lo[1:] >= reach[:-1] + gap
    starts = lo[new]
    ends_idx = np.append(np.nonzero(new)[0][1:] - 1, len(lo) - 1)
    return list(zip(starts.tolist(), reach[ends_idx].tolist()))


def _touched(run_lo: np.ndarray, run_hi: np.ndarray, blocks: Optional[Blocks]) -> List[Tuple[int, int]]:
    """Byte ranges to read for runs ``[run_lo, run_hi)``: their whole blocks (or the runs)."""
    if blocks is None:
        return _merge(run_lo, run_hi, GAP_READ)
    b = blocks.bounds
    first = np.searchsorted(b, run_lo, side="right") - 1
    last = np.searchsorted(b, run_hi - 1, side="right") - 1
    return [(int(b[s]), int(b[e])) for s, e in _merge(first, last + 1, 1)]


def read_region(
    reader: FileReader,
    path: str,
    base: int,
    data_start: int,
    shape: Sequence[int],
    starts: Sequence[int],
    lens: Sequence[int],
    out: torch.Tensor,
    dtype: torch.dtype,
    blocks: Optional[Blocks],
    what: str,
    stats: Optional[ReadStats] = None,
) -> None:
    """Copy the box ``starts``/``lens`` of the chunk ``shape`` (stored as ``dtype`` at
    item-relative byte ``data_start``; the item starts at file offset ``base``) into ``out``.

    ``blocks``: the item's checksummed blocks (every byte read is verified), or None.
    """
    esize = dtype_size(dtype)
    ndim = len(shape)
    numel = math.prod(lens)
    if numel == 0:
        return
    strides = [1] * ndim
    for a in range(ndim - 2, -1, -1):
        strides[a] = strides[a + 1] * shape[a + 1]
    bstrides = [s * esize for s in strides]
    first = data_start + sum(s * st for s, st in zip(starts, bstrides))
    # k: first axis from which the request is one contiguous run per index of the axes before it
    k = ndim
    while k > 0 and (k == ndim or (starts[k] == 0 and lens[k] == shape[k])):
        k -= 1
    checker = _Checker(blocks, path, base, what) if blocks is not None else None
    stats = stats if stats is not None else _NO_STATS
    direct = k == 0 and out.dtype == dtype and out.device.type == "cpu"
    if direct and out.is_contiguous():
        _read_direct(reader, base, first, numel * esize, tensor_buffer(out), blocks, checker, stats)
    elif direct and (layout := _scatter_layout(out, list(lens), esize)) is not None:
        _read_direct(reader, base, first, numel * esize, layout[0], blocks, checker, stats, layout[1], layout[2])
    else:
        _read_window(reader, base, first, list(lens), bstrides, esize, k, out, dtype, blocks, checker, stats)
    if checker is not None:
        checker.finish()


# A contiguous request into a non-contiguous ``out`` is read straight into out's rows when they
# are at least this long (below, the per-row bookkeeping costs more than a copy via scratch).
SCATTER_MIN = 16 << 10


def _scatter_layout(out: torch.Tensor, lens: List[int], esize: int) -> Optional[Tuple[memoryview, np.ndarray, int]]:
    """For ``out`` whose innermost axes are contiguous: a byte view spanning ``out``, the byte
    offsets of its contiguous segments in row-major order, and the segment length."""
    st = out.stride()
    j, expect = len(lens), 1
    while j > 0 and (lens[j - 1] == 1 or st[j - 1] == expect):
        expect *= lens[j - 1]
        j -= 1
    seg = math.prod(lens[j:])
    if seg * esize < SCATTER_MIN:
        return None
    offs = np.zeros(1, dtype=np.int64)
    for a in range(j):
        offs = (offs[:, None] + np.arange(lens[a], dtype=np.int64) * st[a]).reshape(-1)
    span = torch.as_strided(out.detach(), (int(offs.max()) + seg,), (1,))
    return tensor_buffer(span), offs * esize, seg * esize


def _read_direct(reader, base, lo, nbytes, dest: memoryview, blocks, checker, stats, seg_offsets=None, seg_bytes=0) -> None:
    """The request is bytes ``[lo, lo + nbytes)``: read them into ``dest`` (contiguous, or the
    segments at ``seg_offsets`` of ``seg_bytes`` each), the rest of the touched blocks into
    scratch (for the checksum only), piece by piece."""
    hi = lo + nbytes
    piece = getattr(reader, "piece_bytes", DIRECT_PIECE)  # remote readers: one request per piece
    ranges = _touched(np.array([lo]), np.array([hi]), blocks)
    read_ahead(reader, base + ranges[0][0], ranges[-1][1] - ranges[0][0])
    bounds = blocks.lists()[0] if blocks is not None else None
    for r_lo, r_hi in ranges:
        pos = r_lo
        while pos < r_hi:
            end = min(r_hi, pos + piece)
            if bounds is not None and end < r_hi:
                # end the piece at a block boundary (ranges start at one): each block is then
                # checked in one call, without a running digest across pieces (a block larger
                # than a piece is still split)
                b = bounds[bisect.bisect_right(bounds, end) - 1]
                end = b if b > pos else end
            segs: List[Tuple[int, memoryview]] = []
            head = max(0, min(end, lo) - pos)  # bytes of the first block before the request
            tail = max(0, end - max(pos, hi))  # bytes of the last block after it
            scratch = tensor_buffer(scratch_buffer(head + tail, 1)) if head + tail else None
            if head:
                segs.append((pos, scratch[:head]))
            if end > lo and pos < hi:
                a, b = max(pos, lo), min(end, hi)
                if seg_offsets is None:
                    segs.append((a, dest[a - lo : b - lo]))
                else:
                    segs.extend(_dest_segments(dest, seg_offsets, seg_bytes, a - lo, b - lo, lo))
            if tail:
                segs.append((end - tail, scratch[head : head + tail]))
            views = [v for _, v in segs]
            t0 = time.perf_counter()
            reader.readv(views, base + pos)
            t1 = time.perf_counter()
            if checker is not None:
                checker.feed_views(pos, views)
            stats.add(end - pos, t1 - t0, time.perf_counter() - t1)
            pos = end


def read_ahead(reader: FileReader, start: int, length: int) -> None:
    """Local files: ask the kernel to read the whole range ahead, so that on disk the reads of
    later pieces proceed while earlier ones are checksummed (no effect on tmpfs)."""
    fd = getattr(reader, "fd", None)
    if isinstance(fd, int) and length > DIRECT_PIECE and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass


def _dest_segments(dest: memoryview, offsets: np.ndarray, seg: int, a: int, b: int, lo: int) -> List[Tuple[int, memoryview]]:
    """(file position, destination view) for request bytes ``[a, b)`` spread over segments."""
    out = []
    s0, s1 = a // seg, -(-b // seg)  # segments touched
    if a != s0 * seg:  # a partial first segment
        start = int(offsets[s0]) + a - s0 * seg
        take = min(b, (s0 + 1) * seg) - a
        out.append((lo + a, dest[start : start + take]))
        s0 += 1
    last_partial = b != s1 * seg and s1 - 1 >= s0
    full_end = s1 - 1 if last_partial else s1
    out.extend((lo + s * seg, dest[o : o + seg]) for s, o in zip(range(s0, full_end), offsets[s0:full_end].tolist()))
    if last_partial:
        o = int(offsets[s1 - 1])
        out.append((lo + (s1 - 1) * seg, dest[o : o + b - (s1 - 1) * seg]))
    return out


def _read_window(reader, base, first, lens, bstrides, esize, k, out, dtype, blocks, checker, stats) -> None:
    """Strided requests and indirect destinations: pieces through a scratch buffer, rows copied out.

    Rows are the indices of axis ``r``, the outermost axis one index of which spans at most a
    piece; each piece is a group of consecutive rows. A block that holds the end of one
    piece and the start of the next is read in two parts, each in its piece, its digest
    running across both: every byte is read and checked once.
    """
    ndim = len(lens)
    if ndim == 0:
        lens, bstrides, k = [1], [esize], 0
        out = out.reshape(1)
        ndim = 1
    # span[a]: bytes from the first to the last byte of the request at one index of axis a
    span = [0] * ndim
    inner = esize
    for a in range(ndim - 1, -1, -1):
        span[a] = inner
        inner += (lens[a] - 1) * bstrides[a]
    r = next(a for a in range(ndim) if span[a] <= PIECE)
    # the pieces are read one after the other: on disk, ask the kernel for the whole request
    # ahead (as direct reads do) when it reads most of that span anyway - with block checks it
    # reads every touched block; without, only if the runs cover at least half of it
    if blocks is not None or math.prod(lens) * esize * 2 >= inner:
        touched = _touched(np.array([first]), np.array([first + inner]), blocks)
        read_ahead(reader, base + touched[0][0], touched[-1][1] - touched[0][0])
    # byte offsets of a row's contiguous runs, relative to the row start
    if k <= r:  # the axes below r are whole: the row is one run
        row_runs, run_len = np.zeros(1, dtype=np.int64), span[r]
    else:
        run_len = lens[k] * bstrides[k]
        axes = [np.arange(lens[a], dtype=np.int64) * bstrides[a] for a in range(r + 1, k)]
        row_runs = np.zeros(1, dtype=np.int64)
        for off in axes:
            row_runs = (row_runs[:, None] + off[None, :]).reshape(-1)
    row_step = bstrides[r]
    rows_per_piece = max(1, (PIECE - span[r]) // max(1, row_step) + 1)
    src_strides = [s // esize for s in bstrides[r:]]
    pieces = []  # (destination, first row, end row, file offset of the first row)
    for outer in itertools.product(*[range(n) for n in lens[:r]]):
        o_start = first + sum(i * bstrides[a] for a, i in enumerate(outer))
        dest = out[outer] if outer else out
        for i0 in range(0, lens[r], rows_per_piece):
            pieces.append((dest, i0, min(lens[r], i0 + rows_per_piece), o_start + i0 * row_step))
    done_hi = 0  # file bytes below this were read (and checked) by earlier pieces
    for j, (dest, i0, i1, start) in enumerate(pieces):
        row_lo = start + np.arange(i1 - i0, dtype=np.int64) * row_step
        run_lo = (row_lo[:, None] + row_runs[None, :]).reshape(-1)
        # read up to where the next piece's rows begin: the rest of a block they share is
        # read there, so every byte is read (and checksummed) once, in file order
        stop = pieces[j + 1][3] if j + 1 < len(pieces) else None
        ranges = [
            (max(a, done_hi), b if stop is None else min(b, stop))
            for a, b in _touched(run_lo, run_lo + run_len, blocks)
            if b > done_hi and (stop is None or a < stop)
        ]
        w_lo = min(start, ranges[0][0])
        w_hi = max(ranges[-1][1], int(row_lo[-1]) + span[r])
        pad = (w_lo - first) % esize
        buf = scratch_buffer(w_hi - w_lo + pad)
        mv = tensor_buffer(buf)
        t_read = t_crc = 0.0
        for a, b in ranges:
            seg = mv[pad + a - w_lo : pad + b - w_lo]
            t0 = time.perf_counter()
            reader.readv([seg], base + a)
            t1 = time.perf_counter()
            if checker is not None:
                checker.feed(a, seg)
            t_read += t1 - t0
            t_crc += time.perf_counter() - t1
        done_hi = ranges[-1][1]
        t0 = time.perf_counter()
        typed = buf[: (buf.numel() // esize) * esize].view(dtype)
        src = torch.as_strided(typed, [i1 - i0, *lens[r + 1 :]], src_strides, (pad + start - w_lo) // esize)
        dest[i0:i1].copy_(src)
        stats.add(sum(b - a for a, b in ranges), t_read, t_crc, time.perf_counter() - t0)


# --------------------------------------------------------------------------- readers' helpers
_ESIZE: Dict[torch.dtype, int] = {}


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (cached: called per read)."""
    e = _ESIZE.get(dtype)
    if e is None:
        e = _ESIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return e


@dataclass
class ChunkLayout:
    """A stored chunk as a reader that fetches its bytes itself sees it (see ``chunk_layout``).

    ``base``: file offset of the item; ``data_start``: item-relative start of the row-major
    data (``shape``, ``esize`` bytes per element); ``blocks``: the checks to run (None:
    unchecked); ``bounds``: item-relative block boundaries (also when unchecked: 1 MiB
    blocks of the data, for planning).
    """

    path: str
    fd: Any  # the file's FileReader
    base: int
    data_start: int
    nbytes: int
    shape: Tuple[int, ...]
    esize: int
    blocks: Optional[Blocks]
    bounds: np.ndarray
    what: str
    has_frame: bool = False
    length: int = 0  # bytes of the whole item
    dtype: Optional[torch.dtype] = None  # as .metadata records it (checked against the archive's data.pkl)


def run_parallel(tasks: Sequence[Any], fn, thread_count: int) -> None:
    """Run ``fn(task)`` for all tasks with up to ``thread_count`` threads; re-raise the first error.

    Threads take tasks from one shared iterator in order (no future per task: with tens of
    thousands of small tensors, a future and its lock per task cost more than the reads).
    """
    if thread_count <= 1 or len(tasks) <= 1:
        for t in tasks:
            fn(t)
        return
    it = iter(tasks)
    lock = threading.Lock()
    errors: List[BaseException] = []

    def worker() -> None:
        while not errors:
            with lock:
                t = next(it, _DONE)
            if t is _DONE:
                return
            try:
                fn(t)
            except BaseException as e:  # stop the others, raise in the caller
                errors.append(e)
                return

    with ThreadPoolExecutor(min(thread_count, len(tasks)), thread_name_prefix="ckpt-read") as pool:
        for f in [pool.submit(worker) for _ in range(min(thread_count, len(tasks)))]:
            f.result()
    if errors:
        raise errors[0]


_DONE = object()
