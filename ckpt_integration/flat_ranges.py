"""Flat ranges of a row-major tensor as rectangles (pure arithmetic, no I/O).

A flattened shard (``ShardedTensor.flattened_range``, a ZeRO optimizer's piece of a parameter)
covers a range of the tensor's row-major elements; saved and loaded, it is the rectangles that
range covers. :mod:`ckpt_integration.mapping` re-exports :func:`flat_range_to_boxes`.
"""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple


def flat_range_to_boxes(shape: Sequence[int], start: int, end: int) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """Split the row-major flat range ``[start, end)`` of a tensor of ``shape`` into rectangles.

    Returns ``[(offset, size), ...]`` in flat order; concatenating the boxes' elements in
    row-major order gives the flat range. Per axis at most a partial first part, a block
    of whole sub-tensors and a partial last part (3 boxes for 2-D, recursively for N-D).

    Example: ``flat_range_to_boxes((4, 5), 3, 17)`` ->
    ``[((0, 3), (1, 2)), ((1, 0), (2, 5)), ((3, 0), (1, 2))]``
    """
    shape = tuple(int(s) for s in shape)
    if start >= end:
        return []
    if len(shape) == 0:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (end - start,))]
    row = math.prod(shape[1:])
    first, first_off = divmod(start, row)
    last, last_off = divmod(end, row)
    sub = lambda r, a, b: [((r,) + o, (1,) + s) for o, s in flat_range_to_boxes(shape[1:], a, b)]  # noqa: E731
    if first == last:
        return sub(first, first_off, last_off)
    out = []
    if first_off:
        out += sub(first, first_off, row)
        first += 1
    if last > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (last - first,) + shape[1:]))
    if last_off:
        out += sub(last, 0, last_off)
    return out


def narrowed_flat_runs(fr_start: int, fr_stop: int, local_len: int, inner: int, start: int,
                       length: int) -> List[Tuple[int, int, int]]:
    """``(lo, hi, new_lo)`` of each run of a flattened range ``[fr_start, fr_stop)`` inside a narrowing
    to ``[start, start + length)`` of an axis of ``local_len`` (``inner`` elements per index of it): per
    index of the axes before it, the narrowed region is one run; ``new_lo`` is where the run starts in
    the narrowed shard's flattened order (:meth:`..mapping.ShardedTensor.narrow`)."""
    block, new_block = local_len * inner, length * inner
    out: List[Tuple[int, int, int]] = []
    if block == 0 or new_block == 0:
        return out
    for o in range(fr_start // block, -(-fr_stop // block)):
        lo = max(fr_start, o * block + start * inner)
        hi = min(fr_stop, o * block + (start + length) * inner)
        if lo < hi:
            out.append((lo, hi, o * new_block + lo - o * block - start * inner))
    return out
