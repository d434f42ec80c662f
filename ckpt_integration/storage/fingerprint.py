"""Layout-independent fingerprints of tensors: what a load proves it placed where it belongs.

Block digests prove that every byte a load reads is the byte that was written; they cannot
tell whether the byte landed at the right place of the right tensor. The fingerprint of a
tensor is a sum over its elements, each weighted by a hash of its global coordinates, mod
2^64: the sum over any set of disjoint boxes that tile the tensor is the same, however the
tensor is split. A save records it per stored chunk (the commit adds the chunks of a key), a
load computes it over what it loaded and compares (``execution/state_check.py``).

**The function** (also in docs/format.md, so that other readers can check it). For a tensor
whose elements are ``b`` bytes wide (1, 2, 4, 8 or 16), with global coordinates
``(c_0, ..., c_{n-1})`` (a 0-d tensor counts as one element at ``(0,)``):

* the *row* of an element is its leading coordinates ``(c_0, ..., c_{n-2})``; its bytes sit at
  positions ``p = c_{n-1} * b + k`` (``k``: the byte's place in the element, little-endian) of
  the row, and the row is cut into *segments* of ``S = 65536`` byte positions (``s = p // S``);
* lane sums, for ``j`` in ``0..7``: ``y_j(row, s) = sum of int8(byte) * W[p % S, j]`` over the
  row's bytes in segment ``s``, where ``W[q, j]`` is the low byte, as int8, of
  ``fmix(8 * q + j ^ 0x5EED_0F_B17E_5EED)`` (``fmix``: SplitMix64's finaliser); exact in 32 bits;
* ``rowkey``: ``h = 0x0C0FFEE5``, then for each leading axis ``d``:
  ``h = fmix(h ^ (c_d * 0x9E3779B97F4A7C15 + d + 1))`` (mod 2^64);
* ``H(row, s, j) = fmix(fmix(rowkey ^ (s + 1) * 0xD1B54A32D192ED03) ^ (j + 1) * 0xA0761D6478BD642F) | 1``;
* ``F = sum over rows, segments and lanes of y_j(row, s) * H(row, s, j)``, mod 2^64, with
  ``y_j`` sign-extended.

Every element contributes through eight byte-weighted lanes and an odd 64-bit weight of its
row and segment, so a changed element always changes ``F``, and two elements swapped, a row
moved, a slice shifted change it unless their bytes collide under all eight lanes and the
64-bit weights (about 2^-64 for unrelated data). The lane sums are one int8 matrix product per
segment of rows (``torch._int_mm`` on the CPU: about the cost of one memory copy of the data;
on a GPU, on the device), the rest is arithmetic per row.
"""

from __future__ import annotations

import base64
import ctypes
import functools
import struct
from typing import Any, Optional, Sequence, Tuple

import numpy as np
import torch

from ..planning.digests import fmix, halves, joined
from ..planning.records import decode_array, encode_array

SEGMENT = 1 << 16  # byte positions per segment of a row: lane sums stay exact in int32
LANES = 8
_SEED_W = np.uint64(0x5EED0FB17E5EED)
_SEED_ROW = np.uint64(0x0C0FFEE5)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_K_SEG = np.uint64(0xD1B54A32D192ED03)
_K_LANE = np.uint64(0xA0761D6478BD642F)
_ONE = np.uint64(1)
# rows per step: bounds the per-row arrays (lane sums and weights) for tall, narrow tensors
_ROWS_PER_STEP = 1 << 16
MASK64 = (1 << 64) - 1


@functools.lru_cache(maxsize=None)
def _weights(device: str) -> torch.Tensor:
    """``W``: the byte weights of one segment, int8, shape ``(SEGMENT, LANES)``."""
    q = np.arange(SEGMENT * LANES, dtype=np.uint64)
    with np.errstate(over="ignore"):
        w = (fmix(q ^ _SEED_W) & np.uint64(0xFF)).astype(np.uint8).view(np.int8)
    return torch.from_numpy(w.reshape(SEGMENT, LANES).copy()).to(device)


def _lane_sums(xb: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``xb @ w`` (int8 x int8), exact, as int32 on the CPU (``xb``'s rows: one segment's bytes)."""
    if xb.shape[0] == 0 or xb.shape[1] == 0:
        return torch.zeros((xb.shape[0], LANES), dtype=torch.int32)
    if xb.is_cuda:
        m, k = xb.shape
        if m > 16 and k % 8 == 0:
            try:
                return torch._int_mm(xb.contiguous(), w).cpu()
            except RuntimeError:
                pass
        # products < 2^14, at most 2^16 of them: exact in float64
        return (xb.to(torch.float64) @ w.to(torch.float64)).round().to(torch.int32).cpu()
    mm = getattr(torch, "_int_mm", None)
    if mm is not None:
        try:
            return mm(xb, w)
        except (RuntimeError, NotImplementedError):
            pass
    return xb.to(torch.int32) @ w.to(torch.int32)


def _row_keys(offsets: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
    """``rowkey`` of every row of a box (its leading axes), in row-major order, as uint64."""
    h = np.array([_SEED_ROW], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for d, (o, n) in enumerate(zip(offsets, sizes)):
            c = np.arange(o, o + n, dtype=np.uint64) * _GOLDEN + np.uint64(d + 1)
            h = fmix(h[:, None] ^ c[None, :]).reshape(-1)
    return h


def _segment_weights(rowkeys: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """``H(row, s, j)`` for the given rows and segments: shape ``(rows, segments, LANES)``."""
    with np.errstate(over="ignore"):
        rs = fmix(rowkeys[:, None] ^ ((segments.astype(np.uint64) + _ONE) * _K_SEG)[None, :])
        lanes = (np.arange(1, LANES + 1, dtype=np.uint64) * _K_LANE)
        return fmix(rs[:, :, None] ^ lanes[None, None, :]) | _ONE


def fingerprint(t: torch.Tensor, offsets: Optional[Sequence[int]] = None) -> int:
    """The fingerprint (see the module docstring) of the box of a tensor whose elements are
    ``t`` and whose first element has global coordinates ``offsets`` (default: all 0): the
    contribution of these elements to the whole tensor's fingerprint. Sums of boxes that tile a
    tensor, mod 2^64, give the tensor's.

    Example::

        full = torch.arange(12.0).view(3, 4)
        whole = fingerprint(full)
        parts = fingerprint(full[:2], (0, 0)) + fingerprint(full[2:], (2, 0))
        assert whole == parts % 2**64
    """
    if t.dim() == 0:
        t = t.reshape(1)
        offsets = (0,)
    shape = tuple(t.shape)
    offsets = tuple(int(o) for o in (offsets if offsets is not None else (0,) * len(shape)))
    if len(offsets) != len(shape):
        raise ValueError(f"{len(offsets)} offsets for a tensor of {len(shape)} dimensions")
    if t.numel() == 0:
        return 0
    esize = t.element_size()
    last, c0 = shape[-1], offsets[-1]
    rows = t.numel() // last
    xb = _byte_rows(t, rows, last)
    w = _weights(str(t.device) if t.is_cuda else "cpu")
    return int(_contribution(xb, _row_keys(offsets[:-1], shape[:-1]), c0 * esize, (c0 + last) * esize, w))


def _byte_rows(t: torch.Tensor, rows: int, last: int) -> torch.Tensor:
    """``t``'s elements as ``(rows, last * element size)`` int8 (a view when its rows are contiguous)."""
    x = t.detach().reshape(rows, last)
    if x.stride(-1) != 1 or (rows > 1 and x.stride(0) != last):
        x = x.contiguous()
    return x.view(torch.int8)


def _contribution(xb: torch.Tensor, keys: np.ndarray, lo: int, hi: int, w: torch.Tensor) -> np.uint64:
    """The contribution of rows of bytes ``xb`` (shape ``(rows, hi - lo)``) that sit at byte
    positions ``[lo, hi)`` of rows with row keys ``keys``."""
    rows = xb.shape[0]
    segs = np.arange(lo // SEGMENT, (hi - 1) // SEGMENT + 1, dtype=np.int64)
    total = np.uint64(0)
    if len(segs) > 4:  # long rows (a flat vector, a byte view): each row's whole segments in one product
        for r in range(rows):
            total = total + _long_row(xb[r], w, lo, hi, keys[r : r + 1])
        return total
    for r0 in range(0, rows, _ROWS_PER_STEP):
        r1 = min(rows, r0 + _ROWS_PER_STEP)
        if len(segs) == 1:
            s0 = int(segs[0])
            y = _lane_sums(xb[r0:r1], w[lo - s0 * SEGMENT : hi - s0 * SEGMENT])[:, None, :]
        else:
            lanes = []
            for s in segs.tolist():
                a, e = max(lo, s * SEGMENT), min(hi, (s + 1) * SEGMENT)
                lanes.append(_lane_sums(xb[r0:r1, a - lo : e - lo], w[a - s * SEGMENT : e - s * SEGMENT]))
            y = torch.stack(lanes, dim=1)
        y = y.numpy().astype(np.int64).view(np.uint64)  # (rows, segments, lanes)
        h = _segment_weights(keys[r0:r1], segs)
        with np.errstate(over="ignore"):
            total = total + (y * h).sum(dtype=np.uint64)
    return total


# a tensor of at most this many bytes is fingerprinted in a batch (fingerprints)
SMALL = 1 << 16


def _pair_weights(rowkeys: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """``H(row_i, s_i, j)`` for pairs ``(rowkeys[i], segments[i])``: shape ``(n, LANES)``."""
    with np.errstate(over="ignore"):
        rs = fmix(rowkeys ^ ((segments.astype(np.uint64) + _ONE) * _K_SEG))
        lanes = np.arange(1, LANES + 1, dtype=np.uint64) * _K_LANE
        return fmix(rs[:, None] ^ lanes[None, :]) | _ONE


def fingerprints(items: Sequence[tuple]) -> list:
    """:func:`fingerprint` of each ``(tensor, offsets)``, the small ones in batches.

    A small CPU tensor whose rows each lie within one segment (most tensors of a model by count:
    biases, norms, small matrices, and their shards) is not multiplied on its own: the rows of
    all such tensors whose rows start at the same place of a segment are stacked into one
    zero-padded byte matrix (zero bytes weigh nothing) and multiplied at once, a few
    microseconds per tensor instead of a call each."""
    out: list = [0] * len(items)
    memmove = ctypes.memmove
    groups: dict = {}  # start in the segment -> [(item, rows, row bytes, segment, tensor, offsets)]
    for i, (t, o) in enumerate(items):
        n = t.numel()
        if n == 0 or t.is_cuda:
            out[i] = fingerprint(t, o)
            continue
        if not o:  # a 0-d tensor: one element at (0,)
            t, o = t.reshape(1), (0,)
        esize = t.element_size()
        last = t.shape[-1]
        p0 = o[-1] * esize
        q0, width = p0 % SEGMENT, last * esize
        if n * esize > SMALL or q0 + width > SEGMENT:
            out[i] = fingerprint(t, o)
            continue
        if not t.is_contiguous():
            t = t.contiguous()
        group = groups.get(q0)
        if group is None:
            group = groups[q0] = []
        group.append((i, n // last, width, p0 // SEGMENT, t, o))
    for q0, members in groups.items():
        rows_of = [m[1] for m in members]
        total_rows = sum(rows_of)
        width = max(m[2] for m in members)
        mat = np.zeros((total_rows, width), dtype=np.int8)
        keys = np.full(total_rows, _SEED_ROW, dtype=np.uint64)  # (a vector's one row: the seed)
        segs = np.repeat(np.array([m[3] for m in members], dtype=np.int64), rows_of)
        starts = np.cumsum([0] + rows_of[:-1])
        flat2d: list = []  # (first row, rows, offset of the one leading axis): keys computed together
        base = mat.ctypes.data
        for (i, rows, nb, seg, t, o), r in zip(members, starts.tolist()):
            if rows == 1:  # (one copy call: most small tensors are vectors)
                memmove(base + r * width, t.data_ptr(), nb)
            else:
                mat[r : r + rows, :nb] = t.detach().reshape(-1).view(torch.int8).numpy().reshape(rows, nb)
            nd = t.dim()
            if nd == 2:
                flat2d.append((r, rows, int(o[0])))
            elif nd > 2:
                keys[r : r + rows] = _row_keys(tuple(int(v) for v in o[:-1]), tuple(t.shape[:-1]))
        if flat2d:  # rowkey of a row of a 2-d tensor: fmix(seed ^ (c_0 * golden + 1)), all at once
            at = np.concatenate([np.arange(a, a + n) for a, n, _ in flat2d])
            c0 = np.concatenate([np.arange(c, c + n) for _, n, c in flat2d]).astype(np.uint64)
            with np.errstate(over="ignore"):
                keys[at] = fmix(_SEED_ROW ^ (c0 * _GOLDEN + _ONE))
        y = _lane_sums(torch.from_numpy(mat), _weights("cpu")[q0 : q0 + width]).numpy().astype(np.int64).view(np.uint64)
        with np.errstate(over="ignore"):
            per_row = (y * _pair_weights(keys, segs)).sum(axis=1, dtype=np.uint64)
            sums = np.add.reduceat(per_row, starts).tolist()
        for m, v in zip(members, sums):
            out[m[0]] = v
    return out


def _long_row(row: torch.Tensor, w: torch.Tensor, lo: int, hi: int, key: np.ndarray) -> np.uint64:
    """One row's contribution when it spans many segments: its whole segments as the rows of one
    matrix (one product), the partial ones at either end on their own."""
    s_lo, s_hi = lo // SEGMENT, (hi - 1) // SEGMENT  # the segments touched (inclusive)
    whole_lo = s_lo if lo % SEGMENT == 0 else s_lo + 1
    whole_hi = s_hi + 1 if hi % SEGMENT == 0 else s_hi  # whole segments: [whole_lo, whole_hi)
    pieces = []  # (segments, lane sums (n, LANES))
    for s in sorted({s_lo, s_hi}):
        if whole_lo <= s < whole_hi:
            continue
        a, e = max(lo, s * SEGMENT), min(hi, (s + 1) * SEGMENT)
        pieces.append((np.array([s]), _lane_sums(row[None, a - lo : e - lo], w[a - s * SEGMENT : e - s * SEGMENT])))
    if whole_hi > whole_lo:
        a = whole_lo * SEGMENT - lo
        mid = row[a : a + (whole_hi - whole_lo) * SEGMENT].reshape(whole_hi - whole_lo, SEGMENT)
        pieces.append((np.arange(whole_lo, whole_hi), _lane_sums(mid, w)))
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for segs, y in pieces:
            h = _segment_weights(key, segs.astype(np.int64))[0]  # (segments, lanes)
            total = total + (y.numpy().astype(np.int64).view(np.uint64) * h).sum(dtype=np.uint64)
    return total


def add(*parts: int) -> int:
    """Fingerprints of disjoint boxes added: the fingerprint of their union (mod 2^64)."""
    return sum(parts) & MASK64


# --- the recorded fingerprints: one row per saved chunk (key, box, fingerprint) ------------------
MAGIC = b"CKFP"
TABLE_VERSION = 1
_HEAD = struct.Struct("<4sII")  # magic, version, rows


def encode_groups(groups: Sequence[tuple]) -> str:
    """The manifest's ``fingerprints`` text for rows given as columns per number of dimensions:
    ``(nd, keys, fingerprints (uint64), offsets (m, nd), sizes (m, nd))``. Rows are sorted by
    key and offsets; per ``nd`` the columns are key id, low and high 32 bits of the fingerprint,
    offsets, sizes."""
    merged: dict = {}
    for nd, keys, fp, offs, szs in groups:
        m = len(keys)
        merged.setdefault(nd, []).append((list(keys), np.asarray(fp, dtype=np.uint64),
                                          np.asarray(offs, dtype=np.int64).reshape(m, nd),
                                          np.asarray(szs, dtype=np.int64).reshape(m, nd)))
    all_keys = sorted({k for parts in merged.values() for p in parts for k in p[0]})
    kid_of = {k: i for i, k in enumerate(all_keys)}
    ints: list = []
    n = 0
    for nd in sorted(merged):
        parts = merged[nd]
        kid = np.array([kid_of[k] for p in parts for k in p[0]], dtype=np.int64)
        fp = np.concatenate([p[1] for p in parts])
        offs = np.concatenate([p[2] for p in parts])
        szs = np.concatenate([p[3] for p in parts])
        order = np.lexsort(tuple(offs[:, d] for d in reversed(range(nd))) + (kid,)) if nd else np.argsort(kid, kind="stable")
        halves_ = halves(fp[order])
        ints.append(np.concatenate([np.array([nd, len(order)], dtype=np.int64), kid[order], halves_[0], halves_[1],
                                    offs[order].T.reshape(-1), szs[order].T.reshape(-1)]))
        n += len(order)
    body = np.concatenate(ints) if ints else np.zeros(0, dtype=np.int64)
    raw = _HEAD.pack(MAGIC, TABLE_VERSION, n) + encode_array(all_keys, body)
    return base64.b64encode(raw).decode("ascii")


class Recorded:
    """The fingerprints a checkpoint recorded, decoded from the manifest's ``fingerprints`` text.

    ``chunks(key)`` lists ``(offsets, sizes, fingerprint)`` of the key's saved chunks;
    ``total(key)`` is their sum, the whole tensor's fingerprint. Damage raises ValueError (the
    caller names the file)."""

    def __init__(self, text: str):
        raw = base64.b64decode(text.encode("ascii"), validate=True)
        if len(raw) < _HEAD.size:
            raise ValueError("fingerprint table shorter than its header")
        magic, version, n = _HEAD.unpack_from(raw, 0)
        if magic != MAGIC or version != TABLE_VERSION:
            raise ValueError(f"not a fingerprint table of version {TABLE_VERSION}")
        self.keys, ints = decode_array(raw[_HEAD.size:])
        self._rows: dict = {}  # key id -> list of row numbers
        self._groups: list = []  # (nd, key ids, fingerprints, offsets (m, nd), sizes (m, nd))
        p, seen = 0, 0
        while p < len(ints):
            nd, m = int(ints[p]), int(ints[p + 1])
            p += 2
            if nd < 0 or m < 0 or p + m * (3 + 2 * nd) > len(ints):
                raise ValueError("fingerprint table rows are cut short")
            kid = ints[p : p + m]
            fp = joined(ints[p + m : p + 2 * m], ints[p + 2 * m : p + 3 * m])
            p += 3 * m
            offs = ints[p : p + nd * m].reshape(nd, m).T
            p += nd * m
            szs = ints[p : p + nd * m].reshape(nd, m).T
            p += nd * m
            if m and (int(kid.min()) < 0 or int(kid.max()) >= len(self.keys)):
                raise ValueError("a fingerprint row names a key the table does not list")
            self._groups.append((nd, kid, fp, offs, szs))
            seen += m
        if seen != n:
            raise ValueError(f"{seen} fingerprint rows where the header says {n}")
        self._index = {k: i for i, k in enumerate(self.keys)}
        self._by_key: Optional[dict] = None
        self._at: Optional[dict] = None

    @classmethod
    def of_columns(cls, keys: Sequence[str], groups: Sequence[tuple]) -> "Recorded":
        """From rows already decoded (a format-6 checkpoint index): ``keys`` a string table,
        ``groups`` per number of dimensions ``(nd, key ids, fingerprints, offsets (m, nd), sizes
        (m, nd))``. Only the keys that have rows count as recorded."""
        self = cls.__new__(cls)
        self.keys = list(keys)
        self._groups = list(groups)
        self._rows = {}
        ids = np.unique(np.concatenate([g[1] for g in groups])) if groups else np.zeros(0, dtype=np.int64)
        self._index = {self.keys[i]: i for i in ids.tolist()}
        self._by_key = self._at = None
        return self

    def _build(self) -> dict:
        by_key: dict = {}
        for nd, kid, fp, offs, szs in self._groups:
            order = np.argsort(kid, kind="stable")
            ks = kid[order]
            starts = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]]) if len(ks) else np.zeros(0, dtype=np.int64)
            ends = np.r_[starts[1:], len(ks)]
            for a, b in zip(starts.tolist(), ends.tolist()):
                by_key.setdefault(int(ks[a]), []).append((order[a:b], fp, offs, szs))
        return by_key

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def chunk(self, key: str, offsets: Tuple[int, ...]) -> Optional[Tuple[Tuple[int, ...], int]]:
        """``(sizes, fingerprint)`` of ``key``'s saved chunk at ``offsets``, or None."""
        if self._at is None:
            at: dict = {}
            for nd, kid, fp, offs, szs in self._groups:
                names = [self.keys[k] for k in kid.tolist()]
                for k, o, z, v in zip(names, offs.tolist(), szs.tolist(), fp.tolist()):
                    at[(k, tuple(o))] = (tuple(z), v)
            self._at = at
        return self._at.get((key, tuple(offsets)))

    def chunks(self, key: str) -> list:
        """``[(offsets, sizes, fingerprint)]`` of ``key``'s saved chunks (empty: not recorded)."""
        if self._by_key is None:
            self._by_key = self._build()
        out = []
        for sel, fp, offs, szs in self._by_key.get(self._index.get(key, -1), ()):
            for i in sel.tolist():
                out.append((tuple(offs[i].tolist()), tuple(szs[i].tolist()), int(fp[i])))
        return out

    def total(self, key: str) -> Optional[int]:
        """The whole tensor's fingerprint (None: not recorded)."""
        parts = self.chunks(key)
        return add(*(v for _, _, v in parts)) if parts else None


def shard_fingerprints(shards: Sequence[Any]) -> list:
    """The fingerprint of each ShardedTensor's data (flattened shards: the sum over the boxes
    they cover; stacked layers: in their saved shape), in one batch."""
    items: list = []
    owner: list = []
    for i, sh in enumerate(shards):
        for b in sh.unflattened():
            items.append((b.data.reshape(b.saved_shape()), b.global_offset))
            owner.append(i)
    out = [0] * len(shards)
    for i, v in zip(owner, fingerprints(items)):
        out[i] = (out[i] + v) & MASK64
    return out
