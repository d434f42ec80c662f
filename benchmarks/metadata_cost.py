#!/usr/bin/env python
"""What a checkpoint's metadata costs a load, by manifest format (one process, no process group).

Saves ``--small`` tensors of ``--small-bytes`` each once per manifest format (4: the per-item
table as binary columns in the manifest, and chunk_index.bin; 5: the same plus the fingerprint
table; 6: one index, index.bin, see docs/format.md; format 3's JSON tables, measured in
docs/benchmarks.md, are no longer loaded), then times, best of ``--repeats``: what the load's
coordinator does to open the checkpoint (``read_local``: manifest and index read and checked,
the item table built), the broadcast it builds (manifest, commit marker and index), what every
other rank does with that broadcast (decoded, the item table built), and the metadata of the keys
one of two ranks requests (every other key: ``metadata_for``, what each rank of a 2-rank job of
these tensors decodes at each load). Sizes of ``manifest.json``, the index and the broadcast are
printed too.

    python benchmarks/metadata_cost.py --small 20000 --dir /dev/shm
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import time
from typing import Any, Callable, Dict, List


def _best(fn: Callable[[], Any], repeats: int) -> float:
    """Best time of ``fn``, with the cycle collector paused as in a load (``gc_pause``)."""
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        finally:
            gc.enable()
    return best


def measure(n: int, nbytes: int, directory: str, repeats: int) -> List[Dict[str, Any]]:
    import torch

    import ckpt_integration as ci
    from ckpt_integration import ShardedTensor
    from ckpt_integration.execution import shared_metadata as sm
    from ckpt_integration.storage import checkpoint_dir as ckdir

    state = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.rand(max(1, nbytes // 4))) for i in range(n)}
    rows = []
    for version in (4, 5, 6):
        d = os.path.join(directory, f"ckpt_metadata_cost_{os.getpid()}_{version}")
        shutil.rmtree(d, ignore_errors=True)
        was, ckdir.SAVE_MANIFEST_VERSION = ckdir.SAVE_MANIFEST_VERSION, version
        try:
            ci.save(state, d)
        finally:
            ckdir.SAVE_MANIFEST_VERSION = was
        try:
            shared = sm.read_local(d)
            payload = sm.encode_shared(shared, compress=False)
            half = sorted(state)[::2]
            rows.append({
                "version": version,
                "manifest_bytes": os.path.getsize(os.path.join(d, ckdir.MANIFEST_FILE)),
                "index_bytes": sum(os.path.getsize(os.path.join(d, f)) for f in ("chunk_index.bin", "index.bin")
                                   if os.path.exists(os.path.join(d, f))),
                "read_s": _best(lambda: sm.read_local(d).manifest.item_table(), repeats),
                "encode_s": _best(lambda: sm.encode_shared(shared, compress=False), repeats),
                "payload_bytes": len(payload),
                "decode_s": _best(lambda: sm.decode_shared(payload).manifest.item_table(), repeats),
                "metadata_for_s": _best(lambda: shared.metadata_for(half), repeats),
            })
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return rows


def main(argv=None) -> List[Dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", type=int, default=20000, metavar="N", help="tensors in the checkpoint")
    p.add_argument("--small-bytes", type=int, default=4096)
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    rows = measure(args.small, args.small_bytes, args.dir, args.repeats)
    print(f"metadata of {args.small} tensors of {args.small_bytes} B, best of {args.repeats}")
    print("| format | manifest.json | index | opened, read and checked (coordinator) | broadcast built | broadcast "
          "| broadcast decoded (other ranks) | metadata of every other key (`metadata_for`) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['version']} | {r['manifest_bytes'] / 1e6:.2f} MB | {r['index_bytes'] / 1e6:.2f} MB | "
              f"{1e3 * r['read_s']:.1f} ms | "
              f"{1e3 * r['encode_s']:.1f} ms | {r['payload_bytes'] / 1e6:.2f} MB | {1e3 * r['decode_s']:.1f} ms | "
              f"{1e3 * r['metadata_for_s']:.1f} ms |")
    return rows


if __name__ == "__main__":
    main()
