"""N-dimensional boxes (offset + size per axis) and their overlaps.

A saved chunk, a requested shard and their intersection are all boxes in the
coordinate system of the global tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple


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
