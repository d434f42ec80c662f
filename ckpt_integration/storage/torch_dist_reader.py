"""Reading a ``torch_dist`` checkpoint: every requested region of every chunk, verified.

:class:`TorchDistReader` is the backend's :class:`~.opened.CheckpointReader`: it checks each
chunk's recorded extent and archive frame, reads regions through :mod:`.region_read` (block
digests of the manifest, or whole-item checksums of older checkpoints) and objects through the
safe unpickler. The writing side and ``.metadata`` live in :mod:`.torch_dist`.
"""

from __future__ import annotations

import io
import math
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from ..errors import CorruptCheckpointError, MismatchError, UnsafeCheckpointError
from ..planning.boxes import Box, relative_slices
from . import checkpoint_dir as ckdir
from .checksum import CRC32, block_hash, check_zip_bytes
from .filesystem import CheckpointLocation, FileReader, name_problem
from .item_table import BlockRecord
from .region_read import Blocks, ChunkLayout, ReadStats, dtype_size, verify_blocks
from .region_read import read_region as _read_region
from .safe_pickle import safe_torch_load
from .tensor_record import TensorRecord, describe_archive_head, parse_tensor_record
from .torch_dist import BLOCK_SIZE, DCP_METADATA_FILE

if TYPE_CHECKING:
    from typing_extensions import Buffer


@dataclass
class ChunkInfo:
    """A stored chunk: its box in the global tensor and where it is stored (its item digest, when
    a read needs it, is the reader's ``checksums[(file, offset)]``)."""

    box: Box
    storage: _StorageInfo


#: ``TorchDistReader(manifest=...)`` default: read the manifest from the checkpoint directory
MANIFEST_FROM_DIRECTORY = object()


def _is_index(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class TorchDistReader:
    """Reads regions of saved chunks and object payloads from a torch_dist checkpoint.

    Integrity: the manifest is read here (``read_manifest_checked``: a missing manifest of a
    checkpoint saved with one is damage); with ``verify_checksums`` every byte read is
    checked - against its item's block digests (the algorithm is the manifest's ``block_hash``),
    against the whole item's digest where the item has no block record (objects; tensors of
    converted format-1 checkpoints: the item is read whole, also for a partial request), or not at
    all for checkpoints of other writers (logged once). Containment: every data file named in ``.metadata`` must
    be a plain file name inside the directory (checked here, before anything is opened).
    ``checksums`` is accepted for compatibility; the manifest's tables are used when it exists.
    """

    def __init__(
        self,
        ck: CheckpointLocation,
        metadata: Metadata,
        checksums: Optional[Dict[Tuple[str, int], int]] = None,
        verify_checksums: bool = True,
        manifest: Union[ckdir.Manifest, None, object] = MANIFEST_FROM_DIRECTORY,
    ):
        self.ck, self.directory = ck, ck.path  # (the handle; its path for the planners and messages)
        self.metadata = metadata
        if manifest is MANIFEST_FROM_DIRECTORY:  # an opened checkpoint: the manifest it pinned
            manifest = ckdir.read_manifest_checked(ck)
        self.manifest = manifest
        self.hash = manifest.hash if manifest is not None else block_hash(CRC32)  # (checksums given: CRC32s)
        self.checksums = manifest.checksums() if manifest is not None else dict(checksums or {})
        self.block_records = manifest.block_records() if manifest is not None else {}
        # (a checkpoint with a manifest is checked item by item: an item the table does not list, or
        # an emptied table, is damage; an empty table once turned verification off for every item)
        self.verify_checksums = verify_checksums and (manifest is not None or bool(self.checksums))
        # another writer's checkpoint (PyTorch DCP, Megatron-Core): each item is a torch.save zip archive
        # whose records carry their own CRC32s; read data is checked against them
        self.check_records = verify_checksums and not self.verify_checksums
        self._files: Dict[str, FileReader] = {}
        self._records: Dict[Tuple[str, int], Optional[TensorRecord]] = {}
        self._frames_checked: set = set()
        self._block_cache: Dict[Tuple[str, int], Blocks] = {}
        self._layouts: Dict[Tuple[str, int], ChunkLayout] = {}
        self.stats = ReadStats()
        self._lock = threading.Lock()
        where = self.ck.file(DCP_METADATA_FILE)
        names_ok: set = set()  # a few data files named by many items: each name checked once
        for index, info in (metadata.storage_data or {}).items():
            name = getattr(info, "relative_path", None)
            if name in names_ok:
                problem = None
            else:
                problem = name_problem(name)
                if problem is None:
                    names_ok.add(name)
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
                            f"{where} lists chunk {tuple(c.offsets)} of {key!r} but not where it is stored"
                        )
                    lst.append(ChunkInfo(box, info))
                self.chunks[key] = lst

    # -- file handles ------------------------------------------------------------------
    def _fd(self, relative_path: str) -> FileReader:
        with self._lock:
            fd = self._files.get(relative_path)
            if fd is None:
                try:
                    fd = self.ck.open(relative_path, "data file", source=DCP_METADATA_FILE)
                except FileNotFoundError:
                    raise CorruptCheckpointError(
                        f"data file {self.ck.file(relative_path)} is missing (listed in .metadata)"
                    ) from None
                self._files[relative_path] = fd
            return fd

    def file_reader(self, relative_path: str) -> FileReader:
        """The open reader of a data file named in ``.metadata`` (opened on first use, kept until close)."""
        return self._fd(relative_path)

    def _check_extent(self, info: _StorageInfo, what: str) -> FileReader:
        fd = self._fd(info.relative_path)
        size = fd.size
        if info.offset + info.length > size:
            raise CorruptCheckpointError(
                f"{self.ck.file(info.relative_path)} is truncated: {what} needs bytes "
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

    def __exit__(self, *exc: object) -> None:
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
                    f"{self.ck.file(DCP_METADATA_FILE)} is damaged: chunk {c.box} of {key!r} declares "
                    f"{c.box.numel} elements ({c.box.numel * esize} bytes) but its stored item has {info.length} bytes"
                )
            held += c.box.numel
        declared = math.prod(shape)
        if declared > held:
            raise CorruptCheckpointError(
                f"{self.ck.file(DCP_METADATA_FILE)} declares tensor {key!r} of shape {shape} "
                f"({declared} elements), but its saved chunks hold only {held}: the metadata is damaged "
                "(or chunks are missing); nothing was allocated for it"
            )

    # -- objects -----------------------------------------------------------------------
    def read_bytes(self, storage_key: str) -> bytes:
        info = (self.metadata.storage_data or {}).get(MetadataIndex(storage_key))
        if info is None:
            raise MismatchError(f"object {storage_key!r} is not in the checkpoint")
        return self.read_item(info, f"object {storage_key!r}")

    def read_item(self, info: _StorageInfo, what: str) -> bytes:
        """One stored item whole (an object's payload, a tensor chunk's archive), checked as every read is:
        inside its file, then against its block digests or its item digest."""
        fd = self._check_extent(info, what)
        buf = bytearray(info.length)
        pread_exact(fd, memoryview(buf), info.offset, self.ck.file(info.relative_path))
        self._verify(info, buf, what)
        return bytes(buf)

    # -- tensors -----------------------------------------------------------------------
    def _record(self, key: str, chunk: ChunkInfo) -> Optional[TensorRecord]:
        info = chunk.storage
        rid = (info.relative_path, info.offset)
        if rid not in self._records:
            fd = self._check_extent(info, f"chunk {chunk.box} of {key!r}")
            rec = parse_tensor_record(fd, info.offset, info.length, self.ck.file(info.relative_path))
            self._records[rid] = rec
        return self._records[rid]

    def _expected_crc(self, info: _StorageInfo, what: str) -> Optional[int]:
        """The item digest to check (None: unchecked); a manifest without it is damaged."""
        if not self.verify_checksums:
            return None
        expected = self.checksums.get((info.relative_path, info.offset))
        if expected is None:
            raise CorruptCheckpointError(
                f"{self.ck.file(ckdir.MANIFEST_FILE)} has no checksum for {what} "
                f"({info.relative_path}@{info.offset}): the manifest is damaged or does not belong to this checkpoint"
            )
        return expected

    def _verify(self, info: _StorageInfo, buf: Buffer, what: str) -> None:
        """Check a whole item's bytes: against its block digests if it has them, else its item digest."""
        brec = self.block_records.get((info.relative_path, info.offset)) if self.verify_checksums else None
        if brec is not None:
            verify_blocks(self._blocks(info, brec, what), self.ck.file(info.relative_path), info.offset, what, 0, buf)
            return
        expected = self._expected_crc(info, what)
        if expected is None:
            if self.check_records:
                where = f"bytes [{info.offset}, {info.offset + info.length})"
                check_zip_bytes(buf, f"{self.ck.file(info.relative_path)}: {what} ({where})")
            return
        if self.hash.digest(buf) != expected:
            raise CorruptCheckpointError(
                f"{self.ck.file(info.relative_path)}: checksum mismatch for {what} "
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
        path = self.ck.file(info.relative_path)
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
                raise CorruptCheckpointError(f"{self.ck.file(ckdir.MANIFEST_FILE)}: block record of {what} is damaged: {e}") from None
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
            elif self.check_records and rec.member_crc is not None:  # another writer's: its zip record's CRC32
                blocks = Blocks(np.array([rec.data_offset, rec.data_offset + rec.member_size], dtype=np.int64),
                                [rec.member_crc], block_hash(CRC32))
                bounds = blocks.bounds
            else:  # unchecked: 1 MiB blocks of the data, only to plan who reads what
                bounds = np.unique(np.concatenate([[0], np.arange(data_start, data_start + nbytes, BLOCK_SIZE), [data_start + nbytes, info.length]])).astype(np.int64)
        layout = ChunkLayout(path, fd, info.offset, data_start, nbytes, tuple(chunk.box.sizes), esize, blocks, bounds, what,
                             brec is not None, info.length, dtype)
        self._layouts[rid] = layout
        return layout

    def check_frame(self, chunk: ChunkInfo, layout: "ChunkLayout", part: str = "both") -> None:
        """Once per item of a chunk with block checksums: the archive bytes around the data
        match their digests (when verifying), and the dtype and shape that the archive's own
        ``data.pkl`` records are those of ``.metadata`` (always: a ``.metadata`` forged to
        another dtype of the same width, with the manifest updated to match, would otherwise
        load reinterpreted bytes). ``part``: ``"head"`` (the header, before the data is read),
        ``"tail"`` (the trailer, after it: read in file order, it is in the page cache by then
        instead of costing a seek before the data on a cold disk), or ``"both"``."""
        info = chunk.storage
        rid = (info.relative_path, info.offset)
        brec = self.block_records.get(rid)
        if brec is None or rid in self._frames_checked:
            return
        if part != "tail":
            if layout.blocks is not None:
                head = self._check_archive_frame(layout.fd, info, brec, layout.blocks, layout.path, layout.what, "head")
            else:  # unverified: only the header (a few hundred bytes, read once per item)
                head = bytearray(min(brec.data_offset, info.length))
                layout.fd.read_into(memoryview(head), info.offset)
            self._check_recorded_tensor(bytes(head), chunk, layout)
        if part != "head":
            if layout.blocks is not None:
                self._check_archive_frame(layout.fd, info, brec, layout.blocks, layout.path, layout.what, "tail")
            self._frames_checked.add(rid)

    def _check_recorded_tensor(self, head: bytes, chunk: ChunkInfo, layout: "ChunkLayout") -> None:
        try:
            found = describe_archive_head(head)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{layout.path}: {layout.what}: {e}") from None
        if layout.dtype is not None:
            check_archive_head(found, layout.dtype, chunk.box.sizes, layout.path, layout.what, self.ck)

    def read_region(self, key: str, chunk: ChunkInfo, overlap: Box, out: torch.Tensor, dtype: torch.dtype) -> None:
        """Copy ``overlap`` (global coords, inside ``chunk``) of ``key``, stored as ``dtype``, into ``out``.

        ``out`` may be non-contiguous and of another dtype (the copy casts). Every byte read is
        verified when checksums exist (see the class docstring).
        """
        layout = self.chunk_layout(key, chunk, dtype)
        if layout is None:
            self._read_region_fallback(key, chunk, overlap, out)
            return
        self.check_frame(chunk, layout, "head")
        starts = [s.start for s in relative_slices(overlap, chunk.box)]
        _read_region(layout.fd, layout.path, layout.base, layout.data_start, chunk.box.sizes, starts, overlap.sizes,
                     out, dtype, layout.blocks, layout.what, self.stats)
        self.check_frame(chunk, layout, "tail")

    def _blocks(self, info: _StorageInfo, brec: BlockRecord, what: str) -> Blocks:
        rid = (info.relative_path, info.offset)
        blocks = self._block_cache.get(rid)
        if blocks is None:
            try:
                blocks = Blocks(brec.bounds(info.length), brec.digests, brec.hash)
            except ValueError as e:
                raise CorruptCheckpointError(f"{self.ck.file(ckdir.MANIFEST_FILE)}: block record of {what} is damaged: {e}") from None
            self._block_cache[rid] = blocks
        return blocks

    def _check_archive_frame(self, fd: FileReader, info: _StorageInfo, brec: BlockRecord, blocks: Blocks, path: str, what: str,
                             which: str = "both") -> bytearray:
        """Once per item: the archive bytes around the data (zip headers, ``data.pkl``, central
        directory; a few hundred bytes each) match their digests, so a damaged archive - which
        PyTorch DCP could no longer read - is reported by any load that reads from it. Returns
        the header (the bytes before the data)."""
        d, end, length = brec.data_offset, brec.data_offset + brec.data_length, info.length
        parts = [(0, d)] if d > 0 and which != "tail" else []
        parts += [(end, length)] if end < length and which != "head" else []
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
        path = self.ck.file(info.relative_path)
        pread_exact(fd, memoryview(buf), info.offset, path)
        self._verify(info, buf, f"chunk {chunk.box} of {key!r}")
        t = load_item_tensor(bytes(buf), chunk.box.numel, path, f"chunk {chunk.box} of {key!r}")
        t = t.reshape(chunk.box.sizes)
        out.copy_(t[relative_slices(overlap, chunk.box)])


def load_item_tensor(data: bytes, numel: int, path: str, what: str) -> torch.Tensor:
    """A stored tensor item of an archive layout the fast path does not parse, loaded as ``torch.load``
    loads it (restricted): :class:`CorruptCheckpointError` naming ``path`` and ``what`` when its bytes are
    damaged, not a plain tensor record, or not ``numel`` elements. (The load's fallback and ``verify``.)"""
    # safe_torch_load raises CorruptCheckpointError (naming the item and file) for damaged bytes
    try:
        t = safe_torch_load(io.BytesIO(data), what=f"{what} in {path}")
    except UnsafeCheckpointError as e:
        # tensor data never needs arbitrary objects, so trusted=True is no remedy here
        raise CorruptCheckpointError(
            f"{path}: {what} is not a plain tensor record and was refused without running it; the file is "
            f"damaged or was not written by a checkpoint writer ({e})"
        ) from None
    if not isinstance(t, torch.Tensor) or t.numel() != numel:
        raise CorruptCheckpointError(f"{path}: {what} is not a tensor of the expected size ({numel} elements)")
    return t


def check_archive_head(found: Optional[Tuple[torch.dtype, Tuple[int, ...]]], dtype: torch.dtype, sizes: Tuple[int, ...],
                       path: str, what: str, ck: CheckpointLocation) -> None:
    """The dtype and shape a stored item's archive records (``found``, from ``describe_archive_head``)
    against what ``.metadata`` says it holds (``dtype``, ``sizes``): CorruptCheckpointError naming
    ``path`` and ``what`` if they differ. ``found`` None: an archive of another layout, whose data's
    place and size were checked already. (The one check for the reader and the small-item runs.)"""
    if found is None:
        return
    shape = tuple(found[1])
    if found[0] == dtype and shape == tuple(sizes):
        return
    where = ck.file(DCP_METADATA_FILE)  # (made only for the message)
    if found[0] != dtype:
        raise CorruptCheckpointError(
            f"{path}: {what} is stored as {found[0]} (the archive's data.pkl) but {where} says "
            f"{dtype}: the metadata does not belong to this data or was altered; refusing to reinterpret it"
        )
    raise CorruptCheckpointError(  # the writer stores every chunk in its own shape
        f"{path}: {what} is stored with shape {shape} (the archive's data.pkl) but "
        f"{where} says {tuple(sizes)}: the metadata does not belong to this data or was altered"
    )


def pread_exact(reader: FileReader, buf: memoryview, offset: int, path: str = "") -> None:
    """Fill ``buf`` from ``reader`` at ``offset`` (a short read raises CorruptCheckpointError)."""
    reader.read_into(buf, offset)
