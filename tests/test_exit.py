"""A job that saves (or loads) and exits: the last lines of most training scripts.

Each case is a plain script on 2 gloo ranks, run 2 to 14 times (see ``RUNS``), and the exit
code of every run is checked: nothing of the library may be left running or half-finished
when ``save``/``load``/an async save's commit return or when the interpreter exits (a
thread inside a collective or a tensor copy at teardown aborts the process with SIGABRT,
``terminate called without an active exception``).

``save`` then exit without ``destroy_process_group()`` aborted one rank in 2 of 8 runs here (issue 23.0):
the gloo worker thread that ran the save's last broadcast still held its tensors when the helper
returned; their Python objects were dropped, so the worker freed them itself, needed the GIL while
the interpreter was finalizing, and was torn down inside a destructor (core dump: ``~AsyncBroadcastWork``
-> ``THPVariable_dealloc`` -> ``take_gil`` -> ``pthread_exit`` -> ``std::terminate``). The helpers now
return only once the worker let go (``dist.settle``), checked directly by the last test here. The worker
lets go in two steps, its C++ reference, then (under the GIL) its reference to the Python object; waiting
for the first only still aborted about 1 run in 100 (issue 37, the same core dump: CI failed once on this
file's ``save_no_destroy``), so ``settle`` waits for both.

The async cases failed before the library's async commits ran on a group of its own:
``destroy_process_group()`` right after ``save(..., async_sharded_save=True)`` tore the
commit's group down, and the save was lost with a message about an "internal error".
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.dist_utils import free_port, scaled_timeout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HEADER = """
import os, sys, torch, torch.distributed as dist
import ckpt_integration as ci
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
path = sys.argv[1]
def state(fill=True):
    a = torch.arange(64 * 64, dtype=torch.float32).view(64, 64)[rank * 32:(rank + 1) * 32] if fill else torch.empty(32, 64)
    b = torch.arange(16.0) if fill else torch.empty(16)
    return {"a": ci.ShardedTensor.from_rank_offsets("a", a.clone(), (0, rank, world)),
            "b": ci.ShardedTensor.from_rank_offsets("b", b, replica_id=rank), "step": 7}
"""

SCRIPTS = {
    # the plain pattern: save, tear the process group down, exit (no barrier after the save)
    "save": "ci.save(state(), path)\ndist.destroy_process_group()\n",
    # ... or without destroy_process_group(): the process groups are torn down with the interpreter
    "save_no_destroy": "ci.save(state(), path)\n",
    "load": (
        "out = ci.load(state(False), path)\n"
        "assert torch.equal(out['a'], state()['a'].data) and out['step'] == 7\n"
        "dist.destroy_process_group()\n"
    ),
    "load_no_destroy": (
        "out = ci.load(state(False), path)\n"
        "assert torch.equal(out['a'], state()['a'].data) and out['step'] == 7\n"
    ),
    # an async save, the process group destroyed before wait(), exit: the exit handler finishes it
    "async_destroy": "req = ci.save(state(), path, async_sharded_save=True)\ndist.destroy_process_group()\n",
    # an async save and exit without wait() nor destroy_process_group(); 2 writer threads: the save
    # hands its files to a thread pool, which Python shuts down before atexit handlers run
    "async_exit": "req = ci.save(state(), path, async_sharded_save=True, thread_count=2)\n",
    # rank 1 leaves without letting the save finish: rank 0's commit must say so
    "async_abandon": textwrap.dedent("""
        req = ci.save(state(), path, async_sharded_save=True)
        if rank == 1:
            os._exit(0)
        try:
            req.wait()
        except ci.errors.AsyncSaveAbandonedError as e:
            print("ABANDONED:", e, flush=True)
            os._exit(0)
        raise SystemExit("the abandoned save did not fail")
    """),
    # the same without wait(), after destroy_process_group() on the rank that stays: its exit handler
    # must log what happened (abandoned, why, that nothing was committed), not an "internal error"
    "async_destroy_abandon": textwrap.dedent("""
        req = ci.save(state(), path, async_sharded_save=True)
        if rank == 1:
            os._exit(0)
        dist.destroy_process_group()
    """),
}


def _script(tmp_path, case: str):
    script = tmp_path / f"{case}.py"
    script.write_text(HEADER + SCRIPTS[case])
    return script


def _env() -> dict:
    # PYTHONFAULTHANDLER: a rank that aborts prints every thread's Python stack first, so a rare abort
    # in a suite run says where each thread was (the failure message carries the output's tail)
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
            "PYTHONFAULTHANDLER": "1"}


def _run(tmp_path, case: str, ckpt: str, timeout_s: float = 120.0):
    """One run of ``case`` under ``torchrun`` (2 ranks)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(_script(tmp_path, case)), ckpt]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=scaled_timeout(timeout_s))


def _run_direct(tmp_path, case: str, ckpt: str, timeout_s: float = 120.0):
    """One run of ``case`` as 2 rank processes started directly, with the variables torchrun sets:
    the same exit, without the launcher's own interpreter (3.5 s a run here instead of 5)."""
    script, port = _script(tmp_path, case), free_port()
    procs = []
    for r in range(2):
        env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r), "WORLD_SIZE": "2",
               "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}
        procs.append(subprocess.Popen([sys.executable, str(script), ckpt], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    outs, codes = [], []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=scaled_timeout(timeout_s))
            outs.append(out)
            codes.append(p.returncode)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    return subprocess.CompletedProcess(script, next((c for c in codes if c), 0), "".join(outs), "")


def _assert_clean(proc, what: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{what}: exit code {proc.returncode}\n{out[-3000:]}"
    assert "terminate called" not in out and "SIGABRT" not in out, f"{what}:\n{out[-3000:]}"
    assert "internal error" not in out and "save failed" not in out, f"{what}:\n{out[-3000:]}"


def _load_whole(path: str) -> dict:
    import ckpt_integration as ci

    req = {"a": ci.ShardedTensor.from_rank_offsets("a", torch.empty(64, 64)),
           "b": ci.ShardedTensor.from_rank_offsets("b", torch.empty(16))}
    return ci.load(req, path)


def _check_checkpoint(path: str) -> None:
    out = _load_whole(path)
    assert torch.equal(out["a"], torch.arange(64 * 64, dtype=torch.float32).view(64, 64))
    assert torch.equal(out["b"], torch.arange(16.0)) and out["step"] == 7


# Runs per case. ``save_no_destroy`` is the pattern that aborted in 2 of 8 runs before the fix
# (issue 23.0): 14 runs, which a 20% abort rate passes with probability 0.8 ** 14 = 4.4%. The other
# cases that exit with a process group up run 4 times, the ones after ``destroy_process_group()``
# (whose backend threads are joined before the exit: 0 aborts in 16 runs with the fix switched
# off) 2 times. 14 runs of every case took 319 s here and the suite 918 s (over its 15 minutes):
# the long form is ``benchmarks/exit_stress.py --runs N [--burn auto]``. The first run of a case
# goes through torchrun, the others start the 2 ranks directly (same variables, 3.5-4.5 s a run
# instead of 5). With ``dist.settle`` switched off, ``save_no_destroy`` aborted in 2 of 16 direct
# runs here, and in 0 of 42 in another pass (the rate depends on the machine's timing); runs forked
# from one interpreter, a third as costly, never aborted (0 of 40). The deterministic check of the
# mechanism is the last test of this file.
RUNS = 14
RUNS_OTHER = 4
RUNS_AFTER_DESTROY = 2


def _repeat(tmp_path, case: str, runs: int, ckpt_of, check=None) -> None:
    for i in range(runs):
        ck = ckpt_of(i)
        proc = (_run if i == 0 else _run_direct)(tmp_path, case, ck)
        _assert_clean(proc, f"{case} run {i}")
        if check is not None:
            check(ck)


@pytest.mark.parametrize("case,runs", [("save", RUNS_AFTER_DESTROY), ("save_no_destroy", RUNS)])
def test_save_then_exit_exits_cleanly_every_time(tmp_path, case, runs):
    _repeat(tmp_path, case, runs, lambda i: str(tmp_path / f"ck{i}"), _check_checkpoint)


@pytest.mark.parametrize("case,runs", [("load", RUNS_AFTER_DESTROY), ("load_no_destroy", RUNS_OTHER)])
def test_load_then_exit_exits_cleanly_every_time(tmp_path, case, runs):
    ck = str(tmp_path / "ck")
    _assert_clean(_run_direct(tmp_path, "save", ck), "the save to load from")
    _repeat(tmp_path, case, runs, lambda i: ck)


@pytest.mark.parametrize("case", ["async_destroy", "async_exit"])
def test_async_save_survives_destroy_process_group_and_exit(tmp_path, case):
    # async_destroy: the default group destroyed before wait(), committed by the exit handler on the
    # save's own group (which the interpreter tears down); async_exit: no wait() nor
    # destroy_process_group(). Either way nothing is lost
    _repeat(tmp_path, case, RUNS_OTHER, lambda i: str(tmp_path / f"a{i}"), _check_checkpoint)


def test_async_save_abandoned_by_a_rank_says_so(tmp_path):
    ck = tmp_path / "abandoned"
    proc = _run(tmp_path, "async_abandon", str(ck))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "ABANDONED:" in out and str(ck) in out and "internal error" not in out, out[-3000:]
    assert not (ck / "metadata.json").exists()  # nothing committed
    # no wait(), the default group destroyed first: logged at exit, truthfully (issue 23 item 0: the
    # log called it "internal error: chunks of ['a'] were written but no rank planned them")
    ck = tmp_path / "abandoned_after_destroy"
    proc = _run(tmp_path, "async_destroy_abandon", str(ck))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"the async save to {ck} was abandoned on rank 0" in out, out[-3000:]
    assert "called destroy_process_group() before wait()/close()" in out and "Nothing was committed there" in out, out[-3000:]
    assert "internal error" not in out and "terminate called" not in out, out[-3000:]
    assert not (ck / "metadata.json").exists() and not any(ck.glob("*.distcp"))  # nothing committed, partial files removed


def _private_group_lifetime(rank, world, tmp):
    import torch.distributed as dist

    import ckpt_integration as ci
    from ckpt_integration.execution import dist as cdist
    from ckpt_integration.execution.async_save import AsyncCallsQueue

    q = AsyncCallsQueue()
    t = torch.full((4,), float(rank))
    req = ci.save({"t": ci.ShardedTensor.from_rank_offsets("t", t, (0, rank, world))}, f"{tmp}/ck",
                  async_sharded_save=True, async_queue=q)
    group = q.private_group(None)
    assert isinstance(group, cdist.PrivateGroup) and group.size() == world
    assert group not in dist.distributed_c10d._world.pg_map  # not torch's: destroy_process_group leaves it
    req.wait()
    # a new default group after destroy_process_group() gets a private group of its own (before:
    # the queue handed out the old world's group, keyed by "the default group")
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store2", world), rank=rank, world_size=world)
    again = q.private_group(None)
    assert again is not group and isinstance(again, cdist.PrivateGroup) and again.size() == world
    assert list(cdist.all_reduce_ints([rank], "sum", again)) == [sum(range(world))]
    assert q.private_group(None) is again
    q.close()
    assert group.closed and again.closed
    with pytest.raises(cdist.GroupClosedError):
        cdist.all_reduce_ints([1], "max", group)


def test_private_group_is_closed_with_its_queue(tmp_path):
    from tests.dist_utils import run_distributed

    run_distributed(_private_group_lifetime, 2, str(tmp_path))


def _backend_lets_go_of_every_tensor(rank, world, tmp):
    """After each collective helper returns, the process group's worker threads hold none of the tensors
    it was given, neither in C++ nor their Python objects: every one is already freed, by this thread.
    A worker that frees one itself needs the GIL, which it cannot take during the interpreter's teardown:
    the process aborts (``terminate called without an active exception``). Measured before the fixes: the
    gloo worker still held the tensor after 20-28 % of small broadcasts had returned (issue 23.0); and,
    once the helpers waited until its C++ reference was gone, it still held the Python object, to be
    released under the GIL a moment later, after about 2 % (issue 37: 1 run in 60-150 of ``save`` then
    exit aborted, the worker inside ``THPVariable_dealloc``)."""
    import weakref

    import torch.distributed as dist

    from ckpt_integration.execution import dist as cdist

    given = []  # weak references: a strong one would keep them alive, and count as "held" in settle

    def recording(fn):
        def call(*args, **kwargs):
            for a in list(args) + list(kwargs.values()):
                if isinstance(a, torch.Tensor):
                    given.append(weakref.ref(a))
                elif isinstance(a, (list, tuple)):
                    given.extend(weakref.ref(x) for x in a if isinstance(x, torch.Tensor))
            return fn(*args, **kwargs)
        return call

    class Recorder:  # the private group's backend, recording what it is handed
        def __init__(self, pg):
            self.pg = pg

        def __getattr__(self, name):
            return recording(getattr(self.pg, name)) if name != "barrier" else getattr(self.pg, name)

    names = ("broadcast", "all_gather", "all_to_all_single", "all_reduce", "gather")
    saved = {n: getattr(dist, n) for n in names}
    for n in names:
        setattr(dist, n, recording(saved[n]))
    private = cdist.new_private_group(None)
    real_backend = cdist.PrivateGroup.backend
    cdist.PrivateGroup.backend = lambda self: Recorder(real_backend(self))
    try:
        alive = 0
        for i in range(200):
            for group in (None, private):
                calls = [lambda: cdist.broadcast_object({"i": i}, src=0, group=group),
                         lambda: cdist.all_gather_object(i, group=group),
                         lambda: cdist.all_reduce_ints([i, rank], "max", group=group),
                         lambda: cdist.gather_object(i, dst=0, group=group),
                         lambda: cdist.all_to_all_bytes({r: b"x" * (i + r) for r in range(world)}, group=group)]
                for call in calls:
                    given.clear()
                    call()  # (checked at once: no GIL released since the helper returned)
                    assert given, "nothing recorded"
                    alive += sum(1 for ref in given if ref() is not None)
        assert alive == 0, f"rank {rank}: {alive} tensors were still held by the process group after the helpers returned"
    finally:
        for n in names:
            setattr(dist, n, saved[n])
        cdist.PrivateGroup.backend = real_backend
        private.close()


def test_collective_helpers_return_after_the_backend_let_go_of_their_tensors(tmp_path):
    from tests.dist_utils import run_distributed

    run_distributed(_backend_lets_go_of_every_tensor, 2, str(tmp_path))
