"""The metadata exchange of a save (and of a load's request check), one rank's step at a time.

Pure functions from the bytes a rank received to the bytes it sends: the execution
layer moves them with collectives (:mod:`ckpt_integration.execution.exchange`), the
scale benchmark (``benchmarks/scale.py``) with a loop over simulated ranks. No rank
ever holds the records of the whole job.

Every rank plays three roles, for different chunks and keys:

* **holder** - :func:`route_shards`: each local shard record goes to its *chunk
  owner* (a digest of the chunk's key and its band of the tensor, or of an object's storage
  key, modulo the world size: :func:`ownership_digests`), so a chunk's copies (its
  data-parallel replicas) meet on one rank, and a key's small pieces on few ranks. Later
  :func:`assign_writes` turns the owners' replies into the chunks this rank writes.
* **chunk owner** - :func:`chunk_owner_step`: groups the copies of each chunk,
  picks the main replica, and the *holder set* of ranks that may write it (the
  copies with the main's sizes, dtype and data). Replies to each member with
  ``(holder-set digest, size, its position)``; forwards to the *key owner*
  (``crc32(key) % world``) the chunk, its signature, its main record and its holders
  (as arithmetic runs) - not the replicas.
* **key owner** - :func:`~.key_owner.key_owner_step`: validates its keys and keeps a
  per-key summary that rank 0's commit checks the written chunks against.

Records travel as tables (:func:`~.records.put_table`): one column per field, one table per
number of dimensions, so that a rank with tens of thousands of records (many small tensors,
ZeRO-1 pieces) handles them with numpy instead of a Python loop per record; a chunk that is
not the common case (several copies that differ, overlapping main replicas, no main) takes
the general path, one Python step per chunk, with the same outcome as before.

Write balancing happens inside each holder set without another message: its
members hold the same chunks, so each computes the same largest-first assignment
to the least-loaded position (ties rotated by the set's digest) and keeps its own.
What a rank receives is proportional to the copies of the chunks it owns plus
its own shards - flat in the world size for a fixed model-parallel layout.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .digests import halves, joined, mix, string_digests
from .integrity import owner_of_key
from .records import MessageWriter, TableBatch, decode_array, digest64, encode_runs, put_table, read_tables, split_by
from .shards import ShardMeta, object_storage_key

from .key_owner import KeySummary, SummaryTable, chunk_digest, encode_summaries, key_owner_step  # noqa: E402,F401 (re-exported)
from .wire import ANSWER, CLAIM, COMPACT, FULL, GENERAL, HAS_DATA, KIND_CODES, KIND_NAMES, MAIN, SIMPLE, WIDTHS  # noqa: F401
from .written import CommitLayout, Written, WrittenTable, commit_layout, decode_finalize, encode_finalize  # noqa: F401


def chunk_token(storage_key: str, offsets: Optional[Sequence[int]]) -> bytes:
    """Identity of one stored chunk as bytes (for error messages and tests)."""
    return (storage_key + "@" + ("" if offsets is None else ",".join(map(str, offsets)))).encode()


# --------------------------------------------------------------------------- record columns
DIRECT_ABOVE = 64  # more writer candidates than this and ...
DIRECT_BELOW_ELEMENTS = 1 << 20  # ... fewer elements: the chunk owner picks the writer itself


def record_digests(key_d: np.ndarray, kind: np.ndarray, dtype_d: np.ndarray, geo: np.ndarray) -> np.ndarray:
    """Digest of everything in a record but its rank, main flag and data flag (``geo``: global
    shape, offsets and sizes side by side). A non-main copy identical to its main replica (the
    data-parallel case) is sent as this digest and matched by the chunk owner."""
    cols = np.concatenate([kind.reshape(-1, 1), dtype_d.view(np.int64).reshape(-1, 1), geo], axis=1)
    return mix(key_d, cols)


OWNER_BANDS = 512  # a tensor's chunks meet on at most this many chunk owners per column block (ownership_digests)


def ownership_digests(key_d: np.ndarray, kind: np.ndarray, geo: np.ndarray, nd: int) -> np.ndarray:
    """Digest of what picks a chunk's owner: an object's identity (key, offsets, global shape:
    its storage key); a tensor chunk's key, its *band* (the position of its first element in the
    flat tensor, in :data:`OWNER_BANDS` equal parts) and, from two dimensions on, its offset
    along the last axis.

    Every copy of a chunk has the same band, so the copies still meet on one rank. Banding keeps
    the many small chunks of one key on few owners: the owners forward each key's chunks to its
    key owner, and with one owner per chunk the key owner of a ZeRO-1 optimizer state got a
    message per piece (18,570 at 65,536 simulated ranks, most of the slowest rank's planning).
    The last axis keeps column blocks apart: they all start in the tensor's first row, so one
    band would gather every tensor-parallel block of a key, each with its data-parallel copies,
    on one owner. (Integer arithmetic that wraps on absurd shapes: the same on every rank, which
    is all an owner needs.)"""
    obj = kind.reshape(-1, 1) == 1
    gshape, offsets = geo[:, :nd], geo[:, nd : 2 * nd]
    where = offsets
    if nd and not obj.all():
        strides = np.ones_like(gshape)
        for j in range(nd - 2, -1, -1):
            strides[:, j] = strides[:, j + 1] * gshape[:, j + 1]
        start = np.sum(offsets * strides, axis=1)
        part = np.maximum(-(-np.prod(gshape, axis=1) // OWNER_BANDS), 1)  # elements per band, rounded up
        band = np.zeros_like(offsets)
        band[:, 0] = start // part
        if nd > 1:
            band[:, nd - 1] = offsets[:, nd - 1]
        where = np.where(obj, offsets, band)
    return mix(key_d, np.concatenate([kind.reshape(-1, 1), where, np.where(obj, gshape, 0)], axis=1))


@dataclass
class Routed:
    """What a holder sends: ``messages[owner]``; ``digest`` identifies the whole local input."""

    messages: Dict[int, bytes]
    digest: int


def _geometry(metas: Sequence[ShardMeta], idx: Sequence[int], nd: int) -> np.ndarray:
    try:
        geo = np.array([metas[i].global_shape + metas[i].offsets + metas[i].sizes for i in idx], dtype=np.int64)
    except (ValueError, TypeError):
        geo = None
    if geo is None or geo.shape != (len(idx), 3 * nd):
        for i in idx:
            m = metas[i]
            if len(m.offsets) != nd or len(m.sizes) != nd:
                raise ValueError(f"shard record of {m.key!r} has offsets/sizes of another rank than its global shape")
        raise ValueError("shard records with non-integer shapes")
    return geo.reshape(len(idx), 3 * nd)


def route_shards(
    metas: Sequence[ShardMeta], rank: int, world: int, options: str = "", only: Optional[Sequence[int]] = None
) -> Routed:
    """Step 1 (holder): each shard record to its chunk's owner.

    Main replicas go in full; other copies as a 16-byte digest (see :func:`record_digests`),
    completed only if the owner asks (:func:`detail_requests`). ``only`` (indices into
    ``metas``) sends just those records, in full. ``digest`` covers the records, ``rank``,
    ``world`` and ``options``: equal digests on every rank mean the same global input, hence
    the same plan (see "plan once, reuse").
    """
    world = max(world, 1)
    by_nd: Dict[int, List[int]] = defaultdict(list)
    for i in range(len(metas)) if only is None else only:
        by_nd[len(metas[i].global_shape)].append(i)
    parts: Dict[int, List[Tuple[int, int, np.ndarray, np.ndarray, List[str], bool]]] = defaultdict(list)
    for nd, idx in sorted(by_nd.items()):
        geo = _geometry(metas, idx, nd)
        ms = [metas[i] for i in idx]
        keys = [m.key for m in ms]
        dtypes = [m.dtype for m in ms]
        kind = np.fromiter((KIND_CODES[m.kind] for m in ms), dtype=np.int64, count=len(ms))
        flags = np.fromiter(((MAIN if m.is_main else 0) | (HAS_DATA if m.has_data else 0) for m in ms), dtype=np.int64, count=len(ms))
        key_d = string_digests(keys)
        owner = (ownership_digests(key_d, kind, geo, nd) % np.uint64(world)).astype(np.int64)
        full = np.ones(len(ms), dtype=bool) if only is not None else (flags & MAIN) != 0
        rd = None if full.all() else record_digests(key_d, kind, string_digests(dtypes), geo)
        ids = np.asarray(idx, dtype=np.int64)
        for d, sel in split_by(owner):
            f, c = sel[full[sel]], sel[~full[sel]]
            if len(f):
                parts[d].append((FULL, nd, ids[f], np.concatenate([kind[f][None], flags[f][None], geo[f].T]),
                                 [keys[j] for j in f.tolist()] + [dtypes[j] for j in f.tolist()], True))
            if len(c):
                parts[d].append((COMPACT, nd, ids[c], np.concatenate([halves(rd[c]), flags[c][None]]), [], False))
    messages: Dict[int, bytes] = {}
    for d in sorted(parts):
        w = MessageWriter()
        w.add(rank)
        for tag, nd, ids, cols, strings, has_strings in parts[d]:
            if has_strings:
                sid = w.sids(strings)
                n = len(ids)
                put_table(w, tag, nd, [ids, sid[:n], cols[0], sid[n:], cols[1:]])
            else:
                put_table(w, tag, nd, [ids, cols])
        messages[d] = w.tobytes()
    head = f"{rank}/{world}/{options}/{len(metas)}".encode()
    return Routed(messages, digest64(head, *(d.to_bytes(8, "little") + b for d, b in messages.items())))


def encode_shards(metas: Sequence[ShardMeta], rank: int) -> bytes:
    """Records of ``metas`` in one message, in full (e.g. a rank's write assignment, for the zarr layout)."""
    routed = route_shards(metas, rank, 1, only=range(len(metas)))
    return routed.messages.get(0) or MessageWriter().tobytes()


def decode_shards(msg: bytes) -> List[ShardMeta]:
    """The records of an :func:`encode_shards` message as main-replica ShardMetas of its sender."""
    strings, ints = decode_array(msg)
    if len(ints) == 0:
        return []
    src = int(ints[0])
    out: List[Tuple[int, ShardMeta]] = []
    for tag, nd, block in read_tables(ints, 1, WIDTHS):
        if tag != FULL:
            raise ValueError("decode_shards: a compact record has no content")
        for row in block.T.tolist():
            idx, ks, kind, ds, flags = row[:5]
            g, o, s = tuple(row[5 : 5 + nd]), tuple(row[5 + nd : 5 + 2 * nd]), tuple(row[5 + 2 * nd :])
            out.append((idx, ShardMeta(strings[ks], KIND_NAMES[kind], src, strings[ds], g, o, s, (0,), 0,
                                       has_data=bool(flags & HAS_DATA))))
    return [m for _, m in sorted(out, key=lambda im: im[0])]


# --------------------------------------------------------------------------- chunk owner
class _Inbox:
    """The full and compact records a chunk owner received, as arrays (strings interned)."""

    def __init__(self, inbox: Iterable[bytes]) -> None:
        src_of: List[int] = []

        def prefix(i: int, ints: List[int], p: int) -> int:
            src_of.append(ints[p])
            return p + 1

        batch = TableBatch(inbox, WIDTHS, prefix)
        src = np.asarray(src_of, dtype=np.int64)
        self.strings: List[str] = batch.strings
        self.full: Dict[int, np.ndarray] = {}  # nd -> rows (src, idx, key, kind, dtype, flags, geo)
        compact = [np.zeros((0, 5), dtype=np.int64)]  # rows (src, idx, digest low, digest high, flags)
        for tag, nd in batch.tables:
            if tag == FULL:
                msg, block = batch.rows(tag, nd, WIDTHS[FULL](nd))
                rows = np.empty((block.shape[1], 6 + 3 * nd), dtype=np.int64)
                rows[:, 0] = src[msg]
                rows[:, 1] = block[0]
                rows[:, 2] = batch.global_ids(msg, block[1])
                rows[:, 3] = block[2]
                rows[:, 4] = batch.global_ids(msg, block[3])
                rows[:, 5:] = block[4:].T
                self.full[nd] = rows
            elif tag == COMPACT:
                msg, block = batch.rows(tag, nd, WIDTHS[COMPACT](nd))
                compact.append(np.concatenate([src[msg][:, None], block.T], axis=1))
            else:
                raise ValueError(f"unexpected table {tag} in a holder's message")
        self.compact = np.concatenate(compact)


class _Out:
    """Messages a chunk owner sends, by destination: tables of rows, and general records
    (variable length, one GENERAL table per destination, appended by :meth:`close`)."""

    def __init__(self) -> None:
        self.writers: Dict[int, MessageWriter] = {}
        self.general: Dict[int, List[int]] = defaultdict(list)

    def writer(self, dst: int) -> MessageWriter:
        w = self.writers.get(dst)
        if w is None:
            w = self.writers[dst] = MessageWriter()
        return w

    def tobytes(self) -> Dict[int, bytes]:
        for d, g in self.general.items():
            if g:
                put_table(self.writer(d), GENERAL, 0, [np.asarray(g, dtype=np.int64)])
        return {d: w.tobytes() for d, w in sorted(self.writers.items())}


class _Answers:
    """Replies to holders: ANSWER rows ``(idx, holder-set digest low, high, set size, position)``
    by destination, from whole arrays (the plain chunks) or one row at a time."""

    def __init__(self) -> None:
        self.tables: Dict[int, List[np.ndarray]] = defaultdict(list)
        self.rows: Dict[int, List[Tuple[int, ...]]] = defaultdict(list)

    def table(self, dst: int, cols: Sequence[np.ndarray]) -> None:
        self.tables[dst].append(np.stack(cols))

    def row(self, dst: int, idx: int, hdig: int, n: int, pos: int) -> None:
        """``n = 0``: send the record in full (a detail request)."""
        lo, hi = hdig & 0xFFFFFFFF, (hdig >> 32) & 0xFFFFFFFF
        self.rows[dst].append((idx, lo - (1 << 32) if lo >> 31 else lo, hi - (1 << 32) if hi >> 31 else hi, n, pos))

    def tobytes(self) -> Dict[int, bytes]:
        out = {}
        for d in sorted(set(self.tables) | set(self.rows)):
            blocks = self.tables.get(d, []) + ([np.asarray(self.rows[d], dtype=np.int64).T] if self.rows.get(d) else [])
            w = MessageWriter()
            put_table(w, ANSWER, 0, [np.concatenate(blocks, axis=1)])
            out[d] = w.tobytes()
        return out


def chunk_owner_step(
    inbox: Iterable[bytes], world: int, *, balance: bool = True, replies: bool = True
) -> Tuple[Dict[int, bytes], Dict[int, bytes]]:
    """Step 2 (chunk owner): ``(forwards to key owners, replies to holders)``.

    Compact copies are matched to the main replica with the same record digest; a
    copy that matches none is answered with a request for its full record (the
    caller then runs a detail round: :func:`detail_requests`, ``route_shards(only=)``
    and this step again on those full records, with ``replies=False``).

    The main replica of a chunk is its lowest-rank main record; the writer
    candidates are the copies with the main's dtype, global shape, sizes and data
    (only the main for objects or without ``balance``; the main alone when no copy
    has data - its missing data is then reported by the save). A small chunk with
    more than :data:`DIRECT_ABOVE` candidates gets one, chosen by hash, so replies
    stay O(1) per chunk however large the replica group.
    """
    world = max(world, 1)
    box = _Inbox(inbox)
    strings = box.strings
    sdig = string_digests(strings)
    kowner = (sdig % np.uint64(world)).astype(np.int64)  # owner_of_key of every string at once
    compact = box.compact
    cdig = joined(compact[:, 2], compact[:, 3]) if len(compact) else np.zeros(0, dtype=np.uint64)
    claimed = np.zeros(len(compact), dtype=bool)  # compact copies matched to a chunk
    fwd, ans = _Out(), _Answers()
    general: List[Tuple[int, np.ndarray, np.ndarray]] = []  # (nd, rows of one chunk, compact rows matched)
    unmatched_by_digest: Dict[int, List[int]] = defaultdict(list)
    for nd, rows in sorted(box.full.items()):
        key, kind, flags = rows[:, 2], rows[:, 3], rows[:, 5]
        geo = rows[:, 6:]
        # chunk identity: key, kind, offsets, (object) global shape; records of a chunk by (rank, idx)
        gobj = np.where(kind[:, None] == 1, geo[:, :nd], 0)
        sort_cols = [rows[:, 1], rows[:, 0]] + [gobj[:, j] for j in reversed(range(nd))]
        sort_cols += [geo[:, nd + j] for j in reversed(range(nd))] + [kind, key]
        order = np.lexsort(sort_cols)
        rows, key, kind, flags, geo, gobj = rows[order], key[order], kind[order], flags[order], geo[order], gobj[order]
        ident = np.concatenate([key[:, None], kind[:, None], geo[:, nd : 2 * nd], gobj], axis=1)
        starts = np.flatnonzero(np.r_[True, np.any(ident[1:] != ident[:-1], axis=1)])
        counts = np.diff(np.r_[starts, len(rows)])
        # compact copies: matched to the main record with the same content digest
        rdig = record_digests(sdig[key], kind, sdig[rows[:, 4]], geo)
        is_main = (flags & MAIN) != 0
        chunk_of_row = np.repeat(np.arange(len(starts)), counts)
        match = np.full(len(compact), -1, dtype=np.int64)  # row matched by each compact copy
        mains = np.flatnonzero(is_main)
        if len(compact) and len(mains):
            md = rdig[mains]
            srt = np.argsort(md, kind="stable")
            pos = np.searchsorted(md[srt], cdig)
            pos_c = np.minimum(pos, len(srt) - 1)
            hit = (md[srt][pos_c] == cdig) & ~claimed
            match[hit] = mains[srt[pos_c[hit]]]
        simple = (counts == 1) & is_main[starts]
        matched_chunk = np.where(match >= 0, chunk_of_row[np.maximum(match, 0)], -1)
        with_copies = np.zeros(len(starts), dtype=bool)
        if len(compact):
            claimed |= match >= 0
            with_copies[matched_chunk[matched_chunk >= 0]] = True
            for j in np.flatnonzero((match >= 0) & ~simple[np.maximum(matched_chunk, 0)]).tolist():
                unmatched_by_digest[int(cdig[j])].append(j)  # the general path matches these itself
        plain = simple & ~with_copies
        _forward_plain(fwd, ans, rows[starts[plain]], nd, strings, kowner, replies)
        by_chunk = np.argsort(matched_chunk, kind="stable")
        mc = matched_chunk[by_chunk]
        for c in np.flatnonzero(~plain).tolist():
            s = starts[c]
            crow = compact[:0]
            if simple[c]:
                crow = compact[by_chunk[np.searchsorted(mc, c, "left") : np.searchsorted(mc, c, "right")]]
            general.append((nd, rows[s : s + counts[c]], crow))
        for r in np.flatnonzero(plain & (kind[starts] == 1)).tolist():
            _claim(fwd, rows[starts[r] : starts[r] + 1], nd, strings, world)
    for j in np.flatnonzero(~claimed).tolist():
        unmatched_by_digest[int(cdig[j])].append(j)
    for nd, recs, crow in general:
        _general_chunk(fwd, ans, nd, recs, crow, compact, cdig, unmatched_by_digest, strings, sdig, kowner, world,
                       balance, replies)
    # copies matching no main replica here: differ from it, or their chunk has none
    left = sorted(j for js in unmatched_by_digest.values() for j in js)
    for src, idx in compact[left, :2].tolist():
        ans.row(src, idx, 0, 0, 0)
    return fwd.tobytes(), ans.tobytes()


def _forward_plain(fwd: _Out, ans: _Answers, rows: np.ndarray, nd: int, strings: List[str], kowner: np.ndarray,
                   replies: bool) -> None:
    """Chunks with one record, their main replica: forwarded as SIMPLE rows, answered ``n = 1``."""
    if not len(rows):
        return
    for d, sel in split_by(kowner[rows[:, 2]]):
        r = rows[sel]
        w = fwd.writer(d)
        key, dtype = _localize(w, strings, r[:, 2], r[:, 4])
        geo = r[:, 6:]
        one = np.ones(len(r), dtype=np.int64)
        put_table(w, SIMPLE, nd, [key, r[:, 3], dtype, geo[:, : 2 * nd].T, r[:, 0], geo[:, 2 * nd :].T, r[:, 0], one, one])
    if replies:
        for src, sel in split_by(rows[:, 0]):
            n = len(sel)
            zero, one = np.zeros(n, dtype=np.int64), np.ones(n, dtype=np.int64)
            ans.table(src, [rows[sel, 1], zero, zero, one, zero])


def _localize(w: MessageWriter, strings: List[str], *cols: np.ndarray) -> List[np.ndarray]:
    """Columns of global string ids as ids into ``w``'s string table."""
    u = np.unique(np.concatenate(cols))
    lut = w.sids([strings[g] for g in u.tolist()])
    return [lut[np.searchsorted(u, c)] for c in cols]


def _claim(fwd: _Out, recs: np.ndarray, nd: int, strings: List[str], world: int) -> None:
    """A ShardedObject is stored under its unique key; the owner of that name (where a
    ShardedTensor of the same name would be validated) checks that nothing else uses it."""
    r0 = recs[0].tolist()
    key = strings[r0[2]]
    skey = object_storage_key(key, tuple(r0[6 + nd : 6 + 2 * nd]), tuple(r0[6 : 6 + nd]))
    cw = fwd.writer(owner_of_key(skey, world))
    runs = encode_runs(sorted({int(s) for s in recs[:, 0].tolist()}))
    fwd.general[owner_of_key(skey, world)].extend([cw.sid(skey), CLAIM, cw.sid(key), len(runs), *runs])


def _general_chunk(
    fwd: _Out, ans: _Answers, nd: int, recs_arr: np.ndarray, crow: np.ndarray, compact: np.ndarray, cdig: np.ndarray,
    unmatched: Dict[int, List[int]], strings: List[str], sdig: np.ndarray, kowner: np.ndarray, world: int,
    balance: bool, replies: bool,
) -> None:
    """One chunk that is not the plain case, record by record (the reference algorithm)."""
    recs = []  # (src, idx, dtype, gshape, sizes, flags)
    for row in recs_arr.tolist():
        recs.append((row[0], row[1], row[4], tuple(row[6 : 6 + nd]), tuple(row[6 + 2 * nd :]), row[5]))
    recs.sort()
    r0 = recs_arr[0].tolist()
    key_g, kind = r0[2], r0[3]
    key = strings[key_g]
    offsets = tuple(r0[6 + nd : 6 + 2 * nd])
    # the copies identical to a main replica of this chunk, by content (dtype, shape, sizes)
    copies: Dict[Tuple, List[Tuple[int, int, int]]] = {}
    if len(crow):  # matched already (a simple chunk with copies)
        main = next(r for r in recs if r[5] & MAIN)
        copies[(main[2], main[3], main[4])] = [tuple(c) for c in crow[:, [0, 1, 4]].tolist()]
    elif unmatched:
        for r in recs:
            content = (r[2], r[3], r[4])
            if r[5] & MAIN and content not in copies:
                geo = np.asarray([r[3] + offsets + r[4]], dtype=np.int64).reshape(1, 3 * nd)
                d = int(record_digests(sdig[[key_g]], np.asarray([kind]), sdig[[r[2]]], geo)[0])
                js = unmatched.pop(d, [])
                copies[content] = [tuple(compact[j, [0, 1, 4]].tolist()) for j in js]
    by_sig: Dict[Tuple, List[Tuple]] = defaultdict(list)
    for r in recs:
        by_sig[(r[2], r[3])].append(r)
    ko = int(kowner[key_g])
    w = fwd.writer(ko)
    for (dtype_g, gshape), group in by_sig.items():
        mains = [r for r in group if r[5] & MAIN]
        vals = [w.sid(key), kind, w.sid(strings[dtype_g]), nd, *gshape, *offsets, len(mains)]
        for r in mains:
            vals += [r[0], *r[4]]
        holders = {r[0] for r in group}
        for content, cs in copies.items():
            if content[0] == dtype_g and content[1] == gshape:
                holders.update(c[0] for c in cs)
        runs = encode_runs(sorted(holders))
        vals += [len(runs), *runs]
        fwd.general[ko].extend(vals)
    if kind == 1:
        _claim(fwd, recs_arr, nd, strings, world)
    if not replies:
        return
    main = next((r for r in recs if r[5] & MAIN), None)
    if main is None:
        return  # nothing to write (validation reports it)
    if kind == 1 or not balance:
        candidates = [(main[0], main[1])]
    else:
        content = (main[2], main[3], main[4])
        both = [(r[0], r[1]) for r in recs if (r[2], r[3], r[4]) == content and r[5] & HAS_DATA]
        both += [(c[0], c[1]) for c in copies.get(content, ()) if c[2] & HAS_DATA]
        both.sort()
        candidates = [c for i, c in enumerate(both) if i == 0 or both[i - 1][0] != c[0]]  # one per rank
        candidates = candidates or [(main[0], main[1])]
        if len(candidates) > DIRECT_ABOVE and math.prod(main[4]) < DIRECT_BELOW_ELEMENTS:
            # a small chunk held by many ranks (a tensor-parallel-replicated norm or bias
            # across a large data-parallel group): this owner picks the writer, spread by
            # hash, and tells only it - O(1) replies instead of one per copy
            candidates = [candidates[digest64(chunk_token(key, offsets)) % len(candidates)]]
    n = len(candidates)
    hdig = digest64(array("q", [c[0] for c in candidates]).tobytes()) if n > 1 else 0
    for pos, (rank, idx) in enumerate(candidates):
        ans.row(rank, idx, hdig, n, pos)


# --------------------------------------------------------------------------- holder: write assignment
def _answers(replies: Iterable[bytes]) -> np.ndarray:
    """Every reply row as one array ``(m, 4)``: idx, holder-set digest, set size, position."""
    batch = TableBatch(replies, WIDTHS)
    if any(tag != ANSWER for tag, _ in batch.tables):
        raise ValueError("unexpected table in a chunk owner's reply")
    _, b = batch.rows(ANSWER, 0, WIDTHS[ANSWER](0))
    out = np.empty((b.shape[1], 4), dtype=np.int64)
    out[:, 0] = b[0]
    out[:, 1] = joined(b[1], b[2]).view(np.int64)
    out[:, 2] = b[3]
    out[:, 3] = b[4]
    return out


def assign_writes(metas: Sequence[ShardMeta], replies: Iterable[bytes]) -> List[int]:
    """Step 4 (holder): indices into ``metas`` of the chunks this rank writes, in chunk order.

    Within each holder set the members compute the same greedy assignment (largest
    chunk first to the least-loaded position, ties rotated by the set's digest so
    small sets do not all pick their first member) and keep their own chunks.
    """
    rows = _answers(replies)
    mine: List[int] = rows[rows[:, 2] == 1, 0].tolist()
    groups: Dict[Tuple[int, int], List[Tuple]] = defaultdict(list)
    for idx, hdig, n, pos in rows[rows[:, 2] > 1].tolist():
        m = metas[idx]
        groups[(hdig, n)].append((-m.nbytes, m.storage_key, m.offsets, idx, pos))
    for (hdig, n), items in groups.items():
        items.sort()
        rot = hdig % n
        heap = [(0, (p - rot) % n, p) for p in range(n)]
        heapq.heapify(heap)
        for neg_bytes, _sk, _off, idx, pos in items:
            load, order, p = heapq.heappop(heap)
            if p == pos:
                mine.append(idx)
            heapq.heappush(heap, (load - neg_bytes, order, p))
    return sorted(mine, key=lambda i: metas[i].chunk_id)


def detail_requests(replies: Iterable[bytes]) -> List[int]:
    """Indices of the records whose owner asked for them in full (copies that differ from their main)."""
    rows = _answers(replies)
    return sorted(rows[rows[:, 2] == 0, 0].tolist())

