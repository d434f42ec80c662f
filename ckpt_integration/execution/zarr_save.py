"""The zarr backend's part of a save's phase 1: its arrays created from the exchanged layout, and
each rank's write requests turned into whole-chunk writes (border chunks assembled by their
owners from pieces the other writers send). The rest of a save is backend-neutral
(:mod:`.save`, which registers these in ``SAVE_BACKENDS``)."""

from __future__ import annotations

import pickle
from typing import Any, Dict, List, Tuple

from ..planning.shards import ShardMeta
from ..storage.torch_dist import WriteRequest
from ..storage.zarr_backend import Piece, assemble_border_chunks, create_arrays, plan_array_writes, split_for_chunks
from ..storage.filesystem import CheckpointLocation
from . import dist
from .dist import Group
from .failure import Failure
from .objects import dumps
from .preprocess import dtype_from_name


def tensor_layouts(all_metas: List[ShardMeta]) -> Tuple[Dict[str, Any], List[str]]:
    """key -> (dtype, global shape, main-replica boxes); and the object storage keys."""
    tensors: Dict[str, Any] = {}
    objects = set()
    for m in all_metas:
        if m.kind == "object":
            objects.add(m.storage_key)
            continue
        entry = tensors.setdefault(m.key, (dtype_from_name(m.dtype), m.global_shape, []))
        if m.is_main:
            entry[2].append(m.box)
    return tensors, sorted(objects)


def create_zarr_arrays(target: CheckpointLocation, all_metas: List[ShardMeta], durable: bool) -> None:
    tensors, objects = tensor_layouts(all_metas)
    create_arrays(target, tensors, objects, durable)  # (its index first: it marks the directory as a partial save)


def zarr_chunk_requests(
    requests: List[WriteRequest],
    all_metas: List[ShardMeta],
    chosen: Dict[Any, ShardMeta],
    rank: int,
    group: Group,
    failure: Failure,
) -> List[WriteRequest]:
    """zarr: this rank's requests as whole-chunk writes (part of phase 1, collective).

    With shard-aligned chunks nothing changes. Coarser chunks (uneven shards, see
    ``chunk_shape_for``) may straddle shards of different writers; two ranks must not
    write one chunk file, so each such chunk's owner assembles it from the pieces the
    other writers send here, while the data is still at hand (before staging for an
    async save). Only ranks that have pieces for another rank send; all ranks agree on
    who that is from metadata, so a save without such chunks runs no collective.
    """
    tensors, _ = tensor_layouts(all_metas)
    writers: Dict[str, List[Any]] = {}
    for m in chosen.values():
        if m.kind != "object":
            writers.setdefault(m.key, []).append((m.box, m.rank))
    plans = plan_array_writes(tensors, writers)
    senders = sorted({r for _, _, border in plans.values() for c in border.values() for _, r in c.pieces if r != c.owner})
    pieces: List[Piece] = []
    if not failure.failed:
        with failure.capture():
            requests, pieces = split_for_chunks(requests, plans)
    owners = {(key, coords): c.owner for key, (_, _, border) in plans.items() for coords, c in border.items()}
    mine = [p for p in pieces if owners[(p[0], p[1])] == rank]
    outgoing: Dict[int, List[Piece]] = {}
    for p in pieces:
        if owners[(p[0], p[1])] != rank:
            # clone: a view would pickle the whole shard's storage
            outgoing.setdefault(owners[(p[0], p[1])], []).append((p[0], p[1], p[2], p[3].detach().cpu().clone()))
    received = exchange_pieces(outgoing, group) if senders else []
    if not failure.failed:
        with failure.capture():
            dtypes = {key: dtype for key, (dtype, _, _) in tensors.items()}
            requests = requests + assemble_border_chunks(plans, dtypes, rank, mine + received)
    return requests


def exchange_pieces(outgoing: Dict[int, List[Piece]], group: Group) -> List[Piece]:
    """Every rank's pieces to their owners (one ``all_to_all``: each piece travels only to its owner;
    pieces are small, a coarsened chunk holds under 2 MiB); returns the pieces sent to this rank.
    Pickled by :func:`.objects.dumps`, which carries tensors of every dtype (torch's own pickling of
    float8 and uint16/32/64 tensors fails on load)."""
    inbox = dist.all_to_all_bytes({r: dumps(ps) for r, ps in outgoing.items()}, group)
    return [p for src in sorted(inbox) for p in pickle.loads(inbox[src])]
