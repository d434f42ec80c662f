"""Helpers over sharded state dicts (Megatron-Core's ``dist_checkpointing.utils``).

Every function recognises this library's sharded classes and Megatron-Core's (by class
name, see :mod:`ckpt_integration.foreign`), so they work on the output of a Megatron
model's ``sharded_state_dict()`` as well as on ours. The ``extract_*`` functions split a
state dict into ``(matching, rest)`` keeping the nesting (see
:func:`ckpt_integration.dict_utils.extract_matching_values`); the ``*_prefix*`` functions
rename sharded keys in place.
"""

from __future__ import annotations

from typing import Dict, Tuple

from .dict_utils import dict_list_map_inplace, extract_matching_values
from .errors import KeyPrefixError
from .foreign import sharded_kind
from .mapping import ShardedStateDict, StateDict

_BASE = ("ShardedTensor", "ShardedObject", "ShardedTensorFactory")


def _extract(sharded_state_dict: ShardedStateDict, kinds: Tuple[str, ...]) -> Tuple[ShardedStateDict, StateDict]:
    return extract_matching_values(sharded_state_dict, lambda v: sharded_kind(v) in kinds)


def extract_sharded_tensors(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """``(ShardedTensors, everything else)``, both with the original nesting.

    Example: ``tensors, rest = extract_sharded_tensors(model.sharded_state_dict())``
    """
    return _extract(sharded_state_dict, ("ShardedTensor",))


def extract_sharded_tensors_and_factories(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """``(ShardedTensors and ShardedTensorFactories, everything else)``.

    Example: ``params, _ = extract_sharded_tensors_and_factories(model_sd)``
    """
    return _extract(sharded_state_dict, ("ShardedTensor", "ShardedTensorFactory"))


def extract_sharded_tensors_or_nonpersistent(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """``(ShardedTensors, factories and LocalNonpersistentObjects, everything else)``.

    Example: ``sharded, common = extract_sharded_tensors_or_nonpersistent(sd)``
    """
    return _extract(sharded_state_dict, ("ShardedTensor", "ShardedTensorFactory", "LocalNonpersistentObject"))


def extract_sharded_base(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """``(ShardedTensors, ShardedObjects and factories, everything else)``: the split ``save``
    makes between sharded values and the common state.

    Example: ``sharded, common = extract_sharded_base(sd)``
    """
    return _extract(sharded_state_dict, _BASE)


def extract_nonpersistent(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """``(LocalNonpersistentObjects, everything else)``.

    Example: ``local, rest = extract_nonpersistent(optimizer_sd)``
    """
    return _extract(sharded_state_dict, ("LocalNonpersistentObject",))


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend ``prefix`` to the key of every sharded value, in place.

    Example: ``add_prefix_for_sharding(sub_sd, "decoder.")`` turns key ``"w"`` into ``"decoder.w"``
    """

    def add(x: object) -> object:
        if sharded_kind(x) in _BASE:
            x.key = f"{prefix}{x.key}"
        return x

    dict_list_map_inplace(add, sharded_state_dict)


def replace_prefix_for_sharding(sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str) -> None:
    """Replace ``old_prefix`` by ``new_prefix`` in the key of every sharded value, in place.

    Every sharded key must start with ``old_prefix``; the first that does not raises
    :class:`~ckpt_integration.errors.KeyPrefixError` (a ``ValueError`` too) naming it.

    Example: ``replace_prefix_for_sharding(sd, "module.", "model.")``
    """

    def replace(x: object) -> object:
        if sharded_kind(x) in _BASE:
            if not x.key.startswith(old_prefix):
                raise KeyPrefixError(f"Expected {x.key!r} to begin with prefix {old_prefix!r}")
            x.key = f"{new_prefix}{x.key[len(old_prefix):]}"
        return x

    dict_list_map_inplace(replace, sharded_state_dict)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: Dict[str, str]) -> None:
    """Rename sharded keys that start with a prefix in ``prefix_map`` (old -> new), in place;
    the first matching prefix (in the map's order) is used, other keys stay.

    Example: ``apply_prefix_mapping(sd, {"decoder.layers.": "model.layers."})``
    """

    def replace(x: object) -> object:
        if sharded_kind(x) in _BASE:
            for old, new in prefix_map.items():
                if x.key.startswith(old):
                    x.key = f"{new}{x.key[len(old):]}"
                    break
        return x

    dict_list_map_inplace(replace, sharded_state_dict)


__all__ = [
    "extract_sharded_tensors",
    "extract_sharded_tensors_and_factories",
    "extract_sharded_tensors_or_nonpersistent",
    "extract_sharded_base",
    "extract_nonpersistent",
    "add_prefix_for_sharding",
    "replace_prefix_for_sharding",
    "apply_prefix_mapping",
]
