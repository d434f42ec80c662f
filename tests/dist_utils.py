"""Run a test function on N gloo ranks in separate processes, with a hard deadline.

``run_distributed(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on
every rank after ``init_process_group("gloo")``; an exception on any rank fails
the test with that rank's traceback; a hang fails at the deadline and kills the
processes, so a broken collective cannot hang CI. The ranks are forked from a server that
has imported torch, ckpt_integration, Lightning and Megatron-Core once (tests/forked.py), and
run with the test process's environment at the call.

Deadlines are measured, not fixed: ``timeout`` is the work budget on an unloaded
machine, stretched by the slowdown measured now (:func:`slowdown`, by the ranks once
started), so a busy machine (2 cores shared by
several test runs) does not turn a slow run into a failure, and a hang is still caught.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The start of the ranks (fork, connecting) gets this long before it counts as a hang.
STARTUP_LIMIT_S = 600.0


def slowdown(probe_cpu_s: float = 0.05) -> float:
    """How many times slower than on an idle machine work runs right now (>= 1).

    A busy loop of ``probe_cpu_s`` CPU seconds: its wall-clock time over its CPU time is the
    share of a core this process gets. Independent of the machine's speed.
    """
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    while time.thread_time() - cpu0 < probe_cpu_s:
        pass
    return max(1.0, (time.perf_counter() - wall0) / max(time.thread_time() - cpu0, 1e-9))


def scaled_timeout(budget_s: float) -> float:
    """A deadline for work that takes up to ``budget_s`` on an idle machine, scaled by :func:`slowdown`."""
    return budget_s * slowdown()


def _entry(rank, world_size, port, fn, args, errq, readyq=None, env=None, parent=None):
    # Own process group per rank: a timeout kills the rank and anything it started.
    os.setpgrp()
    if env is not None:  # the test process's environment and output now (the fork server's are older)
        from tests.forked import adopt_environment, adopt_output

        adopt_environment(env)
        adopt_output(parent)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    if readyq is not None:
        # forked with its modules imported, a rank starts in no time: the load now is the measure
        readyq.put((rank, slowdown()))
    try:
        # generous: only a hang; run_distributed's measured deadline stops slow runs
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=STARTUP_LIMIT_S)
        )
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size, *args, timeout: float = 180.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    ``timeout``: seconds the ranks may take after start-up on an idle machine; the deadline is
    that budget times the slowdown the ranks measured during their own start-up (the start-up
    itself may take :data:`STARTUP_LIMIT_S`).
    """
    from tests.forked import context

    ctx = context()  # ranks forked from a server that has imported torch, Lightning, ... once
    errq = ctx.SimpleQueue()
    readyq = ctx.SimpleQueue()
    port = free_port()
    pc = mp.start_processes(
        _entry, args=(world_size, port, fn, args, errq, readyq, dict(os.environ), os.getpid()), nprocs=world_size,
        join=False,
        start_method="forkserver"
    )
    deadline = time.monotonic() + STARTUP_LIMIT_S
    ready: dict = {}
    limit = f"start within {STARTUP_LIMIT_S:.0f}s"
    try:
        while True:
            while len(ready) < world_size and not readyq.empty():
                rank, factor = readyq.get()
                ready[rank] = factor
                if len(ready) == world_size:
                    factor = max(1.0, *ready.values())
                    deadline = time.monotonic() + timeout * factor
                    limit = f"finish within {timeout}s x {factor:.1f} (slowdown measured at start-up)"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"distributed test did not {limit}")
            try:
                if pc.join(timeout=min(remaining, 1.0)):
                    break
            except mp.ProcessRaisedException as e:
                errors = []
                while not errq.empty():
                    errors.append(errq.get())
                detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors)) or str(e)
                raise AssertionError(f"a rank failed:\n{detail}") from None
            except mp.ProcessExitedException as e:
                raise AssertionError(f"a rank died: {e}") from None
    finally:
        for p in pc.processes:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the rank and its children (e.g. writer processes)
            except (ProcessLookupError, PermissionError):
                pass
            if p.is_alive():
                p.kill()
            p.join(5)
