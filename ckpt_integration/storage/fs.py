"""Local-filesystem primitives: durable writes, atomic renames, positional reads, shared mappings.

Durability matters for atomic commit: data files are fsync'ed before the
commit marker is written, and the marker itself is written to a temporary name,
fsync'ed and renamed, so a crash leaves either no marker or a complete one.

**Stored chunk data as tensors over the page cache** (:class:`ItemMap`, :func:`can_map`, :func:`typed_view`). A read-once load
(``execution/read_once.py``) lets one rank of a node read and verify a block while the node's other ranks copy their slices of it straight from the same page
cache pages: each rank maps the data file (``MAP_SHARED``, read-only, so every rank of
the node sees the one cached copy of the file) and copies the box it needs out of a
strided view. Nothing is staged. Remote files (fsspec) cannot be mapped: their bytes are
read into a buffer (:func:`.readers.read_bytes`), and the other ranks get them over the process
group.

Views into a mapping must be dropped before :meth:`ItemMap.close` (a view that is still
alive keeps its mapping open until it is collected).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import warnings
from typing import Any, Protocol, Union

import numpy as np
import torch

from ..errors import CorruptCheckpointError

PathLike = Union[str, "os.PathLike[str]"]


def fsync_dir(path: PathLike) -> None:
    """Make a directory's entries (new/renamed files) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (tmpfs on some kernels, network FS) refuse; nothing to do
    finally:
        os.close(fd)


def fsync_file(path: PathLike) -> None:
    """Make a file's data durable (a symbolic link is left alone: its directory holds it)."""
    if os.path.islink(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: PathLike, data: bytes, durable: bool = True, exclusive: bool = False) -> None:
    """Write ``data`` to ``path`` so that readers see either nothing or all of it.

    ``exclusive``: the file must not exist yet; the temporary file is hard-linked into
    place (``link`` fails atomically with ``FileExistsError`` if ``path`` exists), so of
    two writers racing for the same name exactly one succeeds.
    """
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident() % 100000}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if exclusive:
            os.link(tmp, path)
            os.remove(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(os.path.dirname(path) or ".")


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange_paths(a: PathLike, b: PathLike) -> bool:
    """Atomically swap two directory entries (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns False where the kernel, libc or filesystem cannot do it (the caller then
    falls back to two renames). Why: replacing a committed checkpoint with two renames
    leaves a moment where neither the old nor the new one is at the path; an exchange
    never does, so a crash at any point leaves a complete checkpoint in place.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat byte tensor (no copy). ``as_strided``, not ``reshape``:
    the size-1 axes of a contiguous tensor may carry any stride (a slice of a wider tensor), which
    ``reshape`` keeps and a byte view refuses."""
    return t.detach().as_strided((t.numel(),), (1,)).view(torch.uint8)


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype, incl. bf16)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("tensor_buffer needs a contiguous CPU tensor")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    # through numpy: a bytes view of the same memory (a ctypes array type per size is slower)
    return memoryview(byte_view(t).numpy()).cast("B")


def pread_exact(fd: int, buf: memoryview, offset: int, path: str = "") -> None:
    """Fill ``buf`` from ``fd`` at ``offset``; a short read means the file is truncated."""
    done = 0
    total = len(buf)
    while done < total:
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise CorruptCheckpointError(
                f"{path or 'file'} is truncated: needed bytes [{offset}, {offset + total}) "
                f"but the file ends at {offset + done}"
            )
        done += n


_INT_OF_SIZE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64, 16: np.complex128}
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14 (not exported by Python 3.11)


class LocalFile(Protocol):
    """A reader of a local file (``can_map`` said yes): its open descriptor."""

    fd: int


def can_map(file_reader: Any) -> bool:
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


# torch.from_numpy warns about read-only arrays: ours are read-only mappings, only ever copied from
# (the filter names this module: the warning is attributed to typed_view's call of from_numpy)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", module=__name__)


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
