#!/usr/bin/env python
"""zarr-python 3 vs tensorstore on the layout of the ``zarr`` backend (issue 6).

Both libraries write and read the same zarr v3 arrays: no compression (one
little-endian ``bytes`` codec), ``default`` chunk key encoding with ``/``, fill
value 0 -- what ``ckpt_integration/storage/zarr_backend/`` creates. Two arrays
of ``--mib`` MiB each: float32, and bfloat16 stored as int16 (as the backend does;
zarr v3 has no bfloat16 in its core data types).

The array is 2-D, ``rows x 1024``, split into 2 row shards ("ranks"); chunks are
``(rows / 16, 512)``, so every chunk lies in one shard and each rank writes its
half as whole chunks (8 chunks of rows x 2 column chunks per rank).

Measured per library and dtype (best of ``--repeats``; GiB/s = bytes returned
or written / wall time, array open included):

* ``write``      create the array, then rank 0 and rank 1 write their halves
                 (one after the other, in this process);
* ``read all``   the whole array;
* ``col block``  all rows, columns ``[256, 768)``: half of every chunk;
* ``row block``  4 chunk-heights of rows starting half a chunk in (5 chunk rows touched);
* ``strided``    a small box ``[c/3 : c/3 + 3c : 7, 100:900:3]`` (c = chunk rows).

Checks (any failure exits 1): every read, by both libraries, equals the source
bit for bit (the whole array and each slice, compared with numpy's slice of the
source); interop: tensorstore reads what zarr-python wrote and vice versa.
Also reported: whether zarr-python opens a tensorstore array with the native
``bfloat16`` data type (a tensorstore extension).

Usage::

    pip install tensorstore           # only for this benchmark, not a dependency
    python benchmarks/zarr_libs.py --mib 256 --repeats 5          # under /dev/shm
    python benchmarks/zarr_libs.py --mib 64 --dir /var/tmp        # another file system
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Dict, List, Tuple

import numpy as np

COLS = 1024
ROW_CHUNKS = 16  # chunk rows = rows / 16, i.e. 8 chunk rows per rank
COL_CHUNK = 512
RANKS = 2


def make_source(mib: int, kind: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "float32":
        rows = mib * 2**20 // (4 * COLS)
        return rng.standard_normal((rows, COLS), dtype=np.float32)
    # bfloat16 as int16: the upper 16 bits of float32 values (what torch stores)
    rows = mib * 2**20 // (2 * COLS)
    f = rng.standard_normal((rows, COLS), dtype=np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)


def geometry(src: np.ndarray) -> Tuple[Tuple[int, int], Dict[str, Tuple[slice, slice]]]:
    rows = src.shape[0]
    if rows % (ROW_CHUNKS * 2) or rows < ROW_CHUNKS * 6:
        raise SystemExit(f"--mib too small/odd: {rows} rows")
    cr = rows // ROW_CHUNKS
    chunks = (cr, COL_CHUNK)
    slices = {
        "read all": (slice(None), slice(None)),
        "col block": (slice(None), slice(COL_CHUNK // 2, COL_CHUNK // 2 + COL_CHUNK)),
        "row block": (slice(cr // 2, cr // 2 + 4 * cr), slice(None)),
        "strided": (slice(cr // 3, cr // 3 + 3 * cr, 7), slice(100, 900, 3)),
    }
    return chunks, slices


def rank_rows(rows: int) -> List[slice]:
    per = rows // RANKS
    return [slice(r * per, (r + 1) * per) for r in range(RANKS)]


# --------------------------------------------------------------------------- zarr-python


def zarr_write(path: str, src: np.ndarray, chunks: Tuple[int, int]) -> None:
    import zarr

    arr = zarr.create_array(
        store=zarr.storage.LocalStore(path),
        shape=src.shape,
        chunks=chunks,
        dtype=src.dtype,
        compressors=None,
        fill_value=0,
        chunk_key_encoding={"name": "default", "separator": "/"},
        overwrite=True,
        zarr_format=3,
    )
    for rows in rank_rows(src.shape[0]):  # each "rank" writes its half as whole chunks
        arr[rows, :] = src[rows, :]


def zarr_read(path: str, sl: Tuple[slice, slice]) -> np.ndarray:
    import zarr

    arr = zarr.open_array(zarr.storage.LocalStore(path, read_only=True), mode="r", zarr_format=3)
    return arr[sl]


# --------------------------------------------------------------------------- tensorstore


def _ts_spec(path: str) -> dict:
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}


def ts_write(path: str, src: np.ndarray, chunks: Tuple[int, int], data_type: str = "") -> None:
    import tensorstore as ts

    spec = _ts_spec(path)
    spec["metadata"] = {
        "shape": list(src.shape),
        "data_type": data_type or src.dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "fill_value": 0,
    }
    arr = ts.open(spec, create=True, delete_existing=True).result()
    for rows in rank_rows(src.shape[0]):
        arr[rows, :].write(src[rows, :]).result()


def ts_read(path: str, sl: Tuple[slice, slice]) -> np.ndarray:
    import tensorstore as ts

    arr = ts.open(_ts_spec(path), open=True, read=True).result()
    return arr[sl].read().result()


LIBS: Dict[str, Tuple[Callable, Callable]] = {
    "zarr-python": (zarr_write, zarr_read),
    "tensorstore": (ts_write, ts_read),
}


# --------------------------------------------------------------------------- driver


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-for-bit equality (float32 compared as uint32, so -0.0 / NaN patterns count)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    w = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    return np.array_equal(a.view(w), b.view(w))


def best(fn: Callable[[], object], repeats: int, before: Callable[[], None] = lambda: None):
    times, out = [], None
    for _ in range(repeats):
        before()
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=256, help="size of each array in MiB (default 256)")
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs (default 3)")
    p.add_argument("--dir", default=None, help="parent directory (default: a temp dir under /dev/shm)")
    args = p.parse_args()

    import importlib.metadata as md

    import zarr

    parent = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    root = tempfile.mkdtemp(prefix="zarr_libs_", dir=parent)
    print(f"zarr {zarr.__version__}, tensorstore {md.version('tensorstore')}, numpy {np.__version__}; "
          f"{args.mib} MiB per array, best of {args.repeats}, in {root}, {os.cpu_count()} CPUs")
    rows_out: List[Tuple[str, str, str, float, float, float]] = []
    failures: List[str] = []
    try:
        for kind in ("float32", "bf16 as int16"):
            src = make_source(args.mib, "float32" if kind == "float32" else "bf16")
            chunks, slices = geometry(src)
            print(f"\n{kind}: shape {src.shape}, chunks {chunks}, {RANKS} row shards")
            paths = {lib: os.path.join(root, f"{lib}_{src.dtype.name}") for lib in LIBS}
            for lib, (write, read) in LIBS.items():
                path = paths[lib]
                t, _ = best(lambda: write(path, src, chunks), args.repeats,
                            before=lambda: shutil.rmtree(path, ignore_errors=True))
                rows_out.append((lib, kind, "write", src.nbytes / 2**20, t, src.nbytes / t / 2**30))
                for name, sl in slices.items():
                    t, got = best(lambda: read(path, sl), args.repeats)
                    if not same(got, src[sl]):
                        failures.append(f"{lib} {kind} {name}: differs from source")
                    rows_out.append((lib, kind, name, got.nbytes / 2**20, t, got.nbytes / t / 2**30))
            # interop: each library reads the other's array (whole + every slice)
            for writer, reader in (("zarr-python", "tensorstore"), ("tensorstore", "zarr-python")):
                read = LIBS[reader][1]
                ok = all(same(read(paths[writer], sl), src[sl]) for sl in slices.values())
                print(f"  interop: {reader} reads {writer}'s array: {'identical' if ok else 'DIFFERENT'}")
                if not ok:
                    failures.append(f"interop {writer} -> {reader} ({kind})")
            # file layout: both must produce the same chunk file names
            names = {lib: sorted(os.path.relpath(os.path.join(d, f), paths[lib])
                                 for d, _, fs in os.walk(paths[lib]) for f in fs if f != "zarr.json")
                     for lib in LIBS}
            if names["zarr-python"] != names["tensorstore"]:
                failures.append(f"chunk file names differ ({kind})")
            print(f"  chunk files: {len(names['zarr-python'])} per array, same names in both: "
                  f"{names['zarr-python'] == names['tensorstore']}")
            if kind != "float32":
                # tensorstore's native bfloat16 (an extension data type): can zarr-python open it?
                import ml_dtypes

                path = os.path.join(root, "ts_native_bf16")
                ts_write(path, src[: chunks[0] * 2].view(ml_dtypes.bfloat16), chunks, "bfloat16")
                try:
                    zarr_read(path, (slice(0, 1), slice(0, 1)))
                    msg = "opens it"
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    msg = f"refuses it ({type(e).__name__}: {str(e).splitlines()[0][:90]})"
                print(f"  tensorstore native 'bfloat16' array: zarr-python {msg}")
            del src
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print("\n| op | dtype | MiB | zarr-python s | GiB/s | tensorstore s | GiB/s | ts / zarr |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    by = {(lib, kind, op): (mib, t, g) for lib, kind, op, mib, t, g in rows_out}
    for lib, kind, op, mib, _, _ in rows_out:
        if lib != "zarr-python":
            continue
        _, tz, gz = by[("zarr-python", kind, op)]
        _, tt, gt = by[("tensorstore", kind, op)]
        print(f"| {op} | {kind} | {mib:.1f} | {tz:.3f} | {gz:.2f} | {tt:.3f} | {gt:.2f} | {tz / tt:.1f}x |")
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        return 1
    print("\nall reads equal the source bit for bit; interop identical both ways")
    return 0


if __name__ == "__main__":
    sys.exit(main())
