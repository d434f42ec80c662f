"""The key owner's step of a save's exchange: validate the owned keys, summarise them for the commit.

A key owner receives from the chunk owners one record per chunk of each of its keys:
SIMPLE table rows for the common case (one main replica, holders in one arithmetic run) and
general records for the rest (see :mod:`.exchange`). The rows are checked as arrays, all keys
at once: consistent kind, dtype and global shape, inside the global shape, no chunk twice, the
main replicas covering exactly the tensor's elements, and pairwise disjoint where every box is
a flat range of the tensor (row splits, ZeRO-1 whole-row pieces) or of one column block (a
row split within a column split). A key that fails any of these quick tests - or that has
general records, or objects - is validated by the reference code
(:func:`~.integrity.validate_key_records`), which gives the exact problem messages; a valid
key of another layout merely takes that slower path.

Storage-key collisions are refused whether or not the save validates: a ShardedTensor's storage
key is its ``key``, a ShardedObject's is ``<key>/shard_<offsets>_<global shape>``, both in one
namespace, so ``ShardedTensor("x/shard_0_1")`` beside ``ShardedObject("x")`` of shape ``(1,)`` at
``(0,)`` would be one stored item that neither could load. Items of one storage key have one
owner, so the owner sees every claim of it (:func:`collision_message`).

The summary of a key (:class:`KeySummary`): its kind, dtype, global shape, number of main
chunks and the sum of their digests (:func:`~.digests.chunk_digests`), which rank 0's commit
compares with what was written.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple, Union

import numpy as np

from .digests import chunk_digests, halves, joined, string_digest, string_digests
from .integrity import Holding, validate_key_records
from .records import MessageWriter, TableBatch, decode_runs, put_table, segments
from .shards import ShardMeta, object_storage_key
from .wire import CLAIM, GENERAL, KIND_CODES, KIND_NAMES, SIMPLE, SUMMARY, WIDTHS

_MOD = 1 << 64


def collision_message(storage_key: str, items: Mapping[Tuple[str, str], Iterable[int]]) -> str:
    """The problem text for one storage key claimed by several ``(kind, key)`` items (with their ranks)."""
    described = []
    for (kind, key), ranks in sorted(items.items()):
        rs = sorted(set(ranks))
        what = "ShardedTensor" if kind == "tensor" else "ShardedObject"
        described.append(f"{what} {key!r} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})")
    return f"storage key {storage_key!r} would be used by {len(items)} different items: {'; '.join(described)}"


class KeySummary(NamedTuple):
    """What rank 0's commit checks the written chunks of one key against (a named tuple: one is
    built per key, tens of thousands per rank with many small tensors)."""

    key: str
    kind: str
    dtype: str
    global_shape: Tuple[int, ...]
    chunks: int  # distinct chunks with a main replica (each is written exactly once)
    token_sum: int  # sum of the chunks' digests modulo 2**64


def chunk_digest(storage_key: str, offsets: Optional[Sequence[int]]) -> int:
    """The digest of one stored chunk (as :func:`~.digests.chunk_digests` computes them in bulk)."""
    kd = np.asarray([string_digest(storage_key)], dtype=np.uint64)
    off = None if offsets is None else np.asarray([tuple(offsets)], dtype=np.int64).reshape(1, len(offsets))
    return int(chunk_digests(kd, off)[0])


class SummaryTable:
    """Key summaries as columns (a key owner has thousands with many small tensors; rank 0 all of
    them): per number of dimensions of the global shape, the key and dtype as ids into
    ``strings``, the kind code, the shape, the number of main chunks and the digest sum.
    Iterating yields :class:`KeySummary` records."""

    def __init__(self, strings: Optional[List[str]] = None) -> None:
        self.strings: List[str] = [] if strings is None else strings
        self._ids: Optional[Dict[str, int]] = None
        self.blocks: Dict[int, List[Tuple[np.ndarray, ...]]] = defaultdict(list)

    def sid(self, s: str) -> int:
        if self._ids is None:
            self._ids = {x: i for i, x in enumerate(self.strings)}
        i = self._ids.get(s)
        if i is None:
            i = self._ids[s] = len(self.strings)
            self.strings.append(s)
        return i

    def add_block(self, nd: int, key: np.ndarray, kind: np.ndarray, dtype: np.ndarray, shape: np.ndarray,
                  chunks: np.ndarray, token: np.ndarray) -> None:
        if len(key):
            self.blocks[nd].append((np.asarray(key, dtype=np.int64), np.asarray(kind, dtype=np.int64),
                                    np.asarray(dtype, dtype=np.int64), np.asarray(shape, dtype=np.int64).reshape(len(key), nd),
                                    np.asarray(chunks, dtype=np.int64), np.asarray(token, dtype=np.uint64)))

    def extend(self, summaries: Iterable[KeySummary]) -> None:
        by_nd: Dict[int, List[KeySummary]] = defaultdict(list)
        for x in summaries:
            by_nd[len(x.global_shape)].append(x)
        for nd, xs in by_nd.items():
            self.add_block(nd, [self.sid(x.key) for x in xs], [KIND_CODES[x.kind] for x in xs], [self.sid(x.dtype) for x in xs],
                           np.asarray([x.global_shape for x in xs], dtype=np.int64).reshape(len(xs), nd),
                           [x.chunks for x in xs], np.asarray([x.token_sum for x in xs], dtype=np.uint64))

    def columns(self) -> Dict[int, Tuple[np.ndarray, ...]]:
        """nd -> (key, kind, dtype, shape, chunks, token), each block concatenated."""
        out = {}
        for nd, bs in self.blocks.items():
            out[nd] = tuple(np.concatenate([b[j] for b in bs]) for j in range(6)) if len(bs) > 1 else bs[0]
        return out

    def __len__(self) -> int:
        return sum(len(b[0]) for bs in self.blocks.values() for b in bs)

    def __iter__(self):
        for nd, (key, kind, dtype, shape, chunks, token) in sorted(self.columns().items()):
            for k, c, d, sh, n, t in zip(key.tolist(), kind.tolist(), dtype.tolist(), shape.tolist(), chunks.tolist(), token.tolist()):
                yield KeySummary(self.strings[k], KIND_NAMES[c], self.strings[d], tuple(sh), n, t)


class _Received:
    """A key owner's inbox: SIMPLE rows by nd (global string ids) and the general records."""

    def __init__(self, inbox: Iterable[bytes]) -> None:
        batch = TableBatch(inbox, WIDTHS)
        self.strings: List[str] = batch.strings
        self.ids: Dict[str, int] = batch.ids
        self.simple: Dict[int, np.ndarray] = {}
        self.mains: Dict[Tuple[str, int], List[ShardMeta]] = defaultdict(list)
        self.holdings: Dict[Tuple[str, int], List[Holding]] = defaultdict(list)
        self.claims: Dict[str, Dict[Tuple[str, str], set]] = defaultdict(dict)
        for tag, nd in batch.tables:
            if tag == SIMPLE:
                msg, cols = batch.rows(tag, nd, WIDTHS[SIMPLE](nd))
                rows = cols.T.copy()
                rows[:, 0] = batch.global_ids(msg, rows[:, 0])  # key
                rows[:, 2] = batch.global_ids(msg, rows[:, 2])  # dtype
                self.simple[nd] = rows
            elif tag == GENERAL:
                for i, start, cnt in batch.tables[(tag, nd)]:
                    base = int(batch.lut_base[i])
                    nstr = (int(batch.lut_base[i + 1]) if i + 1 < batch.count else len(batch.lut)) - base
                    strings = [self.strings[j] for j in batch.lut[base : base + nstr].tolist()]
                    self._general(strings, batch.ints[start : start + cnt].tolist(), CLAIM, KIND_NAMES)
            else:
                raise ValueError(f"unexpected table {tag} in a chunk owner's forward")

    def _general(self, strings: List[str], ints: List[int], claim: int, kind_names: Sequence[str]) -> None:
        p, n = 0, len(ints)
        while p < n:
            ks, kind, ds, nd = ints[p : p + 4]
            p += 4
            if kind == claim:  # (storage key, CLAIM, object key, #runs, runs...)
                self.claims[strings[ks]].setdefault(("object", strings[ds]), set()).update(decode_runs(ints[p : p + nd]))
                p += nd
                continue
            gshape = tuple(ints[p : p + nd])
            offsets = tuple(ints[p + nd : p + 2 * nd])
            nmain = ints[p + 2 * nd]
            p += 2 * nd + 1
            key, dtype, kname = strings[ks], strings[ds], kind_names[kind]
            for _ in range(nmain):
                self.mains[(key, kind)].append(
                    ShardMeta(key, kname, ints[p], dtype, gshape, offsets, tuple(ints[p + 1 : p + 1 + nd]), (0,), 0)
                )
                p += 1 + nd
            nr = ints[p]
            self.holdings[(key, kind)].append(Holding(kname, dtype, gshape, offsets, tuple(ints[p + 1 : p + 1 + nr])))
            p += 1 + nr


# SIMPLE row columns: key, kind, dtype, global shape (nd), offsets (nd), main rank, sizes (nd), run (3)
def _cols(nd: int) -> Tuple[slice, slice, int, slice, slice]:
    return slice(3, 3 + nd), slice(3 + nd, 3 + 2 * nd), 3 + 2 * nd, slice(4 + 2 * nd, 4 + 3 * nd), slice(4 + 3 * nd, 7 + 3 * nd)


def _bad_keys(rows: np.ndarray, nd: int, validate: bool) -> np.ndarray:
    """Per row (sorted by key): whether its key must take the reference path."""
    g, o, _, s, _ = _cols(nd)
    key = rows[:, 0]
    starts, lengths = segments(key)
    first = np.repeat(starts, lengths)
    bad = rows[:, 1] != 0  # objects
    bad |= np.any(rows[:, 1:3] != rows[first, 1:3], axis=1)  # kind, dtype
    if nd:
        bad |= np.any(rows[:, g] != rows[first, g], axis=1)
    # the same chunk (offsets) twice: two signatures of one chunk, or duplicate main replicas
    if nd:
        order = np.lexsort([rows[:, o][:, j] for j in reversed(range(nd))] + [key])
        so = rows[order]
        same = np.r_[False, (so[1:, 0] == so[:-1, 0]) & np.all(so[1:, o] == so[:-1, o], axis=1)]
        dup = np.zeros(len(rows), dtype=bool)
        dup[order[same]] = True
        dup[order[np.r_[same[1:], False]]] = True
        bad |= dup
    elif len(rows):
        bad |= np.repeat(lengths > 1, lengths)
    if validate and nd:
        gs, os_, ss = rows[:, g], rows[:, o], rows[:, s]
        bad |= np.any((os_ < 0) | (os_ + ss > gs), axis=1)
        vol = np.prod(ss, axis=1)
        covered = np.add.reduceat(vol, starts) if len(starts) else vol[:0]
        total = np.prod(rows[starts][:, g], axis=1)
        bad |= np.repeat(covered != total, lengths)
        bad |= ~_disjoint(rows, nd, starts, lengths)
    return _spread(key, bad)


def _spread(key: np.ndarray, bad: np.ndarray) -> np.ndarray:
    """Mark every row of a key with a bad row (``key`` sorted)."""
    starts, lengths = segments(key)
    if not len(starts):
        return bad
    return np.repeat(np.maximum.reduceat(bad.astype(np.int8), starts) > 0, lengths)


def _disjoint(rows: np.ndarray, nd: int, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per row: its key's main replicas are provably pairwise disjoint (False: cannot tell).

    The vectorised form of :func:`~.integrity._disjoint_flat_ranges`: every non-empty box is
    one flat range of the tensor (``t = nd``) or of the first ``nd - 1`` axes within one
    column block (``t = nd - 1``, the blocks' last-axis intervals disjoint), and within each
    key (and block) the sorted ranges do not overlap."""
    g, o, _, s, _ = _cols(nd)
    gs, os_, ss = rows[:, g], rows[:, o], rows[:, s]
    key = rows[:, 0]
    result = np.zeros(len(rows), dtype=bool)
    for t in (nd, nd - 1):
        if t < 1:
            continue
        empty = np.any(ss == 0, axis=1)
        # i: first axis below t - 1 whose size is not 1; the box is a flat range if every axis after
        # i (below t) is whole
        ne1 = ss[:, : t - 1] != 1
        i = np.where(ne1.any(axis=1), ne1.argmax(axis=1), t - 1) if t > 1 else np.zeros(len(rows), dtype=np.int64)
        ax = np.arange(t)[None, :]
        after = ax > i[:, None]
        ok = np.all(~after | ((os_[:, :t] == 0) & (ss[:, :t] == gs[:, :t])), axis=1) | empty
        strides = np.ones((len(rows), t), dtype=np.int64)
        for j in range(t - 2, -1, -1):
            strides[:, j] = strides[:, j + 1] * gs[:, j + 1]
        lo = np.sum(np.where(ax <= i[:, None], os_[:, :t] * strides, 0), axis=1)
        hi = lo + ss[np.arange(len(rows)), i] * strides[np.arange(len(rows)), i]
        if t < nd:  # blocks: (key, last-axis interval); their intervals must not overlap within a key
            bo, bs = os_[:, t], ss[:, t]
            order = np.lexsort([bs, bo, key])
            k2, bo2, bs2 = key[order], bo[order], bs[order]
            new_block = np.r_[True, (k2[1:] != k2[:-1]) | (bo2[1:] != bo2[:-1]) | (bs2[1:] != bs2[:-1])]
            bi = np.flatnonzero(new_block)  # one row per distinct block, sorted by (key, start)
            cross = (k2[bi][1:] == k2[bi][:-1]) & (bo2[bi][:-1] + bs2[bi][:-1] > bo2[bi][1:])
            blocks_bad = np.zeros(len(rows), dtype=bool)
            blocks_bad[order[bi[1:][cross]]] = True
            group = np.cumsum(new_block)[np.argsort(order)]  # block number of each row
            ok &= ~_spread(key, blocks_bad)
        else:
            group = np.zeros(len(rows), dtype=np.int64)
        live = ~empty
        order = np.lexsort([lo, group, key])
        k3, g3, lo3, hi3, live3 = key[order], group[order], lo[order], hi[order], live[order]
        # consecutive live ranges of one (key, block): the previous one must end before this starts
        idx = np.flatnonzero(live3)
        prev_same = (k3[idx][1:] == k3[idx][:-1]) & (g3[idx][1:] == g3[idx][:-1])
        clash = prev_same & (hi3[idx][:-1] > lo3[idx][1:])
        bad = np.zeros(len(rows), dtype=bool)
        bad[order[idx[1:][clash]]] = True
        bad |= ~ok
        result |= ~_spread(key, bad)
    return result


def key_owner_step(inbox: Iterable[bytes], *, validate: bool = True,
                   whole_grids: bool = True) -> Tuple[List[str], List[KeySummary]]:
    """Step 3 (key owner): integrity problems of the owned keys (sorted by key) and their summaries."""
    rcv = _Received(inbox)
    strings = rcv.strings
    general_keys: Set[str] = {k for k, _ in rcv.holdings}
    groups = rcv.simple
    # keys seen with two numbers of dimensions disagree on the global shape: reference path
    slow_ids = {rcv.ids[k] for k in general_keys if k in rcv.ids}
    if len(groups) > 1:
        u, c = np.unique(np.concatenate([np.unique(rows[:, 0]) for rows in groups.values()]), return_counts=True)
        slow_ids |= set(u[c > 1].tolist())
    summaries = SummaryTable(strings)
    slow: List[KeySummary] = []
    slow_rows: Dict[str, List[Tuple[int, np.ndarray]]] = defaultdict(list)
    for nd, rows in groups.items():
        rows = rows[np.argsort(rows[:, 0], kind="stable")]
        bad = _bad_keys(rows, nd, validate)
        if slow_ids:
            bad |= np.isin(rows[:, 0], np.fromiter(slow_ids, dtype=np.int64))
        for k, r in _split_by_key(rows[bad]):
            slow_rows[strings[k]].append((nd, r))
        _fast_summaries(summaries, rows[~bad], nd, strings)
    problems: List[str] = []
    # storage-key collisions (always refused, validation or not): a name claimed by an object
    # and also a tensor key, or by objects of different keys
    for skey in sorted(rcv.claims):
        items = dict(rcv.claims[skey])
        ranks = _tensor_holders(skey, rcv, groups)
        if ranks is not None:
            items[("tensor", skey)] = ranks
        if len(items) > 1:
            problems.append(collision_message(skey, items))
    general_by_key: Dict[str, List[int]] = defaultdict(list)
    for k, kind in rcv.holdings:
        general_by_key[k].append(kind)
    for key in sorted(set(slow_rows) | general_keys):
        by_kind: Dict[int, Tuple[List[ShardMeta], List[Holding]]] = {}
        for nd, rows in slow_rows.get(key, []):
            for kind, ms, hs in _objects_of(rows, nd, strings, KIND_NAMES):
                e = by_kind.setdefault(kind, ([], []))
                e[0].extend(ms)
                e[1].extend(hs)
        for kind in general_by_key.get(key, []):
            e = by_kind.setdefault(kind, ([], []))
            e[0].extend(rcv.mains.get((key, kind), []))
            e[1].extend(rcv.holdings[(key, kind)])
        if validate:
            ms = [m for kind in sorted(by_kind) for m in by_kind[kind][0]]
            hs = [h for kind in sorted(by_kind) for h in by_kind[kind][1]]
            problems.extend(validate_key_records(key, sorted(ms, key=lambda m: (m.rank, m.offsets)), hs, whole_grids))
        for kind in sorted(by_kind):
            slow.append(_slow_summary(key, kind, *by_kind[kind]))
    summaries.extend(slow)
    return problems, summaries


def _split_by_key(rows: np.ndarray) -> Iterable[Tuple[int, np.ndarray]]:
    starts, lengths = segments(rows[:, 0])
    for a, n in zip(starts.tolist(), lengths.tolist()):
        yield int(rows[a, 0]), rows[a : a + n]


def _fast_summaries(out: SummaryTable, rows: np.ndarray, nd: int, strings: List[str]) -> None:
    if not len(rows):
        return
    g, o, _, _, _ = _cols(nd)
    starts, lengths = segments(rows[:, 0])
    kd = string_digests(strings)[rows[:, 0]]
    dig = chunk_digests(kd, rows[:, o])
    sums = np.add.reduceat(dig, starts)  # uint64: modulo 2**64
    firsts = rows[starts]
    out.add_block(nd, firsts[:, 0], np.zeros(len(starts), dtype=np.int64), firsts[:, 2], firsts[:, g], lengths, sums)


def _objects_of(rows: np.ndarray, nd: int, strings: List[str], kind_names: Sequence[str]):
    """SIMPLE rows of one key as (kind, main records, holdings) for the reference path."""
    g, o, m, s, run = _cols(nd)
    out = []
    for r in rows.tolist():
        kind = r[1]
        meta = ShardMeta(strings[r[0]], kind_names[kind], r[m], strings[r[2]], tuple(r[g]), tuple(r[o]), tuple(r[s]), (0,), 0)
        out.append((kind, [meta], [Holding(kind_names[kind], strings[r[2]], tuple(r[g]), tuple(r[o]), tuple(r[run]))]))
    return out


def _slow_summary(key: str, kind: int, mains: List[ShardMeta], holdings: List[Holding]) -> KeySummary:
    hs = sorted(holdings, key=lambda h: h.runs[0])
    first = hs[0]
    ids = {}
    for mm in mains:
        if mm.kind == "tensor":
            ids[(mm.key, mm.offsets)] = True
        else:  # stored by unique key, without offsets (as the writer reports it)
            ids[(object_storage_key(mm.key, mm.offsets, mm.global_shape), None)] = True
    total = sum(chunk_digest(sk, off) for sk, off in ids) % _MOD
    return KeySummary(key, first.kind, first.dtype, first.global_shape, len(ids), total)


def _tensor_holders(skey: str, rcv: _Received, groups: Dict[int, np.ndarray]) -> Optional[Set[int]]:
    """Ranks holding chunks of tensor key ``skey`` at this owner (None: no such tensor key)."""
    ranks: Set[int] = set()
    found = False
    for h in rcv.holdings.get((skey, 0), []):
        found = True
        ranks.update(decode_runs(h.runs))
    k = rcv.ids.get(skey)
    if k is not None:
        for nd, rows in groups.items():
            sel = rows[(rows[:, 0] == k) & (rows[:, 1] == 0)]
            if len(sel):
                found = True
                for run in sel[:, 4 + 3 * nd : 7 + 3 * nd].tolist():
                    ranks.update(decode_runs(run))
    return ranks if found else None


def encode_summaries(w: MessageWriter, summaries: Union[SummaryTable, Sequence[KeySummary]]) -> None:
    """Append the summaries as SUMMARY tables (one per number of dimensions)."""
    if not isinstance(summaries, SummaryTable):
        t = SummaryTable()
        t.extend(summaries)
        summaries = t
    for nd, (key, kind, dtype, shape, chunks, token) in sorted(summaries.columns().items()):
        u = np.unique(np.concatenate([key, dtype]))
        lut = w.sids([summaries.strings[i] for i in u.tolist()])
        put_table(w, SUMMARY, nd, [lut[np.searchsorted(u, key)], kind, lut[np.searchsorted(u, dtype)], shape.T, chunks,
                                   halves(token)])


def read_summaries(batch: TableBatch) -> SummaryTable:
    """The SUMMARY tables of a batch of messages (strings: the batch's)."""
    out = SummaryTable(batch.strings)
    for tag, nd in list(batch.tables):
        if tag == SUMMARY:
            msg, cols = batch.rows(tag, nd, WIDTHS[SUMMARY](nd))
            out.add_block(nd, batch.global_ids(msg, cols[0]), cols[1], batch.global_ids(msg, cols[2]), cols[3 : 3 + nd].T,
                          cols[3 + nd], joined(cols[4 + nd], cols[5 + nd]))
    return out


__all__ = ["KeySummary", "SummaryTable", "chunk_digest", "key_owner_step", "encode_summaries", "read_summaries"]
