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
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

MAGIC = b"CKR1"
_HEADER = struct.Struct("<4sBIII")  # magic, bytes per int, #strings, string bytes, #ints
_HEAD_DTYPE = np.dtype([("magic", "S4"), ("width", "u1"), ("nstr", "<u4"), ("nblob", "<u4"), ("nints", "<u4")])
_MAX_ND = 1 << 20  # table tags and dimension counts are below this (a table header beyond it is damage)
_INT32 = (-(1 << 31), (1 << 31) - 1)


class MessageWriter:
    """Builds one message: intern strings with :meth:`sid`, append integers with :meth:`add`
    (or whole integer arrays with :meth:`add_array`, e.g. a :func:`put_table` section)."""

    __slots__ = ("strings", "_ids", "ints", "_parts")

    def __init__(self) -> None:
        self.strings: List[str] = []
        self._ids: dict = {}
        self.ints: List[int] = []
        self._parts: List[np.ndarray] = []  # integers added so far as arrays, in order

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

    def add_array(self, values: np.ndarray) -> None:
        """Append the integers of ``values`` (any shape, in C order) without a Python loop."""
        if self.ints:
            self._parts.append(np.asarray(self.ints, dtype=np.int64))
            self.ints = []
        self._parts.append(np.asarray(values, dtype=np.int64).reshape(-1))

    def sids(self, strings: Sequence[str]) -> np.ndarray:
        """:meth:`sid` of each of ``strings``, as an array (tens of thousands of keys: one dict
        call per string; the table of strings is the dict's keys in insertion order)."""
        ids, known = self._ids, len(self.strings)
        out = np.fromiter((ids.setdefault(s, len(ids)) for s in strings), dtype=np.int64, count=len(strings))
        if len(ids) > known:
            _append_new(self.strings, strings, out.tolist())
        return out

    def __bool__(self) -> bool:
        return bool(self.ints) or bool(self.strings) or bool(self._parts)

    def int_values(self) -> Sequence[int]:
        """Every integer added so far (what :func:`decode` of :meth:`tobytes` gives, without encoding
        and decoding the message), as a memoryview of one int64 array: indexing and slicing give Python
        ints as a list's do, and no list of every integer is built (1.5 million at 16,384 ZeRO-1 ranks,
        of which a rank reads the few its keys need)."""
        if not self._parts:
            return list(self.ints)
        return memoryview(np.concatenate(self._parts + [np.asarray(self.ints, dtype=np.int64)]))

    def tobytes(self) -> bytes:
        if not self._parts:
            return encode(self.strings, self.ints)
        parts = self._parts + ([np.asarray(self.ints, dtype=np.int64)] if self.ints else [])
        return encode_array(self.strings, np.concatenate(parts))


def encode(strings: Sequence[str], ints: Sequence[int]) -> bytes:
    blob, nstr = _string_blob(strings)
    wide = bool(ints) and (min(ints) < _INT32[0] or max(ints) > _INT32[1])
    body = array("q" if wide else "i", ints)
    return _HEADER.pack(MAGIC, 8 if wide else 4, nstr, len(blob), len(body)) + blob + body.tobytes()


def _string_blob(strings: Sequence[str]) -> Tuple[bytes, int]:
    raw = [s.encode("utf-8", "surrogatepass") for s in strings]
    return array("I", map(len, raw)).tobytes() + b"".join(raw), len(raw)


def difference_ints(msg: Any, undo: bool = False) -> None:
    """Replace, in place, the integers of the message ``msg`` (a writable buffer: a bytearray or a
    memoryview of one) by their first differences, or (``undo``) back by their running sums. The
    arithmetic wraps in the message's integer width, so both ways are exact whatever the values;
    sorted offsets and repeated columns become small, repeating numbers that compress well."""
    magic, width, _nstr, nblob, nints = _HEADER.unpack_from(msg, 0)
    if magic != MAGIC or width not in (4, 8) or len(msg) != _HEADER.size + nblob + nints * width:
        raise ValueError("not a metadata message (bad magic or length)")
    a = np.frombuffer(msg, dtype=np.int32 if width == 4 else np.int64, count=nints, offset=_HEADER.size + nblob)
    if undo:
        np.cumsum(a, dtype=a.dtype, out=a)
    elif nints > 1:
        a[1:] = np.diff(a)  # (a new array first: no overlap)


def encode_array(strings: Sequence[str], ints: np.ndarray) -> bytes:
    """:func:`encode` of an integer array (same bytes as ``encode(strings, ints.tolist())``)."""
    blob, nstr = _string_blob(strings)
    wide = ints.size > 0 and (int(ints.min()) < _INT32[0] or int(ints.max()) > _INT32[1])
    body = ints.astype(np.int64 if wide else np.int32, copy=False)
    return _HEADER.pack(MAGIC, 8 if wide else 4, nstr, len(blob), ints.size) + blob + body.tobytes()


def decode_array(buf: bytes) -> Tuple[List[str], np.ndarray]:
    """:func:`decode` with the integers as one int64 array (for messages read with :func:`read_tables`)."""
    strings, body = _decode(buf, as_array=True)
    return strings, body


def decode(buf: bytes) -> Tuple[List[str], List[int]]:
    """Inverse of :func:`encode`; raises ``ValueError`` on anything that is not such a message."""
    return _decode(buf, as_array=False)


def _decode(buf: bytes, as_array: bool) -> Tuple[List[str], Any]:
    if len(buf) < _HEADER.size:
        raise ValueError(f"metadata message of {len(buf)} bytes is too short")
    magic, width, nstr, nblob, nints = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC or width not in (4, 8):
        raise ValueError("not a metadata message (bad magic)")
    pos = _HEADER.size
    if len(buf) != pos + nblob + nints * width or nblob < 4 * nstr:
        raise ValueError("metadata message has an inconsistent length")
    if as_array:
        if not nstr and nblob:
            raise ValueError("metadata message has an inconsistent string table")
        ints = np.frombuffer(buf, dtype=np.int64 if width == 8 else np.int32, count=nints, offset=pos + nblob)
        return (_strings(buf, pos, nstr, nblob) if nstr else []), ints.astype(np.int64)
    body = array("q" if width == 8 else "i")
    if not nstr:  # the common small message (e.g. a replica's digest): integers only
        if nblob:
            raise ValueError("metadata message has an inconsistent string table")
        body.frombytes(buf[pos:])
        return [], body.tolist()
    strings = _strings(buf, pos, nstr, nblob)
    body.frombytes(buf[pos + nblob :])
    return strings, body.tolist()


_LENGTHS: Dict[int, struct.Struct] = {}


def _strings(buf: bytes, pos: int, nstr: int, nblob: int) -> List[str]:
    lengths_of = _LENGTHS.get(nstr)
    if lengths_of is None:
        lengths_of = _LENGTHS[nstr] = struct.Struct(f"<{nstr}I") if nstr < 4096 else None
    lengths = lengths_of.unpack_from(buf, pos) if lengths_of is not None else array("I", bytes(buf[pos : pos + 4 * nstr]))
    p = pos + 4 * nstr
    end = pos + nblob
    if p + sum(lengths) != end:
        raise ValueError("metadata message has an inconsistent string table")
    raw = bytes(buf[p:end])
    if raw.isascii():  # one decode, then slices (byte and character offsets agree)
        text = raw.decode("ascii")
        out, q = [], 0
        for n in lengths:
            out.append(text[q : q + n])
            q += n
        return out
    out, q = [], 0
    for n in lengths:
        out.append(raw[q : q + n].decode("utf-8", "surrogatepass"))
        q += n
    return out


# --------------------------------------------------------------------------- tables
# A *table* section inside a message's integers: ``[tag, nd, count]`` followed by ``width``
# columns of ``count`` integers each (column after column), so that a message of thousands of
# records of one layout is written and read by numpy instead of a loop per record. ``width``
# is a function of the tag and ``nd`` (the number of dimensions of the records' shapes), known
# to both sides (see :func:`read_tables`).


def segments(sorted_ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Start index and length of each run of equal values in a sorted array."""
    if not len(sorted_ids):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    return starts, np.diff(np.r_[starts, len(sorted_ids)])


def split_by(values: np.ndarray) -> List[Tuple[int, np.ndarray]]:
    """The indices of ``values`` grouped by value: ``(value, indices)`` per distinct value, values
    ascending and indices ascending within each (a stable sort); e.g. rows by destination rank."""
    if not len(values):
        return []
    order = np.argsort(values, kind="stable")
    return [(int(values[sel[0]]), sel) for sel in np.split(order, np.flatnonzero(np.diff(values[order])) + 1)]


def group_rows(rows: np.ndarray) -> List[Tuple[List[int], np.ndarray]]:
    """The distinct rows of an integer table ``rows`` (``(n, k)``), in ascending (lexicographic)
    order, each with the indices of the rows equal to it (ascending): what ``np.unique(rows,
    axis=0)`` and a mask per group give, without its sort of rows as records (~7 ms for 10,000
    rows of a few small integers, against well under 1 ms for one integer per row)."""
    if len(rows) == 0:
        return []
    lo = rows.min(axis=0)
    span = rows.max(axis=0) - lo + 1
    if float(np.prod(span.astype(np.float64))) >= 2.0 ** 62:  # (not one int64 per row: the general sort)
        uniq, inverse = np.unique(rows, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        return [(u, np.flatnonzero(inverse == i)) for i, u in enumerate(uniq.tolist())]
    code = np.zeros(len(rows), dtype=np.int64)
    for j in range(rows.shape[1]):  # mixed radix, the first column most significant
        code = code * int(span[j]) + (rows[:, j] - lo[j])
    order = np.argsort(code, kind="stable")
    ordered = code[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], len(ordered)]
    return [(rows[order[a]].tolist(), order[a:b]) for a, b in zip(starts.tolist(), ends.tolist())]


def put_table(w: MessageWriter, tag: int, nd: int, columns: Sequence[np.ndarray]) -> None:
    """Append a table of equally long integer ``columns`` (each an array or a 2-D block of columns,
    shape ``(k, count)``)."""
    cols = [np.asarray(c, dtype=np.int64).reshape(-1, np.shape(c)[-1]) for c in columns]
    count = cols[0].shape[1] if cols else 0
    w.add(tag, nd, count)
    w.add_array(np.concatenate(cols, axis=0) if len(cols) > 1 else cols[0])


def read_tables(ints: np.ndarray, p: int, widths: Dict[int, Any]) -> Iterable[Tuple[int, int, np.ndarray]]:
    """Yield ``(tag, nd, block)`` for every table from position ``p`` to the end, ``block`` of shape
    ``(width, count)`` with ``width = widths[tag](nd)``; ValueError for anything malformed."""
    n = len(ints)
    while p < n:
        if p + 3 > n:
            raise ValueError("metadata message ends inside a table header")
        tag, nd, count = (int(x) for x in ints[p : p + 3])
        width_of = widths.get(tag)
        if width_of is None or nd < 0 or count < 0:
            raise ValueError(f"metadata message has an unknown table (tag {tag}, nd {nd}, count {count})")
        width = width_of(nd)
        end = p + 3 + width * count
        if end > n or width < 0:
            raise ValueError("metadata message ends inside a table")
        yield tag, nd, ints[p + 3 : end].reshape(width, count)
        p = end


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


def runs(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The positions ``starts[i], ..., starts[i] + counts[i] - 1`` of every run ``i``, in order
    (each run's start repeated per element, plus the element's place in its run)."""
    return np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()), dtype=np.int64)


def _append_new(table: List[str], strings: Sequence[str], ids: Sequence[int]) -> None:
    """Append to ``table`` (the strings in id order) those of ``strings`` that were just given new ids:
    the first occurrence of a new string has the id ``len(table)``. (Taking the dict's new keys with
    ``islice(ids, known, None)`` walked past every known key: per message of rank 0's commit, so
    quadratic in the ranks' file names: 2.1 s of rank 0's 3.6 s commit at 16,384 simulated ranks.)"""
    n = len(table)
    for s, j in zip(strings, ids):
        if j == n:
            table.append(s)
            n += 1


def _cut(buf: bytes, starts: np.ndarray, counts: np.ndarray) -> bytes:
    """The byte ranges ``[starts[i], starts[i] + counts[i])`` of ``buf``, joined (slices of a
    memoryview: one copy, where a gather by numpy indices costs an index per byte)."""
    mv = memoryview(buf)
    return b"".join([mv[a : a + c] for a, c in zip(starts.tolist(), counts.tolist())])


class TableBatch:
    """Many messages read together: their strings (interned into one table), all their integers
    in one int64 array, and their tables gathered by ``(tag, nd)`` across messages.

    For an inbox of thousands of small messages (a key owner's forwards, rank 0's finalize
    messages) this costs a few Python steps per message and numpy passes for the rest, where
    decoding each message on its own costs tens of numpy calls per message.

    ``prefix(i, ints, p)``, if given, reads message ``i``'s integers before its tables (``ints``
    a Python list of all integers, ``p`` where the message's start) and returns where its tables
    start.
    """

    def __init__(
        self,
        messages: Iterable[bytes],
        widths: Dict[int, Any],
        prefix: Optional[Callable[[int, Sequence[int], int], int]] = None,
    ) -> None:
        self.strings: List[str] = []
        self.ids: Dict[str, int] = {}
        msgs = messages if isinstance(messages, list) else list(messages)
        n = self.count = len(msgs)
        # every message's header, strings and integers cut out of one joined buffer by numpy
        # passes (a few Python steps per message cost a key owner of 18,509 messages ~40 ms)
        H = _HEADER.size
        lens = np.fromiter(map(len, msgs), dtype=np.int64, count=n)
        if n and int(lens.min()) < H:
            raise ValueError(f"metadata message of {int(lens.min())} bytes is too short")
        joined = b"".join(msgs)
        raw = np.frombuffer(joined, dtype=np.uint8)
        at = np.cumsum(lens) - lens + H  # where each message's body (after its header) starts
        head = raw[(at - H)[:, None] + np.arange(H)].view(_HEAD_DTYPE).reshape(n)
        width = head["width"].astype(np.int64)
        nstr, nblob, nints = (head[f].astype(np.int64) for f in ("nstr", "nblob", "nints"))
        if bool((head["magic"] != MAGIC).any() | ((width != 4) & (width != 8)).any()):
            raise ValueError("not a metadata message (bad magic)")
        if bool(((lens != H + nblob + nints * width) | (nblob < 4 * nstr) | ((nstr == 0) & (nblob != 0))).any()):
            raise ValueError("metadata message has an inconsistent length")
        self.lut = self._intern(joined, at, nstr, nblob)
        self.lut_base = np.cumsum(nstr) - nstr
        # the integers: messages of 4-byte ones, then those of 8-byte ones
        start, end = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        arrays, done = [], 0
        for w, dt in ((4, "<i4"), (8, "<i8")):
            sel = np.flatnonzero(width == w)
            if not len(sel):
                continue
            arrays.append(np.frombuffer(_cut(joined, at[sel] + nblob[sel], nints[sel] * w), dtype=dt).astype(np.int64))
            end[sel] = done + np.cumsum(nints[sel])
            start[sel] = end[sel] - nints[sel]
            done = int(end[sel[-1]])
        self.start, self.end = start.tolist(), end.tolist()
        self.ints = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        self.tables: Dict[Tuple[int, int], List[Tuple[int, int, int]]] = {}
        # the integers for Python-side parsing (table headers, prefixes): a memoryview indexes to
        # Python ints without converting them all (``tolist`` of a finalize's ~400,000 integers
        # cost ~20 ms of rank 0's commit for 2 ranks of 10,000 small tensors, for a few headers)
        self.values = values = memoryview(self.ints)
        p = start
        if prefix is not None:
            for i in range(n):
                if self.end[i] > self.start[i]:
                    p[i] = prefix(i, values, self.start[i])
        self._read_table_headers(p, end, widths)

    def _read_table_headers(self, p: np.ndarray, end: np.ndarray, widths: Dict[int, Callable[[int], int]]) -> None:
        """:attr:`tables` from the table headers of every message, whose tables start at ``p`` and
        end at ``end``: the k-th table of every message is read in the k-th numpy pass (a Python
        step per table cost rank 0 ~10 us per message at 16,384 ranks)."""
        ints = self.ints
        found = []
        active = np.flatnonzero(p < end)
        step = 0
        while len(active):
            pa, stop = p[active], end[active]
            if bool((pa + 3 > stop).any()):
                raise ValueError("metadata message ends inside a table header")
            tag, nd, cnt = ints[pa], ints[pa + 1], ints[pa + 2]
            bad = (nd < 0) | (nd >= _MAX_ND) | (cnt < 0) | (tag < 0) | (tag >= _MAX_ND)
            if bool(bad.any()):
                j = int(np.flatnonzero(bad)[0])
                raise ValueError(f"metadata message has an unknown table (tag {int(tag[j])}, nd {int(nd[j])}, count {int(cnt[j])})")
            kinds, inv = np.unique(tag * _MAX_ND + nd, return_inverse=True)  # (one int per (tag, nd))
            width = np.zeros(len(kinds), dtype=np.int64)
            for k, code in enumerate(kinds.tolist()):
                t, d = divmod(code, _MAX_ND)
                width_of = widths.get(t)
                if width_of is None:
                    c = int(cnt[np.flatnonzero(inv == k)[0]])
                    raise ValueError(f"metadata message has an unknown table (tag {t}, nd {d}, count {c})")
                width[k] = width_of(d)
            q = pa + 3 + width[inv] * cnt
            if bool((q > stop).any()):
                raise ValueError("metadata message ends inside a table")
            found.append(np.stack([active, np.full(len(active), step), tag, nd, pa + 3, cnt]))
            p[active] = q
            active = active[q < stop]
            step += 1
        if not found:
            return
        t = np.concatenate(found, axis=1)
        t = t[:, np.lexsort((t[1], t[0]))]  # message order, and each message's tables in its order
        kinds, inv = np.unique(t[2] * _MAX_ND + t[3], return_inverse=True)
        for k, code in enumerate(kinds.tolist()):
            sel = t[:, inv == k]
            self.tables[divmod(code, _MAX_ND)] = list(zip(sel[0].tolist(), sel[4].tolist(), sel[5].tolist()))

    def _intern(self, joined: bytes, at: np.ndarray, nstr: np.ndarray, nblob: np.ndarray) -> np.ndarray:
        """Every message's strings (a table of their byte lengths at ``at``, then their bytes, ``nblob``
        bytes in all), interned into :attr:`strings` (ids in order of first appearance): cut in one
        pass, one dict call per string (per message, this cost rank 0 tens of microseconds: a
        second at 65,536 ranks)."""
        some = np.flatnonzero(nstr)
        if not len(some):
            return np.zeros(0, dtype=np.int64)
        lengths = np.frombuffer(_cut(joined, at[some], 4 * nstr[some]), dtype="<u4").astype(np.int64)
        # each message's strings fill its string bytes exactly
        text_len = nblob[some] - 4 * nstr[some]
        if bool((np.add.reduceat(lengths, np.cumsum(nstr[some]) - nstr[some]) != text_len).any()):
            raise ValueError("metadata message has an inconsistent string table")
        blob = _cut(joined, at[some] + 4 * nstr[some], text_len)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        if blob.isascii():  # one decode, then slices (byte and character offsets agree)
            text = blob.decode("ascii")
            strs = [text[a:b] for a, b in zip(starts.tolist(), ends.tolist())]
        else:
            strs = [blob[a:b].decode("utf-8", "surrogatepass") for a, b in zip(starts.tolist(), ends.tolist())]
        ids = self.ids
        lut = [ids.setdefault(s, len(ids)) for s in strs]
        _append_new(self.strings, strs, lut)
        return np.asarray(lut, dtype=np.int64)

    def rows(self, tag: int, nd: int, width: int) -> Tuple[np.ndarray, np.ndarray]:
        """``(message index of each row, rows as an array of shape (width, rows))`` of every
        ``(tag, nd)`` table, in message order."""
        tabs = self.tables.get((tag, nd), [])
        if not tabs:
            return np.zeros(0, dtype=np.int64), np.zeros((width, 0), dtype=np.int64)
        t = np.asarray(tabs, dtype=np.int64)
        msg, start, cnt = t[:, 0], t[:, 1], t[:, 2]
        tid = np.repeat(np.arange(len(t)), cnt)
        idx = runs(start, cnt)[None, :] + np.arange(width)[:, None] * cnt[tid][None, :]
        return msg[tid], self.ints[idx]

    def global_ids(self, msg: np.ndarray, local: np.ndarray) -> np.ndarray:
        """String ids local to each row's message as ids into :attr:`strings`."""
        return self.lut[self.lut_base[msg] + local]
