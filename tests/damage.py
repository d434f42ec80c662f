"""Helpers of the fault-injection tests: damage a file, fail instead of hanging."""

from __future__ import annotations

import contextlib
import signal


def flip_byte(path, offset: int) -> None:
    """Flip one bit of the byte at ``offset`` of ``path`` in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


@contextlib.contextmanager
def deadline(seconds: int = 20):
    """Fail instead of hanging (opening a FIFO for reading blocks until a writer appears)."""
    def expired(*_):
        raise TimeoutError(f"blocked for more than {seconds}s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
