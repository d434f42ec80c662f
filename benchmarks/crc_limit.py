#!/usr/bin/env python
"""What checking every byte costs on this machine: one process, one core, per block digest.

Reads a file of ``--mib`` MiB (created in ``--dir``) into a preallocated buffer in 1 MiB
``preadv`` calls: plain, and with the digest of each block computed right after it is read
(cache-hot), as a verified load does; also the digest alone over the whole buffer in memory
(memory-resident: ``--mib`` MiB, larger than the caches) and over one 1 MiB block again and
again (cache-hot). Best of ``--repeats``. The ratio ``read+digest / read`` bounds what a
verified load can reach against the plain read of the same bytes when every core is busy
reading (as with one rank per core).

Digests compared: CRC32 (zlib-ng, manifest format 2), XXH3-64 (``xxhash``, format 3, what
new checkpoints record) and, when the ``crc32c`` package is installed, CRC32C (hardware).

    python benchmarks/crc_limit.py --dir /dev/shm --mib 512
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict


def _digests() -> Dict[str, Callable]:
    from ckpt_integration.storage.checksum import IMPLEMENTATION, block_hash

    out = {f"CRC32 ({IMPLEMENTATION})": block_hash("crc32").digest, "XXH3-64 (xxhash)": block_hash("xxh3_64").digest}
    try:
        import crc32c
    except ImportError:
        pass
    else:
        out["CRC32C (crc32c)"] = crc32c.crc32c
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import numpy as np

    digests = _digests()
    path = os.path.join(a.dir, f"crc_limit_{os.getpid()}.bin")
    block, n = 1 << 20, a.mib << 20
    with open(path, "wb") as f:
        chunk = os.urandom(block)
        for _ in range(a.mib):
            f.write(chunk)
    arr = np.ones(n, dtype=np.uint8)  # touched: the reads do not count page faults
    mv = memoryview(arr).cast("B")
    hot = mv[:block]

    def best(fn, nbytes: int = n) -> float:
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return nbytes / min(times) / 2**30

    def read(digest=None) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            for o in range(0, n, block):
                os.preadv(fd, [mv[o : o + block]], o)
                if digest is not None:
                    digest(mv[o : o + block])
        finally:
            os.close(fd)

    def blocks(digest) -> None:
        for o in range(0, n, block):
            digest(mv[o : o + block])

    def again(digest) -> None:
        for _ in range(256):
            digest(hot)

    try:
        r = best(read)
        rows = []
        for name, digest in digests.items():
            rows.append((name, best(lambda: read(digest)), best(lambda: blocks(digest)),
                         best(lambda: again(digest), 256 * block)))
    finally:
        os.remove(path)
    print(f"{a.mib} MiB in {a.dir}, 1 MiB blocks, one core, best of {a.repeats}; GiB/s")
    print(f"{'':20s}{'read + digest':>16s}{'% of read':>11s}{'digest, in memory':>19s}{'digest, cache-hot':>19s}")
    print(f"{'plain read':20s}{r:16.2f}{100:10.0f}%")
    for name, rd, mem, h in rows:
        print(f"{name:20s}{rd:16.2f}{100 * rd / r:10.0f}%{mem:19.2f}{h:19.2f}")


if __name__ == "__main__":
    main()
