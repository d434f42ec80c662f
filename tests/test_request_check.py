"""A load's request check by counting whole saved chunks (planning.request_check).

When every rank requests whole saved chunks, the check counts main replicas per saved chunk
instead of exchanging shard records; it must accept exactly what the general check accepts
and refuse the rest on every rank, in the general check's words.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration.errors import ShardingIntegrityError
from ckpt_integration.planning.request_check import owners, request_problems, route_requests
from tests.dist_utils import run_distributed


# ----------------------------------------------------------------------------- pure counting
def _problems(rows, world=1):
    return sum((request_problems([m]) for m in route_requests(rows, world).values()), [])


def test_valid_requests_have_no_problems():
    rows = [(10, 3, c, 1) for c in (2, 0, 1)] + [(10, 3, 1, 0), (10, 3, 0, 0)]  # mains of all chunks, copies
    rows += [(-7, 1, 0, 1), (-7, 1, 0, 0), (50, 1, 0, 1)]  # an object cell and its copy; one-chunk key
    for world in (1, 2, 5):
        assert _problems(rows, world) == []


@pytest.mark.parametrize("rows, chunks, counts", [
    ([(10, 2, 0, 1), (10, 2, 0, 1), (10, 2, 1, 1)], [0], [2]),  # a chunk requested as main twice
    ([(10, 2, 0, 1)], [1], [0]),  # a chunk with no main replica (a gap)
    ([(10, 2, 0, 0), (10, 2, 1, 0)], [0, 1], [0, 0]),  # copies only
    ([(-7, 1, 0, 1), (-7, 1, 0, 1)], [0], [2]),  # an object cell with two main replicas
    ([(10, 2, 0, 1), (10, 2, 2, 1)], [1], [0]),  # a chunk number outside the key
])
def test_invalid_requests_are_found(rows, chunks, counts):
    for world in (1, 3):
        found = _problems(rows, world)
        assert len(found) == 1, found
        assert f"chunks {chunks} requested as main replica by {counts} ranks" in found[0], found


def test_requests_that_disagree_on_the_number_of_chunks():
    assert len(_problems([(10, 2, 0, 1), (10, 3, 1, 1), (10, 2, 1, 1)])) == 1


def test_rows_go_to_their_key_owner_once():
    rows = [(k * 13, 2, c, c % 2) for k in range(200) for c in range(2)] + [(-1 - k, 1, 0, 1) for k in range(50)]
    messages = route_requests(rows, 7)
    got = sorted(tuple(r) for m in messages.values() for r in torch.frombuffer(bytearray(m), dtype=torch.int64).view(-1, 4).tolist())
    assert got == sorted(rows)
    for dst, m in messages.items():  # every row of a message belongs to that rank
        keys = torch.frombuffer(bytearray(m), dtype=torch.int64).view(-1, 4)[:, 0].numpy()
        assert (owners(keys, 7) == dst).all()
    assert len(messages) == 7  # spread over the ranks
    assert route_requests([], 4) == {} and request_problems([]) == []


# ----------------------------------------------------------------------------- through load()
def _saved(rank, world):
    return {
        "w": ci.ShardedTensor.from_rank_offsets("w", torch.arange(24.0).view(6, 4)[2 * rank : 2 * rank + 2].clone(),
                                                (0, rank, world)),
        "rep": ci.ShardedTensor.from_rank_offsets("rep", torch.full((3,), 7.0), replica_id=rank),
        "obj": ci.ShardedObject("obj", {"rank": rank}, (world,), (rank,), replica_id=0),
    }


def _request(rank, world, *, w_chunk=None, w_replica=0, rep_replica=None, obj_cell=None, obj_replica=0):
    c = rank if w_chunk is None else w_chunk
    return {
        "w": ci.ShardedTensor.from_rank_offsets("w", torch.zeros(2, 4), (0, c, world), replica_id=w_replica),
        "rep": ci.ShardedTensor.from_rank_offsets("rep", torch.zeros(3), replica_id=rank if rep_replica is None else rep_replica),
        "obj": ci.ShardedObject("obj", None, (world,), (rank if obj_cell is None else obj_cell,), replica_id=obj_replica),
    }


def _worker(rank, world, root):
    from ckpt_integration.execution import exchange
    from ckpt_integration.storage import chunk_index

    ci.save(_saved(rank, world), root)
    calls = {"whole": 0, "general": 0, "whole_problems": 0}
    real_whole, real_run = exchange.check_whole_chunks, exchange.run

    def whole(*a, **k):
        calls["whole"] += 1
        found = real_whole(*a, **k)
        calls["whole_problems"] += found is not None
        return found

    def general(*a, **k):
        calls["general"] += 1
        return real_run(*a, **k)

    exchange.check_whole_chunks, exchange.run = whole, general

    def expect(request, *, whole_calls, general_calls, error=None, raises=ShardingIntegrityError, **kw):
        exchange.forget_plans()
        before = dict(calls)
        if error is None:
            out = ci.load(request, root, **kw)
        else:
            with pytest.raises(raises) as info:
                ci.load(request, root, **kw)
            for needle in error:
                assert needle in str(info.value), (needle, str(info.value))
            out = None
        assert calls["whole"] - before["whole"] == whole_calls, (calls, before)
        assert calls["general"] - before["general"] == general_calls, (calls, before)
        return out

    try:
        # same layout, DP copies of "rep", one object cell each: counted, nothing else exchanged
        out = expect(_request(rank, world), whole_calls=1, general_calls=0)
        assert torch.equal(out["w"], torch.arange(24.0).view(6, 4)[2 * rank : 2 * rank + 2])
        assert torch.equal(out["rep"], torch.full((3,), 7.0)) and out["obj"] == {"rank": rank}
        assert calls["whole_problems"] == 0
        # the same request again: reused, not checked again (as the general check's result is)
        before = dict(calls)
        assert torch.equal(ci.load(_request(rank, world), root)["w"], out["w"])
        assert calls == before
        # rank 1 asks for rank 0's chunk as a main replica: chunk 0 twice, chunk 1 by nobody
        overlap = _request(rank, world, w_chunk=0 if rank == 1 else rank)
        expect(overlap, whole_calls=1, general_calls=1, error=["invalid sharding of the load request", "'w'"])
        # and the same again: nothing was cached, it is refused again
        with pytest.raises(ShardingIntegrityError):
            ci.load(overlap, root)
        # a copy of a chunk instead of its main replica (rank 2: its chunk has none)
        expect(_request(rank, world, w_replica=1 if rank == 2 else 0), whole_calls=1, general_calls=1,
               error=["'w'"])
        # every rank requests "rep" as a copy: no main replica anywhere
        expect(_request(rank, world, rep_replica=1), whole_calls=1, general_calls=1,
               error=["'rep'", "no rank holds a main replica"])
        # two main replicas of one object cell
        expect(_request(rank, world, obj_cell=0 if rank < 2 else rank), whole_calls=1, general_calls=1,
               error=["'obj'", "main replicas"])
        # one rank's request is not whole saved chunks as they are (it accepts another shape): every
        # rank takes the general path
        mixed = _request(rank, world)
        if rank == 1:
            mixed["rep"] = replace(mixed["rep"], allow_shape_mismatch=True)
        got = expect(mixed, whole_calls=0, general_calls=1)
        assert torch.equal(got["w"], torch.arange(24.0).view(6, 4)[2 * rank : 2 * rank + 2])
        assert torch.equal(got["rep"], torch.full((3,), 7.0))
        # ranks that were given different indexes (another checkpoint): the general path
        real_identity = chunk_index.CompactMetadata.identity
        if rank == 2:
            chunk_index.CompactMetadata.identity = property(lambda self: 12345)
        try:
            expect(_request(rank, world), whole_calls=0, general_calls=1)
        finally:
            chunk_index.CompactMetadata.identity = real_identity
        # counting finds a problem the general check does not name (it is replaced by one that
        # finds nothing): refused on every rank all the same, naming the chunks
        exchange.run = lambda *a, **k: calls.__setitem__("general", calls["general"] + 1)
        expect(overlap, whole_calls=1, general_calls=1, error=["invalid sharding of the load request", "requested as main replica by"])
        exchange.run = general
        # and a valid load afterwards is checked anew and loads exactly
        out = expect(_request(rank, world), whole_calls=1, general_calls=0)
        assert torch.equal(out["w"], torch.arange(24.0).view(6, 4)[2 * rank : 2 * rank + 2])
        # requests planned by the general read path (a GPU destination, read into host memory
        # first: simulated here by turning the CPU shortcut off) are still whole saved chunks and
        # counted; a cast (float64 requested) is not, on every rank alike
        from ckpt_integration.execution import load as load_mod

        real_fast = load_mod._whole_chunk_task
        load_mod._whole_chunk_task = lambda *a, **k: None
        try:
            out = expect(_request(rank, world), whole_calls=1, general_calls=0)
            assert torch.equal(out["w"], torch.arange(24.0).view(6, 4)[2 * rank : 2 * rank + 2])
            assert torch.equal(out["rep"], torch.full((3,), 7.0)) and out["obj"] == {"rank": rank}
            cast = _request(rank, world)
            cast["w"] = ci.ShardedTensor.from_rank_offsets("w", torch.zeros(2, 4, dtype=torch.float64), (0, rank, world))
            out = expect(cast, whole_calls=0, general_calls=1)
            assert torch.equal(out["w"], torch.arange(24.0, dtype=torch.float64).view(6, 4)[2 * rank : 2 * rank + 2])
        finally:
            load_mod._whole_chunk_task = real_fast
        # a *_all strict mode (Lightning's resume uses "return_all"): counted too; the keys no rank
        # requests are known after the check
        partial = _request(rank, world)
        del partial["rep"]
        out, missing, unexpected = expect(partial, whole_calls=1, general_calls=0, strict="return_all")
        assert missing == {"rep"} and unexpected == set(), (missing, unexpected)
        assert torch.equal(out["w"], torch.arange(24.0).view(6, 4)[2 * rank : 2 * rank + 2])
        # raise_all with a key only rank 0 requests that the checkpoint lacks: nothing is counted (the
        # unexpected key is not a saved chunk), every rank raises before reading, naming the missing
        # key, and rank 0 the unexpected one too
        odd = _request(rank, world)
        del odd["rep"]
        if rank == 0:
            odd["nope"] = ci.ShardedTensor.from_rank_offsets("nope", torch.zeros(2))
        expect(odd, whole_calls=0, general_calls=1, error=["'rep'"] + (["'nope'"] if rank == 0 else []),
               raises=ci.CheckpointingException, strict="raise_all")
    finally:
        exchange.check_whole_chunks, exchange.run = real_whole, real_run


def test_whole_chunk_request_check_on_three_ranks(tmp_path):
    run_distributed(_worker, 3, str(tmp_path / "ckpt"), timeout=120)
