"""Which rank reads which part of a saved chunk when ranks need overlapping data (pure planning).

Used by the fully-parallel and two-stage loads (:mod:`..execution.parallel_load`): the needs of
a group are aligned into *units* (within each saved chunk, overlapping requested regions merged
into their bounding box, disjoint ones kept apart) and every unit gets one reader, balanced over
the group. Pure functions of the gathered records, so every rank computes the same plan.

Example::

    a = Need("w", Box((0, 0), (8, 8)), Box((0, 0), (8, 4)), "float32", 4)
    b = Need("w", Box((0, 0), (8, 8)), Box((0, 4), (8, 4)), "float32", 4)
    [u.region for u in plan_units([[a], [b]])]   # two disjoint units, one per rank
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Sequence, Set, Tuple

from .boxes import Box, intersect, sweep_axis


@dataclass(frozen=True)
class Need:
    """One rank's request: ``overlap`` (global coordinates) of saved ``chunk`` of ``key``."""

    key: str
    chunk: Box
    overlap: Box
    dtype: str
    itemsize: int


@dataclass
class Unit:
    """A region of one saved chunk read once by ``reader`` and delivered to ``needers``."""

    key: str
    chunk: Box
    region: Box
    dtype: str
    itemsize: int
    needers: Tuple[int, ...]
    reader: int = -1
    index: int = -1  # position in the group's processing order

    @property
    def nbytes(self) -> int:
        return self.region.numel * self.itemsize

    @property
    def ident(self) -> Tuple[str, Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
        return (self.key, self.chunk.offsets, self.region.offsets, self.region.sizes)


def bounding(boxes: Sequence[Box]) -> Box:
    lo = [min(b.offsets[a] for b in boxes) for a in range(len(boxes[0].offsets))]
    hi = [max(b.offsets[a] + b.sizes[a] for b in boxes) for a in range(len(boxes[0].offsets))]
    return Box(tuple(lo), tuple(h - l for l, h in zip(lo, hi)))


def box_order(b: Box) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    return (b.offsets, b.sizes)


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


def clusters(regions: Dict[Box, Set[int]]) -> List[Tuple[Box, Set[int]]]:
    """Merge overlapping requested regions of one chunk into bounding boxes (until none overlap).

    The result is unique (the finest grouping whose bounding boxes are disjoint:
    two groups whose boxes overlap end up together whatever the order), so each
    pass unions every overlapping pair found by one sweep, then recomputes the
    bounding boxes, and passes repeat only while a bounding box grew into another
    group. Near-linear for the usual disjoint or identical requests (before: a
    pairwise scan restarted after every single merge).
    """
    groups = [(box, set(ranks)) for box, ranks in regions.items()]
    while len(groups) > 1:
        parent = list(range(len(groups)))

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        merged = False
        for i, j in overlapping_pairs([g[0] for g in groups]):
            ri, rj = root(i), root(j)
            if ri != rj:
                parent[max(ri, rj)] = min(ri, rj)
                merged = True
        if not merged:
            break
        members: Dict[int, List[int]] = defaultdict(list)
        for i in range(len(groups)):
            members[root(i)].append(i)
        groups = [
            (bounding([groups[i][0] for i in idx]), set().union(*(groups[i][1] for i in idx)))
            for idx in members.values()
        ]
    return sorted(groups, key=lambda g: box_order(g[0]))


def hash_index(u: Unit) -> int:
    """Deterministic per-unit number used to rotate tie-breaks between equally loaded ranks."""
    return zlib.crc32(f"{u.key}|{u.chunk.offsets}|{u.region.offsets}".encode())


def least_loaded(ranks: Sequence[int], load: Dict[int, int], h: int) -> int:
    """The rank of ``ranks`` that has read the fewest bytes so far (``load``); equal loads are broken
    by rotating over the candidates by ``h`` (a hash of the unit), so ties do not always go to the
    lowest rank. Both shared-read plans (these units, and read-once's block ranges) pick readers so."""
    n = len(ranks)
    return ranks[min(range(n), key=lambda p: (load.get(ranks[p], 0), (p - h) % n))]


def plan_units(needs_per_rank: Sequence[Sequence[Need]]) -> List[Unit]:
    """Units to read, who reads each, in the group's processing order. Identical on every rank.

    ``needs_per_rank[r]`` are the records of group rank ``r``. The result does not
    depend on the order of the records within a rank.
    """
    by_chunk: Dict[Tuple[str, Tuple[int, ...]], Dict[Box, Set[int]]] = defaultdict(lambda: defaultdict(set))
    info: Dict[Tuple[str, Tuple[int, ...]], Tuple[Box, str, int]] = {}
    for rank, needs in enumerate(needs_per_rank):
        for n in needs:
            k = (n.key, n.chunk.offsets)
            by_chunk[k][n.overlap].add(rank)
            info[k] = (n.chunk, n.dtype, n.itemsize)
    units: List[Unit] = []
    for k in sorted(by_chunk):
        chunk, dtype, itemsize = info[k]
        for region, ranks in clusters(by_chunk[k]):
            units.append(Unit(k[0], chunk, region, dtype, itemsize, tuple(sorted(ranks))))
    # balance: largest first, to the least-loaded rank that needs it; equal loads are
    # broken by rotating over the candidates with a hash of the unit (never "lowest rank wins")
    load: Dict[int, int] = defaultdict(int)
    for u in sorted(units, key=lambda u: (-u.nbytes, u.ident)):
        u.reader = least_loaded(u.needers, load, hash_index(u))
        load[u.reader] += u.nbytes
    # processing order: interleave the readers (i-th unit of every reader, then the (i+1)-th, ...)
    # so all readers work at once, each in storage order of its own units
    position: Dict[int, int] = defaultdict(int)
    keyed = []
    for u in units:  # already in storage order (key, chunk, region)
        keyed.append(((position[u.reader], u.reader), u))
        position[u.reader] += 1
    ordered = [u for _, u in sorted(keyed, key=lambda ku: ku[0])]
    for i, u in enumerate(ordered):
        u.index = i
    return ordered


# a batch's units start at multiples of this many bytes of its buffer: a view of any dtype is aligned
ALIGN = 64


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def batch_units(units: Sequence[Unit], small: int, limit: int) -> List[List[Unit]]:
    """The group's items in processing order: each unit alone, except that units of at most
    ``small`` bytes with the same reader and the same needers are taken together, in their order,
    into batches of at most ``limit`` bytes (each unit :func:`aligned`), read by their reader into
    one buffer and delivered in one transfer. A batch takes the place of its first unit.

    A pure function of the plan and the two numbers (every rank of the group must pass the same):
    one transfer per batch instead of one per unit is what makes a load of thousands of small
    tensors (norms, biases) cost about what a local load costs. Example: four 1 KiB units read by
    rank 0 for ranks (0, 1) with ``limit`` 2 KiB: two batches of two."""
    items: List[Tuple[int, List[Unit]]] = []
    open_batch: Dict[Tuple[int, Tuple[int, ...]], Tuple[List[Unit], List[int]]] = {}
    for u in units:
        size = aligned(u.nbytes)
        if u.nbytes > small or size > limit:
            items.append((u.index, [u]))
            continue
        k = (u.reader, u.needers)
        cur = open_batch.get(k)
        if cur is None or cur[1][0] + size > limit:
            cur = open_batch[k] = ([], [0])
            items.append((u.index, cur[0]))
        cur[0].append(u)
        cur[1][0] += size
    return [b for _, b in sorted(items, key=lambda ib: ib[0])]

