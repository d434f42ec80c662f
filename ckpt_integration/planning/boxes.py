"""N-dimensional boxes (offset + size per axis) and their overlaps.

A saved chunk, a requested shard and their intersection are all boxes in the
coordinate system of the global tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Box:
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]

    @property
    def ends(self) -> Tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The common part of two boxes, or ``None`` when they do not overlap."""
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offsets), tuple(sizes))


def relative_slices(inner: Box, outer: Box) -> Tuple[slice, ...]:
    """Slices selecting ``inner`` inside a tensor that holds ``outer``."""
    return tuple(slice(i - o, i - o + s) for i, o, s in zip(inner.offsets, outer.offsets, inner.sizes))


def clip_to_shape(box: Box, shape: Sequence[int]) -> Optional[Box]:
    """Part of ``box`` inside ``[0, shape)``; ``None`` if empty."""
    return intersect(box, Box(tuple(0 for _ in shape), tuple(shape)))


def sweep_axis(offsets: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], axes: Optional[Sequence[int]] = None) -> int:
    """The axis along which the boxes overlap least (-1 for none): the one to sort or sweep along.

    The cost of an axis is the number of pairs a sweep along it compares: for each
    distinct interval along the axis, its boxes times the boxes of *other* intervals
    still open at its start (boxes sharing an interval are told apart along the other
    axes). The layer axis of a stacked tensor costs 0, however finely each layer is
    split; ties go to the axis with more distinct starts. O(n log n) per axis.

    Example: ``sweep_axis([(0, 0), (0, 4), (1, 0), (1, 4)], [(1, 4)] * 4) == 0``.
    """
    import heapq
    from collections import Counter

    if not offsets:
        return -1
    axes = range(len(offsets[0])) if axes is None else axes
    if len(axes) == 1:  # one candidate (1-D tensors: most small ones): nothing to compare
        return axes[0]
    best, best_key = -1, None
    for a in axes:
        intervals = Counter((o[a], o[a] + s[a]) for o, s in zip(offsets, sizes))
        open_ends: list = []
        active = cost = 0
        for (start, end), count in sorted(intervals.items()):
            while open_ends and open_ends[0][0] <= start:
                active -= heapq.heappop(open_ends)[1]
            cost += count * active
            heapq.heappush(open_ends, (end, count))
            active += count
        key = (cost, -len({start for start, _ in intervals}))
        if best_key is None or key < best_key:
            best, best_key = a, key
    return best


def overlapping_pairs(boxes: Sequence[Box]) -> List[Tuple[int, int]]:
    """Index pairs of boxes that share elements: a sweep along the axis where they overlap least."""
    if len(boxes) < 2:
        return []
    ndim = len(boxes[0].offsets)
    if ndim == 0:
        return [(0, j) for j in range(1, len(boxes))]
    axis = sweep_axis([b.offsets for b in boxes], [b.sizes for b in boxes])
    order = sorted(range(len(boxes)), key=lambda i: boxes[i].offsets[axis])
    active: List[int] = []
    pairs = []
    for i in order:
        start = boxes[i].offsets[axis]
        active = [j for j in active if boxes[j].offsets[axis] + boxes[j].sizes[axis] > start]
        pairs.extend((j, i) for j in active if intersect(boxes[i], boxes[j]) is not None)
        active.append(i)
    return pairs
