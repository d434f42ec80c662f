"""The per-item tables of ``manifest.json`` made from a commit's arrays (storage layer): the
binary table of format 4 (:func:`table_of_written`, see :mod:`.item_table`), or, for formats 2
and 3, JSON text.

A commit records for every stored item its whole-item checksum (``items``) and, for tensor
items, its block checksums (``blocks``: data offset, data length, block size and the base64 of
the little-endian checksums), keyed ``"<file>@<offset>"``. With tens of thousands of items the
generic route (a dict entry and a list per item, then ``json.dumps``) took most of a second at
rank 0; here the text of each table is produced directly, one short string per item, and
spliced into the manifest by :func:`~.checkpoint_dir.write_manifest`. The JSON is the same as
``json.dumps`` of the equivalent dicts (readers parse it as before).
"""

from __future__ import annotations

import base64
import json
from typing import Dict, List, Tuple

import numpy as np

from ..planning.written import WrittenColumns
from .checksum import BlockHash
from .item_table import encode_table, encode_text


def file_sizes(w: WrittenColumns) -> Dict[str, Dict[str, int]]:
    """``{file: {"size": end of its last item}}`` for the data files of the items."""
    if not len(w):
        return {}
    order = np.argsort(w.file, kind="stable")
    f = w.file[order]
    starts = np.flatnonzero(np.r_[True, f[1:] != f[:-1]])
    ends = np.maximum.reduceat((w.start + w.length)[order], starts)
    return {w.strings[k]: {"size": e} for k, e in zip(f[starts].tolist(), ends.tolist())}


def _item_names(w: WrittenColumns) -> List[str]:
    """The quoted JSON key ``"<file>@<offset>`` (without the closing quote) of each item."""
    quoted = {}
    for k in np.unique(w.file).tolist():
        quoted[k] = json.dumps(w.strings[k])[:-1] + "@"
    return [quoted[f] + str(s) for f, s in zip(w.file.tolist(), w.start.tolist())]


def render_tables(w: WrittenColumns, block_hash: BlockHash) -> Tuple[str, str]:
    """JSON text of the manifest's ``items`` and ``blocks`` objects for the items of ``w``, whose
    block digests are ``block_hash``'s (stored as :meth:`~.checksum.BlockHash.pack` stores them)."""
    if not len(w):
        return "{}", "{}"
    names = _item_names(w)
    items = "{" + ", ".join(f'{n}": {d}' for n, d in zip(names, w.digest.tolist())) + "}"
    has = np.flatnonzero(w.nblocks >= 0)
    packed = _pack_rows(w, has, f"<u{block_hash.width}")
    heads = zip(w.data_offset[has].tolist(), w.data_length[has].tolist(), w.block_size[has].tolist())
    blocks = "{" + ", ".join(
        f'{names[i]}": [{d}, {n}, {b}, "{p}"]' for i, (d, n, b), p in zip(has.tolist(), heads, packed)
    ) + "}"
    return items, blocks


def _pack_rows(w: WrittenColumns, rows: np.ndarray, digest_dtype: str) -> List[str]:
    """base64 of each item's block checksums (stored as ``digest_dtype``)."""
    out: List[str] = [""] * len(rows)
    nb = w.nblocks[rows]
    width = np.dtype(digest_dtype).itemsize
    for n in np.unique(nb).tolist():
        at = np.flatnonzero(nb == n)
        if n == 0:
            continue
        pos = w.block_pos[rows[at]]
        grid = w.block_digests[pos[:, None] + np.arange(n)[None, :]].astype(digest_dtype)
        raw = grid.tobytes()
        row_bytes = n * width
        if row_bytes % 3 == 0:  # base64 of the concatenation splits at row boundaries
            text = base64.b64encode(raw).decode("ascii")
            step = row_bytes // 3 * 4
            parts = [text[i : i + step] for i in range(0, len(text), step)]
        else:
            parts = [base64.b64encode(raw[i : i + row_bytes]).decode("ascii") for i in range(0, len(raw), row_bytes)]
        for j, p in zip(at.tolist(), parts):
            out[j] = p
    return out


def table_of_written(w: WrittenColumns, block_hash: BlockHash) -> str:
    """The ``tables`` field (format 4) of the items of ``w``: JSON text of the base64 of their
    binary table (base64 needs no escaping in JSON)."""
    raw = encode_table(w.strings, w.file, w.start, w.digest, w.nblocks, w.data_offset, w.data_length, w.block_size,
                       w.block_pos, w.block_digests, block_hash)
    return '"' + encode_text(raw) + '"'


def rendered_tables(w: WrittenColumns, block_hash: BlockHash, version: int) -> Dict[str, str]:
    """The per-item fields of a manifest of format ``version`` as JSON text (for
    :func:`~.checkpoint_dir.write_manifest`): ``tables`` (format 4), or ``items`` and ``blocks``."""
    if version >= 4:
        return {"tables": table_of_written(w, block_hash)}
    items, blocks = render_tables(w, block_hash)
    return {"items": items, "blocks": blocks}


__all__ = ["file_sizes", "render_tables", "rendered_tables", "table_of_written"]
