"""Planning layer: pure functions over shard metadata, tested with simulated ranks."""

from __future__ import annotations

import sys

import pytest

from ckpt_integration.planning.boxes import Box, intersect, relative_slices
from ckpt_integration.planning.integrity import validate_key, validate_sharding_integrity
from ckpt_integration.planning.reshard import plan_chunk_reads, uncovered_elements
from ckpt_integration.planning.save_plan import items_for_rank, plan_writers, split_into_buckets
from ckpt_integration.planning.shards import ShardMeta
from ckpt_integration.planning.strict import StrictHandling, mismatched_keys, parse_strict_flag


def meta(key, rank, offsets, sizes, shape, replica=(0,), dtype="float32", kind="tensor"):
    n = 1
    for s in sizes:
        n *= s
    return ShardMeta(key, kind, rank, dtype, tuple(shape), tuple(offsets), tuple(sizes), tuple(replica), n * 4)


def row_split(key, ranks, rows_per, cols=4, replica=lambda r: (0,)):
    total = ranks * rows_per
    return [meta(key, r, (r * rows_per, 0), (rows_per, cols), (total, cols), replica(r)) for r in range(ranks)]


def test_valid_layouts_have_no_errors():
    assert validate_key("w", row_split("w", 4, 3)) == []
    grid = [meta("g", r, ((r // 2) * 2, (r % 2) * 3), (2, 3), (4, 6)) for r in range(4)]
    assert validate_key("g", grid) == []
    uneven = [meta("u", 0, (0, 0), (4, 2), (10, 2)), meta("u", 1, (4, 0), (3, 2), (10, 2)), meta("u", 2, (7, 0), (3, 2), (10, 2))]
    assert validate_key("u", uneven) == []
    # DP replicas: only replica 0 counts for coverage
    dp = [meta("b", r, (0,), (6,), (6,), (r,)) for r in range(4)]
    assert validate_key("b", dp) == []


def test_overlap_names_key_ranks_and_region():
    shards = [meta("w", 0, (0, 0), (3, 4), (5, 4)), meta("w", 1, (2, 0), (3, 4), (5, 4))]
    (err,) = validate_key("w", shards)
    assert "'w'" in err and "rank 0" in err and "rank 1" in err and "overlap on [2:3, 0:4]" in err


def test_gap_names_missing_region():
    shards = [meta("w", 0, (0, 0), (2, 4), (5, 4)), meta("w", 1, (3, 0), (2, 4), (5, 4))]
    (err,) = validate_key("w", shards)
    assert "cover 16 of 20" in err and "[2:3, 0:4]" in err


def test_disagreeing_shape_and_dtype_name_ranks():
    shards = [meta("w", 0, (0,), (2,), (4,)), meta("w", 1, (2,), (2,), (5,))]
    (err,) = validate_key("w", shards)
    assert "global shape" in err and "ranks 0" in err and "ranks 1" in err
    shards = [meta("w", 0, (0,), (2,), (4,)), meta("w", 1, (2,), (2,), (4,), dtype="bfloat16")]
    (err,) = validate_key("w", shards)
    assert "dtype" in err and "bfloat16" in err


def test_no_main_replica():
    (err,) = validate_key("w", [meta("w", r, (0,), (4,), (4,), (1, r)) for r in range(2)])
    assert "no rank holds a main replica" in err


def test_object_cells():
    objs = [meta("o", r, (r // 2,), (1,), (2,), (r % 2,), dtype="object", kind="object") for r in range(4)]
    assert validate_key("o", objs) == []
    dup = [meta("o", r, (0,), (1,), (1,), (0,), dtype="object", kind="object") for r in range(2)]
    assert "2 main replicas" in validate_key("o", dup)[0]


def test_object_grid_cells_nobody_saves_are_refused():
    """A ShardedObject grid with a cell no rank saves (Megatron-Core: "Invalid access pattern: 1
    ShardedObject are missing") or a cell outside the grid is refused at the save, naming the cells;
    it was committed before and failed only when a load asked for the cell."""
    holes = [meta("o", r, (r,), (1,), (3,), (0,), dtype="object", kind="object") for r in range(2)]
    (err,) = validate_key("o", holes)
    assert "'o'" in err and "1 of 3 object cells" in err and "(2,)" in err, err
    grid = [meta("o", r, (r // 2, r % 2), (1, 1), (2, 3), (0,), dtype="object", kind="object") for r in range(4)]
    (err,) = validate_key("o", grid)
    assert "2 of 6 object cells" in err and "(0, 2)" in err and "(1, 2)" in err, err
    outside = [meta("o", r, (r,), (1,), (2,), (0,), dtype="object", kind="object") for r in range(3)]
    (err,) = validate_key("o", outside)
    assert "outside its grid (2,)" in err and "(2,)" in err, err


def test_validation_is_split_across_ranks():
    shards = row_split("a", 4, 2) + row_split("b", 4, 2) + row_split("c", 4, 2)
    bad = shards + [meta("d", 0, (0,), (2,), (4,))]  # gap in d
    per_rank = [validate_sharding_integrity(bad, r, 4) for r in range(4)]
    assert sum(len(e) for e in per_rank) == 1  # exactly one rank reports d


def _scale_shards(ranks):
    # 8 tensors split over TP=8 along columns, replicated over DP=ranks/8
    tp = 8
    return [meta(f"t{t}", r, (0, (r % tp) * 16), (64, 16), (64, 16 * tp), (r // tp,))
            for t in range(8) for r in range(ranks)]


def _calls(fn):
    """(Python and builtin function calls made by ``fn()``, its result): an operation count, not a time."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        count += event in ("call", "c_call")

    sys.setprofile(profile)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return count, result


def test_planning_scales_near_linearly():
    """Thousands of simulated ranks: validation + writer planning stay near-linear (no O(world^2)).

    Counted in function calls at 512 and 4096 ranks (8x the shards): a linear or n log n planner
    makes at most ~12x the calls; a quadratic one would make ~64x."""
    small, big = _scale_shards(512), _scale_shards(4096)
    n_small, _ = _calls(lambda: (validate_sharding_integrity(small, 0, 512), plan_writers(small, balance=True)))
    n_big, (errors, chosen) = _calls(lambda: (validate_sharding_integrity(big, 0, 4096), plan_writers(big, balance=True)))
    assert n_big <= 12 * n_small, (n_small, n_big)
    errors = [e for r in range(0, 4096, 512) for e in validate_sharding_integrity(big, r, 4096)]
    assert errors == []
    assert len(chosen) == 8 * 8
    # balanced: the 64 chunks land on 64 distinct ranks
    assert len({s.rank for s in chosen.values()}) == 64


def test_plan_writers_dedups_and_balances():
    shards = [meta("b", r, (0,), (100,), (100,), (r,)) for r in range(4)] + [meta("c", r, (0,), (50,), (50,), (r,)) for r in range(4)]
    unbalanced = plan_writers(shards, balance=False)
    assert {s.rank for s in unbalanced.values()} == {0}
    balanced = plan_writers(shards, balance=True)
    assert sorted(s.rank for s in balanced.values()) == [0, 1]
    assert [s.key for s in items_for_rank(balanced, 1)] == ["c"]


def test_split_into_buckets_balances_bytes():
    buckets = split_into_buckets([10, 1, 1, 8, 1], 2)
    totals = sorted(sum([10, 1, 1, 8, 1][i] for i in b) for b in buckets)
    assert totals == [10, 11]
    assert split_into_buckets([5], 4) == [[0]]


def test_reshard_reads_and_coverage():
    chunks = [Box((0, 0), (4, 4)), Box((4, 0), (4, 4))]
    reads = plan_chunk_reads(Box((2, 1), (4, 2)), chunks)
    assert [r.overlap for r in reads] == [Box((2, 1), (2, 2)), Box((4, 1), (2, 2))]
    assert uncovered_elements(Box((2, 1), (4, 2)), (8, 4), reads) == 0
    assert uncovered_elements(Box((6, 0), (4, 4)), (8, 4), plan_chunk_reads(Box((6, 0), (4, 4)), chunks)) == 0
    assert uncovered_elements(Box((0, 0), (8, 4)), (8, 4), plan_chunk_reads(Box((0, 0), (8, 4)), chunks[:1])) == 16
    assert relative_slices(Box((4, 1), (2, 2)), Box((4, 0), (4, 4))) == (slice(0, 2), slice(1, 3))
    assert intersect(Box((0,), (2,)), Box((2,), (2,))) is None


def test_strict_flags_and_directions():
    assert parse_strict_flag("raise_all") is StrictHandling.RAISE_ALL
    assert parse_strict_flag(True) is StrictHandling.ASSUME_OK_UNEXPECTED
    assert parse_strict_flag(False) is StrictHandling.LOG_UNEXPECTED
    with pytest.raises(ValueError, match="unknown strict mode"):
        parse_strict_flag("nope")
    missing, unexpected = mismatched_keys({"a", "new"}, {"a", "new", "b"}, {"a", "b", "old"})
    assert unexpected == {"new"}  # requested but not in the checkpoint
    assert missing == {"old"}  # in the checkpoint but requested by no rank


# --------------------------------------------------------------------------- the scalable exchange
import random  # noqa: E402

from ckpt_integration.planning import exchange as ex  # noqa: E402
from ckpt_integration.planning import written as written_mod  # noqa: E402
from ckpt_integration.planning.written import gather_finalize  # noqa: E402
from ckpt_integration.planning.records import MessageWriter, decode, decode_runs, encode, encode_runs  # noqa: E402
from ckpt_integration.planning.reshard import ChunkIndex  # noqa: E402


def simulate(per_rank, balance=True, validate=True):
    """Run the exchange steps of every simulated rank through in-memory mailboxes (as the collectives would)."""
    world = len(per_rank)
    routed = [ex.route_shards(m, r, world) for r, m in enumerate(per_rank)]
    mail = [[] for _ in range(world)]
    for rt in routed:
        for d, msg in rt.messages.items():
            mail[d].append(msg)
    fwd, rep = [[] for _ in range(world)], [[] for _ in range(world)]
    for d in range(world):
        f, a = ex.chunk_owner_step(mail[d], world, balance=balance)
        for k, m in f.items():
            fwd[k].append(m)
        for k, m in a.items():
            rep[k].append(m)
    detail = [ex.detail_requests(rep[r]) for r in range(world)]
    if any(detail):  # the detail round: those records in full, their holdings to the key owners
        mail = [[] for _ in range(world)]
        for r in range(world):
            for d, msg in ex.route_shards(per_rank[r], r, world, only=detail[r]).messages.items():
                mail[d].append(msg)
        for d in range(world):
            for k, m in ex.chunk_owner_step(mail[d], world, replies=False)[0].items():
                fwd[k].append(m)
    problems, summaries = [], []
    for d in range(world):
        p, s = ex.key_owner_step(fwd[d], validate=validate)
        problems += p
        summaries += s
    writes = [[per_rank[r][i] for i in ex.assign_writes(per_rank[r], rep[r])] for r in range(world)]
    return problems, summaries, writes


def _per_rank(shards, world):
    out = [[] for _ in range(world)]
    for s in shards:
        out[s.rank].append(s)
    return out


BAD_LAYOUTS = {
    "overlap": [meta("w", 0, (0, 0), (3, 4), (5, 4)), meta("w", 1, (2, 0), (3, 4), (5, 4))],
    "gap": [meta("w", 0, (0, 0), (2, 4), (5, 4)), meta("w", 2, (3, 0), (2, 4), (5, 4))],
    "shape": [meta("w", 0, (0,), (2,), (4,)), meta("w", 1, (2,), (2,), (5,)), meta("w", 2, (2,), (2,), (5,), (1,))],
    "dtype": [meta("w", 0, (0,), (2,), (4,)), meta("w", 1, (2,), (2,), (4,), dtype="bfloat16")],
    "no_main": [meta("w", r, (0,), (4,), (4,), (1, r)) for r in range(3)],
    "object_dup": [meta("o", r, (0,), (1,), (1,), (0,), dtype="object", kind="object") for r in range(2)],
    "object_lost": [meta("o", r, (r,), (1,), (2,), (1,), dtype="object", kind="object") for r in range(2)],
    "outside": [meta("w", 0, (0,), (3,), (4,)), meta("w", 1, (3,), (3,), (4,))],
    # a data-parallel copy (sent as a digest) that differs from its main replica
    "replica_dtype": [meta("w", 0, (0,), (4,), (4,)), meta("w", 1, (0,), (4,), (4,), (1,), dtype="bfloat16")],
    "replica_shape": [meta("w", 0, (0,), (4,), (4,)), meta("w", 2, (0,), (4,), (6,), (1,))],
}


@pytest.mark.parametrize("name", sorted(BAD_LAYOUTS))
@pytest.mark.parametrize("world", [3, 7])
def test_exchange_reports_what_full_validation_reports(name, world):
    """Key owners validating from holdings + main records give the messages of validate_key over all shards."""
    shards = BAD_LAYOUTS[name] + row_split("fine", world, 2, replica=lambda r: (0,))
    expected = validate_key(shards[0].key, [s for s in shards if s.key == shards[0].key])
    assert expected
    problems, _, _ = simulate(_per_rank(shards, world))
    assert problems == expected


def test_exchange_valid_layout_writes_every_chunk_once_balanced():
    tp, dp = 2, 4
    world = tp * dp
    shards = []
    for r in range(world):
        t, d = r % tp, r // tp
        for k in range(6):  # TP-split weights (DP replicas) of different sizes
            rows = 8 * (k + 1)
            shards.append(meta(f"w{k}", r, (0, t * 4), (rows, 4), (rows, 4 * tp), (0, d)))
        shards.append(meta("norm", r, (0,), (8,), (8,), (t, d)))  # replicated everywhere
        shards.append(meta("obj", r, (t,), (1,), (tp,), (d,), dtype="object", kind="object"))
    problems, summaries, writes = simulate(_per_rank(shards, world))
    assert problems == []
    written = [m.chunk_id for ws in writes for m in ws]
    expected = {s.chunk_id for s in shards}
    assert sorted(written) == sorted(expected)  # each unique chunk exactly once
    assert {m.rank for ws in writes for m in ws if m.kind == "object"} == {0, 1}  # objects by their main replica
    loads = [sum(m.nbytes for m in ws) for ws in writes]
    assert max(loads) <= 2 * (sum(loads) / world)  # spread over the DP replicas, not all on the main ones
    assert len([l for l in loads if l]) == world
    by_key = {s.key: s for s in summaries}
    assert by_key["w0"].chunks == tp and by_key["norm"].chunks == 1 and by_key["obj"].chunks == tp
    # without balancing the main replicas write
    _, _, writes = simulate(_per_rank(shards, world), balance=False)
    assert all(m.is_main for ws in writes for m in ws)
    assert sorted(m.chunk_id for ws in writes for m in ws) == sorted(expected)


def test_exchange_never_assigns_a_replica_without_data():
    shards = [ShardMeta("k", "tensor", r, "float32", (100,), (0,), (100,), (r,), 400, has_data=r == 0) for r in range(4)]
    shards += [ShardMeta(f"k{i}", "tensor", r, "float32", (10,), (0,), (10,), (r,), 40) for i in range(4) for r in range(4)]
    _, _, writes = simulate(_per_rank(shards, 4))
    assert [m.rank for ws in writes for m in ws if m.key == "k"] == [0]
    assert sorted(len([m for m in ws if m.key != "k"]) for ws in writes) == [1, 1, 1, 1]


def test_a_keys_chunks_meet_on_few_owners_and_a_chunks_copies_on_one():
    """ZeRO-1 pieces of one optimizer state (one row each, 4,096 of them) reach at most
    ``OWNER_BANDS`` chunk owners, so their key owner gets at most that many forwards (it got one
    per piece: 18,570 at 65,536 simulated ranks); column blocks, which all start in the first row,
    still go to owners of their own; every copy of a chunk goes to the same owner as its main."""
    world = 8192
    pieces = [meta("exp_avg", r, (r, 0), (1, 64), (4096, 64)) for r in range(4096)]
    owners = {d for m in pieces for d in ex.route_shards([m], m.rank, world).messages}
    assert 2 <= len(owners) <= ex.OWNER_BANDS
    blocks = [meta("w", c * 100 + dp, (0, 8 * c), (4096, 8), (4096, 64), (dp,)) for c in range(8) for dp in range(100)]
    owner_of = {}
    for m in blocks:
        (d,) = ex.route_shards([m], m.rank, world).messages
        owner_of.setdefault(m.offsets, set()).add(d)
    assert all(len(ds) == 1 for ds in owner_of.values())  # a chunk's 100 copies meet on one rank
    assert len(set().union(*owner_of.values())) == 8  # each block has an owner of its own
    # a valid layout of many small pieces still validates and writes each piece once
    world = 64
    problems, _, writes = simulate(_per_rank([meta("s", r % world, (r, 0), (1, 4), (640, 4)) for r in range(640)], world))
    assert problems == [] and sorted(m.offsets for ws in writes for m in ws) == [(r, 0) for r in range(640)]


def test_commit_layout_from_compact_records_and_its_checks(monkeypatch):
    shards = row_split("w", 4, 2) + [meta("o", 0, (0,), (1,), (1,), dtype="object", kind="object")]
    _, summaries, writes = simulate(_per_rank(shards, 4))

    def written(ws):
        return [
            ex.Written(m.storage_key, m.offsets if m.kind == "tensor" else None, m.sizes if m.kind == "tensor" else None,
                       f"__{m.rank}_0.distcp", 0, 10, 1)
            for m in ws
        ]

    msgs = [ex.encode_finalize(None, written(ws), [s for s in summaries if ex.owner_of_key(s.key, 4) == r]) for r, ws in enumerate(writes)]
    errors, cols, summ = gather_finalize(msgs)
    assert errors == []
    items = cols.items()
    assert sorted(items, key=repr) == sorted((w for ws in writes for w in written(ws)), key=repr)  # records survive the trip
    # the chunk identities digest the names of keys only: the written table also holds every data
    # file's name (131,072 of them at 65,536 ranks), which cost rank 0's commit ~0.3 s to digest
    digested = []
    real_digests = written_mod.string_digests
    monkeypatch.setattr(written_mod, "string_digests", lambda names: digested.extend(names) or real_digests(names))
    layout = ex.commit_layout(cols, summ)
    assert sorted(digested) == ["o/shard_0_1", "w"]
    assert layout.tensors["w"] == ("float32", (8, 4), [((2 * r, 0), (2, 4)) for r in range(4)])
    assert layout.objects == ["o/shard_0_1"]

    def layout_of(its):
        return ex.commit_layout(gather_finalize([ex.encode_finalize(None, its, [])])[1], summ)

    missing_one = [w for w in items if w.offsets != (0, 0)]
    with pytest.raises(Exception, match="internal error: 4 chunks of 'w' should have been written, 3 were"):
        layout_of(missing_one)
    with pytest.raises(Exception, match="written twice"):
        layout_of(items + items[:1])
    with pytest.raises(Exception, match="written but no rank planned them"):
        layout_of(items + [ex.Written("stray", (0,), (1,), "__0_0.distcp", 99, 1, 1)])
    assert ex.decode_finalize(ex.encode_finalize("boom", [], []))[0] == "boom"
    assert gather_finalize([b"", ex.encode_finalize("boom", [], [])])[0] == [(1, "boom")]
    assert ex.encode_finalize(None, [], []) == b""  # ranks with nothing to report send nothing


def test_record_encoding_roundtrip_and_rejects_garbage():
    w = MessageWriter()
    ints = [w.sid("é/key"), w.sid("x"), w.sid("é/key"), -5, 1 << 40]
    w.extend(ints)
    strings, got = decode(w.tobytes())
    assert strings == ["é/key", "x"] and got == [0, 1, 0, -5, 1 << 40]
    assert decode(encode([], [1, 2]))[1] == [1, 2]
    for bad in (b"", b"XXXX" + bytes(20), encode(["a"], [1])[:-1]):
        with pytest.raises(ValueError):
            decode(bad)
    for ranks in ([], [3], [0, 2, 4, 6], [1, 2, 5, 9, 10, 11]):
        assert decode_runs(encode_runs(ranks)) == ranks
    assert len(encode_runs(list(range(5, 5 + 8 * 1000, 8)))) == 3  # a DP group is one run


def test_chunk_index_matches_a_scan():
    rng = random.Random(0)
    for _ in range(300):
        nd = rng.randint(1, 3)
        shape = [rng.randint(4, 12) for _ in range(nd)]
        cuts = [sorted({0, s, *rng.sample(range(1, s), rng.randint(0, 3))}) for s in shape]
        chunks = []

        def grid(a, off, size):
            if a == nd:
                chunks.append(Box(tuple(off), tuple(size)))
                return
            for lo, hi in zip(cuts[a], cuts[a][1:]):
                grid(a + 1, off + [lo], size + [hi - lo])

        grid(0, [], [])
        rng.shuffle(chunks)
        index = ChunkIndex(chunks, list(range(len(chunks))))
        for _ in range(5):
            off = [rng.randint(0, s - 1) for s in shape]
            req = Box(tuple(off), tuple(rng.randint(1, s - o) for o, s in zip(off, shape)))
            expected = {(r.chunk, r.overlap) for r in plan_chunk_reads(req, chunks)}
            got = index.reads(req)
            assert {(r.chunk, r.overlap) for r in got} == expected
            assert all(chunks[r.source] == r.chunk for r in got)


def test_overlapping_pairs_are_every_pair_that_shares_elements_found_in_near_linear_time(monkeypatch):
    """The sweep behind the delivery ledger finds exactly the pairs a comparison of all pairs finds,
    and for boxes in a row compares each with its neighbours only (was n*(n-1)/2 comparisons)."""
    from ckpt_integration.planning import boxes as bx

    rng = random.Random(0)
    for _ in range(500):
        nd = rng.randint(1, 3)
        boxes = [Box(tuple(rng.randint(0, 10) for _ in range(nd)), tuple(rng.randint(1, 4) for _ in range(nd)))
                 for _ in range(rng.randint(1, 10))]
        want = {(i, j) for i in range(len(boxes)) for j in range(i + 1, len(boxes)) if intersect(boxes[i], boxes[j])}
        assert {tuple(sorted(p)) for p in bx.overlapping_pairs(boxes)} == want
    calls = []
    real = bx.intersect
    monkeypatch.setattr(bx, "intersect", lambda a, b: calls.append(1) or real(a, b))
    n = 2000
    assert bx.overlapping_pairs([Box((2 * i, 0), (2, 8)) for i in range(n)]) == []
    assert len(calls) <= 2 * n


def test_small_chunks_of_large_replica_groups_get_one_writer_chosen_by_their_owner():
    world = 3 * (ex.DIRECT_ABOVE + 1)
    shards = [meta(f"norm{k}", r, (0,), (8,), (8,), (r,)) for k in range(12) for r in range(world)]
    shards += [ShardMeta("big", "tensor", r, "float32", (1 << 20,), (0,), (1 << 20,), (r,), 4 << 20) for r in range(world)]
    _, _, writes = simulate(_per_rank(shards, world))
    written = [m for ws in writes for m in ws]
    assert sorted(m.key for m in written) == sorted(["big"] + [f"norm{k}" for k in range(12)])
    assert len({m.rank for m in written if m.key != "big"}) > 6  # spread by hash, not all on rank 0
