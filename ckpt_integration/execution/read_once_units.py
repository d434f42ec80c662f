"""One read-once unit's bytes: mapped (or read), verified, and the parts of a box taken out of it.

The helpers :mod:`.read_once` runs per unit, on the rank that checks it and on the ranks of its
node that copy their parts from the same mapping, and per transfer (the parts of a box that lie
in a unit, in the order both sides of a transfer agree on).
"""

from __future__ import annotations

import mmap
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..planning.delivery import global_part
from ..planning.read_once import flat_index, range_boxes, strides
from ..storage.fs import ItemMap, typed_view
from ..storage.readers import read_bytes
from ..storage.region_read import ChunkLayout, verify_blocks
from ..storage.small_reads import ReadTaskLike

BoxT = Tuple[Tuple[int, ...], Tuple[int, ...]]


@dataclass
class Stats:
    """Seconds per step and bytes of a shared-read load (summed over its threads: ``add`` holds a
    lock, as ``values[key] += v`` from two threads can lose one of the additions)."""

    values: Dict[str, float] = field(default_factory=lambda: defaultdict(float))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, key: str, v: float) -> None:
        with self.lock:
            self.values[key] += v


def unit_parts(lay: ChunkLayout, lo: int, hi: int, regions: Sequence[BoxT]) -> Tuple[List[Tuple[int, BoxT]], int]:
    """``(region index, part)`` of every part of ``regions`` whose bytes lie in ``[lo, hi)``, in the
    order of a transfer's message, and their number of elements."""
    parts = [(g, p) for g, region in enumerate(regions) for p in range_boxes(lay.shape, lay.esize, lay.data_start, lo, hi, region)]
    return parts, sum(int(np.prod(p[1])) for _, p in parts)


class Source:
    """The stored elements of a chunk whose first byte lies in the item-relative range ``[lo, hi)``,
    as one flat tensor of its dtype over ``buf`` (a mapping of the unit, or the bytes this rank
    read); ``at(x)`` is the index in ``buf`` of item-relative byte ``x``. No copy."""

    def __init__(self, layout: ChunkLayout, dtype: torch.dtype, buf: Union[mmap.mmap, torch.Tensor], lo: int, hi: int,
                 at):
        numel = layout.nbytes // layout.esize
        self.shape, self.strides = layout.shape, strides(layout.shape)
        e0 = min(numel, max(0, -(-(lo - layout.data_start) // layout.esize)))
        e1 = min(numel, max(0, -(-(hi - layout.data_start) // layout.esize)))
        self.e0 = e0
        start = at(layout.data_start + e0 * layout.esize)
        self.flat = typed_view(buf, start, e1 - e0, dtype, layout.esize)
        if self.flat.data_ptr() % layout.esize:
            # elements not aligned in the file (small items follow each other unpadded, foreign files
            # align nothing): copied to an aligned buffer first, as torch's strided copies of some
            # dtypes (complex128) crash the process on unaligned elements
            self.flat = typed_view(buf, start, (e1 - e0) * layout.esize, torch.uint8, 1).clone().view(dtype)

    def part(self, starts: Sequence[int], lens: Sequence[int]) -> torch.Tensor:
        if not self.shape:
            return self.flat.reshape(())
        return torch.as_strided(self.flat, tuple(lens), tuple(self.strides), flat_index(starts, self.shape) - self.e0)


def map_unit(lay: ChunkLayout, lo: int, hi: int, st: Stats, populate: bool = True) -> Tuple[ItemMap, Any]:
    """A mapping of item bytes ``[lo, hi)`` (a unit: the pages held stay bounded) and its ``at``."""
    t0 = time.perf_counter()
    im = ItemMap(lay.fd, lay.base + lo, hi - lo, populate=populate)
    st.add("map_s", time.perf_counter() - t0)
    return im, (lambda x: im.at(x - lo))


def unmap(im: ItemMap, st: Stats) -> None:
    """Close a unit's mapping (about half the cost of mapping it: counted in ``map_s`` with it)."""
    t0 = time.perf_counter()
    im.close()
    st.add("map_s", time.perf_counter() - t0)


def dest_view(task: ReadTaskLike, region: Tuple[Tuple[int, ...], Tuple[int, ...]], part: Tuple[Tuple[int, ...], Tuple[int, ...]]) -> torch.Tensor:
    return task.out[tuple(slice(s - r, s - r + n) for s, r, n in zip(part[0], region[0], part[1]))]


def verify_unit(lay: ChunkLayout, im: Optional[ItemMap], at, lo: int, hi: int, st: Stats) -> Optional[torch.Tensor]:
    """Read (unless mapped) and check the blocks of ``[lo, hi)`` of a chunk laid out as ``lay``; the
    bytes read for unmapped files."""
    t0 = time.perf_counter()
    raw = None
    if im is None:
        raw = read_bytes(lay.fd, lay.base + lo, hi - lo)
        st.add("read_s", time.perf_counter() - t0)
        t0 = time.perf_counter()
    if lay.blocks is not None:
        if im is not None:
            with memoryview(im.mm) as whole:
                verify_blocks(lay.blocks, lay.path, lay.base, lay.what, lo, whole[at(lo) : at(hi)])
        else:
            verify_blocks(lay.blocks, lay.path, lay.base, lay.what, lo, memoryview(raw.numpy()))
    st.add("crc_s", time.perf_counter() - t0)
    st.add("bytes_read", hi - lo)
    return raw


def copy_parts(tasks: Sequence[Any], regions: Sequence[BoxT], parts: Sequence[Tuple[int, BoxT]], src: Source) -> None:
    """Copy ``parts`` (of :func:`unit_parts`) out of ``src`` into their tasks' destinations, each
    recorded in its task's delivery ledger."""
    for g, p in parts:
        dest_view(tasks[g], regions[g], p).copy_(src.part(*p))
        delivered(tasks[g], p)


def delivered(task: ReadTaskLike, part: BoxT) -> None:
    """Record ``part`` (chunk-relative starts and sizes) as filled in ``task``'s ledger."""
    task.got.append(global_part(task.chunk.box.offsets, part[0], part[1]))
