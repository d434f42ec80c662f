"""Optimizer state keyed by parameter name, as ``torch.distributed.checkpoint.state_dict`` gives it.

``get_optimizer_state_dict(model, optimizer)`` returns ``{"state": {name: {state: value}},
"param_groups": [{..., "params": [names]}]}`` for any model torch supports (FSDP1 with flat
parameters included, whose optimizer params are not the model's); the per-param tensors are
this rank's shards (torch's ``ShardedTensor`` for FSDP1, ``DTensor`` for FSDP2). Here they are
saved sharded like the parameter of that name, with the same keys as
:func:`~ckpt_integration.optimizer.optimizer_sharded_state_dict` uses
(``optimizer.state.exp_avg.<name>``), so such checkpoints and those of DDP / FSDP2 / one device
load into each other; :func:`load_named_optimizer_state` fills such a dict from a checkpoint
for ``set_optimizer_state_dict``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from ..dict_utils import nested_values
from ..mapping import LocalNonpersistentObject, ShardedStateDict, ShardedTensor
from ..dtensors import is_dtensor
from .load import (LabelDict, check_state_names, gather_problems, has_optimizer_state, raise_mismatch, read_optimizer_state,
                   report_missing_state)
from .sharding import DEFAULT_PREFIX, grid_object, make_sharded_optimizer_tensor, state_object

#: ``local(value) -> (this rank's shard or None for a scalar, global shape or None)``
LocalFn = Callable[[Any], Tuple[Optional[torch.Tensor], Optional[Tuple[int, ...]]]]


def local_shard(value: object) -> Tuple[Optional[torch.Tensor], Optional[Tuple[int, ...]]]:
    """This rank's part of a per-param state and its global shape: a DTensor's local tensor, the one
    local shard of torch's (FSDP1) ``ShardedTensor`` (empty if this rank holds none), a plain tensor
    with dimensions itself; ``(None, None)`` for a scalar (0-dim tensor, number)."""
    if not isinstance(value, torch.Tensor):
        return None, None
    from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor

    if isinstance(value, TorchShardedTensor):
        shards = value.local_shards()
        if len(shards) > 1:
            raise ValueError(f"a ShardedTensor with {len(shards)} local shards (one expected)")
        size = tuple(value.size())
        return (shards[0].tensor if shards else torch.empty((0,) + size[1:])), size
    if is_dtensor(value):
        return value.to_local(), tuple(value.shape)
    if value.dim() == 0:
        return None, None
    return value, tuple(value.shape)


def _order(named_osd: Dict[str, Any]) -> List[str]:
    return [n for g in named_osd["param_groups"] for n in g["params"]]


def _by_key(model_sharded_state_dict: ShardedStateDict) -> Dict[str, ShardedTensor]:
    return {v.key: v for v in nested_values(model_sharded_state_dict) if isinstance(v, ShardedTensor)}


def named_optimizer_sharded_state_dict(
    named_osd: Dict[str, Any], model_sharded_state_dict: ShardedStateDict, *, prefix: str = DEFAULT_PREFIX,
    local: LocalFn = local_shard,
) -> ShardedStateDict:
    """The optimizer sharded state dict of ``named_osd`` (``get_optimizer_state_dict``'s format): each
    state of parameter ``name`` sharded like the model ShardedTensor keyed ``name``; param ids follow
    the groups' order, as ``optimizer.state_dict()`` numbers them. A parameter whose shard on this
    rank is empty has nothing here (the ranks holding it save it).

    Example::

        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        osd = named_optimizer_sharded_state_dict(get_optimizer_state_dict(model, opt), model_sd)
    """
    params = _by_key(model_sharded_state_dict)
    state: Dict[int, Dict[str, Any]] = {}
    for pid, name in enumerate(_order(named_osd)):
        sp, saved = params.get(name), named_osd["state"].get(name)
        if sp is None or not saved:
            continue
        entry: Dict[str, Any] = {}
        for sname, value in saved.items():
            shard, _ = local(value)
            if shard is not None:
                entry[sname] = make_sharded_optimizer_tensor(sp, shard.detach(), f"{prefix}.state.{sname}")
            else:
                entry[sname] = state_object(prefix, sname, sp, value.detach().clone() if isinstance(value, torch.Tensor) else value)
        state[pid] = entry
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": LocalNonpersistentObject(list(g["params"]))}
              for g in named_osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_named_optimizer_state(
    optimizer: torch.optim.Optimizer,
    named_osd: Dict[str, Any],
    model_sharded_state_dict: ShardedStateDict,
    checkpoint_dir: Union[str, "os.PathLike[str]"],
    *,
    prefix: str = DEFAULT_PREFIX,
    state_dict_key: Optional[str] = None,
    missing_ok: bool = False,
    local: LocalFn = local_shard,
    **load_kwargs: object,
) -> bool:
    """Fill ``named_osd`` (``get_optimizer_state_dict(model, optimizer)`` of the current run, whose
    state exists: torch creates it) from a checkpoint, resharded for this rank; then hand it to
    ``set_optimizer_state_dict``. Tensor states are copied into this rank's shards in place,
    scalars and the groups' hyper-parameters replaced. Collective. Returns False if the checkpoint
    has no optimizer state and ``missing_ok``; raises
    :class:`~ckpt_integration.optimizer.OptimizerStateMismatchError` naming the parameters whose
    state is missing, shaped otherwise, or unlike what ``optimizer`` keeps.
    """
    state_dict_key = state_dict_key or prefix
    if not has_optimizer_state(checkpoint_dir, prefix):
        report_missing_state(checkpoint_dir, prefix, missing_ok)
        return False
    params = _by_key(model_sharded_state_dict)
    order = _order(named_osd)
    id_map: Dict[int, Any] = {}
    targets: Dict[int, Dict[str, Any]] = {}
    for pid, name in enumerate(order):
        target = named_osd["state"].setdefault(name, {})
        targets[pid] = target
        sp = params.get(name)
        if sp is None:  # this rank's shard is empty: only the scalars (FSDP1 flattens them with the others)
            shape = next((local(v)[1] for v in target.values() if local(v)[1] is not None), None)
            if shape is None:
                continue
            sp = ShardedTensor.from_global_offsets(name, torch.empty((0,) + shape[1:]), shape,
                                                   (shape[0],) + (0,) * (len(shape) - 1), replica_id=1)
        id_map[pid] = sp

    def make_requests(pid: int, name: str, dtype: torch.dtype) -> Any:
        sp = id_map[pid]
        if sp.data.numel() == 0:
            return None
        return make_sharded_optimizer_tensor(sp, torch.empty(sp.local_shape, dtype=dtype), f"{prefix}.state.{name}")

    labels = LabelDict({sp.key: f"parameter {sp.key!r}" for sp in id_map.values()})
    template_groups = [dict(g) for g in named_osd["param_groups"]]
    state, scalars, groups = read_optimizer_state(
        checkpoint_dir, prefix, id_map, lambda pid, key, st: grid_object(key, st, None), make_requests,
        template_groups, labels, state_dict_key, load_kwargs,
    )
    problems: List[str] = []
    for pid, target in targets.items():
        got = {**state.get(pid, {}), **scalars.get(pid, {})}
        for sname, value in got.items():
            old = target.get(sname)
            shard = local(old)[0] if old is not None else None
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if shard is None:
                    problems.append(f"parameter {order[pid]!r}: the checkpoint holds {sname!r}, which "
                                    f"{type(optimizer).__name__} does not keep")
                    continue
                shard.copy_(value.view(shard.shape))
            else:
                target[sname] = value.clone() if isinstance(value, torch.Tensor) else value
    groups_pids, it = [], iter(range(len(order)))
    for g in named_osd["param_groups"]:
        groups_pids.append([next(it) for _ in g["params"]])
    # (a param whose shard here is empty got its scalars only: the ranks holding it check its tensors)
    saved_names = {pid: {n: True for n in {**state.get(pid, {}), **scalars.get(pid, {})}} for pid in targets
                   if pid in id_map and id_map[pid].data.numel()}
    problems += check_state_names(optimizer, named_osd["param_groups"], groups_pids, saved_names, (),
                                   lambda p: repr(order[p]))
    raise_mismatch(gather_problems(problems, load_kwargs.get("process_group")), str(checkpoint_dir), prefix,
                    f"does not fit {type(optimizer).__name__} (saved by another optimizer, with other options, or "
                    "for other parameters?)")
    for g, loaded in zip(named_osd["param_groups"], groups):
        g.update({k: v for k, v in loaded.items() if k != "params"})
    return True
