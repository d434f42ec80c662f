"""Every requested element delivered exactly once: the ledger a load keeps per destination.

A load's plan says which stored bytes fill which part of which destination; the ledger
records what was actually copied (or received) into each destination, at the place the copy
happens, and :func:`tiling_problem` checks at the end that those boxes tile the destination
exactly: every box inside it, no two overlapping, their elements adding up to its own. A path
that skips a part (a missing file a second engine did not notice), fills a part twice or
writes outside its region fails here, whatever its plan said.

Pure: boxes in, a description of what is wrong out.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Protocol, Sequence, Tuple

from ..errors import StateVerificationError
from .boxes import Box, intersect, overlapping_pairs


class _Keyed(Protocol):
    """A read task, as far as the error naming it needs."""

    key: str


def global_part(chunk_offsets: Sequence[int], starts: Sequence[int], lens: Sequence[int]) -> Box:
    """A part given relative to a stored chunk (``starts``, ``lens``) in global coordinates."""
    return Box(tuple(o + s for o, s in zip(chunk_offsets, starts)), tuple(int(n) for n in lens))


def tiling_problem(dest: Box, boxes: Sequence[Box]) -> Optional[str]:
    """None when ``boxes`` tile ``dest`` exactly; otherwise what is wrong, in words."""
    if len(boxes) == 1 and (boxes[0] is dest or boxes[0] == dest):
        return None  # the common case: one read filled the whole destination
    total = dest.numel
    got = 0
    for b in boxes:
        if b.numel == 0:
            continue
        inside = intersect(b, dest)
        if inside is None or inside != b:
            return f"elements {b} were written outside the requested region {dest}"
        got += b.numel
    nonempty: List[Box] = [b for b in boxes if b.numel]
    pairs = overlapping_pairs(nonempty)
    if pairs:
        i, j = pairs[0]
        twice = intersect(nonempty[i], nonempty[j])
        return f"elements {twice} were delivered twice ({len(pairs)} overlapping deliveries)"
    if got != total:
        return f"{total - got} of its {total} elements were never delivered{_first_gap(dest, nonempty)}"
    return None


def _first_gap(dest: Box, boxes: Sequence[Box]) -> str:
    """``", e.g. row i"`` naming one undelivered index along the first axis (for the message)."""
    if not dest.sizes:
        return ""
    covered = [0] * dest.sizes[0] if dest.sizes[0] <= 1 << 20 else None
    if covered is None:
        return ""
    row = dest.numel // dest.sizes[0] if dest.sizes[0] else 0
    for b in boxes:
        per = b.numel // b.sizes[0] if b.sizes[0] else 0
        for i in range(b.offsets[0] - dest.offsets[0], b.offsets[0] - dest.offsets[0] + b.sizes[0]):
            covered[i] += per
    for i, n in enumerate(covered):
        if n < row:
            return f" (e.g. in index {dest.offsets[0] + i} of the first axis)"
    return ""


def check_delivered(tasks: Iterable[Any], rank: int, where: str) -> None:
    """Raise :class:`StateVerificationError` unless every destination of ``tasks`` (a load's
    read tasks: ``key``, ``overlap``, ``dest`` - None when the overlap is the whole destination -
    and ``got``, the boxes delivered) was tiled exactly by what was delivered into it."""
    shared: Dict[int, Tuple[Any, List[Box]]] = {}
    for t in tasks:
        got = t.got
        if t.dest is None:  # the task's region is the whole destination (one saved chunk)
            if len(got) == 1 and (got[0] is t.overlap or got[0] == t.overlap):
                continue
            problem = tiling_problem(t.overlap, got)
            if problem:
                _undelivered(t, t.overlap, problem, rank, where)
        else:
            entry = shared.get(id(t.dest))
            if entry is None:
                shared[id(t.dest)] = (t, list(got))
            else:
                entry[1].extend(got)
    for t, boxes in shared.values():
        problem = tiling_problem(t.dest, boxes)
        if problem:
            _undelivered(t, t.dest, problem, rank, where)


def _undelivered(t: _Keyed, dest: Box, problem: str, rank: int, where: str) -> None:
    raise StateVerificationError(
        f"load of {where} on rank {rank}: tensor {t.key!r}, requested region {dest}: {problem}; "
        "nothing of this load is returned (a load never returns a region it did not fill)"
    )
