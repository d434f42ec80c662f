"""Planning layer: pure functions over shard metadata, tested with simulated ranks."""

from __future__ import annotations

import time

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


def test_validation_is_split_across_ranks():
    shards = row_split("a", 4, 2) + row_split("b", 4, 2) + row_split("c", 4, 2)
    bad = shards + [meta("d", 0, (0,), (2,), (4,))]  # gap in d
    per_rank = [validate_sharding_integrity(bad, r, 4) for r in range(4)]
    assert sum(len(e) for e in per_rank) == 1  # exactly one rank reports d


@pytest.mark.parametrize("ranks", [4096])
def test_planning_scales_near_linearly(ranks):
    """Thousands of simulated ranks: validation + writer planning stay fast (no O(world^2))."""
    # 8 tensors split over TP=8 along columns, replicated over DP=ranks/8
    tp = 8
    shards = []
    for t in range(8):
        for r in range(ranks):
            tp_rank, dp_rank = r % tp, r // tp
            shards.append(meta(f"t{t}", r, (0, tp_rank * 16), (64, 16), (64, 16 * tp), (dp_rank,)))
    start = time.perf_counter()
    errors = [e for r in range(0, ranks, 512) for e in validate_sharding_integrity(shards, r, ranks)]
    chosen = plan_writers(shards, balance=True)
    elapsed = time.perf_counter() - start
    assert errors == []
    assert len(chosen) == 8 * tp
    # balanced: the 64 chunks land on 64 distinct ranks
    assert len({s.rank for s in chosen.values()}) == 64
    assert elapsed < 30  # generous bound only to catch quadratic blow-ups, not a benchmark


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
