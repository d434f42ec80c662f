"""FSDP1 (``FullyShardedDataParallel``, Lightning's ``FSDPStrategy``) state through PyTorch's own
state-dict API, ``torch.distributed.checkpoint.state_dict``.

``get_model_state_dict(model)`` gives every parameter as this rank's shard (torch's
``ShardedTensor`` for FSDP1, chunks of dim 0; ``DTensor`` with a device mesh), keyed by the
parameter's name without FSDP's wrapper prefixes: the names ``module.state_dict()`` of the
unwrapped module uses. Those shards become this library's ShardedTensors at their global
offsets, so an FSDP1 checkpoint holds the same keys as one of DDP, FSDP2 or one device and
loads into any of them (and back). Optimizer state goes through ``get_optimizer_state_dict`` /
``set_optimizer_state_dict`` (:mod:`ckpt_integration.optimizer.by_name`), which map FSDP's flat
parameters (``use_orig_params=False``) to names too. Nothing here flattens or unflattens by hand.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as tdist

from ..mapping import ShardedTensor
from ..dtensors import dtensor_to_sharded_tensor, is_dtensor
from ..modules import raise_on_key_mismatch
from ..optimizer.by_name import load_named_optimizer_state, local_shard, named_optimizer_sharded_state_dict


def is_fsdp1(strategy: Any) -> bool:
    """Whether ``strategy`` is Lightning's ``FSDPStrategy`` (or a subclass)."""
    from lightning.pytorch.strategies import FSDPStrategy

    return isinstance(strategy, FSDPStrategy)


def _replica_of_shard_group(value: Any) -> int:
    """Which copy of a ShardedTensor this rank holds: 0 under FULL_SHARD (one shard group), the shard
    group's index under HYBRID_SHARD (shard groups of consecutive ranks, replicated across them)."""
    pg = getattr(value, "_process_group", None)
    if pg is None or not tdist.is_initialized():
        return 0
    size = tdist.get_world_size(pg)
    return tdist.get_rank() // size if size < tdist.get_world_size() else 0


def _entry(key: str, value: Any, rank: int) -> Any:
    """One ``get_model_state_dict`` entry as saved (``None``: this rank holds none of it)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor

    if isinstance(value, TorchShardedTensor):
        shard, shape = local_shard(value)
        if shard is None or shard.numel() == 0:
            return None
        offsets = tuple(value.local_shards()[0].metadata.shard_offsets)
        return ShardedTensor.from_global_offsets(key, shard.detach(), shape, offsets,
                                                 replica_id=_replica_of_shard_group(value))
    if is_dtensor(value):
        return dtensor_to_sharded_tensor(key, value)
    if isinstance(value, torch.Tensor):  # buffers, NO_SHARD parameters: the same on every rank
        return ShardedTensor.from_rank_offsets(key, value.detach(), replica_id=rank)
    return value  # get_extra_state() objects and the like: common state


def model_state(model: torch.nn.Module) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(sharded state dict, torch's state dict)`` of an FSDP1 model: the first for saving or as a load
    request (its tensors are this rank's shards of the second, filled in place by a load)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    raw = get_model_state_dict(model)
    rank = tdist.get_rank() if tdist.is_initialized() else 0
    out: Dict[str, Any] = {}
    for key, value in raw.items():
        entry = _entry(key, value, rank)
        if entry is not None:
            out[key] = entry
    return out, raw


def load_model_state(model: torch.nn.Module, raw: Dict[str, Any], loaded: Dict[str, Any], strict: bool,
                     missing: List[str], unexpected: List[str]) -> Tuple[List[str], List[str]]:
    """Put what a load filled (tensors in place in ``raw``'s shards; other values in ``loaded``) into the
    FSDP1 model with ``set_model_state_dict``. ``missing`` / ``unexpected`` come from the load; with
    ``strict`` any of them raises :class:`~ckpt_integration.modules.StateDictMismatchError`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    sd = dict(raw)
    for key, value in raw.items():
        if not isinstance(value, torch.Tensor) and key in loaded:
            sd[key] = loaded[key]
    if strict:
        raise_on_key_mismatch(model, missing, unexpected)
    set_model_state_dict(model, sd, options=StateDictOptions(strict=False))
    return sorted(missing), sorted(unexpected)


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_sd: Dict[str, Any],
                    prefix: str) -> Dict[str, Any]:
    """The optimizer sharded state dict of an FSDP1 model's optimizer (keys as for DDP / FSDP2)."""
    if not optimizer.state:  # torch's API would create state with a step of lr 0: save the groups only
        sd = optimizer.state_dict()
        return named_optimizer_sharded_state_dict({"state": {}, "param_groups": [
            {**g, "params": [str(p) for p in g["params"]]} for g in sd["param_groups"]]}, model_sd, prefix=prefix)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return named_optimizer_sharded_state_dict(get_optimizer_state_dict(model, optimizer), model_sd, prefix=prefix)


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_sd: Dict[str, Any], path: str,
                   prefix: str, **load_kwargs: Any) -> bool:
    """Load an FSDP1 model's optimizer state from ``path`` (any layout it was saved in). Collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    template = get_optimizer_state_dict(model, optimizer)  # creates the state torch fills
    if not load_named_optimizer_state(optimizer, template, model_sd, path, prefix=prefix, **load_kwargs):
        return False
    set_optimizer_state_dict(model, optimizer, template)
    return True


def setup_cpu_model(strategy: Any, model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """FSDP1 on a CPU device: Lightning passes ``device_id=root_device.index`` (``None`` on CPU), torch's
    FSDP1 needs ``torch.device("cpu")`` there. Returns the wrapped model, or ``None`` off CPU."""
    from lightning.pytorch.strategies.fsdp import _move_torchmetrics_to_device, _setup_activation_checkpointing
    from torch.distributed.fsdp import FullyShardedDataParallel

    if strategy.root_device.type != "cpu" or any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return None
    # as Lightning's FSDPStrategy._setup_model, with the device torch needs on CPU
    wrapped = FullyShardedDataParallel(
        module=model, cpu_offload=strategy.cpu_offload, mixed_precision=strategy.mixed_precision_config,
        sharding_strategy=strategy.sharding_strategy, device_id=torch.device("cpu"), **strategy.kwargs,
    )
    _move_torchmetrics_to_device(wrapped, strategy.root_device)
    _setup_activation_checkpointing(wrapped, strategy._activation_checkpointing_kwargs)
    return wrapped
