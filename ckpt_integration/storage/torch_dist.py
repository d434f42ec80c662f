"""The ``torch_dist`` backend: PyTorch DCP's on-disk format.

Layout of a checkpoint directory (shared with PyTorch DCP and Megatron-Core)::

    __<rank>_<i>.distcp   data files: each item is a torch.save archive (tensor chunk)
                          or raw bytes (a ShardedObject, torch.save'd as [obj])
    .metadata             pickled torch.distributed.checkpoint.metadata.Metadata
    common.pt             common state (rank 0)            - see checkpoint_dir.py
    manifest.json         our checksums and save info      - see checkpoint_dir.py
    metadata.json         commit marker + backend/version  - see checkpoint_dir.py

Writes use one file per writer thread; every tensor item's data is checksummed in
blocks while it is written (:class:`~.tensor_record.BlockDigestWriter`), recorded in the
manifest. Reads check every byte they read against those blocks (or, for checkpoints
saved before block checksums, against the whole-item CRC32) and read only the blocks a
request touches (see :mod:`.region_read`). Every name in ``.metadata`` is checked to be a
plain file name inside the checkpoint before it is opened (see ``filesystem.checked_path``),
and declared shapes are checked against what the chunks can hold before anything is
allocated for them.
"""

from __future__ import annotations

import contextlib
import io
import math
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
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

from ..errors import CorruptCheckpointError, MismatchError, SaveConflictError, UnsafeCheckpointError
from ..planning.boxes import Box, relative_slices
from ..planning.save_plan import split_into_buckets
from ..planning.written import WrittenTable
from . import checkpoint_dir as ckdir
from .checksum import CRC32, DEFAULT_BLOCK_SIZE, block_hash, crc32, save_block_hash
from .filesystem import FileReader, join, name_problem, storage_for, writing
from .region_read import Blocks, ChunkLayout, ReadStats, dtype_size, run_parallel, verify_blocks  # noqa: F401 (re-exported)
from .region_read import read_region as _read_region
from .metadata_pickle import dumps_dcp_metadata
from .safe_pickle import load_dcp_metadata, safe_torch_load
from .tensor_record import BlockDigestWriter, DigestWriter, TensorRecord, describe_archive_head, parse_tensor_record, save_tensor
from .small_items import SmallItemWriter

DCP_METADATA_FILE = ".metadata"
DATA_SUFFIX = ".distcp"
# block size of the data checksums of new saves (recorded per item, so readers need not know it)
BLOCK_SIZE = DEFAULT_BLOCK_SIZE


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
    checksum: int  # the item digest (torch_dist: of the manifest's block_hash; zarr: CRC32)
    # tensor items: (data_offset, data_length, block_size, block digests), see BlockDigestWriter
    blocks: Optional[Tuple[int, int, int, List[int]]] = None

    @property
    def crc32(self) -> int:
        """``checksum`` under the name the zarr backend reads (its items record CRC32s)."""
        return self.checksum


_crc_lock = threading.Lock()
_crc_users = 0
_crc_local = threading.local()


def _setting_is_per_thread() -> bool:
    """Whether torch keeps ``serialization.config`` overrides per thread (a ``ContextVar``, as
    torch 2.13 does): then each writer thread must switch the archive members' CRC32s off itself."""
    cached = getattr(_setting_is_per_thread, "value", None)
    if cached is None:
        from torch.utils.serialization import config

        before = config.save.compute_crc32
        seen = []

        def flip() -> None:
            config.save.compute_crc32 = not before
            seen.append(config.save.compute_crc32)
            config.save.compute_crc32 = before

        t = threading.Thread(target=flip)
        t.start()
        t.join()
        cached = _setting_is_per_thread.value = config.save.compute_crc32 == before and seen == [not before]
    return cached


@contextlib.contextmanager
def _archive_member_crc_disabled():
    """torch.save CRCs every archive member single-threaded; we checksum ourselves.

    Entered by every thread that writes archives: where torch keeps the setting per thread, it
    is switched off and restored in that thread (nesting allowed); where it is process-wide, a
    count of the writers switches it off for the first and back on after the last.
    """
    global _crc_users
    try:
        from torch.utils.serialization import config
    except ImportError:  # older torch: nothing to switch off
        yield
        return
    if _setting_is_per_thread():
        depth = getattr(_crc_local, "depth", 0)
        if depth == 0:
            _crc_local.saved = config.save.compute_crc32
            config.save.compute_crc32 = False
        _crc_local.depth = depth + 1
        try:
            yield
        finally:
            _crc_local.depth -= 1
            if _crc_local.depth == 0:
                config.save.compute_crc32 = _crc_local.saved
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


def data_file_name(rank: int, index: int, prefix: str = "") -> str:
    """``__<rank>_<index>.distcp`` as PyTorch DCP and Megatron-Core name data files; with a separation
    hint, ``<hint>__<rank>_<index>.distcp`` as Megatron-Core names the files of the hinted keys."""
    return f"{prefix}__{rank}_{index}{DATA_SUFFIX}"


def _separate(requests: Sequence[WriteRequest], hint: Optional[str], thread_count: int) -> List[Tuple[str, List[int]]]:
    """``[(file name prefix, request indices)]`` buckets: the requests whose keys start with ``hint`` in
    files of their own (about half the threads each, as Megatron-Core splits them), the rest in the
    others; without a hint, ``thread_count`` buckets."""
    if not hint:
        return [("", b) for b in split_into_buckets([r.nbytes for r in requests], thread_count)]
    problem = name_problem(data_file_name(0, 0, hint))
    if problem or "/" in hint or "\\" in hint:
        raise MismatchError(f"separation_hint {hint!r} cannot begin a data file name: {problem or 'a path separator'}")
    out: List[Tuple[str, List[int]]] = []
    threads = max(1, thread_count // 2)
    for prefix, picked in (("", [i for i, r in enumerate(requests) if not r.storage_key.startswith(hint)]),
                           (hint, [i for i, r in enumerate(requests) if r.storage_key.startswith(hint)])):
        if picked:
            for b in split_into_buckets([requests[i].nbytes for i in picked], threads):
                out.append((prefix, [picked[j] for j in b]))
    return out


def write_data_files(
    directory: str,
    rank: int,
    requests: Sequence[WriteRequest],
    thread_count: int = 2,
    durable: bool = True,
    block_size: Optional[int] = None,
    separation_hint: Optional[str] = None,
) -> WrittenTable:
    """Write ``requests`` into ``__<rank>_<i>.distcp`` files, one per thread; fsync them.

    Tensor items get block digests (``block_size``, of ``checksum.SAVE_BLOCK_HASH``) besides
    their item digest. A failed
    write (disk full, permissions) raises :class:`CheckpointWriteError` naming the file.
    Items whose keys start with ``separation_hint`` go to files of their own,
    ``<hint>__<rank>_<i>.distcp``, so that ``remove_sharded_tensors(dir, hint)`` drops them
    by deleting those files (Megatron-Core's ``separation_hint``).
    """
    if not requests:
        return WrittenTable()
    block_size = block_size or BLOCK_SIZE
    digest = save_block_hash()
    storage, directory = storage_for(directory)
    groups = _separate(requests, separation_hint, thread_count)
    buckets = [b for _, b in groups]

    def write_bucket(index: int, bucket: List[int]) -> WrittenTable:
        name = data_file_name(rank, index, groups[index][0])
        path = join(directory, name)
        out = WrittenTable()
        try:
            f = storage.open_write(path, exclusive=True)
        except FileExistsError:
            raise SaveConflictError(
                f"cannot write {path}: the file exists, created by another save into the same directory "
                "(two jobs saving to one path at once); this save is abandoned"
            ) from None
        with writing(path), f, _archive_member_crc_disabled():  # (per thread: see there)
            small = SmallItemWriter(f, block_size, digest)
            for i in bucket:
                req = requests[i]
                if isinstance(req.data, torch.Tensor) and req.offsets is not None:
                    done = small.add(req.data)
                    if done is not None:
                        out.append(req.storage_key, req.offsets, tuple(req.data.shape), name, *done)
                        continue
                small.flush()
                start = f.tell()
                sizes = None
                if isinstance(req.data, torch.Tensor):
                    t = _standalone(req.data)
                    w = BlockDigestWriter(f, t, block_size, digest)
                    try:
                        save_tensor(t, w)
                    except Exception as e:
                        raise (w.error or e) from e  # torch wraps the OSError of a full disk
                    item_digest, blocks = w.finish()
                    sizes = tuple(t.shape) if req.offsets is not None else None
                else:
                    w = DigestWriter(f, digest)
                    w.write(req.data)
                    item_digest, blocks = w.digest, None
                out.append(req.storage_key, req.offsets, sizes, name, start, f.tell() - start, item_digest, blocks)
                small.pos = f.tell()
            small.flush()
            storage.sync(f, durable)
        return out

    with _archive_member_crc_disabled():
        if len(buckets) == 1:
            return write_bucket(0, buckets[0])
        with ThreadPoolExecutor(len(buckets), thread_name_prefix="ckpt-write") as pool:
            futures = [pool.submit(write_bucket, i, b) for i, b in enumerate(buckets)]
            results = [f.result() for f in futures]
    out = WrittenTable()
    for r in results:
        out.extend(r)
    return out


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
    data = dumps_dcp_metadata(metadata)
    storage, directory = storage_for(directory)
    storage.write_atomic(join(directory, DCP_METADATA_FILE), data, durable)
    return {"size": len(data), "crc32": crc32(data)}


def read_dcp_metadata(directory: str, trusted: bool = False, manifest: Any = None) -> Metadata:
    """``.metadata``, checked against the manifest (read once: the bytes checked are the bytes
    unpickled) and unpickled restrictedly unless ``trusted``. ``manifest``: the checkpoint's
    manifest when the caller has read it already (else it is read here)."""
    storage, directory = storage_for(directory)
    path = join(directory, DCP_METADATA_FILE)
    if manifest is None:
        manifest = ckdir.read_manifest(directory)
    try:
        data = ckdir.read_verified_file(directory, DCP_METADATA_FILE, manifest, "tensor metadata file")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing: the torch_dist checkpoint has no tensor metadata") from None
    try:
        md = load_dcp_metadata(io.BytesIO(data), trusted=trusted)
    except RecursionError:
        raise CorruptCheckpointError(f"{path} is damaged: its pickle is nested too deeply") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
        raise CorruptCheckpointError(f"{path} is damaged and cannot be decoded: {e!r}") from None
    except Exception as e:  # pickle.UnpicklingError and friends

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
    checksum: Optional[int] = None  # the item digest recorded in the manifest


#: ``TorchDistReader(manifest=...)`` default: read the manifest from the checkpoint directory
MANIFEST_FROM_DIRECTORY = object()


def _is_index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class TorchDistReader:
    """Reads regions of saved chunks and object payloads from a torch_dist checkpoint.

    Integrity: the manifest is read here (``read_manifest_checked``: a missing manifest of a
    checkpoint saved with one is damage); with ``verify_checksums`` every byte read is
    checked - against block digests (XXH3-64 in format 3, CRC32 in format 2; the algorithm
    is the manifest's ``block_hash``), against the whole item's CRC32 (format 1:
    the item is read whole, also for a partial request), or not at all for checkpoints of
    other writers (logged once). Containment: every data file named in ``.metadata`` must
    be a plain file name inside the directory (checked here, before anything is opened).
    ``checksums`` is accepted for compatibility; the manifest's tables are used when it exists.
    """

    def __init__(
        self,
        directory: str,
        metadata: Metadata,
        checksums: Optional[Dict[Tuple[str, int], int]] = None,
        verify_checksums: bool = True,
        manifest: Any = MANIFEST_FROM_DIRECTORY,
    ):
        self.storage, self.directory = storage_for(directory)
        self.metadata = metadata
        if manifest is MANIFEST_FROM_DIRECTORY:
            manifest = ckdir.read_manifest_checked(self.directory)
        self.manifest = manifest
        self.hash = manifest.hash if manifest is not None else block_hash(CRC32)  # (checksums given: CRC32s)
        self.checksums = manifest.checksums() if manifest is not None else dict(checksums or {})
        self.block_records = manifest.block_records() if manifest is not None else {}
        self.verify_checksums = verify_checksums and bool(self.checksums or self.block_records)
        self._files: Dict[str, FileReader] = {}
        self._records: Dict[Tuple[str, int], Optional[TensorRecord]] = {}
        self._frames_checked: set = set()
        self._block_cache: Dict[Tuple[str, int], Blocks] = {}
        self._layouts: Dict[Tuple[str, int], ChunkLayout] = {}
        self.stats = ReadStats()
        self._lock = threading.Lock()
        where = join(self.directory, DCP_METADATA_FILE)
        for index, info in (metadata.storage_data or {}).items():
            problem = name_problem(getattr(info, "relative_path", None))
            if problem:
                raise UnsafeCheckpointError(
                    f"refusing {where}: item {getattr(index, 'fqn', index)!r} is stored in "
                    f"{getattr(info, 'relative_path', None)!r}: {problem}; a checkpoint may only name files "
                    "inside its own directory"
                )
            if not (_is_index(getattr(info, "offset", None)) and _is_index(getattr(info, "length", None))):
                raise CorruptCheckpointError(f"{where} is damaged: item {getattr(index, 'fqn', index)!r} has an invalid byte range")
        self.chunks: Dict[str, List[ChunkInfo]] = defaultdict(list)
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                shape = tuple(md.size)
                lst = []
                for c in md.chunks:
                    box = Box(tuple(c.offsets), tuple(c.sizes))
                    if len(box.offsets) != len(shape) or len(box.sizes) != len(shape) or any(
                        not (_is_index(o) and _is_index(n) and o + n <= g) for o, n, g in zip(box.offsets, box.sizes, shape)
                    ):
                        raise CorruptCheckpointError(f"{where} is damaged: chunk {box} of {key!r} lies outside its global shape {shape}")
                    info = (metadata.storage_data or {}).get(MetadataIndex(key, torch.Size(c.offsets)))
                    if info is None:
                        raise CorruptCheckpointError(
                            f"{directory}/.metadata lists chunk {tuple(c.offsets)} of {key!r} but not where it is stored"
                        )
                    crc = self.checksums.get((info.relative_path, info.offset))
                    lst.append(ChunkInfo(box, info, crc))
                self.chunks[key] = lst

    # -- file handles ------------------------------------------------------------------
    def _fd(self, relative_path: str) -> FileReader:
        with self._lock:
            fd = self._files.get(relative_path)
            if fd is None:
                try:
                    fd = self.storage.open_in(self.directory, relative_path, "data file", source=DCP_METADATA_FILE)
                except FileNotFoundError:
                    raise CorruptCheckpointError(
                        f"data file {join(self.directory, relative_path)} is missing (listed in .metadata)"
                    ) from None
                self._files[relative_path] = fd
            return fd

    def _check_extent(self, info: _StorageInfo, what: str) -> FileReader:
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

    def validate_tensor(self, key: str) -> None:
        """Before allocating a whole ``key``: its declared global shape must be what its chunks
        can hold. Each chunk must fit its stored bytes (which must lie inside the data file),
        and the chunks must hold at least as many elements as the shape declares; a damaged
        or hostile ``.metadata`` (a 10^12-element tensor) raises CorruptCheckpointError."""
        md = self.metadata.state_dict_metadata[key]
        shape = tuple(md.size)
        esize = torch.empty((), dtype=md.properties.dtype).element_size()
        held = 0
        for c in self.chunks.get(key, []):
            info = c.storage
            self._check_extent(info, f"chunk {c.box} of {key!r}")
            if c.box.numel * esize > info.length:
                raise CorruptCheckpointError(
                    f"{join(self.directory, DCP_METADATA_FILE)} is damaged: chunk {c.box} of {key!r} declares "
                    f"{c.box.numel} elements ({c.box.numel * esize} bytes) but its stored item has {info.length} bytes"
                )
            held += c.box.numel
        declared = math.prod(shape)
        if declared > held:
            raise CorruptCheckpointError(
                f"{join(self.directory, DCP_METADATA_FILE)} declares tensor {key!r} of shape {shape} "
                f"({declared} elements), but its saved chunks hold only {held}: the metadata is damaged "
                "(or chunks are missing); nothing was allocated for it"
            )

    # -- objects -----------------------------------------------------------------------
    def read_bytes(self, storage_key: str) -> bytes:
        info = (self.metadata.storage_data or {}).get(MetadataIndex(storage_key))
        if info is None:
            raise MismatchError(f"object {storage_key!r} is not in the checkpoint")
        fd = self._check_extent(info, f"object {storage_key!r}")
        buf = bytearray(info.length)
        pread_exact(fd, memoryview(buf), info.offset, join(self.directory, info.relative_path))
        self._verify(info, buf, storage_key)
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

    def _expected_crc(self, info: _StorageInfo, what: str) -> Optional[int]:
        """The item digest to check (None: unchecked); a manifest without it is damaged."""
        if not self.verify_checksums:
            return None
        expected = self.checksums.get((info.relative_path, info.offset))
        if expected is None:
            raise CorruptCheckpointError(
                f"{join(self.directory, ckdir.MANIFEST_FILE)} has no checksum for {what} "
                f"({info.relative_path}@{info.offset}): the manifest is damaged or does not belong to this checkpoint"
            )
        return expected

    def _verify(self, info: _StorageInfo, buf: Any, what: str) -> None:
        """Check a whole item's bytes: against its block digests if it has them, else its item digest."""
        brec = self.block_records.get((info.relative_path, info.offset)) if self.verify_checksums else None
        if brec is not None:
            verify_blocks(self._blocks(info, brec, what), join(self.directory, info.relative_path), info.offset, what, 0, buf)
            return
        expected = self._expected_crc(info, what)
        if expected is None:
            return
        if self.hash.digest(buf) != expected:
            raise CorruptCheckpointError(
                f"{join(self.directory, info.relative_path)}: checksum mismatch for {what} "
                f"(bytes [{info.offset}, {info.offset + info.length})): the file is damaged"
            )

    def chunk_layout(self, key: str, chunk: ChunkInfo, dtype: torch.dtype) -> Optional["ChunkLayout"]:
        """Where ``chunk``'s raw data lies in its file and how it is checked (after the extent and
        record checks), or None when it is not stored as one plain contiguous array (read such a
        chunk with :meth:`read_region`). Cached per chunk."""
        info = chunk.storage
        rid = (info.relative_path, info.offset)
        cached = self._layouts.get(rid)
        if cached is not None:
            return cached
        path = join(self.directory, info.relative_path)
        what = f"chunk {chunk.box} of {key!r}"
        fd = self._check_extent(info, what)
        esize = dtype_size(dtype)
        nbytes = chunk.box.numel * esize
        brec = self.block_records.get(rid)
        blocks = None
        if brec is not None:
            # block checksums: the data's place is recorded, the archive needs no parsing
            if brec.data_length != nbytes:
                raise CorruptCheckpointError(
                    f"{path}: {what} holds {brec.data_length} bytes of data, but .metadata says "
                    f"{chunk.box.numel} elements of {dtype} ({nbytes} bytes)"
                )
            data_start = brec.data_offset
            if self.verify_checksums:
                blocks = self._blocks(info, brec, what)
            try:
                bounds = blocks.bounds if blocks is not None else brec.bounds(info.length)
            except ValueError as e:
                raise CorruptCheckpointError(f"{join(self.directory, ckdir.MANIFEST_FILE)}: block record of {what} is damaged: {e}") from None
        else:
            rec = self._record(key, chunk)
            if rec is None or not rec.is_contiguous:
                return None
            if rec.dtype != dtype:
                raise CorruptCheckpointError(f"{path}: {what} is stored as {rec.dtype} but .metadata says {dtype}")
            if math.prod(rec.shape) != chunk.box.numel:
                raise CorruptCheckpointError(
                    f"{path}: {what} holds {math.prod(rec.shape)} elements, expected {chunk.box.numel}"
                )
            data_start = rec.data_offset + rec.storage_offset * esize
            if data_start + nbytes > info.length:
                raise CorruptCheckpointError(f"{path}: {what}: the tensor data exceeds its stored item")
            expected = self._expected_crc(info, what)
            if expected is not None:  # checkpoints before block checksums: the item is one block
                blocks = Blocks(np.array([0, info.length], dtype=np.int64), [expected], self.hash)
                bounds = blocks.bounds
            else:  # unchecked: 1 MiB blocks of the data, only to plan who reads what
                bounds = np.unique(np.concatenate([[0], np.arange(data_start, data_start + nbytes, BLOCK_SIZE), [data_start + nbytes, info.length]])).astype(np.int64)
        layout = ChunkLayout(path, fd, info.offset, data_start, nbytes, tuple(chunk.box.sizes), esize, blocks, bounds, what,
                             brec is not None, info.length, dtype)
        self._layouts[rid] = layout
        return layout

    def check_frame(self, chunk: ChunkInfo, layout: "ChunkLayout") -> None:
        """Once per item of a chunk with block checksums: the archive bytes around the data
        match their digests (when verifying), and the dtype and shape that the archive's own
        ``data.pkl`` records are those of ``.metadata`` (always: a ``.metadata`` forged to
        another dtype of the same width, with the manifest updated to match, would otherwise
        load reinterpreted bytes)."""
        info = chunk.storage
        rid = (info.relative_path, info.offset)
        brec = self.block_records.get(rid)
        if brec is None or rid in self._frames_checked:
            return
        if layout.blocks is not None:
            head = self._check_archive_frame(layout.fd, info, brec, layout.blocks, layout.path, layout.what)
        else:  # unverified: only the header (a few hundred bytes, read once per item)
            head = bytearray(min(brec.data_offset, info.length))
            layout.fd.read_into(memoryview(head), info.offset)
        self._check_recorded_tensor(bytes(head), chunk, layout)
        self._frames_checked.add(rid)

    def _check_recorded_tensor(self, head: bytes, chunk: ChunkInfo, layout: "ChunkLayout") -> None:
        try:
            found = describe_archive_head(head)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{layout.path}: {layout.what}: {e}") from None
        if found is None or layout.dtype is None:
            return  # an archive of another layout: its data's place and size were checked already
        dtype, shape = found
        where = join(self.directory, DCP_METADATA_FILE)
        if dtype != layout.dtype:
            raise CorruptCheckpointError(
                f"{layout.path}: {layout.what} is stored as {dtype} (the archive's data.pkl) but {where} says "
                f"{layout.dtype}: the metadata does not belong to this data or was altered; refusing to reinterpret it"
            )
        if tuple(shape) != tuple(chunk.box.sizes):  # the writer stores every chunk in its own shape
            raise CorruptCheckpointError(
                f"{layout.path}: {layout.what} is stored with shape {tuple(shape)} (the archive's data.pkl) but "
                f"{where} says {tuple(chunk.box.sizes)}: the metadata does not belong to this data or was altered"
            )

    def read_region(self, key: str, chunk: ChunkInfo, overlap: Box, out: torch.Tensor, dtype: torch.dtype) -> None:
        """Copy ``overlap`` (global coords, inside ``chunk``) of ``key``, stored as ``dtype``, into ``out``.

        ``out`` may be non-contiguous and of another dtype (the copy casts). Every byte read is
        verified when checksums exist (see the class docstring).
        """
        layout = self.chunk_layout(key, chunk, dtype)
        if layout is None:
            self._read_region_fallback(key, chunk, overlap, out)
            return
        self.check_frame(chunk, layout)
        starts = [s.start for s in relative_slices(overlap, chunk.box)]
        _read_region(layout.fd, layout.path, layout.base, layout.data_start, chunk.box.sizes, starts, overlap.sizes,
                     out, dtype, layout.blocks, layout.what, self.stats)

    def _blocks(self, info: _StorageInfo, brec: Any, what: str) -> Blocks:
        rid = (info.relative_path, info.offset)
        blocks = self._block_cache.get(rid)
        if blocks is None:
            try:
                blocks = Blocks(brec.bounds(info.length), brec.digests, brec.hash)
            except ValueError as e:
                raise CorruptCheckpointError(f"{join(self.directory, ckdir.MANIFEST_FILE)}: block record of {what} is damaged: {e}") from None
            self._block_cache[rid] = blocks
        return blocks

    def _check_archive_frame(self, fd: FileReader, info: _StorageInfo, brec: Any, blocks: Blocks, path: str, what: str) -> bytearray:
        """Once per item: the archive bytes around the data (zip headers, ``data.pkl``, central
        directory; a few hundred bytes each) match their digests, so a damaged archive - which
        PyTorch DCP could no longer read - is reported by any load that reads from it. Returns
        the header (the bytes before the data)."""
        d, end, length = brec.data_offset, brec.data_offset + brec.data_length, info.length
        parts = [(0, d)] if d > 0 else []
        parts += [(end, length)] if end < length else []
        head = bytearray()
        for lo, hi in parts:
            buf = bytearray(hi - lo)
            fd.read_into(memoryview(buf), info.offset + lo)
            b = blocks.index(lo)
            if int(blocks.bounds[b]) != lo or int(blocks.bounds[b + 1]) != hi or blocks.hash.digest(buf) != int(blocks.digests[b]):
                raise CorruptCheckpointError(
                    f"{path}: checksum mismatch for the archive {'header' if lo == 0 else 'trailer'} of {what} "
                    f"(bytes [{info.offset + lo}, {info.offset + hi})): the file is damaged"
                )
            if lo == 0:
                head = buf
        return head

    def _read_region_fallback(self, key: str, chunk: ChunkInfo, overlap: Box, out: torch.Tensor) -> None:
        info = chunk.storage
        fd = self._check_extent(info, f"chunk {chunk.box} of {key!r}")
        buf = bytearray(info.length)
        path = join(self.directory, info.relative_path)
        pread_exact(fd, memoryview(buf), info.offset, path)
        self._verify(info, buf, f"chunk {chunk.box} of {key!r}")

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
