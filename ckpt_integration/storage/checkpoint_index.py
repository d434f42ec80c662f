"""``index.bin``: a checkpoint's one index (manifest format 6, torch_dist).

One row per stored item, in storage order (by data file, then offset): its key, its box
(offsets and sizes, tensor chunks only), its data file, offset and length, where its raw tensor
data lies in its archive (data offset, data length, block size), its item digest, its block
digests and its fingerprint. Beside the rows, one entry per tensor key: dtype, global shape and
its chunks as row numbers, in offset order. That is everything the commit knows about what was
written (``planning.written.CommitLayout``), stored once, by the commit, from the same arrays it
exports ``.metadata`` from; nothing else records digests or positions.

What a load or a tool uses is derived from it in memory, on first use: the item table
(``ItemTable``, lookups by ``(file, offset)`` for verified reads), the chunk index
(``chunk_index.compact_of_index``, lookups by key and box for planning) and the fingerprints
(``fingerprint.Recorded``). Formats 4 and 5 kept those three as separate records (the manifest's
``tables`` and ``fingerprints``, and ``chunk_index.bin``); they still load through the same views.

The file (little-endian), see docs/format.md:

* a 56-byte header (:data:`_HEAD`): magic ``CKIX``, index version (u32, 1), digest width in bytes
  (u32: 8 for XXH3-64, 4 for CRC32), flags (u32; 1: fingerprints present; 2: item digests derived,
  set exactly with XXH3-64), the number of rows and
  of block digests (u64 each), the length of the column message (u64), the size and CRC32 of the
  ``.metadata`` exported with it (i64 each, -1 when unknown);
* the column message: a :mod:`..planning.records` message (its string table: the data file names,
  sorted, then keys and dtype names) whose integers are stored as first differences and which is
  zlib-compressed (sorted offsets and repeated sizes become small repeating numbers);
* the item digests (one per row; with flag 2 only those of rows without block digests: the item
  digest of a row with block digests is XXH3-64 of them, derived when asked), the block digests
  (every row's, in row order), and with flag 1 the fingerprints (one u64 per row, 0 where a row
  has none), as unsigned integers.

The message's integers: the number of file names and of tensor keys; eleven columns of one entry
per row (key id, dimensions (-1: an object), has sizes, file id, offset, length, data offset, data
length, block size, number of block digests (-1: no block record), has a fingerprint); every row's
offsets then sizes; four columns of one entry per tensor key (key id, dtype id, dimensions, number
of chunks), sorted by key; the shapes; every tensor key's chunk rows.

Every structural problem (lengths, magic, a newer version, ids out of range, rows out of order or
overlapping, a chunk row that is not a chunk of its key, counts that do not add up) raises
:class:`CorruptCheckpointError` naming the file.
"""

from __future__ import annotations

import operator
import struct
import zlib
from typing import Any, Dict, List, Optional, Set

import numpy as np

from ..errors import CheckpointingException, CorruptCheckpointError
from ..planning.dtypes import dtype_name
from ..planning.records import MessageWriter, decode_array, difference_ints
from ..planning.written import CommitLayout, WrittenColumns
from .checksum import XXH3_64, BlockHash
from .fingerprint import Recorded
from .item_table import ItemTable, check_columns, read_head

INDEX_FILE = "index.bin"
INDEX_VERSION = 1
MAGIC = b"CKIX"
_HEAD = struct.Struct("<4sIIIQQQqq")  # magic, version, digest width, flags, rows, block digests, message, .metadata size, CRC32
_FINGERPRINTS, _DERIVED = 1, 2
_ROW_COLUMNS = 11
_TENSOR_COLUMNS = 4
_LEVEL = 1  # zlib: the differenced columns repeat; level 1 is fast and takes most of it


def encode_index(layout: CommitLayout, h: BlockHash, metadata_entry: Optional[Dict[str, int]] = None) -> bytes:
    """The bytes of ``index.bin`` for a commit's layout (its items' digests are ``h``'s)."""
    w = layout.written
    n = len(w)
    out = MessageWriter()
    used = np.unique(w.file).tolist() if n else []
    names = sorted({w.strings[i] for i in used})
    out.sids(names)  # ids 0..len(names)-1, in name order: rows sort by file id
    fid = np.full(len(w.strings), -1, dtype=np.int64)
    if used:
        fid[np.asarray(used, dtype=np.int64)] = out.sids([w.strings[i] for i in used])
    file = fid[w.file] if n else np.zeros(0, dtype=np.int64)
    order = np.lexsort((w.start, file))
    where_now = np.empty(n, dtype=np.int64)
    where_now[order] = np.arange(n)
    r = w.take(order)  # the rows in storage order
    key = _sids(out, r.strings, r.key)
    nblocks, has_fp = r.nblocks, r.has_fingerprint.astype(np.int64)
    tkeys = out.sids(layout.tensor_keys)
    tdtypes = out.sids(layout.tensor_dtypes)
    tnd = np.asarray([len(s) for s in layout.tensor_shapes], dtype=np.int64)
    shapes = np.asarray([d for s in layout.tensor_shapes for d in s], dtype=np.int64)
    out.add(len(names), len(layout.tensor_keys))
    out.add_array(np.concatenate([
        key, r.nd, r.has_sizes.astype(np.int64), file[order], r.start, r.length, r.data_offset, r.data_length,
        r.block_size, nblocks, has_fp, r.coords,
        tkeys, tdtypes, tnd, np.diff(layout.key_starts), shapes, where_now[layout.chunk_items],
    ]))
    msg = bytearray(out.tobytes())
    difference_ints(msg)
    zmsg = zlib.compress(bytes(msg), _LEVEL)
    flags = _FINGERPRINTS if has_fp.any() else 0
    digest = r.digest
    if h.name == XXH3_64:  # (an item digest its block digests determine is not stored: 1.6 MiB at 65,536 ranks)
        flags |= _DERIVED
        digest = digest[nblocks < 0]
    entry = metadata_entry or {}
    dt = f"<u{h.width}"
    parts = [_HEAD.pack(MAGIC, INDEX_VERSION, h.width, flags, n, len(r.block_digests), len(zmsg),
                        int(entry.get("size", -1)), int(entry.get("crc32", -1))),
             zmsg, digest.astype(dt).tobytes(), r.block_digests.astype(dt).tobytes()]
    if flags & _FINGERPRINTS:
        parts.append(np.where(has_fp != 0, r.fingerprint, np.uint64(0)).astype("<u8").tobytes())
    return b"".join(parts)


def _sids(out: MessageWriter, strings: List[str], ids: np.ndarray) -> np.ndarray:
    """``out``'s ids of the strings ``strings[ids]`` (each distinct string looked up once)."""
    if not len(ids):
        return np.zeros(0, dtype=np.int64)
    distinct, which = np.unique(ids, return_inverse=True)
    return out.sids([strings[i] for i in distinct.tolist()])[which]


class CheckpointIndex:
    """A decoded ``index.bin``: ``layout`` (the commit's layout, rows in storage order),
    ``metadata_size`` / ``metadata_crc32`` (the ``.metadata`` exported with it), ``raw`` (the
    file's bytes, as a load's broadcast sends them) and the views derived on first use."""

    def __init__(self, raw: bytes, h: BlockHash, where: str):
        self.raw, self.hash, self.where = raw, h, where
        try:
            self._decode(raw, h)
        except (ValueError, IndexError, zlib.error) as e:
            raise CorruptCheckpointError(f"{where} is damaged: {e}") from None
        self._table: Optional[ItemTable] = None
        self._fingerprints: Optional[Recorded] = None

    def _decode(self, raw: bytes, h: BlockHash) -> None:
        _, _, width, flags, n, nb, nmsg, md_size, md_crc = read_head(raw, _HEAD, MAGIC, INDEX_VERSION, "index", h)
        if flags & ~(_FINGERPRINTS | _DERIVED):
            raise ValueError(f"unknown flags {flags:#x}")
        if flags & _DERIVED and h.name != XXH3_64:
            raise ValueError(f"item digests derived from block digests, but its digests are {h.label}")
        self.derived = bool(flags & _DERIVED)
        end = _HEAD.size + nmsg
        self.metadata_size, self.metadata_crc32 = md_size, md_crc
        msg = bytearray(zlib.decompress(raw[_HEAD.size : end]))
        difference_ints(msg, undo=True)
        strings, ints = decode_array(bytes(msg))
        if len(ints) < 2:
            raise ValueError("its column message has no counts")
        nfiles, nt = int(ints[0]), int(ints[1])
        if not (0 <= nfiles <= len(strings)) or nt < 0:
            raise ValueError("counts out of range")
        p = 2 + _ROW_COLUMNS * n
        if len(ints) < p:
            raise ValueError("rows cut short")
        rows = ints[2:p].reshape(_ROW_COLUMNS, n)
        key, nd, has_sizes, file, start, length, data_offset, data_length, block_size, nblocks, has_fp = rows
        if bool(has_fp.any()) != bool(flags & _FINGERPRINTS):
            raise ValueError("its rows and its flags disagree on whether it holds fingerprints")
        _check_rows(strings, nfiles, key, nd, has_sizes, has_fp, file, start, length, nblocks, data_offset, data_length,
                    block_size, nb)
        ncoords = np.where(nd < 0, 0, nd * (1 + has_sizes))
        coords, p = _take(ints, p, int(ncoords.sum()), "box coordinates")
        tcols, p = _take(ints, p, _TENSOR_COLUMNS * nt, "tensor keys")
        tkey, tdtype, tnd, tcount = tcols.reshape(_TENSOR_COLUMNS, nt)
        if nt and (int(min(tkey.min(), tdtype.min())) < 0 or int(max(tkey.max(), tdtype.max())) >= len(strings)
                   or int(tnd.min()) < 0 or int(tcount.min()) < 0):
            raise ValueError("a tensor key's ids or counts are out of range")
        shapes, p = _take(ints, p, int(tnd.sum()), "shapes")
        chunk_rows, p = _take(ints, p, int(tcount.sum()), "chunk rows")
        if p != len(ints):
            raise ValueError(f"{len(ints) - p} integers after the last section")
        tkeys = [strings[k] for k in tkey.tolist()]
        if not all(map(operator.lt, tkeys, tkeys[1:])):
            raise ValueError("tensor keys are not sorted, or a key is listed twice")
        objects = np.flatnonzero(has_sizes == 0)
        names = [strings[k] for k in key[objects].tolist()]  # (objects: one row each, by name)
        if len(set(names)) != len(names) or not set(names).isdisjoint(tkeys):
            raise ValueError("an object key is listed twice, or is a tensor key too")
        _check_chunks(chunk_rows, tkey, tnd, tcount, key, nd, has_sizes)
        stored = int((nblocks < 0).sum()) if self.derived else n  # (item digests in the file)
        want = end + (stored + nb) * width + (n * 8 if flags & _FINGERPRINTS else 0)
        if len(raw) != want:
            raise ValueError(f"{len(raw)} bytes where its header and rows describe {want}")
        dt = f"<u{width}"
        digest = np.frombuffer(raw, dtype=dt, count=stored, offset=end).astype(np.uint64)
        if self.derived:  # (zeros where the block digests determine it: ItemTable derives those)
            digest, given = np.zeros(n, dtype=np.uint64), digest
            digest[nblocks < 0] = given
        block_digests = np.frombuffer(raw, dtype=dt, count=nb, offset=end + stored * width).astype(np.uint64)
        fingerprint = np.zeros(n, dtype=np.uint64)
        if flags & _FINGERPRINTS:
            fingerprint = np.frombuffer(raw, dtype="<u8", count=n, offset=end + (stored + nb) * width).astype(np.uint64)
            if bool((fingerprint[has_fp == 0] != 0).any()):
                raise ValueError("a row without a fingerprint has one stored")
        counts = np.maximum(nblocks, 0)
        written = WrittenColumns(
            strings=strings, key=key, nd=nd, has_sizes=has_sizes != 0, coord_pos=np.cumsum(ncoords) - ncoords,
            coords=coords, file=file, start=start, length=length, digest=digest, data_offset=data_offset,
            data_length=data_length, block_size=block_size, nblocks=nblocks, block_pos=np.cumsum(counts) - counts,
            block_digests=block_digests, has_fingerprint=has_fp != 0, fingerprint=fingerprint)
        objects = objects[np.argsort(names, kind="stable")] if len(objects) else objects
        self.layout = CommitLayout(
            written=written, tensor_keys=tkeys, tensor_dtypes=[strings[k] for k in tdtype.tolist()],
            tensor_shapes=_shapes(shapes, tnd),
            chunk_items=chunk_rows, key_starts=np.r_[0, np.cumsum(tcount)].astype(np.int64), object_items=objects)
        self.files = strings[:nfiles]
        # the tensor keys' string ids, dtype ids and shapes (flat, start of each key's): what the chunk
        # index derived from this one is made of, in this index's string table
        self.tensor_key_ids, self.tensor_dtype_ids = tkey, tdtype
        self.tensor_shapes = (shapes, np.cumsum(tnd) - tnd)

    def __len__(self) -> int:
        return len(self.layout.written)

    def item_table(self) -> ItemTable:
        """The rows as the item table verified reads look items up in (built once)."""
        if self._table is None:  # (the rows are in its order, their file ids number the sorted file names)
            w = self.layout.written
            self._table = ItemTable.of_columns(self.files, w.file, w.start, w.digest, w.nblocks, w.data_offset,
                                               w.data_length, w.block_size, w.block_digests, self.hash, self.where,
                                               derived=self.derived)
        return self._table

    def fingerprints(self) -> Optional[Recorded]:
        """The recorded fingerprints of the saved tensor chunks (None: the save recorded none)."""
        w = self.layout.written
        if self._fingerprints is None and w.has_fingerprint.any():
            self._fingerprints = Recorded.of_columns(w.strings, w.fingerprint_groups())
        return self._fingerprints

    def without_keys(self, keys: Set[str], metadata_entry: Optional[Dict[str, int]] = None) -> bytes:
        """The bytes of this index without the items of ``keys`` (storage keys: tensors and objects),
        for the ``.metadata`` of ``metadata_entry`` (a tool that removes keys rewrites both)."""
        lay, w = self.layout, self.layout.written
        gone_ids = np.asarray([i for i, s in enumerate(w.strings) if s in keys], dtype=np.int64)
        keep = ~np.isin(w.key, gone_ids)
        new_row = np.cumsum(keep) - 1
        ks = [k for k, key in enumerate(lay.tensor_keys) if key not in keys]
        starts = lay.key_starts
        chunk = [lay.chunk_items[starts[k] : starts[k + 1]] for k in ks]
        kept = w.take(np.flatnonzero(keep))
        counts = [len(c) for c in chunk]
        out = CommitLayout(
            written=kept, tensor_keys=[lay.tensor_keys[k] for k in ks], tensor_dtypes=[lay.tensor_dtypes[k] for k in ks],
            tensor_shapes=[lay.tensor_shapes[k] for k in ks],
            chunk_items=new_row[np.concatenate(chunk)] if chunk else np.zeros(0, dtype=np.int64),
            key_starts=np.r_[0, np.cumsum(counts)].astype(np.int64) if counts else np.zeros(1, dtype=np.int64),
            object_items=np.zeros(0, dtype=np.int64))  # (derived from the rows when decoded)
        return encode_index(out, self.hash, metadata_entry)


def layout_of_metadata(md: Any, w: WrittenColumns) -> CommitLayout:
    """The layout of items written through PyTorch DCP's own save planner (``ci.dcp.Writer``): each
    tensor key's dtype and shape from DCP's ``Metadata`` ``md``, its chunks the rows ``w`` wrote for
    them (matched by key and offsets; every chunk written exactly once, nothing else written)."""
    row_of: Dict[Any, int] = {}
    for i in range(len(w)):
        if w.has_sizes[i]:
            row_of[(w.strings[w.key[i]], w.offsets_of(i))] = i
    keys, dtypes, shapes, chunk_items, starts = [], [], [], [], [0]
    for key in sorted(md.state_dict_metadata):
        meta = md.state_dict_metadata[key]
        if not hasattr(meta, "chunks"):  # (an object: a row without a box)
            continue
        for offsets in sorted(tuple(int(x) for x in c.offsets) for c in meta.chunks):
            i = row_of.pop((key, offsets), None)
            if i is None:
                raise CheckpointingException(f"internal error: chunk {offsets} of {key!r} was not written")
            chunk_items.append(i)
        keys.append(key)
        dtypes.append(dtype_name(meta.properties.dtype))
        shapes.append(tuple(int(x) for x in meta.size))
        starts.append(len(chunk_items))
    if row_of:
        raise CheckpointingException(f"internal error: chunks of {sorted({k for k, _ in row_of})[:5]} were written "
                                     "but the metadata does not list them")
    return CommitLayout(written=w, tensor_keys=keys, tensor_dtypes=dtypes, tensor_shapes=shapes,
                        chunk_items=np.asarray(chunk_items, dtype=np.int64), key_starts=np.asarray(starts, dtype=np.int64))


def _shapes(flat: np.ndarray, nds: np.ndarray) -> List[tuple]:
    """The shapes of ``nds`` dimensions each, one after another in ``flat``, as tuples (built column
    by column per distinct number of dimensions: 20,000 small tensors cost no Python step each)."""
    out: List[tuple] = [()] * len(nds)
    starts = np.cumsum(nds) - nds
    groups = np.unique(nds).tolist()
    for nd in groups:
        sel = np.flatnonzero(nds == nd) if len(groups) > 1 else np.arange(len(nds))
        shapes = list(zip(*(flat[starts[sel] + j].tolist() for j in range(nd)))) if nd else [()] * len(sel)
        if len(groups) == 1:
            return shapes
        for i, shape in zip(sel.tolist(), shapes):
            out[i] = shape
    return out


def _take(ints: np.ndarray, p: int, count: int, what: str):
    if count < 0 or p + count > len(ints):
        raise ValueError(f"its {what} are cut short")
    return ints[p : p + count], p + count


def _check_rows(strings: List[str], nfiles: int, key: np.ndarray, nd: np.ndarray, has_sizes: np.ndarray,
                has_fp: np.ndarray, file: np.ndarray, start: np.ndarray, length: np.ndarray, nblocks: np.ndarray,
                data_offset: np.ndarray, data_length: np.ndarray, block_size: np.ndarray, nb: int) -> None:
    """The rows' own checks, then the item columns' (``item_table.check_columns``, the same as a
    format-5 table's): what the derived item table may assume."""
    files = strings[:nfiles]
    if not all(map(operator.lt, files, files[1:])):  # (C loops: 3 ms for 131,072 names)
        raise ValueError("its data file names are not sorted, or a data file name is listed twice")
    if len(key) and (int(key.min()) < 0 or int(key.max()) >= len(strings)):
        raise ValueError("a row names a key the index does not list")
    if len(key) and (int(nd.min()) < -1 or bool(((has_sizes != 0) & (has_sizes != 1)).any())
                     or bool(((nd < 0) & (has_sizes != 0)).any())):
        raise ValueError("a row has an invalid number of dimensions")
    if bool(((has_fp != 0) & (has_fp != 1)).any()) or bool(((has_fp != 0) & (has_sizes == 0)).any()):
        raise ValueError("a row has an invalid fingerprint flag, or an object row has a fingerprint")
    check_columns(nfiles, file, start, nblocks, data_offset, data_length, block_size, nb, length=length)


def _check_chunks(chunk_rows: np.ndarray, tkey: np.ndarray, tnd: np.ndarray, tcount: np.ndarray, key: np.ndarray,
                  nd: np.ndarray, has_sizes: np.ndarray) -> None:
    """Every tensor row is exactly one chunk of its own key, with the key's dimensions."""
    n = len(key)
    if len(chunk_rows) and (int(chunk_rows.min()) < 0 or int(chunk_rows.max()) >= n):
        raise ValueError("a tensor key lists a chunk row the index does not hold")
    seen = np.bincount(chunk_rows, minlength=n) if n else np.zeros(0, dtype=np.int64)
    if bool((seen != (has_sizes != 0)).any()):
        raise ValueError("a stored chunk is listed by no tensor key, or twice")
    owner = np.repeat(np.arange(len(tkey)), tcount)
    if bool((key[chunk_rows] != tkey[owner]).any()) or bool((nd[chunk_rows] != tnd[owner]).any()):
        raise ValueError("a tensor key lists a chunk of another key or of other dimensions")


__all__ = ["INDEX_FILE", "INDEX_VERSION", "CheckpointIndex", "encode_index", "layout_of_metadata"]
