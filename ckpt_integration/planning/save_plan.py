"""Who writes which chunk, from every rank's records at once; and writer-thread buckets.

:func:`plan_writers` is the whole-job reference planner (deduplicate replicas,
balance the write volume), used by tests and tools that hold all records. A save
does not call it: :mod:`.exchange` decides the same things with each rank seeing
only the chunks it owns and the copies it holds.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import Dict, Iterable, List, Sequence, Tuple

from .shards import ShardMeta

ChunkId = Tuple[str, Tuple[int, ...]]


def plan_writers(shards: Iterable[ShardMeta], balance: bool = True) -> Dict[ChunkId, ShardMeta]:
    """Choose one writer per stored chunk.

    Without ``balance`` the main replica (replica_id all zeros) writes, as in
    Megatron-Core. With ``balance`` every rank holding a copy of a tensor chunk
    (with data) is a candidate, so replicas must be identical, as data parallelism keeps them and chunks are assigned largest-first to the
    least-loaded candidate (ties to the lowest rank), which spreads the bytes of
    data-parallel replicas over the whole group. Objects are always written by
    their main replica: replicas of an object need not be byte-identical.
    """
    by_chunk: Dict[ChunkId, List[ShardMeta]] = defaultdict(list)
    for s in shards:
        by_chunk[s.chunk_id].append(s)
    chosen: Dict[ChunkId, ShardMeta] = {}
    pending = []
    for cid, group in by_chunk.items():
        main = next((s for s in group if s.is_main), None)
        if main is None:
            continue  # validation reports it; nothing to write for non-main partial copies
        if not balance or main.kind == "object":
            chosen[cid] = main
        else:
            # replicas are assumed identical (as data parallelism keeps them); one without data
            # (a metadata-only non-main replica) can never write
            candidates = sorted((s for s in group if s.sizes == main.sizes and s.has_data), key=lambda s: s.rank)
            if not candidates:
                candidates = [main]  # the save reports the main replica's missing data
            pending.append((cid, main.nbytes, candidates))
    load: Dict[int, int] = defaultdict(int)
    for s in chosen.values():
        load[s.rank] += s.nbytes
    pending.sort(key=lambda p: (-p[1], p[0]))
    for cid, nbytes, candidates in pending:
        best = min(candidates, key=lambda s: (load[s.rank], s.rank))
        load[best.rank] += nbytes
        chosen[cid] = best
    return chosen


def items_for_rank(chosen: Dict[ChunkId, ShardMeta], rank: int) -> List[ShardMeta]:
    """The chunks ``rank`` must write, in a deterministic order."""
    return sorted((s for s in chosen.values() if s.rank == rank), key=lambda s: s.chunk_id)


def split_into_buckets(sizes: Sequence[int], n: int) -> List[List[int]]:
    """Indices of ``sizes`` split into ``n`` buckets of similar total (largest first)."""
    n = max(1, min(n, len(sizes)))
    if n == 1:
        return [list(range(len(sizes)))] if len(sizes) else []
    buckets: List[List[int]] = [[] for _ in range(n)]
    # the bucket with the least bytes so far (the first of equals) from a heap, not a scan per
    # item: tens of thousands of items at every save of a model with many small tensors
    heap = [(0, j) for j in range(n)]
    for i in sorted(range(len(sizes)), key=sizes.__getitem__, reverse=True):  # (stable: equals keep their order)
        total, j = heapq.heappop(heap)
        buckets[j].append(i)
        heapq.heappush(heap, (total + sizes[i], j))
    return [sorted(b) for b in buckets if b]
