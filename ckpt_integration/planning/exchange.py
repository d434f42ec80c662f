"""The metadata exchange of a save (and of a load's request check), one rank's step at a time.

Pure functions from the bytes a rank received to the bytes it sends: the execution
layer moves them with collectives (:mod:`ckpt_integration.execution.exchange`), the
scale benchmark (``benchmarks/scale.py``) with a loop over simulated ranks. No rank
ever holds the records of the whole job.

Every rank plays three roles, for different chunks and keys:

* **holder** - :func:`route_shards`: each local shard record goes to its *chunk
  owner* (``crc32(storage key, offsets) % world``), so a chunk's copies (its
  data-parallel replicas) meet on one rank. Later :func:`assign_writes` turns the
  owners' replies into the chunks this rank writes.
* **chunk owner** - :func:`chunk_owner_step`: groups the copies of each chunk,
  picks the main replica, and the *holder set* of ranks that may write it (the
  copies with the main's sizes, dtype and data). Replies to each member with
  ``(holder-set digest, size, its position)``; forwards to the *key owner*
  (``crc32(key) % world``) one :class:`~.integrity.Holding` per chunk and
  signature plus the main records - not the replicas.
* **key owner** - :func:`key_owner_step`: validates its keys with the same checks
  and messages as before (:func:`~.integrity.validate_key_records`) and keeps a
  per-key summary (signature, number and digest of main chunks) that rank 0's
  commit checks the written chunks against.

Write balancing happens inside each holder set without another message: its
members hold the same chunks, so each computes the same largest-first assignment
to the least-loaded position (ties rotated by the set's digest) and keeps its own.
What a rank receives is proportional to the copies of the chunks it owns plus
its own shards - flat in the world size for a fixed model-parallel layout.
"""

from __future__ import annotations

import heapq
import math
import zlib
from array import array
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import CheckpointingException
from .integrity import Holding, validate_key_records
from .records import MessageWriter, decode, decode_runs, digest64, encode_runs
from .shards import ShardMeta, object_storage_key
from .storage_keys import collision_message

KIND_CODES = {"tensor": 0, "object": 1}
KIND_NAMES = ("tensor", "object")
CLAIM = 2  # in a forward's kind position: an object's storage key, sent to that key's owner
MAIN, HAS_DATA = 1, 2


def chunk_token(storage_key: str, offsets: Optional[Sequence[int]]) -> bytes:
    """Identity of one stored chunk as bytes (hashed for ownership and digests)."""
    return (storage_key + "@" + ("" if offsets is None else ",".join(map(str, offsets)))).encode()


def owner_of(token: bytes, world: int) -> int:
    return zlib.crc32(token) % max(world, 1)


def key_owner(key: str, world: int) -> int:
    """Rank that validates ``key`` (same formula as :func:`~.integrity.owner_of_key`)."""
    return zlib.crc32(key.encode()) % max(world, 1)


# --------------------------------------------------------------------------- holder -> chunk owner
DIRECT_ABOVE = 64  # more writer candidates than this and ...
DIRECT_BELOW_ELEMENTS = 1 << 20  # ... fewer elements: the chunk owner picks the writer itself
COMPACT = -1  # in a record's key position: a non-main copy sent as (digest, flags)
DETAIL = -1  # in a reply's digest position: "send this record in full"


def record_digest(key: str, kind: int, dtype: str, global_shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> int:
    """Digest of everything in a record but its rank, main flag and data flag.

    A non-main copy identical to its main replica (the data-parallel case) is sent
    as this digest: the chunk owner matches it against the main's full record.
    """
    return digest64(f"{key}\0{kind}\0{dtype}\0{tuple(global_shape)}\0{tuple(offsets)}\0{tuple(sizes)}".encode())


def _put_shard(w: MessageWriter, idx: int, m: ShardMeta, full: bool = True) -> None:
    flags = (MAIN if m.is_main else 0) | (HAS_DATA if m.has_data else 0)
    if not full:
        w.add(idx, COMPACT, record_digest(m.key, KIND_CODES[m.kind], m.dtype, m.global_shape, m.offsets, m.sizes), flags)
        return
    w.add(idx, w.sid(m.key), KIND_CODES[m.kind], w.sid(m.dtype), flags,
          len(m.global_shape), *m.global_shape, *m.offsets, *m.sizes)


@dataclass
class Routed:
    """What a holder sends: ``messages[owner]``; ``digest`` identifies the whole local input."""

    messages: Dict[int, bytes]
    digest: int


def route_shards(
    metas: Sequence[ShardMeta], rank: int, world: int, options: str = "", only: Optional[Sequence[int]] = None
) -> Routed:
    """Step 1 (holder): each shard record to its chunk's owner.

    Main replicas go in full; other copies as a 16-byte digest (see
    :func:`record_digest`), completed only if the owner asks (:func:`detail_requests`).
    ``only`` (indices into ``metas``) sends just those records, in full.
    ``digest`` covers the records, ``rank``, ``world`` and ``options``: equal digests on
    every rank mean the same global input, hence the same plan (see "plan once, reuse").
    """
    writers: Dict[int, MessageWriter] = {}
    for i in range(len(metas)) if only is None else only:
        m = metas[i]
        if len(m.offsets) != len(m.global_shape) or len(m.sizes) != len(m.global_shape):
            raise ValueError(f"shard record of {m.key!r} has offsets/sizes of another rank than its global shape")
        d = owner_of(chunk_token(m.storage_key, m.offsets), world)
        w = writers.get(d)
        if w is None:
            w = writers[d] = MessageWriter()
            w.add(rank)
        _put_shard(w, i, m, full=only is not None or m.is_main)
    messages = {d: w.tobytes() for d, w in sorted(writers.items())}
    head = f"{rank}/{world}/{options}/{len(metas)}".encode()
    return Routed(messages, digest64(head, *(d.to_bytes(8, "little") + b for d, b in messages.items())))


def _read_shards(msg: bytes):
    """Yield ``(src, idx, key, kind, dtype, flags, global_shape, offsets, sizes)`` of a holder's message.

    A compact copy yields ``(src, idx, None, digest, None, flags, None, None, None)``.
    """
    strings, ints = decode(msg)
    src, p, n = ints[0], 1, len(ints)
    while p < n:
        if ints[p + 1] == COMPACT:
            yield src, ints[p], None, ints[p + 2], None, ints[p + 3], None, None, None
            p += 4
            continue
        idx, ks, kind, ds, flags, nd = ints[p : p + 6]
        p += 6
        gshape = tuple(ints[p : p + nd])
        offsets = tuple(ints[p + nd : p + 2 * nd])
        sizes = tuple(ints[p + 2 * nd : p + 3 * nd])
        p += 3 * nd
        yield src, idx, strings[ks], kind, strings[ds], flags, gshape, offsets, sizes


def decode_shards(msg: bytes) -> List[ShardMeta]:
    """The records of a :func:`route_shards`-style message as main-replica ShardMetas of its sender."""
    out = []
    for src, _idx, key, kind, dtype, flags, gshape, offsets, sizes in _read_shards(msg):
        if key is None:
            raise ValueError("decode_shards: a compact record has no content")
        out.append(ShardMeta(key, KIND_NAMES[kind], src, dtype, gshape, offsets, sizes, (0,), 0, has_data=bool(flags & HAS_DATA)))
    return out


def encode_shards(metas: Sequence[ShardMeta], rank: int) -> bytes:
    """Records of ``metas`` in one message (e.g. a rank's write assignment, for the zarr layout)."""
    w = MessageWriter()
    w.add(rank)
    for i, m in enumerate(metas):
        _put_shard(w, i, m)
    return w.tobytes()


# --------------------------------------------------------------------------- chunk owner
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
    chunks: Dict[Tuple, List[Tuple]] = defaultdict(list)  # chunk id -> full records
    compact: Dict[int, List[Tuple[int, int, int]]] = defaultdict(list)  # record digest -> (src, idx, flags)
    for msg in inbox:
        for src, idx, key, kind, dtype, flags, gshape, offsets, sizes in _read_shards(msg):
            if key is None:  # a compact copy: ``kind`` holds its record digest
                compact[kind].append((src, idx, flags))
            else:
                chunks[(key, kind, offsets, gshape if kind == 1 else ())].append((src, idx, dtype, gshape, sizes, flags))
    forwards: Dict[int, MessageWriter] = {}
    answers: Dict[int, MessageWriter] = {}

    def answer(dst: int, *values: int) -> None:
        a = answers.get(dst)
        if a is None:
            a = answers[dst] = MessageWriter()
        a.add(*values)

    for (key, kind, offsets, _), recs in chunks.items():
        recs.sort()
        # the copies identical to a main replica of this chunk, by content (dtype, shape, sizes)
        copies: Dict[Tuple, List[Tuple[int, int, int]]] = {}
        if compact:
            for r in recs:
                content = (r[2], r[3], r[4])
                if r[5] & MAIN and content not in copies:
                    copies[content] = compact.pop(record_digest(key, kind, r[2], r[3], offsets, r[4]), [])
        by_sig: Dict[Tuple, List[Tuple]] = defaultdict(list)
        for r in recs:
            by_sig[(r[2], r[3])].append(r)
        ko = key_owner(key, world)
        w = forwards.get(ko)
        if w is None:
            w = forwards[ko] = MessageWriter()
        for (dtype, gshape), group in by_sig.items():
            mains = [r for r in group if r[5] & MAIN]
            w.add(w.sid(key), kind, w.sid(dtype), len(gshape), *gshape, *offsets, len(mains))
            for r in mains:
                w.add(r[0], *r[4])
            holders = {r[0] for r in group}
            for content, cs in copies.items():
                if content[0] == dtype and content[1] == gshape:
                    holders.update(c[0] for c in cs)
            runs = encode_runs(sorted(holders))
            w.add(len(runs), *runs)
        if kind == 1:
            # A ShardedObject is stored under its unique key; the owner of that name (where a
            # ShardedTensor of the same name would be validated) checks that nothing else uses it.
            skey = object_storage_key(key, offsets, recs[0][3])
            cw = forwards.get(key_owner(skey, world))
            if cw is None:
                cw = forwards[key_owner(skey, world)] = MessageWriter()
            runs = encode_runs(sorted({r[0] for r in recs}))
            cw.add(cw.sid(skey), CLAIM, cw.sid(key), len(runs), *runs)
        if not replies:
            continue
        main = next((r for r in recs if r[5] & MAIN), None)
        if main is None:
            continue  # nothing to write (validation reports it)
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
            answer(rank, idx, hdig, n, pos)
    # copies matching no main replica here: differ from it, or their chunk has none
    for cs in compact.values():
        for src, idx, _flags in cs:
            answer(src, idx, DETAIL, 0, 0)
    return (
        {d: w.tobytes() for d, w in sorted(forwards.items())},
        {d: w.tobytes() for d, w in sorted(answers.items())},
    )


# --------------------------------------------------------------------------- key owner
@dataclass(frozen=True)
class KeySummary:
    """What rank 0's commit checks the written chunks of one key against."""

    key: str
    kind: str
    dtype: str
    global_shape: Tuple[int, ...]
    chunks: int  # distinct chunks with a main replica (each is written exactly once)
    token_sum: int  # sum of the chunks' digests modulo 2**62


_MOD = 1 << 62


def chunk_digest(storage_key: str, offsets: Optional[Sequence[int]]) -> int:
    return digest64(chunk_token(storage_key, offsets)) % _MOD


def key_owner_step(inbox: Iterable[bytes], *, validate: bool = True) -> Tuple[List[str], List[KeySummary]]:
    """Step 3 (key owner): integrity problems of the owned keys (sorted by key) and their summaries."""
    mains: Dict[Tuple[str, int], List[ShardMeta]] = defaultdict(list)
    holdings: Dict[Tuple[str, int], List[Holding]] = defaultdict(list)
    claims: Dict[str, Dict[Tuple[str, str], set]] = defaultdict(dict)  # storage key -> (kind, key) -> ranks
    for msg in inbox:
        strings, ints = decode(msg)
        p, n = 0, len(ints)
        while p < n:
            ks, kind, ds, nd = ints[p : p + 4]
            p += 4
            if kind == CLAIM:  # (storage key, CLAIM, object key, #runs, runs...)
                claims[strings[ks]].setdefault(("object", strings[ds]), set()).update(decode_runs(ints[p : p + nd]))
                p += nd
                continue
            gshape = tuple(ints[p : p + nd])
            offsets = tuple(ints[p + nd : p + 2 * nd])
            nmain = ints[p + 2 * nd]
            p += 2 * nd + 1
            key, dtype, kname = strings[ks], strings[ds], KIND_NAMES[kind]
            for _ in range(nmain):
                mains[(key, kind)].append(
                    ShardMeta(key, kname, ints[p], dtype, gshape, offsets, tuple(ints[p + 1 : p + 1 + nd]), (0,), 0)
                )
                p += 1 + nd
            nr = ints[p]
            holdings[(key, kind)].append(Holding(kname, dtype, gshape, offsets, tuple(ints[p + 1 : p + 1 + nr])))
            p += 1 + nr
    problems: List[str] = []
    summaries: List[KeySummary] = []
    # storage-key collisions (always refused, validation or not): a name claimed by an object
    # and also a tensor key, or by objects of different keys
    for skey in sorted(claims):
        items = dict(claims[skey])
        if (skey, 0) in holdings:
            items[("tensor", skey)] = {r for h in holdings[(skey, 0)] for r in decode_runs(h.runs)}
        if len(items) > 1:
            problems.append(collision_message(skey, items))
    by_key: Dict[str, List[Tuple[str, int]]] = defaultdict(list)
    for k in holdings:
        by_key[k[0]].append(k)
    for key in sorted(by_key):
        if validate:
            ms = [m for k in by_key[key] for m in mains.get(k, [])]
            hs = [h for k in by_key[key] for h in holdings[k]]
            problems.extend(validate_key_records(key, sorted(ms, key=lambda m: (m.rank, m.offsets)), hs))
        for k in sorted(by_key[key], key=lambda k: k[1]):
            hs = sorted(holdings[k], key=lambda h: h.runs[0])
            first = hs[0]
            ids = {}
            for m in mains.get(k, []):
                if m.kind == "tensor":
                    ids[(m.key, m.offsets)] = True
                else:  # stored by unique key, without offsets (as the writer reports it)
                    ids[(object_storage_key(m.key, m.offsets, m.global_shape), None)] = True
            total = sum(chunk_digest(sk, off) for sk, off in ids) % _MOD
            summaries.append(KeySummary(key, first.kind, first.dtype, first.global_shape, len(ids), total))
    return problems, summaries


def encode_summaries(w: MessageWriter, summaries: Sequence[KeySummary]) -> None:
    w.add(len(summaries))
    for s in summaries:
        w.add(w.sid(s.key), KIND_CODES[s.kind], w.sid(s.dtype), len(s.global_shape), *s.global_shape, s.chunks, s.token_sum)


def _read_summaries(strings: List[str], ints: List[int], p: int) -> Tuple[List[KeySummary], int]:
    out = []
    for _ in range(ints[p]):
        ks, kind, ds, nd = ints[p + 1 : p + 5]
        gshape = tuple(ints[p + 5 : p + 5 + nd])
        chunks, token_sum = ints[p + 5 + nd], ints[p + 6 + nd]
        out.append(KeySummary(strings[ks], KIND_NAMES[kind], strings[ds], gshape, chunks, token_sum))
        p += 6 + nd
    return out, p + 1


# --------------------------------------------------------------------------- holder: write assignment
def assign_writes(metas: Sequence[ShardMeta], replies: Iterable[bytes]) -> List[int]:
    """Step 4 (holder): indices into ``metas`` of the chunks this rank writes, in chunk order.

    Within each holder set the members compute the same greedy assignment (largest
    chunk first to the least-loaded position, ties rotated by the set's digest so
    small sets do not all pick their first member) and keep their own chunks.
    """
    groups: Dict[Tuple[int, int], List[Tuple]] = defaultdict(list)
    for msg in replies:
        _, ints = decode(msg)
        for p in range(0, len(ints), 4):
            idx, hdig, n, pos = ints[p : p + 4]
            if hdig == DETAIL:
                continue
            m = metas[idx]
            groups[(hdig, n)].append((-m.nbytes, m.storage_key, m.offsets, idx, pos))
    mine: List[int] = []
    for (hdig, n), items in groups.items():
        if n == 1:
            mine.extend(it[3] for it in items)
            continue
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
    out = []
    for msg in replies:
        _, ints = decode(msg)
        out.extend(ints[p] for p in range(0, len(ints), 4) if ints[p + 1] == DETAIL)
    return sorted(out)


# --------------------------------------------------------------------------- writers -> rank 0
@dataclass(frozen=True)
class Written:
    """One stored item as rank 0 records it (``sizes`` None for objects and zarr items)."""

    storage_key: str
    offsets: Optional[Tuple[int, ...]]
    sizes: Optional[Tuple[int, ...]]
    relative_path: str
    offset: int
    length: int
    checksum: int  # the item digest (CRC32 or XXH3-64: up to 64 bits)
    # tensor items of torch_dist: (data offset, data length, block size, block digests)
    blocks: Optional[Tuple[int, int, int, Sequence[int]]] = None


def _halves(digests: Sequence[int]) -> List[int]:
    """Unsigned 64-bit digests as pairs of signed 32-bit integers (low, high), so that messages
    of digests keep 4-byte integers (numpy for long lists; a loop is faster for a few)."""
    if len(digests) > 8:
        return np.asarray(digests, dtype="<u8").view("<i4").tolist()
    out: List[int] = []
    for d in digests:
        lo, hi = d & 0xFFFFFFFF, d >> 32
        out += (lo - (1 << 32) if lo >> 31 else lo, hi - (1 << 32) if hi >> 31 else hi)
    return out


def _joined(ints: Sequence[int]) -> List[int]:
    """Inverse of :func:`_halves`."""
    if len(ints) > 16:
        return np.asarray(ints, dtype="<i4").view("<u8").tolist()
    return [(ints[i] & 0xFFFFFFFF) | ((ints[i + 1] & 0xFFFFFFFF) << 32) for i in range(0, len(ints), 2)]


def encode_finalize(error: Optional[str], written: Sequence[Written], summaries: Sequence[KeySummary]) -> bytes:
    """A rank's phase-3 message to rank 0: its error, what it wrote, the summaries of its keys.

    Empty (zero bytes) for a rank with nothing to report, so rank 0 receives O(unique
    chunks + keys) bytes plus one size per rank.
    """
    if not error and not written and not summaries:
        return b""
    w = MessageWriter()
    w.sid(error or "")
    w.add(1 if error else 0, len(written))
    for it in written:
        nd = -1 if it.offsets is None else len(it.offsets)
        w.add(w.sid(it.storage_key), nd, *(it.offsets or ()), 1 if it.sizes is not None else 0, *(it.sizes or ()),
              w.sid(it.relative_path), it.offset, it.length, *_halves([it.checksum]))
        if it.blocks is None:
            w.add(-1)
        else:
            data_offset, data_length, block_size, digests = it.blocks
            w.add(len(digests), data_offset, data_length, block_size)
            w.extend(_halves(digests))
    encode_summaries(w, summaries)
    return w.tobytes()


def decode_finalize(msg: bytes) -> Tuple[Optional[str], List[Written], List[KeySummary]]:
    if not msg:
        return None, [], []
    strings, ints = decode(msg)
    error = strings[0] if ints[0] else None
    items = []
    p = 2
    for _ in range(ints[1]):
        sk, nd = ints[p : p + 2]
        p += 2
        offsets = None if nd < 0 else tuple(ints[p : p + nd])
        p += max(nd, 0)
        sizes = None
        if ints[p]:
            sizes = tuple(ints[p + 1 : p + 1 + nd])
            p += nd
        p += 1
        path, offset, length, (digest,) = strings[ints[p]], ints[p + 1], ints[p + 2], _joined(ints[p + 3 : p + 5])
        p += 5
        nb = ints[p]
        blocks = None
        if nb >= 0:
            blocks = (ints[p + 1], ints[p + 2], ints[p + 3], _joined(ints[p + 4 : p + 4 + 2 * nb]))
            p += 3 + 2 * nb
        p += 1
        items.append(Written(strings[sk], offsets, sizes, path, offset, length, digest, blocks))
    summaries, p = _read_summaries(strings, ints, p)
    return error, items, summaries


@dataclass
class CommitLayout:
    """What rank 0's commit writes into ``.metadata``: O(unique chunks), built from compact records."""

    tensors: Dict[str, Tuple[str, Tuple[int, ...], List[Tuple[Tuple[int, ...], Tuple[int, ...]]]]] = field(default_factory=dict)
    objects: List[str] = field(default_factory=list)
    written: List[Written] = field(default_factory=list)


def commit_layout(written: Sequence[Written], summaries: Sequence[KeySummary], check_layout: bool = True) -> CommitLayout:
    """Tensor layouts (dtype name, global shape, chunk boxes) and object keys for the commit.

    With ``check_layout`` every summarised key must have exactly its main chunks
    written, once each; anything else is an internal error naming the key.
    """
    out = CommitLayout(written=list(written))
    seen: Dict[Tuple[str, Optional[Tuple[int, ...]]], Written] = {}
    for it in written:
        cid = (it.storage_key, it.offsets)
        if cid in seen:
            raise CheckpointingException(
                f"internal error: chunk {it.offsets} of {it.storage_key!r} was written twice "
                f"({seen[cid].relative_path} and {it.relative_path})"
            )
        seen[cid] = it
    if not check_layout:
        return out
    by_key: Dict[str, List[Written]] = defaultdict(list)
    for it in written:
        key = it.storage_key if it.sizes is not None else it.storage_key.rsplit("/shard_", 1)[0]
        by_key[key].append(it)
    for s in sorted(summaries, key=lambda s: (s.key, s.kind)):
        items = [it for it in by_key.get(s.key, []) if (it.sizes is not None) == (s.kind == "tensor")]
        total = sum(chunk_digest(it.storage_key, it.offsets) for it in items) % _MOD
        if len(items) != s.chunks or total != s.token_sum:
            raise CheckpointingException(
                f"internal error: {s.chunks} chunks of {s.key!r} should have been written, "
                f"{len(items)} were (not written by any rank, or by the wrong ranks)"
            )
        if s.kind == "tensor":
            out.tensors[s.key] = (s.dtype, s.global_shape, sorted((it.offsets, it.sizes) for it in items))
        else:
            out.objects.extend(it.storage_key for it in items)
    unknown = sorted(set(by_key) - {s.key for s in summaries})
    if unknown:
        raise CheckpointingException(f"internal error: chunks of {unknown[:5]} were written but no rank planned them")
    out.objects.sort()
    return out

