"""Read-once planning: which rank reads (and verifies) each stored block of a chunk.

A stored chunk is a row-major array at item-relative byte ``data_start``, checked in
blocks (``bounds``: item-relative block boundaries, see ``storage/checksum.py``). A rank
that wants a box of it must read every block its bytes touch; when several ranks touch
the same blocks (a column slice of row-major chunks, data-parallel replicas, uneven
splits) the job as a whole would read them several times. Here, for one chunk, the
ranks' touched byte ranges are united and cut into *units* (block-aligned ranges), and
each unit gets one *reader* among the ranks that touch it: the job reads and checks
every touched block exactly once. The other ranks get their parts of a unit from the
node's page cache (same node as the reader) or from the reader over the process group
(another node); :func:`range_boxes` says which part of a box lies in a unit, the same
way on the sending and the receiving side.

Everything here is a pure function of integers: the execution layer routes each chunk's
needs to one owner rank, which calls :func:`plan_chunk`.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import numpy as np


# Largest unit: what a reader stages at once for ranks on other nodes (and the grain of
# balancing within a chunk). Units are block-aligned, so a unit is at least one block.
UNIT_BYTES = 8 << 20

Ranges = List[Tuple[int, int]]
BoxT = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (starts, lens), chunk-relative


def region_runs(shape: Sequence[int], esize: int, starts: Sequence[int], lens: Sequence[int]) -> Tuple[np.ndarray, int]:
    """Byte offsets (relative to the chunk's data start) of the contiguous runs of a box, and their length."""
    ndim = len(shape)
    if ndim == 0:
        return np.zeros(1, dtype=np.int64), esize
    strides = [esize] * ndim
    for a in range(ndim - 2, -1, -1):
        strides[a] = strides[a + 1] * shape[a + 1]
    # k: first axis from which the box is one contiguous run per index of the axes before it
    k = ndim - 1
    while k > 0 and starts[k] == 0 and lens[k] == shape[k]:
        k -= 1
    run_len = lens[k] * strides[k]
    lo = np.array([sum(s * st for s, st in zip(starts, strides))], dtype=np.int64)
    for a in range(k):
        lo = (lo[:, None] + np.arange(lens[a], dtype=np.int64)[None, :] * strides[a]).reshape(-1)
    return lo, run_len


def merge_ranges(lo: np.ndarray, hi: np.ndarray) -> Ranges:
    """Sorted union of the intervals ``[lo, hi)`` (touching ones merged)."""
    if len(lo) == 0:
        return []
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    reach = np.maximum.accumulate(hi)
    new = np.empty(len(lo), dtype=bool)
    new[0] = True
    new[1:] = lo[1:] > reach[:-1]
    starts = lo[new]
    ends = reach[np.append(np.nonzero(new)[0][1:] - 1, len(lo) - 1)]
    return list(zip(starts.tolist(), ends.tolist()))


def touched_ranges(bounds: np.ndarray, data_start: int, shape: Sequence[int], esize: int,
                   starts: Sequence[int], lens: Sequence[int]) -> Ranges:
    """Item-relative, block-aligned byte ranges a reader of the box must read (whole blocks)."""
    if math.prod(lens) == 0:
        return []
    run_lo, run_len = region_runs(shape, esize, starts, lens)
    run_lo = run_lo + data_start  # ascending (row-major order)
    # every block from the first run's to the last run's is touched unless a gap between two
    # runs holds a whole one: with no gap as wide as the smallest of those blocks (a column slice
    # of rows shorter than a block), one range, without a block lookup per run (a search per row
    # of a 4096-row chunk, sorted and merged: ~0.2 ms a chunk)
    b0 = int(np.searchsorted(bounds, run_lo[0], side="right")) - 1
    b1 = int(np.searchsorted(bounds, run_lo[-1] + run_len - 1, side="right")) - 1
    if len(run_lo) == 1 or int(np.diff(run_lo).max()) - run_len < int(np.diff(bounds[b0 : b1 + 2]).min()):
        return [(int(bounds[b0]), int(bounds[b1 + 1]))]
    first = np.searchsorted(bounds, run_lo, side="right") - 1
    last = np.searchsorted(bounds, run_lo + run_len - 1, side="right") - 1
    return [(int(bounds[a]), int(bounds[b])) for a, b in merge_ranges(first, last + 1)]


def ranges_bytes(ranges: Ranges) -> int:
    return sum(b - a for a, b in ranges)


def flat_range_boxes(shape: Sequence[int], e0: int, e1: int) -> List[BoxT]:
    """The elements ``[e0, e1)`` (row-major) of an array of ``shape`` as at most ``2 * ndim - 1`` boxes."""
    if e1 <= e0:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    r0, c0 = divmod(e0, inner)
    r1, c1 = divmod(e1, inner)
    rest = tuple(shape[1:])
    if r0 == r1:
        return [((r0, *s), (1, *n)) for s, n in flat_range_boxes(rest, c0, c1)]
    out: List[BoxT] = []
    if c0:
        out += [((r0, *s), (1, *n)) for s, n in flat_range_boxes(rest, c0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, *(0,) * len(rest)), (r1 - r0, *rest)))
    if c1:
        out += [((r1, *s), (1, *n)) for s, n in flat_range_boxes(rest, 0, c1)]
    return out


def intersect_box(a: BoxT, b: BoxT) -> BoxT:
    """Common part of two boxes (sizes 0 when they do not overlap)."""
    starts, lens = [], []
    for ao, al, bo, bl in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        starts.append(lo)
        lens.append(max(0, hi - lo))
    return tuple(starts), tuple(lens)


def range_boxes(shape: Sequence[int], esize: int, data_start: int, lo: int, hi: int, region: BoxT) -> List[BoxT]:
    """The parts of ``region`` (chunk-relative box) whose bytes lie in the item-relative range ``[lo, hi)``.

    Element ``e`` belongs to the range when its first byte does; both sides of a transfer
    call this to agree on the layout of the message (the parts in this order, each row-major).
    """
    numel = math.prod(shape)
    e0 = min(numel, max(0, -(-(lo - data_start) // esize)))
    e1 = min(numel, max(0, -(-(hi - data_start) // esize)))
    out = []
    for box in flat_range_boxes(shape, e0, e1):
        part = intersect_box(box, region)
        if all(part[1]):
            out.append(part)
    return out


def split_range(bounds: np.ndarray, lo: int, hi: int, pieces: int) -> Ranges:
    """``[lo, hi)`` (block-aligned) cut at block boundaries into up to ``pieces`` nearly equal ranges."""
    inner = bounds[(bounds > lo) & (bounds < hi)]
    cuts = [lo]
    if pieces > 1 and len(inner):
        for j in range(1, pieces):
            target = lo + (hi - lo) * j // pieces
            i = int(np.searchsorted(inner, target))
            if i < len(inner) and (i == 0 or abs(int(inner[i]) - target) <= abs(int(inner[i - 1]) - target)):
                c = int(inner[i])
            else:
                c = int(inner[i - 1])
            if c > cuts[-1]:
                cuts.append(c)
    cuts.append(hi)
    return list(zip(cuts[:-1], cuts[1:]))


@dataclass
class ChunkNeeds:
    """What the ranks want of one stored chunk (collected by the chunk's owner)."""

    bounds: np.ndarray
    ranks: List[int] = field(default_factory=list)
    nodes: List[int] = field(default_factory=list)
    ranges: List[Ranges] = field(default_factory=list)


@dataclass
class PlannedUnit:
    lo: int
    hi: int
    reader: int
    needers: Tuple[int, ...]


def chunk_totals(needs: ChunkNeeds) -> Tuple[int, int]:
    """(bytes the ranks would read each on its own, bytes of the union: read once)."""
    separate = sum(ranges_bytes(r) for r in needs.ranges)
    lo = np.array([a for r in needs.ranges for a, _ in r], dtype=np.int64)
    hi = np.array([b for r in needs.ranges for _, b in r], dtype=np.int64)
    return separate, ranges_bytes(merge_ranges(lo, hi))


def union_bytes(ids: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> int:
    """Total length of the union of the ranges ``[lo, hi)`` taken per id (ranges of different
    ids never overlap): vectorised, for the owners' decision over many chunks."""
    if len(ids) == 0:
        return 0
    order = np.lexsort((lo, ids))
    ids, lo, hi = ids[order], lo[order], hi[order]
    group = np.concatenate([[0], np.cumsum(ids[1:] != ids[:-1])]).astype(np.int64)
    span = int(max(hi.max(), 1)) + 1
    glo, ghi = lo + group * span, hi + group * span  # groups apart: one running maximum serves all
    reach = np.maximum.accumulate(ghi)
    prev = np.concatenate([[np.iinfo(np.int64).min], reach[:-1]])
    return int(np.maximum(0, ghi - np.maximum(glo, prev)).sum())


def _overlaps(ranges: Ranges, lo: int, hi: int) -> bool:
    return any(a < hi and lo < b for a, b in ranges)


def least_loaded(ranks: Sequence[int], load: Dict[int, int], h: int) -> int:
    """The rank of ``ranks`` that has read the fewest bytes so far (``load``); equal loads are broken
    by rotating over the candidates by ``h`` (a hash of the unit), so ties do not always go to the
    lowest rank. Every shared-read plan picks its readers so."""
    n = len(ranks)
    return ranks[min(range(n), key=lambda p: (load.get(ranks[p], 0), (p - h) % n))]


def plan_chunk(needs: ChunkNeeds, load: Dict[int, int], salt: str = "", unit_bytes: int = UNIT_BYTES) -> List[PlannedUnit]:
    """Units covering the union of the ranks' touched ranges, each with one reader.

    A union interval is cut (at block boundaries) into pieces of at most ``unit_bytes`` and
    at least as many pieces as ranks touch it, so the ranks sharing a chunk share its
    reading. Each unit's reader is the rank touching it that has read the least so far
    (``load``, updated here: the owner balances across the chunks it plans); equal loads
    are broken by a rotation derived from ``salt`` and the unit's place.
    """
    lo = np.array([a for r in needs.ranges for a, _ in r], dtype=np.int64)
    hi = np.array([b for r in needs.ranges for _, b in r], dtype=np.int64)
    units: List[PlannedUnit] = []
    for a, b in merge_ranges(lo, hi):
        touching = [i for i, r in enumerate(needs.ranges) if _overlaps(r, a, b)]
        pieces = max(-(-(b - a) // unit_bytes), len(touching))
        for u_lo, u_hi in split_range(needs.bounds, a, b, pieces):
            idx = [i for i in touching if _overlaps(needs.ranges[i], u_lo, u_hi)]
            ranks = sorted(needs.ranks[i] for i in idx)
            reader = least_loaded(ranks, load, zlib.crc32(f"{salt}@{u_lo}".encode()))
            load[reader] = load.get(reader, 0) + (u_hi - u_lo)
            units.append(PlannedUnit(u_lo, u_hi, reader, tuple(ranks)))
    return units


def flat_index(starts: Sequence[int], shape: Sequence[int]) -> int:
    """Row-major index of element ``starts`` in an array of ``shape``."""
    i = 0
    for s, n in zip(starts, shape):
        i = i * n + s
    return i


def strides(shape: Sequence[int]) -> List[int]:
    """Row-major element strides of ``shape``."""
    st = [1] * len(shape)
    for a in range(len(shape) - 2, -1, -1):
        st[a] = st[a + 1] * shape[a + 1]
    return st


def pieces(bounds: np.ndarray, lo: int, hi: int, size: int) -> List[Tuple[int, int]]:
    """``[lo, hi)`` cut at block boundaries into pieces of about ``size`` bytes (at least one block)."""
    inner = bounds[(bounds > lo) & (bounds < hi)].tolist()
    out, start = [], lo
    for b in inner:
        if b - start >= size:
            out.append((start, b))
            start = b
    out.append((start, hi))
    return out
