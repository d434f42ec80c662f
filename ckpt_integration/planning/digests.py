"""64-bit digests of metadata records computed on whole arrays of records (planning layer).

The save's exchange hashes every record: to pick its chunk's owner, to match a data-parallel
copy with its main replica, and to check at commit time that exactly the validated chunks were
written (a sum of chunk digests per key). Hashing a formatted string per record costs a few
microseconds in Python, which with tens of thousands of records per rank is most of a save's
planning time; here a string (a key, a dtype name) is hashed once, and the integers of every
record are folded in with vectorised 64-bit arithmetic (the SplitMix64 finaliser, a bijective
mix with good avalanche), one numpy pass per column. The digests are not stored anywhere: they
only have to agree between the ranks of one job.

Example::

    keys = string_digests(["layer.weight", "layer.bias"])
    offsets = np.array([[0, 0], [4, 0]])
    mix(keys, offsets)   # one uint64 per record
"""

from __future__ import annotations

import hashlib
from typing import Dict, Optional, Sequence

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = 0x9E3779B97F4A7C15
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
MASK63 = (1 << 63) - 1


def fmix(z: np.ndarray) -> np.ndarray:
    z = z ^ (z >> _S30)
    z = z * _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


_cache: Dict[str, int] = {}


def string_digest(s: str) -> int:
    """A 64-bit digest of ``s`` (blake2b; cached: keys and dtype names repeat)."""
    d = _cache.get(s)
    if d is None:
        d = int.from_bytes(hashlib.blake2b(s.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
        if len(_cache) < 1 << 20:
            _cache[s] = d
    return d


def string_digests(strings: Sequence[str]) -> np.ndarray:
    """:func:`string_digest` of each string, as a uint64 array."""
    # (the cache looked up in one comprehension, the function called only for strings not in it:
    # a save or load looks up each of its keys several times)
    get = _cache.get
    found = [get(s) for s in strings]
    if None in found:
        found = [string_digest(s) if d is None else d for s, d in zip(strings, found)]
    return np.array(found, dtype=np.uint64)


def mix(h: np.ndarray, columns: Optional[np.ndarray]) -> np.ndarray:
    """Fold the integer ``columns`` (shape ``(m, k)``, or None for no columns) into the uint64
    digests ``h`` (shape ``(m,)``), column by column; ``k`` itself is folded in too, so that
    records of different lengths never share a digest by construction."""
    h = np.asarray(h, dtype=np.uint64)
    k = 0 if columns is None else columns.shape[1]
    out = fmix(h ^ np.uint64((_GOLDEN * (k + 1)) & 0xFFFFFFFFFFFFFFFF))
    for j in range(k):
        col = np.ascontiguousarray(columns[:, j]).astype(np.int64, copy=False).view(np.uint64)
        out = fmix(out ^ (col + np.uint64((_GOLDEN * (j + 2)) & 0xFFFFFFFFFFFFFFFF)))
    return out


def chunk_digests(key_digests: np.ndarray, offsets: Optional[np.ndarray]) -> np.ndarray:
    """Digest of each stored chunk ``(storage key, offsets)`` (``offsets`` None: objects, stored
    under their unique key without offsets; shape ``(m, nd)`` else)."""
    if offsets is None:
        return mix(key_digests, np.full((len(key_digests), 1), -1, dtype=np.int64))
    return mix(key_digests, offsets)


def halves(d: np.ndarray) -> np.ndarray:
    """uint64 digests as two int32 values each (low, high): shape ``(2, m)``, for messages whose
    other integers fit 32 bits."""
    return np.ascontiguousarray(np.asarray(d, dtype=np.uint64)).view(np.int32).reshape(-1, 2).T.astype(np.int64)


def joined(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Inverse of :func:`halves`."""
    return (np.asarray(lo, dtype=np.int64).astype(np.uint32).astype(np.uint64)
            | (np.asarray(hi, dtype=np.int64).astype(np.uint32).astype(np.uint64) << np.uint64(32)))
