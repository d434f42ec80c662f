"""One read-once unit's bytes: mapped (or read), verified, and the parts of a box taken out of it.

The helpers :mod:`.read_once` runs per unit, on the rank that checks it and on the ranks of its
node that copy their parts from the same mapping, and per transfer (the parts of a box that lie
in a unit, in the order both sides of a transfer agree on). A chunk that is not one plain array in
a file (a zarr array, a foreign record) is planned the same way over its row-major elements
(:func:`whole_layout`); its reader reads a unit's rows through the checkpoint's reader
(:func:`read_rows`), which checks them, instead of mapping bytes.
"""

from __future__ import annotations

import logging
import math
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
from ..storage.region_read import ChunkLayout, dtype_size, verify_blocks
from ..storage.small_reads import ReadTaskLike
from ..planning.boxes import Box
from .dist import Group
from . import dist

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


def whole_destination(tasks: Sequence[Any], regions: Sequence[BoxT], lay: ChunkLayout, lo: int, hi: int
                      ) -> Optional[Tuple[int, BoxT, torch.Tensor]]:
    """``(region index, part, view)`` when this rank's destination of a unit of a
    :func:`whole_layout` chunk is exactly the unit's rows, one contiguous host tensor of the stored
    dtype: the unit is then read straight into it (no buffer, no copy). None otherwise."""
    parts, n = unit_parts(lay, lo, hi, regions)
    if len(parts) != 1 or n * lay.esize != hi - lo:
        return None
    g, p = parts[0]
    view = dest_view(tasks[g], regions[g], p)
    ok = view.dtype == lay.dtype and view.is_contiguous() and view.device.type == "cpu"
    return (g, p, view) if ok else None


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


# rows of a chunk without a byte layout of its own are planned in blocks of about this many bytes
# (the grain at which ranks that need different rows read different units)
WHOLE_BLOCK = 1 << 20


def whole_layout(key: str, chunk: Any, dtype: torch.dtype, grain: Optional[int] = None) -> ChunkLayout:
    """A chunk that is not one plain array in a file, as the engine plans it: its row-major
    elements from byte 0, no file of its own (``fd`` None: :func:`read_rows` reads it), in blocks
    of whole bands of ``grain`` rows (the storage's own chunks: zarr's) of about
    :data:`WHOLE_BLOCK` bytes or more; one block when ``grain`` is None (a record that is read
    whole whatever part of it is asked for)."""
    shape = tuple(chunk.box.sizes)
    esize = dtype_size(dtype)
    nbytes = math.prod(shape) * esize
    row = math.prod(shape[1:]) * esize if shape else esize
    nrows = shape[0] if shape else 1
    per = nrows if grain is None else grain * max(1, WHOLE_BLOCK // max(1, grain * row))
    bounds = np.append(np.arange(0, nrows, per, dtype=np.int64) * row, nbytes) if nbytes else np.zeros(1, np.int64)
    return ChunkLayout(path=key, fd=None, base=0, data_start=0, nbytes=nbytes, shape=shape, esize=esize,
                       blocks=None, bounds=bounds, what=f"chunk {chunk.box} of {key!r}", length=nbytes, dtype=dtype)


def read_rows(reader: Any, task: ReadTaskLike, lay: ChunkLayout, lo: int, hi: int, st: Stats,
              into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The bytes ``[lo, hi)`` (whole rows: block bounds) of a chunk of :func:`whole_layout`, read
    and checked by ``reader.read_region`` (into ``into``, a contiguous destination of exactly those
    rows, when given); a flat uint8 tensor."""
    t0 = time.perf_counter()
    box = task.chunk.box
    if lay.shape:
        row = lay.nbytes // lay.shape[0]
        r0, r1 = lo // row, -(-hi // row)
        region = Box((box.offsets[0] + r0, *box.offsets[1:]), (r1 - r0, *box.sizes[1:]))
    else:
        region = box
    out = torch.empty(region.sizes, dtype=lay.dtype) if into is None else into
    reader.read_region(task.key, task.chunk, region, out, lay.dtype)
    st.add("read_s", time.perf_counter() - t0)
    st.add("bytes_read", hi - lo)
    return out.reshape(-1).view(torch.uint8)


PHASES = (("plan_s", "plan"), ("own_s", "own reads"), ("map_s", "mappings"), ("read_s", "storage reads"),
          ("crc_s", "checks"), ("exchange_s", "waiting for transfers"), ("copy_s", "copies into place"),
          ("total_s", "total"))


def log_summary(stats: Dict[str, float], mode: str, group: Group, logger: logging.Logger) -> None:
    """Gather every rank's statistics to the group's first rank and log a per-phase, per-rank table
    (INFO for ``two_stage``, as Megatron-Core's two-stage load reports; DEBUG otherwise). Collective."""
    gathered = dist.gather_object(dict(stats), dst=dist.coordinator_rank(group), group=group)
    level = logging.INFO if mode == "two_stage" else logging.DEBUG
    if gathered is not None and logger.isEnabledFor(level):
        logger.log(level, "%s", format_summary(gathered, mode))


def format_summary(per_rank: Sequence[Dict[str, float]], mode: str) -> str:
    """Text table: one row per group rank and a max row; seconds per phase, MiB read, sent, received."""
    cols = [k for k, _ in PHASES]
    sizes = ("bytes_read", "bytes_sent", "bytes_received")
    head = f"{'rank':>5} " + " ".join(f"{k[:-2]:>9}" for k in cols) + "".join(f" {k[6:] + ' MiB':>13}" for k in sizes)

    def row(label: str, s: Dict[str, float]) -> str:
        return (f"{label:>5} " + " ".join(f"{s.get(k, 0.0):9.3f}" for k in cols)
                + "".join(f" {s.get(k, 0) / 2**20:13.1f}" for k in sizes))

    rows = [head] + [row(str(r), s) for r, s in enumerate(per_rank)]
    rows.append(row("max", {k: max(s.get(k, 0.0) for s in per_rank) for k in cols + list(sizes)}))
    total = sum(s.get("bytes_read", 0) for s in per_rank)
    return (f"{mode} load summary: {total / 2**20:.1f} MiB read from storage by {len(per_rank)} ranks (seconds "
            "per phase: " + ", ".join(f"{k[:-2]} = {d}" for k, d in PHASES) + ")\n  " + "\n  ".join(rows))
