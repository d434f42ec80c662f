"""Compact wire format for metadata that ranks exchange: a string table and one integer array.

A message is ``MAGIC | header | strings | integers``: every string (key, dtype or
file name) appears once per message and records refer to it by index; everything
else is an integer, stored as int32 when all values fit and int64 otherwise.
Compared with pickled dataclasses this is several times smaller, (de)serialises in
C loops, and decoding bytes from another rank (or from a checkpoint) can never
execute code.

Example::

    w = MessageWriter()
    w.add(w.sid("layer.weight"), 3, 4)
    strings, ints = decode(w.tobytes())   # (["layer.weight"], [0, 3, 4])
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from typing import Iterable, List, Sequence, Tuple

MAGIC = b"CKR1"
_HEADER = struct.Struct("<4sBIII")  # magic, bytes per int, #strings, string bytes, #ints
_INT32 = (-(1 << 31), (1 << 31) - 1)


class MessageWriter:
    """Builds one message: intern strings with :meth:`sid`, append integers with :meth:`add`."""

    __slots__ = ("strings", "_ids", "ints")

    def __init__(self) -> None:
        self.strings: List[str] = []
        self._ids: dict = {}
        self.ints: List[int] = []

    def sid(self, s: str) -> int:
        """Index of ``s`` in this message's string table (added on first use)."""
        i = self._ids.get(s)
        if i is None:
            i = self._ids[s] = len(self.strings)
            self.strings.append(s)
        return i

    def add(self, *values: int) -> None:
        self.ints.extend(values)

    def extend(self, values: Iterable[int]) -> None:
        self.ints.extend(values)

    def __bool__(self) -> bool:
        return bool(self.ints) or bool(self.strings)

    def tobytes(self) -> bytes:
        return encode(self.strings, self.ints)


def encode(strings: Sequence[str], ints: Sequence[int]) -> bytes:
    raw = [s.encode("utf-8", "surrogatepass") for s in strings]
    lengths = array("I", map(len, raw))
    blob = lengths.tobytes() + b"".join(raw)
    wide = bool(ints) and (min(ints) < _INT32[0] or max(ints) > _INT32[1])
    body = array("q" if wide else "i", ints)
    return _HEADER.pack(MAGIC, 8 if wide else 4, len(raw), len(blob), len(body)) + blob + body.tobytes()


def decode(buf: bytes) -> Tuple[List[str], List[int]]:
    """Inverse of :func:`encode`; raises ``ValueError`` on anything that is not such a message."""
    if len(buf) < _HEADER.size:
        raise ValueError(f"metadata message of {len(buf)} bytes is too short")
    magic, width, nstr, nblob, nints = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC or width not in (4, 8):
        raise ValueError("not a metadata message (bad magic)")
    pos = _HEADER.size
    if len(buf) != pos + nblob + nints * width or nblob < 4 * nstr:
        raise ValueError("metadata message has an inconsistent length")
    body = array("q" if width == 8 else "i")
    if not nstr:  # the common small message (e.g. a replica's digest): integers only
        if nblob:
            raise ValueError("metadata message has an inconsistent string table")
        body.frombytes(buf[pos:])
        return [], body.tolist()
    lengths = array("I")
    lengths.frombytes(buf[pos : pos + 4 * nstr])
    p = pos + 4 * nstr
    strings = []
    for n in lengths:
        strings.append(bytes(buf[p : p + n]).decode("utf-8", "surrogatepass"))
        p += n
    if p != pos + nblob:
        raise ValueError("metadata message has an inconsistent string table")
    body.frombytes(buf[pos + nblob :])
    return strings, body.tolist()


def digest64(*parts: bytes) -> int:
    """Deterministic 63-bit digest (same on every rank and run, unlike ``hash``)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(p)
    return int.from_bytes(h.digest(), "little") >> 1


def encode_runs(ranks: Sequence[int]) -> List[int]:
    """Sorted distinct ranks as arithmetic runs ``[start, step, count, ...]``.

    Data-parallel groups are usually one run, so a holder set costs three integers
    whatever its size.
    """
    out: List[int] = []
    i, n = 0, len(ranks)
    while i < n:
        if i + 1 == n:
            out += (ranks[i], 1, 1)
            break
        step = ranks[i + 1] - ranks[i]
        j = i + 1
        while j + 1 < n and ranks[j + 1] - ranks[j] == step:
            j += 1
        out += (ranks[i], step, j - i + 1)
        i = j + 1
    return out


def decode_runs(runs: Sequence[int]) -> List[int]:
    out: List[int] = []
    for k in range(0, len(runs), 3):
        start, step, count = runs[k], runs[k + 1], runs[k + 2]
        out.extend(range(start, start + step * count, step) if count > 1 else (start,))
    return out
