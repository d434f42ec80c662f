"""Storage-key collisions: two different items that a save would store under the same key.

A checkpoint names each stored item by its storage key: a ShardedTensor's ``key`` (one
entry per tensor in ``.metadata``, its chunks told apart by their offsets), a
ShardedObject's unique key ``<key>/shard_<offsets>_<global shape>``. Both live in one
namespace, so ``ShardedTensor("x/shard_0_1")`` beside ``ShardedObject("x")`` with shape
``(1,)`` and offset ``(0,)`` would be written as one item: the commit would succeed and
neither value could be loaded. Replicas of one item (same kind, key and place) share a
storage key legitimately; everything else that shares one is refused before anything is
written (the save raises :class:`~ckpt_integration.errors.ShardingIntegrityError`).

Pure function over :class:`~ckpt_integration.planning.shards.ShardMeta` records. Every
record of a storage key is needed to see a collision, so it runs over all gathered records
(or, with the metadata exchange partitioned by storage key, over the records a rank owns:
colliding items have the same storage key, hence the same owner).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Tuple

from .shards import ShardMeta


def storage_key_collisions(metas: Iterable[ShardMeta]) -> List[str]:
    """One message per storage key claimed by items of different kinds or keys (empty: none)."""
    owners: Dict[str, Dict[Tuple[str, str], List[int]]] = {}
    for m in metas:
        owners.setdefault(m.storage_key, {}).setdefault((m.kind, m.key), []).append(m.rank)
    return [collision_message(skey, items) for skey, items in sorted(owners.items()) if len(items) > 1]


def collision_message(storage_key: str, items: Mapping[Tuple[str, str], Iterable[int]]) -> str:
    """The problem text for one storage key claimed by several ``(kind, key)`` items (with their ranks)."""
    described = []
    for (kind, key), ranks in sorted(items.items()):
        rs = sorted(set(ranks))
        what = "ShardedTensor" if kind == "tensor" else "ShardedObject"
        described.append(f"{what} {key!r} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})")
    return f"storage key {storage_key!r} would be used by {len(items)} different items: {'; '.join(described)}"
