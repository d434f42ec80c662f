"""``.metadata`` written straight from the commit's arrays: the pickle of DCP's ``Metadata``
without building its objects (storage layer).

PyTorch DCP and Megatron-Core read ``.metadata`` with ``pickle.load``: what matters is that
unpickling gives DCP's own objects (``Metadata``, ``TensorStorageMetadata``,
``ChunkStorageMetadata``, ``MetadataIndex``, ``_StorageInfo``, ``torch.Size``...). Building
those objects and pickling them costs ~30 us per chunk in Python (``torch.Size`` and dataclass
construction, a ``reducer_override`` call per object), which at tens of thousands of chunks
(ZeRO-1 at scale, many small tensors) was most of rank 0's commit. Here the pickle opcodes are
generated instead: a chunk's entries are fixed-width records per number of dimensions (the
integers in the narrowest pickle integer opcode that fits the column), written by numpy for all
chunks at once; per key only the key's own header is Python. The object graph that
``pickle.load`` returns is the one :func:`~.torch_dist.make_dcp_metadata` builds (a test
compares them), and :func:`~.torch_dist.dumps_dcp_metadata` stays the path for anything this writer does not
recognise.

The parts that depend on torch's classes (the ``Metadata`` envelope with its ``StorageMeta``,
one ``TensorProperties`` per dtype) are pickled by ``pickle`` itself once and relocated into
this file's memo range, so a torch release that adds a field to them is followed automatically;
if the per-chunk classes change shape, :func:`supported` is False and the caller builds the
objects as before.
"""

from __future__ import annotations

import copyreg
import dataclasses
import functools
import inspect
import pickle
import pickletools
import struct
from typing import Dict, List, Optional, Sequence, Tuple

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

from ..planning.records import group_rows
from .torch_dist import WrittenItem, dumps_dcp_metadata, make_dcp_metadata

# opcodes (pickle protocol 4)
MARK, STOP, POP, TUPLE = b"(", b".", b"0", b"t"
EMPTY_TUPLE, EMPTY_DICT, EMPTY_LIST, NONE = b")", b"}", b"]", b"N"
TUPLE1, TUPLE2, TUPLE3 = b"\x85", b"\x86", b"\x87"
REDUCE, BUILD, NEWOBJ, SETITEMS, APPENDS = b"R", b"b", b"\x81", b"u", b"e"
BINGET, LONG_BINGET, BINPUT, LONG_BINPUT = b"h", b"j", b"q", b"r"
STACK_GLOBAL, SHORT_BINUNICODE, BINUNICODE = b"\x93", b"\x8c", b"X"
BININT1, BININT2, BININT, LONG1 = b"K", b"M", b"J", b"\x8a"

# memo slots of the globals and field names (BINGET: 2 bytes each)
_GLOBALS = [
    Metadata, TensorStorageMetadata, ChunkStorageMetadata, MetadataIndex, _StorageInfo, torch.Size,
    BytesStorageMetadata, TensorProperties,
]
G_TSM, G_CSM, G_MI, G_SI, G_SIZE, G_BSM, G_TP = 1, 2, 3, 4, 5, 6, 7
F_PROPERTIES, F_SIZE, F_CHUNKS = 8, 9, 10
_RELOC_BASE = 16  # relocated fragments (envelope, TensorProperties states) use memo slots from here
_STATE_BASE = 512  # the TensorProperties state of each dtype (one shared tuple per dtype)
_STRINGS_BASE = 1024  # then the key and file name strings


@functools.lru_cache(maxsize=None)
def supported() -> bool:
    """Whether DCP's per-chunk classes have the shape this writer emits (else build objects)."""
    try:
        fields = lambda c: tuple(f.name for f in dataclasses.fields(c))  # noqa: E731
        ok = (
            fields(TensorStorageMetadata) == ("properties", "size", "chunks")
            and fields(ChunkStorageMetadata)[:2] == ("offsets", "sizes")
            and all(f.default is not dataclasses.MISSING for f in dataclasses.fields(ChunkStorageMetadata)[2:])
            and fields(BytesStorageMetadata) == ()
            and tuple(inspect.signature(MetadataIndex.__init__).parameters)[1:4] == ("fqn", "offset", "index")
            and fields(_StorageInfo)[:3] == ("relative_path", "offset", "length")
            and all(getattr(c, "__reduce__") is object.__reduce__ and "__getstate__" not in c.__dict__
                    and "__slots__" not in c.__dict__ for c in (TensorStorageMetadata, BytesStorageMetadata))
        )
        return ok and _envelope() is not None and bool(_properties_state("float32"))
    except Exception:  # noqa: BLE001 - any surprise: use the object path
        return False


def _get(i: int) -> bytes:
    return BINGET + bytes([i]) if i < 256 else LONG_BINGET + struct.pack("<I", i)


def _put(i: int) -> bytes:
    return BINPUT + bytes([i]) if i < 256 else LONG_BINPUT + struct.pack("<I", i)


def _str(s: str) -> bytes:
    b = s.encode("utf-8", "surrogatepass")
    return (SHORT_BINUNICODE + bytes([len(b)]) if len(b) < 256 else BINUNICODE + struct.pack("<I", len(b))) + b


def _memo_strings(strings: Sequence[str], base: int) -> bytes:
    """``_str(s) + _put(base + i) + POP`` for each string: the memo's string table, built with
    numpy for tens of thousands of keys (~0.3 us each instead of ~2 one by one)."""
    if not strings:
        return b""
    enc = [s.encode("utf-8", "surrogatepass") for s in strings]
    n = np.fromiter(map(len, enc), dtype=np.int64, count=len(enc))
    if int(n.max()) >= 256 or base < 256:  # (long keys, low slots: the other opcodes, one by one)
        return b"".join(_str(s) + _put(base + i) + POP for i, s in enumerate(strings))
    # per string: SHORT_BINUNICODE, its length, its bytes, LONG_BINPUT, the slot (4 bytes), POP
    ends = np.cumsum(n + 8)
    starts = ends - (n + 8)
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    out[starts] = SHORT_BINUNICODE[0]
    out[starts + 1] = n
    src = np.frombuffer(b"".join(enc), dtype=np.uint8)
    out[np.arange(len(src)) + 8 * np.repeat(np.arange(len(enc)), n) + 2] = src
    out[starts + n + 2] = LONG_BINPUT[0]
    slots = np.arange(base, base + len(enc), dtype="<u4").view(np.uint8).reshape(-1, 4)
    for b in range(4):
        out[starts + n + 3 + b] = slots[:, b]
    out[ends - 1] = POP[0]
    return out.tobytes()


def _int(v: int) -> bytes:
    if 0 <= v < 256:
        return BININT1 + bytes([v])
    if 0 <= v < 65536:
        return BININT2 + struct.pack("<H", v)
    if -(1 << 31) <= v < 1 << 31:
        return BININT + struct.pack("<i", v)
    return LONG1 + bytes([8]) + struct.pack("<q", v)


def _tuple(items: Sequence[bytes]) -> bytes:
    n = len(items)
    if n == 0:
        return EMPTY_TUPLE
    if n <= 3:
        return b"".join(items) + (TUPLE1, TUPLE2, TUPLE3)[n - 1]
    return MARK + b"".join(items) + TUPLE


def _size(values: Sequence[int]) -> bytes:
    return _get(G_SIZE) + _tuple([_int(v) for v in values]) + TUPLE1 + REDUCE


def _relocate(data: bytes, base: int) -> Optional[bytes]:
    """The opcodes of a pickle (without PROTO, FRAME and STOP) with its memo moved to slots
    ``base + i``; None if it uses an opcode this does not handle."""
    out: List[bytes] = []
    puts = 0
    ops = list(pickletools.genops(data))
    for k, (op, arg, pos) in enumerate(ops):
        end = ops[k + 1][2] if k + 1 < len(ops) else len(data)
        name = op.name
        if name in ("PROTO", "FRAME", "STOP"):
            continue
        if name == "MEMOIZE":
            out.append(LONG_BINPUT + struct.pack("<I", base + puts))
            puts += 1
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            out.append(LONG_BINPUT + struct.pack("<I", base + int(arg)))
            puts = max(puts, int(arg) + 1)
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            out.append(LONG_BINGET + struct.pack("<I", base + int(arg)))
        elif name in ("PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4", "INST", "OBJ"):
            return None
        else:
            out.append(data[pos:end])
    return b"".join(out)


def _memo_slots(fragment: bytes) -> int:
    """How many memo slots a relocated fragment uses (from its base)."""
    top = -1
    for op, arg, _ in pickletools.genops(b"\x80\x04" + fragment + STOP):
        if op.name in ("LONG_BINPUT", "LONG_BINGET"):
            top = max(top, int(arg))
    return 0 if top < 0 else top + 1


@functools.lru_cache(maxsize=None)
def _envelope() -> Optional[Tuple[bytes, bytes, bytes, bytes]]:
    """The pickle of an empty ``Metadata`` cut where the three tables' contents go:
    ``(head, after state_dict_metadata's dict, after planner_data's, after storage_data's)``,
    each part ending with that table's (still empty) dict."""
    md = Metadata(state_dict_metadata={}, planner_data={}, storage_data={}, storage_meta=StorageMeta(), version="1.0.0")
    body = _relocate(pickletools.optimize(pickle.dumps(md, protocol=4)), _RELOC_BASE)
    if body is None or _RELOC_BASE + _memo_slots(body) > _PROPERTIES_BASE:
        return None
    cuts = []
    ops = list(pickletools.genops(b"\x80\x04" + body + STOP))
    for k, (op, arg, _) in enumerate(ops):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE") and arg in ("state_dict_metadata", "planner_data", "storage_data"):
            j = k + 1
            while ops[j][0].name in ("LONG_BINPUT", "BINPUT", "MEMOIZE"):
                j += 1
            if ops[j][0].name != "EMPTY_DICT":
                return None
            cuts.append(ops[j][2] + 1 - 2)  # just after the EMPTY_DICT, in body coordinates
    if len(cuts) != 3:
        return None
    a, b, c = cuts
    return body[:a], body[a:b], body[b:c], body[c:]


_PROPERTIES_BASE = _RELOC_BASE + 128  # scratch slots of a TensorProperties state's own pickle


@functools.lru_cache(maxsize=64)
def _properties_state(dtype_name: str) -> bytes:
    """The pickle opcodes of the state of ``TensorProperties(dtype)`` (what its ``__setstate__``
    takes): every key of that dtype shares this (immutable) tuple, built once on load."""
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype_name!r}")
    rv = TensorProperties(dtype=dtype).__reduce_ex__(4)
    if not (rv[0] is copyreg.__newobj__ and rv[1] == (TensorProperties,) and isinstance(rv[2], tuple)
            and all(x is None for x in rv[3:])):
        raise ValueError("TensorProperties does not pickle as NEWOBJ + a state tuple")
    frag = _relocate(pickletools.optimize(pickle.dumps(rv[2], protocol=4)), _PROPERTIES_BASE)
    if frag is None or _PROPERTIES_BASE + _memo_slots(frag) > _STATE_BASE:
        raise ValueError(f"cannot relocate the pickle of TensorProperties({dtype_name})'s state")
    return frag


# --------------------------------------------------------------------------- fixed-width records
def _int_field(values: np.ndarray) -> Tuple[bytes, str]:
    """Opcode and numpy field type of the narrowest pickle integer that holds every value."""
    if not len(values):
        return BININT1, "u1"
    lo, hi = int(values.min()), int(values.max())
    if lo >= 0 and hi < 256:
        return BININT1, "u1"
    if lo >= 0 and hi < 65536:
        return BININT2, "<u2"
    if lo >= -(1 << 31) and hi < 1 << 31:
        return BININT, "<i4"
    return LONG1 + bytes([8]), "<i8"


class _Record:
    """A fixed-width byte record: constant byte strings and integer columns, in order."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.fields: List[Tuple[str, str]] = []
        self.values: Dict[str, object] = {}

    def const(self, b: bytes) -> None:
        if not b:
            return
        name = f"f{len(self.fields)}"
        self.fields.append((name, f"S{len(b)}"))
        self.values[name] = b

    def ints(self, values: np.ndarray) -> None:
        op, dt = _int_field(values)
        self.const(op)
        name = f"f{len(self.fields)}"
        self.fields.append((name, dt))
        self.values[name] = values

    def tobytes(self) -> bytes:
        arr = np.zeros(self.n, dtype=np.dtype(self.fields))
        for name, v in self.values.items():
            arr[name] = v
        return arr.tobytes()

    @property
    def width(self) -> int:
        return np.dtype(self.fields).itemsize if self.fields else 0


def _tuple_record(rec: _Record, cols: np.ndarray) -> None:
    """A tuple of the integer columns ``cols`` (shape ``(m, k)``)."""
    k = cols.shape[1]
    if k == 0:
        rec.const(EMPTY_TUPLE)
        return
    if k > 3:
        rec.const(MARK)
    for j in range(k):
        rec.ints(cols[:, j])
    rec.const((TUPLE1, TUPLE2, TUPLE3)[k - 1] if k <= 3 else TUPLE)


def _size_record(rec: _Record, cols: np.ndarray) -> None:
    rec.const(_get(G_SIZE))
    _tuple_record(rec, cols)
    rec.const(TUPLE1 + REDUCE)


def _get_record(rec: _Record, slots: np.ndarray) -> None:
    rec.const(LONG_BINGET)
    name = f"f{len(rec.fields)}"
    rec.fields.append((name, "<u4"))
    rec.values[name] = slots


def _rows(rec: _Record) -> np.ndarray:
    """The records as a ``(n, width)`` uint8 array."""
    return np.frombuffer(rec.tobytes(), dtype=np.uint8).reshape(rec.n, rec.width)


def dumps_layout(
    keys: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Tuple[int, ...]], chunk_offsets: Dict[int, np.ndarray],
    chunk_sizes: Dict[int, np.ndarray], chunk_key: Dict[int, np.ndarray], chunk_file: Dict[int, np.ndarray],
    chunk_start: Dict[int, np.ndarray], chunk_length: Dict[int, np.ndarray], object_keys: Sequence[str],
    object_file: np.ndarray, object_start: np.ndarray, object_length: np.ndarray, files: Sequence[str],
) -> bytes:
    """``.metadata`` bytes of tensors ``keys`` (sorted; ``dtypes`` names, global ``shapes``) and
    objects ``object_keys``. The chunks come per number of dimensions ``nd``: ``chunk_offsets[nd]``
    and ``chunk_sizes[nd]`` (shape ``(m, nd)``), the index of each chunk's key in ``keys``
    (``chunk_key[nd]``, grouped by key in key order, offsets sorted within a key) and where it is
    stored (index into ``files``, start, length). Objects: one per key, its storage record.

    Every key's entry of ``state_dict_metadata`` is a fixed-width record for the keys of one
    (shape rank, chunk rank, chunk count): built by numpy for all of them, then put in key order.
    """
    head, after_sd, after_pd, tail = _envelope()
    nkeys = len(keys) + len(object_keys)
    key_slot = _STRINGS_BASE
    file_slot = _STRINGS_BASE + nkeys
    parts: List[bytes] = [b"\x80\x04"]
    for i, cls in enumerate(_GLOBALS):
        parts += [_str(cls.__module__), _str(cls.__qualname__), STACK_GLOBAL, _put(i), POP]
    for i, name in ((F_PROPERTIES, "properties"), (F_SIZE, "size"), (F_CHUNKS, "chunks")):
        parts += [_str(name), _put(i), POP]
    names = sorted(set(dtypes))
    state_slot = {d: _STATE_BASE + i for i, d in enumerate(names)}
    for d in names:
        parts += [_properties_state(d), _put(state_slot[d]), POP]
    parts.append(_memo_strings(list(keys) + list(object_keys), key_slot))
    parts.append(_memo_strings(list(files), file_slot))
    parts.append(head)
    # the chunk records of each chunk rank, as rows of bytes: ChunkStorageMetadata(Size(offsets), Size(sizes))
    chunk_rows: Dict[int, np.ndarray] = {}
    nchunks = np.zeros(len(keys), dtype=np.int64)
    first_row = np.zeros(len(keys), dtype=np.int64)
    chunk_nd = np.full(len(keys), -1, dtype=np.int64)
    for nd, off in chunk_offsets.items():
        rec = _Record(len(off))
        rec.const(_get(G_CSM))
        _size_record(rec, off)
        _size_record(rec, chunk_sizes[nd])
        rec.const(TUPLE2 + REDUCE)
        chunk_rows[nd] = _rows(rec)
        ks, first, counts = np.unique(chunk_key[nd], return_index=True, return_counts=True)
        nchunks[ks], first_row[ks], chunk_nd[ks] = counts, first, nd
    # state_dict_metadata entries: TensorStorageMetadata(properties, size, chunks) per key
    entries: List[bytes] = [b""] * nkeys
    gnd = np.asarray([len(sh) for sh in shapes], dtype=np.int64)
    group_of = np.stack([gnd, chunk_nd, nchunks], axis=1) if len(keys) else np.zeros((0, 3), dtype=np.int64)
    for (n_g, cnd, c), sel in group_rows(group_of):
        rec = _Record(len(sel))
        _get_record(rec, (key_slot + sel).astype(np.uint32))
        rec.const(_get(G_TSM) + EMPTY_TUPLE + NEWOBJ + EMPTY_DICT + MARK + _get(F_PROPERTIES) + _get(G_TP) + EMPTY_TUPLE + NEWOBJ)
        _get_record(rec, np.asarray([state_slot[dtypes[k]] for k in sel.tolist()], dtype=np.uint32))
        rec.const(BUILD + _get(F_SIZE))
        _size_record(rec, np.asarray([shapes[k] for k in sel.tolist()], dtype=np.int64).reshape(len(sel), n_g))
        rec.const(_get(F_CHUNKS) + EMPTY_LIST + MARK)
        blocks = [_rows(rec)]
        if c > 0:
            idx = first_row[sel][:, None] + np.arange(c)[None, :]
            blocks.append(chunk_rows[cnd][idx.reshape(-1)].reshape(len(sel), -1))
        blocks.append(np.frombuffer(APPENDS + SETITEMS + BUILD, dtype=np.uint8)[None, :].repeat(len(sel), axis=0))
        data = np.concatenate(blocks, axis=1)
        width = data.shape[1]
        flat = data.tobytes()
        for j, k in enumerate(sel.tolist()):
            entries[k] = flat[j * width : (j + 1) * width]
    if object_keys:  # BytesStorageMetadata() per object key
        rec = _Record(len(object_keys))
        _get_record(rec, np.arange(key_slot + len(keys), key_slot + nkeys, dtype=np.uint32))
        rec.const(_get(G_BSM) + EMPTY_TUPLE + NEWOBJ)
        flat, width = rec.tobytes(), rec.width
        for j in range(len(object_keys)):
            entries[len(keys) + j] = flat[j * width : (j + 1) * width]
    if nkeys:
        parts += [MARK, *entries, SETITEMS]
    parts.append(after_sd)
    # planner_data: every key to (key,)
    if nkeys:
        rec = _Record(nkeys)
        slots = np.arange(key_slot, key_slot + nkeys, dtype=np.uint32)
        _get_record(rec, slots)
        _get_record(rec, slots)
        rec.const(TUPLE1)
        parts += [MARK, rec.tobytes(), SETITEMS]
    parts.append(after_pd)
    # storage_data: MetadataIndex(key, offsets) -> _StorageInfo(file, start, length)
    stored: List[bytes] = []
    for nd, off in chunk_offsets.items():
        rec = _Record(len(off))
        rec.const(_get(G_MI))
        _get_record(rec, (key_slot + chunk_key[nd]).astype(np.uint32))
        _tuple_record(rec, off)
        rec.const(NONE + TUPLE3 + REDUCE + _get(G_SI))
        _get_record(rec, (file_slot + chunk_file[nd]).astype(np.uint32))
        rec.ints(chunk_start[nd])
        rec.ints(chunk_length[nd])
        rec.const(TUPLE3 + REDUCE)
        stored.append(rec.tobytes())
    if len(object_keys):
        rec = _Record(len(object_keys))
        rec.const(_get(G_MI))
        _get_record(rec, np.arange(key_slot + len(keys), key_slot + nkeys, dtype=np.uint32))
        rec.const(NONE + NONE + TUPLE3 + REDUCE + _get(G_SI))
        _get_record(rec, (file_slot + object_file).astype(np.uint32))
        rec.ints(object_start)
        rec.ints(object_length)
        rec.const(TUPLE3 + REDUCE)
        stored.append(rec.tobytes())
    if any(stored):
        parts += [MARK, *stored, SETITEMS]
    parts += [tail, STOP]
    return b"".join(parts)


def dumps_commit_layout(layout: "CommitLayout") -> bytes:  # noqa: F821 - planning.written.CommitLayout
    """``.metadata`` bytes of a commit: tensors with their chunks and where each is stored, objects.

    The fast path above when DCP's classes have the expected shape (:func:`supported`), else
    the same metadata built as objects (``make_dcp_metadata``) and pickled compactly.
    """
    w = layout.written
    if not supported():
        return _dumps_objects(layout)
    items = layout.chunk_items
    counts = np.diff(layout.key_starts)
    key_of = np.repeat(np.arange(len(layout.tensor_keys), dtype=np.int64), counts)
    used = np.unique(np.concatenate([w.file[items], w.file[layout.object_items]]))
    files = [w.strings[f] for f in used.tolist()]
    nd_all = w.nd[items]
    offs, sizes, keys_, file_, start, length = {}, {}, {}, {}, {}, {}
    for nd in np.unique(nd_all).tolist():
        pos = np.flatnonzero(nd_all == nd)
        sel = items[pos]
        offs[nd], sizes[nd] = w.grid(sel, nd), w.grid(sel, nd, sizes=True)
        keys_[nd] = key_of[pos]
        file_[nd] = np.searchsorted(used, w.file[sel])
        start[nd], length[nd] = w.start[sel], w.length[sel]
    obj = layout.object_items
    return dumps_layout(
        layout.tensor_keys, layout.tensor_dtypes, layout.tensor_shapes, offs, sizes, keys_, file_, start, length,
        [w.strings[k] for k in w.key[obj].tolist()], np.searchsorted(used, w.file[obj]), w.start[obj], w.length[obj], files,
    )


def _dumps_objects(layout: "CommitLayout") -> bytes:  # noqa: F821
    w = layout.written
    tensors = {k: (getattr(torch, dt), shape, chunks) for k, (dt, shape, chunks) in layout.tensors.items()}
    written = [WrittenItem(it.storage_key, it.offsets, it.relative_path, it.offset, it.length, it.checksum)
               for it in (w.items()[i] for i in np.concatenate([layout.chunk_items, layout.object_items]).tolist())]
    return dumps_dcp_metadata(make_dcp_metadata(tensors, layout.objects, written))
