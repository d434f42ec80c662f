"""Run a test function on N gloo ranks in spawned processes, with a hard timeout.

``run_distributed(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on
every rank after ``init_process_group("gloo")``; an exception on any rank fails
the test with that rank's traceback; a hang fails after ``timeout`` seconds and
kills the processes, so a broken collective cannot hang CI.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, errq):
    # Own process group per rank: a timeout kills the rank and anything it started.
    os.setpgrp()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
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
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    port = free_port()
    pc = mp.start_processes(
        _entry, args=(world_size, port, fn, args, errq), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while True:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                raise TimeoutError(f"distributed test did not finish within {timeout}s")
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
