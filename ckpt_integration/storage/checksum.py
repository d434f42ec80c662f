"""CRC32 of checkpoint bytes, as recorded in ``manifest.json`` and ``zarr_index.json``.

zlib-ng's SIMD implementation is used when it is installed (``pip install
"ckpt_integration[fast]"``): the same CRC32 values as :func:`zlib.crc32`, about three times
faster and without holding the GIL, which matters because every byte read is verified on
load. Without it the standard library's zlib computes the same values, so checkpoints
written with either verify with either.

Block checksums (manifest format 2): a tensor item's raw data is checksummed in blocks of
``block_size`` bytes (plus one CRC for the archive bytes before the data and one for those
after it), so a ranged read checks only the blocks it touches. The whole-item CRC32 that
older readers and ``verify`` use is derived from the block CRCs with :func:`crc32_combine`
instead of a second pass over the data.
"""

from __future__ import annotations

import base64
import functools
from typing import Any, List, Sequence

import numpy as np

try:  # pragma: no cover - depends on the environment
    from zlib_ng.zlib_ng import crc32 as _crc32
    from zlib_ng.zlib_ng import crc32_combine as _crc32_combine

    IMPLEMENTATION = "zlib-ng"
except ImportError:  # pragma: no cover - depends on the environment
    from zlib import crc32 as _crc32

    _crc32_combine = None
    IMPLEMENTATION = "zlib"

# Data block size of new checkpoints: the most a ranged read reads beyond what it needs is
# one block at each end of a contiguous run; the manifest grows by ~5.3 bytes per block.
DEFAULT_BLOCK_SIZE = 1 << 20


def crc32(data: Any, value: int = 0) -> int:
    """CRC32 of a bytes-like object, continuing from ``value`` (as :func:`zlib.crc32`)."""
    return _crc32(data, value)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's crc32_combine)."""
    if _crc32_combine is not None:
        return _crc32_combine(crc1, crc2, len2)
    if len2 <= 0:
        return crc1
    tables = _shift_tables(len2)
    shifted = tables[0][crc1 & 0xFF] ^ tables[1][(crc1 >> 8) & 0xFF] ^ tables[2][(crc1 >> 16) & 0xFF] ^ tables[3][crc1 >> 24]
    return shifted ^ crc2


# --- pure-Python crc32_combine (only without zlib-ng): the CRC register is a linear map over
# GF(2); appending n zero bytes is a 32x32 bit matrix, built by squaring and cached per length
# (block, header and tail lengths repeat), then applied through four byte tables.
def _gf2_times(mat: Sequence[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: Sequence[int]) -> List[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


@functools.lru_cache(maxsize=64)
def _shift_tables(nbytes: int) -> List[List[int]]:
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    op = None
    n = nbytes
    while True:  # apply len2 zero bytes: squarings of the "one zero byte" operator
        even = _gf2_square(odd)
        if n & 1:
            op = even if op is None else [_gf2_times(even, c) for c in op]
        n >>= 1
        if not n:
            break
        odd = _gf2_square(even)
        if n & 1:
            op = odd if op is None else [_gf2_times(odd, c) for c in op]
        n >>= 1
        if not n:
            break
    cols = op  # column i: image of bit i
    return [[_gf2_times(cols, b << (8 * k)) for b in range(256)] for k in range(4)]


# --------------------------------------------------------------------------- block records
def pack_crcs(crcs: Sequence[int]) -> str:
    """Block CRCs as they are stored in the manifest: little-endian uint32, base64."""
    return base64.b64encode(np.asarray(crcs, dtype="<u4").tobytes()).decode("ascii")


def unpack_crcs(text: str) -> np.ndarray:
    """Inverse of :func:`pack_crcs` (raises ValueError for malformed input)."""
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    if len(raw) % 4:
        raise ValueError("block checksum table length is not a multiple of 4 bytes")
    return np.frombuffer(raw, dtype="<u4")


__all__ = ["crc32", "crc32_combine", "pack_crcs", "unpack_crcs", "IMPLEMENTATION", "DEFAULT_BLOCK_SIZE"]
