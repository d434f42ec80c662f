"""Helpers of the benchmarks: peak memory from /proc (stdlib only), page-cache eviction, free ports."""

from __future__ import annotations

import os
import socket
from typing import Any, Optional


# --------------------------------------------------------------------------- memory helpers
def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_bytes() -> int:
    v = _status_kib("VmRSS")
    if v is not None:
        return v * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_bytes() -> int:
    v = _status_kib("VmHWM")
    if v is not None:
        return v * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _drop_cache(directory: str) -> None:
    """Evict the files' pages (for disk targets) so reads really read; no-op on tmpfs."""
    if not hasattr(os, "posix_fadvise"):
        return
    for root, _, files in os.walk(directory):
        for n in files:
            try:
                fd = os.open(os.path.join(root, n), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


def _is_tmpfs(path: str) -> bool:
    try:
        best, fstype = "", ""
        rp = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                if (rp == mnt or rp.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, fstype = mnt, parts[2]
        return fstype in ("tmpfs", "ramfs")
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- phase scripts
# (load_phases.py and save_phases.py: the same state, the same timers, the same ranks)


def timed(timings: dict, name: str, fn):
    """``fn`` with its wall time added to ``timings[name]`` at every call."""
    import time

    def inner(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            timings[name] += time.perf_counter() - t0

    return inner


def add_state_args(p) -> None:
    """The arguments describing each rank's state (and where it goes) of the phase scripts."""
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--mib", type=int, default=512, help="state per rank (MiB)")
    p.add_argument("--tensors", type=int, default=32)
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--small", type=int, default=0, metavar="N", help="N tensors of --small-bytes per rank instead")
    p.add_argument("--small-bytes", type=int, default=4096)
    p.add_argument("--dir", default="/dev/shm")


def start_rank(rank: int, world: int, port: int, args) -> list:
    """A gloo rank of a phase script (one node, as torchrun would say) and its state: ``--small``
    tensors of ``--small-bytes``, or ``--tensors`` tensors of ``--cols`` columns making ``--mib``."""
    import datetime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    if args.small:
        return [torch.rand(args.small_bytes // 4) for _ in range(args.small)]
    per = args.mib * (1 << 20) // args.tensors // (args.cols * 4)
    return [torch.rand(per, args.cols) for _ in range(args.tensors)]


def all_gather(obj: Any) -> list:
    """Every rank's ``obj`` (collective), gathered with the library's helper: it waits until gloo's
    worker threads have let go of its tensors. ``torch.distributed.all_gather_object`` does not, and
    a tensor such a thread frees after the interpreter began to exit aborts the process
    ("terminate called without an active exception"): a benchmark's last gather is followed by
    exactly that exit."""
    from ckpt_integration.execution import dist as cdist

    return cdist.all_gather_object(obj)


def with_slowest(rec: dict, world: int) -> dict:
    """``rec`` (one run's timings on this rank) with ``total_max``: the slowest rank's ``total``
    (collective: every rank calls it once per run)."""
    allrec = all_gather(rec)
    rec["total_max"] = max(r["total"] for r in allrec)
    return rec


def keep_best(best: dict, rec: dict) -> None:
    """Each of ``rec``'s timings into ``best`` where it is the lowest so far."""
    for k, v in rec.items():
        best[k] = min(best.get(k, v), v)


def write_per_rank(best: dict, world: int, rank: int, out_path: str) -> None:
    """Every rank's ``best`` into ``out_path`` (JSON list by rank, written by rank 0; collective)."""
    import json

    import torch.distributed as tdist

    allbest = all_gather(best)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(allbest, f)
    tdist.barrier()


def run_ranks(worker, args) -> list:
    """``worker(rank, world, port, args, out_path)`` on ``args.ranks`` spawned processes; what they
    wrote with :func:`write_per_rank`."""
    import json
    import tempfile

    import torch.multiprocessing as mp

    out = tempfile.mktemp(suffix=".json")
    mp.start_processes(worker, args=(args.ranks, _free_port(), args, out), nprocs=args.ranks, start_method="spawn")
    with open(out) as f:
        per_rank = json.load(f)
    os.unlink(out)
    return per_rank


def print_phase_table(title: str, columns: list, rows: list, n: int) -> None:
    """A markdown table of phase timings: a row per ``(key, label)`` of ``rows``, a column per
    ``(name, timings)`` of ``columns``; seconds, or microseconds per tensor with ``n`` tensors.
    ``title`` is the first header cell, with ``{unit}`` where the unit goes."""
    unit = "us/tensor" if n else "seconds"
    scale = (lambda v: f"{1e6 * v / n:.1f}") if n else (lambda v: f"{v:.4f}")
    print(f"| {title.format(unit=unit)} | " + " | ".join(name for name, _ in columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for k, label in rows:
        print(f"| {label} | " + " | ".join(scale(b.get(k, 0.0)) for _, b in columns) + " |")
