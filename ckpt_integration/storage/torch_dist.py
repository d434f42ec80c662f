"""The ``torch_dist`` backend: PyTorch DCP's on-disk format.

Layout of a checkpoint directory (shared with PyTorch DCP and Megatron-Core)::

    __<rank>_<i>.distcp   data files: each item is a torch.save archive (tensor chunk)
                          or raw bytes (a ShardedObject, torch.save'd as [obj])
    .metadata             pickled torch.distributed.checkpoint.metadata.Metadata
    common.pt             common state (rank 0)            - see checkpoint_dir.py
    manifest.json         our checksums and save info      - see checkpoint_dir.py
    metadata.json         commit marker + backend/version  - see checkpoint_dir.py

Writes use one file per writer thread; reads group requests by file, read only
the byte ranges needed (see :mod:`tensor_record`) and run in a thread pool.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CorruptCheckpointError, MismatchError, UnsafeCheckpointError
from ..planning.boxes import Box, relative_slices
from ..planning.save_plan import split_into_buckets
from .checksum import crc32
from .filesystem import FileReader, join, storage_for
from .fs import tensor_buffer
from .safe_pickle import load_dcp_metadata
from .tensor_record import CrcWriter, TensorRecord, parse_tensor_record

DCP_METADATA_FILE = ".metadata"
DATA_SUFFIX = ".distcp"
# Runs (contiguous pieces of a strided region) shorter than this are read as one
# covering span instead of one read each: below a page, syscalls cost more than the waste.
SPAN_READ_MAX_RUN = 4096


# --------------------------------------------------------------------------- writing
@dataclass
class WriteRequest:
    """One item to store: a tensor chunk (``offsets`` set) or object bytes."""

    storage_key: str
    offsets: Optional[Tuple[int, ...]]
    data: Union[torch.Tensor, bytes]

    @property
    def nbytes(self) -> int:
        if isinstance(self.data, torch.Tensor):
            return self.data.numel() * self.data.element_size()
        return len(self.data)


@dataclass(frozen=True)
class WrittenItem:
    storage_key: str
    offsets: Optional[Tuple[int, ...]]
    relative_path: str
    offset: int
    length: int
    crc32: int


_crc_lock = threading.Lock()
_crc_users = 0


@contextlib.contextmanager
def _archive_member_crc_disabled():
    """torch.save CRCs every archive member single-threaded; we checksum ourselves."""
    global _crc_users
    try:
        from torch.utils.serialization import config
    except ImportError:  # older torch: nothing to switch off
        yield
        return
    with _crc_lock:
        if _crc_users == 0:
            _archive_member_crc_disabled.saved = config.save.compute_crc32
            config.save.compute_crc32 = False
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                config.save.compute_crc32 = _archive_member_crc_disabled.saved


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor owning exactly its bytes (torch.save of a view would save the whole storage)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if (
        not t.is_contiguous()
        or t.storage_offset() != 0
        or t.untyped_storage().nbytes() != t.numel() * t.element_size()
    ):
        t = t.contiguous().clone() if t.is_contiguous() else t.contiguous()
    return t


def data_file_name(rank: int, index: int) -> str:
    return f"__{rank}_{index}{DATA_SUFFIX}"


def write_data_files(
    directory: str, rank: int, requests: Sequence[WriteRequest], thread_count: int = 2, durable: bool = True
) -> List[WrittenItem]:
    """Write ``requests`` into ``__<rank>_<i>.distcp`` files, one per thread; fsync them."""
    if not requests:
        return []
    storage, directory = storage_for(directory)
    buckets = split_into_buckets([r.nbytes for r in requests], thread_count)

    def write_bucket(index: int, bucket: List[int]) -> List[WrittenItem]:
        name = data_file_name(rank, index)
        path = join(directory, name)
        out = []
        with storage.open_write(path) as f:
            for i in bucket:
                req = requests[i]
                w = CrcWriter(f)
                start = f.tell()
                if isinstance(req.data, torch.Tensor):
                    torch.save(_standalone(req.data), w)
                else:
                    w.write(req.data)
                out.append(WrittenItem(req.storage_key, req.offsets, name, start, f.tell() - start, w.crc))
            storage.sync(f, durable)
        return out

    with _archive_member_crc_disabled():
        if len(buckets) == 1:
            return write_bucket(0, buckets[0])
        with ThreadPoolExecutor(len(buckets), thread_name_prefix="ckpt-write") as pool:
            futures = [pool.submit(write_bucket, i, b) for i, b in enumerate(buckets)]
            results = [f.result() for f in futures]
    return [item for r in results for item in r]


def make_dcp_metadata(
    tensors: Dict[str, Tuple[torch.dtype, Tuple[int, ...], List[Tuple[Tuple[int, ...], Tuple[int, ...]]]]],
    object_keys: Iterable[str],
    written: Iterable[WrittenItem],
) -> Metadata:
    """Build DCP ``Metadata``.

    ``tensors`` maps key -> (dtype, global shape, [(chunk offsets, chunk sizes)]).
    ``planner_data`` maps every key to itself so that DCP's own loaders
    (``dcp_to_torch_save``) produce a flat dict with our keys.
    """
    sd_meta: Dict[str, Any] = {}
    for key, (dtype, shape, chunk_list) in tensors.items():
        sd_meta[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(shape),
            chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in sorted(chunk_list)],
        )
    for key in object_keys:
        sd_meta[key] = BytesStorageMetadata()
    storage_data: Dict[MetadataIndex, _StorageInfo] = {}
    for item in written:
        info = _StorageInfo(item.relative_path, item.offset, item.length)
        offset = None if item.offsets is None else torch.Size(item.offsets)
        storage_data[MetadataIndex(item.storage_key, offset)] = info
    return Metadata(
        state_dict_metadata=sd_meta,
        planner_data={k: (k,) for k in sd_meta},
        storage_data=storage_data,
        storage_meta=StorageMeta(),
        version="1.0.0",
    )


def write_dcp_metadata(directory: str, metadata: Metadata, durable: bool = True) -> Dict[str, int]:
    """Write ``.metadata``; returns ``{"size", "crc32"}`` for the manifest."""
    import pickle

    data = pickle.dumps(metadata)
    storage, directory = storage_for(directory)
    storage.write_atomic(join(directory, DCP_METADATA_FILE), data, durable)
    return {"size": len(data), "crc32": crc32(data)}


def read_dcp_metadata(directory: str, trusted: bool = False) -> Metadata:
    storage, directory = storage_for(directory)
    path = join(directory, DCP_METADATA_FILE)
    if storage.exists(path):
        from .checkpoint_dir import read_manifest, verify_file_checksum

        verify_file_checksum(directory, DCP_METADATA_FILE, read_manifest(directory))
    try:
        md = load_dcp_metadata(io.BytesIO(storage.read_bytes(path)), trusted=trusted)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing: the torch_dist checkpoint has no tensor metadata") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
        raise CorruptCheckpointError(f"{path} is damaged and cannot be decoded: {e!r}") from None
    except Exception as e:  # pickle.UnpicklingError and friends
        from ..errors import UnsafeCheckpointError

        if isinstance(e, UnsafeCheckpointError):
            raise
        raise CorruptCheckpointError(f"{path} is damaged and cannot be decoded: {e!r}") from None
    if not isinstance(md, Metadata) or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CorruptCheckpointError(f"{path} does not hold DCP metadata (got {type(md).__name__})")
    return md


# --------------------------------------------------------------------------- reading
@dataclass
class ChunkInfo:
    box: Box
    storage: _StorageInfo
    crc32: Optional[int] = None


class TorchDistReader:
    """Reads regions of saved chunks and object payloads from a torch_dist checkpoint."""

    def __init__(
        self,
        directory: str,
        metadata: Metadata,
        checksums: Optional[Dict[Tuple[str, int], int]] = None,
        verify_checksums: bool = True,
    ):
        self.storage, self.directory = storage_for(directory)
        self.metadata = metadata
        self.checksums = checksums or {}
        self.verify_checksums = verify_checksums and bool(checksums)
        self._files: Dict[str, FileReader] = {}
        self._records: Dict[Tuple[str, int], Optional[TensorRecord]] = {}
        self._lock = threading.Lock()
        self.chunks: Dict[str, List[ChunkInfo]] = defaultdict(list)
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                lst = []
                for c in md.chunks:
                    info = (metadata.storage_data or {}).get(MetadataIndex(key, torch.Size(c.offsets)))
                    if info is None:
                        raise CorruptCheckpointError(
                            f"{directory}/.metadata lists chunk {tuple(c.offsets)} of {key!r} but not where it is stored"
                        )
                    crc = self.checksums.get((info.relative_path, info.offset))
                    lst.append(ChunkInfo(Box(tuple(c.offsets), tuple(c.sizes)), info, crc))
                self.chunks[key] = lst

    # -- file handles ------------------------------------------------------------------
    def _fd(self, relative_path: str) -> FileReader:
        with self._lock:
            fd = self._files.get(relative_path)
            if fd is None:
                path = join(self.directory, relative_path)
                try:
                    fd = self.storage.open_reader(path)
                except FileNotFoundError:
                    raise CorruptCheckpointError(
                        f"data file {path} is missing (listed in .metadata)"
                    ) from None
                self._files[relative_path] = fd
            return fd

    def _check_extent(self, info: _StorageInfo, what: str) -> int:
        fd = self._fd(info.relative_path)
        size = fd.size
        if info.offset + info.length > size:
            raise CorruptCheckpointError(
                f"{join(self.directory, info.relative_path)} is truncated: {what} needs bytes "
                f"[{info.offset}, {info.offset + info.length}) but the file has {size} bytes"
            )
        return fd

    def close(self) -> None:
        with self._lock:
            for fd in self._files.values():
                fd.close()
            self._files.clear()

    def __enter__(self) -> "TorchDistReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- objects -----------------------------------------------------------------------
    def read_bytes(self, storage_key: str) -> bytes:
        info = (self.metadata.storage_data or {}).get(MetadataIndex(storage_key))
        if info is None:
            raise MismatchError(f"object {storage_key!r} is not in the checkpoint")
        fd = self._check_extent(info, f"object {storage_key!r}")
        buf = bytearray(info.length)
        pread_exact(fd, memoryview(buf), info.offset, join(self.directory, info.relative_path))
        self._verify(info, [bytes(buf)], storage_key)
        return bytes(buf)

    # -- tensors -----------------------------------------------------------------------
    def _record(self, key: str, chunk: ChunkInfo) -> Optional[TensorRecord]:
        info = chunk.storage
        rid = (info.relative_path, info.offset)
        if rid not in self._records:
            fd = self._check_extent(info, f"chunk {chunk.box} of {key!r}")
            rec = parse_tensor_record(fd, info.offset, info.length, join(self.directory, info.relative_path))
            self._records[rid] = rec
        return self._records[rid]

    def _verify(self, info: _StorageInfo, parts: Sequence[Any], what: str) -> None:
        if not self.verify_checksums:
            return
        expected = self.checksums.get((info.relative_path, info.offset))
        if expected is None:
            return
        crc = 0
        for p in parts:
            crc = crc32(p, crc)
        if crc != expected:
            raise CorruptCheckpointError(
                f"{join(self.directory, info.relative_path)}: checksum mismatch for {what} "
                f"(bytes [{info.offset}, {info.offset + info.length})): the file is damaged"
            )

    def read_region(self, key: str, chunk: ChunkInfo, overlap: Box, out: torch.Tensor, dtype: torch.dtype) -> None:
        """Copy ``overlap`` (global coords, inside ``chunk``) of ``key`` into ``out``."""
        info = chunk.storage
        path = join(self.directory, info.relative_path)
        rec = self._record(key, chunk)
        if rec is None or not rec.is_contiguous:
            self._read_region_fallback(key, chunk, overlap, out)
            return
        if rec.dtype != dtype:
            raise CorruptCheckpointError(
                f"{path}: chunk {chunk.box} of {key!r} is stored as {rec.dtype} but .metadata says {dtype}"
            )
        if math.prod(rec.shape) != chunk.box.numel:
            raise CorruptCheckpointError(
                f"{path}: chunk {chunk.box} of {key!r} holds {math.prod(rec.shape)} elements, "
                f"expected {chunk.box.numel}"
            )
        fd = self._fd(info.relative_path)
        esize = torch.empty((), dtype=dtype).element_size()
        base = info.offset + rec.data_offset + rec.storage_offset * esize
        shape = chunk.box.sizes
        rel = relative_slices(overlap, chunk.box)
        starts = [s.start for s in rel]
        lens = list(overlap.sizes)
        ndim = len(shape)
        strides = [1] * ndim
        for a in range(ndim - 2, -1, -1):
            strides[a] = strides[a + 1] * shape[a + 1]
        # k: first axis from which the request is one contiguous run per index of the axes before it
        k = ndim
        while k > 0 and (k == ndim or (starts[k] == 0 and lens[k] == shape[k])):
            k -= 1
        # axes < k index runs; axis k and after form one run
        run_elems = lens[k] * strides[k] if ndim else 1
        nruns = math.prod(lens[:k]) if ndim else 1
        whole_chunk = overlap == chunk.box
        direct = out.is_contiguous() and out.dtype == dtype
        if nruns == 1:
            first = sum(s * st for s, st in zip(starts, strides))
            target = out if direct else torch.empty(lens, dtype=dtype)
            buf = tensor_buffer(target)
            pread_exact(fd, buf, base + first * esize, path)
            if whole_chunk and self.verify_checksums and chunk.crc32 is not None:
                self._verify_whole(fd, info, rec, buf, key, chunk)
            if not direct:
                out.copy_(target)
            return
        if run_elems * esize >= SPAN_READ_MAX_RUN:
            target = out if direct else torch.empty(lens, dtype=dtype)
            flat = tensor_buffer(target)
            run_bytes = run_elems * esize
            for i, idx in enumerate(itertools.product(*map(range, lens[:k]))):
                first = sum((starts[a] + idx[a]) * strides[a] for a in range(k)) + starts[k] * strides[k]
                pread_exact(fd, flat[i * run_bytes : (i + 1) * run_bytes], base + first * esize, path)
            if not direct:
                out.copy_(target)
            return
        first = sum(s * st for s, st in zip(starts, strides))
        last = sum((s + l - 1) * st for s, l, st in zip(starts, lens, strides))
        span = torch.empty(last - first + 1, dtype=dtype)
        pread_exact(fd, tensor_buffer(span), base + first * esize, path)
        out.copy_(torch.as_strided(span, lens, strides, 0))

    def _verify_whole(self, fd: int, info: _StorageInfo, rec: TensorRecord, data: memoryview, key: str, chunk: ChunkInfo) -> None:
        """Checksum the whole archive: small header/footer reads + the data already read."""
        if rec.storage_offset != 0:
            return  # the data read is not the whole storage; only whole archives are checksummed
        head = fd.read(info.offset, rec.data_offset)
        tail_start = rec.data_offset + len(data)
        tail = fd.read(info.offset + tail_start, info.length - tail_start)
        self._verify(info, [head, data, tail], f"chunk {chunk.box} of {key!r}")

    def _read_region_fallback(self, key: str, chunk: ChunkInfo, overlap: Box, out: torch.Tensor) -> None:
        info = chunk.storage
        fd = self._check_extent(info, f"chunk {chunk.box} of {key!r}")
        buf = bytearray(info.length)
        path = join(self.directory, info.relative_path)
        pread_exact(fd, memoryview(buf), info.offset, path)
        self._verify(info, [bytes(buf)], f"chunk {chunk.box} of {key!r}")
        from .safe_pickle import safe_torch_load

        # safe_torch_load raises CorruptCheckpointError (naming the chunk and file) for damaged bytes
        try:
            t = safe_torch_load(io.BytesIO(bytes(buf)), what=f"chunk {chunk.box} of {key!r} in {path}")
        except UnsafeCheckpointError as e:
            # tensor data never needs arbitrary objects, so trusted=True is no remedy here
            raise CorruptCheckpointError(
                f"{path}: chunk {chunk.box} of {key!r} is not a plain tensor record and was refused "
                f"without running it; the file is damaged or was not written by a checkpoint writer ({e})"
            ) from None
        if not isinstance(t, torch.Tensor) or t.numel() != chunk.box.numel:
            raise CorruptCheckpointError(f"{path}: chunk {chunk.box} of {key!r} is not a tensor of the expected size")
        t = t.reshape(chunk.box.sizes)
        out.copy_(t[relative_slices(overlap, chunk.box)])


def pread_exact(reader: FileReader, buf: memoryview, offset: int, path: str = "") -> None:
    """Fill ``buf`` from ``reader`` at ``offset`` (a short read raises CorruptCheckpointError)."""
    reader.read_into(buf, offset)


def run_parallel(tasks: Sequence[Any], fn, thread_count: int) -> None:
    """Run ``fn(task)`` for all tasks in a thread pool; re-raise the first error."""
    if thread_count <= 1 or len(tasks) <= 1:
        for t in tasks:
            fn(t)
        return
    with ThreadPoolExecutor(min(thread_count, len(tasks)), thread_name_prefix="ckpt-read") as pool:
        for f in [pool.submit(fn, t) for t in tasks]:
            f.result()
