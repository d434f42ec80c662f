"""Pure planning for the memory tier: who keeps copies of whose snapshot, and where a restore reads.

No I/O, no collectives: functions over ranks and inventories, unit-testable on their own.

**Replication** follows NVIDIA Resiliency Extension's ``CliqueReplicationStrategy`` with
``replication_jump = ranks_per_node`` and ``replication_factor = replicas``: nodes (blocks of
``ranks_per_node`` consecutive ranks, as torchrun and SLURM number them) form *replica groups*
of ``replicas`` consecutive nodes, and the rank with local index ``l`` on a node sends its
snapshot to the rank with the same local index on every other node of its group. A group is
the failure domain: the tier survives the loss of up to ``replicas - 1`` nodes of every group.
Where the node count is not a multiple of ``replicas`` (NVRx refuses that), the last group
takes the remaining nodes and each of its nodes sends to the next ``replicas - 1`` nodes of the
group in a ring, so copies still land on distinct nodes and every node holds the same number.
A job with fewer nodes than ``replicas`` (restarted smaller after losing nodes) keeps one copy
per node (``ReplicationPlan.replicas``; ``asked`` keeps what was asked for).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from ..errors import MemoryCheckpointError

__all__ = ["ReplicationPlan", "CopyLocation", "replication_plan", "choose_sources"]


@dataclass(frozen=True)
class ReplicationPlan:
    """Where every rank's snapshot is kept: ``holders[r]`` are the peer ranks (on other nodes)
    that keep a copy of rank ``r``'s snapshot besides ``r`` itself."""

    world_size: int
    ranks_per_node: int
    replicas: int  # copies kept, the owner's included (at most the number of nodes)
    holders: Tuple[Tuple[int, ...], ...]
    asked: int = 0  # the replicas asked for (more than the nodes of a job restarted on fewer)

    def node_of(self, rank: int) -> int:
        """Index of the node ``rank`` runs on (``rank // ranks_per_node``)."""
        return rank // self.ranks_per_node

    def held_by(self, rank: int) -> Tuple[int, ...]:
        """The owners whose copies ``rank`` keeps (its own snapshot not included)."""
        return tuple(o for o, hs in enumerate(self.holders) if rank in hs)

    def group_of(self, rank: int) -> Tuple[int, ...]:
        """The nodes of ``rank``'s replica group (its failure domain)."""
        node = self.node_of(rank)
        return tuple(sorted({node} | {self.node_of(h) for h in self.holders[rank]}))


def replication_plan(world_size: int, ranks_per_node: int, replicas: int) -> ReplicationPlan:
    """The copies of every rank's snapshot (see the module docstring).

    Example: ``replication_plan(4, 2, 2).holders == ((2,), (3,), (0,), (1,))``.
    """
    if world_size < 1 or ranks_per_node < 1:
        raise ValueError(f"world_size and ranks_per_node must be >= 1, got {world_size} and {ranks_per_node}")
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1 (1 = no peer copy), got {replicas}")
    if world_size % ranks_per_node:
        raise MemoryCheckpointError(
            f"world size {world_size} is not a multiple of ranks_per_node={ranks_per_node}: the memory tier needs "
            "the same number of ranks on every node (pass ranks_per_node, default LOCAL_WORLD_SIZE)"
        )
    nodes = world_size // ranks_per_node
    asked = replicas
    replicas = min(replicas, nodes)  # copies on distinct nodes: as many as the nodes allow (a smaller restart)
    groups: List[List[int]] = [list(range(g, g + replicas)) for g in range(0, nodes - nodes % replicas, replicas)]
    if nodes % replicas:
        groups[-1].extend(range(nodes - nodes % replicas, nodes))  # the remainder joins the last group
    holders: List[Tuple[int, ...]] = [()] * world_size
    for group in groups:
        size = len(group)
        for j, node in enumerate(group):
            targets = [group[(j + i) % size] for i in range(1, replicas)]
            for local in range(ranks_per_node):
                rank = node * ranks_per_node + local
                holders[rank] = tuple(t * ranks_per_node + local for t in targets)
    return ReplicationPlan(world_size, ranks_per_node, replicas, tuple(holders), asked)


@dataclass(frozen=True)
class CopyLocation:
    """One copy of an owner's snapshot of one step: on the node whose memory id is ``node``,
    visible to ``ranks`` (the ranks running there now)."""

    owner: int
    node: str
    ranks: Tuple[int, ...]


def choose_sources(
    owners: Iterable[int],
    copies: Mapping[int, Sequence[CopyLocation]],
    refused: Set[Tuple[int, str]] = frozenset(),  # type: ignore[assignment]
) -> Tuple[Dict[int, Tuple[str, int]], List[int]]:
    """Pick, for every owner, the copy to restore from and the rank that reads it.

    Returns ``({owner: (node, serving rank)}, [owners without any usable copy])``. A copy on
    the owner's own node is read by the owner itself (no transfer); otherwise a peer copy is
    served by the rank of that node with the fewest assignments so far (ties: lowest rank),
    so the transfers spread over nodes. ``refused`` are ``(owner, node)`` copies that failed
    verification before. Deterministic for a given input, so every rank computes the same.
    """
    chosen: Dict[int, Tuple[str, int]] = {}
    missing: List[int] = []
    load: Dict[int, int] = {}
    pending: List[int] = []
    for owner in sorted(set(owners)):
        usable = [c for c in copies.get(owner, ()) if (owner, c.node) not in refused and c.ranks]
        own = [c for c in usable if owner in c.ranks]
        if own:
            chosen[owner] = (sorted(own, key=lambda c: c.node)[0].node, owner)
        elif usable:
            pending.append(owner)
        else:
            missing.append(owner)
    for owner in pending:
        best: Optional[Tuple[int, int, str]] = None
        for c in copies[owner]:
            if (owner, c.node) in refused or not c.ranks:
                continue
            for r in c.ranks:
                cand = (load.get(r, 0), r, c.node)
                if best is None or cand < best:
                    best = cand
        assert best is not None
        load[best[1]] = load.get(best[1], 0) + 1
        chosen[owner] = (best[2], best[1])
    return chosen, missing
