#!/usr/bin/env python
"""What checking every byte costs on this machine: one process, one core.

Reads a file of ``--mib`` MiB (created in ``--dir``) into a preallocated buffer in 1 MiB
``preadv`` calls: plain, and with the CRC32 of each block computed right after it is read
(cache-hot), as a verified load does; also the CRC32 alone over a buffer in memory. Best of
``--repeats``. The ratio ``read+crc / read`` bounds what a verified load can reach against the
plain read of the same bytes when every core is busy reading (as with one rank per core).

    python benchmarks/crc_limit.py --dir /dev/shm --mib 512
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from ckpt_integration.storage.checksum import IMPLEMENTATION, crc32

    path = os.path.join(a.dir, f"crc_limit_{os.getpid()}.bin")
    block, n = 1 << 20, a.mib << 20
    with open(path, "wb") as f:
        chunk = os.urandom(block)
        for _ in range(a.mib):
            f.write(chunk)
    import numpy as np

    arr = np.ones(n, dtype=np.uint8)  # touched: the reads do not count page faults
    mv = memoryview(arr).cast("B")

    def best(fn):
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return n / min(times) / 2**30

    def read(check: bool):
        fd = os.open(path, os.O_RDONLY)
        try:
            for o in range(0, n, block):
                os.preadv(fd, [mv[o : o + block]], o)
                if check:
                    crc32(mv[o : o + block])
        finally:
            os.close(fd)

    try:
        r = best(lambda: read(False))
        rc = best(lambda: read(True))
        c = best(lambda: crc32(mv))
    finally:
        os.remove(path)
    print(f"CRC32 implementation: {IMPLEMENTATION}; {a.mib} MiB in {a.dir}, 1 MiB blocks, best of {a.repeats}")
    print(f"read            {r:6.2f} GiB/s")
    print(f"read + CRC32    {rc:6.2f} GiB/s  ({100 * rc / r:.0f}% of the plain read)")
    print(f"CRC32 alone     {c:6.2f} GiB/s  (memory-resident buffer)")


if __name__ == "__main__":
    main()
