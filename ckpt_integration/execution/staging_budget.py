"""Async saves within a host-memory budget: staging in waves through one reused buffer (execution layer).

An async save copies the state into host memory so that training can go on while it is written; by
default the copy is the whole state (``staging.StateDictStager``: buffers kept and reused across
saves). A job whose state is a large part of a node's memory cannot afford that copy. With
``staging_budget=BYTES`` the save never holds more than ``BYTES`` of staged tensor data:

1. data files an earlier checkpoint holds unchanged (an incremental save's base) are linked first:
   they need no staging at all;
2. the rest is cut into waves of at most the budget. The last wave (as many bytes as the budget
   holds) is staged into the buffer and written in the background, as an ordinary async save;
   every earlier wave is staged into the same buffer and written before the next is copied, while
   the caller waits: the training loop is blocked exactly as long as the state beyond the budget
   takes to write;
3. a tensor larger than the budget is written from its own memory (no copy) when it is on the
   CPU; a device tensor that large cannot be staged and the save fails, naming it and the budget
   it needs.

The buffer (pinned when CUDA is present) is allocated once per save slot of the queue and reused
by every wave of every later save. :class:`StagingReport` says, per save, how many bytes were
staged, in how many waves, and how long the caller was blocked.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..errors import StagingMemoryError, format_size
from ..planning.written import WrittenTable
from ..storage.checksum import save_block_hash
from ..storage.filesystem import write_error
from ..storage.torch_dist import WriteRequest, link_unchanged, write_data_files
from .save import SavePlan, request_fingerprints

_ALIGN = 64  # staged tensors start at multiples of this (>= any element size; the writer's alignment)


@dataclass
class StagingReport:
    """What one async save staged: ``bytes`` of tensor data copied into host buffers, ``waves`` (1 for
    an unbounded save), ``blocked_s`` (seconds the caller waited, staging and early waves included),
    ``budget`` (None: unbounded), ``linked_files`` (data files taken from the base, not staged; 0 for an
    unbounded save, which stages everything and links in the background)."""

    bytes: int = 0
    waves: int = 1
    blocked_s: float = 0.0
    budget: Optional[int] = None
    linked_files: int = 0


class StagingArena:
    """One host buffer of ``nbytes`` that waves of tensors are copied into (reused while it fits)."""

    def __init__(self) -> None:
        self.buffer: Optional[torch.Tensor] = None

    def reserve(self, nbytes: int, rank: int = 0) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = None  # (the old one first: never two at once)
            try:
                self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            except RuntimeError as e:  # (torch's allocator: "can't allocate memory")
                raise StagingMemoryError(f"rank {rank}: cannot allocate {format_size(nbytes)} of host memory to stage "
                                         f"an async save in: {str(e).splitlines()[0]}") from None
        return self.buffer

    def stage(self, tensors: Sequence[torch.Tensor], nbytes: int) -> List[torch.Tensor]:
        """Copies of ``tensors`` in the buffer, each a tensor with a storage of its own over its aligned
        byte range (``torch.frombuffer``): a view of the whole buffer would make the writer save, or
        clone, the whole buffer (``torch.save`` writes a tensor's entire storage)."""
        memory = memoryview(self.reserve(nbytes).numpy())
        out, at = [], 0
        for t in tensors:
            n = t.numel() * t.element_size()
            if n:
                copy = torch.frombuffer(memory[at : at + n], dtype=t.dtype).view(t.shape)
                copy.copy_(t)
            else:
                copy = torch.empty(t.shape, dtype=t.dtype)
            out.append(copy)
            at += -(-n // _ALIGN) * _ALIGN
        return out


def _size(r: WriteRequest) -> int:
    return -(-r.nbytes // _ALIGN) * _ALIGN


def waves(requests: Sequence[WriteRequest], budget: int) -> Tuple[List[List[int]], List[int], List[int]]:
    """``(early waves, last wave, direct)``: request indices. The last wave is staged and written in
    the background, so it takes as much of the budget as it can; the early waves, staged one after
    another before the caller returns, take the rest in pieces of at most the budget; ``direct`` are
    tensors larger than the budget (written from their own memory). Objects (bytes, already copied
    when the save was planned) go with the last wave."""
    tensors = [i for i, r in enumerate(requests) if isinstance(r.data, torch.Tensor)]
    direct = [i for i in tensors if _size(requests[i]) > budget]
    rest = sorted((i for i in tensors if _size(requests[i]) <= budget), key=lambda i: -_size(requests[i]))
    last: List[int] = [i for i, r in enumerate(requests) if not isinstance(r.data, torch.Tensor)]
    early: List[List[int]] = []
    room, left = budget, []
    for i in rest:  # largest first: the last wave fills the budget best
        if _size(requests[i]) <= room:
            last.append(i)
            room -= _size(requests[i])
        else:
            left.append(i)
    wave, used = [], 0
    for i in left:
        if used + _size(requests[i]) > budget:
            early.append(wave)
            wave, used = [], 0
        wave.append(i)
        used += _size(requests[i])
    if wave:
        early.append(wave)
    return early, sorted(last), direct


def available_memory() -> Optional[int]:
    """Bytes of host memory available to new allocations (Linux ``MemAvailable``), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(needed: int, where: str, rank: int) -> None:
    """An unbounded async save: refuse, naming the budget to use, when its staging cannot fit in the
    host memory available now (instead of an out-of-memory kill in the middle of training)."""
    free = available_memory()
    if free is not None and needed > free:
        raise StagingMemoryError(
            f"async save to {where}, rank {rank}: staging the state needs {format_size(needed)} of host memory and "
            f"{format_size(free)} are available; pass staging_budget= (e.g. {max(free // 4, 1 << 20)} bytes; "
            "DistCkptIO(staging_budget=...)) to stage it in waves, or save synchronously")


def write_in_waves(plan: SavePlan, arena: StagingArena, budget: int) -> StagingReport:
    """The caller's part of a bounded async save (see the module doc): link what the base holds,
    write every early wave and direct tensor, and leave in ``plan.requests`` the last wave, staged in
    ``arena``, for the background writer; what was written is kept in ``plan.written_before``."""
    report = StagingReport(budget=budget, waves=0, bytes=0)  # (blocked_s: the caller's, set by async_save)
    requests: List[WriteRequest] = plan.requests
    rows = WrittenTable()
    names: set = set()
    try:
        fps = request_fingerprints(requests)
        rows, taken, stable = link_unchanged(plan.target, requests, plan.base, save_block_hash(), None, fps,
                                             plan.separation_hint)
        report.linked_files = len(set(rows.files))
        names |= set(rows.files)
        for i in stable:
            requests[i].stable = True
        keep = [i for i in range(len(requests)) if i not in taken]
        rest = [requests[i] for i in keep]
        early, last, direct = waves(rest, budget)
        # the largest wave once (waves of other sizes never reallocate it): the budget is a bound, a
        # budget above what the state needs reserves only what it needs
        arena.reserve(max([sum(_size(rest[i]) for i in w if isinstance(rest[i].data, torch.Tensor))
                           for w in early + [last]], default=0), plan.rank)
        for i in direct:
            if not rest[i].data.is_cpu:
                raise StagingMemoryError(
                    f"async save to {plan.checkpoint_dir}, rank {plan.rank}: {rest[i].storage_key} holds "
                    f"{rest[i].nbytes} bytes on {rest[i].data.device}, more than staging_budget={budget}; "
                    f"a budget of at least {_size(rest[i])} bytes is needed")
        for wave, staged in [(w, True) for w in early] + ([(direct, False)] if direct else []):
            table = write_data_files(plan.target, plan.rank,
                                     _stage(rest, wave, arena, report) if staged else [rest[i] for i in wave],
                                     plan.thread_count, plan.durable, separation_hint=plan.separation_hint,
                                     fingerprints=[fps[keep[i]] for i in wave], taken_names=names)
            names |= set(table.files)
            rows.extend(table)
        plan.requests = _stage(rest, last, arena, report)
        plan.item_fingerprints = [fps[keep[i]] for i in last]
    except Exception as e:
        plan.failure.record(write_error(e, plan.write_dir))
        plan.requests = []
    plan.base = None  # (linked above)
    plan.written_before, plan.taken_names = rows, names
    return report


def _stage(rest: List[WriteRequest], wave: List[int], arena: StagingArena, report: StagingReport) -> List[WriteRequest]:
    """The requests ``wave`` with their tensors copied into ``arena`` (objects as they are)."""
    idx = [i for i in wave if isinstance(rest[i].data, torch.Tensor)]
    nbytes = sum(_size(rest[i]) for i in idx)
    staged = dict(zip(idx, arena.stage([rest[i].data for i in idx], nbytes)))
    report.waves += 1
    report.bytes += nbytes
    return [dataclasses.replace(rest[i], data=staged[i]) if i in staged else rest[i] for i in wave]


__all__ = ["StagingArena", "StagingMemoryError", "StagingReport", "available_memory", "check_fits", "waves",
           "write_in_waves"]
