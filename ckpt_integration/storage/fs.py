"""Local-filesystem primitives: durable writes, atomic renames, positional reads.

Durability matters for atomic commit: data files are fsync'ed before the
commit marker is written, and the marker itself is written to a temporary name,
fsync'ed and renamed, so a crash leaves either no marker or a complete one.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from typing import Union

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
