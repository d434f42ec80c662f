"""Where a ZeRO-1 save cuts the flat optimizer slices: at row boundaries (pure planning).

A ZeRO-1 optimizer gives data-parallel rank ``r`` the flat range ``[r*S, (r+1)*S)`` of all
params concatenated. Cut as it is, the part of a param's (row-major) local shard that a rank
holds is up to three boxes in model space (partial first row, whole rows, partial last row;
:func:`~ckpt_integration.mapping.flat_range_to_boxes`), and each box is one stored chunk, so
the chunks of every optimizer tensor grow with data parallelism three at a time.

A save instead stores every row on the rank that holds the row's *first* element: the
head of a rank's slice that lies inside a row begun on an earlier rank (less than one row)
moves to that rank before the write, and each rank's saved range of each param is whole
rows, i.e. one box (for N-D shards: the ranges are aligned to the last axis, at most
``2 * ndim - 3`` boxes instead of ``2 * ndim - 1``). What moves is at most one row per rank and
param boundary; which rank sends what to whom follows from the partition alone, so every
rank computes its own sends and receives here without any message.

Loads are unaffected: they request the held ranges (up to three boxes each) and read them out
of the stored whole-row chunks like any other resharding.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from ..mapping import flat_range_to_boxes


def row_unit(shape: Sequence[int]) -> int:
    """Elements of one row of a local shard: its last axis for 2-D and up; 1 for 0-/1-D shards
    (any flat range of those is one box already, nothing needs to move)."""
    return int(shape[-1]) if len(shape) >= 2 and int(shape[-1]) > 0 else 1


def _ceil_to(x: int, unit: int) -> int:
    return -(-x // unit) * unit


@dataclass(frozen=True)
class Transfer:
    """``[lo, hi)`` of param ``pid`` (flat, relative to the param's local shard) moves from
    data-parallel rank ``src`` to ``dst``, which saves it."""

    pid: int
    src: int
    dst: int
    lo: int
    hi: int


@dataclass
class RowAlignedSave:
    """One DP rank's part of a row-aligned ZeRO-1 save.

    ``saved[pid] = (lo, hi)``: the param-relative flat range this rank stores (whole rows);
    ``sends`` / ``receives``: the transfers leaving / reaching this rank, in the same order on
    both ends (by param, then by source rank).
    """

    saved: Dict[int, Tuple[int, int]] = field(default_factory=dict)
    sends: List[Transfer] = field(default_factory=list)
    receives: List[Transfer] = field(default_factory=list)


def row_aligned_save(numels: Sequence[int], units: Sequence[int], shard_size: int, dp_rank: int) -> RowAlignedSave:
    """The row-aligned save of DP rank ``dp_rank`` under the uniform ZeRO-1 partition.

    ``numels[p]`` / ``units[p]``: elements and row length (:func:`row_unit`) of param ``p``;
    params are concatenated in this order and rank ``r`` holds ``[r*S, (r+1)*S)`` of the
    concatenation (clipped to its end), ``S = shard_size``. Cost: O(params the rank touches
    + the ranks whose heads it receives).
    """
    if shard_size <= 0:
        raise ValueError(f"shard_size must be positive, got {shard_size}")
    S = shard_size
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + int(n))
    total = starts[-1]
    a_glob, b_glob = min(total, dp_rank * S), min(total, (dp_rank + 1) * S)
    out = RowAlignedSave()
    if a_glob >= b_glob:
        return out
    p = max(0, bisect_right(starts, a_glob) - 1)
    while p < len(numels) and starts[p] < b_glob:
        ps, n, unit = starts[p], int(numels[p]), max(1, int(units[p]))
        if n == 0 or starts[p + 1] <= a_glob:
            p += 1
            continue
        a, b = max(a_glob, ps) - ps, min(b_glob, ps + n) - ps
        # the head [a, first row start) belongs to the rank holding the start of that row
        first_row = _ceil_to(a, unit)
        if a % unit:
            head_end = min(b, first_row)
            dst = (ps + (a // unit) * unit) // S
            out.sends.append(Transfer(p, dp_rank, dst, a, head_end))
        lo, hi = first_row, min(n, _ceil_to(b, unit))
        if lo < b:  # the rank holds the first element of at least one row: it saves those rows
            out.saved[p] = (lo, hi)
            x = b  # the rest of its last row comes from the heads of the next ranks
            while x < hi:
                src = (ps + x) // S
                end = min(hi, (src + 1) * S - ps)
                out.receives.append(Transfer(p, src, dp_rank, x, end))
                x = end
        p += 1
    return out


def boxes_per_rank(shape: Sequence[int], lo: int, hi: int) -> int:
    """Number of stored chunks a saved flat range of ``shape`` becomes (for tests and the
    scale benchmark)."""
    return len(flat_range_to_boxes(tuple(shape), lo, hi)) if hi > lo and math.prod(shape) else 0
