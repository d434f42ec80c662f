"""Point-to-point transfers posted in an order both sides know, waited for oldest first, bounded.

Every byte one rank hands another outside a collective moves through :class:`Transfers`: a
shared-read load's units (:mod:`.read_once`, every strategy that shares reads) and the memory tier's
snapshot copies (:mod:`ckpt_integration.memory.transfer`, :mod:`ckpt_integration.memory.elastic`).
Both sides post their sends and receives in one order (the plan every rank computed alike),
so one tag serves a whole exchange: gloo and NCCL match messages between a pair in the order
they were posted. Messages larger than :data:`CHUNK` go in pieces (gloo's per-message buffers
stay bounded). With a ``budget``, at most that many bytes of buffers are in flight: the oldest
transfers are waited for first, and their buffers reused (memory a process has not touched yet
is paged in on first use, which costs more than the copy into it: ~1 s per load measured with a
fresh buffer per transfer). A wait on a lost peer raises :class:`~..errors.PeerLostError`.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Deque, List, Optional, Tuple

import torch

from . import dist
from .dist import Group

CHUNK = 256 << 20  # bytes per message


def chunks(t: torch.Tensor) -> List[torch.Tensor]:
    """A flat tensor ``t`` in messages of at most :data:`CHUNK` bytes."""
    step = max(1, CHUNK // max(1, t.element_size()))
    return [t[o:o + step] for o in range(0, t.numel(), step)]  # (empty: no message, on both sides)


class Transfers:
    """Sends and receives over ``group`` with one ``tag``, waited for in the order they were posted.

    ``budget``: the bytes of buffers that may be in flight (``None``: unbounded; wait with
    :meth:`settle`). ``on_done`` of a receive runs once its bytes are in (an error it raises goes
    to ``note``, and the remaining transfers still complete: a peer never waits forever).
    ``seconds`` collects the time spent waiting (``stats.add("exchange_s", ...)``).
    """

    def __init__(self, group: Group, tag: int, budget: Optional[int] = None,
                 note: Optional[Callable[[BaseException], None]] = None,
                 seconds: Optional[Callable[[float], None]] = None) -> None:
        self.group, self.tag, self.budget = group, tag, budget
        self.note, self.seconds = note, seconds
        # (posted work, bytes, on completion, buffer to reuse, memory kept alive until then)
        self.pending: Deque[Tuple[Any, int, Optional[Callable[[], None]], Optional[torch.Tensor],
                                  Optional[torch.Tensor]]] = deque()
        self.bytes = 0
        self.peak = 0  # the most bytes of buffers ever in flight at once
        self.free: List[torch.Tensor] = []  # uint8 buffers of finished transfers

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` (one a finished transfer left, when one is large enough);
        pass it back as ``base`` to the transfer that uses it. Makes room under the budget first."""
        self._make_room(nbytes)
        for i, b in enumerate(self.free):
            if b.numel() >= nbytes:
                return self.free.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8)

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` this rank keeps outside the transfers (a unit it read into memory to send
        from) against the budget until :meth:`release`: room is made first, as for a buffer."""
        self._make_room(nbytes)
        self.bytes += nbytes
        self.peak = max(self.peak, self.bytes)

    def _make_room(self, nbytes: int) -> None:
        if self.budget is not None:
            self.settle(max(0, self.budget - nbytes))

    def release(self, nbytes: int) -> None:
        self.bytes -= nbytes

    def send(self, t: torch.Tensor, dst: int, base: Optional[torch.Tensor] = None,
             keep: Optional[torch.Tensor] = None) -> None:
        """Post a send of flat ``t`` to group rank ``dst``; ``base``: the :meth:`buffer` it lies in;
        ``keep``: memory of the caller's own it lies in instead (kept alive and counted until sent)."""
        self._post([dist.isend(c, dst, self.group, self.tag) for c in chunks(t)], t, None, base, keep)

    def recv(self, t: torch.Tensor, src: int, on_done: Optional[Callable[[], None]] = None,
             base: Optional[torch.Tensor] = None) -> None:
        """Post a receive into flat ``t`` from group rank ``src``."""
        self._post([dist.irecv(c, src, self.group, self.tag) for c in chunks(t)], t, on_done, base)

    def _post(self, works: List[Any], t: torch.Tensor, on_done: Optional[Callable[[], None]],
              base: Optional[torch.Tensor], keep: Optional[torch.Tensor] = None) -> None:
        held = base is not None or keep is not None
        nbytes = t.numel() * t.element_size() if held else 0  # (in place: no buffer held)
        if not works:  # (nothing to move)
            if on_done is not None:
                on_done()
            return
        for w in works[:-1]:
            self.pending.append((w, 0, None, None, None))
        self.pending.append((works[-1], nbytes, on_done, base, keep))
        self.bytes += nbytes
        self.peak = max(self.peak, self.bytes)

    def settle(self, keep_bytes: int = -1) -> None:
        """Wait for the oldest transfers until at most ``keep_bytes`` bytes of buffers are in flight
        (``-1``: all of them). A failed wait (a lost peer) raises once every other posted transfer
        was waited for too: none is left pending with a buffer that is then freed."""
        failed: Optional[BaseException] = None
        while self.pending and (failed is not None or keep_bytes < 0 or self.bytes > keep_bytes):
            work, nbytes, on_done, base, _keep = self.pending.popleft()
            t0 = time.perf_counter()
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - raised below, after the others
                failed = failed or e
            finally:
                self.bytes -= nbytes
                if self.seconds is not None:
                    self.seconds(time.perf_counter() - t0)
            if failed is not None:
                continue
            if on_done is not None:
                try:
                    on_done()
                except Exception as e:  # noqa: BLE001 - recorded; the other transfers go on
                    if self.note is None:
                        raise
                    self.note(e)
            if base is not None and (self.budget is None or sum(b.numel() for b in self.free) + base.numel()
                                     <= self.budget):
                self.free.append(base)
        if failed is not None:
            raise failed
