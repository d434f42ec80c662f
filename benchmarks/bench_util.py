"""Helpers of the benchmarks: peak memory from /proc (stdlib only), page-cache eviction, free ports."""

from __future__ import annotations

import os
import socket
from typing import Optional


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
