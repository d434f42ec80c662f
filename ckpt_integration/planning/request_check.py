"""A load's request check when every requested shard is one whole saved chunk (a same-layout resume).

The general check (:mod:`.exchange`: shard records to chunk owners, holdings to key owners,
where the main replicas of each key must tile its global shape exactly) compares requests with
each other, because in general they are unrelated boxes. When every rank's every request is
exactly one chunk of the checkpoint (its box, dtype and global shape those stored: checked by
the rank against the checkpoint's index while planning its reads), the same conditions are
statements about saved chunks, which every rank numbers alike from the index it was given:

* the main replicas of a key tile it exactly  <=>  each saved chunk of the key is requested as a
  main replica by exactly one rank (the saved chunks tile the key: a save refuses anything else);
* a copy (a non-main replica) has a main replica somewhere  <=>  its key's chunks do (above);
* dtypes and global shapes agree between ranks  <=>  each agrees with the checkpoint (checked).

So a request is a row of four integers ``(key, chunks of the key, chunk, main)``, where ``key``
is the position of the key's chunk records in the index (an object cell: the negated digest of
its storage key, with one chunk), and one all-to-all sends each row to its key's owner, which
counts. About 1 us per request instead of ~10 for records, routing and the general validation;
the general check runs only when this one finds a problem, to name it in its words.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Sequence, Tuple

import numpy as np

from .records import digest64, segments, split_by

ROW = 4  # key, chunks of the key, chunk, main (1) or copy (0)
_MIX = np.uint64(0x9E3779B97F4A7C15)  # (spreads key positions, which grow in steps, over the owners)


def object_place(storage_key: str) -> Tuple[int, int, int]:
    """The place of a ShardedObject cell in a request row: a negative id from its storage key (key
    positions are >= 0), one chunk, chunk 0."""
    return -1 - (digest64(storage_key.encode()) >> 1), 1, 0


def owners(keys: np.ndarray, world: int) -> np.ndarray:
    """The rank that checks each key (``keys``: int64 ids of :data:`ROW` rows)."""
    with np.errstate(over="ignore"):
        return ((keys.astype(np.uint64) * _MIX) >> np.uint64(33)) % np.uint64(max(world, 1))


def route_requests(rows: Sequence[Tuple[int, int, int, int]], world: int) -> Dict[int, bytes]:
    """Each request row to its key's owner, as little-endian int64 bytes."""
    if not len(rows):
        return {}
    table = np.asarray(rows, dtype=np.int64).reshape(-1, ROW)
    return {d: table[sel].astype("<i8").tobytes() for d, sel in split_by(owners(table[:, 0], world).astype(np.int64))}


def request_problems(messages: Iterable[bytes], limit: int = 20) -> List[str]:
    """What is wrong with the rows a key owner received (empty: the requests of its keys are
    valid). Problems name keys by their index position: the general check names them."""
    parts = [np.frombuffer(m, dtype="<i8") for m in messages if m]
    if not parts:
        return []
    flat = np.concatenate(parts)
    if len(flat) % ROW:
        return ["request rows of a wrong length"]
    t = flat.reshape(-1, ROW)
    # by key, its main replicas first and those by chunk: a key is valid when its main replicas
    # are chunks 0, 1, ..., n - 1 in that order (each once, none missing), one vectorised pass
    t = t[np.lexsort([t[:, 2], -t[:, 3], t[:, 0]])]
    key, n, chunk, main = t[:, 0], t[:, 1], t[:, 2], t[:, 3] == 1
    starts, lengths = segments(key)
    first = np.repeat(starts, lengths)
    bad_row = (main & (chunk != np.arange(len(key)) - first)) | (n != n[first])
    mains = np.add.reduceat(main.astype(np.int64), starts)
    bad = (mains != n[starts]) | (n[starts] < 1) | (np.maximum.reduceat(bad_row.astype(np.int8), starts) > 0)
    problems: List[str] = []
    for s in starts[bad][:limit].tolist():
        e = s + int(lengths[np.searchsorted(starts, s)])
        count = int(n[s])
        got = np.bincount(np.clip(chunk[s:e][main[s:e]], 0, max(count, 0)), minlength=count + 1)[:count]
        wrong = np.flatnonzero(got != 1)[:3].tolist()
        problems.append(f"key #{int(key[s])} of {count} chunks: chunks {wrong} requested as main replica by "
                        f"{[int(got[i]) for i in wrong]} ranks (exactly one each)")
    return problems
