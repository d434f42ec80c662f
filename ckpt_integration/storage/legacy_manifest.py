"""Manifest formats 1 to 3 (JSON item tables, written until 2026-11-27): read only to convert them.

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

from typing import Any, Dict, Iterable, List

import numpy as np

from ..errors import UnsupportedCheckpointError
from .checksum import CRC32, BlockHash, block_hash
from .item_table import encode_table, encode_text

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


__all__ = ["LEGACY_VERSIONS", "refusal", "upgrade"]
