"""Warn when the common state differs between ranks (it is saved from rank 0 only).

Megatron-Core broadcasts rank 0's common state at every save and diffs it on every
other rank. Here each rank hashes its common state and one all-reduce of 5 integers
(the maximum of the digest and of its negation: equal everywhere iff max == min)
decides, at a cost that does not grow with the number of ranks; rank 0's common state travels (one broadcast) only when some digest
differs, and then each differing rank logs, in Megatron-Core's sentence, which keys exist
only on rank 0, only on that rank, or differ (with both types). Nothing is raised: rank 0's copy is
what gets saved, as in Megatron-Core.
"""

from __future__ import annotations

import hashlib
import io
import logging
import pickle
from typing import Any, Callable, Optional

import torch

from ..dict_utils import diff
from ..mapping import StateDict
from . import dist
from .dist import Group

logger = logging.getLogger(__name__)


def _comparable(x: object) -> Any:
    """The common state with every DTensor replaced by its local tensor: comparing or pickling
    a DTensor may run collectives, which only some ranks would enter here."""
    if isinstance(x, dict):
        return {k: _comparable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_comparable(v) for v in x) if type(x) in (list, tuple) else x
    if type(x).__name__ == "DTensor" and hasattr(x, "to_local"):
        return x.to_local()
    return x


def _digest(common: object) -> Optional[bytes]:
    """A hash of the pickled common state; ``None`` if it cannot be pickled (then the save
    itself reports it) so that every rank still takes part in the collectives below."""
    try:
        return hashlib.blake2b(pickle.dumps(common, protocol=4), digest_size=16).digest()
    except Exception:  # noqa: BLE001 - reported by the save, not by this check
        return None


def check_common_consistency(
    common: StateDict, group: Group = None, preprocess: Optional[Callable[[Any], Any]] = None
) -> None:
    """Collective: log on every rank != 0 how its common state differs from rank 0's.

    ``preprocess`` (Megatron-Core's ``preprocess_common_before_consistancy_check``) maps
    the common state to what is compared, e.g. to drop keys expected to differ; it must
    not modify its argument. Costs one hash per rank and one all-reduce of 5 integers when
    the states agree.
    """
    if dist.get_world_size(group) == 1:
        return
    view = _comparable(preprocess(common) if preprocess is not None else common)
    mine = _digest(view)
    parts = [0, 0] if mine is None else [int.from_bytes(mine[i : i + 7], "little") for i in (0, 7)]
    top = dist.all_reduce_ints([1 if mine is None else 0, *parts, *(-x for x in parts)], "max", group)
    if not top[0] and top[1] == -top[3] and top[2] == -top[4]:
        return  # every rank has rank 0's digest
    rank = dist.get_rank(group)
    payload = None
    if rank == 0:
        try:
            buf = io.BytesIO()
            torch.save(view, buf)
            payload = (mine, buf.getvalue())
        except Exception:  # noqa: BLE001 - the save reports an unpicklable common state
            payload = None
    payload = dist.broadcast_object(payload, src=dist.coordinator_rank(group), group=group)
    if rank == 0 or payload is None or payload[0] is None or mine == payload[0]:
        return
    payload = payload[1]
    # rank 0's common state, from this job: trusted like the local one
    rank0 = torch.load(io.BytesIO(payload), weights_only=False)
    only_rank0, only_here, mismatch = diff(rank0, view)
    if only_rank0 or only_here or mismatch:
        # Megatron-Core's sentence as it words it; what it means for the save on a line of its own
        logger.warning(
            "Rank %d common state dict differs from rank 0 common state dict. Keys only on rank 0: %s, "
            "Keys only on %d: %s, Mismatched keys: %s\n(only rank 0's common state is saved)",
            rank, only_rank0, rank, only_here, mismatch,
        )
