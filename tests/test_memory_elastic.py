"""Elastic restore from the memory tier (issue 36 item 3): a job restarted with another world size
or layout restores straight from the surviving nodes' memory, resharded, every byte verified.

4 gloo ranks as 2 simulated nodes (ranks 0-1 on node 0, 2-3 on node 1, ``replicas=2``) save a
state with row-split (TP) weights, a stacked tensor with a prepended layer axis, ZeRO-style
flattened optimizer pieces, a replicated bias, per-rank objects and common state. Then:

1. node 1 is lost and the job restarts as 2 ranks on node 0 with another split (columns instead
   of rows, other flat ranges), no durable checkpoint at all: exact state from memory;
2. both nodes survive, a byte of node 0's copy of rank 0's snapshot is flipped; 2 ranks, one per
   node: that copy is refused (named in the log and the report) and the one on node 1 is used;
3. a request no surviving memory covers (another global shape): refused on every rank with
   ``MemoryLayoutError``, and the durable checkpoint (persisted from memory) loads instead;
4. node 1 lost and node 0's copies of ranks 2 and 3 damaged (a data file truncated, one emptied):
   ``MemoryCheckpointError`` on every rank naming them, and the durable checkpoint loads.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

R, C, L = 16, 64, 4  # rows per old rank, columns of "w"; layers of the stacked tensor
P = (8, 32)  # the replicated parameter whose optimizer state is flattened over the ranks


# --------------------------------------------------------------------------------------------
# pure planning
# --------------------------------------------------------------------------------------------
def test_saved_pieces_cover_and_block_hull():
    from ckpt_integration.memory.plan import block_hull, cover, saved_pieces
    from ckpt_integration.planning.boxes import Box

    flat = {"kind": "tensor", "key": "p", "dtype": "float32", "local_shape": [4, 5], "global_shape": [4, 5],
            "global_offset": [0, 0], "prepend_axis_num": 0, "flattened_range": [3, 17], "region": 2,
            "elem_offset": 10, "size": [14], "stride": [1]}
    pieces = saved_pieces(1, flat)
    assert [(p.box.offsets, p.box.sizes, p.base) for p in pieces] == [((0, 3), (1, 2), 10), ((1, 0), (2, 5), 12),
                                                                     ((3, 0), (1, 2), 22)]
    assert pieces[1].extent(Box((2, 1), (1, 3))) == (18, 21)  # row 2, columns 1..3 of the middle rectangle
    stacked = {**flat, "flattened_range": None, "prepend_axis_num": 1, "local_shape": [3, 2], "global_shape": [5, 3, 2],
               "global_offset": [4, 0, 0], "size": [3, 2], "stride": [2, 1], "elem_offset": 0}
    (s,) = saved_pieces(0, stacked)
    assert (s.box, s.strides) == (Box((4, 0, 0), (1, 3, 2)), (0, 2, 1))
    taken, left = cover(Box((0, 0), (4, 5)), pieces + pieces)  # a replica of the same pieces is taken once
    assert len(taken) == 3 and left == 20 - 14
    assert block_hull(5, 7, 100, 4) == (4, 8) and block_hull(97, 99, 98, 4) == (96, 98)


# --------------------------------------------------------------------------------------------
# the ranks
# --------------------------------------------------------------------------------------------
def _w(step):
    return torch.arange(4 * R * C, dtype=torch.float32).view(4 * R, C) * 0.5 + step


def _layers(step):
    return torch.arange(L * 3 * 2, dtype=torch.float64).view(L, 3, 2) - step


def _moment(step):
    return torch.linspace(-1, 1, P[0] * P[1]).view(P) * step


def _saved_state(rank, world, step):
    import ckpt_integration as ci

    n = P[0] * P[1] // world
    return {
        "w": ci.ShardedTensor.from_rank_offsets("w", _w(step)[rank * R:(rank + 1) * R].clone(), (0, rank, world)),
        "layers": ci.ShardedTensor.from_rank_offsets("layers", _layers(step)[rank].clone(), (0, rank, world),
                                                     prepend_axis_num=1),
        "exp_avg": ci.ShardedTensor.from_rank_offsets_flat("exp_avg", _moment(step).reshape(-1)[rank * n:(rank + 1) * n].clone(),
                                                           P, flattened_range=slice(rank * n, (rank + 1) * n)),
        "b": ci.ShardedTensor.from_rank_offsets("b", torch.full((5,), float(step)), replica_id=rank),
        "rng": ci.ShardedObject("rng", {"rank": rank, "seed": 1000 + rank}, (world,), (rank,)),
        "iteration": step, "cfg": {"lr": 0.1, "names": ["a", "b"]},
    }


def _request(rank, world, columns=True):
    """Another layout for ``world`` ranks: ``w`` split by columns, 2 layers each, other flat ranges."""
    import ckpt_integration as ci

    n = P[0] * P[1] // world
    w = (ci.ShardedTensor.from_rank_offsets("w", torch.zeros(4 * R, C // world), (1, rank, world)) if columns else
         ci.ShardedTensor.from_rank_offsets("w", torch.zeros(4 * R // world, C), (0, rank, world)))
    per = L // world
    return {
        "w": w,
        "layers": [ci.ShardedTensor.from_rank_offsets("layers", torch.zeros(3, 2, dtype=torch.float64), (0, i, L),
                                                      prepend_axis_num=1) for i in range(rank * per, (rank + 1) * per)],
        "exp_avg": ci.ShardedTensor.from_rank_offsets_flat("exp_avg", torch.zeros(n), P,
                                                           flattened_range=slice(rank * n, (rank + 1) * n)),
        "full_moment": ci.ShardedTensor.from_rank_offsets("exp_avg", torch.zeros(P), replica_id=1),
        "b": ci.ShardedTensor.from_rank_offsets("b", torch.zeros(5), replica_id=rank),
        "rng": [ci.ShardedObject("rng", None, (4,), (r,)) for r in (2 * rank, 2 * rank + 1)],
    }


def _check(got, rank, world, step, columns=True):
    n = P[0] * P[1] // world
    want_w = _w(step)[:, rank * C // world:(rank + 1) * C // world] if columns else _w(step)[rank * 4 * R // world:
                                                                                          (rank + 1) * 4 * R // world]
    assert torch.equal(got["w"], want_w), f"rank {rank}: w"
    per = L // world
    for j, t in enumerate(got["layers"]):
        assert torch.equal(t, _layers(step)[rank * per + j]), f"rank {rank}: layer {rank * per + j}"
    assert torch.equal(got["exp_avg"], _moment(step).reshape(-1)[rank * n:(rank + 1) * n])
    assert torch.equal(got["full_moment"], _moment(step)) and torch.equal(got["b"], torch.full((5,), float(step)))
    assert [o["rank"] for o in got["rng"]] == [2 * rank, 2 * rank + 1]
    assert got["iteration"] == step and got["cfg"] == {"lr": 0.1, "names": ["a", "b"]}


def _node(root, rank, rpn):
    return os.path.join(root, "shm", f"node{rank // rpn}")


def _save(rank, world, root):
    import ckpt_integration as ci

    tier = ci.MemoryCheckpoints(_node(root, rank, 2), "el", replicas=2, ranks_per_node=2)
    for step in (1, 2):
        tier.save(_saved_state(rank, world, step), step)
    tier.wait()
    tier.persist(2, os.path.join(root, "durable")).wait()
    tier.close()


def _restore(rank, world, root, rpn, expect):
    import ckpt_integration as ci

    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    log = logging.getLogger("ckpt_integration.memory")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    tier = ci.MemoryCheckpoints(_node(root, rank, rpn), "el", replicas=2, ranks_per_node=rpn)
    try:
        step = tier.latest()
        assert step == 2 and tier.saved_world_size(2) == 4, step
        with pytest.raises(ci.errors.MemoryCheckpointError, match="saved by 4 rank"):  # (was "not complete")
            tier.persist(2, os.path.join(root, f"persist-{expect}"))
        if expect == "damaged":  # old ranks 2 and 3 survive only on node 0, one file truncated, one emptied
            with pytest.raises(ci.errors.MemoryCheckpointError, match=r"no intact copy left in memory of what old "
                                                                       r"rank\(s\) \[2, 3\] saved"):
                tier.load(_request(rank, world), step)
            _check(ci.load(_request(rank, world), os.path.join(root, "durable")), rank, world, 2)
            return
        if expect == "uncovered":
            request = _request(rank, world)
            request["w"] = ci.ShardedTensor.from_rank_offsets("w", torch.zeros(4 * R, C), (0, rank, world))  # 2x rows
            with pytest.raises(ci.errors.MemoryLayoutError, match="'w' was saved with global shape"):
                tier.load(request, step)
            got = ci.load(_request(rank, world), os.path.join(root, "durable"))  # the fallback: the durable tier
            _check(got, rank, world, 2)
            return
        got = tier.load(_request(rank, world), step)
        _check(got, rank, world, 2)
        rep = tier.last_restore
        assert rep.source.startswith("memory of 4 rank(s), resharded"), rep
        assert any(f"rank {rank} read from" in m and "old rank" in m for m in records), records
        if expect == "flipped" and rank == 0:
            assert len(rep.refused) == 1 and "old rank 0's copy on node" in rep.refused[0], rep.refused
            assert "mismatch in block" in rep.refused[0], rep.refused
            assert "peer rank 1" in rep.ranges, rep.ranges  # fetched again from node 1's copy
            assert any("refused old rank 0's copy of step 2" in m for m in records), records
        elif expect == "node0":
            assert list(rep.ranges) == ["own node"] and not rep.refused, rep
        # the restored job goes on: its first complete snapshot frees the larger job's ones
        tier.save(_saved_state(rank, world, 3) | _request_shaped(rank, world, 3), 3)
        tier.wait()
        assert tier.latest() == 3 and tier.saved_world_size(3) == world
        left = sorted(os.listdir(os.path.join(_node(root, rank, rpn), "el")))
        assert [n for n in left if n.startswith("r")] == [f"r{r:05d}" for r in range(world)], left
    finally:
        log.removeHandler(handler)
        tier.close()


def _request_shaped(rank, world, step):
    """The state as the restarted job holds it (its own layout)."""
    import ckpt_integration as ci

    return {"w": ci.ShardedTensor.from_rank_offsets("w", _w(step)[:, rank * C // world:(rank + 1) * C // world].clone(),
                                                    (1, rank, world)),
            "layers": ci.ShardedTensor.from_rank_offsets("layers", torch.zeros(2, 3, 2, dtype=torch.float64), (0, rank, world)),
            "exp_avg": ci.ShardedTensor.from_rank_offsets("exp_avg", torch.zeros(P), replica_id=rank),
            "rng": ci.ShardedObject("rng", {"rank": rank}, (world,), (rank,))}


@pytest.mark.slow
def test_restart_smaller_from_memory_resharded_with_a_damaged_copy_and_an_uncovered_layout(tmp_path):
    from ckpt_integration.memory import slots
    from tests.damage import flip_byte
    from tests.dist_utils import run_distributed

    root = str(tmp_path)
    run_distributed(_save, 4, root, timeout=120)
    pristine = os.path.join(root, "pristine")
    shutil.copytree(os.path.join(root, "shm"), pristine)
    durable = os.path.join(root, "durable")

    def reset(drop_node1: bool) -> None:
        shutil.rmtree(os.path.join(root, "shm"))
        shutil.copytree(pristine, os.path.join(root, "shm"))
        if drop_node1:
            shutil.rmtree(os.path.join(root, "shm", "node1"))

    # 1) node 1 lost, 2 ranks on node 0, columns instead of rows, and no durable checkpoint at all
    reset(drop_node1=True)
    os.rename(durable, durable + ".away")
    run_distributed(_restore, 2, root, 2, "node0", timeout=120)
    os.rename(durable + ".away", durable)

    # 2) a byte of node 0's copy of rank 0's "w" flipped: refused, node 1's copy used instead
    reset(drop_node1=False)
    node0 = os.path.join(root, "shm", "node0", "el")
    rec = next(r for r in (slots.read_record(node0, 0, s) for s in slots.SLOTS) if r is not None and r.step == 2)
    w_region = next(s["region"] for s in rec.header["shards"] if s["key"] == "w")
    name, offset, nbytes, _ = rec.regions[w_region]
    flip_byte(os.path.join(slots.owner_dir(node0, 0), name), offset + nbytes // 3)
    run_distributed(_restore, 2, root, 1, "flipped", timeout=120)

    # 3) a layout that no surviving memory covers: refused on every rank, the durable tier loads
    reset(drop_node1=True)
    run_distributed(_restore, 2, root, 2, "uncovered", timeout=120)

    # 4) node 1 lost and node 0's copies of ranks 2 and 3 damaged (a data file truncated, one
    # emptied): no intact copy of their bytes is left, refused on every rank, the durable tier loads
    reset(drop_node1=True)
    for owner, size in ((2, lambda n: n // 2), (3, lambda n: 0)):
        rec = next(r for r in (slots.read_record(node0, owner, s) for s in slots.SLOTS) if r is not None and r.step == 2)
        path = os.path.join(slots.owner_dir(node0, owner), rec.regions[0][0])
        os.truncate(path, size(os.path.getsize(path)))
    run_distributed(_restore, 2, root, 2, "damaged", timeout=120)
