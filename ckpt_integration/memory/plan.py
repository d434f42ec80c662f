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

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from ..errors import MemoryCheckpointError, format_size
from ..flat_ranges import flat_range_to_boxes
from ..planning.boxes import Box, intersect

__all__ = ["ReplicationPlan", "CopyLocation", "SavedPiece", "replication_plan", "choose_sources", "memory_clashes",
           "space_problem", "saved_pieces", "cover", "block_hull"]


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


def group_ranks_per_node(global_ranks: Sequence[int], local_world_size: int) -> int:
    """Ranks per node of a group whose members are ``global_ranks`` (in group order), on a job whose
    nodes run ``local_world_size`` consecutive global ranks each (a data-parallel group ``{0, 2}`` of
    2 ranks per node: 1). The plan numbers nodes by blocks of group ranks, so the members on one node
    must be consecutive in the group, and equally many on every node.

    Example: ``group_ranks_per_node([1, 3, 5, 7], 4) == 2``."""
    nodes = [g // local_world_size for g in global_ranks]
    size = nodes.count(nodes[0]) if nodes else 1
    blocks = [nodes[i:i + size] for i in range(0, len(nodes), size)]
    if any(len(set(b)) != 1 or len(b) != size for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
        raise MemoryCheckpointError(
            f"the process group's ranks {list(global_ranks)} do not sit on the nodes in blocks of equal size (node "
            f"= global rank // LOCAL_WORLD_SIZE={local_world_size}): pass ranks_per_node, or a group ordered node by node")
    return size


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


def memory_clashes(plan: ReplicationPlan, identities: Sequence[str], directories: Sequence[str]) -> Optional[str]:
    """Why copies would sit in their owners' own memory (``identities[r]``: the memory rank ``r``'s
    directory is in), or ``None``: a copy there protects nothing and overwrites its owner's records."""
    clashes = [(r, h) for r in range(plan.world_size) for h in plan.holders[r] if identities[h] == identities[r]]
    if not clashes:
        return None
    shown = "; ".join(f"rank {r}'s copy on rank {h}" for r, h in clashes[:6]) + (" ..." if len(clashes) > 6 else "")
    return (f"memory tier: copies would be kept in the same memory as their owners ({shown}: both in "
            f"{directories[clashes[0][1]]}, {identities[clashes[0][0]]}); ranks_per_node={plan.ranks_per_node} puts "
            "ranks of one host's memory on different nodes, or several nodes were given one directory. Pass the ranks "
            "per node the job really has (LOCAL_WORLD_SIZE), and each node its own shared-memory directory")


def space_problem(plan: ReplicationPlan, rank: int, sizes: Sequence[int], free: int, directory: str) -> Optional[str]:
    """Why ``rank``'s node lacks room for 2 slots of the snapshots it holds (its ranks' own and the
    copies they keep; ``sizes[r]``: bytes of rank ``r``'s snapshot; ``free``: bytes it can use), or ``None``."""
    mine = [r for r in range(plan.world_size) if plan.node_of(r) == plan.node_of(rank)]
    held = set(mine) | {o for r in mine for o in plan.held_by(r)}
    need = 2 * sum(sizes[o] for o in held)
    if need <= free:
        return None
    return (f"node {plan.node_of(rank)} ({directory}, ranks {mine[0]}-{mine[-1]}): needs {format_size(need)} for 2 "
            f"slots of {len(mine)} own and {len(held) - len(mine)} peer snapshots, {format_size(free)} free")


# --------------------------------------------------------------------------- elastic restore
@dataclass(frozen=True)
class SavedPiece:
    """A rectangle of a saved shard in global coordinates (``box``) and where its elements sit
    in the owner's region ``region``: the first at element ``base`` from the region's start,
    then ``strides`` elements per step along each global axis (0 on prepended axes)."""

    owner: int
    region: int
    dtype: str
    box: Box
    base: int
    strides: Tuple[int, ...]

    def extent(self, part: Box) -> Tuple[int, int]:
        """Elements ``[first, last + 1)`` of the region that ``part`` (inside :attr:`box`) spans."""
        first = self.base + sum((p - b) * s for p, b, s in zip(part.offsets, self.box.offsets, self.strides))
        return first, first + sum((n - 1) * s for n, s in zip(part.sizes, self.strides)) + 1


def saved_pieces(owner: int, entry: Mapping[str, Any]) -> List[SavedPiece]:
    """The rectangles of a snapshot record's tensor entry (a flattened shard is cut as
    :func:`~ckpt_integration.flat_ranges.flat_range_to_boxes` cuts it; each rectangle's elements
    are a row-major run of the flat tensor)."""
    p = int(entry["prepend_axis_num"])
    goff, local = tuple(entry["global_offset"]), tuple(entry["local_shape"])
    size, stride = list(entry["size"]), list(entry["stride"])
    fr = entry["flattened_range"]
    if fr is None:
        return [SavedPiece(owner, int(entry["region"]), entry["dtype"], Box(goff, (1,) * p + local),
                           int(entry["elem_offset"]), (0,) * p + tuple(int(s) for s in stride))]
    step = int(stride[0]) if size and size[0] > 1 else 1
    out, pos = [], 0
    for off, sz in flat_range_to_boxes(local, int(fr[0]), int(fr[1])):
        row_major = [math.prod(sz[i + 1:]) * step for i in range(len(sz))]
        box = Box(goff[:p] + tuple(g + o for g, o in zip(goff[p:], off)), (1,) * p + tuple(sz))
        out.append(SavedPiece(owner, int(entry["region"]), entry["dtype"], box, int(entry["elem_offset"]) + pos * step,
                              (0,) * p + tuple(row_major)))
        pos += math.prod(sz)
    return out


def cover(request: Box, candidates: Sequence[SavedPiece]) -> Tuple[List[Tuple[SavedPiece, Box]], int]:
    """Which saved pieces fill ``request``: ``([(piece, overlap)], elements left uncovered)``.

    Candidates are taken in order; one overlapping a part already taken (a replica saved under
    another shard layout) is skipped, so every element is copied once."""
    taken: List[Tuple[SavedPiece, Box]] = []
    for c in candidates:
        ov = intersect(request, c.box)
        if ov is None or any(intersect(ov, o) is not None for _, o in taken):
            continue
        taken.append((c, ov))
    return taken, request.numel - sum(o.numel for _, o in taken)


def block_hull(lo: int, hi: int, nbytes: int, block: int) -> Tuple[int, int]:
    """``[lo, hi)`` widened to whole digest blocks of a region of ``nbytes`` (what can be verified)."""
    return lo // block * block, min(nbytes, -(-hi // block) * block)
