"""A manifest's per-item tables: block records (where each tensor item's data lies and the
digests of its blocks) and item digests.

Decoded on first use (:class:`BlockRecordTable`, :class:`ItemDigestTable`): a manifest has one
entry per stored item, a load uses those of the items it reads.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import CorruptCheckpointError
from .checksum import BlockHash

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

    @staticmethod
    def parse(v: Any, h: BlockHash) -> "BlockRecord":
        d, n, b, text = _fields(v)
        return BlockRecord(d, n, b, h.unpack(text), h)

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


def item_id(key: str) -> Tuple[str, int]:
    """``(file, offset)`` of a manifest table key ``"<file>@<offset>"``; ValueError if the offset is
    not an integer."""
    name, _, off = key.rpartition("@")
    return name, int(off)


def _fields(v: Any) -> Tuple[int, int, int, str]:
    """``(data_offset, data_length, block_size, digests text)`` of a raw block record; ValueError
    when it does not have that form and those bounds."""
    if not (type(v) is list and len(v) == 4 and type(v[0]) is int and type(v[1]) is int and type(v[2]) is int):
        raise ValueError(f"a block record must be [data_offset, data_length, block_size, digests], got {str(v)[:80]}")
    d, n, b, text = v
    if d < 0 or n < 0 or b <= 0 or not isinstance(text, str):
        raise ValueError(f"invalid block record {str(v)[:80]}")
    return d, n, b, text


class BlockRecordTable(Mapping):
    """``(file, offset) -> BlockRecord`` over a manifest's ``blocks`` table: the entries' form is
    checked when the table is made (cheap), each record decoded on first use (its base64 digests
    and arrays: with tens of thousands of small tensors, decoding every record costs more than
    a load that reads a few of them). A record found malformed then raises
    :class:`CorruptCheckpointError` naming the manifest.

    ``checked=True`` (what a manifest's table is): nothing is done per entry until it is used; a
    record is found by its key as the writer spells it (``file@offset``), its form checked when it
    is decoded, and the index of every entry (checking every key and record) is built only when
    that finds nothing (an item without block record, or a key spelled otherwise) or the table is
    iterated.
    """

    def __init__(self, blocks: Dict[str, Any], h: BlockHash, checked: bool = False):
        self._raw, self._hash = blocks, h
        self._parsed: Dict[Tuple[str, int], BlockRecord] = {}
        self._keys: Optional[Dict[Tuple[str, int], str]] = None
        if not checked:
            self._index()

    def _index(self) -> Dict[Tuple[str, int], str]:
        keys = self._keys
        if keys is None:
            keys = {}
            try:
                for k, v in self._raw.items():
                    rid = item_id(k)
                    if not (isinstance(v, list) and len(v) == 4 and type(v[0]) is int and type(v[1]) is int
                            and type(v[2]) is int and isinstance(v[3], str)):
                        raise ValueError(f"a block record must be [data_offset, data_length, block_size, digests], "
                                         f"got {str(v)[:80]}")
                    keys[rid] = k
            except ValueError as e:
                raise CorruptCheckpointError(f"{MANIFEST_FILE} is damaged: {e}") from None
            self._keys = keys
        return keys

    def _key(self, rid: Tuple[str, int]) -> Optional[str]:
        if self._keys is None:
            k = f"{rid[0]}@{rid[1]}"
            if k in self._raw:
                return k
        return self._index().get(rid)

    def __getitem__(self, rid: Tuple[str, int]) -> "BlockRecord":
        rec = self._parsed.get(rid)
        if rec is None:
            k = self._key(rid)
            if k is None:
                raise KeyError(rid)
            try:
                rec = BlockRecord.parse(self._raw[k], self._hash)
            except ValueError as e:
                raise CorruptCheckpointError(f"{MANIFEST_FILE} is damaged: block record of {rid[0]}@{rid[1]}: {e}") from None
            self._parsed[rid] = rec
        return rec

    def digests_of(self, rid: Tuple[str, int]) -> Optional[Tuple[int, int, int, Tuple[int, ...]]]:
        """``(data_offset, data_length, block_size, digests as ints)`` of one item, or None without a
        record: what a read of many small items needs, decoded straight to Python integers (no
        :class:`BlockRecord` and no numpy array per item). Malformed: :class:`CorruptCheckpointError`."""
        k = self._key(rid)
        if k is None:
            return None
        try:
            d, n, b, text = _fields(self._raw[k])
            return d, n, b, self._hash.unpack_ints(text)
        except ValueError as e:
            raise CorruptCheckpointError(f"{MANIFEST_FILE} is damaged: block record of {rid[0]}@{rid[1]}: {e}") from None

    def digests_many(self, rids: Sequence[Tuple[str, int]]) -> List[Optional[Tuple[int, int, int, Tuple[int, ...]]]]:
        """:meth:`digests_of` for many items at once (what a read of many small items needs):
        the digest texts of one length are joined and decoded together (one base64 decode and one
        ``struct.unpack``, not one per item). Same results and errors as item by item."""
        out: List[Optional[Tuple[int, int, int, Tuple[int, ...]]]] = [None] * len(rids)
        raw = self._raw
        # the records as the writer spells their keys, looked up in one pass (``_key`` for the rest)
        fields: List[Any] = [raw.get(f"{f}@{o}") for f, o in rids] if self._keys is None else [None] * len(rids)
        by_len: Dict[int, List[int]] = {}
        for j, v in enumerate(fields):
            if v is None:
                k = self._key(rids[j])
                if k is None:
                    continue
                v = fields[j] = raw[k]
            # (``_fields``'s form and bounds, inline: once per small item)
            if type(v) is list and len(v) == 4 and type(v[0]) is int and type(v[1]) is int and type(v[2]) is int \
                    and v[0] >= 0 and v[1] >= 0 and v[2] > 0 and isinstance(v[3], str):
                text = v[3]
                if len(text) % 4 == 0 and not text.endswith("="):  # joins with others into valid base64
                    by_len.setdefault(len(text), []).append(j)
                    continue
            out[j] = self.digests_of(rids[j])  # (raises naming a malformed record; decodes odd text alone)
        w, code = self._hash.width, "Q" if self._hash.width == 8 else "I"
        for length, js in by_len.items():
            per = length // 4 * 3 // w if length // 4 * 3 % w == 0 else 0
            try:
                ints = struct.unpack(f"<{per * len(js)}{code}", base64.b64decode("".join(fields[j][3] for j in js), validate=True)) if per else None
            except (ValueError, struct.error):
                ints = None
            if ints is None:  # some text is malformed: find and name it
                for j in js:
                    out[j] = self.digests_of(rids[j])
                continue
            for i, j in enumerate(js):
                d, n, b, _ = fields[j]
                out[j] = (d, n, b, ints[i * per : (i + 1) * per])
        return out

    @property
    def hash(self) -> BlockHash:
        return self._hash

    def __contains__(self, rid: object) -> bool:
        return isinstance(rid, tuple) and len(rid) == 2 and self._key(rid) is not None  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Tuple[str, int]]:
        return iter(self._index())

    def __len__(self) -> int:
        return len(self._raw) if self._keys is None else len(self._keys)


class ItemDigestTable(Mapping):
    """``(file, offset) -> item digest`` over a manifest's ``items`` table, each entry checked and
    converted when it is used (a load needs the entries of the chunks it reads; converting every
    entry of every rank up front cost ~1.2 us each on every rank, 25 ms for 20,000 small tensors).

    An entry is found by its key as the writer spells it (``file@offset``); the index of every
    entry (each key and digest checked) is built only when that finds nothing or the table is
    iterated. A malformed entry raises :class:`CorruptCheckpointError` naming the manifest.
    """

    def __init__(self, items: Dict[str, Any]):
        self._raw = items
        self._index: Optional[Dict[Tuple[str, int], int]] = None

    def _full(self) -> Dict[Tuple[str, int], int]:
        if self._index is None:
            out = {}
            try:
                for k, v in self._raw.items():
                    out[item_id(k)] = int(v)
            except (TypeError, ValueError) as e:
                raise CorruptCheckpointError(f"{MANIFEST_FILE} is damaged: an item digest entry: {e}") from None
            self._index = out
        return self._index

    def __getitem__(self, rid: Tuple[str, int]) -> int:
        if self._index is None:
            v = self._raw.get(f"{rid[0]}@{rid[1]}")
            if v is not None:
                try:
                    return int(v)
                except (TypeError, ValueError) as e:
                    raise CorruptCheckpointError(f"{MANIFEST_FILE} is damaged: item digest of {rid[0]}@{rid[1]}: {e}") from None
        return self._full()[rid]

    def __iter__(self) -> Iterator[Tuple[str, int]]:
        return iter(self._full())

    def __len__(self) -> int:
        return len(self._raw) if self._index is None else len(self._index)
