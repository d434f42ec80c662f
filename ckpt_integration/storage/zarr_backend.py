"""The ``zarr`` backend: one zarr array per tensor key (zarr-python, format 3).

Layout of a checkpoint directory::

    <key>/zarr.json, <key>/c/...     one array per ShardedTensor key (global shape)
    <object key>/shard_<o>_<s>.pt    ShardedObjects, torch.save([obj]) (Megatron's layout)
    zarr_index.json                  keys -> dtype, shape, chunking; object keys;
                                     size + CRC32 of every chunk and object file
    common.pt, manifest.json         as for torch_dist
    metadata.json                    commit marker: {"sharded_backend": "zarr", ...}

Why this shape: every array is chunked on the grid of all shard boundaries
(the gcd of offsets and sizes per axis), so each zarr chunk lies inside exactly
one saved shard and ranks write disjoint chunk files without coordination.
Resharded reads are plain slices of the array. zarr has no bfloat16 (and no
float8): such tensors are stored as same-width integers and the real dtype is
kept in the index.

Integrity: zarr itself reads a missing chunk file as fill value (zeros) and
checks nothing. So every chunk is written (also all-zero ones), each rank
records size and CRC32 of the exact bytes it hands to zarr's store (a store
wrapper sees them, no re-read), and the coordinator commits these records into
``zarr_index.json`` (``"format": 2``) before ``metadata.json``. Reads go through
a checking store wrapper: zarr fetches only the chunks a region needs, and each
fetched chunk is checked (present, size, CRC32) before it is decoded. Indexes
without records (written before format 2) are read unchecked, as before.

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
import threading
import zlib
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

from ..errors import CheckpointingException, CorruptCheckpointError, MismatchError
from ..planning.boxes import Box
from .filesystem import is_remote, join, storage_for
from .torch_dist import ChunkInfo, WriteRequest, WrittenItem, run_parallel

INDEX_FILE = "zarr_index.json"
# format 2 adds "files": per chunk/object file its key, size and CRC32
INDEX_FORMAT = 2
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


def chunk_shape_for(global_shape: Sequence[int], boxes: Iterable[Box]) -> Tuple[int, ...]:
    """Per axis, the gcd of all shard offsets and sizes: chunk borders are shard borders."""
    boxes = list(boxes)
    out = []
    for a, n in enumerate(global_shape):
        values = [b.offsets[a] for b in boxes] + [b.sizes[a] for b in boxes] + [n]
        g = reduce(math.gcd, [v for v in values if v > 0], 0)
        out.append(max(1, g or 1))
    return tuple(out)


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
    crc32: int  # zlib.crc32 of the bytes, the checksum torch_dist uses too


def chunk_file_names(shape: Sequence[int], chunks: Sequence[int]) -> Iterator[str]:
    """Every chunk file of an array, relative to it (zarr v3 default key encoding, "/")."""
    grid = [math.ceil(n / c) for n, c in zip(shape, chunks)]
    for coords in itertools.product(*map(range, grid)):
        yield "/".join(["c", *map(str, coords)])


def _is_chunk_name(name: str) -> bool:
    return name == "c" or name.startswith("c/")


def _chunk_offsets(name: str, chunks: Sequence[int]) -> Tuple[int, ...]:
    """Global offsets of the chunk file ``c/i/j/...``."""
    return tuple(int(i) * c for i, c in zip(name.split("/")[1:], chunks))


async def _crc32(buffer: Any) -> int:
    view = buffer.as_buffer_like()
    if len(buffer) >= _CRC_IN_THREAD_BYTES:
        return await asyncio.to_thread(zlib.crc32, view)
    return zlib.crc32(view)


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
            if not _is_chunk_name(key):
                await self._store.set(key, value)
                return
            # checksum while the store writes: both only read the buffer
            crc, _ = await asyncio.gather(_crc32(value), self._store.set(key, value))
            self.records[key] = (len(value), crc)

    class CheckingStore(WrapperStore):
        """Checks every whole chunk zarr fetches against its record before zarr decodes it."""

        def __init__(self, store: Any, array_dir: str, records: Callable[[str], Optional[FileRecord]], verify: bool):
            super().__init__(store)
            self.array_dir, self.records, self.verify = array_dir, records, verify

        def _with_store(self, store: Any) -> Any:
            return type(self)(store, self.array_dir, self.records, self.verify)

        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            data = await self._store.get(key, prototype, byte_range)
            if byte_range is None and _is_chunk_name(key):
                await self._check(key, data)
            return data

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

    return RecordingStore, CheckingStore


def commit_file_records(directory: str, written: Iterable[WrittenItem], durable: bool = True) -> None:
    """Coordinator, before the commit marker: put every rank's file records into the index.

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
    index["format"] = INDEX_FORMAT
    index["files"] = {path: asdict(r) for path, r in sorted(files.items())}
    write_index(directory, index, durable)


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
    """Coordinator: create every array (metadata only) and return the index to commit."""
    zarr = _zarr()

    index: Dict[str, Any] = {"format": 1, "tensors": {}, "objects": sorted(object_keys)}
    for key, (dtype, shape, boxes) in tensors.items():
        stored = _storage_dtype(dtype)
        chunks = chunk_shape_for(shape, boxes) if shape else ()
        zarr.create_array(
            store=_store(directory, key),
            shape=shape,
            chunks=chunks,  # () for 0-d tensors: one chunk file "c"
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


def write_index(directory: str, index: Dict[str, Any], durable: bool = True) -> None:
    storage, directory = storage_for(directory)
    storage.write_atomic(join(directory, INDEX_FILE), json.dumps(index).encode(), durable)


def read_index(directory: str) -> Dict[str, Any]:
    storage, directory = storage_for(directory)
    path = join(directory, INDEX_FILE)
    try:
        return json.loads(storage.read_bytes(path))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing: the zarr checkpoint has no index") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is damaged: {e}") from None


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
            return WrittenItem(req.storage_key, None, object_file_name(req.storage_key), 0, len(req.data), zlib.crc32(req.data))
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


class ZarrReader:
    """Reads regions of zarr arrays; same interface as ``TorchDistReader``.

    Every chunk file read is checked against its record (present, size, and CRC32
    when ``verify_checksums``); ``checksums`` is unused (the records are in the index).
    """

    def __init__(self, directory: str, checksums: Any = None, verify_checksums: bool = True):
        self.storage, self.directory = storage_for(directory)
        self.index = read_index(self.directory)
        # None: an index written before records existed; such files are read unchecked
        self.files = _read_file_records(self.index, join(self.directory, INDEX_FILE))
        self.verify_checksums = verify_checksums
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
        """The opened zarr array of ``key`` (its zarr.json read and checked by zarr)."""
        zarr = _zarr()

        with self._lock:
            if key not in self._arrays:
                path = _array_path(self.directory, key)
                try:
                    self._arrays[key] = zarr.open_array(self._open_store(key), mode="r")
                except Exception as e:  # zarr raises several types for missing/damaged metadata
                    raise CorruptCheckpointError(f"zarr array {path} for {key!r} cannot be opened: {e}") from None
            return self._arrays[key]

    def _open_store(self, key: str) -> Any:
        if self.files is None:
            return _store(self.directory, key, read_only=True)
        files = self.files
        _, CheckingStore = _store_wrappers()
        return CheckingStore(
            _base_store(self.directory, key, read_only=True),
            _array_path(self.directory, key),
            lambda name: files.get(f"{key}/{name}"),
            self.verify_checksums,
        )

    def read_region(self, key: str, chunk: ChunkInfo, overlap: Box, out: torch.Tensor, dtype: torch.dtype) -> None:
        arr = self.array(key)
        info = self.index["tensors"][key]
        region = tuple(slice(o, o + s) for o, s in zip(overlap.offsets, overlap.sizes))
        try:
            values = arr[region] if region else arr[...]
        except CorruptCheckpointError:
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
            data = self.storage.read_bytes(path)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"object file {path} of {storage_key!r} is missing (listed in {INDEX_FILE})") from None
        record = self.files.get(object_file_name(storage_key)) if self.files is not None else None
        if record is not None:
            crc = zlib.crc32(data) if self.verify_checksums else None
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
            reader = self.storage.open_reader(path)
        except FileNotFoundError:
            return file_problem(what, path, record, None)
        try:
            if reader.size != record.size:
                return file_problem(what, path, record, reader.size)
            crc = 0
            for start in range(0, reader.size, _VERIFY_BLOCK):
                crc = zlib.crc32(reader.read(start, min(_VERIFY_BLOCK, reader.size - start)), crc)
            return file_problem(what, path, record, reader.size, crc)
        finally:
            reader.close()

    def close(self) -> None:
        self._arrays.clear()

    def __enter__(self) -> "ZarrReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
