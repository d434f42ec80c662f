"""Fully-parallel and two-stage loads: each needed byte is read from storage once per group.

Ranks that need the same data (typically a data-parallel group) would otherwise
each read it. Here (Megatron-Core's ``TwoStageDataParallelLoadShardedStrategy``
steps, generalised to any saved/requested layout):

1. the group exchanges what each rank needs (one ``all_gather`` of small
   ``(key, saved chunk, region)`` records);
2. the needs are aligned: within each saved chunk, requested regions that
   overlap are merged into one *unit* (their bounding box); disjoint regions
   stay separate units, so ranks that need different parts of a chunk never
   read or receive each other's bytes;
3. every unit is assigned one *reader* among the ranks that need it, largest
   unit first to the least-loaded rank (ties rotated by a hash of the unit),
   so reads are balanced over the group and not always done by the lowest
   rank. The plan is a pure function of the gathered records: identical on
   every rank;
4. the units are processed in one order shared by the group: the reader reads
   the unit, it is sent to the other ranks that need it (``broadcast`` when the
   whole group needs it, point-to-point sends to the needers otherwise, so a
   rank that needs nothing takes part in nothing), every needer copies its
   parts into place, and the buffer is freed. Small units (a model's norms and
   biases) with the same reader and needers go as one *batch*
   (:func:`~..planning.load_units.batch_units`): read as one run where they are
   adjacent in a file, sent in one transfer, so thousands of them cost a few
   collectives, not one each.

Modes:

* ``fully_parallel``: per-rank rounds of at most ``memory_budget`` staged
  bytes: read the round (``thread_count`` threads), then exchange it.
* ``two_stage``: a prefetch thread admits this rank's units in the shared
  order while earlier ones are exchanged, so reading (and, for an NCCL-only
  group, the host-to-device copy) of unit ``i+1`` overlaps the exchange of
  unit ``i``, as far as the budget allows. A per-phase, per-rank load-time
  summary is gathered to the group's first rank and logged (INFO).

Memory: staging buffers (reads and receive buffers) live on a rank at the
same time never exceed ``max(memory_budget, largest unit it stages)`` bytes,
in both modes: a unit is admitted only when it fits in what is left of the
budget or nothing else is staged. A rank that needs exactly one contiguous
region of a unit (the usual data-parallel replica) reads or receives straight
into its destination, which stages nothing. Freed per unit.

Deadlock freedom: every rank walks the same ordered unit list and takes part
only in the transfers of the units it needs (or, for a broadcast, all of
them); the prefetcher admits in that same order, so the unit the exchange
waits for is always admitted. Errors (a failed read, a failed copy) are
recorded, the transfer still runs with a zeroed buffer so no peer waits
forever, and the error is raised after the last transfer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..planning.boxes import Box, intersect, relative_slices
from ..planning.load_units import Need, Unit, aligned, batch_units, plan_units
from ..storage.opened import CheckpointReader
from ..storage.fs import byte_view
from ..storage.small_reads import read_tasks
from . import dist
from .dist import Group
from .failure import Failure
from .preprocess import dtype_from_name, dtype_name
from .read_once_units import Stats
from .transfer import Transfers
from ..errors import CheckpointingException, CorruptCheckpointError

logger = logging.getLogger(__name__)

MODES = ("fully_parallel", "two_stage")
# units of at most SMALL_UNIT bytes with the same reader and needers travel in batches of at most
# BATCH_BYTES (or the smallest memory budget of the group): one read run and one transfer each
SMALL_UNIT = 1 << 20
BATCH_BYTES = 16 << 20
_TAG = 0x50_4C  # every unit's transfer: pairs match them in the shared order


class _Budget:
    """Byte budget for staging buffers, admitted in one fixed order.

    ``acquire(n)`` returns once ``n`` more bytes fit, or at once when nothing is
    staged (a unit larger than the budget runs alone). ``peak`` is the largest
    number of bytes ever admitted at the same time.
    """

    def __init__(self, limit: int):
        self.limit = max(0, int(limit))
        self.used = 0
        self.peak = 0
        self.closed = False
        self._cv = threading.Condition()

    def acquire(self, n: int) -> bool:
        with self._cv:
            while not self.closed and self.used > 0 and self.used + n > self.limit:
                self._cv.wait()
            if self.closed:
                return False
            self.used += n
            self.peak = max(self.peak, self.used)
            return True

    def release(self, n: int) -> None:
        with self._cv:
            self.used -= n
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()


def _new_buffer(shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every staging buffer is allocated here (tests hook it to measure live staging bytes)."""
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass
class _Item:
    """One unit, or a batch of small units with one reader and the same needers, as this rank handles it."""

    units: List[Unit]
    tasks: List[List[Any]]  # per unit: this rank's tasks in it
    offsets: List[int]  # per unit: where it starts in the item's buffer
    nbytes: int  # the buffer's bytes
    direct: Optional[torch.Tensor] = None  # destination to read/receive into (no staging)
    staged: int = 0  # bytes admitted against the budget
    future: Optional["Future[torch.Tensor]"] = None
    reads: bool = False  # this rank is the item's reader


@dataclass
class _Part:
    """A unit's read into its view of the item's buffer (a ``ReadTask`` as ``read_tasks`` takes it)."""

    key: str
    chunk: Any
    overlap: Box
    out: torch.Tensor
    dtype: torch.dtype
    got: List[Box] = field(default_factory=list)


def _view(flat: torch.Tensor, offset: int, u: Unit) -> torch.Tensor:
    """Unit ``u``'s region in a flat byte buffer, as a tensor of its dtype and shape."""
    return flat[offset : offset + u.nbytes].view(dtype_from_name(u.dtype)).view(u.region.sizes)


PHASES = (
    ("metadata_s", "metadata exchange"),
    ("plan_s", "plan"),
    ("read_s", "storage reads (summed over threads)"),
    ("h2d_s", "host-to-device copies"),
    ("read_wait_s", "waiting for reads"),
    ("exchange_s", "broadcast/send/recv"),
    ("copy_s", "copy into place"),
    ("total_s", "total"),
)


def exchange_reads(
    reader: CheckpointReader,
    tasks: List[Any],
    failed_before: bool,
    group: Group = None,
    *,
    mode: str = "fully_parallel",
    thread_count: int = 4,
    memory_budget: int = 1 << 30,
) -> Dict[str, float]:
    """Fill every task's ``out`` reading each unit once per group. Collective over ``group``.

    ``tasks`` are this rank's :class:`~ckpt_integration.execution.load.ReadTask` (key,
    chunk, overlap, out, dtype). Returns this rank's statistics (bytes, seconds per
    phase, peak staging bytes; ``failed``: some rank failed before, nothing was read). Raises after the last transfer
    when anything failed on this rank; the caller's final agreement makes every rank raise.
    """
    if mode not in MODES:
        raise ValueError(f"unknown parallel load mode {mode!r}; choose one of {MODES}")
    st = Stats()
    t0 = time.perf_counter()
    needs = [Need(t.key, t.chunk.box, t.overlap, dtype_name(t.dtype), t.dtype.itemsize) for t in tasks]
    gathered = dist.all_gather_object((failed_before, needs, int(memory_budget)), group)
    st.values["metadata_s"] = time.perf_counter() - t0
    if any(failed for failed, _, _ in gathered):
        st.values["failed"] = 1  # nothing read: the caller's final agreement raises on every rank
        return dict(st.values)
    t1 = time.perf_counter()
    units = plan_units([n for _, n, _ in gathered])
    # (the batches must be the same on every rank: the smallest budget of the group bounds them)
    batches = batch_units(units, SMALL_UNIT, min(BATCH_BYTES, *(b for _, _, b in gathered)))
    run = _Run(reader, tasks, group, st, _Budget(memory_budget))
    items = run.items(units, batches)
    st.values["plan_s"] = time.perf_counter() - t1
    st.values["units_total"] = len(units)
    pool = ThreadPoolExecutor(max(1, int(thread_count)), thread_name_prefix="ckpt-pload")
    try:
        if mode == "fully_parallel":
            _run_rounds(items, run.budget, pool, run.read, run.finish)
        else:
            _run_pipelined(items, run.budget, pool, run.read, run.finish, run.failure)
    finally:
        run.budget.close()
        pool.shutdown(wait=True, cancel_futures=True)
    st.values["peak_staging_bytes"] = run.budget.peak
    st.values["total_s"] = time.perf_counter() - t0
    stats = dict(st.values)
    _log_summary(stats, mode, len(units), group)
    if run.failure.failed:
        e = run.failure.exc
        raise type(e)(f"parallel load ({mode}) failed on rank {run.rank} of its group: {e}") from e.__cause__
    return stats


class _Run:
    """One rank's part in a shared-read load: its items, their reads (pool threads) and their
    exchanges (main thread, in the group's order). The first error is kept in ``failure``: every
    transfer still runs, as the peers wait for it."""

    def __init__(self, reader: CheckpointReader, tasks: List[Any], group: Group, st: Stats, budget: _Budget) -> None:
        self.reader, self.tasks, self.group, self.st, self.budget = reader, tasks, group, st, budget
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.device = dist.buffer_device(group)
        self.chunk_info = {(t.key, t.chunk.box.offsets): t.chunk for t in tasks}
        self.failure = Failure()
        self.local = threading.local()  # (a CUDA stream per reader thread)

    def items(self, units: List[Unit], batches: List[List[Unit]]) -> List[_Item]:
        """The batches this rank takes part in (it needs them), with its tasks in each unit."""
        units_of_chunk: Dict[Tuple[str, Tuple[int, ...]], List[Unit]] = defaultdict(list)
        for u in units:
            units_of_chunk[(u.key, u.chunk.offsets)].append(u)
        tasks_of: Dict[int, List[Any]] = defaultdict(list)
        for t in self.tasks:
            for u in units_of_chunk[(t.key, t.chunk.box.offsets)]:
                if intersect(t.overlap, u.region) == t.overlap:
                    tasks_of[u.index].append(t)
                    break
        items: List[_Item] = []
        for batch in batches:
            head = batch[0]
            if self.rank not in head.needers:
                continue  # a unit is only ever sent to the ranks that need it: no part in it
            offsets, end = [], 0
            for u in batch:
                offsets.append(end)
                end += aligned(u.nbytes)
            it = _Item(batch, [tasks_of.get(u.index, []) for u in batch], offsets,
                       end if len(batch) > 1 else head.nbytes, reads=head.reader == self.rank)
            if self.device.type == "cpu" and len(batch) == 1 and len(it.tasks[0]) == 1:
                t = it.tasks[0][0]
                if t.overlap == head.region and t.out.is_contiguous() and t.out.dtype == dtype_from_name(head.dtype):
                    it.direct = t.out
            if it.direct is None:
                it.staged = it.nbytes
            items.append(it)
        return items

    def read(self, it: _Item) -> torch.Tensor:
        """Read one item (on a pool thread): into its destination, or into a staging buffer; a
        batch's units as one run of reads where they are adjacent whole items (``read_tasks``)."""
        if self.failure.failed:  # an earlier unit failed and the load will raise: skip the I/O
            raise RuntimeError("skipped after an earlier failure")
        reader, device = self.reader, self.device
        flat, target = None, it.direct
        if target is None:
            flat = (_new_buffer((it.nbytes,), torch.uint8, device) if device.type == "cpu"
                    else torch.empty(it.nbytes, dtype=torch.uint8, pin_memory=True))
        parts = [_Part(u.key, self.chunk_info.get((u.key, u.chunk.offsets)) or _find_chunk(reader, u), u.region,
                       target if flat is None else _view(flat, off, u), dtype_from_name(u.dtype))
                 for u, off in zip(it.units, it.offsets)]
        tr = time.perf_counter()
        if len(parts) > 1 and getattr(reader, "block_records", None):  # (runs join adjacent items only)
            parts.sort(key=lambda p: (p.chunk.storage.relative_path, p.chunk.storage.offset))
        read_tasks(reader, parts, 1)
        self.st.add("read_s", time.perf_counter() - tr)
        self.st.add("bytes_read", sum(u.nbytes for u in it.units))
        self.st.add("units_read", len(it.units))
        if flat is None:
            return target
        if device.type != "cpu":
            th = time.perf_counter()
            dev = _new_buffer((it.nbytes,), torch.uint8, device)
            stream = getattr(self.local, "stream", None)
            if stream is None:
                stream = self.local.stream = torch.cuda.Stream(device)  # one per reader thread
            with torch.cuda.stream(stream):
                dev.copy_(flat, non_blocking=True)
            stream.synchronize()
            self.st.add("h2d_s", time.perf_counter() - th)
            flat = dev
        return flat

    def finish(self, it: _Item) -> None:
        """Exchange one admitted item, copy it into place, free it (main thread, shared order)."""
        head, st, failure = it.units[0], self.st, self.failure
        what = f"{head.key!r} {head.region}" + (f" (and {len(it.units) - 1} more small units)" if len(it.units) > 1 else "")
        tw = time.perf_counter()
        buf: Optional[torch.Tensor] = None
        if it.future is not None:
            try:
                buf = it.future.result()
            except Exception as e:  # keep the transfer going: peers are waiting for it
                failure.record(_failed(f"reading {what}", e))
        st.add("read_wait_s", time.perf_counter() - tw)
        if buf is None:
            buf = it.direct if it.direct is not None else _new_buffer((it.nbytes,), torch.uint8, self.device)
            if head.reader == self.rank:
                buf.zero_()
        if self.device.type != "cpu":
            buf.record_stream(torch.cuda.current_stream(self.device))
        tx = time.perf_counter()
        _exchange_unit(head, buf, self.rank, self.size, self.group)
        st.add("exchange_s", time.perf_counter() - tx)
        if head.reader != self.rank:
            st.add("bytes_received", sum(u.nbytes for u in it.units))
        if it.direct is None:
            tc = time.perf_counter()
            for u, off, ts in zip(it.units, it.offsets, it.tasks):
                try:
                    view = _view(buf, off, u)
                    for t in ts:
                        t.out.copy_(view[relative_slices(t.overlap, u.region)])
                        t.got.append(t.overlap)  # the delivery ledger (planning.delivery)
                except Exception as e:
                    failure.record(_failed(f"copying {u.key!r} {u.region} into place", e))
            st.add("copy_s", time.perf_counter() - tc)
        else:  # read or received straight into the one task's destination
            it.tasks[0][0].got.append(it.tasks[0][0].overlap)
        it.future = None
        del buf
        self.budget.release(it.staged)


def _failed(what: str, e: BaseException) -> CheckpointingException:
    """``what`` failed with ``e``, as the error the load raises (damage stays damage)."""
    kind = CorruptCheckpointError if isinstance(e, CorruptCheckpointError) else CheckpointingException
    err = kind(f"{what} failed: {type(e).__name__}: {e}")
    err.__cause__ = e
    return err


def _run_rounds(items: List[_Item], budget: _Budget, pool: ThreadPoolExecutor, read, finish) -> None:
    """fully_parallel: read a budget-sized round of this rank's units (in parallel), then exchange it."""
    i = 0
    while i < len(items):
        rnd, used = [items[i]], items[i].staged
        i += 1
        while i < len(items) and used + items[i].staged <= budget.limit:
            used += items[i].staged
            rnd.append(items[i])
            i += 1
        for it in rnd:
            budget.acquire(it.staged)  # never waits: the previous round is released, this one fits
            if it.reads:
                it.future = pool.submit(read, it)
        for it in rnd:
            if it.future is not None:
                it.future.exception()  # the whole round is read before any exchange
        for it in rnd:
            finish(it)


def _run_pipelined(items: List[_Item], budget: _Budget, pool: ThreadPoolExecutor, read, finish, failure: Failure) -> None:
    """two_stage: a prefetch thread admits units in order while the main thread exchanges earlier ones."""
    ready: "queue.Queue[Optional[_Item]]" = queue.Queue()

    def prefetch() -> None:
        try:
            for it in items:
                if not budget.acquire(it.staged):
                    return  # closed: the main thread stopped early
                if it.reads:
                    it.future = pool.submit(read, it)
                ready.put(it)
        except BaseException as e:  # never leave the main thread waiting
            failure.record(_failed("prefetch", e))
        finally:
            ready.put(None)

    # a dedicated thread, not the read pool: with thread_count=1 the pool's only
    # thread must stay free for the reads the prefetcher submits
    thread = threading.Thread(target=prefetch, name="ckpt-prefetch", daemon=True)
    thread.start()
    try:
        done = 0
        while done < len(items):
            it = ready.get()
            if it is None:
                break
            finish(it)
            done += 1
        thread.join()
        for it in items[done:]:  # the prefetcher failed: finish the transfers without it
            budget.acquire(it.staged)
            if it.future is None and it.reads:
                it.future = pool.submit(read, it)
            finish(it)
    finally:
        budget.close()
        thread.join()


def _exchange_unit(u: Unit, buf: torch.Tensor, rank: int, size: int, group: Group) -> None:
    """Deliver the reader's ``buf`` to the other ranks that need ``u``. Called in the shared order."""
    if len(u.needers) == 1 or size == 1:
        return
    flat = byte_view(buf)  # (not reshape: an error here would leave the peers waiting)
    if u.needers == tuple(range(size)):
        dist.broadcast_tensor(flat, dist.global_rank(group, u.reader), group)
        return
    moves = Transfers(group, _TAG)  # (waited for here: the unit's buffer is freed after it)
    if rank == u.reader:
        for r in u.needers:
            if r != rank:
                moves.send(flat, r)
    else:
        moves.recv(flat, u.reader)
    moves.settle()


def _log_summary(stats: Dict[str, float], mode: str, n_units: int, group: Group) -> None:
    """Gather every rank's statistics to the group's first rank and log a per-phase, per-rank table."""
    dst = dist.coordinator_rank(group)
    gathered = dist.gather_object(stats, dst=dst, group=group)
    if gathered is None:
        return
    level = logging.INFO if mode == "two_stage" else logging.DEBUG
    if not logger.isEnabledFor(level):
        return
    lines = [format_summary(gathered, mode, n_units)]
    logger.log(level, "%s", "\n".join(lines))


def format_summary(per_rank: Sequence[Dict[str, float]], mode: str, n_units: int) -> str:
    """Text table: one row per group rank and a max row; seconds per phase, MiB read/received."""
    cols = [k for k, _ in PHASES]
    head = f"{'rank':>5} " + " ".join(f"{k[:-2]:>11}" for k in cols) + f" {'read MiB':>9} {'recv MiB':>9} {'peak MiB':>9}"
    rows = [head]

    def row(label: str, s: Dict[str, float]) -> str:
        return (
            f"{label:>5} " + " ".join(f"{s.get(k, 0.0):11.3f}" for k in cols)
            + f" {s.get('bytes_read', 0) / 2**20:9.1f} {s.get('bytes_received', 0) / 2**20:9.1f}"
            + f" {s.get('peak_staging_bytes', 0) / 2**20:9.1f}"
        )

    for r, s in enumerate(per_rank):
        rows.append(row(str(r), s))
    keys = set(cols) | {"bytes_read", "bytes_received", "peak_staging_bytes"}
    rows.append(row("max", {k: max(s.get(k, 0.0) for s in per_rank) for k in keys}))
    total_read = sum(s.get("bytes_read", 0) for s in per_rank)
    return (
        f"{mode} load summary: {n_units} units, {total_read / 2**20:.1f} MiB read from storage by "
        f"{len(per_rank)} ranks (seconds per phase: " + ", ".join(f"{k[:-2]} = {d}" for k, d in PHASES) + ")\n  "
        + "\n  ".join(rows)
    )


def _find_chunk(reader: CheckpointReader, u: Unit) -> Any:
    for c in reader.chunks[u.key]:
        if c.box == u.chunk:
            return c
    raise KeyError(f"chunk {u.chunk} of {u.key!r} is not in the checkpoint")
