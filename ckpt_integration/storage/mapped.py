"""Stored chunk data as tensors over the page cache: read-only shared mappings of local data files.

A read-once load (``execution/read_once.py``) lets one rank of a node read and verify a
block while the node's other ranks copy their slices of it straight from the same page
cache pages: each rank maps the data file (``MAP_SHARED``, read-only, so every rank of
the node sees the one cached copy of the file) and copies the box it needs out of a
strided view. Nothing is staged. Remote files (fsspec) cannot be mapped: their bytes are
read into a buffer (:func:`read_bytes`), and the other ranks get them over the process
group.

Views into a mapping must be dropped before :meth:`ItemMap.close` (a view that is still
alive keeps its mapping open until it is collected).
"""

from __future__ import annotations

import mmap
import warnings
from typing import Protocol, Union

import numpy as np
import torch

from .fs import tensor_buffer
from .readers import FileReader

# torch.from_numpy warns about read-only arrays: ours are read-only mappings, only ever copied from
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", module=__name__)

_INT_OF_SIZE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64, 16: np.complex128}
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14 (not exported by Python 3.11)


class LocalFile(Protocol):
    """A reader of a local file (``can_map`` said yes): its open descriptor."""

    fd: int


def can_map(file_reader: FileReader) -> bool:
    """Whether ``file_reader``'s file is local and can be mapped (probed with one page)."""
    fd = getattr(file_reader, "fd", None)
    if not isinstance(fd, int) or getattr(file_reader, "size", 0) <= 0:
        return False
    try:
        mmap.mmap(fd, min(_PAGE, file_reader.size), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ).close()
        return True
    except (OSError, ValueError):
        return False


class ItemMap:
    """A read-only shared mapping of bytes ``[base, base + length)`` of a local file.

    Mapped per stored item and closed when the item is done, so the pages a rank touched
    leave its resident set with the item (they stay in the page cache for the others).
    ``at(x)`` is the index in :attr:`mm` of item-relative byte ``x``.
    """

    def __init__(self, file_reader: LocalFile, base: int, length: int, willneed: bool = True, populate: bool = True):
        start = base - base % _PAGE
        self.delta = base - start
        self.mm = mmap.mmap(file_reader.fd, self.delta + length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=start)
        if willneed:
            # page tables filled in one call instead of a fault per few pages (Linux >= 5.14; on
            # disk this also reads the item, as one large request); older kernels: read ahead
            for advice in ((_MADV_POPULATE_READ,) if populate else ()) + (mmap.MADV_WILLNEED,):
                try:
                    self.mm.madvise(advice)
                    break
                except (OSError, ValueError, AttributeError):
                    continue

    def at(self, x: int) -> int:
        return self.delta + x

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # a view is still referenced: unmapped when it is collected
            pass

    def __enter__(self) -> "ItemMap":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def typed_view(buffer: Union[mmap.mmap, torch.Tensor], offset: int, numel: int, dtype: torch.dtype, esize: int) -> torch.Tensor:
    """``numel`` elements of ``dtype`` at byte ``offset`` of ``buffer`` (a mapping or a byte tensor),
    without copying. The offset need not be aligned (items in DCP files are not)."""
    np_type = _INT_OF_SIZE.get(esize)
    if np_type is None:
        raise ValueError(f"no view for elements of {esize} bytes")
    if isinstance(buffer, torch.Tensor):
        buffer = tensor_buffer(buffer)
    arr = np.ndarray((numel,), dtype=np_type, buffer=buffer, offset=offset)
    t = torch.from_numpy(arr)
    return t if t.dtype == dtype else t.view(dtype)


def read_bytes(file_reader: FileReader, start: int, length: int) -> torch.Tensor:
    """``length`` bytes of a file from ``start`` into a new byte tensor (files that are not mapped)."""
    buf = torch.empty(length, dtype=torch.uint8)
    if length:
        file_reader.readv([tensor_buffer(buf)], start)
    return buf


