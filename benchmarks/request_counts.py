"""Storage operations of a save and of loads, on a local directory and on fsspec ``memory://``.

Counts the operations the library issues through its storage layer (``Storage`` calls: exists,
isdir, listdir, size, reads of whole files, opens, writes, renames, removals; plus every read
request made through an opened file), which on an object store are requests. Counts, not times:
deterministic, so one run is enough.

Compared: an evaluation-style reader that asks for the common state, the tensor metadata and the
tensors of one checkpoint

* by path (each call opens the checkpoint for itself: ``metadata.json`` and the manifest, and
  ``.metadata`` / ``common.pt`` when it needs them), and
* through one ``ci.open_checkpoint`` (each of those files read once for all calls; checked reads
  need no commit lookup, see docs/reading.md).

"metadata ops" are every operation but the read requests made through opened files; those ("data
read requests") include the small reads of manifest heads and depend on the load plan (whole
files or ranges, grouped small tensors), which may differ between two loads of the same files.

Run: ``python benchmarks/request_counts.py [--tensors 8 32]``
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import tempfile
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import ckpt_integration as ci  # noqa: E402
from ckpt_integration.storage import filesystem as fsmod
from ckpt_integration.storage import readers as readers_mod  # noqa: E402

_STORAGE_OPS = ("exists", "isdir", "listdir", "size", "makedirs", "open_write", "write_atomic", "read_bytes",
                "open_reader", "remove", "rmtree", "rename", "exchange", "sync_dir")
_READER_OPS = ("read", "read_into", "readv")


@contextlib.contextmanager
def counting():
    """Count storage operations by kind while the block runs (nested calls counted once)."""
    counts: collections.Counter = collections.Counter()
    depth = [0]
    patched = []

    def wrap(cls, name, label):
        real = getattr(cls, name)

        def inner(*a, **k):
            if depth[0] == 0:
                counts[label] += 1
            depth[0] += 1
            try:
                return real(*a, **k)
            finally:
                depth[0] -= 1

        setattr(cls, name, inner)
        patched.append((cls, name, real))

    for name in _STORAGE_OPS:
        wrap(fsmod.Storage, name, name)
    # local reads: each call is a system call; remote reads: each fetch is a request (reads are
    # served from shared read-ahead windows, storage/readers.py)
    for cls, names in ((readers_mod.LocalReader, _READER_OPS), (readers_mod.FsspecReader, ("_fetch",))):
        for name in names:
            if name in cls.__dict__:
                wrap(cls, name, "read request")
    try:
        yield counts
    finally:
        for cls, name, real in reversed(patched):
            setattr(cls, name, real)


def _state(n: int):
    return {**{f"t{i}": ci.ShardedTensor.from_rank_offsets(f"t{i}", torch.full((256, 64), float(i))) for i in range(n)},
            "step": 7}


def _request(n: int):
    return {f"t{i}": ci.ShardedTensor.from_rank_offsets(f"t{i}", torch.empty(256, 64)) for i in range(n)}


def _reader_by_path(path: str, n: int) -> None:
    ci.load_common_state_dict(path)
    ci.load_tensors_metadata(path)
    ci.load(_request(n), path)


def _reader_opened(path: str, n: int) -> None:
    with ci.open_checkpoint(path) as ck:
        ci.load_common_state_dict(ck)
        ci.load_tensors_metadata(ck)
        ci.load(_request(n), ck)


def measure(root: str, n: int) -> dict:
    path = f"{root}/ckpt_{n}"
    with counting() as save:
        ci.save(_state(n), path)
    with counting() as load_path:
        ci.load(_request(n), path)
    with counting() as load_opened:
        with ci.open_checkpoint(path) as ck:
            ci.load(_request(n), ck)
    with counting() as reader_path:
        _reader_by_path(path, n)
    with counting() as reader_opened:
        _reader_opened(path, n)
    return {"save": save, "load (path)": load_path, "load (opened)": load_opened,
            "reader: common+metadata+load (paths)": reader_path, "reader: same through one opened checkpoint": reader_opened}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, nargs="+", default=[8, 32])
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as local:
        for where, root in (("local", local), ("memory://", f"memory://bench-{uuid.uuid4().hex[:8]}")):
            for n in args.tensors:
                for what, c in measure(root, n).items():
                    rows.append((where, n, what, sum(c.values()), dict(sorted(c.items()))))
    print("| storage | tensors | operation | metadata ops | data read requests | by kind |\n|---|---:|---|---:|---:|---|")
    for where, n, what, total, kinds in rows:
        data = kinds.get("read request", 0)
        detail = ", ".join(f"{k} {v}" for k, v in kinds.items())
        print(f"| {where} | {n} | {what} | {total - data} | {data} | {detail} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
