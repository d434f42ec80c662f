#!/usr/bin/env python
"""What a resharded load pays per page of the page cache, on one core: the floor under ``row->col``.

A load that changes the split axis (rows saved, columns loaded) needs half of every stored row,
so on one node each rank touches every page of the checkpoint once: the pages whose blocks it
checks (read-once: mapped, digested, its half copied out) and the pages another rank checked (its
half copied out of the shared mapping). A same-layout load touches only its own half, with
``preadv`` into the destination. This script times each of those steps on one file (``--mib``,
rows of ``--row-bytes``), best of ``--repeats``, so that the ``map`` and ``copy`` phases of
``bench.py`` / ``load_phases.py --layout row_to_col`` can be read against what the kernel and
the memory allow here:

* ``preadv``: the region into a buffer in 2 MiB pieces (a same-layout read);
* ``preadv + digest``: the same, each piece's 1 MiB blocks hashed right after (XXH3-64, as saved);
* ``map own unit``: map (``MADV_POPULATE_READ``), digest from the mapping, copy half of each row
  out, unmap: a unit this rank checks in a read-once load;
* ``map other's unit``: map, copy half of each row out, unmap: a unit another rank of the node
  checked (with the time of each step, and again with page faults instead of populating);
* ``preadv, half rows``: no mapping: ``preadv`` with one destination per half row and a reused
  scratch buffer for the other half (the kernel copies every byte);
* ``hand-off``: the design not built: the checking rank maps its unit, digests it, copies its half
  out and the other rank's half into shared memory both keep mapped, the other rank copies that
  half out of there (steps: the checking rank's part / the other rank's part).

    python benchmarks/page_costs.py --dir /dev/shm --mib 256
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import tempfile
import time
import warnings
from typing import Callable, Dict, List, Tuple

import numpy as np
import torch
import xxhash

warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
PIECE, BLOCK = 2 << 20, 1 << 20


def _best(fn: Callable[[], Tuple[float, ...]], repeats: int) -> Tuple[float, ...]:
    return min((fn() for _ in range(repeats)), key=sum)


def measure(path: str, nbytes: int, row_bytes: int, repeats: int) -> Dict[str, Tuple[float, ...]]:
    """Seconds per step of each method over the first ``nbytes`` of ``path`` (see the module doc)."""
    fd = os.open(path, os.O_RDONLY)
    rows, half = nbytes // row_bytes, row_bytes // 2
    dest = torch.ones(rows, half // 4, dtype=torch.float32)  # half of each row (float32 columns)
    buf = torch.ones(nbytes, dtype=torch.uint8)
    bmv = memoryview(buf.numpy())
    digest = xxhash.xxh3_64_intdigest

    def pread(check: bool) -> Tuple[float, ...]:
        t0 = time.perf_counter()
        for i in range(0, nbytes, PIECE):
            os.preadv(fd, [bmv[i : i + PIECE]], i)
            if check:
                for j in range(i, min(nbytes, i + PIECE), BLOCK):
                    digest(bmv[j : j + BLOCK])
        return (time.perf_counter() - t0,)

    def mapped(check: bool, populate: bool) -> Tuple[float, ...]:
        t0 = time.perf_counter()
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        if populate:
            mm.madvise(POPULATE_READ)
        t1 = time.perf_counter()
        whole = memoryview(mm)
        src = torch.from_numpy(np.ndarray((rows, row_bytes // 4), dtype=np.float32, buffer=mm))
        per = max(1, PIECE // row_bytes)
        for r in range(0, rows, per):
            if check:
                for j in range(r * row_bytes, min(nbytes, (r + per) * row_bytes), BLOCK):
                    digest(whole[j : j + BLOCK])
            dest[r : r + per].copy_(src[r : r + per, : half // 4])
        del src
        whole.release()
        t2 = time.perf_counter()
        mm.close()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    # a hand-off through shared memory instead of a second mapping: the checking rank copies the
    # other rank's half into a buffer both keep mapped (made and touched once, as a ring would be),
    # the other rank copies it out of there
    ring = mmap.mmap(-1, nbytes // 2, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    shared = torch.from_numpy(np.ndarray((rows, half // 4), dtype=np.float32, buffer=ring))
    shared.fill_(0)
    other = torch.ones_like(dest)

    def hand_off() -> Tuple[float, ...]:
        t0 = time.perf_counter()
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        mm.madvise(POPULATE_READ)
        whole = memoryview(mm)
        src = torch.from_numpy(np.ndarray((rows, row_bytes // 4), dtype=np.float32, buffer=mm))
        per = max(1, PIECE // row_bytes)
        for r in range(0, rows, per):
            for j in range(r * row_bytes, min(nbytes, (r + per) * row_bytes), BLOCK):
                digest(whole[j : j + BLOCK])
            dest[r : r + per].copy_(src[r : r + per, : half // 4])
            shared[r : r + per].copy_(src[r : r + per, half // 4 :])
        del src
        whole.release()
        mm.close()
        t1 = time.perf_counter()
        other.copy_(shared)
        return t1 - t0, time.perf_counter() - t1

    libc = ctypes.CDLL(None, use_errno=True)
    libc.preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_long]
    libc.preadv.restype = ctypes.c_ssize_t
    scratch = torch.empty(half, dtype=torch.uint8)
    iov = np.empty((2 * rows, 2), dtype=np.int64)  # (address, length): half row to dest, half to scratch
    iov[0::2, 0] = dest.data_ptr() + np.arange(rows, dtype=np.int64) * half
    iov[1::2, 0] = scratch.data_ptr()
    iov[:, 1] = half
    per_call = 512  # rows per call (IOV_MAX is 1024 vectors)

    def pread_half_rows() -> Tuple[float, ...]:
        t0 = time.perf_counter()
        for r in range(0, rows, per_call):
            n = min(per_call, rows - r)
            if libc.preadv(fd, iov.ctypes.data + 2 * r * 16, 2 * n, r * row_bytes) != n * row_bytes:
                raise OSError(ctypes.get_errno(), "short preadv")
        return (time.perf_counter() - t0,)

    try:
        out = {
            "preadv": _best(lambda: pread(False), repeats),
            "preadv + digest": _best(lambda: pread(True), repeats),
            "map own unit (populate, digest, copy half, unmap)": _best(lambda: mapped(True, True), repeats),
            "map other's unit (populate, copy half, unmap)": _best(lambda: mapped(False, True), repeats),
            "map other's unit (page faults, copy half, unmap)": _best(lambda: mapped(False, False), repeats),
            "preadv, half rows (no mapping)": _best(pread_half_rows, repeats),
            "hand-off: own unit + other half to shared memory / taken": _best(hand_off, repeats),
        }
        full = torch.from_numpy(np.fromfile(path, dtype=np.float32, count=nbytes // 4).reshape(rows, -1))
        if not torch.equal(dest, full[:, : half // 4]) or not torch.equal(other, full[:, half // 4 :]):
            raise AssertionError("the half rows read differ from the file")
        return out
    finally:
        os.close(fd)


def main(argv: List[str] = None) -> Dict[str, Tuple[float, ...]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--row-bytes", type=int, default=4096, help="bytes per stored row (4 KiB: 1024 float32 columns)")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    nbytes = a.mib << 20
    fd, path = tempfile.mkstemp(dir=a.dir, prefix="page_costs_")
    try:
        with os.fdopen(fd, "wb") as f:
            for _ in range(a.mib):
                f.write(torch.rand(1 << 18).numpy().tobytes())
        res = measure(path, nbytes, a.row_bytes, a.repeats)
    finally:
        os.unlink(path)
    pages = nbytes // mmap.PAGESIZE
    print(f"{a.mib} MiB in {a.dir}, rows of {a.row_bytes} B, one core, best of {a.repeats}")
    print(f"{'method':<58}{'ms':>8}{'GB/s':>7}{'ns/page':>9}   steps (ms)")
    for name, parts in res.items():
        t = sum(parts)
        steps = " / ".join(f"{1e3 * v:.1f}" for v in parts) if len(parts) > 1 else ""
        print(f"{name:<58}{1e3 * t:>8.1f}{nbytes / t / 1e9:>7.2f}{1e9 * t / pages:>9.0f}   {steps}")
    return res


if __name__ == "__main__":
    main()
