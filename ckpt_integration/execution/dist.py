"""Collectives that also work without ``torch.distributed`` (a single process).

Every save/load exchanges only small Python objects (shard metadata, error
messages); tensors never go through these helpers.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Optional[Any] = None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: Optional[Any] = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def all_gather_object(obj: Any, group: Optional[Any] = None) -> List[Any]:
    if not is_distributed() or get_world_size(group) == 1:
        return [obj]
    out: List[Any] = [None] * get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: Any, dst: int = 0, group: Optional[Any] = None) -> Optional[List[Any]]:
    """Gather to global rank ``dst``; returns the list there and ``None`` elsewhere."""
    if not is_distributed() or get_world_size(group) == 1:
        return [obj]
    out: Optional[List[Any]] = [None] * get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group: Optional[Any] = None) -> Any:
    if not is_distributed() or get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group: Optional[Any] = None) -> None:
    if is_distributed() and get_world_size(group) > 1:
        dist.barrier(group=group)


def coordinator_rank(group: Optional[Any] = None) -> int:
    """Global rank of the group's first member (writes shared files)."""
    if not is_distributed():
        return 0
    if group is None:
        return 0
    return dist.get_global_rank(group, 0)


def agree_on_errors(local_error: Optional[str], group: Optional[Any] = None) -> List[str]:
    """Every rank learns every rank's error message (``rank N: ...``); one collective."""
    errors = all_gather_object(local_error, group)
    return [f"rank {r}: {e}" for r, e in enumerate(errors) if e]


def raise_if_any_failed(local_exc: Optional[BaseException], errors: List[str], context: str) -> None:
    """Raise on every rank when any rank failed.

    A rank that failed itself re-raises its own exception (specific type, with
    the other ranks' errors attached as a note); healthy ranks raise
    :class:`DistributedCheckpointingError` listing the causes.
    """
    if not errors and local_exc is None:
        return
    from ..errors import DistributedCheckpointingError

    if local_exc is not None:
        if hasattr(local_exc, "add_note"):
            from torch.distributed import get_rank

            me = f"rank {get_rank()}: " if is_distributed() else ""
            others = "; failing ranks:\n  " + "\n  ".join(errors) if len(errors) > 1 else ""
            local_exc.add_note(me + context + others)
        raise local_exc
    raise DistributedCheckpointingError(f"{context}:\n  " + "\n  ".join(errors))
