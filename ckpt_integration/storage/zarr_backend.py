"""The ``zarr`` backend: one zarr array per tensor key (zarr-python, format 3).

Layout of a checkpoint directory::

    <key>/zarr.json, <key>/c/...     one array per ShardedTensor key (global shape)
    <object key>/shard_<o>_<s>.pt    ShardedObjects, torch.save([obj]) (Megatron's layout)
    zarr_index.json                  keys -> dtype, shape, chunking; object keys;
                                     size + CRC32 of every chunk, object and zarr.json file
    common.pt, manifest.json         as for torch_dist
    metadata.json                    commit marker: {"sharded_backend": "zarr", ...}

Keys are paths inside the checkpoint, so :func:`check_layout_paths` refuses keys
that would leave it (``..``, absolute paths, backslashes, empty segments),
overwrite its own files, or land inside another array's directory; the reader
refuses an index whose keys resolve outside the checkpoint directory.

Chunking (:func:`chunk_shape_for`): an array is chunked on the grid of all shard
boundaries (the gcd of offsets and sizes per axis) when those chunks are large
enough; then each chunk lies inside one saved shard and ranks write disjoint
chunk files without coordination. Uneven shards (a 50257-row vocabulary over
TP=3) make that gcd 1, i.e. one file per row; such arrays get coarser chunks
(about ``min(1 MiB, tensor / 64)``), and a chunk that straddles shards of
different writers is assembled by one owner rank (:func:`plan_chunk_writes`;
the save exchanges the pieces). Resharded reads are plain slices of the array
and do not depend on the chunk shape, so older checkpoints read unchanged.
zarr has no bfloat16 (and no float8): such tensors are stored as same-width
integers and the real dtype is kept in the index.

Integrity: zarr itself reads a missing chunk file as fill value (zeros) and
checks nothing. So every chunk is written (also all-zero ones), each rank
records size and CRC32 of the exact bytes it hands to zarr's store (a store
wrapper sees them, no re-read), and the coordinator commits these records (and
those of every array's ``zarr.json``) into ``zarr_index.json`` before
``metadata.json``. Reads go through a checking store wrapper: zarr fetches only
the chunks a region needs, and each fetched chunk is checked (present, size,
CRC32) before it is decoded; a partial (byte-range) fetch is served from the
whole chunk, checked, so every byte read is verified. Opening an array checks its
``zarr.json`` (CRC32, and shape, dtype, chunk shape and encoding against the index),
so an edited ``zarr.json`` cannot make a load decode garbage. Indexes without records
(written before format 2) are read unchecked, as before, except for that
comparison. Containment: every file the store wrapper reads is checked like every
other reader's open (no path leading outside the checkpoint, no link leading
outside it, only regular files), records or not.

The load side exposes the same interface as :class:`TorchDistReader` (a DCP
``Metadata`` view, ``chunks``, ``read_region``, ``read_bytes``), so every load
strategy works on both backends.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import math
import os
import posixpath
import stat
import threading
from dataclasses import asdict, dataclass
from functools import reduce
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CheckpointingException, CorruptCheckpointError, MismatchError, UnsafeCheckpointError
from ..planning.boxes import Box, intersect, relative_slices
from .checkpoint_dir import COMMON_FILE, CONFIG_FILE, MANIFEST_FILE, WRITER_FILE, load_json
from .checksum import crc32
from .filesystem import checked_path, is_remote, join, not_regular, storage_for, symlinks_allowed, write_error
from .torch_dist import ChunkInfo, WriteRequest, WrittenItem, run_parallel

INDEX_FILE = "zarr_index.json"
# format 2 adds "files": per chunk/object file its key, size and CRC32;
# format 3 adds the records of every array's zarr.json (and may coarsen chunks, see chunk_shape_for)
INDEX_FORMAT = 3
ARRAY_METADATA_FILE = "zarr.json"
# Chunks below this size are coarsened (unless the tensor is small): zarr-python
# spends about half a millisecond per chunk file, which dominates below it.
MIN_CHUNK_BYTES = 1 << 20
# ... and a tensor below 64 MiB gets about this many chunks at most.
MAX_SMALL_TENSOR_CHUNKS = 64
# files of the checkpoint directory itself: a key must not start with one of them
_RESERVED_NAMES = frozenset({CONFIG_FILE, COMMON_FILE, MANIFEST_FILE, WRITER_FILE, INDEX_FILE, ".metadata"})
# CRC32 of buffers above this size runs in a worker thread: zlib releases the GIL,
# and zarr's event loop (one thread for all arrays) keeps issuing I/O meanwhile.
_CRC_IN_THREAD_BYTES = 1 << 20
# verify reads files in blocks of this size (bounded memory for large chunks)
_VERIFY_BLOCK = 64 << 20


def _zarr() -> Any:
    """zarr-python, or an error that says how to install it (it is an optional dependency)."""
    try:
        import zarr
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the zarr backend needs zarr-python >= 3: pip install 'ckpt_integration[zarr]' "
            "(or save with the default backend, sharded_strategy='torch_dist')"
        ) from e
    return zarr


# torch dtypes numpy cannot represent -> same-width integer storage
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _storage_dtype(dtype: torch.dtype) -> torch.dtype:
    try:
        torch.empty(0, dtype=dtype).numpy()
        return dtype
    except TypeError:
        return _INT_OF_SIZE[torch.empty((), dtype=dtype).element_size()]


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


def aligned_chunk_shape(global_shape: Sequence[int], boxes: Iterable[Box]) -> Tuple[int, ...]:
    """Per axis, the gcd of all shard offsets and sizes: chunk borders are shard borders."""
    boxes = list(boxes)
    out = []
    for a, n in enumerate(global_shape):
        values = [b.offsets[a] for b in boxes] + [b.sizes[a] for b in boxes] + [n]
        g = reduce(math.gcd, [v for v in values if v > 0], 0)
        out.append(max(1, g or 1))
    return tuple(out)


def chunk_shape_for(global_shape: Sequence[int], boxes: Iterable[Box], itemsize: int = 1) -> Tuple[int, ...]:
    """The chunk shape of an array saved from shards ``boxes``.

    The shard-aligned grid (:func:`aligned_chunk_shape`) when its chunks hold at least
    ``min(MIN_CHUNK_BYTES, tensor / MAX_SMALL_TENSOR_CHUNKS)`` bytes: then no chunk is
    shared by two shards. Otherwise (uneven shards make the gcd tiny, down to one row)
    a coarser grid of about that size, so the number of chunk files stays bounded by
    ``max(64, tensor / 1 MiB)``; chunks on shard borders then need one owner each
    (:func:`plan_chunk_writes`).
    """
    shape = tuple(int(n) for n in global_shape)
    aligned = aligned_chunk_shape(shape, boxes)
    total = math.prod(shape) * itemsize
    target = min(MIN_CHUNK_BYTES, total / MAX_SMALL_TENSOR_CHUNKS)
    if not shape or math.prod(aligned) * itemsize >= target:
        return aligned
    return _coarsened(shape, aligned, math.ceil(target / itemsize))


def _coarsened(shape: Tuple[int, ...], aligned: Tuple[int, ...], min_elements: int) -> Tuple[int, ...]:
    """Grow ``aligned`` to about ``min_elements`` per chunk.

    Axes without shard borders are already whole. The others grow about equally
    (smallest extent first, as it may be capped at its extent): square-ish chunks
    cross the fewest shard borders on a 2-D grid of shards, so few chunks need
    pieces from another rank.
    """
    chunks = list(aligned)
    growing = sorted((a for a, n in enumerate(shape) if chunks[a] < n), key=lambda a: shape[a])
    while growing:
        fixed = math.prod(chunks[a] for a in range(len(shape)) if a not in growing)
        per_axis = math.ceil((min_elements / max(1, fixed)) ** (1 / len(growing)))
        a = growing.pop(0)
        chunks[a] = min(shape[a], max(chunks[a], per_axis))
    return tuple(chunks)


def chunk_box(coords: Sequence[int], shape: Sequence[int], chunks: Sequence[int]) -> Box:
    """The region of chunk ``coords``, clipped to the array (edge chunks are partial)."""
    offsets = tuple(i * c for i, c in zip(coords, chunks))
    return Box(offsets, tuple(min(c, n - o) for o, c, n in zip(offsets, chunks, shape)))


def _chunk_ranges(box: Box, shape: Sequence[int], chunks: Sequence[int]) -> Tuple[List[range], List[range]]:
    """Per axis, the chunk indices ``box`` overlaps and those it contains whole
    (a chunk clipped at the array's end counts as whole when ``box`` reaches that end)."""
    overlapped, inside = [], []
    for o, s, n, c in zip(box.offsets, box.sizes, shape, chunks):
        end = o + s
        overlapped.append(range(o // c, -(-end // c)))
        inside.append(range(-(-o // c), -(-end // c) if end == n else end // c))
    return overlapped, inside


def interior_box(box: Box, shape: Sequence[int], chunks: Sequence[int]) -> Optional[Box]:
    """The union of the chunks lying wholly inside ``box`` (a box itself), or None."""
    _, inside = _chunk_ranges(box, shape, chunks)
    if any(len(r) == 0 for r in inside):
        return None
    offsets = tuple(r.start * c for r, c in zip(inside, chunks))
    ends = tuple(min(r.stop * c, n) for r, c, n in zip(inside, chunks, shape))
    return Box(offsets, tuple(e - o for o, e in zip(offsets, ends)))


def border_chunks(box: Box, shape: Sequence[int], chunks: Sequence[int]) -> Iterator[Tuple[int, ...]]:
    """Coordinates of the chunks ``box`` overlaps without containing them.

    Enumerated slab by slab (for the first axis on which a chunk is not inside,
    only the first and last overlapped index can be partial), so a shard of many
    chunks costs only its border.
    """
    overlapped, inside = _chunk_ranges(box, shape, chunks)
    for d in range(len(shape)):
        edges = sorted({i for i in (overlapped[d].start, overlapped[d].stop - 1) if i in overlapped[d] and i not in inside[d]})
        for e in edges:
            axes = [inside[k] for k in range(d)] + [[e]] + [overlapped[k] for k in range(d + 1, len(shape))]
            yield from itertools.product(*axes)


@dataclass
class BorderChunk:
    """A chunk shared by shards of more than one writer, or not wholly inside its writer's shard."""

    box: Box  # clipped to the array
    owner: int  # the rank that writes it: the writer of the shard holding the chunk's first element
    pieces: List[Tuple[Box, int]]  # (part of the chunk, writer rank of the shard it comes from)


def plan_chunk_writes(
    shape: Sequence[int], chunks: Sequence[int], writers: Sequence[Tuple[Box, int]]
) -> Dict[Tuple[int, ...], BorderChunk]:
    """Every border chunk of one array, with its owner and pieces; deterministic on every rank.

    ``writers``: (shard box, writing rank) per saved shard. Chunks wholly inside a shard
    are written by its writer and are not listed. Empty for shard-aligned chunking.
    """
    if not shape or math.prod(shape) == 0:
        return {}
    out: Dict[Tuple[int, ...], BorderChunk] = {}
    for box, rank in sorted(writers, key=lambda w: (w[0].offsets, w[1])):
        for coords in border_chunks(box, shape, chunks):
            cbox = chunk_box(coords, shape, chunks)
            part = intersect(box, cbox)
            if part is None:
                continue
            entry = out.setdefault(coords, BorderChunk(cbox, -1, []))
            entry.pieces.append((part, rank))
            if part.offsets == cbox.offsets:
                entry.owner = rank
    for coords, entry in out.items():
        if entry.owner < 0:  # no shard holds the chunk's first element: invalid sharding
            entry.owner = entry.pieces[0][1]
    return out


# --------------------------------------------------------------------------- keys as paths
def key_path_problem(key: Any) -> Optional[str]:
    """Why ``key`` cannot be a path inside the checkpoint directory, or None.

    Keys become directories as they are ("decoder.layers.0.weight", "model/w"), so
    only what could leave the checkpoint, hit its own files or differ between
    operating systems is refused.
    """
    if not isinstance(key, str) or not key:
        return "the key is empty"
    if "\\" in key:
        return "it contains a backslash (a path separator on Windows)"
    if any(ord(ch) < 32 for ch in key):
        return "it contains a control character"
    if key.startswith("/"):
        return "it is an absolute path"
    segments = key.split("/")
    if "" in segments:
        return "it has an empty path segment ('//' or a trailing '/')"
    if any(seg in (".", "..") for seg in segments):
        return "it has a '.' or '..' path segment (it would leave its own directory)"
    if segments[0] in _RESERVED_NAMES:
        return f"{segments[0]!r} is a file of the checkpoint directory itself"
    return None


def check_layout_paths(tensor_keys: Iterable[str], object_keys: Iterable[str]) -> None:
    """Before anything is written: every key must be a safe path, and no two may collide.

    Each array owns its directory (zarr keeps ``zarr.json`` and ``c/...`` there, and
    overwriting or removing an array deletes it whole), so nothing else may lie
    inside it; an object's ``.pt`` file must not be an array's or object's path.
    """
    owners: Dict[str, str] = {}
    for what, keys, path_of in (("tensor", tensor_keys, lambda k: k), ("object", object_keys, object_file_name)):
        for key in keys:
            problem = key_path_problem(key)
            if problem:
                raise CheckpointingException(
                    f"{what} key {key!r} cannot be saved by the zarr backend, whose files are named after "
                    f"their keys: {problem}; rename it (or save with sharded_strategy='torch_dist')"
                )
            path = path_of(key)
            if path in owners:
                raise CheckpointingException(f"zarr backend: {what} {key!r} and {owners[path]} would both be stored at {path}")
            owners[path] = f"{what} {key!r}"
    for path, owner in sorted(owners.items()):
        parts = path.split("/")
        for i in range(1, len(parts)):
            outer = owners.get("/".join(parts[:i]))
            if outer is not None:
                raise CheckpointingException(
                    f"zarr backend: {owner} would be stored inside the directory of {outer} "
                    f"({'/'.join(parts[:i])}/), which belongs to that array alone; rename one of the keys"
                )


def check_index_paths(directory: str, index: Dict[str, Any]) -> None:
    """Reader: every path the index names must stay inside the checkpoint directory.

    Lexically for every backend (a crafted index could name ``../../x`` or ``/etc``),
    and for local checkpoints also after resolving symbolic links.
    """
    where = join(directory, INDEX_FILE)
    keys = [("tensor", k) for k in index.get("tensors", {})] + [("object", k) for k in index.get("objects", [])]
    root = None if is_remote(directory) or symlinks_allowed() else os.path.realpath(directory)
    for what, key in keys:
        if not isinstance(key, str) or not key:
            raise CorruptCheckpointError(f"{where} is damaged: it names an empty or non-string {what} key {key!r}")
        norm = posixpath.normpath(key.replace("\\", "/"))
        if key.startswith(("/", "\\")) or os.path.isabs(key) or norm in (".", "..") or norm.startswith("../") or "\x00" in key:
            raise UnsafeCheckpointError(f"refusing {where}: {what} key {key!r} points outside the checkpoint directory")
        if root is not None:
            # the path actually read: the array's directory, or the object's .pt file
            real = os.path.realpath(os.path.join(root, key if what == "tensor" else object_file_name(key)))
            if not real.startswith(root.rstrip(os.sep) + os.sep):
                raise UnsafeCheckpointError(
                    f"refusing {where}: {what} key {key!r} resolves to {real}, outside the checkpoint directory {root}"
                )


def _array_path(directory: str, key: str) -> str:
    return join(directory, key)


def _store(directory: str, key: str, read_only: bool = False) -> Any:
    """What zarr should open: a local path, or an fsspec store for URLs.

    (A bare ``memory://`` string would give zarr's own in-process store, not
    fsspec's memory filesystem where the rest of the checkpoint lives.)
    """
    path = _array_path(directory, key)
    if not is_remote(path):
        return path
    zarr = _zarr()

    return zarr.storage.FsspecStore.from_url(path, read_only=read_only)


def _base_store(directory: str, key: str, read_only: bool = False) -> Any:
    """Like :func:`_store`, but always a zarr ``Store`` object (the integrity wrappers need one)."""
    store = _store(directory, key, read_only)
    if isinstance(store, str):
        store = _zarr().storage.LocalStore(store, read_only=read_only)
    return store


def object_path(directory: str, unique_key: str) -> str:
    return join(directory, f"{unique_key}.pt")


def object_file_name(unique_key: str) -> str:
    return f"{unique_key}.pt"


# --------------------------------------------------------------------------- integrity records
@dataclass(frozen=True)
class FileRecord:
    """One file a rank wrote (a zarr chunk or an object), as committed in ``zarr_index.json``."""

    key: str  # the tensor or object key the file belongs to (named in every error)
    size: int  # bytes
    crc32: int  # crc32 of the bytes, the checksum torch_dist uses too


def chunk_file_names(shape: Sequence[int], chunks: Sequence[int]) -> Iterator[str]:
    """Every chunk file of an array, relative to it (zarr v3 default key encoding, "/")."""
    grid = [math.ceil(n / c) for n, c in zip(shape, chunks)]
    for coords in itertools.product(*map(range, grid)):
        yield "/".join(["c", *map(str, coords)])


def _is_chunk_name(name: str) -> bool:
    return name == "c" or name.startswith("c/")


def chunk_coords(name: str) -> Tuple[int, ...]:
    """Grid coordinates of the chunk file ``c/i/j/...`` (see :func:`chunk_file_names`)."""
    return tuple(int(i) for i in name.split("/")[1:])


def _chunk_offsets(name: str, chunks: Sequence[int]) -> Tuple[int, ...]:
    """Global offsets of the chunk file ``c/i/j/...``."""
    return tuple(i * c for i, c in zip(chunk_coords(name), chunks))


async def _crc32(buffer: Any) -> int:
    view = buffer.as_buffer_like()
    if len(buffer) >= _CRC_IN_THREAD_BYTES:
        return await asyncio.to_thread(crc32, view)
    return crc32(view)


def file_problem(what: str, path: str, record: FileRecord, size: Optional[int], crc: Optional[int] = None) -> Optional[str]:
    """Why a file does not match its record, or None. ``size`` None: missing; ``crc`` None: not checked."""
    where = f"{what} {path} of {record.key!r}"
    if size is None:
        return f"{where} is missing (recorded in {INDEX_FILE} at save time)"
    if size != record.size:
        how = "truncated" if size < record.size else "too long"
        return f"{where} is {how}: {size} bytes, expected {record.size}"
    if crc is not None and crc != record.crc32:
        return f"{where} is damaged: CRC32 {crc:#010x}, recorded at save time {record.crc32:#010x}"
    return None


@functools.lru_cache(maxsize=None)
def _store_wrappers() -> Tuple[type, type]:
    """The two store wrappers; built on first use because zarr is an optional (and slow) import."""
    WrapperStore = _zarr().storage.WrapperStore

    class RecordingStore(WrapperStore):
        """Writes through; records size and CRC32 of each chunk from the bytes zarr hands over."""

        def __init__(self, store: Any, records: Optional[Dict[str, Tuple[int, int]]] = None):
            super().__init__(store)
            self.records = {} if records is None else records  # chunk name -> (size, crc32)

        def _with_store(self, store: Any) -> Any:
            return type(self)(store, self.records)

        async def set(self, key: str, value: Any) -> None:
            try:
                if not _is_chunk_name(key):
                    await self._store.set(key, value)
                    return
                # checksum while the store writes: both only read the buffer
                crc, _ = await asyncio.gather(_crc32(value), self._store.set(key, value))
            except Exception as e:
                converted = write_error(e, f"{self._store}/{key}")
                if converted is e:
                    raise
                raise converted from e
            self.records[key] = (len(value), crc)

    class CheckingStore(WrapperStore):
        """Checks every file zarr fetches: containment always, and a chunk against its record
        (``records`` None: an index without records) before zarr decodes it."""

        def __init__(
            self, store: Any, array_dir: str, records: Optional[Callable[[str], Optional[FileRecord]]], verify: bool,
            root: str = "", prefix: str = "",
        ):
            super().__init__(store)
            self.array_dir, self.records, self.verify = array_dir, records, verify
            self.root, self.prefix = root, prefix  # checkpoint directory, array key

        def _with_store(self, store: Any) -> Any:
            return type(self)(store, self.array_dir, self.records, self.verify, self.root, self.prefix)

        def _contain(self, key: str) -> None:
            # containment as for every reader: a name inside the checkpoint, no link out, a regular file
            path = checked_path(self.root, f"{self.prefix}/{key}", "zarr file", nested=True, source=INDEX_FILE)
            if not is_remote(path):
                try:
                    mode = os.stat(path).st_mode
                except FileNotFoundError:
                    return  # zarr reports it missing (records say whether that is damage)
                if not stat.S_ISREG(mode):
                    raise not_regular(mode, path, "zarr file")

        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            if self.root:
                self._contain(key)
            if byte_range is not None and _is_chunk_name(key) and self.records is not None:
                # a partial fetch would skip the check: fetch the chunk whole, check it, cut the range
                whole = await self.get(key, prototype, None)
                return None if whole is None else _byte_range(whole, byte_range)
            data = await self._store.get(key, prototype, byte_range)
            if self.records is None:
                return data
            if byte_range is None and _is_chunk_name(key):
                await self._check(key, data)
            elif byte_range is None and key == ARRAY_METADATA_FILE:
                await self._check_metadata(data)
            return data

        async def get_partial_values(self, prototype: Any, key_ranges: Any) -> List[Any]:
            return [await self.get(k, prototype, r) for k, r in key_ranges]

        async def _get_many(self, requests: Any) -> Any:
            for key, prototype, byte_range in requests:
                yield key, await self.get(key, prototype, byte_range)

        async def _check(self, name: str, data: Any) -> None:
            path = join(self.array_dir, name)
            record = self.records(name)
            if record is None:
                raise CorruptCheckpointError(f"zarr chunk file {path} has no record in {INDEX_FILE}: the index is damaged")
            size = None if data is None else len(data)
            crc = await _crc32(data) if self.verify and size == record.size else None
            problem = file_problem("zarr chunk file", path, record, size, crc)
            if problem:
                raise CorruptCheckpointError(problem)

        async def _check_metadata(self, data: Any) -> None:
            # always with CRC32 (a few hundred bytes): an edited zarr.json decodes chunks as garbage
            record = self.records(ARRAY_METADATA_FILE)
            if record is None:
                return  # indexes before format 3: compared with the index after opening instead
            path = join(self.array_dir, ARRAY_METADATA_FILE)
            if data is None:
                raise CorruptCheckpointError(file_problem("zarr metadata file", path, record, None) or path)
            size, crc = len(data), crc32(data.as_buffer_like())
            if (size, crc) != (record.size, record.crc32):
                raise CorruptCheckpointError(
                    f"zarr metadata file {path} of {record.key!r} is damaged: changed after the save "
                    f"({size} bytes, CRC32 {crc:#010x}; recorded {record.size} bytes, CRC32 {record.crc32:#010x}), "
                    "so its chunks would be decoded wrongly"
                )

    return RecordingStore, CheckingStore


def _byte_range(buf: Any, byte_range: Any) -> Any:
    """The part of a whole fetched ``buf`` a zarr ``ByteRequest`` asks for."""
    n = len(buf)
    if hasattr(byte_range, "start") and hasattr(byte_range, "end"):  # RangeByteRequest
        lo, hi = byte_range.start, byte_range.end
    elif hasattr(byte_range, "offset"):  # OffsetByteRequest
        lo, hi = byte_range.offset, n
    elif hasattr(byte_range, "suffix"):  # SuffixByteRequest
        lo, hi = max(0, n - byte_range.suffix), n
    else:
        raise CorruptCheckpointError(f"unsupported byte range request {byte_range!r}")
    return buf[lo:hi]


def commit_file_records(directory: str, written: Iterable[WrittenItem], durable: bool = True) -> None:
    """Coordinator, before the commit marker: put every rank's file records into the index,
    and those of every array's ``zarr.json`` (read back here: a few hundred bytes each).

    Also checks that every chunk of every array and every object has a record: a
    chunk no rank wrote would otherwise read as zeros.
    """
    index = read_index(directory)
    files = {w.relative_path: FileRecord(w.storage_key, w.length, w.crc32) for w in written}
    missing = [(key, path) for key, path in expected_files(index) if path not in files]
    if missing:
        key, path = missing[0]
        raise CheckpointingException(
            f"internal error: {len(missing)} file(s) were not written by any rank, e.g. {path} of {key!r}"
        )
    storage, directory = storage_for(directory)
    for key in sorted(index["tensors"]):
        data = storage.read_bytes(join(_array_path(directory, key), ARRAY_METADATA_FILE))
        files[metadata_file_name(key)] = FileRecord(key, len(data), crc32(data))
    index["format"] = INDEX_FORMAT
    index["files"] = {path: asdict(r) for path, r in sorted(files.items())}
    write_index(directory, index, durable)


def metadata_file_name(key: str) -> str:
    """The ``zarr.json`` of array ``key``, relative to the checkpoint."""
    return f"{key}/{ARRAY_METADATA_FILE}"


def expected_files(index: Dict[str, Any]) -> List[Tuple[str, str]]:
    """(key, file relative to the checkpoint) for every chunk of every array and every object."""
    out = [
        (key, f"{key}/{name}")
        for key, info in sorted(index["tensors"].items())
        for name in chunk_file_names(info["shape"], info["chunks"])
    ]
    return out + [(key, object_file_name(key)) for key in sorted(index.get("objects", []))]


def _read_file_records(index: Dict[str, Any], where: str) -> Optional[Dict[str, FileRecord]]:
    """The records of a format-2 index; None for older indexes (integrity unknown, not corrupt)."""
    if "files" not in index:
        return None
    try:
        return {path: FileRecord(r["key"], int(r["size"]), int(r["crc32"])) for path, r in index["files"].items()}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: the file records are damaged: {e!r}") from None


def create_arrays(
    directory: str,
    tensors: Dict[str, Tuple[torch.dtype, Tuple[int, ...], List[Box]]],
    object_keys: Iterable[str],
) -> Dict[str, Any]:
    """Coordinator: create every array (metadata only) and return the index to commit.

    Refuses unsafe or colliding keys (:func:`check_layout_paths`) before anything is written.
    """
    zarr = _zarr()

    object_keys = sorted(object_keys)
    check_layout_paths(list(tensors), object_keys)
    index: Dict[str, Any] = {"format": 1, "tensors": {}, "objects": object_keys}
    for key, (dtype, shape, boxes) in tensors.items():
        stored = _storage_dtype(dtype)
        chunks = array_chunks(dtype, shape, boxes)
        zarr.create_array(
            store=_store(directory, key),
            shape=shape,
            chunks=chunks,
            dtype=_numpy_dtype(stored),
            compressors=None,
            fill_value=0,
            # pinned: chunk_file_names() enumerates chunk files in this encoding
            chunk_key_encoding={"name": "default", "separator": "/"},
            overwrite=True,
        )
        index["tensors"][key] = {
            "dtype": str(dtype).replace("torch.", ""),
            "stored_dtype": str(stored).replace("torch.", ""),
            "shape": list(shape),
            "chunks": list(chunks),
        }
    return index


def array_chunks(dtype: torch.dtype, shape: Sequence[int], boxes: Iterable[Box]) -> Tuple[int, ...]:
    """The chunk shape :func:`create_arrays` gives a tensor (every rank computes the same)."""
    if not shape:
        return ()  # 0-d tensors: one chunk file "c"
    return chunk_shape_for(shape, boxes, torch.empty((), dtype=dtype).element_size())


def write_index(directory: str, index: Dict[str, Any], durable: bool = True) -> None:
    storage, directory = storage_for(directory)
    storage.write_atomic(join(directory, INDEX_FILE), json.dumps(index).encode(), durable)


def read_index(directory: str) -> Dict[str, Any]:
    storage, directory = storage_for(directory)
    path = join(directory, INDEX_FILE)
    try:
        index = load_json(storage.read_in(directory, INDEX_FILE, "zarr index"), path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing: the zarr checkpoint has no index") from None
    if not isinstance(index, dict):
        raise CorruptCheckpointError(f"{path} is damaged: it is not a JSON object")
    return index


# --------------------------------------------------------------------------- chunk-aligned writes
ArrayPlan = Tuple[Tuple[int, ...], Tuple[int, ...], Dict[Tuple[int, ...], BorderChunk]]  # shape, chunks, border chunks
# (key, chunk coordinates, part of the chunk, its values): what a rank contributes to a border chunk
Piece = Tuple[str, Tuple[int, ...], Box, torch.Tensor]


def plan_array_writes(
    tensors: Dict[str, Tuple[torch.dtype, Tuple[int, ...], List[Box]]], writers: Dict[str, List[Tuple[Box, int]]]
) -> Dict[str, ArrayPlan]:
    """Per array: shape, chunk shape (as :func:`create_arrays` chooses it) and border chunks.

    ``tensors`` as for :func:`create_arrays`; ``writers``: per key (shard box, writing rank).
    The same on every rank (metadata only), so the save needs no extra exchange to agree on it.
    """
    plans: Dict[str, ArrayPlan] = {}
    for key, (dtype, shape, boxes) in tensors.items():
        shape = tuple(shape)
        chunks = array_chunks(dtype, shape, boxes)
        plans[key] = (shape, chunks, plan_chunk_writes(shape, chunks, writers.get(key, [])))
    return plans


def split_for_chunks(requests: Sequence[WriteRequest], plans: Dict[str, ArrayPlan]) -> Tuple[List[WriteRequest], List[Piece]]:
    """This rank's shard requests as writes of whole chunks, plus its pieces of border chunks.

    Per shard: one request for the chunks wholly inside it (zarr writes whole chunks
    without reading them back, so concurrent writers never race on one file), and one
    piece per border chunk it overlaps, for that chunk's owner to assemble.
    """
    out: List[WriteRequest] = []
    pieces: List[Piece] = []
    for req in requests:
        plan = plans.get(req.storage_key) if req.offsets is not None else None
        if plan is None or not plan[2]:
            out.append(req)  # shard-aligned chunks (or an object): written as it is
            continue
        shape, chunks, _ = plan
        box = Box(tuple(req.offsets), tuple(req.data.shape))
        inner = interior_box(box, shape, chunks)
        if inner == box:
            out.append(req)
            continue
        if inner is not None:
            out.append(WriteRequest(req.storage_key, inner.offsets, req.data[relative_slices(inner, box)]))
        for coords in border_chunks(box, shape, chunks):
            part = intersect(box, chunk_box(coords, shape, chunks))
            if part is not None:
                pieces.append((req.storage_key, coords, part, req.data[relative_slices(part, box)]))
    return out, pieces


def assemble_border_chunks(plans: Dict[str, ArrayPlan], dtypes: Dict[str, torch.dtype], rank: int, pieces: Iterable[Piece]) -> List[WriteRequest]:
    """Owner side: one whole-chunk request per border chunk ``rank`` owns, from all its pieces.

    A chunk the pieces do not cover would be saved with zeros in the gap, so it is an error.
    """
    got: Dict[Tuple[str, Tuple[int, ...]], List[Tuple[Box, torch.Tensor]]] = {}
    for key, coords, part, values in pieces:
        got.setdefault((key, tuple(coords)), []).append((part, values))
    out = []
    for key in sorted(plans):
        for coords, chunk in sorted(plans[key][2].items()):
            if chunk.owner != rank:
                continue
            buffer = torch.empty(chunk.box.sizes, dtype=dtypes[key])
            covered = 0
            for part, values in got.pop((key, coords), []):
                buffer[relative_slices(part, chunk.box)] = values
                covered += part.numel
            if covered < chunk.box.numel:
                raise CheckpointingException(
                    f"zarr chunk {'/'.join(map(str, coords))} {chunk.box} of {key!r}: the saved shards cover "
                    f"only {covered} of its {chunk.box.numel} elements (missing shards, or a rank failed)"
                )
            out.append(WriteRequest(key, chunk.box.offsets, buffer))
    if got:
        (key, coords), _ = next(iter(got.items()))
        raise CheckpointingException(f"internal error: rank {rank} received pieces of chunk {coords} of {key!r}, which it does not own")
    return out


def write_zarr_requests(directory: str, requests: Sequence[WriteRequest], thread_count: int = 2, durable: bool = True) -> List[WrittenItem]:
    """Write tensor chunks into their arrays and objects into ``.pt`` files.

    Returns one item per file written (each chunk file, each object file) with its
    size and CRC32, for :func:`commit_file_records`.
    """
    zarr = _zarr()
    RecordingStore, _ = _store_wrappers()

    storage, directory = storage_for(directory)
    arrays: Dict[str, Any] = {}
    stores: Dict[str, Any] = {}
    lock = threading.Lock()

    def array(key: str) -> Any:
        with lock:
            if key not in arrays:
                stores[key] = RecordingStore(_base_store(directory, key))
                # all-zero chunks are written too: a missing chunk file then always means damage
                arrays[key] = zarr.open_array(stores[key], mode="r+").with_config({"write_empty_chunks": True})
            return arrays[key]

    def write(req: WriteRequest) -> Optional[WrittenItem]:
        if req.offsets is None:
            path = object_path(directory, req.storage_key)
            parent = path.rsplit("/", 1)[0]
            storage.makedirs(parent)
            storage.write_atomic(path, req.data, durable)
            return WrittenItem(req.storage_key, None, object_file_name(req.storage_key), 0, len(req.data), crc32(req.data))
        t = req.data.detach().cpu().contiguous()
        stored = _storage_dtype(t.dtype)
        values = (t.view(stored) if stored != t.dtype else t).numpy()
        region = tuple(slice(o, o + s) for o, s in zip(req.offsets, t.shape))
        arr = array(req.storage_key)
        if region:
            arr[region] = values
        else:
            arr[...] = values
        return None  # its chunk files are reported from the recording store below

    results: List[Optional[WrittenItem]] = [None] * len(requests)

    def task(i: int) -> None:
        results[i] = write(requests[i])

    run_parallel(list(range(len(requests))), task, thread_count)
    items = [r for r in results if r is not None]
    for key, store in stores.items():
        chunks = arrays[key].chunks
        for name, (size, crc) in sorted(store.records.items()):
            items.append(WrittenItem(key, _chunk_offsets(name, chunks), f"{key}/{name}", 0, size, crc))
    return items


def _check_index_entries(directory: str, index: Dict[str, Any]) -> None:
    """Reader: the index's own tensor entries must be well formed and consistent.

    They are the checkpoint metadata every load plans with (dtype, shape), so a
    damaged entry would otherwise surface as a raw error deep in a load.
    """
    where = join(directory, INDEX_FILE)
    tensors = index.get("tensors", {})
    if not isinstance(tensors, dict) or not isinstance(index.get("objects", []), list):
        raise CorruptCheckpointError(f"{where} is damaged: 'tensors' must be an object and 'objects' a list")
    for key, info in tensors.items():
        try:
            dtype, stored = getattr(torch, info["dtype"]), getattr(torch, info["stored_dtype"])
            shape, chunks = info["shape"], info["chunks"]
            ok = (
                isinstance(dtype, torch.dtype)
                and isinstance(stored, torch.dtype)
                and stored == _storage_dtype(dtype)
                and all(isinstance(n, int) and n >= 0 for n in shape)
                and all(isinstance(c, int) and c >= 1 for c in chunks)
                and len(shape) == len(chunks)
            )
        except (AttributeError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{where} is damaged: the entry of tensor {key!r} is unreadable: {e!r}") from None
        if not ok:
            raise CorruptCheckpointError(f"{where} is damaged: the entry of tensor {key!r} is inconsistent: {info!r}")


def _array_mismatch(arr: Any, info: Dict[str, Any]) -> Optional[str]:
    """How an opened array differs from its index entry (what the save created), or None."""
    expected_dtype = _numpy_dtype(getattr(torch, info["stored_dtype"]))
    problems = []
    if tuple(arr.shape) != tuple(info["shape"]):
        problems.append(f"shape {list(arr.shape)}, expected {info['shape']}")
    if np.dtype(arr.dtype) != expected_dtype:
        problems.append(f"data type {np.dtype(arr.dtype)}, expected {expected_dtype} (for {info['dtype']})")
    if tuple(arr.chunks) != tuple(info["chunks"]):
        problems.append(f"chunk shape {list(arr.chunks)}, expected {info['chunks']}")
    meta = arr.metadata
    separator = getattr(meta.chunk_key_encoding, "separator", None)
    if separator != "/":
        problems.append(f"chunk key separator {separator!r}, expected '/'")
    # saved uncompressed, little-endian: anything else decodes the recorded chunk bytes differently
    codecs = [type(c).__name__ for c in meta.codecs]
    endian = getattr(getattr(meta.codecs[0], "endian", None), "value", None) if codecs else None
    if codecs != ["BytesCodec"] or endian not in (None, "little"):
        problems.append(f"codecs {codecs} ({endian or 'no'} byte order), expected one little-endian 'bytes' codec")
    return "; ".join(problems) or None


class ZarrReader:
    """Reads regions of zarr arrays; same interface as ``TorchDistReader``.

    Every chunk file read is checked against its record (present, size, and CRC32
    when ``verify_checksums``); ``checksums`` is unused (the records are in the index).
    """

    def __init__(self, directory: str, checksums: Any = None, verify_checksums: bool = True):
        self.storage, self.directory = storage_for(directory)
        self.index = read_index(self.directory)
        _check_index_entries(self.directory, self.index)
        check_index_paths(self.directory, self.index)
        # None: an index written before records existed; such files are read unchecked
        self.files = _read_file_records(self.index, join(self.directory, INDEX_FILE))
        self.verify_checksums = verify_checksums
        self._chunk_records: Optional[Dict[str, List[int]]] = None
        self._arrays: Dict[str, Any] = {}
        self._lock = threading.Lock()
        sd_meta: Dict[str, Any] = {}
        self.chunks: Dict[str, List[ChunkInfo]] = {}
        for key, info in self.index.get("tensors", {}).items():
            dtype = getattr(torch, info["dtype"])
            shape = tuple(info["shape"])
            whole = Box((0,) * len(shape), shape)
            sd_meta[key] = TensorStorageMetadata(
                TensorProperties(dtype=dtype), torch.Size(shape), [ChunkStorageMetadata(torch.Size(whole.offsets), torch.Size(shape))]
            )
            # the whole array is one logical chunk: zarr slices any region directly
            self.chunks[key] = [ChunkInfo(whole, _StorageInfo(key, 0, 0))]
        for key in self.index.get("objects", []):
            sd_meta[key] = BytesStorageMetadata()
        self.metadata = Metadata(state_dict_metadata=sd_meta, planner_data={k: (k,) for k in sd_meta}, storage_data={})

    def array(self, key: str) -> Any:
        """The opened zarr array of ``key``.

        Its ``zarr.json`` is checked against its record (format 3 indexes) and the
        opened array against the index (shape, dtype, chunking): a ``zarr.json``
        edited after the save raises instead of decoding chunks as garbage.
        """
        zarr = _zarr()

        with self._lock:
            if key not in self._arrays:
                path = _array_path(self.directory, key)
                try:
                    # format pinned: zarr would otherwise also probe for zarr v2 metadata files
                    arr = zarr.open_array(self._open_store(key), mode="r", zarr_format=3)
                except CheckpointingException:
                    raise  # from the checking store: names the damaged zarr.json (or a refused path)
                except Exception as e:  # zarr raises several types for missing/damaged metadata
                    raise CorruptCheckpointError(f"zarr array {path} for {key!r} cannot be opened: {e}") from None
                problem = _array_mismatch(arr, self.index["tensors"][key])
                if problem:
                    raise CorruptCheckpointError(
                        f"zarr metadata file {join(path, ARRAY_METADATA_FILE)} of {key!r} does not match "
                        f"{INDEX_FILE} (written at save time): {problem}"
                    )
                self._arrays[key] = arr
            return self._arrays[key]

    def _open_store(self, key: str) -> Any:
        files = self.files
        _, CheckingStore = _store_wrappers()
        return CheckingStore(
            _base_store(self.directory, key, read_only=True),
            _array_path(self.directory, key),
            None if files is None else (lambda name: files.get(f"{key}/{name}")),
            self.verify_checksums,
            self.directory,
            key,
        )

    def validate_tensor(self, key: str) -> None:
        """Before allocating a whole ``key``: with file records, its declared shape must match
        the recorded chunk files (their number and sizes), so a damaged index cannot make a
        load allocate a tensor the files cannot hold. (Indexes without records: unchecked.)"""
        if self.files is None:
            return
        info = self.index["tensors"][key]
        shape, chunks = info["shape"], info["chunks"]
        esize = torch.empty((), dtype=getattr(torch, info["stored_dtype"])).element_size()
        grid = math.prod(math.ceil(n / c) for n, c in zip(shape, chunks)) if math.prod(shape) else 0
        per_chunk = math.prod(chunks) * esize
        if self._chunk_records is None:  # key -> sizes of its recorded chunk files (one pass over the records)
            self._chunk_records = {}
            for name, r in self.files.items():
                head, sep, rest = name.rpartition("/c/") if "/c/" in name else name.rpartition("/c")
                if sep and _is_chunk_name(sep[1:] + rest):
                    self._chunk_records.setdefault(head, []).append(r.size)
        recorded = self._chunk_records.get(key, [])
        if len(recorded) != grid or any(size != per_chunk for size in recorded):
            raise CorruptCheckpointError(
                f"{join(self.directory, INDEX_FILE)} is damaged: tensor {key!r} is declared with shape {shape} "
                f"in chunks of {chunks} ({grid} chunk files of {per_chunk} bytes), but {len(recorded)} chunk "
                "files are recorded; nothing was allocated for it"
            )

    def read_region(self, key: str, chunk: ChunkInfo, overlap: Box, out: torch.Tensor, dtype: torch.dtype) -> None:
        arr = self.array(key)
        info = self.index["tensors"][key]
        region = tuple(slice(o, o + s) for o, s in zip(overlap.offsets, overlap.sizes))
        try:
            values = arr[region] if region else arr[...]
        except CheckpointingException:
            raise  # from the checking store: already names key and chunk file
        except Exception as e:
            raise CorruptCheckpointError(f"reading {overlap} of zarr array {key!r} in {self.directory} failed: {e}") from None
        t = torch.from_numpy(np.ascontiguousarray(values))
        if info["stored_dtype"] != info["dtype"]:
            t = t.view(dtype)
        out.copy_(t.reshape(out.shape))

    def read_bytes(self, storage_key: str) -> bytes:
        if storage_key not in self.index.get("objects", []):
            raise MismatchError(f"object {storage_key!r} is not in the checkpoint")
        path = object_path(self.directory, storage_key)
        try:
            data = self.storage.read_in(self.directory, object_file_name(storage_key), "object file", nested=True, source=INDEX_FILE)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"object file {path} of {storage_key!r} is missing (listed in {INDEX_FILE})") from None
        record = self.files.get(object_file_name(storage_key)) if self.files is not None else None
        if record is not None:
            crc = crc32(data) if self.verify_checksums else None
            problem = file_problem("object file", path, record, len(data), crc)
            if problem:
                raise CorruptCheckpointError(problem)
        return data

    def check_files(self) -> Iterator[Tuple[str, str, int, Optional[str]]]:
        """For ``verify``: (key, file, size, problem or None) for every chunk file of every
        array and every object file, read in blocks; nothing for indexes without records."""
        if self.files is None:
            return
        for key, name in expected_files(self.index):
            record = self.files.get(name)
            if record is None:
                yield key, name, 0, f"{join(self.directory, name)} of {key!r} has no record in {INDEX_FILE}: the index is damaged"
            else:
                yield key, name, record.size, self._file_problem(name, record)

    def _file_problem(self, name: str, record: FileRecord) -> Optional[str]:
        path = join(self.directory, name)
        what = "object file" if name == object_file_name(record.key) else "zarr chunk file"
        try:
            reader = self.storage.open_in(self.directory, name, what, nested=True, source=INDEX_FILE)
        except FileNotFoundError:
            return file_problem(what, path, record, None)
        except CheckpointingException as e:  # refused (leads outside the checkpoint) or not a regular file
            return str(e)
        try:
            if reader.size != record.size:
                return file_problem(what, path, record, reader.size)
            crc = 0
            for start in range(0, reader.size, _VERIFY_BLOCK):
                crc = crc32(reader.read(start, min(_VERIFY_BLOCK, reader.size - start)), crc)
            return file_problem(what, path, record, reader.size, crc)
        finally:
            reader.close()

    def close(self) -> None:
        self._arrays.clear()

    def __enter__(self) -> "ZarrReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
