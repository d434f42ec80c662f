"""DTensor parameters (``torch.distributed.tensor``) as ShardedTensors: a ``Shard(dim)`` /
``Replicate`` placement on a DeviceMesh (uneven shards included) becomes a ShardedTensor at its
global offset, and the mesh coordinates a tensor does not vary along become its replica id.
Used by :mod:`.modules` (the default ``sharded_state_dict``), the optimizer state and FSDP2."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Optional, Tuple

from .mapping import ReplicaId, ShardedTensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

__all__ = ["dtensor_to_sharded_tensor", "is_dtensor", "mesh_replica_index"]


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (False where torch has none)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _dtensor_local_offset(dt: DTensor) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(local shape, global offset) of this rank's shard, as torch computes them (uneven too)."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
        return tuple(shape), tuple(offset)
    except ImportError:  # pragma: no cover - fallback for other torch versions: Shard(dim) only, once per dim
        from torch.distributed.tensor import Shard

        coord = dt.device_mesh.get_coordinate()
        offset = [0] * dt.ndim
        for mesh_dim, pl in enumerate(dt.placements):
            if isinstance(pl, Shard):
                n = dt.device_mesh.size(mesh_dim)
                size = dt.shape[pl.dim]
                chunk = math.ceil(size / n)
                offset[pl.dim] += min(chunk * coord[mesh_dim], size)
        return tuple(dt.to_local().shape), tuple(offset)


def _is_shard_placement(pl: Placement) -> bool:
    """``Shard(dim)``, or ``_StridedShard`` (FSDP2 over tensor-parallel params: the data-parallel split
    of a TP shard, still one contiguous block per rank, as torch's offset computation gives it)."""
    from torch.distributed.tensor import Shard

    if isinstance(pl, Shard):
        return True
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover
        return False
    return isinstance(pl, _StridedShard)


def dtensor_to_sharded_tensor(key: str, dt: DTensor, extra_replica_id: Optional[int] = None) -> Optional[ShardedTensor]:
    """A ShardedTensor for this rank's shard of a DTensor (``None`` if the local shard is empty).

    Global offsets come from the mesh coordinates and ``Shard(dim)`` placements
    (uneven shards as torch makes them; FSDP2 + TP's ``_StridedShard`` too); the ``replica_id`` is the tuple of this
    rank's coordinates on the mesh dims with ``Replicate`` placement (plus
    ``extra_replica_id`` if given), so each element has exactly one main replica.
    ``Partial`` placements are refused (reduce first).
    """
    from torch.distributed.tensor import Replicate

    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    rid: List[int] = []
    for mesh_dim, pl in enumerate(dt.placements):
        if isinstance(pl, Replicate):
            rid.append(int(coord[mesh_dim]))
        elif not _is_shard_placement(pl):
            raise ValueError(f"{key!r}: DTensor placement {pl} cannot be checkpointed; redistribute to Shard/Replicate")
    if extra_replica_id is not None:
        rid.append(int(extra_replica_id))
    local = dt.to_local().detach()
    if local.numel() == 0:
        return None
    shape, offset = _dtensor_local_offset(dt)
    if tuple(shape) != tuple(local.shape):
        raise ValueError(
            f"{key!r}: the local shard of DTensor {tuple(dt.shape)} with placements {tuple(dt.placements)} has shape "
            f"{tuple(local.shape)}, but torch computes {tuple(shape)} at offset {tuple(offset)}; it is not one "
            "block of the global tensor and cannot be checkpointed (redistribute to Shard/Replicate)"
        )
    replica: ReplicaId = tuple(rid) if rid else 0
    return ShardedTensor.from_global_offsets(key, local, tuple(dt.shape), offset, replica_id=replica)


def mesh_replica_index(dt: DTensor, mesh: DeviceMesh) -> Optional[int]:
    """Which copy of ``dt``'s device mesh this rank is in, within the larger ``mesh``.

    A DTensor on a sub-mesh (e.g. FSDP2 on the ``data_parallel`` dims of a 2-D mesh, for a
    parameter that tensor parallelism left alone) is replicated along the other dims of
    ``mesh``: the result is this rank's coordinate on those dims (row-major), 0 on exactly
    one copy. ``None`` if ``dt``'s mesh spans ``mesh`` (nothing replicated outside it) or
    this rank is not in ``mesh``.
    """
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    full = mesh.mesh
    sub = [int(r) for r in dt.device_mesh.mesh.flatten().tolist()]
    positions = [(full == r).nonzero() for r in sub]
    positions = [p[0].tolist() for p in positions if len(p)]
    if not positions:
        return None
    extra, found = 0, False
    for d in range(full.ndim):
        if full.size(d) > 1 and len({p[d] for p in positions}) == 1:  # dt's mesh does not vary along d
            extra = extra * full.size(d) + int(coord[d])
            found = True
    return extra if found else None
