"""Resharding: which parts of which saved chunks fill a requested shard."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

from .boxes import Box, clip_to_shape, intersect, sweep_axis


@dataclass(frozen=True)
class ChunkRead:
    """Copy ``overlap`` (global coordinates) from saved ``chunk`` into the request.

    ``source`` is whatever the index was built with for that chunk (e.g. the
    storage layer's chunk record), so the caller needs no second lookup.
    """

    chunk: Box
    overlap: Box
    source: Any = None


def plan_chunk_reads(request: Box, saved_chunks: Sequence[Box]) -> List[ChunkRead]:
    """Overlaps of ``request`` with every saved chunk (chunks never overlap each other).

    Scans all chunks: for many requests of one tensor build a :class:`ChunkIndex` once.
    """
    reads = []
    for chunk in saved_chunks:
        common = intersect(request, chunk)
        if common is not None:
            reads.append(ChunkRead(chunk, common))
    return reads


class ChunkIndex:
    """The saved chunks of one tensor, sorted once so each request costs O(log n + k).

    Chunks are sorted by their start along the axis where they overlap least
    (:func:`~.boxes.sweep_axis`: the layer axis of a stacked layer tensor, the split
    axis of a tensor-parallel one). A request's candidates are the chunks starting in
    ``(request start - longest chunk, request end)`` along that axis: ``k`` is the
    chunks sharing the request's band, e.g. the tensor-parallel pieces of one layer.

    Example::

        index = ChunkIndex([Box((0, 0), (4, 4)), Box((4, 0), (4, 4))], ["a", "b"])
        [r.source for r in index.reads(Box((3, 0), (2, 4)))]   # ["a", "b"]
    """

    def __init__(self, boxes: Sequence[Box], sources: Optional[Sequence[Any]] = None):
        sources = list(sources) if sources is not None else list(boxes)
        self._build([b.offsets for b in boxes], [b.sizes for b in boxes], sources)

    def _build(self, offsets: List[Tuple[int, ...]], sizes: List[Tuple[int, ...]], sources: List[Any]) -> None:
        self.axis = sweep_axis(offsets, sizes)
        order = range(len(offsets))
        if self.axis >= 0:
            a = self.axis
            order = sorted(order, key=lambda i: offsets[i][a])
        self._order = [(offsets[i], sizes[i], sources[i]) for i in order]
        a = self.axis
        self._starts: List[int] = [o[a] for o, _, _ in self._order] if a >= 0 else []
        self._longest = max((s[a] for _, s, _ in self._order), default=0) if a >= 0 else 0

    def __len__(self) -> int:
        return len(self._order)

    def reads(self, request: Box) -> List[ChunkRead]:
        """Same result as :func:`plan_chunk_reads` (in start order), with ``source`` filled in."""
        order = self._order
        return overlapping_reads(
            request, band(self._starts.__getitem__, len(order), self.axis, self._longest, request),
            lambda i: order[i],
        )


def band(start: Callable[[int], int], n: int, axis: int, longest: int, request: Box) -> range:
    """Positions of the chunks that may overlap ``request``, among ``n`` chunks sorted by their
    start along ``axis`` (``start(i)``; ``longest``: the longest chunk along it). All of them when
    ``axis`` is -1. Shared by :class:`ChunkIndex` and the integer-encoded chunk lists of a
    broadcast ``.metadata``, so both answer a request with the same binary search."""
    if axis < 0:
        return range(n)
    lo = request.offsets[axis]
    first = bisect_left(range(n), lo - longest + 1, key=start)
    return range(first, bisect_left(range(n), lo + request.sizes[axis], key=start))


def overlapping_reads(
    request: Box, candidates: Iterable[int], chunk: Callable[[int], Tuple[Sequence[int], Sequence[int], Any]]
) -> List[ChunkRead]:
    """The :class:`ChunkRead` of every candidate whose chunk (``chunk(i)`` = offsets, sizes,
    source) overlaps ``request``; a :class:`Box` is built only for those."""
    out = []
    ro, rsz = request.offsets, request.sizes
    for i in candidates:
        offsets, sizes, source = chunk(i)
        for o, s, a, b in zip(offsets, sizes, ro, rsz):  # (a loop, not all(...): called per small tensor)
            if not (o < a + b and a < o + s):
                break
        else:
            box = Box(tuple(offsets), tuple(sizes))
            common = request if box == request else intersect(request, box)
            if common is not None:  # (an empty request inside a chunk passes the test above: nothing to read)
                out.append(ChunkRead(box, common, source))
    return out


def uncovered_elements(request: Box, saved_global_shape: Sequence[int], reads: Sequence[ChunkRead]) -> int:
    """Elements of the request inside the saved tensor that no read fills (0 when complete)."""
    inside: Optional[Box] = clip_to_shape(request, saved_global_shape)
    want = inside.numel if inside is not None else 0
    return want - sum(r.overlap.numel for r in reads)
