"""Read-once loads: every stored block a load touches is read and verified by one rank of the job.

When the ranks' requests interleave inside stored chunks (rows saved, columns requested),
overlap (data-parallel replicas) or share the blocks at their borders (uneven splits),
each rank reading and checking the blocks it touches reads the checkpoint several times
over. Here:

0. **shortcut** (``"auto"``, one ``all_reduce``): when every rank's tasks read whole stored chunks of
   main-replica requests that the load's request check proved disjoint, no block is shared and
   the load reads as ``"local"`` without the steps below (the same-layout load);
1. **needs to owners** (``all_to_all``): for every stored chunk it needs, a rank sends the
   chunk's owner (a hash of its file and offset picks one rank) the block-aligned byte
   ranges it touches, its requested boxes and its node;
2. **decision** (one ``all_reduce``): the owners add up the bytes the ranks would read on
   their own and the bytes of the union. ``load_strategy="auto"`` goes on only when the
   union is smaller by at least 1 MiB per rank (otherwise every rank reads its own blocks, as
   ``"local"``: two more exchanges cost more than re-reading a few shared blocks);
   ``"read_once"`` always goes on. Under ``"auto"``, whole items of at most 64 KiB (norms,
   biases) are left out of this count and of the plan: each rank reads its own, in runs, as
   ``"local"`` does (a unit of the plan costs more than reading such an item again);
3. **plan** (``all_to_all``): each owner cuts the union into block-aligned units and gives
   each unit one reader among the ranks touching it (:func:`~..planning.read_once.plan_chunk`),
   and tells every rank the units it touches;
4. **read, verify, copy**: the reader of a unit checks its blocks. Ranks on the reader's
   node (same host and ``GROUP_RANK`` / ``RANK // LOCAL_WORLD_SIZE``) copy their boxes
   straight from the file's shared mapping, i.e. the node's page cache: a block is read
   from storage and verified once, then copied by every rank that needs a slice of it.
   Ranks on other nodes get exactly their slices from the reader over the process group,
   in one order shared by all ranks, with at most ``memory_budget`` bytes of send and
   receive buffers in flight per rank (a slice that is one run of the destination, as a row
   split loaded by columns gives, is received in place: no buffer, no copy). Files that
   cannot be mapped (fsspec URLs) are read into buffers by the reader and every other rank
   counts as another node. A chunk that no other rank needs, for one destination, is read by its
   rank as ``"local"`` reads: straight into place and checked (a mapping and a copy out of it cost
   ~40% more).

A damaged block fails the load on every rank, naming the file and the block: the reader
records the error and still sends (so no rank waits forever), and the caller's final
agreement raises everywhere; nothing is returned from an unverified block.

Simulate several nodes on one host with ``LOCAL_WORLD_SIZE=1`` (every rank its own node).

``fully_parallel`` and ``two_stage`` (Megatron-Core's names for loads that read each byte once per
data-parallel group) are this engine with the plan always made (no step 2 decision), on any backend:
a chunk that is not one plain array in a file (zarr's arrays, foreign records) is planned over its
rows and its units are read through the checkpoint's reader (``read_once_units.whole_layout``).
Whole items of at most 64 KiB are read by each rank that needs them, as under ``"auto"``.
``two_stage`` logs a per-phase, per-rank summary on the group's first rank (INFO).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import zlib
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import numpy as np
import torch
import torch.distributed as tdist

from ..planning.read_once import ChunkNeeds, merge_ranges, plan_chunk, touched_ranges, union_bytes
from ..planning.read_once import pieces as _pieces
from ..planning.records import digest64
from ..planning.records import MessageWriter, decode
from ..storage.fs import byte_view
from ..storage.fs import can_map
from ..storage.small_reads import SMALL_ITEM, read_order, read_tasks
from ..storage.opened import CheckpointReader
from . import dist
from .dist import Group
from .failure import Failure
from .transfer import Transfers
from .read_once_units import (Source, Stats, copy_parts, delivered, dest_view, log_summary, map_unit, read_rows,
                              unit_parts, unmap, verify_unit, whole_destination, whole_layout)

logger = logging.getLogger(__name__)

STRATEGIES = ("auto", "read_once", "fully_parallel", "two_stage")
# "auto" reads once only when that saves at least this many bytes per rank on average: below,
# the two extra exchanges of the plan cost more than reading the shared blocks again
MIN_SAVING_PER_RANK = 1 << 20
_TAG = 0x52_4F  # one tag for every transfer: pairs match messages in the shared order
# "auto": whole items of at most this many bytes (a model's norms and biases) are read by each rank
# that needs them, as "local" reads them (in runs of adjacent items): a unit of the plan costs
# ~200 us (its mapping, check and messages; measured), more than reading such an item again
SMALL_ALONE = 64 << 10


def node_of(rank: int) -> int:
    """This process's node: its host and torchrun's node index (``GROUP_RANK``, or
    ``RANK // LOCAL_WORLD_SIZE``). Ranks with the same value share a page cache."""
    index = os.environ.get("GROUP_RANK")
    if index is None:
        lws = dist.local_world_size()
        global_rank = tdist.get_rank() if dist.is_distributed() else rank
        index = str(global_rank // lws) if lws else "0"
    return zlib.crc32(f"{socket.gethostname()}/{index}".encode()) & 0x3FFFFFFF


@dataclass
class _Chunk:
    """A stored chunk this rank needs, with its tasks and the units it takes part in."""

    file: str
    offset: int
    task_list: List[Any]
    layout: Any
    ranges: List[Tuple[int, int]]
    units: List[Tuple[int, int, int, int, bool]] = field(default_factory=list)  # lo, hi, reader, reader node, first
    whole: bool = False  # not one plain array in a file: units read through the reader (read_rows)
    mapped: bool = False  # its units come from a shared mapping of the file (same-node ranks copy from it)
    node: int = -1  # this rank's node for this chunk (its own rank's when not mapped)
    remote: Dict[Tuple[int, int], List[Tuple[int, List[Tuple[Tuple[int, ...], Tuple[int, ...]]]]]] = field(default_factory=dict)
    sole: bool = False  # no other rank needs any of it: this rank reads its tasks itself, as "local" does

    @property
    def regions(self) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
        c = self.task_list[0].chunk.box
        return [(tuple(o - co for o, co in zip(t.overlap.offsets, c.offsets)), tuple(t.overlap.sizes)) for t in self.task_list]


def _owner(file: str, offset: int, world: int) -> int:
    return zlib.crc32(f"{file}@{offset}".encode()) % world


def load_read_once(
    reader: CheckpointReader, tasks: List[Any], failed_before: bool, group: Group, *, mode: str = "auto",
    thread_count: int = 2, memory_budget: int = 1 << 30, disjoint: bool = False,
) -> Tuple[str, Dict[str, float]]:
    """Collective: fill every task's ``out`` reading each touched block once per job.

    ``mode``: one of :data:`STRATEGIES`. Returns ``(outcome, stats)``: ``"done"``; ``"local"`` when ``mode="auto"`` found
    nothing to save (the caller reads as ``"local"``); ``"failed"`` when some rank failed
    before reading (the caller's final agreement raises). Raises after the last transfer
    when a read, a check or a copy failed on this rank.

    ``disjoint``: this rank's tasks read whole stored chunks for main-replica requests that the
    load's request check found disjoint from every other rank's. When that holds on every rank
    (``mode="auto"``), no stored block is touched twice and one ``all_reduce`` decides "local"
    (the same-layout load) without computing touched ranges or exchanging them.
    """
    if mode not in STRATEGIES:
        raise ValueError(f"unknown shared-read load strategy {mode!r}; choose one of {STRATEGIES}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    st = Stats()
    t0 = time.perf_counter()
    if mode == "auto":
        mine = 0
        if not failed_before and disjoint:
            mine = sum(t.overlap.numel * t.dtype.itemsize for t in tasks)  # each byte read once anyway
        failed, not_disjoint, separate = dist.all_reduce_ints(
            [int(failed_before), 0 if (disjoint or failed_before) else 1, mine], "sum", group
        )
        if failed or not not_disjoint:
            st.values.update(plan_s=time.perf_counter() - t0, separate_bytes=separate, union_bytes=separate,
                             read_once=0)
            return ("failed" if failed else "local"), dict(st.values)
    # what follows moves bytes in host memory: on a group that takes only CUDA tensors (NCCL), over
    # a gloo group of the same ranks (made once per group, here where every rank goes on)
    group = dist.host_group(group)
    chunks: Dict[Tuple[str, int], _Chunk] = {}
    small: List[Any] = []
    outgoing: Dict[int, bytes] = {}
    owned: Dict[Tuple[str, int], Tuple[ChunkNeeds, dict]] = {}
    # this rank's own failure: a load that fails here must raise here, however the group decides
    # (the caller's agreement then raises on every rank); failed_before: some step before failed
    failure = Failure()
    node = -1 - rank
    mapped = False
    if not failed_before:
        with failure.capture():
            chunks, small = _collect(reader, tasks, small_alone=mode != "read_once")
            # ranks share a page cache only through mapped local files; otherwise each is its own node
            files = {c.file: reader.file_reader(c.file) for c in chunks.values() if not c.whole}
            mapped = all(can_map(fd) for fd in files.values())
            if mapped:
                node = node_of(rank)
            for c in chunks.values():
                c.mapped = mapped and not c.whole
                c.node = node if c.mapped else -1 - rank
            outgoing = _encode_ranges(chunks, world)
    # decision: bytes the ranks would read each on its own vs the union (flat integer arrays,
    # vectorised at the owners: cheap also for tens of thousands of small chunks)
    inbox = dist.all_to_all_bytes(outgoing if not failure.failed else {}, group)
    separate = union = 0
    if not (failure.failed or failed_before):
        with failure.capture():
            separate = sum(b - a for c in chunks.values() for a, b in c.ranges)
            arr = np.frombuffer(b"".join(inbox.values()), dtype=np.int64).reshape(-1, 3)
            union = union_bytes(arr[:, 0], arr[:, 1], arr[:, 2])
    failed, separate, union = dist.all_reduce_ints([int(failure.failed or failed_before), separate, union], "sum", group)
    st.values.update(plan_s=time.perf_counter() - t0, separate_bytes=separate, union_bytes=union, read_once=0)
    if failure.failed:
        raise failure.exc  # (after the collective: every rank has taken part in it)
    if failed or (mode == "auto" and separate - union < MIN_SAVING_PER_RANK * world):
        return ("failed" if failed else "local"), dict(st.values)
    # needs in full to the owners; then the owners plan, and tell every rank its units. A rank that
    # failed at a step still takes part in the later exchanges, with nothing to say.
    outgoing = {}
    with failure.capture():
        _layouts(reader, chunks)
        outgoing = _encode_needs(chunks, world)
    inbox = dist.all_to_all_bytes(outgoing if not failure.failed else {}, group)
    if not failure.failed:
        with failure.capture():
            owned = _decode_needs(inbox)
    replies: Dict[int, bytes] = {}
    if not failure.failed:
        with failure.capture():
            replies = _plan_replies(owned)
    inbox = dist.all_to_all_bytes(replies if not failure.failed else {}, group)
    if not failure.failed:
        with failure.capture():
            _decode_replies(inbox, chunks)
    if dist.all_reduce_ints([int(failure.failed)], "max", group)[0]:
        if failure.failed:
            raise failure.exc
        return "failed", dict(st.values)
    st.values["plan_s"] = time.perf_counter() - t0
    st.values["read_once"] = 1
    st.values["small_items_local"] = len(small)
    _execute(reader, chunks, small, rank, group, thread_count, memory_budget, st, failure)
    st.values["total_s"] = time.perf_counter() - t0
    if mode in ("fully_parallel", "two_stage"):
        # (the summary's "read" counts the own reads too; the load adds them from the reader's statistics)
        log_summary({**st.values, "bytes_read": st.values["bytes_read"] + st.values["own_bytes"]}, mode, group, logger)
    if failure.failed:
        raise failure.exc
    return "done", dict(st.values)


def _collect(reader: CheckpointReader, tasks: List[Any], small_alone: bool = False
             ) -> Tuple[Dict[Tuple[str, int], _Chunk], List[Any]]:
    """This rank's chunks (tasks grouped, touched ranges computed) and, with ``small_alone``, whole
    items of at most ``SMALL_ALONE`` bytes, which this rank reads itself."""
    chunks: Dict[Tuple[str, int], _Chunk] = {}
    small: List[Any] = []
    records = getattr(reader, "block_records", None) or {}
    layout_of = getattr(reader, "chunk_layout", None)  # (zarr: none, its arrays are read in bands of rows)
    grain = getattr(reader, "row_grain", None)
    for t in tasks:
        info = t.chunk.storage
        cid = (info.relative_path, info.offset)
        c = chunks.get(cid)
        if c is None:
            c = chunks[cid] = _Chunk(cid[0], cid[1], [], None, [])
        c.task_list.append(t)
    for cid, c in list(chunks.items()):
        t = c.task_list[0]
        brec = records.get(cid) if len(c.task_list) == 1 and t.overlap == t.chunk.box else None
        if brec is not None and small_alone and t.chunk.storage.length <= SMALL_ALONE:
            small.append(t)
            del chunks[cid]
            continue
        if brec is not None:  # a whole chunk: its data's blocks; the layout only if reading once
            c.ranges = [(brec.data_offset, brec.data_offset + brec.data_length)] if brec.data_length else []
            continue
        c.layout = layout_of(t.key, t.chunk, t.dtype) if layout_of is not None else None
        if c.layout is None:
            c.layout, c.whole = whole_layout(t.key, t.chunk, t.dtype, grain(t.key) if grain else None), True
    for c in chunks.values():
        lay = c.layout
        t = c.task_list[0]
        if lay is None:
            continue
        if len(c.task_list) == 1 and t.overlap == t.chunk.box:  # the whole chunk: its data's blocks
            b = lay.bounds
            lo = int(b[np.searchsorted(b, lay.data_start, side="right") - 1])
            hi = int(b[min(len(b) - 1, np.searchsorted(b, lay.data_start + lay.nbytes - 1, side="right"))])
            c.ranges = [(lo, hi)] if lay.nbytes else []
            continue
        spans = []
        for starts, lens in c.regions:
            spans += touched_ranges(lay.bounds, lay.data_start, lay.shape, lay.esize, starts, lens)
        c.ranges = merge_ranges(np.array([a for a, _ in spans], dtype=np.int64), np.array([b for _, b in spans], dtype=np.int64))
    return chunks, small


def _layouts(reader: CheckpointReader, chunks: Dict[Tuple[str, int], _Chunk]) -> None:
    """The layouts _collect left for later (checks of tens of microseconds per chunk: with many
    small tensors, more than the decision that the load reads as ``local``)."""
    for c in (c for c in chunks.values() if c.layout is None):
        c.layout = reader.chunk_layout(c.task_list[0].key, c.task_list[0].chunk, c.task_list[0].dtype)


def _chunk_id(file: str, offset: int) -> int:
    return digest64(f"{file}@{offset}".encode()) & 0x7FFFFFFFFFFFFFFF


def _encode_ranges(chunks: Dict[Tuple[str, int], _Chunk], world: int) -> Dict[int, bytes]:
    """Per owner: (chunk id, lo, hi) of every touched range, as int64 triples."""
    rows: Dict[int, List[int]] = defaultdict(list)
    for c in chunks.values():
        cid = _chunk_id(c.file, c.offset)
        out = rows[_owner(c.file, c.offset, world)]
        for a, b in c.ranges:
            out += (cid, a, b)
    return {d: np.array(v, dtype=np.int64).tobytes() for d, v in rows.items()}


def _encode_needs(chunks: Dict[Tuple[str, int], _Chunk], world: int) -> Dict[int, bytes]:
    writers: Dict[int, MessageWriter] = {}
    for c in chunks.values():
        if not c.ranges:
            continue
        w = writers.setdefault(_owner(c.file, c.offset, world), MessageWriter())
        lay = c.layout
        regions = c.regions
        w.add(w.sid(c.file), c.offset, c.node, lay.esize, lay.data_start, len(lay.shape), *lay.shape)
        w.add(len(lay.bounds), *lay.bounds.tolist())
        w.add(len(c.ranges), *[v for r in c.ranges for v in r])
        w.add(len(regions), *[v for s, n in regions for v in (*s, *n)])
    return {d: w.tobytes() for d, w in writers.items()}


def _decode_needs(inbox: Dict[int, bytes]) -> Dict[Tuple[str, int], Tuple[ChunkNeeds, dict]]:
    owned: Dict[Tuple[str, int], Tuple[ChunkNeeds, dict]] = {}
    for src in sorted(inbox):
        strings, ints = decode(inbox[src])
        p = 0
        while p < len(ints):
            f, off, node, esize, ds, nd = ints[p : p + 6]
            p += 6
            shape = tuple(ints[p : p + nd])
            p += nd
            nb = ints[p]
            bounds = np.array(ints[p + 1 : p + 1 + nb], dtype=np.int64)
            p += 1 + nb
            nr = ints[p]
            ranges = [(ints[p + 1 + 2 * i], ints[p + 2 + 2 * i]) for i in range(nr)]
            p += 1 + 2 * nr
            ng = ints[p]
            p += 1
            regions = []
            for _ in range(ng):
                regions.append((tuple(ints[p : p + nd]), tuple(ints[p + nd : p + 2 * nd])))
                p += 2 * nd
            cid = (strings[f], off)
            if cid not in owned:
                owned[cid] = (ChunkNeeds(bounds), {"shape": shape, "esize": esize, "data_start": ds, "regions": {}, "nodes": {}})
            needs, info = owned[cid]
            needs.ranks.append(src)
            needs.nodes.append(node)
            needs.ranges.append(ranges)
            info["regions"][src] = regions
            info["nodes"][src] = node
    return owned


def _plan_replies(owned: Dict[Tuple[str, int], Tuple[ChunkNeeds, dict]]) -> Dict[int, bytes]:
    writers: Dict[int, MessageWriter] = {}
    load: Dict[int, int] = {}
    for cid in sorted(owned):
        needs, info = owned[cid]
        units = plan_chunk(needs, load, salt=f"{cid[0]}@{cid[1]}")
        first_lo = units[0].lo if units else -1
        for rank in needs.ranks:
            mine = [u for u in units if rank in u.needers]
            w = writers.setdefault(rank, MessageWriter())
            w.add(w.sid(cid[0]), cid[1], int(len(needs.ranks) == 1), len(mine))
            for u in mine:
                rnode = info["nodes"][u.reader]
                w.add(u.lo, u.hi, u.reader, rnode, 1 if u.lo == first_lo else 0)
                remote = [r for r in u.needers if info["nodes"][r] != rnode] if u.reader == rank else []
                w.add(len(remote))
                for r in remote:
                    regions = info["regions"][r]
                    w.add(r, len(regions), *[v for s, n in regions for v in (*s, *n)])
    return {d: w.tobytes() for d, w in writers.items()}


def _decode_replies(inbox: Dict[int, bytes], chunks: Dict[Tuple[str, int], _Chunk]) -> None:
    for src in sorted(inbox):
        strings, ints = decode(inbox[src])
        p = 0
        while p < len(ints):
            c = chunks[(strings[ints[p]], ints[p + 1])]
            c.sole, n = bool(ints[p + 2]), ints[p + 3]
            p += 4
            nd = len(c.layout.shape)
            for _ in range(n):
                lo, hi, rd, rnode, first, nremote = ints[p : p + 6]
                p += 6
                c.units.append((lo, hi, rd, rnode, bool(first)))
                remote = []
                for _ in range(nremote):
                    r, ng = ints[p], ints[p + 1]
                    p += 2
                    regions = []
                    for _ in range(ng):
                        regions.append((tuple(ints[p : p + nd]), tuple(ints[p + nd : p + 2 * nd])))
                        p += 2 * nd
                    remote.append((r, regions))
                if remote:
                    c.remote[(lo, hi)] = remote


def _execute(reader, chunks, small, rank, group, thread_count, budget, st, failure: Failure) -> None:
    """Verify this rank's units, copy node-local slices from the mapping, exchange the rest (the
    first error is kept in ``failure``; every transfer still runs, so no peer waits forever)."""
    note = failure.record

    def copy_local(c: _Chunk, src: Source, lo: int, hi: int) -> None:
        regions = c.regions
        copy_parts(c.task_list, regions, unit_parts(c.layout, lo, hi, regions)[0], src)

    def local_work(c: _Chunk) -> None:
        """Units this rank checks for its node only, and its copies of the node-local parts.

        A unit this rank checks is taken a piece at a time: the piece's blocks are checked,
        then this rank's parts of them are copied out while they are still in cache. The parts
        in units checked by the node's other ranks are copied from the mapping as they are.
        """
        if not c.mapped or not c.units:
            return  # unmapped: every part comes through _transfer (also from this rank's own reads)
        lay = c.layout
        try:
            t_copy = 0.0
            dtype = c.task_list[0].dtype
            for lo, hi, rd, rnode, first in c.units:
                if rnode != c.node:
                    continue  # read on another node: arrives through _transfer
                im, at = map_unit(lay, lo, hi, st, POPULATE)
                try:
                    src = Source(lay, dtype, im.mm, lo, hi, at)
                    if rd == rank and (lo, hi) not in c.remote:
                        if first and lay.has_frame:
                            reader.check_frame(c.task_list[0].chunk, lay)
                        for p_lo, p_hi in _pieces(lay.bounds, lo, hi, PIECE):
                            verify_unit(c.layout, im, at, p_lo, p_hi, st)
                            t0 = time.perf_counter()
                            copy_local(c, src, p_lo, p_hi)
                            t_copy += time.perf_counter() - t0
                    else:
                        t0 = time.perf_counter()
                        copy_local(c, src, lo, hi)
                        t_copy += time.perf_counter() - t0
                    del src
                finally:
                    unmap(im, st)
            st.add("copy_s", t_copy)
            st.add("bytes_copied", sum(t.out.numel() for t in c.task_list) * lay.esize)
        except Exception as e:
            note(e)

    # a chunk no other rank needs, for one destination, is read as "local" reads: straight into place,
    # checked (no mapping, no copy out of one: 0.12 s against 0.17-0.18 s for a 2 x 512 MiB
    # same-layout load). (Several destinations of one chunk stay on units: read per destination, a
    # block at their border would be read twice.) Whole items up to SMALL_ITEM join the small ones,
    # read in runs of adjacent items.
    own = {k: c.task_list[0] for k, c in chunks.items() if c.sole and len(c.task_list) == 1}
    chunks = {k: c for k, c in chunks.items() if k not in own}
    alone = sorted(small + [t for t in own.values() if t.chunk.storage.length <= SMALL_ITEM], key=read_order)
    large = [t for t in own.values() if t.chunk.storage.length > SMALL_ITEM]
    ordered = []  # (file, offset, lo, hi, chunk, role, extra): transfers in the order shared by the group
    for c in chunks.values():
        for lo, hi, rd, rnode, first in c.units:
            if rd == rank and ((lo, hi) in c.remote or not c.mapped):
                ordered.append((c.file, c.offset, lo, hi, c, "send", first))
            elif rd != rank and (rnode != c.node or not c.mapped):
                ordered.append((c.file, c.offset, lo, hi, c, "recv", rd))
    ordered.sort(key=lambda x: x[:4])
    pool = ThreadPoolExecutor(max(1, int(thread_count)), thread_name_prefix="ckpt-read-once")
    try:
        futures = [pool.submit(local_work, c) for c in sorted(chunks.values(), key=lambda c: (c.file, c.offset))]
        futures += [pool.submit(_read_own, reader, [t], st) for t in large]
        if alone:
            futures.append(pool.submit(_read_own, reader, alone, st))
        _transfer(reader, ordered, rank, group, budget, st, note)
        for e in [f.exception() for f in futures]:
            if e is not None:
                note(e)
    finally:
        pool.shutdown(wait=True)


def _read_own(reader: CheckpointReader, tasks: List[Any], st: Stats) -> None:
    """Read tasks that no other rank shares, as ``"local"`` reads them (one thread: the pool runs
    the other chunks beside it)."""
    t0 = time.perf_counter()
    read_tasks(reader, tasks, 1)
    # (the bytes, reads and checks are counted by the reader: the load adds its statistics)
    st.add("own_s", time.perf_counter() - t0)
    st.add("own_reads", len(tasks))
    st.add("own_bytes", sum(t.overlap.numel * t.dtype.itemsize for t in tasks))


POPULATE = os.environ.get("CKPT_READ_ONCE_POPULATE", "1") == "1"
# bytes checked, then copied out, at a time: a few blocks, so they are still in the core's cache
PIECE = 2 << 20


def _transfer(reader, ordered, rank, group, budget, st, note) -> None:
    """Sends and receives in the shared order, at most ``budget`` bytes of buffers in flight
    (their peak: ``peak_staging_bytes``)."""
    flight = Transfers(group, _TAG, budget, note, lambda s: st.add("exchange_s", s))
    for file, offset, lo, hi, c, role, extra in ordered:
        lay = c.layout
        dtype = c.task_list[0].dtype
        if role == "send":
            src = im = direct = None
            held = 0 if c.mapped else hi - lo  # (read into memory: counted against the budget while sent)
            flight.hold(held)
            try:
                if extra and lay.has_frame:
                    reader.check_frame(c.task_list[0].chunk, lay)
                if c.whole:
                    direct = whole_destination(c.task_list, c.regions, lay, lo, hi)
                    raw = read_rows(reader, c.task_list[0], lay, lo, hi, st, None if direct is None else direct[2])
                    src = Source(lay, dtype, raw, lo, hi, lambda x: x - lo)
                elif c.mapped:
                    im, at = map_unit(lay, lo, hi, st)
                    raw = verify_unit(c.layout, im, at, lo, hi, st)
                    src = Source(lay, dtype, im.mm, lo, hi, at)
                else:
                    raw = verify_unit(c.layout, None, None, lo, hi, st)
                    src = Source(lay, dtype, raw, lo, hi, lambda x: x - lo)
            except Exception as e:
                note(e)
            receivers = list(c.remote.get((lo, hi), []))
            if not c.mapped:  # unmapped: this rank's own parts come from the buffer too
                receivers.append((rank, c.regions))
            for r, regions in receivers:
                tc = time.perf_counter()
                parts, n = unit_parts(lay, lo, hi, regions)
                if n == 0:
                    continue  # the receiver skips it too
                if r == rank:
                    if direct is not None and src is not None:  # (read straight into its destination)
                        delivered(c.task_list[direct[0]], direct[1])
                    elif src is not None:
                        copy_parts(c.task_list, regions, parts, src)
                    st.add("copy_s", time.perf_counter() - tc)
                    continue
                nbytes = n * lay.esize
                if not c.mapped and src is not None and n == src.flat.numel() and len({g for g, _ in parts}) == 1:
                    # the receiver takes the whole unit, in its order: the bytes read are sent as they are
                    flight.send(byte_view(src.flat), r, keep=src.flat)
                    st.add("bytes_sent", nbytes)
                    continue
                base = flight.buffer(nbytes)
                tc = time.perf_counter()
                buf = base[:nbytes].view(dtype)
                if src is not None:
                    pos = 0
                    for _, p in parts:
                        k = int(np.prod(p[1]))
                        buf[pos : pos + k].view(p[1]).copy_(src.part(*p))
                        pos += k
                else:
                    buf.zero_()  # keep the peer going: the load fails anyway
                st.add("copy_s", time.perf_counter() - tc)
                flight.send(base[:nbytes], r, base)
                st.add("bytes_sent", nbytes)
                del buf
            del src
            flight.release(held)
            if im is not None:
                unmap(im, st)
        else:
            regions = c.regions
            parts, n = unit_parts(lay, lo, hi, regions)
            if n == 0:
                continue
            st.add("bytes_received", n * lay.esize)
            into = dest_view(c.task_list[parts[0][0]], regions[parts[0][0]], parts[0][1]) if len(parts) == 1 else None
            if into is not None and into.dtype == dtype and into.is_contiguous():
                # one box that is one run of the destination (a row split loaded by columns): received
                # in place, no buffer and no copy out of one
                # (byte_view, not view(-1): an error here would leave the sender waiting)
                g, p = parts[0]
                flight.recv(byte_view(into), extra, lambda t=c.task_list[g], p=p: delivered(t, p))
                st.add("bytes_received_in_place", n * lay.esize)
                continue
            base = flight.buffer(n * lay.esize)
            buf = base[: n * lay.esize].view(dtype)

            def unpack(buf=buf, parts=parts, c=c, regions=regions) -> None:
                tc = time.perf_counter()
                pos = 0
                for g, p in parts:
                    k = int(np.prod(p[1]))
                    dest_view(c.task_list[g], regions[g], p).copy_(buf[pos : pos + k].view(p[1]))
                    delivered(c.task_list[g], p)
                    pos += k
                st.add("copy_s", time.perf_counter() - tc)

            flight.recv(base[: n * lay.esize], extra, unpack, base)
            del buf
    flight.settle(-1)
    st.values["peak_staging_bytes"] = flight.peak
