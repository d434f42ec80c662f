"""Resharding: which parts of which saved chunks fill a requested shard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .boxes import Box, clip_to_shape, intersect


@dataclass(frozen=True)
class ChunkRead:
    """Copy ``overlap`` (global coordinates) from saved ``chunk`` into the request."""

    chunk: Box
    overlap: Box


def plan_chunk_reads(request: Box, saved_chunks: Sequence[Box]) -> List[ChunkRead]:
    """Overlaps of ``request`` with every saved chunk (chunks never overlap each other)."""
    reads = []
    for chunk in saved_chunks:
        common = intersect(request, chunk)
        if common is not None:
            reads.append(ChunkRead(chunk, common))
    return reads


def uncovered_elements(request: Box, saved_global_shape: Sequence[int], reads: Sequence[ChunkRead]) -> int:
    """Elements of the request inside the saved tensor that no read fills (0 when complete)."""
    inside: Optional[Box] = clip_to_shape(request, saved_global_shape)
    want = inside.numel if inside is not None else 0
    return want - sum(r.overlap.numel for r in reads)


def request_box(offsets: Tuple[int, ...], sizes: Tuple[int, ...]) -> Box:
    return Box(tuple(offsets), tuple(sizes))
