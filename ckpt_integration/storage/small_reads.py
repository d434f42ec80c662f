"""Reading many small whole items at once: one read per run of adjacent items, every byte verified.

A model with tens of thousands of small tensors per rank stores them as adjacent items of a few
KiB in each data file. Read one by one (:meth:`TorchDistReader.read_region`), each costs a
layout lookup, the archive frame check, two small reads and a digest per block: hundreds of
microseconds of Python per item, for bytes that take nanoseconds to copy. Here the whole-chunk
requests of small items are grouped by file and sorted by offset; each run of adjacent items (at
most ``SPAN`` bytes) is read with ONE read into a per-thread scratch buffer, and then, item by
item, straight from that buffer:

* every block of the item (archive header, data blocks, archive trailer) is checked against the
  manifest's block digests, so every byte read is verified (a mismatch names the file and the
  block's byte range, as the one-item path does);
* the dtype and shape that the archive's own ``data.pkl`` records are compared with
  ``.metadata`` (parsed once per distinct header: items of one shape and dtype share it);
* the data bytes are copied into the destination tensor.

Only requests that are the whole chunk, into a contiguous CPU tensor of the stored dtype, of an
item with a block record and at most ``SMALL_ITEM`` bytes, take this path; everything else (large
tensors, slices, casts, checkpoints without block records) is left to ``read_region``.
"""

from __future__ import annotations

import ctypes
import operator
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch

from ..errors import CorruptCheckpointError
from ..planning.boxes import Box
from .opened import CheckpointReader
from .checkpoint_dir import MANIFEST_FILE
from .checksum import BlockHash
from .region_read import dtype_size, run_parallel, scratch_buffer
from .fs import tensor_buffer
from .item_table import Digests
from .tensor_record import describe_archive_head
from .torch_dist_reader import ChunkInfo, TorchDistReader, check_archive_head

# items up to this size (archive included) are read in runs; larger ones one by one (their
# per-item overhead is small next to their bytes, and read_region reads them into place)
SMALL_ITEM = 1 << 20
# bytes per read of a run of adjacent items (fits the per-thread scratch buffer of region_read)
SPAN = 8 << 20
# the order reads are made in: by file and offset (runs join adjacent items; a C getter, ~0.2 us a
# task against ~0.6 through a property)
read_order = operator.attrgetter("chunk.storage.relative_path", "chunk.storage.offset")


class ReadTaskLike(Protocol):
    """A load's read task as far as this module reads and records it (``execution``'s ``ReadTask``)."""

    key: str
    chunk: ChunkInfo
    overlap: Box
    out: torch.Tensor
    dtype: torch.dtype
    got: List[Box]


def _fits(t: ReadTaskLike) -> bool:
    """Whether task ``t`` can be read in a run, if its item has a block record."""
    chunk, out = t.chunk, t.out
    if chunk.storage.length > SMALL_ITEM or (t.overlap is not chunk.box and t.overlap != chunk.box) or out.dtype != t.dtype:
        return False
    # (the shape first: a whole chunk's destination has the chunk's shape, compared without a product)
    return out.is_cpu and out.is_contiguous() and (out.shape == chunk.box.sizes or out.numel() == chunk.box.numel)


def read_task(reader: CheckpointReader, t: ReadTaskLike) -> None:
    """Read one task's region into its destination and record the delivery (its ledger, ``got``)."""
    reader.read_region(t.key, t.chunk, t.overlap, t.out, t.dtype)
    t.got.append(t.overlap)


def read_tasks(reader: CheckpointReader, tasks: Sequence[ReadTaskLike], thread_count: int) -> None:
    """Read every task, each byte verified: whole small items in runs of adjacent items (one read
    each), the rest one region at a time, with up to ``thread_count`` threads. The one local read
    of every load path (``local``, the leftovers of read-once, a shared-read unit's reader)."""
    rest = read_small_items(reader, tasks, thread_count)
    run_parallel(rest, lambda t: read_task(reader, t), thread_count)


def read_small_items(reader: CheckpointReader, tasks: Sequence[ReadTaskLike], thread_count: int) -> List[ReadTaskLike]:
    """Read the tasks that are whole small items in runs (see the module docstring); return the
    others, in their order, for ``read_region``. ``tasks`` are ``ReadTask``-like (``key``,
    ``chunk``, ``overlap``, ``out``, ``dtype``, and ``got``: each task read here records its
    whole region there, the delivery ledger of :mod:`..planning.delivery`)."""
    if not getattr(reader, "block_records", None) or not reader.block_records:
        return list(tasks)
    # (one pass per list, no call per task: tens of thousands of tasks for some models)
    fits = [_fits(t) for t in tasks]
    where = [(t.chunk.storage.relative_path, t.chunk.storage.offset) for t, f in zip(tasks, fits) if f]
    records = iter(reader.block_records.digests_many(where))
    rest: List[Any] = []
    small: List[Tuple[str, int, ReadTaskLike, Digests]] = []
    for t, f in zip(tasks, fits):
        brec = next(records) if f else None
        if brec is None:
            rest.append(t)
        else:
            info = t.chunk.storage
            small.append((info.relative_path, info.offset, t, brec))
    if not small:
        return rest
    # no sort: the load's tasks come sorted by file and offset, and a run only joins adjacent items
    spans: List[List[Tuple[str, int, ReadTaskLike, Digests]]] = []
    cur: List[Tuple[str, int, ReadTaskLike, Digests]] = []
    end = -1
    for s in small:
        length = s[2].chunk.storage.length
        # a run continues only over adjacent items: bytes between them would be read unverified
        if cur and s[0] == cur[0][0] and s[1] == end and s[1] + length - cur[0][1] <= SPAN:
            cur.append(s)
        else:
            if cur:
                spans.append(cur)
            cur = [s]
        end = s[1] + length
    spans.append(cur)
    if thread_count <= 1 or len(spans) == 1:
        for span in spans:
            _check_span(reader, span, *_fetch(reader, span, None))
    else:
        _pipelined(reader, spans, thread_count)
    return rest


def _pipelined(reader: TorchDistReader, spans: List[List[Tuple[str, int, ReadTaskLike, Digests]]], thread_count: int) -> None:
    """Reads in up to ``thread_count`` pool threads, checks and copies in the calling thread, in order.

    The per-item work is Python that holds the GIL: run in several threads at once it only
    contends (measured, 20,000 items of 4 KiB in one process: 26 us per item with 4 threads
    against 14 with one). The reads release the GIL and overlap with it (and keep several
    requests in flight on remote storage). Each span in flight has a buffer of its own."""
    depth = min(thread_count, len(spans))
    # a buffer per span in flight, reused in turn (not the threads' scratch buffers: a span is
    # checked here while its reader thread already reads the next one)
    free: List[Any] = [torch.empty(SPAN, dtype=torch.uint8) for _ in range(depth)]
    pending: "deque[Tuple[List[Tuple[str, int, ReadTaskLike, Digests]], Any]]" = deque()
    it = iter(spans)
    with ThreadPoolExecutor(depth, thread_name_prefix="ckpt-read") as pool:
        try:
            for span in it:
                pending.append((span, pool.submit(_fetch, reader, span, free.pop())))
                if not free:
                    break
            while pending:
                span, fut = pending.popleft()
                mv, buf, nbytes, read_s = fut.result()
                _check_span(reader, span, mv, buf, nbytes, read_s)
                nxt = next(it, None)
                if nxt is not None:  # this span's buffer is free again
                    pending.append((nxt, pool.submit(_fetch, reader, nxt, buf)))
        except BaseException:
            for _, fut in pending:  # (reads already running finish before the pool closes)
                fut.cancel()
            raise


def _what(t: ReadTaskLike) -> str:
    return f"chunk {t.chunk.box} of {t.key!r}"


def _fetch(reader: TorchDistReader, span: List[Tuple[str, int, ReadTaskLike, Digests]], buf: Optional[torch.Tensor]
           ) -> Tuple[memoryview, torch.Tensor, int, float]:
    """Read a span's bytes: ``(its bytes, the buffer holding them, their count, seconds)``, into
    ``buf`` (None: this thread's scratch buffer; one too small is replaced)."""
    name, lo = span[0][0], span[0][1]
    last = span[-1][2].chunk.storage
    hi = last.offset + last.length
    fd = reader.file_reader(name)
    path = reader.ck.file(name)
    size = fd.size
    if hi > size:  # name the first item that does not fit, as a one-item read would
        t = next(s[2] for s in span if s[1] + s[2].chunk.storage.length > size)
        info = t.chunk.storage
        raise CorruptCheckpointError(
            f"{path} is truncated: {_what(t)} needs bytes [{info.offset}, {info.offset + info.length}) "
            f"but the file has {size} bytes"
        )
    nbytes = hi - lo
    if buf is None:
        buf = scratch_buffer(nbytes)
    elif buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, SPAN), dtype=torch.uint8)
    mv = tensor_buffer(buf)[:nbytes]
    t0 = time.perf_counter()
    fd.readv([mv], lo)
    return mv, buf, nbytes, time.perf_counter() - t0


def _check_span(reader: TorchDistReader, span: List[Tuple[str, int, ReadTaskLike, Digests]], mv: memoryview, buf: torch.Tensor, nbytes: int,
                read_s: float) -> None:
    """Check every item of a span read into ``mv`` (see the module docstring) and copy its data out."""
    name, lo = span[0][0], span[0][1]
    path = reader.ck.file(name)
    addr = buf.data_ptr()
    verify = reader.verify_checksums
    memmove = ctypes.memmove
    heads: dict = {}
    crc_s = 0.0
    h = reader.block_records.hash
    digest = h.digest
    # a header whose digest was checked is known by (length, digest) (64-bit digests only: no
    # copy and hash of its bytes per item); otherwise by its bytes
    by_digest = verify and h.width == 8
    perf = time.perf_counter
    if verify and len(span) >= UNIFORM_MIN:
        c0 = perf()
        if _check_uniform(span, mv, addr, h):
            reader.stats.add(nbytes, read_s, perf() - c0)
            return
    for _name, off, t, brec in span:
        out = t.out
        length = t.chunk.storage.length
        s = off - lo  # the item's place in the buffer
        d, n, b, digests = brec
        if n != out.nbytes:  # (out holds the chunk's elements in the stored dtype: see _fits)
            esize = dtype_size(t.dtype)
            raise CorruptCheckpointError(
                f"{path}: {_what(t)} holds {n} bytes of data, but .metadata says "
                f"{t.chunk.box.numel} elements of {t.dtype} ({t.chunk.box.numel * esize} bytes)"
            )
        tail = d + n < length
        if d + n > length or len(digests) != (d > 0) + -(-n // b) + tail:
            where = reader.ck.file(MANIFEST_FILE)
            raise CorruptCheckpointError(
                f"{where}: block record of {_what(t)} is damaged: data [{d}, {d + n}) in an item of {length} "
                f"bytes with {len(digests)} block checksums"
            )
        if verify:
            c0 = perf()
            i = 0
            if d > 0:
                if digest(mv[s : s + d]) != digests[0]:
                    _frame_mismatch(path, off, 0, d, t)
                i = 1
            if n <= b:  # one data block (or none): the common case of a small item
                if n:
                    got = digest(mv[s + d : s + d + n])
                    if got != digests[i]:
                        _data_mismatch(path, off, d, d + n, t, h, got, digests[i])
                    i += 1
            else:
                for p in range(d, d + n, b):
                    q = min(p + b, d + n)
                    got = digest(mv[s + p : s + q])
                    if got != digests[i]:
                        _data_mismatch(path, off, p, q, t, h, got, digests[i])
                    i += 1
            if tail and digest(mv[s + d + n : s + length]) != digests[i]:
                _frame_mismatch(path, off, d + n, length, t)
            crc_s += perf() - c0
        key = (d, digests[0]) if by_digest and d > 0 else bytes(mv[s : s + d])
        found = heads.get(key, heads)  # (the dict itself: not seen yet; None: seen, not our layout)
        if found is heads:
            try:
                found = heads[key] = describe_archive_head(bytes(mv[s : s + d]))
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(f"{path}: {_what(t)}: {e}") from None
        if found is not None and (found[0] != t.dtype or found[1] != t.chunk.box.sizes):
            check_archive_head(found, t.dtype, t.chunk.box.sizes, path, _what(t), reader.ck)
        if n:
            memmove(out.data_ptr(), addr + s + d, n)
        t.got.append(t.overlap)  # the task's ledger (planning.delivery)
    reader.stats.add(nbytes, read_s, crc_s)


# spans of at least this many items of one layout are checked as a table (see _check_uniform)
UNIFORM_MIN = 8


def _check_uniform(span: List[Tuple[str, int, ReadTaskLike, Digests]], mv: memoryview, addr: int, h: BlockHash) -> bool:
    """A span of items of one layout (many tensors of one shape and dtype: same length, header,
    data and trailer lengths, one data block), checked as a table and copied out; False (nothing
    copied) when it is not such a span or anything does not match, and the item-by-item check
    then finds and names it.

    Every block is still verified: the first item's header and trailer by their digests, every
    other header and trailer by being byte-identical to those with the same recorded digest (so
    its digest is the recorded one), every data block by its own digest. What this saves is the
    loop's per-item Python (~1 us an item); each item's digest and copy remain."""
    t0 = span[0][2]
    length = t0.chunk.storage.length
    d, n, b, digests = span[0][3]
    if not (0 < d and 0 < n <= b and d + n < length and len(digests) == 3):
        return False
    count = len(span)
    # one layout, one header digest and one trailer digest recorded for all
    for _name, _off, t, brec in span:
        if brec[0] != d or brec[1] != n or brec[2] != b or len(brec[3]) != 3 or brec[3][0] != digests[0] \
                or brec[3][2] != digests[2] or t.chunk.storage.length != length or t.out.nbytes != n:
            return False
    digest = h.digest
    if digest(mv[:d]) != digests[0] or digest(mv[d + n : length]) != digests[2]:
        return False
    table = np.frombuffer(mv, dtype=np.uint8, count=count * length).reshape(count, length)
    if not (table[:, :d] == table[0, :d]).all() or not (table[:, d + n :] == table[0, d + n :]).all():
        return False
    if [digest(mv[s : s + n]) for s in range(d, count * length, length)] != [e[3][3][1] for e in span]:
        return False
    try:
        found = describe_archive_head(bytes(mv[:d]))
    except CorruptCheckpointError:
        return False
    if found is not None:
        dtype, shape = found
        for _name, _off, t, _brec in span:
            if t.dtype != dtype or t.chunk.box.sizes != shape:
                return False
    memmove = ctypes.memmove
    for i, (_name, _off, t, _brec) in enumerate(span):
        memmove(t.out.data_ptr(), addr + i * length + d, n)
        t.got.append(t.overlap)
    return True


def _frame_mismatch(path: str, off: int, lo: int, hi: int, t: ReadTaskLike) -> None:
    raise CorruptCheckpointError(
        f"{path}: checksum mismatch for the archive {'header' if lo == 0 else 'trailer'} of {_what(t)} "
        f"(bytes [{off + lo}, {off + hi})): the file is damaged"
    )


def _data_mismatch(path: str, off: int, lo: int, hi: int, t: ReadTaskLike, h: BlockHash, got: int, expected: int) -> None:
    raise CorruptCheckpointError(
        f"{path}: checksum mismatch for {_what(t)} (bytes [{off + lo}, {off + hi}) of the file: {h.show(got)}, "
        f"recorded at save time {h.show(expected)}): the file is damaged"
    )
