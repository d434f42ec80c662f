"""Turning a user's sharded state dict into shards, common state and shard metadata.

Shared by save and load. The caller's dict is never modified: containers are
copied before factories are applied.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as tdist

from ..dict_utils import dict_list_map_inplace, dict_list_map_outplace, extract_matching_values, nested_items
from ..errors import CheckpointingException
from ..foreign import convert_foreign, refuse_sharded_looking
from ..mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    extract_factories,
    is_sharded,
    note_built_factories,
)
from ..planning.dtypes import dtype_from_name, dtype_name, element_size  # noqa: F401 - used here and re-exported
from ..planning.shards import ShardMeta, replica_tuple
from . import dist


_MAIN = (0,)


def layout_problem(t: torch.Tensor) -> Optional[str]:
    """Why ``t`` has no plain strided memory holding its values (sparse, nested, quantized, opaque
    MKL-DNN), or None: neither a save nor a load can take such a tensor's memory."""
    if t.layout is not torch.strided or t.is_nested:
        return f"a {'nested' if t.is_nested else t.layout} tensor: only dense tensors are stored (use .to_dense())"
    if t.is_quantized:
        return "a quantized tensor: store its dequantize() (or int_repr() and its scales)"
    if t.dtype in _SUB_BYTE:  # (torch.save knows no such dtype: the save failed deep inside, naming no key)
        return f"of dtype {t.dtype}, whose elements are smaller than a byte: store the packed uint8 tensor it is made from"
    return None


_SUB_BYTE = frozenset(getattr(torch, f"{sign}int{bits}") for sign in ("", "u") for bits in range(1, 8)
                      if isinstance(getattr(torch, f"{sign}int{bits}", None), torch.dtype))


def memory_problem(t: torch.Tensor) -> Optional[str]:
    """Why a load cannot write ``t``'s memory as its values, or None: :func:`layout_problem`, a
    conjugate or negative view (its bytes hold the values before the flip), an expanded tensor
    (elements sharing memory). (A save resolves the views and copies expanded data.)"""
    problem = layout_problem(t)
    if problem:
        return problem
    if t.is_conj() or t.is_neg():
        return "a conjugate or negative view: its memory holds the values before the flip (use .resolve_conj() / .resolve_neg())"
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        return "an expanded tensor: several of its elements share one memory location (use .clone())"
    return None


def shard_meta(sh: ShardedBase, rank: int) -> ShardMeta:
    if isinstance(sh, ShardedTensor):
        rid = sh.replica_id
        return ShardMeta.of_tensor(
            sh.key,
            rank,
            dtype_name(sh.dtype),
            sh.global_shape,
            sh.global_offset,
            sh.saved_shape(),
            _MAIN if rid == 0 and type(rid) is int else replica_tuple(rid),
            math.prod(sh.local_shape) * element_size(sh.dtype),
            sh.allow_shape_mismatch,
            sh.data is not None,
        )
    if isinstance(sh, ShardedObject):
        return ShardMeta(
            key=sh.key,
            kind="object",
            rank=rank,
            dtype="object",
            global_shape=sh.global_shape,
            offsets=sh.global_offset,
            sizes=tuple(1 for _ in sh.global_shape),
            replica_id=replica_tuple(sh.replica_id),
            nbytes=0,
        )
    raise CheckpointingException(f"unsupported sharded value {type(sh).__name__}")


def shards_identity(shards: List[ShardedBase], rank: int, world: int, options: str = "") -> Any:
    """The shards' description as values compared with ``==``: every field of their records
    (:func:`shard_meta`) comes from these, so equal identities mean equal records, and a save's
    plan or a load's request check made for one holds for the other (see
    ``exchange.known_digest``). None (never equal) when a shard is of another class (a subclass
    may carry more)."""
    out = []
    for s in shards:  # (a tuple per shard, no record: ~1 us, against ~4.5 for records and routing)
        if type(s) is ShardedTensor:
            out.append((s.key, s.dtype, s.global_shape, s.global_offset, s.local_shape, s.prepend_axis_num,
                        s.replica_id, s.allow_shape_mismatch, s.data is None))
        elif type(s) is ShardedObject:
            out.append((ShardedObject, s.key, s.global_shape, s.global_offset, s.replica_id))
        else:
            return None
    return (rank, world, options, tuple(out))


def split_state_dict(sharded_state_dict: Dict[str, Any]) -> Tuple[Any, Any, Any, Any, Any]:
    """Return ``(sharded, common, nonpersistent, factories, template)`` from a copy of the input.

    Other libraries' sharded values (Megatron-Core's classes) are converted to ours first,
    also where a factory's ``build_fn`` returns them (see :mod:`ckpt_integration.foreign`).
    ``sharded`` holds ShardedTensors/ShardedObjects at their positions (a flattened
    ShardedTensor as it is: :func:`local_shards` cuts it into boxes),
    ``common`` everything else that is saved (empty containers included, dict types
    kept), ``nonpersistent`` the unwrapped LocalNonpersistentObjects, ``factories``
    the factories for merging on load, ``template`` the input with factories built
    (what :func:`restore_list_types` needs to give every list back as a list, also the
    lists a ``build_fn`` returned).
    """
    if not isinstance(sharded_state_dict, dict):
        raise CheckpointingException(
            f"a sharded state dict must be a dict, got {type(sharded_state_dict).__name__}"
        )
    sd = convert_foreign(sharded_state_dict)
    factories, _ = extract_factories(sd)
    _build_factories(sd)
    template = sd
    nonpersistent, sd = extract_matching_values(
        sd, lambda v: isinstance(v, LocalNonpersistentObject), return_lists_as_dicts=True
    )
    nonpersistent = dict_list_map_outplace(lambda v: v.unwrap(), nonpersistent)
    sharded, common = extract_matching_values(sd, is_sharded, return_lists_as_dicts=True)
    # Lists that held no sharded value come back whole as lists; mixed lists stay
    # {index: value} so that merging on load puts every value back in its slot.
    common = restore_list_types(common, template)
    for path, v in nested_items(common):
        refuse_sharded_looking(v, path)
    return sharded, common, nonpersistent, factories, template


def _build_factories(sd: Union[dict, list]) -> None:
    """Replace every factory by what it builds (in place), recursively; what a foreign
    ``build_fn`` returns (Megatron-Core's classes) is converted to ours."""
    dict_list_map_inplace(_built, sd)


def _built(x: object) -> Any:
    # (a module function, not a closure calling itself: such a closure is a reference cycle that
    # keeps everything it sees alive until the cycle collector runs)
    if isinstance(x, ShardedTensorFactory):
        try:
            built = x.build()
        except CheckpointingException:
            raise
        except Exception as e:  # (user code: name the factory, as a failing merge_fn is named)
            raise CheckpointingException(f"build_fn of ShardedTensorFactory {x.key!r} failed: "
                                         f"{type(e).__name__}: {e}") from e
        built = note_built_factories(x, convert_foreign(built, (f"<built by factory {x.key!r}>",)))
        return dict_list_map_inplace(_built, built)
    return x


def local_shards(sharded: object) -> List[ShardedBase]:
    """Every shard to save or load, a flattened ShardedTensor as the boxes it covers."""
    out: List[ShardedBase] = []
    for _, v in nested_items(sharded):
        if isinstance(v, ShardedTensor) and v.flattened_range is not None:
            out.extend(v.unflattened())
        elif not (isinstance(v, ShardedTensor) and 0 in v.local_shape and 0 not in v.global_shape):
            out.append(v)
        # (else an empty piece of a non-empty tensor, an uneven split's empty part: it holds nothing, and at the
        # offset of another piece it took that piece's place in the save's plan, whose data was then not saved)
    return out


def restore_list_types(x: object, template: object) -> Any:
    """Turn ``{0: a, 1: b}`` back into ``[a, b]`` wherever the request had a list.

    A mixed list whose positions are not all present (its sharded values were not
    loaded) stays ``{index: value}``.
    """
    if isinstance(template, list) and isinstance(x, dict) and set(x) == set(range(len(template))):
        return [restore_list_types(x[i], template[i]) for i in range(len(template))]
    if isinstance(template, list) and isinstance(x, list):
        return [restore_list_types(v, t) for v, t in zip(x, template)] + x[len(template):]
    if isinstance(template, dict) and isinstance(x, dict):
        for k in list(x):
            if k in template:
                x[k] = restore_list_types(x[k], template[k])
        return x
    if isinstance(template, list) and isinstance(x, dict):
        for k in list(x):
            if isinstance(k, int) and 0 <= k < len(template):
                x[k] = restore_list_types(x[k], template[k])
        return x
    return x


def savable(shards: List[ShardedBase]) -> List[ShardedBase]:
    """Before anything is written: tensors must have data a save can read as their values (not on the
    meta device, dense, of the dtype and shape they were built with: ``data`` replaced since is
    refused, as its bytes would be recorded as the old dtype's); a conjugate or negative view is
    saved as its values (a resolved copy), since a save writes a tensor's memory."""
    out = shards
    for i, sh in enumerate(shards):  # (``is_meta``, not ``device.type``: no device object per tensor)
        data = getattr(sh, "data", None)
        if not (isinstance(sh, ShardedTensor) and isinstance(data, torch.Tensor)):
            continue
        if data.is_meta:
            raise CheckpointingException(
                f"ShardedTensor {sh.key!r} is on the meta device (it has a shape but no values); "
                "materialize it (e.g. module.to_empty(device=...) and initialize) before saving"
            )
        problem = layout_problem(data)
        if problem:
            raise CheckpointingException(f"ShardedTensor {sh.key!r} cannot be saved: it is {problem}")
        if data.dtype is not sh.dtype or (data.shape != sh.local_shape if sh.flattened_range is None
                                          else data.numel() != sh.flat_numel()):
            raise CheckpointingException(
                f"ShardedTensor {sh.key!r} was built for {sh.dtype} of shape {sh.local_shape}, but its data is now "
                f"{data.dtype} of shape {tuple(data.shape)} (replaced since): build the ShardedTensor from the data it saves"
            )
        if data.is_conj() or data.is_neg():
            out = list(shards) if out is shards else out
            out[i] = dataclasses.replace(sh, data=data.resolve_conj().resolve_neg())
    return out


def check_group(group: object, what: str) -> None:
    """``group`` as a ``process_group`` argument of ``what``: the default (None), a library group, or a
    torch process group this rank is a member of; anything else is refused here, saying what to pass
    (torch raised bare errors from deep inside, or waited for ranks that never came)."""
    if group is None or isinstance(group, dist.PrivateGroup):
        return
    outside = group is getattr(tdist.GroupMember, "NON_GROUP_MEMBER", object())  # (new_group's value off its ranks)
    if outside or isinstance(group, tdist.ProcessGroup) and dist.is_distributed() and tdist.get_rank(group) < 0:
        raise CheckpointingException(f"{what}: rank {tdist.get_rank()} is not a member of the process_group passed; "
                                     "only its members take part")
    if not isinstance(group, tdist.ProcessGroup):
        hint = ""
        if isinstance(group, (list, tuple, range)):
            hint = "; make one of those ranks with torch.distributed.new_group(ranks), on every rank"
        elif hasattr(group, "get_group") and hasattr(group, "mesh"):
            hint = "; pass one of its dimensions' groups: mesh.get_group(dim)"
        raise CheckpointingException(f"{what}: process_group must be a torch.distributed ProcessGroup, "
                                     f"got {type(group).__name__}{hint}")
    if not dist.is_distributed():
        raise CheckpointingException(f"{what}: a process_group was given but torch.distributed is not initialized")
