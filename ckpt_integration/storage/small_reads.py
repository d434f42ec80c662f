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
import time
from typing import Any, List, Sequence, Tuple

from ..errors import CorruptCheckpointError
from .checkpoint_dir import MANIFEST_FILE
from .filesystem import join
from .region_read import scratch_buffer, dtype_size, run_parallel
from .fs import tensor_buffer
from .tensor_record import describe_archive_head
from .torch_dist import DCP_METADATA_FILE

# items up to this size (archive included) are read in runs; larger ones one by one (their
# per-item overhead is small next to their bytes, and read_region reads them into place)
SMALL_ITEM = 1 << 20
# bytes per read of a run of adjacent items (fits the per-thread scratch buffer of region_read)
SPAN = 8 << 20


def _eligible(reader: Any, t: Any) -> Any:
    """The item's block record ``(data_offset, data_length, block_size, digests)`` when task ``t``
    can be read in a run, else None."""
    chunk, out = t.chunk, t.out
    info = chunk.storage
    if info.length > SMALL_ITEM or (t.overlap is not chunk.box and t.overlap != chunk.box) or out.dtype != t.dtype:
        return None
    if out.device.type != "cpu" or not out.is_contiguous() or out.numel() != chunk.box.numel:
        return None
    return reader.block_records.digests_of((info.relative_path, info.offset))


def read_small_items(reader: Any, tasks: Sequence[Any], thread_count: int) -> List[Any]:
    """Read the tasks that are whole small items in runs (see the module docstring); return the
    others, in their order, for ``read_region``. ``tasks`` are ``ReadTask``-like (``key``,
    ``chunk``, ``overlap``, ``out``, ``dtype``)."""
    if not getattr(reader, "block_records", None) or not reader.block_records:
        return list(tasks)
    rest: List[Any] = []
    small: List[Tuple[str, int, Any, Any]] = []
    for t in tasks:
        brec = _eligible(reader, t)
        if brec is None:
            rest.append(t)
        else:
            info = t.chunk.storage
            small.append((info.relative_path, info.offset, t, brec))
    if not small:
        return rest
    # no sort: the load's tasks come sorted by file and offset, and a run only joins adjacent items
    spans: List[List[Tuple[str, int, Any, Any]]] = []
    cur: List[Tuple[str, int, Any, Any]] = []
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
    run_parallel(spans, lambda span: _read_span(reader, span), thread_count)
    return rest


def _what(t: Any) -> str:
    return f"chunk {t.chunk.box} of {t.key!r}"


def _read_span(reader: Any, span: List[Tuple[str, int, Any, Any]]) -> None:
    name, lo = span[0][0], span[0][1]
    last = span[-1][2].chunk.storage
    hi = last.offset + last.length
    fd = reader.file_reader(name)
    path = join(reader.directory, name)
    size = fd.size
    if hi > size:  # name the first item that does not fit, as a one-item read would
        t = next(s[2] for s in span if s[1] + s[2].chunk.storage.length > size)
        info = t.chunk.storage
        raise CorruptCheckpointError(
            f"{path} is truncated: {_what(t)} needs bytes [{info.offset}, {info.offset + info.length}) "
            f"but the file has {size} bytes"
        )
    nbytes = hi - lo
    buf = scratch_buffer(nbytes)
    mv = tensor_buffer(buf)[:nbytes]
    t0 = time.perf_counter()
    fd.readv([mv], lo)
    t1 = time.perf_counter()
    addr = buf.data_ptr()
    verify = reader.verify_checksums
    memmove = ctypes.memmove
    heads = {}
    crc_s = 0.0
    h = reader.block_records.hash
    for _name, off, t, brec in span:
        length = t.chunk.storage.length
        s = off - lo  # the item's place in the buffer
        d, n, b, digests = brec
        esize = dtype_size(t.dtype)
        if n != t.chunk.box.numel * esize:
            raise CorruptCheckpointError(
                f"{path}: {_what(t)} holds {n} bytes of data, but .metadata says "
                f"{t.chunk.box.numel} elements of {t.dtype} ({t.chunk.box.numel * esize} bytes)"
            )
        if d + n > length or len(digests) != (d > 0) + -(-n // b) + (d + n < length):
            where = join(reader.directory, MANIFEST_FILE)
            raise CorruptCheckpointError(
                f"{where}: block record of {_what(t)} is damaged: data [{d}, {d + n}) in an item of {length} "
                f"bytes with {len(digests)} block checksums"
            )
        if verify:
            c0 = time.perf_counter()
            digest, i = h.digest, 0
            if d > 0:
                if digest(mv[s : s + d]) != digests[0]:
                    _frame_mismatch(path, off, 0, d, t)
                i = 1
            for p in range(d, d + n, b):
                q = min(p + b, d + n)
                got = digest(mv[s + p : s + q])
                if got != digests[i]:
                    _data_mismatch(path, off, p, q, t, h, got, digests[i])
                i += 1
            if d + n < length and digest(mv[s + d + n : s + length]) != digests[i]:
                _frame_mismatch(path, off, d + n, length, t)
            crc_s += time.perf_counter() - c0
        head = bytes(mv[s : s + d])
        found = heads.get(head)
        if found is None:
            try:
                found = heads[head] = (describe_archive_head(head),)
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(f"{path}: {_what(t)}: {e}") from None
        _check_recorded(found[0], t, path, reader.directory)
        if n:
            memmove(t.out.data_ptr(), addr + s + d, n)
    reader.stats.add(nbytes, t1 - t0, crc_s)


def _frame_mismatch(path: str, off: int, lo: int, hi: int, t: Any) -> None:
    raise CorruptCheckpointError(
        f"{path}: checksum mismatch for the archive {'header' if lo == 0 else 'trailer'} of {_what(t)} "
        f"(bytes [{off + lo}, {off + hi})): the file is damaged"
    )


def _data_mismatch(path: str, off: int, lo: int, hi: int, t: Any, h: Any, got: int, expected: int) -> None:
    raise CorruptCheckpointError(
        f"{path}: checksum mismatch for {_what(t)} (bytes [{off + lo}, {off + hi}) of the file: {h.show(got)}, "
        f"recorded at save time {h.show(expected)}): the file is damaged"
    )


def _check_recorded(found: Any, t: Any, path: str, directory: str) -> None:
    """The archive's dtype and shape (``found``, from ``describe_archive_head``) against ``.metadata``."""
    if found is None:
        return  # an archive of another layout: its data's place and size were checked already
    dtype, shape = found
    if dtype == t.dtype and shape == t.chunk.box.sizes:
        return
    where = join(directory, DCP_METADATA_FILE)
    if dtype != t.dtype:
        raise CorruptCheckpointError(
            f"{path}: {_what(t)} is stored as {dtype} (the archive's data.pkl) but {where} says "
            f"{t.dtype}: the metadata does not belong to this data or was altered; refusing to reinterpret it"
        )
    if tuple(shape) != tuple(t.chunk.box.sizes):
        raise CorruptCheckpointError(
            f"{path}: {_what(t)} is stored with shape {tuple(shape)} (the archive's data.pkl) but "
            f"{where} says {tuple(t.chunk.box.sizes)}: the metadata does not belong to this data or was altered"
        )
