"""Async save with staging: snapshots, buffer reuse, aliasing, containers, failures, bounds.

Distributed scenarios are batched into one 2-rank launch (each spawn costs seconds), with
the background-snapshot scenarios of ``tests/test_async_snapshot.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

import ckpt_integration as ci
from ckpt_integration import ShardedObject, ShardedTensor
from ckpt_integration.errors import CheckpointingException
from ckpt_integration.execution import save as save_mod
from ckpt_integration.execution.async_save import AsyncCallsQueue, AsyncRequest, async_save_torch_dist
from ckpt_integration.execution.staging import StateDictStager
from tests.dist_utils import run_distributed, scaled_timeout


# --------------------------------------------------------------------------- containers
@dataclasses.dataclass
class OptState:
    exp_avg: torch.Tensor
    step: int


class Pair(NamedTuple):
    first: torch.Tensor
    name: str


class Holder:
    """A custom container with a deepcopy hook."""

    def __init__(self, t: torch.Tensor, tag: str):
        self.t = t
        self.tag = tag
        self.copied = False

    def __deepcopy__(self, memo):
        import copy

        out = Holder(copy.deepcopy(self.t, memo), self.tag)
        out.copied = True
        return out


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# --------------------------------------------------------------------------- stager (1 process)
def test_stager_snapshots_containers_aliasing_and_reuse():
    base = torch.arange(64, dtype=torch.float32)
    w = base[8:40].view(4, 8)
    tied = base[8:40].view(4, 8)  # another view of the same storage (tied weight)
    cpu_plain = torch.ones(5)
    state = {
        "w": w,
        "tied": tied,
        "tail": base[48:56],
        "list": [cpu_plain, (torch.zeros(2), 3)],
        "dc": OptState(torch.full((3,), 7.0), 11),
        "nt": Pair(torch.eye(2), "p"),
        "od": collections.OrderedDict(a=w),
        "custom": Holder(base[0:4], "h"),
        "param": torch.nn.Parameter(torch.ones(2)),
        "text": "x",
    }
    st = StateDictStager(pin_memory=False)
    s = st.stage(state)
    expect = {k: v.clone() for k, v in [("w", w), ("tail", base[48:56]), ("plain", cpu_plain)]}
    base.add_(100)
    cpu_plain.mul_(0)
    state["dc"].exp_avg.add_(1)
    # snapshot: later in-place updates are not seen
    assert torch.equal(s["w"], expect["w"]) and torch.equal(s["tail"], expect["tail"])
    assert torch.equal(s["list"][0], expect["plain"])
    assert torch.equal(s["dc"].exp_avg, torch.full((3,), 7.0))
    # containers keep their types and non-tensor members
    assert isinstance(s["dc"], OptState) and s["dc"].step == 11
    assert isinstance(s["nt"], Pair) and s["nt"].name == "p" and torch.equal(s["nt"].first, torch.eye(2))
    assert isinstance(s["list"][1], tuple) and s["list"][1][1] == 3
    assert isinstance(s["od"], collections.OrderedDict)
    assert isinstance(s["custom"], Holder) and s["custom"].copied and s["custom"].tag == "h"
    assert torch.equal(s["custom"].t, torch.arange(4, dtype=torch.float32))
    assert s["text"] == "x"
    # aliasing: every view of `base` is a view of ONE staged storage, distinct from the source
    ptrs = {_storage_ptr(s[k]) for k in ("w", "tied", "tail")} | {_storage_ptr(s["od"]["a"]), _storage_ptr(s["custom"].t)}
    assert len(ptrs) == 1 and _storage_ptr(base) not in ptrs
    assert s["od"]["a"] is s["w"]
    s["w"][0, 0] = -1.0
    assert s["tied"][0, 0] == -1.0  # still tied
    # nothing staged references the live tensors
    assert _storage_ptr(s["list"][0]) != _storage_ptr(cpu_plain)
    assert _storage_ptr(s["param"]) != _storage_ptr(state["param"])
    first = dataclasses.replace(st.stats)
    assert first.allocations == first.storages_staged and first.fallback_copies == 0

    # second call with the same structure: buffers reused, no allocation
    s2 = st.stage(state)
    assert st.stats.last_allocations == 0
    assert st.stats.allocations == first.allocations
    assert st.stats.allocated_bytes == first.allocated_bytes
    assert _storage_ptr(s2["w"]) == _storage_ptr(s["w"])
    assert torch.equal(s2["w"], w) and torch.equal(s2["list"][0], cpu_plain)


def test_stager_reuses_buffers_for_recreated_tensors_and_adapts_to_new_structure():
    st = StateDictStager(pin_memory=False)
    st.stage({"a": torch.randn(16, 4), "b": [torch.randn(8)]})
    n = st.stats.allocations
    # new tensor objects, same sizes (e.g. a reshape copy made each step): reused by size
    out = st.stage({"a": torch.randn(16, 4), "b": [torch.randn(8)]})
    assert st.stats.last_allocations == 0 and st.stats.allocations == n
    assert out["a"].shape == (16, 4)
    # structure change: only the new size is allocated, unused buffers are dropped
    st.stage({"a": torch.randn(16, 4), "c": torch.randn(3)})
    assert st.stats.last_allocations == 1
    assert st.cached_bytes == 16 * 4 * 4 + 3 * 4
    st.clear()
    assert st.cached_bytes == 0


def test_stager_only_copies_the_used_range_of_a_large_storage():
    flat = torch.zeros(1 << 16)
    st = StateDictStager(pin_memory=False)
    s = st.stage({"piece": flat[1000:1100]})
    assert s["piece"].untyped_storage().nbytes() < 1024
    assert torch.equal(s["piece"], flat[1000:1100])


# --------------------------------------------------------------------------- async (1 process)
def _sd(w, b):
    return {
        "w": ShardedTensor.from_rank_offsets("w", w),
        "b": ShardedTensor.from_rank_offsets("b", b),
        "obj": ShardedObject("obj", {"k": 1}, (1,), (0,)),
        "step": 7,
    }


def _load_wb(path, shape_w, shape_b):
    req = {
        "w": ShardedTensor.from_rank_offsets("w", torch.empty(shape_w)),
        "b": ShardedTensor.from_rank_offsets("b", torch.empty(shape_b)),
        "obj": ShardedObject("obj", None, (1,), (0,)),
    }
    return ci.load(req, path)


def test_async_single_process_snapshot_reuse_and_finalize_fns(tmp_path):
    w, b = torch.randn(64, 32), torch.randn(17)
    calls = []
    with AsyncCallsQueue() as q:
        refs = []
        for i in range(3):
            refs.append((w.clone(), b.clone()))
            req = async_save_torch_dist(
                _sd(w, b), str(tmp_path / f"c{i}"), queue=q, finalize_fns=[lambda i=i: calls.append(i)]
            )
            assert isinstance(req, AsyncRequest) and req.blocking_seconds is not None
            w.add_(1.0)  # in-place update right after the call returns
            b.mul_(2.0)
            if i >= 1:
                assert q.stagers[0].stats.last_allocations == 0
        assert q.get_num_unfinalized_calls() == 1
    assert calls == [0, 1, 2]
    for i, (rw, rb) in enumerate(refs):
        out = _load_wb(str(tmp_path / f"c{i}"), (64, 32), (17,))
        assert torch.equal(out["w"], rw) and torch.equal(out["b"], rb)
        assert out["step"] == 7 and out["obj"] == {"k": 1}
    assert q.stagers[0].stats.allocations == 2  # one buffer per tensor, all from the first save


def test_maybe_finalize_is_local_and_ordered(tmp_path):
    q = AsyncCallsQueue(max_in_flight=2)
    gate = threading.Event()
    r0 = AsyncRequest(gate.wait)
    r1 = AsyncRequest(lambda: None)
    q.schedule_async_request(r0)
    q.schedule_async_request(r1)
    time.sleep(0.05)
    assert q.maybe_finalize_async_calls(blocking=False) == []  # r0 not done; r1 waits behind it
    gate.set()
    assert q.maybe_finalize_async_calls(blocking=True) == [0, 1]
    q.close()
    with pytest.raises(RuntimeError, match="closed"):
        q.schedule_async_request(AsyncRequest(lambda: None))


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_bounded_in_flight(max_in_flight):
    q = AsyncCallsQueue(max_in_flight=max_in_flight)
    gates = [threading.Event() for _ in range(3)]
    reqs = [AsyncRequest(g.wait) for g in gates]
    for r in reqs[:max_in_flight]:
        q.schedule_async_request(r)
    assert q.get_num_unfinalized_calls() == max_in_flight
    # one more must first wait for the oldest: run it in a thread and check it blocks
    t = threading.Thread(target=q.schedule_async_request, args=(reqs[max_in_flight],))
    t.start()
    time.sleep(0.1)
    assert t.is_alive() and q.get_num_unfinalized_calls() == max_in_flight
    gates[0].set()
    t.join(scaled_timeout(5))
    assert not t.is_alive() and reqs[0].is_done()
    assert q.get_num_unfinalized_calls() == max_in_flight
    for g in gates:
        g.set()
    q.close()
    assert all(r.is_done() for r in reqs[: max_in_flight + 1])


@pytest.mark.parametrize("snapshot", ["background", "caller"])
def test_threads_saving_on_one_queue_keep_their_own_data(tmp_path, snapshot):
    """Two threads each saving in the background on one queue (the default queue, as ``save`` uses)
    took the same stager slot and staged into each other's buffers: checkpoints held the other
    thread's tensors beside their own common state, loaded and verified without an error."""
    q = AsyncCallsQueue(snapshot=snapshot)
    errors = []

    def worker(tid):
        try:
            for i in range(4):
                w = torch.full((256, 512), float(tid * 100 + i))  # (512 KiB: copied in the background)
                sd = {"w": ShardedTensor.from_rank_offsets("w", w), "tid": tid}
                async_save_torch_dist(sd, str(tmp_path / f"t{tid}_{i}"), queue=q).wait()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled_timeout(60))
    q.close()
    assert not errors, errors
    for tid in range(2):
        for i in range(4):
            path = str(tmp_path / f"t{tid}_{i}")
            assert torch.equal(ci.load_plain_tensors(path)["w"], torch.full((256, 512), float(tid * 100 + i))), path
            assert ci.load_common_state_dict(path)["tid"] == tid


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_relative_path_is_the_one_of_the_save_call_not_of_the_write(tmp_path, monkeypatch, overwrite):
    """Hydra changes the working directory: an async save to a relative path wrote against the cwd
    of the moment its background write ran (a new checkpoint failed with "no such file or directory",
    an overwrite left a staging directory behind); the path is the one the save was called with."""
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    monkeypatch.chdir(tmp_path / "a")
    if overwrite:
        ci.save({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, "ck")
    q = AsyncCallsQueue(max_in_flight=2)
    gate = threading.Event()
    q.schedule_async_request(AsyncRequest(gate.wait))  # the save's write runs after it
    req = async_save_torch_dist({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, "ck", queue=q,
                                overwrite=overwrite)
    monkeypatch.chdir(tmp_path / "b")
    gate.set()
    req.wait()
    q.close()
    assert torch.equal(ci.load_plain_tensors(str(tmp_path / "a" / "ck"))["w"], torch.arange(4.0))
    assert sorted(os.listdir(tmp_path / "a")) == ["ck"] and os.listdir(tmp_path / "b") == []


def test_megatron_flow_on_its_own_queue_waits_and_finalizes(tmp_path, monkeypatch):
    """Megatron-Core's flow: ``req = save(..., async_sharded_save=True)``, ``req.add_finalize_fn(fn)``,
    ``queue.schedule_async_request(req)`` on the job's own queue, later
    ``queue.maybe_finalize_async_calls(blocking=True)``. The request was already on the default queue,
    so the job's queue ignored it: it counted 0 calls, the blocking finalize returned at once with the
    save uncommitted and ``fn`` (Megatron's tracker file update) not run."""
    from ckpt_integration.execution.staging import PendingCopy

    q = AsyncCallsQueue()
    gate, copy = threading.Event(), PendingCopy.run
    monkeypatch.setattr(PendingCopy, "run", lambda self: (gate.wait(scaled_timeout(60)), copy(self)))  # (held)
    req = ci.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(256, 512))}, str(tmp_path / "iter_200"),
                  async_sharded_save=True)
    ran = []
    req.add_finalize_fn(lambda: ran.append((tmp_path / "iter_200" / "metadata.json").exists()))
    assert q.schedule_async_request(req) == req.call_idx
    assert q.get_num_unfinalized_calls() == 1 and q.maybe_finalize_async_calls(blocking=False) == []
    threading.Timer(0.2, gate.set).start()
    assert q.maybe_finalize_async_calls(blocking=True) == [req.call_idx]
    assert ran == [True] and q.get_num_unfinalized_calls() == 0
    q.close()
    ci.execution.async_save.get_default_async_queue().maybe_finalize_async_calls(blocking=True)
    assert ran == [True]  # (once)


def test_async_write_failure_single_process(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("injected write failure")

    w, b = torch.randn(8, 4), torch.randn(3)
    q = AsyncCallsQueue()
    monkeypatch.setattr(save_mod, "write_data_files", boom)
    req = async_save_torch_dist(_sd(w, b), str(tmp_path / "bad"), queue=q)
    with pytest.raises(OSError, match="injected write failure"):
        req.wait()
    with pytest.raises(OSError, match="injected write failure"):
        req.wait()  # idempotent: raises again
    assert not (tmp_path / "bad" / "metadata.json").exists()
    # a failure not waited for surfaces at the next save on the queue
    async_save_torch_dist(_sd(w, b), str(tmp_path / "bad2"), queue=q)
    with pytest.raises(OSError, match="injected write failure"):
        async_save_torch_dist(_sd(w, b), str(tmp_path / "never"), queue=q)
    assert not (tmp_path / "bad2" / "metadata.json").exists()
    assert not (tmp_path / "never").exists()
    monkeypatch.undo()
    # the queue is still usable, and a failure at close is raised too
    async_save_torch_dist(_sd(w, b), str(tmp_path / "good"), queue=q).wait()
    assert (tmp_path / "good" / "metadata.json").exists()
    monkeypatch.setattr(save_mod, "write_data_files", boom)
    async_save_torch_dist(_sd(w, b), str(tmp_path / "bad3"), queue=q)
    with pytest.raises(OSError, match="injected write failure"):
        q.close()
    assert not (tmp_path / "bad3" / "metadata.json").exists()


def test_async_unwritable_path_fails_without_commit(tmp_path):
    target = tmp_path / "file"
    target.write_text("not a dir")
    with AsyncCallsQueue() as q:
        with pytest.raises(CheckpointingException):
            async_save_torch_dist(_sd(torch.ones(2), torch.ones(2)), str(target), queue=q)


# --------------------------------------------------------------------------- distributed
ROWS, COLS = 16, 8


def _dist_state(rank, world, w, emb, rep):
    return {
        "w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world)),
        # tied: output layer shares the embedding's storage
        "emb": ShardedTensor.from_rank_offsets("emb", emb, (0, rank, world)),
        "out": ShardedTensor.from_rank_offsets("out", emb.view(-1, COLS), (0, rank, world)),
        "rep": ShardedTensor.from_rank_offsets("rep", rep, replica_id=rank),
        "meta": {"iteration": 5},
    }


def _load_dist(path, rank, world):
    req = {
        "w": ShardedTensor.from_rank_offsets("w", torch.empty(ROWS, COLS), (0, rank, world)),
        "emb": ShardedTensor.from_rank_offsets("emb", torch.empty(ROWS, COLS), (0, rank, world)),
        "out": ShardedTensor.from_rank_offsets("out", torch.empty(ROWS, COLS), (0, rank, world)),
        "rep": ShardedTensor.from_rank_offsets("rep", torch.empty(6), replica_id=rank),
    }
    return ci.load(req, path)


def _dist_snapshot_and_reuse(rank, world, root):
    torch.manual_seed(rank)
    w = torch.randn(ROWS, COLS)
    emb = torch.randn(ROWS, COLS)
    rep = torch.arange(6, dtype=torch.float32)  # same on all ranks
    q = AsyncCallsQueue()
    refs = []
    for i in range(3):
        refs.append((w.clone(), emb.clone(), rep.clone()))
        req = async_save_torch_dist(_dist_state(rank, world, w, emb, rep), os.path.join(root, f"ck{i}"), queue=q)
        # training goes on at once: in-place updates and an unrelated collective
        w.add_(1.0)
        emb.mul_(-1.0)
        rep.add_(10.0)
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == world
        if i >= 1:
            assert q.stagers[0].stats.last_allocations == 0, q.stagers[0].stats
    allocs = q.stagers[0].stats.allocations
    req.wait()
    q.close()
    # tied tensors shared one staged storage: 3 distinct storages per save (w, emb, rep)
    assert q.stagers[0].stats.storages_staged <= 3 * 3
    assert allocs == q.stagers[0].stats.allocations
    dist.barrier()
    for i, (rw, remb, rrep) in enumerate(refs):
        out = _load_dist(os.path.join(root, f"ck{i}"), rank, world)
        assert torch.equal(out["w"], rw), i
        assert torch.equal(out["emb"], remb) and torch.equal(out["out"], remb), i
        assert torch.equal(out["rep"], rrep), i
        assert out["meta"] == {"iteration": 5}


def _dist_failures(rank, world, root):
    w = torch.randn(ROWS, COLS)
    emb = torch.randn(ROWS, COLS)
    rep = torch.arange(6, dtype=torch.float32)
    real = save_mod.write_data_files

    def fail_on_rank1(*a, **k):
        if rank == 1:
            raise OSError("injected disk failure on rank 1")
        return real(*a, **k)

    q = AsyncCallsQueue()
    # 1) failure surfaces at wait() on every rank, nothing is committed
    save_mod.write_data_files = fail_on_rank1
    try:
        req = async_save_torch_dist(_dist_state(rank, world, w, emb, rep), os.path.join(root, "bad1"), queue=q)
        t = torch.ones(1)
        dist.all_reduce(t)  # main-thread collectives are unaffected
        with pytest.raises(Exception, match="injected disk failure on rank 1"):
            req.wait()
        # 2) a failed save that nobody waited for surfaces at the next save call, on every rank
        async_save_torch_dist(_dist_state(rank, world, w, emb, rep), os.path.join(root, "bad2"), queue=q)
        with pytest.raises(Exception, match="injected disk failure on rank 1"):
            async_save_torch_dist(_dist_state(rank, world, w, emb, rep), os.path.join(root, "never"), queue=q)
    finally:
        save_mod.write_data_files = real
    dist.barrier()
    for name in ("bad1", "bad2"):
        assert not os.path.exists(os.path.join(root, name, "metadata.json")), name
    assert not os.path.exists(os.path.join(root, "never"))
    # 3) the queue still works afterwards; maybe_finalize is local (ranks call it at different times)
    req = async_save_torch_dist(_dist_state(rank, world, w, emb, rep), os.path.join(root, "good"), queue=q)
    if rank == 0:
        q.maybe_finalize_async_calls(blocking=False)
    req.wait()
    assert os.path.exists(os.path.join(root, "good", "metadata.json"))
    # 4) a failure is raised at close() on every rank
    save_mod.write_data_files = fail_on_rank1
    try:
        async_save_torch_dist(_dist_state(rank, world, w, emb, rep), os.path.join(root, "bad3"), queue=q)
        with pytest.raises(Exception, match="injected disk failure on rank 1"):
            q.close()
    finally:
        save_mod.write_data_files = real
    dist.barrier()
    assert not os.path.exists(os.path.join(root, "bad3", "metadata.json"))
    out = _load_dist(os.path.join(root, "good"), rank, world)
    assert out["meta"] == {"iteration": 5}


def _dist_abandon(rank, world, root):
    """A save that cannot finish within ``close(timeout=...)`` is abandoned on every rank (preemption,
    issue 23.5); a checkpoint committed by rank 0 is never removed because telling the others failed."""
    import ckpt_integration.storage.tensor_record as small_items
    from ckpt_integration.errors import AsyncSaveAbandonedError, DistributedCheckpointingError
    from ckpt_integration.execution import dist as cdist

    w, emb, rep = torch.randn(ROWS, COLS), torch.randn(ROWS, COLS), torch.arange(6, dtype=torch.float32)
    kept = os.path.join(root, "kept")
    with AsyncCallsQueue() as q:
        async_save_torch_dist(_dist_state(rank, world, w, emb, rep), kept, queue=q).wait()
    before = _load_dist(kept, rank, world)
    # 1) an overwrite of ``kept`` whose writes take 0.5 s an item, closed with a 0.2 s limit
    # every tensor item passes through the small-item writer first (written there when small)
    real_item = small_items.SmallItemWriter.add

    def slow_item(self, t):
        time.sleep(0.5)
        return real_item(self, t)

    small_items.SmallItemWriter.add = slow_item
    try:
        q = AsyncCallsQueue()
        async_save_torch_dist(_dist_state(rank, world, w + 1, emb + 1, rep + 1), kept, queue=q, overwrite=True)
        t0 = time.monotonic()
        with pytest.raises((AsyncSaveAbandonedError, DistributedCheckpointingError), match="abandoned") as e:
            q.close(timeout=0.2)
        took = time.monotonic() - t0
    finally:
        small_items.SmallItemWriter.add = real_item
    assert "still running 0s after the queue was closed" in str(e.value) or "abandoned on rank" in str(e.value), e.value
    assert took < scaled_timeout(3.0), took  # one item (0.5 s) at most after the limit, not the whole write
    dist.barrier()
    assert not [n for n in os.listdir(root) if ".tmp-" in n or ".old-" in n], os.listdir(root)  # staging removed
    after = _load_dist(kept, rank, world)
    for k in before:
        assert torch.equal(before[k], after[k]) if isinstance(before[k], torch.Tensor) else before[k] == after[k], k
    # 2) rank 0 commits, then the group fails before the others hear of it: the checkpoint stays
    real_bcast = cdist.broadcast_object

    def fail_after_commit(obj, src=0, group=None):
        if threading.current_thread().name == "ckpt-async-save" and isinstance(group, cdist.PrivateGroup):
            group.abort("test: the group failed right after the commit")
            raise RuntimeError("injected: the status broadcast failed")
        return real_bcast(obj, src, group)

    if rank == 0:
        cdist.broadcast_object = fail_after_commit
    try:
        q = AsyncCallsQueue()
        req = async_save_torch_dist(_dist_state(rank, world, w, emb, rep), os.path.join(root, "committed"), queue=q)
        if rank == 0:
            req.wait()  # committed: not an error on the rank that committed
        else:
            with pytest.raises(AsyncSaveAbandonedError, match="committed if and only if"):
                req.wait()
        q.close()
    finally:
        cdist.broadcast_object = real_bcast
    dist.barrier()
    assert torch.equal(_load_dist(os.path.join(root, "committed"), rank, world)["w"], w)


def _dist_all(rank, world, root):
    from tests.test_async_snapshot import dist_snapshot_scenarios

    _dist_snapshot_and_reuse(rank, world, os.path.join(root, "a"))
    dist.barrier()
    _dist_failures(rank, world, os.path.join(root, "b"))
    dist.barrier()
    _dist_abandon(rank, world, os.path.join(root, "d"))
    dist.barrier()
    dist_snapshot_scenarios(rank, world, os.path.join(root, "c"))  # last: it gates the background copies


def test_async_distributed_two_ranks(tmp_path):
    run_distributed(_dist_all, 2, str(tmp_path), timeout=120)


def test_stager_keeps_lazy_conj_views():
    x = torch.randn(4, dtype=torch.complex64)
    s = StateDictStager(pin_memory=False).stage({"x": x, "c": x.conj()})
    assert torch.equal(s["c"], x.conj()) and torch.equal(s["x"], x)
    assert _storage_ptr(s["c"]) == _storage_ptr(s["x"])
