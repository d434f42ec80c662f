"""The in-memory checkpoint tier (issue 20): ``ci.MemoryCheckpoints``.

Pure planning and record tests, one-process round trips, and a multi-process scenario: 4 gloo
processes as 2 simulated nodes (ranks 0-1 on node 0, 2-3 on node 1; each node passes its own
directory), restarted between phases as a real job would be:

A. train steps 1..4 (snapshot every step, step 3 persisted to a durable checkpoint); a second
   job on the same nodes saves its own step 100; rank 1 is SIGKILLed in the middle of copying
   snapshot 5 into its slot;
B. restart: step 4 (never the torn 5) is restored exactly from every rank's own memory; the
   other job restores its own step 100 and removes its snapshots, leaving ours; train 5 and 6,
   then rank 2 is SIGKILLed between snapshots;
C. a byte of rank 0's own copy of step 6 is flipped first: rank 0's copy is refused (logged)
   and its peer copy on node 1 used; the others restore step 6 from their own memory; save 7;
D. node 1's directory is deleted first (node replaced): ranks 2 and 3 restore step 7 from their
   peer copies on node 0; persist step 7;
E. 2 processes (another world size; node 1 empty): step 7 of 4 ranks is restored from node 0's
   memory, resharded (rank 1's bytes served by rank 0), equal to the durable checkpoint of step 7.

Each rank is a subprocess launched here (a dead rank is part of the test); every wait has a
deadline and everything left over is SIGKILLed. Running this file as a script is a rank's
entry point.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from ckpt_integration.storage.filesystem import locate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N, M = 128, 512  # rows per rank, columns: 256 KiB per rank (deferred to the background copy)
LAUNCH_TIMEOUT = 120.0  # seconds for one launch on an idle machine (scaled by the measured load)
SURVIVOR_GRACE = 30.0


# --------------------------------------------------------------------------------------------
# pure parts
# --------------------------------------------------------------------------------------------
def test_replication_plan_distinct_nodes_and_groups():
    from ckpt_integration.memory.plan import replication_plan

    p = replication_plan(4, 2, 2)
    assert p.holders == ((2,), (3,), (0,), (1,))
    assert p.held_by(0) == (2,) and p.group_of(3) == (0, 1)
    p = replication_plan(6, 1, 3)  # NVRx cliques: every member keeps every other member's copy
    assert p.holders == ((1, 2), (2, 0), (0, 1), (4, 5), (5, 3), (3, 4))
    p = replication_plan(6, 2, 2)  # 3 nodes, groups of 2: the last group takes the odd node (a ring)
    assert p.holders == ((2,), (3,), (4,), (5,), (0,), (1,))
    for world, rpn, reps in [(8, 2, 2), (12, 3, 2), (10, 1, 3), (9, 3, 3)]:
        p = replication_plan(world, rpn, reps)
        for r, hs in enumerate(p.holders):
            nodes = {p.node_of(r)} | {p.node_of(h) for h in hs}
            assert len(hs) == reps - 1 and len(nodes) == reps, (world, rpn, reps, r, hs)
            assert all(h % rpn == r % rpn for h in hs)  # same local index (NVRx's replication jump)
        counts = [len(p.held_by(r)) for r in range(world)]
        assert counts == [reps - 1] * world  # every rank keeps as many copies as it has holders


def test_a_groups_ranks_per_node_follow_its_global_ranks():
    import ckpt_integration as ci
    from ckpt_integration.memory.plan import group_ranks_per_node

    assert group_ranks_per_node([1, 3, 5, 7], 4) == 2 and group_ranks_per_node([0, 2], 2) == 1
    assert group_ranks_per_node(range(8), 4) == 4 and group_ranks_per_node(range(3), 8) == 3
    for ranks in ([0, 1, 2], [0, 2, 1, 3]):  # unequal blocks; a node's members not consecutive in the group
        with pytest.raises(ci.errors.MemoryCheckpointError, match="pass ranks_per_node"):
            group_ranks_per_node(ranks, 2)


def test_replication_plan_refuses_impossible_layouts():
    import ckpt_integration as ci
    from ckpt_integration.memory.plan import replication_plan

    p = replication_plan(4, 2, 3)  # fewer nodes than replicas (a job restarted smaller): a copy per node
    assert (p.replicas, p.asked) == (2, 3) and p.holders == ((2,), (3,), (0,), (1,))
    p = replication_plan(2, 2, 2)  # one node: no peer copies
    assert (p.replicas, p.holders) == (1, ((), ()))
    with pytest.raises(ci.errors.MemoryCheckpointError, match="not a multiple of ranks_per_node=3"):
        replication_plan(4, 3, 1)
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        replication_plan(4, 2, 0)


def test_choose_sources_prefers_own_node_then_spreads_and_skips_refused():
    from ckpt_integration.memory.plan import CopyLocation as C
    from ckpt_integration.memory.plan import choose_sources

    copies = {0: [C(0, "A", (0, 1)), C(0, "B", (2, 3))], 1: [C(1, "A", (0, 1)), C(1, "B", (2, 3))],
              2: [C(2, "A", (0, 1))], 3: [C(3, "A", (0, 1))]}
    chosen, missing = choose_sources(range(4), copies)
    assert chosen[0] == ("A", 0) and chosen[1] == ("A", 1) and not missing
    assert {chosen[2][1], chosen[3][1]} == {0, 1}  # node B lost: served by both ranks of node A
    chosen, missing = choose_sources(range(4), copies, {(0, "A"), (3, "A")})
    assert chosen[0][0] == "B" and chosen[0][1] in (2, 3) and missing == [3]


def test_record_roundtrip_and_damage(tmp_path):
    import ckpt_integration as ci
    from ckpt_integration.memory import slots

    raw = slots.encode_record({"job_id": "j", "owner": 0, "step": 3, "incarnation": [1, "x"], "files": {},
                               "regions": [], "shards": [], "slot": 0, "world_size": 1}, b"blob")
    rec = slots.decode_record(raw, "r")
    assert (rec.step, rec.owner, rec.blob, rec.incarnation) == (3, 0, b"blob", (1, "x"))
    for i in (0, 9, 30, len(raw) - 1):
        bad = bytearray(raw)
        bad[i] ^= 1
        with pytest.raises(ci.CorruptCheckpointError, match="record r"):
            slots.decode_record(bytes(bad), "r")
    with pytest.raises(ci.CorruptCheckpointError, match="truncated"):
        slots.decode_record(raw[:10], "r")
    # a record whose CRC32 holds but whose layout does not add up (a writer's bug, a crafted file):
    # refused when decoded, never an out-of-range view or a huge allocation inside a restore
    # (before: accepted; prepend_axis_num=10**12 raised MemoryError inside the restore's plan)
    shard = {"kind": "tensor", "key": "w", "dtype": "float32", "size": [4, 8], "stride": [8, 1], "elem_offset": 0,
             "region": 0, "prepend_axis_num": 0, "global_shape": [4, 8]}
    good = {"job_id": "j", "owner": 0, "step": 3, "incarnation": [1, "x"], "files": {"a.bin": 8192},
            "regions": [["a.bin", 4096, 128, ""]], "shards": [shard], "slot": 0, "world_size": 1}
    assert slots.decode_record(slots.encode_record(good, b""), "r").step == 3
    for change, said in [({"regions": [["a.bin", 4096, 8192, ""]]}, "outside its arena file"),
                         ({"regions": [["b.bin", 0, 128, ""]]}, "outside its arena file"),
                         ({"shards": [{**shard, "elem_offset": 1}]}, "past the end of its region"),
                         ({"shards": [{**shard, "stride": [9, 1]}]}, "past the end of its region"),
                         ({"shards": [{**shard, "region": 1}]}, "inconsistent"),
                         ({"shards": [{**shard, "prepend_axis_num": 10**12}]}, "inconsistent"),
                         ({"shards": [{**shard, "stride": [8]}]}, "inconsistent"),
                         ({"shards": [{**shard, "dtype": "float99"}]}, "unknown dtype")]:
        with pytest.raises(ci.CorruptCheckpointError, match=f"record r is damaged: .*{said}"):
            slots.decode_record(slots.encode_record({**good, **change}, b""), "r")
    for bad_id in ("", "..", "a/b", "-x", "x" * 200, ".hidden"):
        with pytest.raises(ValueError, match="job_id"):
            ci.MemoryCheckpoints(str(tmp_path), bad_id, replicas=1)


def _state(rank: int, world: int, step: int, sign: int = 1):
    import ckpt_integration as ci

    w = (torch.arange(N * M, dtype=torch.float32).view(N, M) * (rank + 1) + step) * sign
    return {
        "w": ci.ShardedTensor.from_rank_offsets("w", w, (0, rank, world)),
        "b": ci.ShardedTensor.from_rank_offsets("b", torch.full((7,), float(step)), replica_id=rank),
        "rng": ci.ShardedObject("rng", {"rank": rank, "step": step, "t": torch.tensor([step, rank])}, (world,), (rank,)),
        "iteration": step * sign, "nested": {"empty": {}, "pair": (step, None), "list": []},
    }


def _request(rank: int, world: int):
    import ckpt_integration as ci

    return {
        "w": ci.ShardedTensor.from_rank_offsets("w", torch.zeros(N, M), (0, rank, world)),
        "b": ci.ShardedTensor.from_rank_offsets("b", torch.zeros(7), replica_id=rank),
        "rng": ci.ShardedObject("rng", None, (world,), (rank,)),
    }


def _check(got, rank: int, world: int, step: int, sign: int = 1) -> None:
    want = _state(rank, world, step, sign)
    assert torch.equal(got["w"], want["w"].data), f"rank {rank}: w differs"
    assert torch.equal(got["b"], want["b"].data)
    assert got["rng"]["rank"] == rank and got["rng"]["step"] == step and torch.equal(got["rng"]["t"], torch.tensor([step, rank]))
    assert got["iteration"] == step * sign and got["nested"] == {"empty": {}, "pair": (step, None), "list": []}


def test_single_process_roundtrip_slots_and_persist(tmp_path):
    import ckpt_integration as ci

    d = str(tmp_path / "shm")
    tier = ci.MemoryCheckpoints(d, "solo", replicas=1)
    assert tier.latest() is None
    for step in (1, 2, 3):
        tier.save(_state(0, 1, step), step)
    tier.wait()
    names = sorted(os.listdir(os.path.join(d, "solo", "r00000")))
    assert [n for n in names if n.endswith(".rec")] == ["s0.rec", "s1.rec"]  # two slots: steps 3 and 2
    assert tier.latest() == 3
    _check(tier.load(_request(0, 1), 3), 0, 1, 3)
    assert tier.last_restore.from_mapping  # the process that saved copies from its own mappings
    _check(tier.load(_request(0, 1), 2), 0, 1, 2)
    # those mappings are the files: a byte changed in place is seen (and refused) there too, and a
    # file replaced by another (new inode) is read from the directory, not from the old mapping
    owner = os.path.join(d, "solo", "r00000")
    data = [os.path.join(owner, n) for n in os.listdir(owner) if n.startswith("s0-") and n.endswith(".bin")]
    assert len(data) == 1, data
    path, at = data[0], tier_region_start(tier, 0)  # a byte of "w"'s region
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(ci.errors.MemoryCheckpointError, match="no intact copy"):
        tier.load(_request(0, 1), 3)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b)
    shutil.copyfile(path, path + ".new")
    os.replace(path + ".new", path)
    _check(tier.load(_request(0, 1), 3), 0, 1, 3)
    assert not tier.last_restore.from_mapping
    with pytest.raises(ci.errors.MemoryCheckpointError, match="step 1 is not complete"):
        tier.load(_request(0, 1), 1)
    # another layout (half the rows, a column block): resharded from memory; a key no snapshot holds: refused
    half = tier.load({"w": ci.ShardedTensor.from_rank_offsets("w", torch.zeros(N // 2, M), (0, 1, 2)),
                      "c": ci.ShardedTensor.from_rank_offsets("w", torch.zeros(N, M // 4), (1, 2, 4))}, 3)
    w3 = _state(0, 1, 3)["w"].data
    assert torch.equal(half["w"], w3[N // 2:]) and torch.equal(half["c"], w3[:, M // 2:3 * M // 4])
    assert half["iteration"] == 3 and tier.last_restore.source.startswith("memory of 1 rank(s), resharded")
    with pytest.raises(ci.errors.MemoryLayoutError, match="'v' is in no snapshot"):
        tier.load({"v": ci.ShardedTensor.from_rank_offsets("v", torch.zeros(4))}, 3)
    tier.persist(3, str(tmp_path / "durable")).wait()
    got = ci.load(_request(0, 1), str(tmp_path / "durable"))
    _check(got, 0, 1, 3)
    tier.close()
    again = ci.MemoryCheckpoints(d, "solo", replicas=1)  # a restarted process finds the snapshots
    assert again.latest() == 3 and again.last_complete_step == 3
    again.save(_state(0, 1, 4), 4)  # goes to the slot of step 2; step 3 stays
    again.wait()
    assert again.latest() == 4
    _check(again.load(_request(0, 1), 3), 0, 1, 3)
    assert not again.last_restore.from_mapping  # (a restarted process reads the files)
    again.close(remove=True)
    assert not os.path.exists(os.path.join(d, "solo"))


def test_snapshots_of_a_timeline_the_job_left_are_never_restored(tmp_path):
    """A run that goes on from an older step than earlier runs of the job reached (a rollback to a
    durable checkpoint, a restart from scratch) leaves their later snapshots behind: they were
    offered by ``latest()`` (and persisted at a SIGTERM) before the run's own first snapshot
    overwrote them, so the next restart silently resumed the abandoned timeline."""
    import ckpt_integration as ci
    from ckpt_integration.memory import slots

    d = str(tmp_path)
    first = ci.MemoryCheckpoints(d, "tl", replicas=1)
    for step in (4, 5):  # (step 4 in slot 0, step 5 in slot 1)
        first.save(_state(0, 1, step), step)
    first.close()  # killed: its snapshots of steps 4 and 5 stay in memory
    # a rollback to the durable checkpoint of step 4: this run's own steps differ from the first's (sign -1)
    rolled = ci.MemoryCheckpoints(d, "tl", replicas=1)
    assert rolled.latest() == 5 and rolled.last_complete_step == 5
    req = rolled.persist(5, str(tmp_path / "durable5"))  # (a persist reading step 5: the drop waits for it)
    rolled.discard_newer(4)  # (Lightning calls it at train start with the step it resumed from)
    req.wait()
    assert rolled.latest() == 4 and rolled.last_complete_step is None  # nothing a SIGTERM would persist
    # its first snapshot fails on the way (the slot's record removed, then the write failed): step 4 stays,
    # in the other slot (the dropped step 5 had left no slot protected, and slot 0 was overwritten)
    real, slots.write_record = slots.write_record, _failing_write
    try:
        rolled.save(_state(0, 1, 5, -1), 5)
        with pytest.raises(OSError, match="no room"):
            rolled.wait()
    finally:
        slots.write_record = real
    assert rolled.latest() == 4
    rolled.save(_state(0, 1, 5, -1), 5)
    rolled.wait()
    assert rolled.latest() == 5 and rolled.last_complete_step == 5
    _check(rolled.load(_request(0, 1), 5), 0, 1, 5, -1)  # its own step 5, not the first run's
    rolled.close()
    # a restart that restores step 5 and goes on: the step it came from stays beside its own
    again = ci.MemoryCheckpoints(d, "tl", replicas=1)
    _check(again.load(_request(0, 1), 5), 0, 1, 5, -1)
    again.discard_newer(5)
    again.save(_state(0, 1, 6, -1), 6)
    again.wait()
    assert again.latest() == 6
    _check(again.load(_request(0, 1), 5), 0, 1, 5, -1)
    again.close()
    # a run from scratch without discard_newer: its first complete snapshot drops the others' later steps
    scratch = ci.MemoryCheckpoints(d, "tl", replicas=1)
    scratch.save(_state(0, 1, 1), 1)
    scratch.wait()
    assert scratch.latest() == 1
    scratch.close()
    fresh = ci.MemoryCheckpoints(d, "tl", replicas=1)  # and one that calls it, before any snapshot
    fresh.discard_newer(0)
    assert fresh.latest() is None and fresh.last_complete_step is None
    assert not [n for n in os.listdir(os.path.join(d, "tl", "r00000")) if n.startswith("s")]  # files freed too
    fresh.close(remove=True)


def test_a_second_open_tier_of_the_same_job_and_directory_is_refused(tmp_path):
    """Two tiers of one job_id and directory (one per data-parallel group: both have a rank 0) wrote
    the same files, and a restore returned another rank's state without an error. A rank's place is
    locked while its tier is open: the second is refused naming the job, the first is untouched."""
    import ckpt_integration as ci

    d = str(tmp_path)
    first = ci.MemoryCheckpoints(d, "twice", replicas=1)
    first.save(_state(0, 1, 3), 3)
    first.wait()
    with pytest.raises(ci.errors.MemoryCheckpointError, match="rank 0's place .* job_id 'twice' .* its own job_id"):
        ci.MemoryCheckpoints(d, "twice", replicas=1)
    _check(first.load(_request(0, 1), 3), 0, 1, 3)
    other = ci.MemoryCheckpoints(d, "other", replicas=1)  # another job beside it is fine
    other.close(remove=True)
    first.close()
    again = ci.MemoryCheckpoints(d, "twice", replicas=1)  # closed (or its process gone): the place is free
    _check(again.load(_request(0, 1), 3), 0, 1, 3)
    again.close(remove=True)
    assert sorted(os.listdir(d)) == []


def _failing_write(*args, **kwargs):
    raise OSError(28, "no room")


def test_a_step_a_later_run_left_is_not_offered_and_load_takes_what_latest_found():
    """Run X (2 ranks) reached steps 6 and 7; a later run Y (1 rank, one node) rolled back and saved 5
    and 6; X's copies survive on the node Y did not have. ``latest()`` offered X's step 7, and
    ``load(6)`` preferred X's step 6 (of this job size) to Y's: the timeline Y left."""
    from ckpt_integration.memory.restore import Inventory, complete_any, step_in_memory
    from ckpt_integration.memory.slots import Entry

    x, y = (100, "x"), (200, "y")
    node0 = [Entry(0, s % 2, s, x, 2) for s in (6, 7)] + [Entry(1, s % 2, s, x, 2) for s in (6, 7)] + [
        Entry(0, s % 2, s, y, 1) for s in (5, 6)]
    node1 = [Entry(o, s % 2, s, x, 2) for o in (0, 1) for s in (6, 7)]
    inv = Inventory(["n0", "n1"], [node0, node1])
    assert [k for k, _ in complete_any(inv)] == [(6, y), (5, y)]
    assert step_in_memory(inv, 6) == ((6, y), 1)


def test_tmpfs_without_huge_pages_is_named(tmp_path):
    from ckpt_integration.memory.slots import tmpfs_without_huge_pages

    mounts = tmp_path / "mounts"
    mounts.write_text("tmpfs /dev/shm tmpfs rw,relatime,size=24684092k 0 0\n"
                      "tmpfs /dev/shm/huge tmpfs rw,size=8g,huge=within_size 0 0\n"
                      "/dev/vda1 / ext4 rw,relatime 0 0\n")
    assert tmpfs_without_huge_pages("/dev/shm/ckpt/node0", str(mounts)) == "/dev/shm"
    assert tmpfs_without_huge_pages("/dev/shm/huge/node0", str(mounts)) is None  # the longest mount point wins
    assert tmpfs_without_huge_pages("/var/tmp/x", str(mounts)) is None  # not a tmpfs
    assert tmpfs_without_huge_pages("/dev/shmx", str(mounts)) is None


def tier_region_start(tier, slot: int) -> int:
    """The byte offset of the largest region of rank 0's record in ``slot``, plus 100."""
    import ckpt_integration as ci

    rec = ci.memory.slots.read_record(tier.root, 0, slot)
    return max(rec.regions, key=lambda r: r[2])[1] + 100


def _shared_directory(rank, world, root):
    import logging

    import ckpt_integration as ci

    # two plan nodes given one directory (as a wrong ranks_per_node does on one host): refused on
    # every rank, naming the ranks, before anything is written
    with pytest.raises(ci.errors.MemoryCheckpointError, match=r"same memory as their owners \(rank 0's copy on rank 1; rank 1's copy on rank 0"):
        ci.MemoryCheckpoints(os.path.join(root, "shared"), "clash", replicas=2, ranks_per_node=1)
    assert not os.path.exists(os.path.join(root, "shared", "clash", "r00000", "s0.rec"))
    # one node's memory for both ranks, said so: the tier keeps one copy (a restart on fewer nodes)
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("ckpt_integration.memory.tier").addHandler(handler)
    try:
        tier = ci.MemoryCheckpoints(os.path.join(root, "shared"), "one", replicas=2, ranks_per_node=2)
    finally:
        logging.getLogger("ckpt_integration.memory.tier").removeHandler(handler)
    assert tier.plan.replicas == 1 and any("keeping 1 copy" in m for m in records), records
    tier.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.full((2,), float(rank)), (0, rank, world))}, 1)
    tier.wait()
    got = tier.load({"w": ci.ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, rank, world))}, 1, verify_state=True)
    assert torch.equal(got["w"], torch.full((2,), float(rank)))
    # ranks that disagree on the step a run goes on from: refused on every rank, nothing dropped (before:
    # each rank kept other slots, and every later snapshot failed naming another rank's step)
    with pytest.raises(ci.errors.MismatchError, match=r"different steps \(from 0 to 1; this rank: " + str(rank)):
        tier.discard_newer(rank)
    assert tier.latest() == 1
    tier.close(remove=True)
    # a tier made after another was closed, again and again in one process (Lightning's fit after
    # fit): each its own groups; torch's new_group reused a closed group's name and rendezvous keys
    # and hung connecting to its dead peers
    for k in range(6):
        with ci.MemoryCheckpoints(os.path.join(root, f"node{rank}"), "again", replicas=2, ranks_per_node=1) as tier:
            tier.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.full((64,), float(k + rank)), (0, rank, world))},
                      k + 1)
            tier.wait()
            got = tier.load({"w": ci.ShardedTensor.from_rank_offsets("w", torch.zeros(64), (0, rank, world))}, k + 1)
            assert torch.equal(got["w"], torch.full((64,), float(k + rank))) and tier.last_restore.source == "own memory"
    # a rank that stages no tensor bytes: only common state, or a zero-size shard (the other rank holds the
    # tensor whole). Its snapshot failed (found by a probe): no directory for its record (a bare
    # FileNotFoundError), and a zero-size shard's empty region named a file the record did not keep, so
    # the peer refused the copy as damaged. Both restore from memory and persist exactly now
    full = torch.arange(8.0).reshape(4, 2)

    def state(data, empty):
        if rank == 1:
            return {"w": ci.ShardedTensor.from_global_offsets("w", data, (4, 2), (0, 0)), "step": 5}
        return {"step": 5} if empty is None else {"w": ci.ShardedTensor.from_global_offsets("w", empty, (4, 2), (0, 0)),
                                                  "step": 5}

    for name, empty in (("nothing", None), ("zero_size", full[:0].clone())):
        with ci.MemoryCheckpoints(os.path.join(root, f"node{rank}"), name, replicas=2, ranks_per_node=1) as tier:
            tier.save(state(full.clone(), empty), 5)
            tier.wait()
            got = tier.load(state(torch.zeros(4, 2), None if empty is None else torch.zeros(0, 2)), 5, verify_state=True)
            assert got["step"] == 5 and (rank == 0 or torch.equal(got["w"], full))
            tier.persist(5, os.path.join(root, f"persisted_{name}")).wait()
        got = ci.load({"w": ci.ShardedTensor.from_rank_offsets("w", torch.zeros(4, 2), replica_id=rank)},
                      os.path.join(root, f"persisted_{name}"))
        assert torch.equal(got["w"], full)


def test_copies_in_the_owners_own_memory_are_refused(tmp_path):
    from tests.dist_utils import run_distributed

    run_distributed(_shared_directory, 2, str(tmp_path), timeout=120)


def test_a_persisted_snapshot_records_its_step_and_is_the_newest(tmp_path):
    """A durable save of step 5 as last.ckpt, then a snapshot of step 7 persisted beside it (as at
    a preemption): the persisted checkpoint records step 7 and orders after last.ckpt, so a
    resume on new nodes (memory gone) takes it, and it loads exactly."""
    import ckpt_integration as ci
    from ckpt_integration.storage import checkpoint_dir as ckdir

    ckpts = tmp_path / "ckpts"
    durable = _state(0, 1, 5)
    durable["global_step"] = 5
    ci.save(durable, str(ckpts / "last.ckpt"))
    tier = ci.MemoryCheckpoints(str(tmp_path / "shm"), "preempt", replicas=1)
    snap = _state(0, 1, 7)
    snap["global_step"] = 7
    tier.save(snap, 7)
    tier.persist(7, str(ckpts / "preempted-step=7.ckpt")).wait()
    tier.close(remove=True)  # new nodes: nothing in memory
    assert ckdir.read_manifest(locate(ckpts / "preempted-step=7.ckpt")).step == 7
    assert [os.path.basename(p) for p in ci.list_checkpoints(str(ckpts))] == ["last.ckpt", "preempted-step=7.ckpt"]
    got = ci.load(_request(0, 1), ci.list_checkpoints(str(ckpts))[-1])
    _check(got, 0, 1, 7)
    assert got["global_step"] == 7
    # the tier's step is recorded also when the common state names none
    tier = ci.MemoryCheckpoints(str(tmp_path / "shm"), "plain", replicas=1)
    tier.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(4))}, 9)
    tier.persist(9, str(ckpts / "memory-step=9.ckpt")).wait()
    tier.close(remove=True)
    assert ckdir.read_manifest(locate(ckpts / "memory-step=9.ckpt")).step == 9
    assert os.path.basename(ci.list_checkpoints(str(ckpts))[-1]) == "memory-step=9.ckpt"


def test_snapshot_is_a_copy_and_a_failed_snapshot_keeps_the_previous_step(tmp_path):
    import ckpt_integration as ci

    tier = ci.MemoryCheckpoints(str(tmp_path), "copy", replicas=1)
    state = _state(0, 1, 1)
    tier.save(state, 1)
    ci.wait_for_snapshot()
    state["w"].data.add_(1000)  # after the snapshot: the snapshot keeps step 1's values
    state["iteration"] = -1
    tier.wait()
    _check(tier.load(_request(0, 1), 1), 0, 1, 1)
    bad = _state(0, 1, 2)
    bad["w"] = ci.ShardedTensor.from_rank_offsets("w", torch.empty(N, M, device="meta"), (0, 0, 1))
    tier.save(bad, 2)
    with pytest.raises(ci.CheckpointingException, match="meta device"):
        tier.wait()
    assert tier.latest() == 1
    tier.save(_state(0, 1, 3), 3)  # the failed slot is reused; step 1 stays until 3 is complete
    tier.wait()
    assert tier.latest() == 3
    _check(tier.load(_request(0, 1), 1), 0, 1, 1)
    tier.close()


def test_a_snapshot_record_that_cannot_be_written_is_named_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    """The shared memory fills up while a snapshot's record is written (probe: a small tmpfs, ENOSPC).
    That raised a bare OSError naming no file, and left ``s1.rec.tmp-<pid>`` behind."""
    import errno

    import ckpt_integration as ci
    from ckpt_integration.storage import fs as fsmod

    tier = ci.MemoryCheckpoints(str(tmp_path), "full", replicas=1)
    tier.save(_state(0, 1, 1), 1)
    tier.wait()

    class Full:  # a file on a full file system: its bytes do not fit
        def __init__(self, path, mode):
            self.f = open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fsmod, "open", lambda path, mode="r", *a, **k: Full(path, mode) if ".rec.tmp-" in str(path)
                        else open(path, mode, *a, **k), raising=False)
    tier.save(_state(0, 1, 2), 2)
    with pytest.raises(ci.errors.MemorySpaceError, match=r"r00000/s1\.rec cannot be written: No space left on device"):
        tier.wait()
    monkeypatch.undo()
    owner = os.path.join(str(tmp_path), "full", "r00000")
    assert not [n for n in os.listdir(owner) if ".tmp-" in n], os.listdir(owner)
    assert tier.latest() == 1
    _check(tier.load(_request(0, 1), 1), 0, 1, 1)
    tier.save(_state(0, 1, 3), 3)  # room again: the next snapshot commits
    tier.wait()
    assert tier.latest() == 3
    tier.close(remove=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_not_enough_shared_memory_is_refused_before_the_first_snapshot(tmp_path):
    import ckpt_integration as ci

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        tier = ci.MemoryCheckpoints(str(mnt), "big", replicas=1)
        with pytest.raises(ci.errors.MemorySpaceError, match=r"needs [1-9][\d.]* [KMG]iB for 2 slots.*, [1-9][\d.]* [KMG]iB free"):
            tier.save(_state(0, 1, 1), 1)
        assert not os.listdir(os.path.join(str(mnt), "big", "r00000")) if os.path.exists(
            os.path.join(str(mnt), "big", "r00000")) else True
        tier.close()
    finally:
        import gc

        gc.collect()  # (files a failed save's frames still hold keep the mount busy)
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mnt)], check=False)  # (never left mounted under pytest's tmp)


# --------------------------------------------------------------------------------------------
# the rank program (runs in a subprocess)
# --------------------------------------------------------------------------------------------
def _install_kill_mid_copy(at_step: int, marker: str) -> None:
    """SIGKILL this process halfway through the background copy of snapshot ``at_step``."""
    from ckpt_integration.execution import staging

    real = staging.PendingCopy.run
    state = {"calls": 0}

    def run(self):
        state["calls"] += 1
        if state["calls"] < at_step:
            return real(self)
        g = self._groups[0]
        n = (g.hi - g.lo) // 2
        src = staging._byte_view(g.storage, g.device, g.lo, n)
        staging._byte_view(g.buffer, torch.device("cpu"), 0, n).copy_(src)  # half of the bytes land
        with open(marker, "w") as f:
            f.write("killed")
        os.kill(os.getpid(), signal.SIGKILL)

    staging.PendingCopy.run = run


def _rank_main(cfg: dict) -> None:
    import datetime
    import logging

    import torch.distributed as dist

    import ckpt_integration as ci

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format=f"rank {rank}: %(message)s")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    rpn = cfg["rpn"]
    node_dir = os.path.join(cfg["base"], f"node{rank // rpn}")
    out: dict = {}
    path = f"{cfg['out']}-rank{rank}.json"

    def dump():
        with open(path, "w") as f:
            json.dump(out, f)

    phase = cfg["phase"]
    if phase == "E":  # another world size: the step of 4 ranks is restored from memory, resharded
        tier = ci.MemoryCheckpoints(node_dir, "J", replicas=2, ranks_per_node=rpn)
        out["latest"] = tier.latest()
        full = torch.cat([_state(r, 4, 7)["w"].data for r in range(4)])
        rows = full.shape[0] // world
        got = tier.load(_request_resharded(rank, world), out["latest"])
        out["w_ok"] = torch.equal(got["w"], full[rank * rows:(rank + 1) * rows])
        out["iteration"] = got["iteration"]
        out["source"] = tier.last_restore.source
        durable = ci.load(_request_resharded(rank, world), cfg["durable"])  # the same as the durable tier's
        out["w_ok"] = out["w_ok"] and torch.equal(durable["w"], got["w"]) and durable["iteration"] == 7
        tier.close()
        dump()
        dist.destroy_process_group()
        return
    tier = ci.MemoryCheckpoints(node_dir, "J", replicas=2, ranks_per_node=rpn)
    if phase == "A":
        other = ci.MemoryCheckpoints(node_dir, "K", replicas=2, ranks_per_node=rpn)
        other.save(_state(rank, world, 100, sign=-1), 100)
        other.close()
        if rank == cfg.get("victim"):
            _install_kill_mid_copy(5, cfg["marker"])
        for step in range(1, 6):
            state = _state(rank, world, step)
            tier.save(state, step)
            tier.wait()
            if step == 3:
                tier.persist(3, cfg["durable3"]).wait()
            out["saved"] = step
            dump()
        return  # not reached: rank 1 dies in step 5, the others fail or are killed
    start = tier.latest()
    out["latest"] = start
    got = tier.load(_request(rank, world), start)
    _check(got, rank, world, start)
    out["source"], out["refused"] = tier.last_restore.source, tier.last_restore.refused
    if phase == "B":
        other = ci.MemoryCheckpoints(node_dir, "K", replicas=2, ranks_per_node=rpn)
        out["other_latest"] = other.latest()
        _check(other.load(_request(rank, world), 100), rank, world, 100, sign=-1)
        other.close(remove=True)
        # a tier per data-parallel group ({0, 2}, {1, 3}: each spans both nodes) copies to the other node
        # (the default ranks_per_node applied LOCAL_WORLD_SIZE to group ranks: one node, no copies)
        os.environ["LOCAL_WORLD_SIZE"] = str(rpn)
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        sub = ci.MemoryCheckpoints(node_dir, f"D{rank % 2}", replicas=2, process_group=groups[rank % 2])
        out["sub_holders"] = [list(h) for h in sub.plan.holders]
        sub.close(remove=True)
    for step in cfg["steps"]:
        tier.save(_state(rank, world, step), step)
        tier.wait()
    if cfg.get("persist"):
        tier.persist(cfg["steps"][-1] if cfg["steps"] else start, cfg["persist"]).wait()
    out["done"] = True
    dump()
    if rank == cfg.get("victim"):
        os.kill(os.getpid(), signal.SIGKILL)  # between snapshots, "mid-training"
    tier.close()
    dist.barrier()
    dist.destroy_process_group()


def _request_resharded(rank: int, world: int):
    import ckpt_integration as ci

    rows = 4 * N // world
    return {"w": ci.ShardedTensor.from_rank_offsets("w", torch.zeros(rows, M), (0, rank, world))}


# --------------------------------------------------------------------------------------------
# the launcher (in the test process)
# --------------------------------------------------------------------------------------------
def _launch(tmp: str, name: str, cfg: dict, world: int, victim=None):
    from tests.proc_launch import launch

    return launch(__file__, tmp, name, cfg, world, victim=victim, timeout=LAUNCH_TIMEOUT,
                  survivor_grace=SURVIVOR_GRACE, ranks_per_node=cfg["rpn"])


def _tails(logs, n=3000):
    from tests.proc_launch import tails

    return tails(logs, n)


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.slow
def test_four_ranks_two_nodes_kill_restart_node_loss_corruption_and_reshard(tmp_path):
    import shutil

    import ckpt_integration as ci
    from ckpt_integration.memory import slots

    tmp = str(tmp_path)
    base = os.path.join(tmp, "shm")  # node0/ and node1/: the simulated nodes' shared memory
    common = dict(base=base, rpn=2, durable3=os.path.join(tmp, "iter3"))

    # A: train 1..4, rank 1 dies while copying snapshot 5
    marker = os.path.join(tmp, "killed")
    rcs, outs, logs = _launch(tmp, "A", {**common, "phase": "A", "marker": marker}, 4, victim=1)
    assert rcs[1] == -signal.SIGKILL and os.path.exists(marker), f"{rcs}\n{_tails(logs)}"
    assert all(o.get("saved") == 4 for o in outs), outs
    assert ci.load_common_state_dict(common["durable3"])["iteration"] == 3  # persisted from memory
    k_files = {r: sorted(os.listdir(os.path.join(base, f"node{r // 2}", "K", f"r{r:05d}"))) for r in range(4)}

    # B: restart; step 4 from own memory (5 is torn on rank 1); job K restores its own step and removes it
    rcs, outs, logs = _launch(tmp, "B", {**common, "phase": "B", "steps": [5, 6]}, 4, victim=2)
    assert rcs[2] == -signal.SIGKILL and all(o.get("done") for o in outs), f"{rcs}\n{_tails(logs)}"
    for o in outs:
        assert (o["latest"], o["source"], o["refused"], o["other_latest"]) == (4, "own memory", [], 100), o
        assert o["sub_holders"] == [[1], [0]], o
    assert all(k_files[r] for r in range(4))
    for node in ("node0", "node1"):
        assert not os.path.exists(os.path.join(base, node, "K")), "job K's snapshots were not removed"
        assert os.path.exists(os.path.join(base, node, "J"))

    # C: flip a byte of rank 0's own copy of step 6: refused, its peer copy on node 1 used
    root0 = os.path.join(base, "node0", "J")
    rec = next(slots.read_record(root0, 0, s) for s in (0, 1) if slots.read_record(root0, 0, s).step == 6)
    name, offset, nbytes, _ = rec.regions[0]
    _flip_byte(os.path.join(slots.owner_dir(root0, 0), name), offset + nbytes // 2)
    rcs, outs, logs = _launch(tmp, "C", {**common, "phase": "C", "steps": [7]}, 4)
    assert rcs == [0] * 4, f"{rcs}\n{_tails(logs)}"
    assert outs[0]["latest"] == 6 and outs[0]["source"] == "peer rank 2", outs[0]
    assert len(outs[0]["refused"]) == 1 and "XXH3-64 mismatch in block" in outs[0]["refused"][0], outs[0]
    assert "refused its copy of step 6 in own memory" in _tails(logs[:1], 100000)
    assert [o["source"] for o in outs[1:]] == ["own memory"] * 3

    # D: node 1 replaced (its shared memory is gone): ranks 2 and 3 restore step 7 from node 0
    shutil.rmtree(os.path.join(base, "node1"))
    durable7 = os.path.join(tmp, "iter7")
    rcs, outs, logs = _launch(tmp, "D", {**common, "phase": "D", "steps": [], "persist": durable7}, 4)
    assert rcs == [0] * 4, f"{rcs}\n{_tails(logs)}"
    assert [o["latest"] for o in outs] == [7] * 4
    assert [o["source"] for o in outs] == ["own memory", "own memory", "peer rank 0", "peer rank 1"], outs
    assert ci.load_common_state_dict(durable7)["iteration"] == 7

    # E: 2 ranks (one per node; node 1's memory is empty): step 7 of 4 ranks restored from memory,
    # resharded; rank 1's bytes are served by rank 0 (node 0 holds all four snapshots)
    rcs, outs, logs = _launch(tmp, "E", {**common, "phase": "E", "rpn": 1, "durable": durable7}, 2)
    assert rcs == [0, 0], f"{rcs}\n{_tails(logs)}"
    assert [(o["latest"], o["w_ok"], o["iteration"]) for o in outs] == [(7, True, 7)] * 2, outs
    assert outs[0]["source"] == "memory of 4 rank(s), resharded: own node (2 range(s))", outs
    assert outs[1]["source"] == "memory of 4 rank(s), resharded: peer rank 0 (2 range(s))", outs


if __name__ == "__main__":  # one rank of a launch: python test_memory_tier.py '<json cfg>'
    sys.path.insert(0, ROOT)
    _rank_main(json.loads(sys.argv[1]))


def test_a_persist_to_a_relative_path_writes_where_it_was_asked(tmp_path, monkeypatch):
    """``tier.persist(step, "ck/persisted")`` resolved the path in its background thread: after a
    ``chdir`` (Hydra's) the durable checkpoint landed under the new working directory (with
    ``overwrite=True``, as Lightning persists, replacing a checkpoint there)."""
    import threading

    import ckpt_integration as ci
    from ckpt_integration.memory.tier import MemoryCheckpoints

    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    monkeypatch.chdir(tmp_path / "a")
    tier = ci.MemoryCheckpoints(str(tmp_path / "shm"), "rel", replicas=1)
    tier.save(_state(0, 1, 3), 3)
    tier.wait()
    gate, real = threading.Event(), MemoryCheckpoints._run_persist
    monkeypatch.setattr(MemoryCheckpoints, "_run_persist", lambda self, *a: (gate.wait(60), real(self, *a))[1])
    req = tier.persist(3, "ck/persisted")
    monkeypatch.chdir(tmp_path / "b")
    gate.set()
    req.wait()
    tier.close()
    assert ci.load_common_state_dict(str(tmp_path / "a" / "ck" / "persisted"))["iteration"] == 3
    assert os.listdir(tmp_path / "b") == []


def test_persist_with_base_auto_links_from_the_newest_checkpoint_beside_it(tmp_path, caplog):
    """``persist(step, dir, base="auto")`` took "auto" for a path (``<cwd>/auto``: "cannot be used ...
    writing every byte"), so nothing was linked; it means the newest committed checkpoint beside ``dir``,
    as in ``save``."""
    import logging

    import ckpt_integration as ci

    tier = ci.MemoryCheckpoints(str(tmp_path / "shm"), "auto", replicas=1)
    for step in (1, 2):
        tier.save(_state(0, 1, 1), step)  # (the same tensors: everything unchanged)
        tier.wait()
    tier.persist(1, str(tmp_path / "ck" / "p1")).wait()
    with caplog.at_level(logging.WARNING, logger="ckpt_integration"):
        tier.persist(2, str(tmp_path / "ck" / "p2"), base="auto").wait()
    tier.close()
    assert "cannot be used" not in caplog.text, caplog.text
    inodes = {os.stat(tmp_path / "ck" / "p1" / n).st_ino for n in os.listdir(tmp_path / "ck" / "p1") if n.endswith(".distcp")}
    linked = [n for n in os.listdir(tmp_path / "ck" / "p2") if n.endswith(".distcp")
              and os.stat(tmp_path / "ck" / "p2" / n).st_ino in inodes]
    assert linked, os.listdir(tmp_path / "ck" / "p2")
    assert ci.load_common_state_dict(str(tmp_path / "ck" / "p2"))["iteration"] == 1


def test_persist_takes_the_save_options_of_save_and_refuses_others_at_the_call(tmp_path):
    """``persist(step, dir, sharded_strategy="zarr")`` (the save's name for the backend) returned a request
    whose ``wait`` raised a bare ``TypeError`` from the background; an unknown option likewise."""
    import ckpt_integration as ci
    from ckpt_integration.storage.checkpoint_dir import read_config
    from ckpt_integration.storage.filesystem import locate

    tier = ci.MemoryCheckpoints(str(tmp_path / "shm"), "opts", replicas=1)
    tier.save(_state(0, 1, 1), 1)
    tier.wait()
    with pytest.raises(ci.CheckpointingException, match="thread_cont is not an option of the save"):
        tier.persist(1, str(tmp_path / "bad"), thread_cont=2)
    tier.persist(1, str(tmp_path / "z"), sharded_strategy="zarr").wait()
    tier.close()
    assert read_config(locate(str(tmp_path / "z"))).sharded_backend == "zarr"
    assert ci.load_common_state_dict(str(tmp_path / "z"))["iteration"] == 1
