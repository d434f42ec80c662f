"""One tensor stored as a ``torch.save`` archive inside a ``.distcp`` file.

The DCP format stores every tensor chunk as a complete ``torch.save`` zip
archive at some byte range of a ``.distcp`` file. ``torch.load`` on that range
reads the whole chunk. To read only the bytes a rank needs, we locate the raw
tensor bytes inside the archive (zip local header of ``<prefix>/data/<key>``)
and decode the tiny ``data.pkl`` with a restricted unpickler that only
understands tensor rebuilds. Archives written by others (DCP, Megatron-Core)
are handled the same way; anything unusual falls back to a safe ``torch.load``.

**Writing.** A tensor item is a ``torch.save`` archive; with the archive members' CRC32s off it is a
per-layout template around the tensor's bytes (:func:`archive_template`). Small plain CPU tensors
are written in bulk from it (:class:`SmallItemWriter`: one copy, one checksum and a share of one
large write per item, a few microseconds instead of ~25 us through ``torch.save``, which decides the
checkpoint time of models with tens of thousands of small tensors); a device tensor's bytes are
streamed into it through host buffers (:meth:`BlockDigestWriter.write_archive`), never copied whole.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import io
import pickle
import struct
import threading
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from ..errors import CheckpointWriteError, CorruptCheckpointError
from .checksum import BlockHash, crc32, save_block_hash
from .fs import tensor_buffer
from .readers import FileReader

if TYPE_CHECKING:
    from typing_extensions import Buffer

_LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # zip local file header (30 bytes)


@dataclass(frozen=True)
class TensorRecord:
    """Where a serialized tensor's raw bytes lie, relative to the archive start; its storage's zip record
    (``member_size`` bytes from ``data_offset``) and that record's CRC32 (None: written without one)."""

    data_offset: int
    dtype: torch.dtype
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    storage_offset: int  # in elements
    member_size: int = 0
    member_crc: Optional[int] = None

    @property
    def is_contiguous(self) -> bool:
        expected = [int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape))]
        return all(st == ex or sz == 1 for st, ex, sz in zip(self.stride, expected, self.shape))


class _SliceFile(io.RawIOBase):
    """Read-only file-like view of ``[offset, offset+length)`` of a :class:`FileReader`."""

    def __init__(self, reader: FileReader, offset: int, length: int):
        self.reader, self.base, self.length, self.pos = reader, offset, length, 0

    def readable(self) -> bool:
        return True

    seekable = readable

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else (self.pos + pos if whence == 1 else self.length + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: Optional[int] = -1) -> bytes:
        if n is None or n < 0:
            n = self.length - self.pos
        n = max(0, min(n, self.length - self.pos))
        data = self.reader.read(self.base + self.pos, n)
        self.pos += len(data)
        return data


def _storage_dtypes() -> dict:
    import warnings

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in dir(torch):
            cls = getattr(torch, name, None)
            if name.endswith("Storage") and isinstance(cls, type) and isinstance(getattr(cls, "dtype", None), torch.dtype):
                out[name] = cls.dtype
    return out


_STORAGE_DTYPES = _storage_dtypes()


class _DescribingUnpickler(pickle.Unpickler):
    """Decodes ``data.pkl`` of a single-tensor archive into a description, executing nothing."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _describe_tensor
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Unusual(f"{module}.{name}")

    def persistent_load(self, pid: object) -> Any:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise _Unusual(f"persistent id {pid!r}")
        _, storage_type, key, _location, _numel = pid
        if not isinstance(storage_type, torch.dtype):
            raise _Unusual(f"storage type {storage_type!r}")
        dtype = storage_type
        return ("storage", dtype, str(key))


class _Unusual(Exception):
    pass


def _describe_tensor(storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    if metadata:  # (a conjugate or negative bit: the stored bytes are not the values; torch.load applies it)
        raise _Unusual(f"tensor metadata {sorted(metadata)}")
    return ("tensor", storage, int(storage_offset), tuple(size), tuple(stride))


def parse_tensor_record(fd: FileReader, offset: int, length: int, path: str = "") -> TensorRecord | None:
    """Locate the raw bytes of the tensor archived at ``[offset, offset+length)`` of ``fd`` (a
    :class:`~ckpt_integration.storage.filesystem.FileReader`). ``None`` for archives that are valid
    but unusual (callers then fall back to ``torch.load``); :class:`CorruptCheckpointError` when the
    bytes are not a readable archive, or its tensor reaches past its storage."""
    try:
        zf = zipfile.ZipFile(_SliceFile(fd, offset, length))
        names = {i.filename: i for i in zf.infolist()}
        pkl_name = next((n for n in names if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl_name is None:
            raise CorruptCheckpointError(f"{path}@{offset}: archive has no data.pkl")
        prefix = pkl_name[: -len("data.pkl")]
        pkl = _read_member(fd, offset, length, names[pkl_name])
        try:
            desc = _DescribingUnpickler(io.BytesIO(pkl)).load()
        except _Unusual:
            return None
        if not (isinstance(desc, tuple) and desc and desc[0] == "tensor"):
            return None
        _, (_, dtype, key), storage_offset, shape, stride = desc
        info = names.get(f"{prefix}data/{key}")
        if info is None:
            raise CorruptCheckpointError(f"{path}@{offset}: archive lacks storage data/{key}")
        end = (storage_offset + sum((n - 1) * st for n, st in zip(shape, stride)) + 1) * dtype.itemsize if all(shape) else 0
        if storage_offset < 0 or min(stride, default=0) < 0 or end > info.file_size:  # (a damaged offset/stride: other records)
            raise CorruptCheckpointError(f"{path}@{offset}: the tensor (storage offset {storage_offset}, shape {list(shape)}, "
                                         f"stride {list(stride)}) reaches past its storage data/{key} ({info.file_size} bytes)")
        data_start = _member_data_start(fd, offset, length, info)
        return TensorRecord(data_start, dtype, shape, stride, storage_offset, info.file_size, info.CRC or None)
    except CorruptCheckpointError:
        raise
    except Exception as e:
        # Damaged archive bytes raise many types (BadZipFile, NotImplementedError "zip file version",
        # OSError/OverflowError of a pread at an impossible offset, MemoryError of a huge pickle
        # length, TypeError of a mangled rebuild...): all mean the record is unreadable
        raise CorruptCheckpointError(
            f"{path}: the record at byte {offset} (length {length}) is not a readable tensor archive: {type(e).__name__}: {e}"
        ) from None


@functools.lru_cache(maxsize=4096)  # items of one shape and dtype have byte-identical headers
def describe_archive_head(head: bytes) -> Optional[Tuple[torch.dtype, Tuple[int, ...]]]:
    """The dtype and shape that ``data.pkl`` records, from the first bytes of a single-tensor
    archive (everything before the tensor data; ``data.pkl`` is its first member).

    ``None`` for a valid but unusual archive (another first member, another pickle layout):
    then there is nothing to compare. No code runs: the unpickler knows only tensor rebuilds.
    The pickle ends at its STOP opcode, so the member's size (kept in a data descriptor
    after it, where ``torch.save`` writes it) is not needed.
    """
    if len(head) < _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
        return None
    fields = _LOCAL_HEADER.unpack_from(head, 0)
    name_len, extra_len, method = fields[-2], fields[-1], fields[3]
    start = _LOCAL_HEADER.size + name_len + extra_len
    if method != zipfile.ZIP_STORED or not head[_LOCAL_HEADER.size:_LOCAL_HEADER.size + name_len].endswith(b"data.pkl"):
        return None
    try:
        desc = _DescribingUnpickler(io.BytesIO(head[start:])).load()
    except _Unusual:
        return None
    except Exception as e:  # noqa: BLE001 - damaged pickle bytes raise many types
        raise CorruptCheckpointError(f"data.pkl of the archive is not readable: {e}") from None
    if not (isinstance(desc, tuple) and len(desc) == 5 and desc[0] == "tensor"):
        return None
    _, (_, dtype, _key), _offset, shape, _stride = desc
    return dtype, tuple(int(n) for n in shape)


def _member_data_start(fd: int, offset: int, length: int, info: zipfile.ZipInfo) -> int:
    header = fd.read(offset + info.header_offset, _LOCAL_HEADER.size)
    if len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"bad local header for {info.filename}")
    fields = _LOCAL_HEADER.unpack(header)
    name_len, extra_len = fields[-2], fields[-1]
    start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if info.compress_type != zipfile.ZIP_STORED or start + info.file_size > length:
        raise zipfile.BadZipFile(f"member {info.filename} is compressed or exceeds the record")
    return start


def _read_member(fd: int, offset: int, length: int, info: zipfile.ZipInfo) -> bytes:
    start = _member_data_start(fd, offset, length, info)
    data = fd.read(offset + start, info.file_size)
    if len(data) != info.file_size or info.CRC and crc32(data) != info.CRC:  # (0: written without CRC32s)
        raise zipfile.BadZipFile(f"member {info.filename} is truncated or fails its CRC32 check")
    return data


class DigestWriter(io.RawIOBase):
    """Write-through stream that keeps a running digest (of ``block_hash``) of everything written:
    the item digest of an item saved without block digests (an object's bytes)."""

    def __init__(self, f: BinaryIO, block_hash: Optional[BlockHash] = None):
        self.f, self.pos = f, 0
        self._h = (block_hash or save_block_hash()).hasher()

    @property
    def digest(self) -> int:
        return self._h.intdigest()

    def writable(self) -> bool:
        return True

    def write(self, b: Buffer) -> int:
        mv = memoryview(b).cast("B")
        self._h.update(mv)
        n = self.f.write(mv)
        self.pos += len(mv)
        return len(mv) if n is None else n

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        self.f.flush()


def _address(mv: memoryview) -> int:
    return np.frombuffer(mv, dtype=np.uint8).__array_interface__["data"][0] if len(mv) else 0


class BlockDigestWriter(io.RawIOBase):
    """Write-through stream for one ``torch.save`` archive of ``tensor``: block digests of its data.

    The raw tensor bytes are recognised as the write(s) whose buffer is the tensor's own
    memory (torch hands the storage to the writer without copying). Before them: one digest
    of the archive header; during them: one digest per ``block_size`` bytes, each computed
    on a slice right before that slice is written (one pass over memory, cache-hot for the
    write); after them: one digest of the trailer. The item digest is derived from these
    (``BlockHash.item_digest``), so the data is checksummed once. ``block_hash``: the
    algorithm (default: what new saves record, ``checksum.SAVE_BLOCK_HASH``).

    If the data write is not recognised (some other torch version), ``record`` is None and
    the item digest is the plain digest of the archive's bytes (computed alongside, at the
    cost of a second hash pass); the item is then verified whole on load.
    OS errors of the underlying file are kept in ``error`` (torch wraps them).
    """

    def __init__(self, f: BinaryIO, tensor: torch.Tensor, block_size: int, block_hash: Optional[BlockHash] = None):
        self.f, self.block_size = f, block_size
        self.hash = block_hash or save_block_hash()
        self.tensor = tensor
        self.data_ptr = tensor.data_ptr() if tensor.numel() else -1
        self.nbytes = tensor.numel() * tensor.element_size()
        self.pos = 0
        self.data_offset: Optional[int] = None  # where the data starts (archive-relative)
        self.data_done = 0
        self.head, self.tail, self.tail_len = self.hash.hasher(), self.hash.hasher(), 0
        self.blocks: List[int] = []
        self.block_fill, self.block = 0, None  # bytes of the current data block so far, its running digest
        self.unrecognised = False
        # Only for archives of an unexpected layout, whose item digest is the digest of all their
        # bytes: the header bytes (kept while short) and, once the data was interrupted, a running
        # digest of everything (see _plain_digest).
        self.head_bytes: Optional[bytearray] = bytearray()
        self.whole: Any = None
        self.error: Optional[BaseException] = None

    def writable(self) -> bool:
        return True

    def _write(self, mv: memoryview) -> None:
        try:
            self.f.write(mv)
        except OSError as e:
            self.error = e
            raise

    def write(self, b: Buffer) -> int:
        mv = memoryview(b).cast("B")
        n = len(mv)
        in_data = (
            self.data_ptr >= 0
            and self.data_done < self.nbytes
            and _address(mv) == self.data_ptr + self.data_done
            and (self.data_offset is None or self.pos == self.data_offset + self.data_done)
        )
        if in_data and self.data_done + n <= self.nbytes:
            if self.data_offset is None:
                self.data_offset = self.pos
            self._write_data(mv)
        elif self.data_offset is None:
            self.head.update(mv)
            if self.head_bytes is not None:
                self.head_bytes += mv
                if len(self.head_bytes) > _HEAD_KEEP:
                    self.head_bytes = None  # not a tensor archive's header: the data was not recognised
            self._write(mv)
        else:
            if self.data_done < self.nbytes and not self.unrecognised:
                self.unrecognised = True  # data interrupted: not the layout we understand
                self.whole = self._digest_so_far()
            if self.whole is not None:
                self.whole.update(mv)
            self.tail.update(mv)
            self.tail_len += n
            self._write(mv)
        self.pos += n
        return n

    def write_archive(self, parts: Tuple[bytes, bytes], chunks: Iterable[Buffer]) -> None:
        """Write the archive of template ``parts`` (:func:`archive_template`) around the tensor's
        bytes given in order as ``chunks`` (host copies of a device tensor's bytes)."""
        self.data_ptr = -1  # (nothing here is the tensor's own memory)
        self.write(parts[0])
        self.data_offset = self.pos
        for b in chunks:
            mv = memoryview(b).cast("B")
            self._write_data(mv)
            self.pos += len(mv)
        self.write(parts[1])

    def _write_data(self, mv: memoryview) -> None:
        bs, i, n = self.block_size, 0, len(mv)
        digest = self.hash.digest
        while i < n:
            take = min(bs - self.block_fill, n - i)
            piece = mv[i : i + take]
            if take == bs:  # a whole block in this write (the usual case): one call
                self.blocks.append(digest(piece))
            else:
                if self.block is None:
                    self.block = self.hash.hasher()
                self.block.update(piece)
                self.block_fill += take
                if self.block_fill == bs:
                    self.blocks.append(self.block.intdigest())
                    self.block_fill, self.block = 0, None
            self._write(piece)
            i += take
        self.data_done += n

    def finish(self) -> Tuple[int, Optional[Tuple[int, int, int, List[int]]]]:
        """``(item digest, block record or None)``; call after ``torch.save`` returned. The block record is
        ``(data_offset, data_length, block_size, digests)``, the digests of the non-empty blocks in order:
        header, data blocks, trailer."""
        if self.block is not None:
            self.blocks.append(self.block.intdigest())
            self.block_fill, self.block = 0, None
        d = self.pos if self.data_offset is None else self.data_offset  # no data: all header
        n = self.data_done
        digests = ([self.head.intdigest()] if d > 0 else []) + self.blocks + ([self.tail.intdigest()] if self.tail_len else [])
        lengths = ([d] if d > 0 else []) + [min(self.block_size, n - k) for k in range(0, n, self.block_size)]
        lengths += [self.tail_len] if self.tail_len else []
        if self.unrecognised or n != self.nbytes or d + n + self.tail_len != self.pos:
            return self._plain_digest(), None
        return self.hash.item_digest(digests, lengths), (d, n, self.block_size, digests)

    def _digest_so_far(self) -> Any:
        """A running digest of the bytes written so far (header, then the data written from the
        tensor's memory), at the point where the data was interrupted."""
        if self.head_bytes is None:
            raise CheckpointWriteError(
                "internal error: torch.save wrote an archive of a layout the checkpoint writer does not "
                f"understand (a header over {_HEAD_KEEP} bytes before the tensor data); it cannot be checksummed"
            )

        h = self.hash.hasher()
        h.update(self.head_bytes)
        h.update(tensor_buffer(self.tensor)[: self.data_done])
        return h

    def _plain_digest(self) -> int:
        """The digest of all the archive's bytes: the item digest of an item without a block record."""
        if self.data_offset is None:  # no data recognised: every byte went to the header's digest
            return self.head.intdigest()
        if self.whole is None:  # the data ended early, nothing after it
            self.whole = self._digest_so_far()
        return self.whole.intdigest()

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        self.f.flush()


_HEAD_KEEP = 64 << 10  # header bytes kept for _plain_digest: a torch.save header is a few hundred bytes
TEMPLATE_MAX_BYTES = 1 << 20  # archives of tensors up to this size are written from a template (save_tensor)
_TEMPLATE_SLOTS = 1024
_templates: "OrderedDict[Tuple[Any, ...], Tuple[bytes, bytes]]" = OrderedDict()
_templates_lock = threading.Lock()


class _Probe(io.RawIOBase):
    """What ``torch.save`` writes before and after a tensor's data, without reading the data (a
    template of a 4 GiB tensor costs no more than one of 4 bytes)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.ptr, self.nbytes = tensor, tensor.data_ptr(), tensor.nbytes
        self.parts, self.seen = [bytearray(), bytearray()], 0

    def write(self, b: Buffer) -> int:  # (torch.save needs only this of its file)
        mv = memoryview(b).cast("B")
        if self.seen < self.nbytes and not self.parts[1] and _address(mv) == self.ptr + self.seen:
            self.seen += len(mv)
        else:
            self.parts[0 if self.seen == 0 and self.nbytes else 1] += mv
        return len(mv)


def archive_template(tensor: torch.Tensor) -> Optional[Tuple[bytes, bytes]]:
    """``(archive bytes before the data, archive bytes after it)`` of ``torch.save`` for tensors of
    ``tensor``'s dtype, shape and stride, or None when it cannot be templated.

    With the archive members' CRC32s switched off (as ``write_data_files`` does), ``torch.save``
    of a contiguous, plain CPU tensor (or a device tensor's host copy) writes the same bytes for
    every tensor of one dtype, shape and stride except the data itself (pickled size, stride and
    dtype, member names and offsets, ``serialization_id``; unless :func:`starts_like_descriptor`):
    one ``torch.save`` per layout, then each tensor is the template around its own bytes
    (tests/test_small_tensors.py compares with ``torch.save``).
    """
    if member_crcs_on():
        return None  # the archive's member CRC32s would depend on the data
    key = (tensor.dtype, tuple(tensor.shape), tensor.stride())  # (the pickle holds the stride)
    with _templates_lock:
        hit = _templates.get(key)
        if hit is not None:
            _templates.move_to_end(key)
            return hit
    probe = _Probe(torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype))
    # (uninitialized bytes left by an earlier archive may look like a descriptor: see starts_like_descriptor)
    ctypes.memset(probe.ptr, 0, min(probe.nbytes, 8))
    torch.save(probe.tensor, probe)
    if probe.seen != probe.nbytes or member_crcs_on():  # not that layout; or switched on meanwhile
        return None
    hit = (bytes(probe.parts[0]), bytes(probe.parts[1]))
    with _templates_lock:
        _templates[key] = hit
        while len(_templates) > _TEMPLATE_SLOTS:
            _templates.popitem(last=False)
    return hit


def starts_like_descriptor(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes (CPU, contiguous) begin with a zip data descriptor's signature, whose next
    4 bytes ``torch.save`` mixes into the archive's ``serialization_id``: no template writes that."""
    return t.nbytes >= 8 and ctypes.string_at(t.data_ptr(), 4) == b"PK\x07\x08"


def member_crcs_on() -> bool:
    try:
        from torch.utils.serialization import config
    except ImportError:  # older torch: members always checksummed
        return True
    return bool(config.save.compute_crc32)


def save_tensor(tensor: torch.Tensor, w: "BlockDigestWriter") -> None:
    """``torch.save(tensor, w)``; small tensors from a template (``torch.save`` costs ~250 us a call,
    which decides the checkpoint time of states with tens of thousands of small tensors).

    ``tensor`` is contiguous, owns exactly its bytes (see ``write_data_files``), and the
    archive members' CRC32s are off.
    """
    nbytes = tensor.numel() * tensor.element_size()
    plain = (
        0 < nbytes <= TEMPLATE_MAX_BYTES and tensor.layout == torch.strided and type(tensor) is torch.Tensor
        and not tensor.is_quantized and not tensor.requires_grad and tensor.device.type == "cpu"
        and tensor.is_contiguous() and tensor.storage_offset() == 0
    )
    parts = archive_template(tensor) if plain and not starts_like_descriptor(tensor) else None
    if parts is None:
        torch.save(tensor, w)
        return

    w.write(parts[0])
    w.write(tensor_buffer(tensor))
    w.write(parts[1])


# --------------------------------------------------------------------------- small tensor items written in bulk

FLUSH_BYTES = 4 << 20  # pending bytes written at once


class SmallItemWriter:
    """Appends small tensor items to an open data file (call :meth:`flush` before other writes).

    Items are assembled in one reused staging buffer (template header, the tensor's bytes, template
    trailer, by ``memmove``) and checksummed there, so the bytes hashed are the bytes written even
    if the tensor changes meanwhile; the buffer goes to the file in one write when full. No
    per-item ``bytes`` object: allocating and filling one (``ctypes.string_at``) cost ~5 us of the
    ~14 us an item took, the join before the write another copy.
    """

    def __init__(self, f: BinaryIO, block_size: int, block_hash: Optional[BlockHash] = None):
        self.f = f
        self.block_size = block_size
        self.hash = block_hash or save_block_hash()
        self._digest, self._item_digest = self.hash.digest, self.hash.item_digest  # (once per item)
        self.limit = min(block_size, TEMPLATE_MAX_BYTES)
        self.pending = 0  # bytes staged in ``buf``, not yet written
        self.pos = f.tell()  # the file offset of ``buf[0]``
        # (dtype, shape, stride) -> (template: header + room for the data + trailer, header length,
        # its digest, trailer digest), or None when that layout cannot be templated
        self.templates: Dict[Tuple[Any, ...], Optional[Tuple[bytes, int, int, int]]] = {}
        self.enabled = not member_crcs_on()  # templates only without the archive members' CRC32s
        self.buf: Optional[torch.Tensor] = None  # allocated on the first item
        self.view: Optional[memoryview] = None
        self.addr = 0

    def add(self, t: torch.Tensor) -> Optional[Tuple[int, int, int, Tuple[int, int, int, List[int]]]]:
        """Append ``t`` as one item if it is a small plain tensor: ``(start, length, item digest,
        block record)``; None (nothing written) otherwise."""
        if not self.enabled or type(t) is not torch.Tensor or not t.is_cpu or t.layout != torch.strided:
            return None
        nbytes = t.nbytes
        if not 0 < nbytes <= self.limit or t.is_quantized or not t.is_contiguous() or starts_like_descriptor(t):
            return None
        key = (t.dtype, t.shape, t.stride())
        tpl = self.templates.get(key, False)
        if tpl is False:
            tpl = self.templates[key] = self._make_template(t)
        if tpl is None:
            return None
        frame, d, head_digest, tail_digest = tpl
        length = len(frame)
        if self.pending + length > FLUSH_BYTES:
            if length > FLUSH_BYTES:  # (not with the default sizes: an item is at most 1 MiB + _FRAME_MAX)
                return None
            self.flush()
        if self.buf is None:
            self.buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8)
            self.view = memoryview(self.buf.numpy())
            self.addr = self.buf.data_ptr()
        s = self.pending
        view = self.view
        # the template by a memoryview assignment (a C copy: ~0.4 us, ctypes.memmove ~1 us), then
        # the tensor's bytes over its data part
        view[s : s + length] = frame
        ctypes.memmove(self.addr + s + d, t.data_ptr(), nbytes)
        digests = [head_digest, self._digest(view[s + d : s + d + nbytes]), tail_digest]
        whole = self._item_digest(digests, (d, nbytes, length - d - nbytes))
        self.pending = s + length
        return self.pos + s, length, whole, (d, nbytes, self.block_size, digests)

    def _make_template(self, t: torch.Tensor) -> Optional[Tuple[bytes, int, int, int]]:
        parts = archive_template(t.detach())
        if parts is None or not parts[0] or not parts[1] or len(parts[0]) + len(parts[1]) > _FRAME_MAX:
            return None  # (an archive always has a header and a trailer around the data)
        head, tail = parts
        frame = head + bytes(t.nbytes) + tail  # (ctypes.memmove copies from a bytes object's buffer)
        return frame, len(head), self.hash.digest(head), self.hash.digest(tail)

    def flush(self) -> None:
        if self.pending:
            assert self.view is not None
            # the file copies the bytes before write returns (a local file, or fsspec's buffer)
            self.f.write(self.view[: self.pending])
            self.pos += self.pending
            self.pending = 0


# room for a template's header and trailer (a few hundred bytes each; longer keeps the generic path)
_FRAME_MAX = 64 << 10

