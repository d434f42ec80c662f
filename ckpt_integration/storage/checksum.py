"""CRC32 of checkpoint bytes, as recorded in ``manifest.json`` and ``zarr_index.json``.

zlib-ng's SIMD implementation is used when it is installed (``pip install
"ckpt_integration[fast]"``): the same CRC32 values as :func:`zlib.crc32`, about three times
faster and without holding the GIL, which matters because every chunk read whole is
verified on load. Without it the standard library's zlib computes the same values, so
checkpoints written with either verify with either.
"""

from __future__ import annotations

from typing import Any

try:  # pragma: no cover - depends on the environment
    from zlib_ng.zlib_ng import crc32 as _crc32

    IMPLEMENTATION = "zlib-ng"
except ImportError:  # pragma: no cover - depends on the environment
    from zlib import crc32 as _crc32

    IMPLEMENTATION = "zlib"


def crc32(data: Any, value: int = 0) -> int:
    """CRC32 of a bytes-like object, continuing from ``value`` (as :func:`zlib.crc32`)."""
    return _crc32(data, value)


__all__ = ["crc32", "IMPLEMENTATION"]
