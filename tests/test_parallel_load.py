"""Fully-parallel and two-stage loads: Megatron-Core's names for loads that read each byte once
per group, run by the read-once engine (``execution/read_once.py``).

Checked against the plain (``local``) load with ``torch.equal`` on every tensor, across
layouts (TP x DP, uneven shards, resharded loads, ranks that need nothing, tensors needed
by only some ranks), on the world group and on explicit DP groups, for both backends, on one
node (pages shared through the file's mapping) and as if every rank were its own node (bytes
sent over the group). Reads are counted through hooks on the engine's checks and on the
readers: with the parallel strategies no stored byte is read twice within a group. Staging
memory is the load's own statistic, the summary is caught with a logging handler.
"""

from __future__ import annotations

import logging
import os
import re
import threading

import pytest
import torch
import torch.distributed as dist

import ckpt_integration as ci
import ckpt_integration.execution.load as load_mod
import ckpt_integration.execution.read_once as ro
from ckpt_integration.storage.torch_dist_reader import TorchDistReader
from tests.dist_utils import run_distributed
from tests.layouts import global_tensor, grid_shard

PARALLEL = ("fully_parallel", "two_stage")
LOGGER = "ckpt_integration.execution.read_once"
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
    """Counts reads: every block range the engine checks (mapped or read into memory), every region
    a reader reads (``read_region``: zarr's units, the ``local`` load) and every small item read in
    a run, as ``(key, kind, where)`` per call, kind ``"bytes"`` (a stored item's byte range) or
    ``"box"`` (global offsets and sizes)."""

    def __init__(self):
        from ckpt_integration.storage import small_reads
        from ckpt_integration.storage.zarr_backend import ZarrReader

        self.log = []
        self.lock = threading.Lock()
        self.fail = None  # a callable(key) -> bool making the read raise

        def record(key, kind, where):
            if self.fail is not None and self.fail(key):
                raise OSError(f"injected read failure for {key!r}")
            with self.lock:
                self.log.append((key, kind, where))

        for cls in (TorchDistReader, ZarrReader):
            def counting(reader, key, chunk, overlap, out, dtype, _real=cls.read_region):
                record(key, "box", (overlap.offsets, overlap.sizes, _chunk_id(chunk)))
                return _real(reader, key, chunk, overlap, out, dtype)
            cls.read_region = counting
        real_verify = ro.verify_unit

        def verify(lay, im, at, lo, hi, st):
            key = re.search(r" of '(.*)'$", lay.what).group(1)
            record(key, "bytes", (lay.path, lay.base, lo, hi))
            return real_verify(lay, im, at, lo, hi, st)
        ro.verify_unit = verify
        real_fetch = small_reads._fetch

        def fetch(reader, span, buf):
            for _name, _off, t, _brec in span:
                record(t.key, "box", (t.overlap.offsets, t.overlap.sizes, _chunk_id(t.chunk)))
            return real_fetch(reader, span, buf)
        small_reads._fetch = fetch


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


def _chunk_id(chunk):
    """A stored chunk as both kinds of read records name it: (file name, item offset); None for a
    chunk without one (zarr's arrays)."""
    storage = chunk.storage
    path = getattr(storage, "relative_path", None)
    return None if path is None else (os.path.basename(path), storage.offset)


def _assert_read_once(reads_per_rank, groups):
    """Within each group no element of any tensor (no byte of any stored item) is read twice, and
    no stored chunk is read both by boxes (a rank reading it for itself) and by units."""
    for g in groups:
        for key, shape in SHAPES.items():
            count = torch.zeros(shape, dtype=torch.int32)
            ranges = []
            box_chunks = set()
            for r in g:
                for k, kind, where in reads_per_rank[r]:
                    if k != key:
                        continue
                    if kind == "box":
                        count[tuple(slice(o, o + s) for o, s in zip(where[0], where[1]))] += 1
                        box_chunks.add(where[2])
                    else:
                        ranges.append(where)
            assert int(count.max()) <= 1, f"group {g}: parts of {key!r} read {int(count.max())} times"
            ranges.sort()
            for (f1, b1, lo1, hi1), (f2, b2, lo2, hi2) in zip(ranges, ranges[1:]):
                assert (f1, b1) != (f2, b2) or hi1 <= lo2, f"group {g}: bytes of {key!r} checked twice: {ranges}"
            both = {(os.path.basename(f), b) for f, b, _, _ in ranges} & box_chunks
            assert not both, f"group {g}: chunks {both} of {key!r} read both ways"


def _compare_strategies(rank, world, path, make_request, groups, group=None, budget=600, **kw):
    """Load with every strategy; parallel ones must equal ``local`` exactly and read once per group."""
    reads = kw.pop("reads")
    results, stats = {}, {}
    for strategy in ("local",) + PARALLEL:
        reads.log.clear()
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
        stats[strategy] = dict(load_mod.last_load_stats)
    local, local_reads = results["local"]
    for strategy in PARALLEL:
        tensors, per_rank = results[strategy]
        assert tensors.keys() == local.keys()
        for name in local:
            assert torch.equal(tensors[name], local[name]), (strategy, name)
        _assert_read_once(per_rank, groups)
        # the same tensors are touched as by the plain load
        assert {k for rr in per_rank for k, _, _ in rr} == {k for rr in local_reads for k, _, _ in rr}
    return results, stats


def _worker4(rank, world, root):
    ro.SMALL_ALONE = 0  # (every tensor here is small: planned like large ones, so that reads are counted)
    reads = _Reads()
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
        common = dict(reads=reads)

        # 1. same layout, world group: E needed by all, W by half; one node (pages shared)
        cap.messages.clear()
        results, _ = _compare_strategies(rank, world, path, _same_layout_request, world_groups, **common)
        local_reads = results["local"][1]
        e_local = sum(1 for rr in local_reads for k, _, _ in rr if k == "e")
        assert e_local == world  # the plain load reads E on every rank: the counting sees duplicates
        readers = {r for r, rr in enumerate(results["fully_parallel"][1]) if any(k in "ewrc" for k, _, _ in rr)}
        # shared reads spread over the group, not all on rank 0 (zarr stores each of the four shared
        # tensors as one array, planned in blocks of rows of 1 MiB: one unit each)
        assert len(readers) >= (3 if backend == "torch_dist" else 2), readers
        summaries = [m for m in cap.messages if "two_stage load summary" in m]
        if rank == 0:
            assert len(summaries) == 1, cap.messages
            text = summaries[0]
            for phase in ("plan", "read", "exchange", "copy", "total"):
                assert phase in text
            rows = [ln.split()[0] for ln in text.splitlines()[1:]]
            assert rows[1:] == ["0", "1", "2", "3", "max"], rows
        else:
            assert summaries == []

        # 2. resharded, uneven, overlapping requests, rank 3 needs nothing; small budget; every rank
        # its own node, so that every shared byte travels over the group
        os.environ["LOCAL_WORLD_SIZE"] = "1"
        try:
            budget = 256
            _, stats = _compare_strategies(rank, world, path, _resharded_request, world_groups, budget=budget, **common)
        finally:
            del os.environ["LOCAL_WORLD_SIZE"]
        # buffers in flight and a unit read into memory to send from stay within the budget, or,
        # for a unit larger than it, that unit and one slice of it (the largest unit here: a
        # stored item of 256 bytes; in zarr, all of W, 512)
        bound = max(budget, 2 * {"torch_dist": 256, "zarr": 512}[backend])
        for strategy in PARALLEL:
            assert stats[strategy]["peak_staging_bytes"] <= bound, (strategy, stats[strategy])
        all_stats = _gather(stats, world)
        assert any(s["two_stage"]["peak_staging_bytes"] > 0 for s in all_stats)  # bytes did travel
        assert any(s["two_stage"]["bytes_sent"] > 0 for s in all_stats)
        if rank == 3:
            assert stats["fully_parallel"].get("bytes_received", 0) == stats["two_stage"].get("bytes_received", 0) == 0

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
    ro.SMALL_ALONE = 0  # (small tensors planned like large ones, so that reads are counted)
    reads = _Reads()
    path = f"{root}/ckpt"
    ci.save(_two_rank_save(rank), path)
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # every rank its own node: the shared bytes travel
    try:
        for budget in (1, 1 << 20):  # every buffer alone / everything at once
            _, stats = _compare_strategies(rank, world, path, _two_rank_request, [[0, 1]], budget=budget, reads=reads)
            if budget == 1:  # one unit at a time and one slice of it: the largest, SHARED's 64 floats
                assert max(s["peak_staging_bytes"] for s in stats.values() if "peak_staging_bytes" in s) <= 2 * 64 * 4
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    # a failed read on one rank raises on both ranks (no rank left waiting in a transfer),
    # and the group is still usable afterwards
    reads.fail = (lambda key: True) if rank == 1 else None
    for strategy in PARALLEL:
        with pytest.raises(ci.CheckpointingException if rank == 0 else OSError) as info:
            ci.load(_two_rank_request(rank), path, load_strategy=strategy, thread_count=1, memory_budget=64)
        # the failing rank raises its own error (as every strategy does); the other names it and the rank
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
