"""Fully-parallel and two-stage loads.

Checked against the plain (``local``) load with ``torch.equal`` on every tensor, across
layouts (TP x DP, uneven shards, resharded loads, ranks that need nothing, tensors needed
by only some ranks), on the world group and on explicit DP groups, for both backends.
Reads are counted through a hook on the readers: with the parallel strategies no element
is read twice within a group. Staging memory is measured with a hook on the buffer
allocator (live bytes, not time), the prefetch overlap with an event handshake, and the
load-time summary with a logging handler.
"""

from __future__ import annotations

import logging
import threading
import weakref

import pytest
import torch
import torch.distributed as dist

import ckpt_integration as ci
import ckpt_integration.execution.parallel_load as pl
import ckpt_integration.execution.load as load_mod
import ckpt_integration.planning.load_units as lu
from ckpt_integration.storage.torch_dist_reader import TorchDistReader
from ckpt_integration.planning.boxes import Box
from tests.dist_utils import run_distributed, scaled_timeout
from tests.layouts import global_tensor, grid_shard

PARALLEL = ("fully_parallel", "two_stage")
LOGGER = "ckpt_integration.execution.parallel_load"
SHAPES = {"w": (16, 8), "e": (32, 4), "u": (8, 8), "r": (12, 10), "c": (8, 12)}
R_ROWS = [(0, 2), (2, 5), (7, 1), (8, 4)]  # uneven row split of "r" over 4 ranks


def _block(key, shape, rows, cols=None, dtype=torch.float32, replica_id=0, zero=False):
    """ShardedTensor of rows ``(start, size)`` (and cols) of the deterministic global tensor."""
    cols = cols or (0, shape[1])
    data = global_tensor(key, shape, dtype)[rows[0] : rows[0] + rows[1], cols[0] : cols[0] + cols[1]].clone()
    if zero:
        data.zero_()
    return ci.ShardedTensor.from_global_offsets(key, data, shape, (rows[0], cols[0]), replica_id=replica_id)


def _saved_state(rank):
    """Saved layout: TP=2 x DP=2 weight, replicated bf16, private rows, uneven rows, column split."""
    tp, dp = rank % 2, rank // 2
    c_cols = [(0, 4), (4, 4), (8, 4), (0, 4)][rank]
    return {
        "w": grid_shard("w", SHAPES["w"], tp, (2, 1), replica_id=dp),
        "e": ci.ShardedTensor.from_rank_offsets("e", global_tensor("e", SHAPES["e"], torch.bfloat16), replica_id=rank),
        "u": grid_shard("u", SHAPES["u"], rank, (4, 1)),  # needed by one rank each: never exchanged
        "r": _block("r", SHAPES["r"], R_ROWS[rank]),
        "c": _block("c", SHAPES["c"], (0, 8), c_cols, replica_id=int(rank == 3)),
    }


def _same_layout_request(rank):
    sd = _saved_state(rank)
    for v in sd.values():
        v.data.zero_()
    return sd


def _resharded_request(rank):
    """Another layout: W column split instead of row split, R/C re-split with overlapping
    (non-main) requests, E needed by three ranks; rank 3 needs nothing at all."""
    if rank == 3:
        return {}
    tp, dp = rank % 2, rank // 2
    r_rows = [(0, 8), (8, 4), (4, 8)][rank]
    c_rows = [(0, 4), (4, 4), (0, 4)][rank]
    return {
        "w": _block("w", SHAPES["w"], (0, 16), (tp * 4, 4), replica_id=dp, zero=True),
        "e": ci.ShardedTensor.from_rank_offsets("e", torch.zeros(SHAPES["e"], dtype=torch.bfloat16), replica_id=rank),
        "r": _block("r", SHAPES["r"], r_rows, replica_id=int(rank == 2), zero=True),
        "c": _block("c", SHAPES["c"], c_rows, replica_id=int(rank == 2), zero=True),
    }


def _expected(req):
    """What a correct load returns: the matching slices of the global tensors."""
    out = {}
    for name, sh in req.items():
        full = global_tensor(sh.key, sh.global_shape, sh.dtype)
        out[name] = full[tuple(slice(o, o + s) for o, s in zip(sh.global_offset, sh.local_shape))]
    return out


class _Reads:
    """Counts reads: a hook on ``read_region`` of both readers (and on the runs of small items)
    records (key, region) per call."""

    def __init__(self):
        from ckpt_integration.storage.zarr_backend import ZarrReader

        self.log = []
        self.lock = threading.Lock()
        self.fail = None  # a callable(key) -> bool making the read raise
        for cls in (TorchDistReader, ZarrReader):
            real = cls.read_region

            def counting(reader, key, chunk, overlap, out, dtype, _real=real):
                if self.fail is not None and self.fail(key):
                    raise OSError(f"injected read failure for {key!r}")
                with self.lock:
                    self.log.append((key, overlap.offsets, overlap.sizes))
                return _real(reader, key, chunk, overlap, out, dtype)

            cls.read_region = counting
        # whole small items are read in runs of adjacent items (storage/small_reads.py): the same log per item
        from ckpt_integration.storage import small_reads

        real_fetch = small_reads._fetch

        def counting_fetch(reader, span, buf, _real=real_fetch):
            for _name, _off, t, _brec in span:
                if self.fail is not None and self.fail(t.key):
                    raise OSError(f"injected read failure for {t.key!r}")
                with self.lock:
                    self.log.append((t.key, t.overlap.offsets, t.overlap.sizes))
            return _real(reader, span, buf)

        small_reads._fetch = counting_fetch


class _LiveBytes:
    """Live bytes of staging buffers: every ``_new_buffer`` allocation, released when it dies."""

    def __init__(self):
        self.lock = threading.Lock()
        self.live = self.peak = self.count = 0
        real = pl._new_buffer

        def tracked(shape, dtype, device):
            t = real(shape, dtype, device)
            n = t.numel() * t.element_size()
            with self.lock:
                self.live += n
                self.count += 1
                self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, n)
            return t

        pl._new_buffer = tracked

    def _free(self, n):
        with self.lock:
            self.live -= n

    def reset(self):
        with self.lock:
            self.peak = self.live
            self.count = 0


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _gather(obj, world):
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _assert_read_once(reads_per_rank, groups):
    """Within each group no element of any tensor is read twice (every byte once per group)."""
    for g in groups:
        for key, shape in SHAPES.items():
            count = torch.zeros(shape, dtype=torch.int32)
            for r in g:
                for k, off, size in reads_per_rank[r]:
                    if k == key:
                        count[tuple(slice(o, o + s) for o, s in zip(off, size))] += 1
            assert int(count.max()) <= 1, f"group {g}: parts of {key!r} read {int(count.max())} times"


def _compare_strategies(rank, world, path, make_request, groups, group=None, budget=600, **kw):
    """Load with every strategy; parallel ones must equal ``local`` exactly and read once per group."""
    reads, live = kw.pop("reads"), kw.pop("live")
    results, peaks = {}, {}
    for strategy in ("local",) + PARALLEL:
        reads.log.clear()
        live.reset()
        req = make_request(rank)
        out = ci.load(
            req, path, load_strategy=strategy, memory_budget=budget, process_group=group,
            thread_count=1 if strategy == "two_stage" else 2, **kw,
        )
        tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        if dist.get_world_size(group) > 1:  # (what the load's statistics say it ran)
            assert load_mod.last_load_stats["strategy"] == strategy, (strategy, load_mod.last_load_stats)
        for name, exp in _expected(make_request(rank)).items():
            assert torch.equal(tensors[name], exp), (strategy, name)
        results[strategy] = (tensors, _gather(list(reads.log), world))
        peaks[strategy] = live.peak
    local, local_reads = results["local"]
    for strategy in PARALLEL:
        tensors, per_rank = results[strategy]
        assert tensors.keys() == local.keys()
        for name in local:
            assert torch.equal(tensors[name], local[name]), (strategy, name)
        _assert_read_once(per_rank, groups)
        # the same tensors are touched as by the plain load
        assert {k for rr in per_rank for k, _, _ in rr} == {k for rr in local_reads for k, _, _ in rr}
    return results, peaks


def _worker4(rank, world, root):
    reads, live = _Reads(), _LiveBytes()
    cap = _Capture()
    log = logging.getLogger(LOGGER)
    log.setLevel(logging.INFO)
    log.addHandler(cap)
    tp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # the DP groups of TP=2 x DP=2
    dp_group = tp_groups[rank % 2]
    world_groups = [list(range(world))]
    for backend in ("torch_dist", "zarr"):
        path = f"{root}/{backend}"
        ci.save(_saved_state(rank), path, sharded_strategy=backend)
        common = dict(reads=reads, live=live)

        # 1. same layout, world group: E needed by all (broadcast), W by half (point-to-point)
        cap.messages.clear()
        results, _ = _compare_strategies(rank, world, path, _same_layout_request, world_groups, **common)
        local_reads = results["local"][1]
        e_local = sum(1 for rr in local_reads for k, _, _ in rr if k == "e")
        assert e_local == world  # the plain load reads E on every rank: the counting sees duplicates
        readers = {r for r, rr in enumerate(results["fully_parallel"][1]) if any(k in "ew" for k, _, _ in rr)}
        assert len(readers) >= 3, readers  # shared reads spread over the group, not all on rank 0
        summaries = [m for m in cap.messages if "two_stage load summary" in m]
        if rank == 0:
            assert len(summaries) == 1, cap.messages
            text = summaries[0]
            for phase in ("metadata", "read", "exchange", "copy", "total"):
                assert phase in text
            rows = [ln.split()[0] for ln in text.splitlines()[1:]]
            assert rows[1:] == ["0", "1", "2", "3", "max"], rows
        else:
            assert summaries == []

        # 2. resharded, uneven, overlapping requests, rank 3 needs nothing; small budget
        budget = 256
        _, peaks = _compare_strategies(rank, world, path, _resharded_request, world_groups, budget=budget, **common)
        # live staging bytes never exceed max(budget, largest staged unit): with torch_dist the
        # largest is R's saved rows 2:7 (200 B); zarr stores R as one chunk, and the overlapping
        # requests of ranks 0-2 merge into all of it (12 x 10 x 4 = 480 B), staged alone
        bound = max(budget, {"torch_dist": 200, "zarr": 480}[backend])
        for strategy in PARALLEL:
            assert peaks[strategy] <= bound, (strategy, peaks[strategy])
        all_peaks = _gather(peaks, world)
        assert any(p["two_stage"] > 0 for p in all_peaks)  # the layout does need staging somewhere
        if rank == 3:
            assert peaks["fully_parallel"] == peaks["two_stage"] == 0

        # 3. explicit DP groups (TP=2 x DP=2, each DP group of 2 ranks loads on its own)
        cap.messages.clear()
        _compare_strategies(
            rank, world, path, _same_layout_request, [[0, 2], [1, 3]], group=dp_group,
            validate_access_integrity=False, **common,
        )
        summaries = [m for m in cap.messages if "two_stage load summary" in m]
        assert len(summaries) == (1 if rank in (0, 1) else 0)  # on the first rank of each group
        if summaries:
            rows = [ln.split()[0] for ln in summaries[0].splitlines()[1:]]
            assert rows[1:] == ["0", "1", "max"], rows

    # 4. a failure in a DP group names the failing rank by its global rank, as every message does (it
    # said "rank 1" for global rank 2, the second member of [0, 2])
    reads.fail = (lambda key: True) if rank >= 2 else None
    with pytest.raises((ci.CheckpointingException, OSError)) as info:  # (the failing rank: its own OSError)
        ci.load(_same_layout_request(rank), f"{root}/torch_dist", process_group=dp_group, validate_access_integrity=False)
    reads.fail = None
    if rank < 2:
        msg = str(info.value)
        assert isinstance(info.value, ci.errors.DistributedCheckpointingError) and f"rank {rank + 2}: " in msg, msg
        assert "rank 1: " not in msg or rank == 1, msg


def test_parallel_strategies_four_ranks(tmp_path):
    """TP x DP, uneven, resharded, empty rank, DP groups; torch_dist and zarr; equal bytes, reads once."""
    run_distributed(_worker4, 4, str(tmp_path), timeout=150)


def _two_rank_save(rank):
    sd = {
        "shared": ci.ShardedTensor.from_rank_offsets("shared", global_tensor("shared", (64,)), replica_id=rank),
        "x": _block("x", (10, 3), [(0, 7), (7, 3)][rank]),
    }
    if rank == 0:
        for i in range(3):
            sd[f"only0_{i}"] = ci.ShardedTensor.from_rank_offsets(f"only0_{i}", global_tensor(f"only0_{i}", (5, 2)))
    else:
        sd["only1"] = ci.ShardedTensor.from_rank_offsets("only1", global_tensor("only1", (33,)))
    return sd


def _two_rank_request(rank):
    """Different numbers of tensors per rank; overlapping uneven requests of X."""
    sd = _two_rank_save(rank)
    for v in sd.values():
        v.data.zero_()
    sd["x"] = _block("x", (10, 3), [(0, 10), (3, 7)][rank], replica_id=rank, zero=True)
    return sd


def _worker2(rank, world, root):
    reads, live = _Reads(), _LiveBytes()
    path = f"{root}/ckpt"
    ci.save(_two_rank_save(rank), path)
    for budget in (1, 1 << 20):  # every staged unit alone / everything at once
        _, peaks = _compare_strategies(rank, world, path, _two_rank_request, [[0, 1]], budget=budget, reads=reads, live=live)
        if budget == 1:
            assert max(peaks.values()) <= 7 * 3 * 4  # one unit at a time: the largest staged unit
    # a failed read on one rank raises on both ranks (no rank left waiting in a transfer),
    # and the group is still usable afterwards
    reads.fail = (lambda key: True) if rank == 1 else None
    for strategy in PARALLEL:
        with pytest.raises(ci.CheckpointingException) as info:
            ci.load(_two_rank_request(rank), path, load_strategy=strategy, thread_count=1, memory_budget=64)
        # the failing rank raises its own error; the other names it and the rank
        assert "injected read failure" in str(info.value), (rank, str(info.value))
        if rank == 0:
            assert isinstance(info.value, ci.errors.DistributedCheckpointingError) and "rank 1" in str(info.value), str(info.value)
    reads.fail = None
    out = ci.load(_two_rank_request(rank), path, load_strategy="two_stage", thread_count=1)
    for name, exp in _expected(_two_rank_request(rank)).items():
        assert torch.equal(out[name], exp)
    # None is the default; a bad budget or thread count on one rank fails the load on both (rank 1
    # raised a bare TypeError inside a transfer, and rank 0 waited for it until the group's timeout)
    for strategy in PARALLEL + ("read_once", "auto"):
        out = ci.load(_two_rank_request(rank), path, load_strategy=strategy, memory_budget=None, thread_count=None)
        for name, exp in _expected(_two_rank_request(rank)).items():
            assert torch.equal(out[name], exp)
        with pytest.raises(ci.CheckpointingException, match="rank 1: memory_budget must be a non-negative integer"):
            ci.load(_two_rank_request(rank), path, load_strategy=strategy, memory_budget=-1 if rank else None)
        with pytest.raises(ci.CheckpointingException, match="rank 0: thread_count must be a positive integer"):
            ci.load(_two_rank_request(rank), path, load_strategy=strategy, thread_count=1.5 if rank == 0 else 2)


def test_parallel_strategies_two_ranks(tmp_path):
    """DP=2, different tensor counts per rank, thread_count=1, tiny budget, read errors."""
    run_distributed(_worker2, 2, str(tmp_path), timeout=90)


# -- single-process tests of the planning, the pipeline, the memory bound and the summary --


def _need(key, chunk, region, dtype="float32"):
    return lu.Need(key, Box(*chunk), Box(*region), dtype, 4)


def test_plan_balanced_deterministic_and_split_by_region():
    # 8 equal tensors replicated on 4 ranks: 2 reads each, not all on rank 0
    needs = [[_need(f"t{i}", ((0,), (16,)), ((0,), (16,))) for i in range(8)] for _ in range(4)]
    units = lu.plan_units(needs)
    per_reader = {r: sum(1 for u in units if u.reader == r) for r in range(4)}
    assert per_reader == {0: 2, 1: 2, 2: 2, 3: 2}
    # deterministic, and independent of the order of each rank's records
    again = lu.plan_units([list(reversed(n)) for n in needs])
    assert [(u.ident, u.reader) for u in again] == [(u.ident, u.reader) for u in units]
    # single units on an idle group: the tie-break rotates, it is not always the lowest rank
    firsts = {lu.plan_units([[_need(f"k{i}", ((0,), (4,)), ((0,), (4,)))]] * 4)[0].reader for i in range(32)}
    assert len(firsts) >= 3
    # one chunk, disjoint regions -> separate units (no rank reads or receives the other's part);
    # overlapping regions -> one unit (their bounding box), read once
    chunk = ((0, 0), (8, 8))
    split = lu.plan_units([[_need("c", chunk, ((0, 0), (8, 4)))], [_need("c", chunk, ((0, 4), (8, 4)))]])
    assert [(u.region, u.needers) for u in split] == [(Box((0, 0), (8, 4)), (0,)), (Box((0, 4), (8, 4)), (1,))]
    merged = lu.plan_units([[_need("c", chunk, ((0, 0), (5, 8)))], [_need("c", chunk, ((3, 0), (5, 8)))]])
    assert [(u.region, u.needers) for u in merged] == [(Box((0, 0), (8, 8)), (0, 1))]


class _FakeChunk:
    def __init__(self, box):
        self.box = box


class _Task:
    def __init__(self, key, chunk, overlap, out):
        self.key, self.chunk, self.overlap, self.out, self.dtype = key, chunk, overlap, out, out.dtype
        self.got = []  # the delivery ledger every load path records into (planning.delivery)


class _FakeReader:
    """Serves regions of deterministic global tensors; optional hook per read."""

    def __init__(self, on_read=None):
        self.on_read = on_read
        self.reads = []

    def read_region(self, key, chunk, overlap, out, dtype):
        if self.on_read:
            self.on_read(key)
        self.reads.append((key, overlap))
        full = global_tensor(key, (8, 8))
        out.copy_(full[tuple(slice(o, o + s) for o, s in zip(overlap.offsets, overlap.sizes))])


def _column_tasks(n):
    """n tensors (8, 8); each task wants the left 4 columns into a non-contiguous view (staged)."""
    dests, tasks = [], []
    for i in range(n):
        dest = torch.zeros(8, 8)
        dests.append(dest)
        tasks.append(_Task(f"k{i}", _FakeChunk(Box((0, 0), (8, 8))), Box((0, 0), (8, 4)), dest[:, :4]))
    return dests, tasks


@pytest.mark.parametrize("mode", PARALLEL)
@pytest.mark.parametrize("budget", [1, 300, 1 << 20])
def test_staging_memory_is_bounded(mode, budget, monkeypatch):
    monkeypatch.setattr(pl, "_new_buffer", pl._new_buffer)  # restores the real one afterwards
    live = _LiveBytes()
    dests, tasks = _column_tasks(12)
    stats = pl.exchange_reads(_FakeReader(), tasks, False, mode=mode, thread_count=3, memory_budget=budget)
    unit = 8 * 4 * 4
    # every unit staged (non-contiguous destinations), small ones in batches the budget holds
    assert live.count == {1: 12, 300: 6, 1 << 20: 1}[budget]
    assert live.peak <= max(budget, unit) and stats["peak_staging_bytes"] <= max(budget, unit)
    assert live.live == 0  # all freed
    for i, d in enumerate(dests):
        assert torch.equal(d[:, :4], global_tensor(f"k{i}", (8, 8))[:, :4]) and not d[:, 4:].any()


def test_direct_destinations_stage_nothing(monkeypatch):
    monkeypatch.setattr(pl, "_new_buffer", pl._new_buffer)  # restores the real one afterwards
    live = _LiveBytes()
    dest = torch.zeros(8, 8)
    tasks = [_Task("k0", _FakeChunk(Box((0, 0), (8, 8))), Box((0, 0), (4, 8)), dest[:4])]  # contiguous rows
    stats = pl.exchange_reads(_FakeReader(), tasks, False, mode="two_stage", thread_count=1)
    assert live.count == 0 and stats["peak_staging_bytes"] == 0
    assert torch.equal(dest[:4], global_tensor("k0", (8, 8))[:4])


@pytest.mark.parametrize("thread_count", [1, 3])
def test_two_stage_reads_next_unit_during_exchange(thread_count, monkeypatch):
    """While unit i is being exchanged the prefetcher already reads unit i+1 (no wall-clock test:
    the exchange of every unit waits for the read of the next one to start, which only a
    prefetching implementation can satisfy; a sequential one fails on the timeout)."""
    n = 5
    started = [threading.Event() for _ in range(n)]
    order = []

    def on_read(key):
        started[int(key[1:])].set()

    real = pl._exchange_unit

    def exchange(u, buf, rank, size, group):
        i = int(u.key[1:])
        if i + 1 < n:
            assert started[i + 1].wait(scaled_timeout(10)), f"unit {i + 1} was not read while unit {i} was exchanged"
        order.append(i)
        return real(u, buf, rank, size, group)

    monkeypatch.setattr(pl, "_exchange_unit", exchange)
    monkeypatch.setattr(pl, "SMALL_UNIT", 0)  # each unit alone: the pipeline, not the batches
    dests, tasks = _column_tasks(n)
    pl.exchange_reads(_FakeReader(on_read), tasks, False, mode="two_stage", thread_count=thread_count, memory_budget=1 << 20)
    assert order == list(range(n))
    for i, d in enumerate(dests):
        assert torch.equal(d[:, :4], global_tensor(f"k{i}", (8, 8))[:, :4])


def test_fully_parallel_reads_round_before_exchange(monkeypatch):
    events = []
    monkeypatch.setattr(pl, "_exchange_unit", lambda u, *a: events.append(("x", u.key)))
    monkeypatch.setattr(pl, "SMALL_UNIT", 0)  # each unit alone: the rounds, not the batches
    dests, tasks = _column_tasks(4)
    pl.exchange_reads(_FakeReader(lambda k: events.append(("r", k))), tasks, False, mode="fully_parallel",
                      thread_count=1, memory_budget=2 * 128)  # two staged units per round
    kinds = "".join(e[0] for e in events)
    assert kinds == "rrxxrrxx", events


@pytest.mark.parametrize("mode", PARALLEL)
def test_small_units_travel_in_batches(mode, monkeypatch):
    """Thousands of small tensors (norms, biases) must not cost one transfer each: small units with
    the same reader and needers are read into one buffer and exchanged once per batch, within the
    budget, and every destination still gets exactly its own bytes (direct and staged ones alike)."""
    sent = []
    real = pl._exchange_unit
    monkeypatch.setattr(pl, "_exchange_unit", lambda u, buf, *a: (sent.append(buf.numel() * buf.element_size()),
                                                                    real(u, buf, *a)))
    monkeypatch.setattr(pl, "BATCH_BYTES", 3 * 128)
    dests, tasks = _column_tasks(7)  # staged (column views), 128 bytes each
    whole = [torch.zeros(4, 4) for _ in range(2)]  # whole chunks (read in place when alone), 64 bytes each
    tasks += [_Task(f"w{i}", _FakeChunk(Box((0, 0), (4, 4))), Box((0, 0), (4, 4)), d) for i, d in enumerate(whole)]
    stats = pl.exchange_reads(_FakeReader(), tasks, False, mode=mode, thread_count=2)
    assert stats["units_read"] == 9 and stats["units_total"] == 9
    assert sent == [3 * 128, 3 * 128, 128 + 2 * 64]  # k0-k2, k3-k5, then k6 with both whole tensors
    for i, d in enumerate(dests):
        assert torch.equal(d[:, :4], global_tensor(f"k{i}", (8, 8))[:, :4]) and not d[:, 4:].any()
    for i, d in enumerate(whole):
        assert torch.equal(d, global_tensor(f"w{i}", (8, 8))[:4, :4])


def test_a_failed_copy_out_of_a_batch_names_its_own_unit():
    dests, tasks = _column_tasks(4)
    tasks[2].out = torch.zeros(1, 4).expand(8, 4)  # a copy into it fails (elements share memory)
    with pytest.raises(ci.CheckpointingException, match=r"copying 'k2' .* into place failed"):
        pl.exchange_reads(_FakeReader(), tasks, False, mode="two_stage", thread_count=1)
    assert torch.equal(dests[3][:, :4], global_tensor("k3", (8, 8))[:, :4])  # the batch's other units delivered


def test_batches_are_a_function_of_the_plan():
    """The same batches on every rank (the group walks them in one order): small units of one reader
    and needers, in their order, up to the limit; large ones alone; a batch at its first unit's place."""
    needs = [[_need(f"s{i}", ((0,), (16,)), ((0,), (16,))) for i in range(6)] + [_need("big", ((0,), (1024,)), ((0,), (1024,)))]] * 2
    units = lu.plan_units(needs)
    batches = lu.batch_units(units, small=64, limit=128)
    assert sorted(u.index for b in batches for u in b) == list(range(len(units)))
    assert [b[0].index for b in batches] == sorted(b[0].index for b in batches)
    for b in batches:
        assert len({(u.reader, u.needers) for u in b}) == 1
        assert sum(lu.aligned(u.nbytes) for u in b) <= 128 or len(b) == 1
        assert [u.index for u in b] == sorted(u.index for u in b)
    assert [len(b) for b in batches if b[0].key == "big"] == [1]
    assert sum(len(b) for b in batches if b[0].key != "big") == 6 and all(len(b) == 2 for b in batches if b[0].key != "big")
    assert lu.batch_units(units, small=64, limit=128) == batches  # deterministic


def test_summary_is_logged(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    _, tasks = _column_tasks(3)
    stats = pl.exchange_reads(_FakeReader(), tasks, False, mode="two_stage", thread_count=2)
    msgs = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]
    assert len(msgs) == 1 and "two_stage load summary: 3 units" in msgs[0]
    for phase in ("metadata", "plan", "read", "waiting", "exchange", "copy", "total", "read MiB", "peak MiB"):
        assert phase in msgs[0]
    assert [ln.split()[0] for ln in msgs[0].splitlines()[2:]] == ["0", "max"]
    assert stats["bytes_read"] == 3 * 8 * 4 * 4 and stats["units_read"] == 3
    caplog.clear()
    pl.exchange_reads(_FakeReader(), _column_tasks(1)[1], False, mode="fully_parallel")
    assert not [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.INFO]  # DEBUG only


def test_read_error_is_raised_after_the_transfers():
    _, tasks = _column_tasks(3)

    def boom(key):
        if key == "k1":
            raise OSError("disk gone")

    with pytest.raises(ci.CheckpointingException, match="disk gone"):  # a library error, naming the cause
        pl.exchange_reads(_FakeReader(boom), tasks, False, mode="two_stage", thread_count=1, memory_budget=1)


def test_unknown_strategy(tmp_path):
    """``load_strategy`` is a LoadStrategy member or its value; anything else is refused naming the choices."""
    from ckpt_integration.lightning import DistCkptIO
    from ckpt_integration.strategies import LoadStrategy

    ci.save({"a": ci.ShardedTensor.from_rank_offsets("a", torch.ones(2))}, tmp_path / "c")
    for strategy in LoadStrategy:
        out = ci.load({"a": ci.ShardedTensor.from_rank_offsets("a", torch.zeros(2))}, tmp_path / "c", load_strategy=strategy)
        assert torch.equal(out["a"], torch.ones(2)) and strategy == strategy.value
    with pytest.raises(ValueError, match=r"unknown load_strategy 'magic'; choose one of \['auto', 'read_once', 'local'"):
        ci.load({"a": ci.ShardedTensor.from_rank_offsets("a", torch.zeros(2))}, tmp_path / "c", load_strategy="magic")
    assert DistCkptIO(load_strategy=LoadStrategy.two_stage).load_strategy == "two_stage"
    with pytest.raises(ValueError, match="DistCkptIO: unknown load_strategy 'magic'"):
        DistCkptIO(load_strategy="magic")


def test_parallel_strategy_single_process_falls_back(tmp_path):
    ci.save({"a": ci.ShardedTensor.from_rank_offsets("a", torch.ones(2))}, tmp_path / "c")
    out = ci.load({"a": ci.ShardedTensor.from_rank_offsets("a", torch.zeros(2))}, tmp_path / "c", load_strategy="two_stage")
    assert torch.equal(out["a"], torch.ones(2))


def _repeated_loads(rank, world, root):
    from dataclasses import replace

    from ckpt_integration.errors import ShardingIntegrityError
    from ckpt_integration.execution import exchange

    w = global_tensor("w", (8, 4))
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", w.chunk(world)[rank].clone(), (0, rank, world))}, root)
    checks = []
    real = exchange.run
    exchange.run = lambda *a, **k: checks.append(k.get("purpose", "save")) or real(*a, **k)
    # (a request of whole saved chunks is checked by counting them instead of exchange.run)
    real_whole = exchange.check_whole_chunks
    exchange.check_whole_chunks = lambda *a, **k: checks.append("load, whole chunks") or real_whole(*a, **k)
    routed, saves = [], []  # loads and saves that built and routed their shard records
    real_build = exchange.build_routes

    def build(shards, rank_, world_, options):
        (routed if options == "load" else saves).append(1)
        return real_build(shards, rank_, world_, options)

    exchange.build_routes = build
    try:
        cols = lambda: {"w": ci.ShardedTensor.from_rank_offsets("w", torch.zeros(8, 4 // world), (1, rank, world))}  # noqa: E731
        for _ in range(3):  # the same request three times: checked once, its records built once
            assert torch.equal(ci.load(cols(), root)["w"], w.chunk(world, dim=1)[rank])
        assert checks == ["load"] and routed == [1], (checks, routed)
        # one rank's request differs from the one checked (rank 1 has its tensor allocated): every
        # rank builds its records and the check runs, though rank 0's request is the same
        mine = cols()
        if rank == 1:
            mine["w"] = replace(mine["w"], data=None)
        assert torch.equal(ci.load(mine, root)["w"], w.chunk(world, dim=1)[rank])
        assert checks == ["load"] * 2 and routed == [1, 1], (checks, routed)
        # the same again, but rank 0 fails building the records it needs after all: it takes part
        # in the check with nothing and every rank raises, naming it (no rank waits forever)
        real_meta = exchange.shard_meta
        if rank == 0:
            exchange.shard_meta = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("records lost"))
        try:
            # (rank 0's request as checked last, rank 1's changed back; the failing rank raises its own error)
            with pytest.raises(RuntimeError if rank == 0 else ci.CheckpointingException,
                               match="records lost" if rank == 0 else "rank 0: .*records lost"):
                ci.load(cols(), root)
        finally:
            exchange.shard_meta = real_meta
        assert torch.equal(ci.load(cols(), root)["w"], w.chunk(world, dim=1)[rank])  # (checked: nothing cached)
        del checks[1:]
        rows = {"w": ci.ShardedTensor.from_rank_offsets("w", torch.zeros(8 // world, 4), (0, rank, world))}
        assert torch.equal(ci.load(rows, root)["w"], w.chunk(world)[rank])  # another request: checked
        assert checks == ["load", "load, whole chunks"], checks  # (by counting: each is a saved chunk)
        # ranks that disagree on the global shape: checked, refused on every rank, nothing cached
        bad = {"w": ci.ShardedTensor.from_global_offsets("w", torch.zeros(2, 4), (8 + 2 * rank, 4), (0, 0))}
        with pytest.raises(ShardingIntegrityError, match="global shape"):
            ci.load(bad, root)
        with pytest.raises(ShardingIntegrityError, match="global shape"):
            ci.load(bad, root)
        assert checks == ["load", "load, whole chunks", "load", "load"], checks
        ci.save({"x": ci.ShardedTensor.from_rank_offsets("x", torch.ones(2), (0, rank, world))}, root + "_x")
        # the last request checked (rows; one structure is kept), after a save: still not checked again
        assert torch.equal(ci.load(rows, root)["w"], w.chunk(world)[rank])
        assert [c for c in checks if c.startswith("load")] == ["load", "load, whole chunks", "load", "load"], checks
        # saves alike: the structure of the last save planned builds no shard records; one rank
        # adding a tensor makes every rank build its records and plan again
        del saves[:]
        xs = lambda **extra: {"x": ci.ShardedTensor.from_rank_offsets("x", torch.ones(2), (0, rank, world)), **extra}  # noqa: E731
        ci.save(xs(), root + "_y")
        assert saves == [] and checks.count("save") == 1, (saves, checks)
        only1 = {"only1": ci.ShardedTensor.from_rank_offsets("only1", torch.arange(3.0))} if rank == 1 else {}
        ci.save(xs(**only1), root + "_z")
        assert saves == [1] and checks.count("save") == 2, (saves, checks)
        want = {"x": ci.ShardedTensor.from_rank_offsets("x", torch.zeros(2), (0, rank, world))}
        if rank == 1:
            want["only1"] = ci.ShardedTensor.from_rank_offsets("only1", torch.zeros(3))
        got = ci.load(want, root + "_z")
        assert torch.equal(got["x"], torch.ones(2)) and (rank == 0 or torch.equal(got["only1"], torch.arange(3.0)))
    finally:
        exchange.run = real
        exchange.build_routes = real_build
        exchange.check_whole_chunks = real_whole


def test_a_repeated_load_request_is_checked_once(tmp_path):
    """Loads reuse the check of their request like saves reuse their plan: when every rank
    requests what it requested at the last load checked (an evaluation job loading each new
    checkpoint into the same model), the validation exchange is skipped, and so is building the
    request's shard records (its values are compared instead); a request changed on one rank only
    makes every rank build its records and check; a different request, or an invalid one, is
    checked (and refused on every rank) as before, and a save in between keeps its own plan and
    the load's check."""
    run_distributed(_repeated_loads, 2, str(tmp_path / "c"))
