"""Integrity of a zarr checkpoint: the store wrappers that record what is written and check what is read.

zarr reads a missing chunk file as zeros and checks nothing, so every byte passes one of two
wrappers around zarr's store (:func:`store_wrappers`): ``RecordingStore`` records size and
CRC32 of each chunk from the bytes zarr hands over (no re-read), ``CheckingStore`` checks each
fetched file before zarr decodes it (containment, record, CRC32; a byte-range fetch is served
from the whole checked chunk). :func:`array_mismatch` compares an opened array with its index
entry, :func:`file_problem` words every disagreement with a record.
"""

from __future__ import annotations

import asyncio
import functools
import os
import stat
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from ...errors import CorruptCheckpointError
from ..checksum import crc32
from ..filesystem import checked_path, is_remote, join, write_error
from ..readers import RetryPolicy, not_regular, retry_delay
from .index import ARRAY_METADATA_FILE, INDEX_FILE, FileRecord, is_chunk_name, numpy_dtype, zarr_module

if TYPE_CHECKING:  # zarr is optional, and imported on first use
    import zarr
    from zarr.abc.store import ByteRequest, Store
    from zarr.core.buffer import Buffer as ZarrBuffer, BufferPrototype

def _url(store: Any, key: str) -> str:
    """The URL of ``key`` in an fsspec store, or its path in a local one (for messages)."""
    fs, path = getattr(store, "fs", None), getattr(store, "path", None) or str(getattr(store, "root", ""))
    proto = getattr(fs, "protocol", "")
    proto = proto[0] if isinstance(proto, (tuple, list)) else proto
    return f"{proto}://{path}/{key}" if proto and proto != "file" else f"{path}/{key}"


async def retried(store: Any, call: Callable[[], Any], key: str, write: bool) -> Any:
    """``await call()`` on an object store with the bounded retries and per-attempt deadline every other
    remote request gets (``readers.retried``): zarr's own fsspec store makes one attempt, so one throttled
    request failed a save, and a load called it damage. Local stores: one plain call."""
    if type(store).__name__ != "FsspecStore":
        return await call()
    policy, start, attempt = RetryPolicy.from_env(), time.monotonic(), 0
    while True:
        attempt += 1
        try:
            return await (asyncio.wait_for(call(), policy.timeout) if policy.timeout > 0 else call())
        except Exception as e:  # noqa: BLE001 - classified by retry_delay
            await asyncio.sleep(retry_delay(e, policy, attempt, start, "set" if write else "get", _url(store, key),
                                            write, "zarr file"))


# CRC32 of buffers above this size runs in a worker thread: zlib releases the GIL,
# and zarr's event loop (one thread for all arrays) keeps issuing I/O meanwhile.
_CRC_IN_THREAD_BYTES = 1 << 20


async def _crc32(buffer: ZarrBuffer) -> int:
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
def store_wrappers() -> Tuple[type, type]:
    """The two store wrappers; built on first use because zarr is an optional (and slow) import."""
    WrapperStore = zarr_module().storage.WrapperStore

    class RecordingStore(WrapperStore):
        """Writes through; records size and CRC32 of each chunk from the bytes zarr hands over."""

        def __init__(self, store: Store, records: Optional[Dict[str, Tuple[int, int]]] = None):
            super().__init__(store)
            self.records = {} if records is None else records  # chunk name -> (size, crc32)

        def _with_store(self, store: Store) -> Any:
            return type(self)(store, self.records)

        async def set(self, key: str, value: ZarrBuffer) -> None:
            try:
                write = retried(self._store, lambda: self._store.set(key, value), key, write=True)
                if not is_chunk_name(key):
                    await write
                    return
                # checksum while the store writes: both only read the buffer
                crc, _ = await asyncio.gather(_crc32(value), write)
            except Exception as e:
                converted = write_error(e, _url(self._store, key))
                if converted is e:
                    raise
                raise converted from e
            self.records[key] = (len(value), crc)

    class CheckingStore(WrapperStore):
        """Checks every file zarr fetches: containment always, and a chunk against its record
        (``records`` None: an index without records) before zarr decodes it."""

        def __init__(
            self, store: Store, array_dir: str, records: Optional[Callable[[str], Optional[FileRecord]]], verify: bool,
            root: str = "", prefix: str = "",
        ):
            super().__init__(store)
            self.array_dir, self.records, self.verify = array_dir, records, verify
            self.root, self.prefix = root, prefix  # checkpoint directory, array key

        def _with_store(self, store: Store) -> Any:
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

        async def get(self, key: str, prototype: BufferPrototype, byte_range: Optional[ByteRequest] = None) -> Any:
            if self.root:
                self._contain(key)
            if byte_range is not None and is_chunk_name(key) and self.records is not None:
                # a partial fetch would skip the check: fetch the chunk whole, check it, cut the range
                whole = await self.get(key, prototype, None)
                return None if whole is None else _byte_range(whole, byte_range)
            data = await retried(self._store, lambda: self._store.get(key, prototype, byte_range), key, write=False)
            if self.records is None:
                return data
            if byte_range is None and is_chunk_name(key):
                await self._check(key, data)
            elif byte_range is None and key == ARRAY_METADATA_FILE:
                await self._check_metadata(data)
            return data

        async def get_partial_values(
            self, prototype: BufferPrototype, key_ranges: Iterable[Tuple[str, Optional[ByteRequest]]]
        ) -> List[Any]:
            return [await self.get(k, prototype, r) for k, r in key_ranges]

        async def _get_many(self, requests: Iterable[Tuple[str, BufferPrototype, Optional[ByteRequest]]]) -> Any:
            for key, prototype, byte_range in requests:
                yield key, await self.get(key, prototype, byte_range)

        async def _check(self, name: str, data: Optional[ZarrBuffer]) -> None:
            path = join(self.array_dir, name)
            record = self.records(name)
            if record is None:
                raise CorruptCheckpointError(f"zarr chunk file {path} has no record in {INDEX_FILE}: the index is damaged")
            size = None if data is None else len(data)
            crc = await _crc32(data) if self.verify and size == record.size else None
            problem = file_problem("zarr chunk file", path, record, size, crc)
            if problem:
                raise CorruptCheckpointError(problem)

        async def _check_metadata(self, data: Optional[ZarrBuffer]) -> None:
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


def _byte_range(buf: ZarrBuffer, byte_range: ByteRequest) -> Any:
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


def array_mismatch(arr: zarr.Array, info: Dict[str, Any]) -> Optional[str]:
    """How an opened array differs from its index entry (what the save created), or None."""
    expected_dtype = numpy_dtype(getattr(torch, info["stored_dtype"]))
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
