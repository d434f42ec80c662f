"""Async save whose snapshot is copied while training goes on (issue 14).

The background copy is held back by a gate (``PendingCopy.run`` patched to wait for
it), so "the copy has not happened yet" is a fact of the test, not a timing: the
tests then check that the optimizer step waits for it, that forward/backward ran
before it, that early in-place modifications are detected (and never committed),
and that errors surface where async save errors always do.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
import torch.distributed as dist

import ckpt_integration as ci
from ckpt_integration import ShardedTensor
from ckpt_integration.execution import save as save_mod
from ckpt_integration.execution import snapshot as snap_mod
from ckpt_integration.execution.async_save import AsyncCallsQueue, AsyncRequest, async_save_torch_dist
from ckpt_integration.execution.staging import PendingCopy
from tests.dist_utils import scaled_timeout

BIG = (128, 1024)  # 512 KiB of float32: above the copy-now threshold, copied in the background


class Gate:
    """Holds every background copy until ``release()`` (one copy per release)."""

    def __init__(self):
        self.sem = threading.Semaphore(0)
        self.held = 0

    def release(self, n: int = 1):
        for _ in range(n):
            self.sem.release()


def _install_gate(monkeypatch=None) -> Gate:
    gate = Gate()
    real = PendingCopy.run

    def gated(self):
        gate.held += 1
        gate.sem.acquire(timeout=scaled_timeout(60))  # a broken test fails instead of hanging
        return real(self)

    if monkeypatch is not None:
        monkeypatch.setattr(PendingCopy, "run", gated)
    else:
        PendingCopy.run = gated
    return gate


@pytest.fixture
def gate(monkeypatch):
    g = _install_gate(monkeypatch)
    yield g
    g.release(100)  # never leave a copy thread waiting
    ci.wait_for_snapshot()


def _st(key, t):
    return ShardedTensor.from_rank_offsets(key, t)


def _load(path, shapes):
    return ci.load({k: _st(k, torch.empty(s)) for k, s in shapes.items()}, path)


def _model_and_opt(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(BIG[1], BIG[0]), torch.nn.BatchNorm1d(BIG[0]))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return model, opt


def _train_step(model, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss


def _state(model, opt):
    lin, bn = model[0], model[1]
    st = opt.state[lin.weight]
    return {
        "w": _st("w", lin.weight),
        "exp_avg": _st("exp_avg", st["exp_avg"]),
        "exp_avg_sq": _st("exp_avg_sq", st["exp_avg_sq"]),
        "bn_mean": _st("bn_mean", bn.running_mean),
        "iteration": 3,
    }


def _ref(model, opt):
    return {k: v.data.detach().clone() for k, v in
            [("w", model[0].weight), ("exp_avg", opt.state[model[0].weight]["exp_avg"]),
             ("exp_avg_sq", opt.state[model[0].weight]["exp_avg_sq"]), ("bn_mean", model[1].running_mean)]}


def _check_equal(path, ref):
    out = _load(path, {k: v.shape for k, v in ref.items()})
    for k, v in ref.items():
        assert torch.equal(out[k], v), k
    assert out["iteration"] == 3


# --------------------------------------------------------------------------- plain loops
def test_save_returns_before_the_copy_and_hook_lives_only_while_in_flight(gate, tmp_path):
    w = torch.randn(*BIG)
    ref = w.clone()
    assert not snap_mod.hook_installed()
    with AsyncCallsQueue() as q:
        req = async_save_torch_dist({"w": _st("w", w), "iteration": 3}, str(tmp_path / "c"), queue=q)
        # the caller is back while the copy is still held: nothing was copied in its time
        assert req.snapshot is not None and not req.snapshot_done()
        assert snap_mod.hook_installed() and snap_mod.snapshots_in_flight() == [req.snapshot]
        assert not ci.wait_for_snapshot(timeout=0)  # still in flight
        gate.release()
        assert ci.wait_for_snapshot()
        assert req.snapshot_done() and req.snapshot.sealed() and not snap_mod.hook_installed()
        w.add_(1.0)  # free to modify now
        req.wait()
    out = _load(str(tmp_path / "c"), {"w": BIG})
    assert torch.equal(out["w"], ref)


def test_optimizer_step_right_after_async_save_waits_for_the_snapshot(gate, tmp_path):
    model, opt = _model_and_opt()
    x = torch.randn(8, BIG[1])
    _train_step(model, x)
    opt.step()
    opt.zero_grad()
    ref = _ref(model, opt)
    with AsyncCallsQueue() as q:
        req = async_save_torch_dist(_state(model, opt), str(tmp_path / "c"), queue=q)
        assert not req.snapshot_done()
        _train_step(model, x)  # forward/backward overlap the copy (BatchNorm stats change here)
        assert not req.snapshot_done()
        threading.Thread(target=gate.release).start()  # the copy may run once the step is waiting
        opt.step()  # the global pre-hook waits for the snapshot before Adam modifies anything
        assert not torch.equal(model[0].weight, ref["w"])
        req.wait()
    _check_equal(str(tmp_path / "c"), ref)


@pytest.mark.parametrize("as_kwarg", [False, True])
def test_closure_runs_before_the_wait(gate, tmp_path, as_kwarg):
    model, opt = _model_and_opt()
    x = torch.randn(8, BIG[1])
    _train_step(model, x)
    opt.step()
    opt.zero_grad()
    ref = _ref(model, opt)
    seen = []

    def closure():
        seen.append(req.snapshot_done())  # forward/backward inside step() run before the wait
        opt.zero_grad()
        loss = _train_step(model, x)
        gate.release()
        return loss

    with AsyncCallsQueue() as q:
        req = async_save_torch_dist(_state(model, opt), str(tmp_path / "c"), queue=q)
        opt.step(closure=closure) if as_kwarg else opt.step(closure)
        req.wait()
    assert seen == [False]
    _check_equal(str(tmp_path / "c"), ref)


def test_small_tensors_changed_by_forward_are_copied_before_returning(gate, tmp_path):
    """BatchNorm running stats change in forward without a version bump: copied in the caller."""
    model, opt = _model_and_opt()
    model.train()
    x = torch.randn(8, BIG[1])
    _train_step(model, x)
    opt.step()
    ref = _ref(model, opt)
    v = model[1].running_mean._version
    req = ci.save(_state(model, opt), tmp_path / "c", async_sharded_save=True)
    model(x)  # updates running_mean in place ...
    assert model[1].running_mean._version == v and not torch.equal(model[1].running_mean, ref["bn_mean"])
    gate.release()  # ... without telling anyone; the snapshot still has the old values
    req.wait()
    _check_equal(str(tmp_path / "c"), ref)


def test_large_buffers_changed_by_forward_wait_for_their_copy(gate, tmp_path):
    """BatchNorm running stats of 256 KiB and more are copied in the background, and BatchNorm's kernel
    changes them without a version bump: a forward before their copy put the next step's statistics
    into the checkpoint beside this step's weights (a state that never existed), without an error. A
    module whose buffer is still being copied now waits for the copy before it runs."""
    bn = torch.nn.BatchNorm1d(BIG[0] * 512)  # (running stats of 256 KiB each)
    x = torch.randn(4, BIG[0] * 512)
    bn(x)
    ref = {"m": bn.running_mean.clone(), "v": bn.running_var.clone()}
    req = ci.save({"m": _st("m", bn.running_mean), "v": _st("v", bn.running_var), "iteration": 3}, tmp_path / "c",
                  async_sharded_save=True)
    assert not req.snapshot_done()
    threading.Timer(0.3, gate.release).start()  # (the copy is held until then)
    bn(x)  # waits in the module's forward pre-hook for the copy of its buffers
    assert req.snapshot_done() and not torch.equal(bn.running_mean, ref["m"])
    req.wait()
    out = _load(str(tmp_path / "c"), {"m": ref["m"].shape, "v": ref["v"].shape})
    assert torch.equal(out["m"], ref["m"]) and torch.equal(out["v"], ref["v"])
    assert not snap_mod.hook_installed()


def test_a_storage_freed_before_its_copy_is_copied_first_or_fails_the_save(gate, tmp_path):
    """FSDP frees parameters with ``untyped_storage().resize_(0)``. Freed right after an async save
    returned, the background copy read freed memory (a segfault in most runs) or a storage its byte
    view had grown again, zero-filled: zeros committed, verified clean. The resize now waits for the
    copy; a storage resized without that wait (torch's own method) fails the save naming the key and
    is not grown again."""
    w = torch.randn(*BIG)
    ref = w.clone()
    req = ci.save({"w": _st("w", w), "iteration": 3}, tmp_path / "a", async_sharded_save=True)
    threading.Timer(0.3, gate.release).start()  # (the copy is held until then)
    w.untyped_storage().resize_(0)  # waits for the copy
    assert req.snapshot_done() and w.untyped_storage().nbytes() == 0
    req.wait()
    assert torch.equal(_load(str(tmp_path / "a"), {"w": BIG})["w"], ref)
    v = torch.randn(*BIG)
    req = ci.save({"v": _st("v", v), "iteration": 3}, tmp_path / "b", async_sharded_save=True)
    torch._C.StorageBase.resize_(v.untyped_storage(), 0)
    gate.release()
    with pytest.raises(ci.errors.SnapshotModifiedError, match=r": v\b"):
        req.wait()
    assert v.untyped_storage().nbytes() == 0 and not (tmp_path / "b" / "metadata.json").exists()
    assert not snap_mod.hook_installed() and "resize_" not in torch.UntypedStorage.__dict__


def test_common_state_tensors_modified_early_are_named_by_their_keys(gate, tmp_path):
    """Common-state tensors modified before their copy were named by their shape only, and two of one
    shape counted once ("2 tensor(s)" for 3)."""
    st = {"w": _st("w", torch.randn(*BIG)), "ema": {"a": torch.zeros(BIG[0] * 512), "b": torch.zeros(BIG[0] * 512)},
          "buf": torch.zeros(70000), "iteration": 3}
    req = ci.save(st, tmp_path / "c", async_sharded_save=True)
    for t in (st["ema"]["a"], st["ema"]["b"], st["buf"]):
        t.add_(1)
    gate.release(10)
    with pytest.raises(ci.errors.SnapshotModifiedError,
                       match=r"3 tensor\(s\).*common state 'buf', common state 'ema\.a', common state 'ema\.b'"):
        req.wait()


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_in_place_change_during_the_snapshot_fails_the_save_loudly(gate, tmp_path, max_in_flight):
    """An in-place change before the snapshot fails the save, once: the next save copies those tensors before
    returning, whichever slot of the queue it takes (each slot learned on its own: ``max_in_flight`` failed)."""
    w, small = torch.randn(*BIG), torch.randn(16)
    with AsyncCallsQueue(max_in_flight=max_in_flight) as q:
        req = async_save_torch_dist({"w": _st("w", w), "small": _st("small", small), "iteration": 3},
                                    str(tmp_path / "bad"), queue=q)
        w.mul_(2.0)  # in place, outside any optimizer, before the copy: the copy would be newer (or torn)
        gate.release()
        with pytest.raises(ci.errors.SnapshotModifiedError, match=r"in place.*: w\b.*snapshot=\"caller\""):
            req.wait()  # (the message says how to save such a model: copies made before the save returns)
        assert not (tmp_path / "bad" / "metadata.json").exists()
        assert q.stagers[0].stats.copy_now_learned == 1
        # the next save copies `w` before returning, so the same pattern now works
        ref = w.clone()
        req = async_save_torch_dist({"w": _st("w", w), "small": _st("small", small), "iteration": 3},
                                    str(tmp_path / "good"), queue=q)
        assert req.snapshot is None  # nothing left to copy in the background
        w.mul_(2.0)
        req.wait()
    out = _load(str(tmp_path / "good"), {"w": BIG})
    assert torch.equal(out["w"], ref)


def test_change_during_the_copy_that_bypasses_version_counters_fails_the_save(gate, tmp_path, monkeypatch):
    """Another thread's kernel (here: a write through the raw storage, no version counter moves)
    changes a tensor while its copy runs, after its first half was copied: the staged copy would
    mix two states, one that never existed. The copy is compared with its source right after it
    is made: the save fails loudly, nothing is committed, and the fingerprint the checkpoint of
    the next save records is that of its staged bytes (the load checks it)."""
    from ckpt_integration.execution.staging import StateDictStager

    w = torch.randn(*BIG)
    real_copy = StateDictStager._copy

    def copy_then_race(self, groups, background=False, events=None):
        real_copy(self, groups, background, events)
        if background:  # "during" the copy: after its bytes were copied, before it ended
            raw = torch.empty(0).set_(w.untyped_storage(), 0, (w.numel(),), (1,))
            raw.view(torch.uint8)[:4] ^= 0xFF  # through the storage: w._version does not move
    monkeypatch.setattr(StateDictStager, "_copy", copy_then_race)
    version = w._version
    with AsyncCallsQueue() as q:
        req = async_save_torch_dist({"w": _st("w", w), "iteration": 3}, str(tmp_path / "torn"), queue=q)
        gate.release()
        with pytest.raises(ci.errors.SnapshotModifiedError, match=r"copy differs from them.*: w\b"):
            req.wait()
        assert w._version == version
        assert not (tmp_path / "torn" / "metadata.json").exists()
        monkeypatch.setattr(StateDictStager, "_copy", real_copy)
        ref = w.clone()
        req = async_save_torch_dist({"w": _st("w", w), "iteration": 3}, str(tmp_path / "good"), queue=q)
        gate.release()
        req.wait()
    out = ci.load({"w": _st("w", torch.empty(BIG))}, str(tmp_path / "good"), verify_state=True)
    assert torch.equal(out["w"], ref)


def test_change_after_the_copy_without_waiting_is_caught_before_the_commit(gate, tmp_path, monkeypatch):
    """Nobody waited; the writer's check before the commit sees the change (it cannot tell when it happened)."""
    write_gate = threading.Event()
    real_write = save_mod.write_data_files

    def gated_write(*a, **k):
        write_gate.wait(scaled_timeout(60))
        return real_write(*a, **k)

    monkeypatch.setattr(save_mod, "write_data_files", gated_write)
    w = torch.randn(*BIG)
    with AsyncCallsQueue() as q:
        req = async_save_torch_dist({"w": _st("w", w)}, str(tmp_path / "c"), queue=q)
        gate.release()
        req.snapshot._copied.wait(scaled_timeout(60))  # copied, but not checked by this thread
        w.add_(1.0)
        write_gate.set()
        req._event.wait(scaled_timeout(60))  # the writer finished (and failed) first
        with pytest.raises(ci.errors.SnapshotModifiedError, match="before the commit"):
            req.wait()
    assert not (tmp_path / "c" / "metadata.json").exists()


def test_copy_failure_is_raised_by_the_queue_not_by_the_wait(monkeypatch, tmp_path):
    def boom(self):
        try:
            raise RuntimeError("injected copy failure")
        finally:
            self.done.set()

    monkeypatch.setattr(PendingCopy, "run", boom)
    model, opt = _model_and_opt()
    x = torch.randn(8, BIG[1])
    _train_step(model, x)
    opt.step()
    q = AsyncCallsQueue()
    req = async_save_torch_dist(_state(model, opt), str(tmp_path / "bad"), queue=q)
    assert ci.wait_for_snapshot()  # does not raise: a rank must not raise alone
    _train_step(model, x)
    opt.step()  # nor does the optimizer hook
    with pytest.raises(RuntimeError, match="injected copy failure"):
        req.wait()
    assert not (tmp_path / "bad" / "metadata.json").exists()
    # raised once more by the next save on the queue when not waited for, then the queue works again
    req = async_save_torch_dist(_state(model, opt), str(tmp_path / "bad2"), queue=q)
    with pytest.raises(RuntimeError, match="injected copy failure"):
        async_save_torch_dist(_state(model, opt), str(tmp_path / "never"), queue=q)
    monkeypatch.undo()
    ref = _ref(model, opt)
    async_save_torch_dist(_state(model, opt), str(tmp_path / "good"), queue=q).wait()
    q.close()
    _check_equal(str(tmp_path / "good"), ref)
    assert not snap_mod.hook_installed()


def test_snapshot_caller_mode_copies_everything_before_returning(gate, tmp_path):
    w = torch.randn(*BIG)
    ref = w.clone()
    with AsyncCallsQueue(snapshot="caller") as q:
        req = async_save_torch_dist({"w": _st("w", w)}, str(tmp_path / "c"), queue=q)
        assert req.snapshot is None and req.snapshot_done() and gate.held == 0
        w.add_(1.0)
    assert torch.equal(_load(str(tmp_path / "c"), {"w": BIG})["w"], ref)
    with pytest.raises(ValueError, match="snapshot"):
        AsyncCallsQueue(snapshot="later")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_writer_thread_runs_at_lower_priority():
    seen = []

    def record():
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with AsyncCallsQueue(writer_nice=5) as q:
        q.schedule_async_request(AsyncRequest(record))
    with AsyncCallsQueue(writer_nice=0) as q:
        q.schedule_async_request(AsyncRequest(record))
    assert seen == [min(19, mine + 5), mine]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller is untouched


# --------------------------------------------------------------------------- two ranks
def dist_snapshot_scenarios(rank, world, root):
    gate = _install_gate()
    torch.manual_seed(rank)
    w = torch.nn.Parameter(torch.randn(*BIG))
    opt = torch.optim.SGD([w], lr=0.5, momentum=0.9)
    w.grad = torch.ones_like(w)
    opt.step()

    def state():
        return {"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world)),
                "mom": ShardedTensor.from_rank_offsets("mom", opt.state[w]["momentum_buffer"], (0, rank, world))}

    q = AsyncCallsQueue()
    # 1) optimizer step right after the save, on both ranks: the checkpoint is the pre-step state
    ref = (w.detach().clone(), opt.state[w]["momentum_buffer"].clone())
    req = async_save_torch_dist(state(), os.path.join(root, "a"), queue=q)
    t = torch.ones(1)
    dist.all_reduce(t)  # training collectives go on meanwhile
    threading.Thread(target=gate.release).start()
    opt.step()
    req.wait()
    # 2) an early in-place change on rank 1 only: every rank fails, nothing is committed
    req = async_save_torch_dist(state(), os.path.join(root, "b"), queue=q)
    if rank == 1:
        with torch.no_grad():
            w.mul_(0.5)
    gate.release()
    with pytest.raises(Exception, match=r"modified in place.*: w\b"):
        req.wait()
    q.close()
    dist.barrier()
    assert not os.path.exists(os.path.join(root, "b", "metadata.json"))
    rows = BIG[0]
    out = ci.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(*BIG), (0, rank, world)),
                   "mom": ShardedTensor.from_rank_offsets("mom", torch.empty(*BIG), (0, rank, world))},
                  os.path.join(root, "a"))
    assert out["w"].shape[0] == rows
    assert torch.equal(out["w"], ref[0]) and torch.equal(out["mom"], ref[1])

# (run by tests/test_async.py::test_async_distributed_two_ranks, in the same 2-rank launch)
