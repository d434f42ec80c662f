"""Optimizer state checkpointing: optimizer state sharded exactly like the model.

The optimizer's per-parameter state tensors (``exp_avg``, ``exp_avg_sq``,
``momentum_buffer``, fp32 master weights, ...) are described with the *same*
sharding as the parameter they belong to: each becomes a copy of the
parameter's :class:`~ckpt_integration.ShardedTensor` (or
:class:`~ckpt_integration.ShardedTensorFactory`) with the key
``f"{prefix}.state.{state_name}.{param_key}"``, e.g.
``optimizer.state.exp_avg.decoder.fc1.weight``. Optimizer state therefore
reshards exactly like the weights (TP/PP/DP changes, fused tensors).

Scalar states (``step``, ...) are :class:`~ckpt_integration.ShardedObject` s under
the same key scheme, in their place, so the dict ``load`` returns goes straight into
``optimizer.load_state_dict``; a fused param (a factory storing parts) saves them once per
part, so they follow the weights into separate params keyed like the parts and back. A job whose optimizer has no state yet loads with
:func:`load_optimizer_state` (names and dtypes from the checkpoint's metadata).
``param_groups`` hyper-parameters are common state; their ``params`` lists stay
local (``LocalNonpersistentObject``). One module per job: ``sharding`` (the
Megatron-compatible helpers), ``state``, ``load``, ``mixed_precision``, ``zero``.

Public names: :func:`get_param_id_to_sharded_param_map`, :func:`param_map_and_aliases`,
:func:`make_sharded_optimizer_tensor`, :func:`optim_state_to_sharding_state`,
:func:`sharding_state_to_optim_state`, :func:`optimizer_sharded_state_dict`,
:func:`init_optimizer_state`, :func:`load_optimizer_state`, :func:`optimizer_key`,
:func:`has_optimizer_state`, :func:`fill_empty_shards`, :func:`flat_range_to_boxes`,
:class:`MixedPrecisionOptimizer`, :class:`ZeroShardedOptimizer` and the errors
:class:`OptimizerStateNotFoundError`, :class:`OptimizerStateMismatchError`,
:class:`UnmatchedParameterError`. See ``docs/optimizer.md``.
"""

from .load import has_optimizer_state, load_optimizer_state
from .mixed_precision import MixedPrecisionOptimizer
from .sharding import (
    DEFAULT_PREFIX,
    EXTRA_STATE_NAMES,
    PARAM_META_KEY,
    OptimizerStateMismatchError,
    OptimizerStateNotFoundError,
    UnmatchedParameterError,
    get_optim_param_to_id_map,
    get_param_id_to_sharded_param_map,
    is_optimizer_state_key,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
    optimizer_key,
    param_map_and_aliases,
    sharding_state_to_optim_state,
)
from .state import fill_empty_shards, init_optimizer_state, optimizer_sharded_state_dict
from ..mapping import flat_range_to_boxes
from .zero import ZeroShardedOptimizer

__all__ = [
    "DEFAULT_PREFIX",
    "is_optimizer_state_key",
    "optimizer_key",
    "PARAM_META_KEY",
    "OptimizerStateNotFoundError",
    "OptimizerStateMismatchError",
    "UnmatchedParameterError",
    "get_optim_param_to_id_map",
    "get_param_id_to_sharded_param_map",
    "param_map_and_aliases",
    "make_sharded_optimizer_tensor",
    "optim_state_to_sharding_state",
    "sharding_state_to_optim_state",
    "optimizer_sharded_state_dict",
    "init_optimizer_state",
    "fill_empty_shards",
    "has_optimizer_state",
    "load_optimizer_state",
    "flat_range_to_boxes",
    "MixedPrecisionOptimizer",
    "ZeroShardedOptimizer",
]
