"""Fully-parallel and two-stage loads: each needed byte is read from storage once per group.

Ranks that need the same data (typically a data-parallel group) would otherwise
each read it. Here the group first exchanges what it needs (one ``all_gather``
of small records), every distinct region of a saved chunk becomes a *unit*
assigned to one of the ranks that need it (largest first, to the least-loaded
rank, so the lowest rank is not always chosen), the assigned rank reads it,
and a broadcast delivers it to the others, who copy their parts into place.

* ``fully_parallel``: per memory-bounded round, read everything assigned, then exchange.
* ``two_stage`` (Megatron-Core's TwoStageDataParallelLoadShardedStrategy idea):
  the next round is read in the background while the current round is
  broadcast, and a per-phase, per-rank load-time summary is logged.

Peak extra memory is bounded by ``memory_budget`` bytes of unit buffers per
round (twice that with the two-stage prefetch). A unit needed by one rank
only is read by that rank directly and never broadcast.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as tdist

from ..planning.boxes import Box, relative_slices
from . import dist
from .preprocess import dtype_from_name, dtype_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Need:
    key: str
    chunk: Box
    overlap: Box
    dtype: str


@dataclass
class Unit:
    key: str
    chunk: Box
    region: Box
    dtype: str
    needers: Tuple[int, ...]
    reader: int = -1

    @property
    def nbytes(self) -> int:
        return self.region.numel * torch.empty((), dtype=dtype_from_name(self.dtype)).element_size()


def _bounding(boxes: List[Box]) -> Box:
    lo = [min(b.offsets[a] for b in boxes) for a in range(len(boxes[0].offsets))]
    hi = [max(b.offsets[a] + b.sizes[a] for b in boxes) for a in range(len(boxes[0].offsets))]
    return Box(tuple(lo), tuple(h - l for l, h in zip(lo, hi)))


def plan_units(needs_per_rank: List[List[Need]]) -> List[Unit]:
    """Distinct regions to read and who reads each; identical on every rank."""
    by_chunk: Dict[Tuple[str, Tuple[int, ...]], List[Tuple[int, Need]]] = defaultdict(list)
    for rank, needs in enumerate(needs_per_rank):
        for n in needs:
            by_chunk[(n.key, n.chunk.offsets)].append((rank, n))
    units = []
    for (key, _), entries in sorted(by_chunk.items()):
        region = _bounding([n.overlap for _, n in entries])
        needers = tuple(sorted({r for r, _ in entries}))
        units.append(Unit(key, entries[0][1].chunk, region, entries[0][1].dtype, needers))
    load: Dict[int, int] = defaultdict(int)
    for u in sorted(units, key=lambda u: (-u.nbytes, u.key, u.chunk.offsets)):
        u.reader = min(u.needers, key=lambda r: (load[r], (r - hash_index(u)) % 1_000_003))
        load[u.reader] += u.nbytes
    return units


def hash_index(u: Unit) -> int:
    """Deterministic per-unit number used to rotate tie-breaks between equally loaded ranks."""
    import zlib

    return zlib.crc32(f"{u.key}{u.chunk.offsets}".encode())


def _rounds(units: List[Unit], budget: int) -> List[List[Unit]]:
    rounds, current, size = [], [], 0
    for u in units:
        if current and size + u.nbytes > budget:
            rounds.append(current)
            current, size = [], 0
        current.append(u)
        size += u.nbytes
    if current:
        rounds.append(current)
    return rounds


def exchange_reads(
    reader: Any,
    tasks: List[Any],
    local_error: Optional[str],
    group: Any = None,
    *,
    mode: str = "fully_parallel",
    thread_count: int = 4,
    memory_budget: int = 1 << 30,
) -> Dict[str, float]:
    """Fill every task's ``out`` reading each unit once per group. Collective over ``group``.

    Returns this rank's statistics (bytes read, bytes received, seconds per phase).
    """
    rank = dist.get_rank(group)
    stats: Dict[str, float] = defaultdict(float)
    t0 = time.perf_counter()
    needs = [Need(t.key, t.chunk.box, t.overlap, dtype_name(t.dtype)) for t in tasks]
    gathered = dist.all_gather_object((local_error, needs), group)
    stats["exchange_metadata_s"] = time.perf_counter() - t0
    if any(err for err, _ in gathered):
        return stats  # the caller's final agreement raises on every rank
    units = plan_units([n for _, n in gathered])
    my_tasks: Dict[Tuple[str, Tuple[int, ...]], List[Any]] = defaultdict(list)
    for t in tasks:
        my_tasks[(t.key, t.chunk.box.offsets)].append(t)
    chunk_info = {(t.key, t.chunk.box.offsets): t.chunk for t in tasks}

    def read_unit(u: Unit) -> torch.Tensor:
        buf = torch.empty(u.region.sizes, dtype=dtype_from_name(u.dtype))
        chunk = chunk_info.get((u.key, u.chunk.offsets)) or _find_chunk(reader, u)
        reader.read_region(u.key, chunk, u.region, buf, buf.dtype)
        stats["bytes_read"] += u.nbytes
        return buf

    def deliver(u: Unit, buf: torch.Tensor) -> None:
        for t in my_tasks.get((u.key, u.chunk.offsets), []):
            t.out.copy_(buf[relative_slices(t.overlap, u.region)])

    # units only this rank needs: plain local reads, no broadcast
    t1 = time.perf_counter()
    private = [u for u in units if len(u.needers) == 1 and u.needers[0] == rank]
    shared = [u for u in units if len(u.needers) > 1]
    pool = ThreadPoolExecutor(max(1, thread_count), thread_name_prefix="ckpt-pload")
    # The two-stage prefetch runs a whole round, which itself fans out to ``pool``:
    # it needs its own thread, or a 1-thread pool would wait on itself forever.
    prefetcher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-prefetch")
    try:
        for u, buf in zip(private, pool.map(read_unit, private)):
            deliver(u, buf)
        stats["private_read_s"] = time.perf_counter() - t1
        rounds = _rounds(shared, memory_budget)

        def read_round(rnd: List[Unit]) -> Dict[int, torch.Tensor]:
            mine = [i for i, u in enumerate(rnd) if u.reader == rank]
            return dict(zip(mine, pool.map(lambda i: read_unit(rnd[i]), mine)))

        prefetch = None
        for k, rnd in enumerate(rounds):
            t2 = time.perf_counter()
            err = None
            try:
                if prefetch is not None:
                    bufs = prefetch.result()
                else:
                    bufs = read_round(rnd)
            except Exception as e:  # agree before any broadcast, so nobody waits forever
                err, bufs = f"{type(e).__name__}: {e}", {}
            stats["read_s"] += time.perf_counter() - t2
            errors = [e for e in dist.all_gather_object(err, group) if e]
            if errors:
                raise RuntimeError(f"reading failed during the parallel load: {errors[0]}")
            if mode == "two_stage" and k + 1 < len(rounds):
                prefetch = prefetcher.submit(read_round, rounds[k + 1])
            else:
                prefetch = None
            t3 = time.perf_counter()
            for i, u in enumerate(rnd):
                buf = bufs.get(i)
                if buf is None:
                    buf = torch.empty(u.region.sizes, dtype=dtype_from_name(u.dtype))
                src = u.reader if group is None else tdist.get_global_rank(group, u.reader)
                tdist.broadcast(buf.view(-1).view(torch.uint8), src=src, group=group)
                if u.reader != rank:
                    stats["bytes_received"] += u.nbytes
                if rank in u.needers:
                    deliver(u, buf)
                del buf  # free as soon as it is copied into place
            bufs = {}
            stats["broadcast_s"] += time.perf_counter() - t3
    finally:
        prefetcher.shutdown(wait=True)
        pool.shutdown(wait=True)
    stats["total_s"] = time.perf_counter() - t0
    stats["units_total"] = len(units)
    if mode == "two_stage":
        summary = dist.all_gather_object(dict(stats), group)
        if rank == 0:
            lines = [
                f"rank {r}: read {s.get('bytes_read', 0) / 2**20:.1f} MiB in {s.get('read_s', 0) + s.get('private_read_s', 0):.3f}s, "
                f"received {s.get('bytes_received', 0) / 2**20:.1f} MiB, broadcast {s.get('broadcast_s', 0):.3f}s, "
                f"total {s.get('total_s', 0):.3f}s"
                for r, s in enumerate(summary)
            ]
            logger.info("two-stage load summary (%d units):\n  %s", len(units), "\n  ".join(lines))
    return dict(stats)


def _find_chunk(reader: Any, u: Unit) -> Any:
    for c in reader.chunks[u.key]:
        if c.box == u.chunk:
            return c
    raise KeyError(f"chunk {u.chunk} of {u.key!r} is not in the checkpoint")
