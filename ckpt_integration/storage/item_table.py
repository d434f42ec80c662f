"""The manifest's per-item table as binary columns (manifest formats 4 and 5), and a commit's
``BlockRecord`` of each tensor item (where its data lies, the digests of its blocks).

Formats 2 and 3 (read only by ``convert``, see below) kept, per stored item, a JSON entry ``"file@offset": digest`` (``items``) and,
per tensor item, ``"file@offset": [data_offset, data_length, block_size, "<base64 digests>"]``
(``blocks``). With tens of thousands of items every rank paid for them as text: rank 0 rendered
them at each commit, and at each load the coordinator parsed them (~0.8 us an item) and every
other rank parsed them again after the broadcast (20,000 small tensors: 2.6 MB, ~17 ms per
parse, and all ranks in sequence). Format 4 stores the same content as columns, sorted by file
and offset, base64-encoded in the manifest's ``tables`` field:

* a 36-byte header (:data:`_HEAD`, little-endian): magic ``CKIT``, table version (u32, 1),
  digest width in bytes (u32), the number of items, of block digests and the length of the
  column message (u64 each);
* the column message (:mod:`..planning.records` format: the data file names as its string table,
  then six integer columns of one entry per item - file id, offset, number of block digests
  (-1: no block record), data offset, data length, block size);
* the item digests, one per item, and then every item's block digests in item order, as
  little-endian unsigned integers of the digest width.

Decoding is a few numpy views: no Python step per item. A load's coordinator broadcasts the
decoded table's bytes as they are, so the other ranks neither parse text nor decode base64.
Lookups by ``(file, offset)`` are binary searches in a file's sorted offsets.

Manifest formats 1 to 3 (JSON item tables, written until 2026-11-27): read only to convert them.

A load refuses them with an error that names the command (:func:`refusal`). ``ckpt-integration
convert OLD NEW --to torch_dist`` opens one with ``legacy=True``: :func:`upgrade` turns its JSON
tables into the binary item table of the current format, in memory, so that the conversion
reads every byte through the one reader, checked against the digests the old save recorded,
and writes a checkpoint of the current format (fingerprints included). The old checkpoint is
not changed.

What the old formats record (``"<file>@<offset>"`` keys):

* format 1: ``items``, each stored item's whole-item CRC32;
* format 2: adds ``blocks``, per tensor item ``[data_offset, data_length, block_size, base64 of
  the little-endian CRC32s of its blocks]``, and the save token;
* format 3: the block digest named by ``block_hash`` (XXH3-64 for its saves; item digests follow it).

Items without a block record (format 1, objects) keep only their whole-item digest: the reader
checks those items whole, as it does for objects.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from ..planning.records import decode_array, difference_ints, encode_array, runs
from .checksum import CRC32, XXH3_64, BlockHash, block_hash

if TYPE_CHECKING:
    from ..planning.written import WrittenColumns

MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class BlockRecord:
    """Block digests of one tensor item: where its raw data lies in the item and the digests
    (of the algorithm ``hash``).

    Blocks, in item-relative bytes: ``[0, data_offset)`` (archive header), then the data in
    blocks of ``block_size`` (the last one shorter), then ``[data_offset + data_length,
    item_length)`` (archive trailer); empty blocks have no digest.
    """

    data_offset: int
    data_length: int
    block_size: int
    digests: Any  # numpy uint32 (CRC32) or uint64 (XXH3-64) array
    hash: BlockHash

    def bounds(self, item_length: int) -> np.ndarray:
        """Item-relative block boundaries (``len(digests) + 1`` of them); ValueError if inconsistent."""
        d, n, b = self.data_offset, self.data_length, self.block_size
        if d + n > item_length:
            raise ValueError(f"data [{d}, {d + n}) exceeds the item's {item_length} bytes")
        head = [0] if d > 0 else []
        tail = [d + n] if d + n < item_length else []
        out = np.concatenate([np.array(head, dtype=np.int64), np.arange(d, d + n, b, dtype=np.int64),
                              np.array(tail + [item_length], dtype=np.int64)])
        if len(out) != len(self.digests) + 1:
            raise ValueError(f"{len(self.digests)} block checksums recorded for {len(out) - 1} blocks")
        return out


MAGIC = b"CKIT"
TABLE_VERSION = 1
_HEAD = struct.Struct("<4sIIQQQ")  # magic, version, digest width, items, block digests, message bytes
_COLUMNS = 6  # file id, offset, block digest count (-1: none), data offset, data length, block size

Rid = Tuple[str, int]
Digests = Tuple[int, int, int, Tuple[int, ...]]


def encode_table(files: Sequence[str], file: np.ndarray, offset: np.ndarray, digest: np.ndarray, nblocks: np.ndarray,
                 data_offset: np.ndarray, data_length: np.ndarray, block_size: np.ndarray, block_pos: np.ndarray,
                 block_digests: np.ndarray, h: BlockHash) -> bytes:
    """The table's bytes for items given as columns (``file``: ids into ``files``; ``block_pos``:
    where each item's ``nblocks`` digests start in ``block_digests``), in any order: sorted here
    by file name and offset."""
    used = np.unique(np.asarray(file, dtype=np.int64)).tolist()
    names = sorted(set(files[i] for i in used))
    rank_of = {n: i for i, n in enumerate(names)}
    fid = np.full(len(files), -1, dtype=np.int64)  # (``files`` may hold other strings: keys, dtypes)
    for i in used:
        fid[i] = rank_of[files[i]]
    file = fid[np.asarray(file, dtype=np.int64)] if len(file) else np.zeros(0, dtype=np.int64)
    offset = np.asarray(offset, dtype=np.int64)
    order = np.lexsort((offset, file))
    nb = np.asarray(nblocks, dtype=np.int64)[order]
    counts = np.maximum(nb, 0)
    gather = runs(np.asarray(block_pos, dtype=np.int64)[order], counts)  # each item's digests, in the new order
    total = len(gather)
    width = h.width
    cols = np.concatenate([file[order], offset[order], nb, np.asarray(data_offset, dtype=np.int64)[order],
                           np.asarray(data_length, dtype=np.int64)[order], np.asarray(block_size, dtype=np.int64)[order]])
    msg = encode_array(names, cols)
    dt = f"<u{width}"
    return (_HEAD.pack(MAGIC, TABLE_VERSION, width, len(order), total, len(msg)) + msg
            + np.asarray(digest, dtype=np.uint64)[order].astype(dt).tobytes()
            + np.asarray(block_digests, dtype=np.uint64)[gather].astype(dt).tobytes())


def empty_table(h: BlockHash) -> bytes:
    """The bytes of a table without items."""
    z = np.zeros(0, dtype=np.int64)
    return encode_table([], z, z, z.astype(np.uint64), z, z, z, z, z, z.astype(np.uint64), h)


def encode_text(raw: bytes) -> str:
    """The ``tables`` field's text for a table's bytes."""
    return base64.b64encode(raw).decode("ascii")


def file_sizes(w: "WrittenColumns") -> Dict[str, Dict[str, int]]:
    """``{file: {"size": end of its last item}}`` for the data files of a commit's items."""
    if not len(w):
        return {}
    order = np.argsort(w.file, kind="stable")
    f = w.file[order]
    starts = np.flatnonzero(np.r_[True, f[1:] != f[:-1]])
    ends = np.maximum.reduceat((w.start + w.length)[order], starts)
    return {w.strings[k]: {"size": e} for k, e in zip(f[starts].tolist(), ends.tolist())}


def table_of_written(w: "WrittenColumns", h: BlockHash) -> str:
    """The manifest's ``tables`` field for a commit's items (their block digests are ``h``'s):
    JSON text of the base64 of their table (written into the manifest as it is, see
    :func:`~.checkpoint_dir.write_manifest`; base64 needs no escaping in JSON)."""
    raw = encode_table(w.strings, w.file, w.start, w.digest, w.nblocks, w.data_offset, w.data_length, w.block_size,
                       w.block_pos, w.block_digests, h)
    return '"' + encode_text(raw) + '"'


class ItemTable:
    """A decoded table: columns sorted by file and offset, lookups by ``(file, offset)``.

    ``raw`` is the table's bytes (what a load's broadcast sends). Every structural problem
    (lengths, magic, ids out of range, unsorted or repeated offsets, a block record whose counts
    do not add up) raises :class:`CorruptCheckpointError` naming ``where``.
    """

    def __init__(self, raw: bytes, h: BlockHash, where: str = MANIFEST_FILE, wire: bool = False):
        self.raw, self.hash, self.where = raw, h, where
        # (bytes of :meth:`for_wire`: the item digests that the block digests determine are zeros,
        # the integer columns first differences)
        self.wire = wire
        try:
            self._decode(raw, h)
        except ValueError as e:
            raise CorruptCheckpointError(f"{where} is damaged: its item table: {e}") from None

    @classmethod
    def of_columns(cls, files: List[str], file: np.ndarray, offset: np.ndarray, digest: np.ndarray, nblocks: np.ndarray,
                   data_offset: np.ndarray, data_length: np.ndarray, block_size: np.ndarray, block_digests: np.ndarray,
                   h: BlockHash, where: str, derived: bool = False) -> "ItemTable":
        """A table over columns checked already and sorted by file and offset, ``file`` numbering
        ``files`` in name order (a format-6 index's rows): nothing encoded or decoded. ``derived``:
        the item digests of items with block digests are not given (XXH3-64 of those, derived when
        asked, as in a table that travelled :meth:`for_wire`). It has no bytes (format 6 broadcasts
        its index instead)."""
        self = cls.__new__(cls)
        self.raw, self.hash, self.where, self.wire = b"", h, where, derived
        self.files = files
        self.file, self.offset, self.nblocks = file, offset, nblocks
        self.data_offset, self.data_length, self.block_size = data_offset, data_length, block_size
        self.digest, self.block_digests = digest, block_digests
        counts = np.maximum(nblocks, 0)
        self.block_pos = np.cumsum(counts) - counts
        try:
            self._rows = _rows_by_name(files, file)
        except ValueError as e:
            raise CorruptCheckpointError(f"{where} is damaged: {e}") from None
        return self

    def _decode(self, raw: bytes, h: BlockHash) -> None:
        _, _, width, n, nb, nmsg = read_head(raw, _HEAD, MAGIC, TABLE_VERSION, "table", h)
        if self.wire and h.name != XXH3_64:  # (only XXH3-64 item digests follow from the block digests alone)
            raise ValueError(f"a table without its item digests must have XXH3-64 digests, not {h.label}")
        end = _HEAD.size + nmsg
        if len(raw) != end + (n + nb) * width:
            raise ValueError(f"{len(raw)} bytes where its header describes {end + (n + nb) * width}")
        msg = raw[_HEAD.size : end]
        if self.wire:
            msg = bytearray(msg)
            difference_ints(msg, undo=True)
        self.files, ints = decode_array(msg)
        if len(ints) != _COLUMNS * n:
            raise ValueError(f"{len(ints)} column entries for {n} items")
        cols = ints.reshape(_COLUMNS, n)
        self.file, self.offset, self.nblocks, self.data_offset, self.data_length, self.block_size = cols
        dt = f"<u{width}"
        self.digest = np.frombuffer(raw, dtype=dt, count=n, offset=end)
        self.block_digests = np.frombuffer(raw, dtype=dt, count=nb, offset=end + n * width)
        nf = len(self.files)
        check_columns(nf, self.file, self.offset, self.nblocks, self.data_offset, self.data_length, self.block_size, nb)
        counts = np.maximum(self.nblocks, 0)
        self.block_pos = np.cumsum(counts) - counts
        self._rows = _rows_by_name(self.files, self.file)

    def __len__(self) -> int:
        return len(self.offset)

    def count_in(self, name: str) -> int:
        """How many items the data file ``name`` holds (0 for a file the table does not list)."""
        first, end = self._rows.get(name, (0, 0))
        return end - first

    def row(self, rid: Rid) -> int:
        """The row of item ``(file, offset)``, or -1."""
        span = self._rows.get(rid[0]) if isinstance(rid, tuple) and len(rid) == 2 else None
        if span is None or not isinstance(rid[1], (int, np.integer)):
            return -1
        lo, hi = span
        i = lo + int(np.searchsorted(self.offset[lo:hi], rid[1]))
        return i if i < hi and int(self.offset[i]) == rid[1] else -1

    def rows(self, rids: Sequence[Rid]) -> np.ndarray:
        """:meth:`row` of many items at once (a binary search per file, not per item)."""
        out = np.full(len(rids), -1, dtype=np.int64)
        if not len(rids):
            return out
        by_file: Dict[str, List[int]] = {}
        for j, (f, _) in enumerate(rids):
            by_file.setdefault(f, []).append(j)
        for f, js in by_file.items():
            span = self._rows.get(f)
            if span is None:
                continue
            lo, hi = span
            want = np.asarray([rids[j][1] for j in js], dtype=np.int64)
            pos = lo + np.searchsorted(self.offset[lo:hi], want)
            ok = pos < hi
            ok[ok] = self.offset[pos[ok]] == want[ok]
            out[np.asarray(js, dtype=np.int64)[ok]] = pos[ok]
        return out

    def rid(self, i: int) -> Rid:
        return self.files[int(self.file[i])], int(self.offset[i])

    def block_digests_of(self, i: int) -> np.ndarray:
        p = int(self.block_pos[i])
        return self.block_digests[p : p + int(self.nblocks[i])]

    def item_digest(self, i: int) -> int:
        """The digest of item ``i`` (in a table that travelled :meth:`for_wire`, derived from its
        block digests where those determine it)."""
        if self.wire and self.nblocks[i] >= 0:
            return self.hash.item_digest(self.block_digests_of(i).tolist(), ())  # (XXH3-64 needs no lengths)
        return int(self.digest[i])

    def digests(self) -> np.ndarray:
        """Every item's digest (:meth:`item_digest`), as a column."""
        if not self.wire:
            return self.digest
        return np.fromiter((self.item_digest(i) for i in range(len(self))), dtype=np.uint64, count=len(self))

    def for_wire(self) -> Tuple[bytes, bool]:
        """The table's bytes for a load's broadcast between nodes, and whether they are its wire
        form (``ItemTable(raw, h, where, wire=True)`` reads it), made for zlib:

        * with XXH3-64, the digest of an item that has block digests is XXH3-64 of those,
          concatenated (``checksum._xxh3_item``; ``verify`` checks that it is): such digests travel
          as zeros. They are random bytes that nothing compresses, 1.6 of a 9.5 MiB broadcast at
          65,536 ranks, and a load never uses them (it checks such an item by its blocks); a reader
          that asks derives them (:meth:`item_digest`);
        * the integer columns travel as first differences (sorted offsets, repeated sizes: 0.34 ->
          0.15 MiB compressed at 65,536 ranks), undone on arrival.

        With CRC32 the item digests need each block's length: such a table is sent as it is."""
        if self.hash.name != XXH3_64 or self.wire:
            return self.raw, self.wire
        out = bytearray(self.raw)
        n, width = len(self), self.hash.width
        start = len(out) - (n + len(self.block_digests)) * width
        kept = np.where(self.nblocks >= 0, np.uint64(0), self.digest).astype(f"<u{width}")
        out[start : start + n * width] = kept.tobytes()
        difference_ints(memoryview(out)[_HEAD.size : start])
        return bytes(out), True

    def without_files(self, names: Iterable[str]) -> bytes:
        """The bytes of this table without the items of the data files ``names`` (a tool that
        deletes data files rewrites the manifest with it)."""
        gone = {self.files.index(n) for n in names if n in self._rows}
        keep = ~np.isin(self.file, np.asarray(sorted(gone), dtype=np.int64))
        return encode_table(self.files, self.file[keep], self.offset[keep], self.digests()[keep], self.nblocks[keep],
                            self.data_offset[keep], self.data_length[keep], self.block_size[keep],
                            self.block_pos[keep], self.block_digests, self.hash)


def _rows_by_name(files: List[str], file: np.ndarray) -> Dict[str, Tuple[int, int]]:
    """File name -> ``[first row, end row)`` of its items (rows sorted by file id); ValueError when a
    name is listed twice (its items would be looked up in one of them only)."""
    bounds = np.searchsorted(file, np.arange(len(files) + 1)).tolist()  # (Python ints: one conversion, not two per file)
    rows = dict(zip(files, zip(bounds, bounds[1:])))
    if len(rows) != len(files):
        raise ValueError("a data file name is listed twice")
    return rows


def check_columns(nfiles: int, file: np.ndarray, offset: np.ndarray, nblocks: np.ndarray, data_offset: np.ndarray,
                  data_length: np.ndarray, block_size: np.ndarray, nb: int, length: Optional[np.ndarray] = None) -> None:
    """The one structural check of stored items' columns, rows in storage order (an item table's and
    a checkpoint index's): ValueError naming the problem. Files are ids below ``nfiles``; offsets
    strictly increase within a file (with ``length``: items do not overlap); a block record
    (``nblocks >= 0``) has a data range inside its item (with ``length``) and a positive block size;
    the block digest counts add up to ``nb``. What a read derives from these (block bounds, the
    item a ``(file, offset)`` names) then cannot fail or mislead on a consistently rewritten file."""
    n = len(file)
    if n and (int(file.min()) < 0 or int(file.max()) >= nfiles):
        raise ValueError("an item names a file the table does not list")
    if n and int(offset.min()) < 0:
        raise ValueError("an item has a negative offset")
    if length is not None and n and int(length.min()) < 0:
        raise ValueError("an item has a negative length")
    if n > 1:
        same = np.diff(file) == 0
        ends = offset[:-1] + (length[:-1] if length is not None else 1)
        if bool((np.diff(file) < 0).any()) or bool((same & (ends > offset[1:])).any()):
            raise ValueError("items are not sorted by file and offset (storage order), or one is listed twice or overlaps another")
    if bool((nblocks < -1).any()):
        raise ValueError("an item has a negative number of block digests")
    has = nblocks >= 0
    if bool((has & ((data_offset < 0) | (data_length < 0) | (block_size <= 0))).any()):
        raise ValueError("a block record has a negative data range or a block size that is not positive")
    if length is not None and bool((has & (data_offset + data_length > length)).any()):
        raise ValueError("a block record's data range exceeds its item")
    counts = np.maximum(nblocks, 0)
    if int(counts.sum()) != nb:
        raise ValueError(f"the items list {int(counts.sum())} block digests, the table holds {nb}")


def read_head(raw: bytes, head: struct.Struct, magic: bytes, version: int, what: str, h: BlockHash) -> tuple:
    """The fields of a binary table's header that starts with its magic, version and digest width
    (this table's, ``checkpoint_index``'s), checked against ``h``: ValueError naming the problem."""
    if len(raw) < head.size:
        raise ValueError(f"{len(raw)} bytes, shorter than its header")
    fields = head.unpack_from(raw, 0)
    if fields[0] != magic:
        raise ValueError(f"bad magic (not a {what})")
    if fields[1] != version:
        raise ValueError(f"{what} version {fields[1]} (this version of ckpt_integration reads {version})")
    if fields[2] != h.width:
        raise ValueError(f"{fields[2]}-byte digests, but {h.label} digests have {h.width} bytes")
    return fields


def decode_text(text: object, h: BlockHash, where: str = MANIFEST_FILE) -> ItemTable:
    """The table of a manifest's ``tables`` field (base64 text; ``""``: no items, as in the
    manifest of a zarr checkpoint, whose chunks ``zarr_index.json`` records)."""
    if not isinstance(text, str):
        raise CorruptCheckpointError(f"{where} is damaged: 'tables' must be a string, got {type(text).__name__}")
    if not text:
        return ItemTable(empty_table(h), h, where)
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, binascii.Error, UnicodeEncodeError) as e:
        raise CorruptCheckpointError(f"{where} is damaged: its item table is not valid base64: {e}") from None
    return ItemTable(raw, h, where)


class TableItemDigests(Mapping):
    """``(file, offset) -> item digest`` over an :class:`ItemTable` (what ``Manifest.checksums``
    gives)."""

    def __init__(self, table: ItemTable):
        self._t = table

    def __getitem__(self, rid: Rid) -> int:
        i = self._t.row(rid)
        if i < 0:
            raise KeyError(rid)
        return self._t.item_digest(i)

    def __contains__(self, rid: object) -> bool:
        return self._t.row(rid) >= 0  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Rid]:
        t = self._t
        return iter(zip([t.files[f] for f in t.file.tolist()], t.offset.tolist()))

    def __len__(self) -> int:
        return len(self._t)


class TableBlockRecords(Mapping):
    """``(file, offset) -> BlockRecord`` of the items with block digests, over an
    :class:`ItemTable` (``digests_of`` one item, ``digests_many`` a run of them)."""

    def __init__(self, table: ItemTable):
        self._t = table
        self._parsed: Dict[Rid, BlockRecord] = {}

    @property
    def hash(self) -> BlockHash:
        return self._t.hash

    def _row(self, rid: Rid) -> int:
        i = self._t.row(rid)
        return i if i >= 0 and self._t.nblocks[i] >= 0 else -1

    def __getitem__(self, rid: Rid) -> BlockRecord:
        rec = self._parsed.get(rid)
        if rec is None:
            i = self._row(rid)
            if i < 0:
                raise KeyError(rid)
            t = self._t
            rec = self._parsed[rid] = BlockRecord(int(t.data_offset[i]), int(t.data_length[i]), int(t.block_size[i]),
                                                  t.block_digests_of(i), t.hash)
        return rec

    def digests_of(self, rid: Rid) -> Optional[Digests]:
        """``(data_offset, data_length, block_size, digests as ints)`` of one item, or None."""
        i = self._row(rid)
        if i < 0:
            return None
        t = self._t
        return int(t.data_offset[i]), int(t.data_length[i]), int(t.block_size[i]), tuple(t.block_digests_of(i).tolist())

    def digests_many(self, rids: Sequence[Rid]) -> List[Optional[Digests]]:
        """:meth:`digests_of` for many items: the rows found by one search per file, the fields
        converted to Python integers a column at a time."""
        t = self._t
        rows = t.rows(rids)
        found = rows >= 0
        found[found] = t.nblocks[rows[found]] >= 0
        out: List[Optional[Digests]] = [None] * len(rids)
        sel = rows[found]
        if not len(sel):
            return out
        counts = t.nblocks[sel]
        flat = t.block_digests[runs(t.block_pos[sel], counts)].tolist()
        pos = 0
        for j, d, n, b, c in zip(np.flatnonzero(found).tolist(), t.data_offset[sel].tolist(), t.data_length[sel].tolist(),
                                 t.block_size[sel].tolist(), counts.tolist()):
            out[j] = (d, n, b, tuple(flat[pos : pos + c]))
            pos += c
        return out

    def __contains__(self, rid: object) -> bool:
        return self._row(rid) >= 0  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Rid]:
        t = self._t
        has = np.flatnonzero(t.nblocks >= 0)
        return iter(zip([t.files[f] for f in t.file[has].tolist()], t.offset[has].tolist()))

    def __len__(self) -> int:
        return int((self._t.nblocks >= 0).sum())



# --------------------------------------------------------------------------- formats 1 to 3: converted, never loaded

LEGACY_VERSIONS = (1, 2, 3)


def refusal(directory: str, path: str, version: int, readable: Iterable[int]) -> UnsupportedCheckpointError:
    """The error a load of the checkpoint ``directory`` raises, whose manifest ``path`` has format ``version``."""
    return UnsupportedCheckpointError(
        f"{path} has manifest format {version}, written by a version of ckpt_integration from before "
        f"2026-11-27; this version loads formats {list(readable)}. Convert it once (it is read and verified, "
        f"and left unchanged): ckpt-integration convert {directory} NEW_DIR --to torch_dist"
    )


def _item(key: object) -> tuple:
    if not isinstance(key, str) or "@" not in key:
        raise ValueError(f"table key {str(key)[:80]!r} is not '<file>@<offset>'")
    name, _, off = key.rpartition("@")
    if not off.isdigit():
        raise ValueError(f"table key {key[:80]!r} has no integer offset")
    return name, int(off)


def _digest(v: object, h: BlockHash, key: str) -> int:
    if type(v) is not int or not 0 <= v < 1 << (8 * h.width):
        raise ValueError(f"item {key[:80]!r} has no {h.label} digest: {str(v)[:40]}")
    return v


def upgrade(raw: Dict[str, Any], to_version: int) -> Dict[str, Any]:
    """The fields of a current-format manifest recording what the format 1-3 manifest ``raw`` records
    (its tables as the binary item table, no fingerprints); ValueError / TypeError where ``raw``
    is not a manifest of its format."""
    version = raw.get("version")
    out = {k: v for k, v in raw.items() if k not in ("items", "blocks", "block_hash")}
    if "tables" in raw or "fingerprints" in raw:
        raise TypeError(f"format {version} has no 'tables' or 'fingerprints' (format 4 and 5 fields)")
    if version < 3 and "block_hash" in raw:
        raise TypeError(f"format {version} has CRC32 block checksums and no 'block_hash'")
    if version == 3 and "block_hash" not in raw:
        raise TypeError("format 3 names its block checksum algorithm ('block_hash'), this one does not")
    h = block_hash(raw.get("block_hash", CRC32), "manifest.json")
    items, blocks = raw.get("items", {}), raw.get("blocks", {})
    if not isinstance(items, dict) or not isinstance(blocks, dict) or (version == 1 and blocks):
        raise TypeError(f"format {version}: 'items' and 'blocks' must be objects (format 1 has no 'blocks')")
    names: List[str] = []
    name_id: Dict[str, int] = {}
    row: Dict[tuple, int] = {}
    cols: List[List[int]] = [[] for _ in range(6)]  # file id, offset, digest, data offset, data length, block size
    for key, digest in items.items():
        name, off = _item(key)
        fid = name_id.setdefault(name, len(names))
        if fid == len(names):
            names.append(name)
        if (name, off) in row:
            raise ValueError(f"item {name}@{off} is listed twice")
        row[(name, off)] = len(cols[0])
        for c, v in zip(cols, (fid, off, _digest(digest, h, key), -1, 0, 0)):  # (as a commit records no block record)
            c.append(v)
    nblocks = [-1] * len(cols[0])
    block_pos = [0] * len(cols[0])
    packed: List[np.ndarray] = []
    pos = 0
    for key, rec in blocks.items():
        i = row.get(_item(key))
        if i is None:
            raise ValueError(f"block record {key[:80]!r} is of no item in 'items'")
        if not (type(rec) is list and len(rec) == 4 and all(type(v) is int for v in rec[:3]) and isinstance(rec[3], str)):
            raise ValueError(f"block record {key[:80]!r} is not [data_offset, data_length, block_size, digests]")
        d, n, b, text = rec
        if d < 0 or n < 0 or b <= 0:
            raise ValueError(f"block record {key[:80]!r} has a negative range or block size")
        digests = h.unpack(text)
        cols[3][i], cols[4][i], cols[5][i] = d, n, b
        nblocks[i], block_pos[i] = len(digests), pos
        packed.append(digests.astype(np.uint64))
        pos += len(digests)
    ints = [np.asarray(c, dtype=np.uint64 if j == 2 else np.int64) for j, c in enumerate(cols)]
    table = encode_table(names, ints[0], ints[1], ints[2], np.asarray(nblocks, dtype=np.int64),
                         ints[3], ints[4], ints[5], np.asarray(block_pos, dtype=np.int64),
                         np.concatenate(packed) if packed else np.zeros(0, dtype=np.uint64), h)
    out.update(version=to_version, block_hash=h.name, tables=encode_text(table), fingerprints="")
    return out


__all__ = ["LEGACY_VERSIONS", "MANIFEST_FILE", "BlockRecord", "ItemTable", "TableBlockRecords", "TableItemDigests",
           "check_columns", "decode_text", "encode_table", "encode_text", "file_sizes", "refusal", "table_of_written", "upgrade"]
