"""A load's request, checked: the request check across ranks (``validate_access_integrity``) and
strict handling of keys requested but not in the checkpoint, or in it but requested by no rank.

Split from :mod:`.load`, which calls these in order: plan the reads, :func:`check_request`, then
:func:`requested_by_any_rank` and :func:`strict_after_check` for a ``*_all`` strict mode.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Iterable, List, Optional, Protocol, Set, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import STORAGE_TYPES, Metadata, TensorStorageMetadata

from ..dict_utils import nested_values
from ..errors import CheckpointingException, KeyNotInCheckpointError, MismatchError
from ..mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from ..planning.exchange import Routed
from ..planning.strict import StrictHandling, mismatch_message, mismatched_keys, object_keys
from ..storage.opened import EMBEDDED_COMMON_KEY
from ..storage.chunk_index import checkpoint_keys
from ..storage.filesystem import canonical
from . import dist
from .dist import Group
from . import exchange
from .failure import Failure
from .preprocess import memory_problem

logger = logging.getLogger(__name__)


class LoadJob(Protocol):
    """The local part of a load (``load._LoadJob``) as far as the checks here read and record it."""

    index_identity: int
    request_rows: Optional[List[Tuple[int, int, int, int]]]
    missing: Set[str]
    unexpected: Set[str]


def request_key(sh: Union[ShardedTensor, ShardedObject]) -> str:
    return sh.unique_key if isinstance(sh, ShardedObject) else sh.key


def object_storage_keys(shards: Iterable[Any], md: Metadata) -> Set[str]:
    """The storage keys of objects, requested in ``shards`` or stored in the checkpoint ``md`` describes
    (a strict mode compares those by their object's key, tensors' keys as they are)."""
    return object_keys(md) | {s.unique_key for s in shards if isinstance(s, ShardedObject)}


def drop_keys(sharded: object, keys: Set[str]) -> Any:
    """Remove requested shards whose storage key is in ``keys``."""
    if isinstance(sharded, dict):
        out = {}
        for k, v in sharded.items():
            if isinstance(v, (dict, list)):
                sub = drop_keys(v, keys)
                if sub:
                    out[k] = sub
            elif request_key(v) not in keys and v.key not in keys:  # (objects are reported by key)
                out[k] = v
        return out
    return sharded


def handle_strict(
    strict: StrictHandling, missing: Set[str], unexpected: Set[str], checkpoint_dir: str, rank: int
) -> None:
    """Raise or log a key mismatch, in Megatron-Core's words followed by ours."""
    report_missing = StrictHandling.requires_global_app_metadata(strict)
    missing = missing if report_missing else set()
    if not missing and not unexpected:
        return
    if strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
        error = KeyNotInCheckpointError if unexpected else MismatchError
        raise error(mismatch_message(missing, unexpected, f"rank {rank}, {checkpoint_dir}"))
    if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
        logger.warning("%s (skipped)", mismatch_message(missing, unexpected, f"rank {rank}, {checkpoint_dir}"))


def check_directory(ck: Any, coordinator_path: str) -> None:
    """Raise :class:`MismatchError` when this rank was given another directory than the one the
    coordinator opened for the job: its files would be read against the coordinator's manifest (and
    called damaged, or, unverified, returned as they are)."""
    mine = canonical(ck)
    if coordinator_path and mine != coordinator_path:
        raise MismatchError(f"this rank loads {mine!r}, but the coordinator opened {coordinator_path!r} for the "
                            "load: every rank of the group must pass the same directory")


def check_request(job: Optional[LoadJob], routed: Optional[Routed], shards: List[Any], identity: object,
                  failure: Failure, group: Group, checkpoint_dir: Union[str, os.PathLike], arguments: str = "") -> None:
    """The request check (``validate_access_integrity``), collective; raises on every rank when some
    rank failed before it or the request is invalid. Skipped when every rank requests what it
    requested at the last load checked ("plan once, reuse", as saves do: an evaluation job loading
    each new checkpoint into the same model); by counting when every rank requests whole saved
    chunks (``exchange.check_whole_chunks``); otherwise, or to name what counting found, the
    general check of shard records (``exchange.run``). ``arguments``: the load's options that every rank
    must pass alike (those that decide its collectives); the directory is added here."""
    context = f"load of {checkpoint_dir} failed"
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    whole = job.index_identity if job is not None and job.request_rows is not None else None
    cached, all_whole = exchange.start_load(routed, whole, failure, group, context, _arguments(checkpoint_dir, arguments))
    if cached is not None:
        return
    found = exchange.check_whole_chunks(job.request_rows, group, context, identity) if all_whole else None
    if all_whole and found is None:
        return
    # (start_load raised on every rank if any failed above)
    metas, routed, late = exchange.routes_after_change([], routed, shards, rank, world, "load")
    header = f"invalid sharding of the load request for {checkpoint_dir}"
    exchange.run(
        metas, routed, group, replies=False, purpose="load", context=context, problems_header=header,
        identity=identity, failure=late,
    )
    if found is not None:  # (the general check names what counting finds: this is a safety net)
        exchange.forget_plans("load")
        exchange.raise_problems(found, group, header)


def agree_arguments(failure: Failure, group: Group, checkpoint_dir: Union[str, os.PathLike], arguments: str) -> None:
    """What a load without the request check agrees on, collective: every rank's failure so far (raised
    on every rank) and the options that decide the collectives that follow (:class:`MismatchError` on
    every rank when they differ). The same first collective as :func:`check_request`'s, so ranks that
    differ in ``validate_access_integrity`` itself meet in it (and raise) instead of aborting in
    collectives of other sizes. (The directory is compared when the checkpoint is opened: a failure here.)"""
    exchange.start_load(None, None, failure, group, f"load of {checkpoint_dir} failed", arguments)


def _arguments(checkpoint_dir: Union[str, os.PathLike], arguments: str) -> str:
    # (the coordinator opened its path for every rank: a rank given another would read its files
    # against the coordinator's manifest, and report them as damaged)
    return f"checkpoint_dir={canonical(checkpoint_dir)!r}, {arguments}"


def skip_incomplete_factories(result: Any, factories: Any, template: Any, unexpected: Set[str]) -> None:
    """In a strict mode that skips keys not in the checkpoint (``unexpected``): leave out of ``result``
    and ``factories`` (in place) every factory that built such a key, as its ``merge_fn`` cannot
    merge a part that was not loaded (a fused layer added since the save); its keys are reported
    with the others. A factory inside a list cannot be left out of it: its merge raises, naming it."""
    if not unexpected:
        return
    for k, f in list(factories.items()):
        sub = template.get(k) if isinstance(template, dict) else (
            template[k] if isinstance(template, list) and k < len(template) else None)
        if isinstance(f, ShardedTensorFactory):
            built = {v.key for v in nested_values(sub) if isinstance(v, (ShardedTensor, ShardedObject))}
            if built & unexpected and isinstance(result, dict):
                result.pop(k, None)
                del factories[k]
        elif isinstance(f, dict):
            inner = result.get(k) if isinstance(result, dict) else (
                result[k] if isinstance(result, list) and k < len(result) else None)
            skip_incomplete_factories(inner if inner is not None else {}, f, sub, unexpected)
            if not f:  # (nothing left to merge there)
                del factories[k]


def strict_after_check(job: LoadJob, strict: StrictHandling, req: Any, requested_global: Set[str],
                       checkpoint_dir: Union[str, os.PathLike], rank: int) -> None:
    """A ``*_all`` strict mode for reads planned before the ranks' requests were combined: the
    missing keys, and the mismatch raised or logged as when planning follows (unexpected keys were
    left out of the plan). ``req``: the load's request (its ``requested`` keys, ``shards``, ``md``)."""
    missing, _ = mismatched_keys(req.requested, requested_global, checkpoint_keys(req.md),
                                 object_storage_keys(req.shards, req.md))
    # the common state stored as an object in the data (Megatron-Core 0.19's layout; save(...,
    # common_state_in_data=True)) is what every load returns as the common state, not a key to request
    missing.discard(EMBEDDED_COMMON_KEY)
    handle_strict(strict, missing, job.unexpected, checkpoint_dir, rank)
    job.missing = missing


def requested_by_any_rank(ckpt_keys: List[str], requested: List[str], group: Group) -> Set[str]:
    """Checkpoint keys some rank requests: an OR all-reduce of one bit per key (not the keys themselves)."""
    position = {k: i for i, k in enumerate(ckpt_keys)}
    bits = bytearray((len(ckpt_keys) + 7) // 8)
    for k in requested:
        i = position.get(k)
        if i is not None:
            bits[i >> 3] |= 1 << (i & 7)
    merged = dist.any_of_bits(bytes(bits), group)
    return {k for i, k in enumerate(ckpt_keys) if merged[i >> 3] >> (i & 7) & 1}


_CASTS: Dict[Tuple[torch.dtype, torch.dtype], bool] = {}


def _castable(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether torch copies ``a`` values into ``b`` (not between bit or packed dtypes), asked once per pair."""
    ok = _CASTS.get((a, b))
    if ok is None:
        try:
            torch.empty(1, dtype=b).copy_(torch.zeros(1, dtype=a))
            ok = True
        except (RuntimeError, NotImplementedError, TypeError):
            ok = False
        _CASTS[(a, b)] = ok
    return ok


def check_against_saved(sh: ShardedTensor, tmeta: Optional[STORAGE_TYPES], checkpoint_dir: Union[str, os.PathLike],
                        strict_dtype: bool) -> Any:
    """A requested tensor against its saved metadata ``tmeta`` (None: not saved): key, a destination
    with memory (not on the meta device), kind, dtype
    (a cast is allowed unless ``strict_dtype`` or it would drop an imaginary part), global shape and
    number of dims; returns the saved dtype. Raises naming the key."""
    if tmeta is None:
        raise KeyNotInCheckpointError(f"{checkpoint_dir}: tensor {sh.key!r} is not in the checkpoint")
    if sh.data is not None:
        if sh.data.is_meta:  # (a copy into it does nothing: the load would return no data)
            raise MismatchError(f"{checkpoint_dir}: the destination of {sh.key!r} is on the meta device, which holds no "
                                "data to load into; materialize the module first (e.g. module.to_empty(device=...))")
        problem = memory_problem(sh.data)
        if problem:  # (its memory would be written as if it held the plain values)
            raise MismatchError(f"{checkpoint_dir}: the destination of {sh.key!r} is {problem}; load into a plain tensor")
    if not isinstance(tmeta, TensorStorageMetadata):
        raise MismatchError(f"{checkpoint_dir}: {sh.key!r} is stored as an object, not a tensor")
    saved_dtype = tmeta.properties.dtype
    saved_shape = tmeta.size
    if saved_dtype != sh.dtype and (strict_dtype or (saved_dtype.is_complex and not sh.dtype.is_complex)
                                    or not _castable(saved_dtype, sh.dtype)):
        why = ("strict_dtype=True" if strict_dtype else "a cast would drop the imaginary part"
               if saved_dtype.is_complex and not sh.dtype.is_complex else "torch has no cast between them")
        raise MismatchError(
            f"{checkpoint_dir}: tensor {sh.key!r} is saved as {saved_dtype} but requested as {sh.dtype} ({why}); "
            "request it with the saved dtype"
        )
    if saved_shape != sh.global_shape and not sh.allow_shape_mismatch:
        raise MismatchError(
            f"{checkpoint_dir}: tensor {sh.key!r} has global shape {tuple(saved_shape)} in the checkpoint but "
            f"{sh.global_shape} was requested (set allow_shape_mismatch=True to load the overlap)"
        )
    if len(saved_shape) != len(sh.global_shape):
        raise MismatchError(
            f"{checkpoint_dir}: tensor {sh.key!r} has {len(saved_shape)} dims in the checkpoint but "
            f"{len(sh.global_shape)} were requested"
        )
    return saved_dtype


def counts(rank: int, **given: Tuple[Any, int]) -> Tuple[List[int], Optional[CheckpointingException]]:
    """Each ``name=(value, default)`` as a count (None: the default), and the error naming the others."""
    out, bad = [], []
    for name, (v, default) in given.items():
        ok = v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= (name != "memory_budget"))
        out.append(default if v is None or not ok else v)
        if not ok:
            bad.append(f"{name} must be a {'non-negative' if name == 'memory_budget' else 'positive'} integer "
                       f"(or None for the default), got {v!r}")
    return out, CheckpointingException(f"load on rank {rank}: {'; '.join(bad)}") if bad else None
