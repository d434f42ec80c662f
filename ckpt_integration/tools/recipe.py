"""Export recipes: what an export without the model's code needs to know about a checkpoint.

A checkpoint stores ShardedTensors under their keys; a ``ShardedTensorFactory`` (e.g.
:func:`ckpt_integration.modules.fused_column_parallel`: ``qkv.weight`` stored as
``qkv.weight.part0/1/2``) leaves only its parts on disk, and its ``merge_fn`` is code. An
*export recipe*, recorded at save time from the sharded state dict, says how to get every
``module.state_dict()`` name back from the stored keys:

* ``merged``: ``{name: {"parts": [key, ...], "axis": 0}}`` - factories whose parts are
  consecutive blocks of the local tensor along axis 0, split along axis 0 only: the whole
  tensor is the concatenation of the parts' global tensors (checked on the data at save time);
* ``opaque``: ``{name: [key, ...]}`` - other factories: only the module's own ``merge_fn``
  can rebuild them (export with ``module=``);
* ``renamed``: ``{key: name}`` - tensors stored under another key than their state-dict name;
* ``stacked``: ``{key: {name: [index, ...]}}`` - per-layer tensors stacked along prepended axes
  (:func:`ckpt_integration.modules.stack_layers`): ``name`` is the slice at ``index``.

Record it as a ShardedObject on every rank (each rank describes its own factories, so a
pipeline-parallel model is covered whole)::

    sd["export_recipe"] = export_recipe_object(model_sd)      # before ci.save(sd, ...)

:func:`ckpt_integration.tools.export_checkpoint` reads every rank's recipe back
(:func:`read_recipe`) and merges the parts without the module.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ..dict_utils import nested_items
from ..errors import CheckpointingException
from ..mapping import ReplicaId, ShardedObject, ShardedStateDict, ShardedTensor, ShardedTensorFactory
from .sources import TensorSource

#: key of the recipe ShardedObjects (one per rank) in the checkpoint
EXPORT_RECIPE_KEY = "ckpt_integration.export_recipe"
RECIPE_VERSION = 1


def _axis0_parts(factory: ShardedTensorFactory) -> Optional[List[str]]:
    """The part keys (in row order) if the factory stores consecutive axis-0 blocks of its tensor.

    Checked on the views its ``build_fn`` returns: every part shares the factory tensor's memory
    at a row boundary, with its trailing shape and strides, the parts tile the rows exactly, and
    each part is split along axis 0 only. Then the factory's ``merge_fn`` (its inverse) is a
    concatenation along axis 0, in every layout. ``None`` for anything else.
    """
    data = factory.data
    if not isinstance(data, torch.Tensor) or data.dim() == 0 or data.shape[0] == 0:
        return None
    try:
        built = factory.build()
    except Exception:  # noqa: BLE001 - user code; such a factory is simply opaque
        return None
    leaves = [v for _, v in nested_items(built)]
    if not leaves or not all(isinstance(v, ShardedTensor) and isinstance(v.data, torch.Tensor) for v in leaves):
        return None
    row = data.stride(0) * data.element_size()
    base = data.data_ptr()
    spans = []
    for st in leaves:
        t = st.data
        if (st.prepend_axis_num or t.dim() != data.dim() or tuple(t.shape[1:]) != tuple(data.shape[1:])
                or t.stride() != data.stride() or tuple(st.global_shape[1:]) != tuple(t.shape[1:])
                or t.untyped_storage().data_ptr() != data.untyped_storage().data_ptr() or t.shape[0] == 0):
            return None
        offset = t.data_ptr() - base
        if offset < 0 or offset % row:
            return None
        spans.append((offset // row, int(t.shape[0]), st.key))
    spans.sort()
    pos = 0
    for start, rows, _ in spans:
        if start != pos:
            return None
        pos += rows
    return [k for _, _, k in spans] if pos == data.shape[0] else None


def export_recipe(model_sharded_state_dict: ShardedStateDict) -> Dict[str, Any]:
    """The export recipe of a model's sharded state dict (see the module docstring).

    Names are the dict paths joined with ``.`` (the state-dict names for
    :func:`~ckpt_integration.modules.module_sharded_state_dict` output).

    Example: ``export_recipe(model.sharded_state_dict())["merged"]`` ->
    ``{"blocks.0.qkv.weight": {"parts": ["blocks.0.qkv.weight.part0", ...], "axis": 0}}``
    """
    merged: Dict[str, Any] = {}
    opaque: Dict[str, List[str]] = {}
    renamed: Dict[str, str] = {}
    stacked: Dict[str, Dict[str, List[int]]] = {}
    for path, value in nested_items(model_sharded_state_dict):
        name = ".".join(str(p) for p in path)
        if isinstance(value, ShardedTensorFactory):
            parts = _axis0_parts(value)
            if parts is not None:
                merged[name] = {"parts": parts, "axis": 0}
            else:
                try:
                    built = value.build()
                    keys = sorted({v.key for _, v in nested_items(built) if hasattr(v, "key")})
                except Exception:  # noqa: BLE001 - user code
                    keys = [value.key]
                opaque[name] = keys
        elif isinstance(value, ShardedTensor):
            if value.prepend_axis_num:
                stacked.setdefault(value.key, {})[name] = list(value.global_offset[: value.prepend_axis_num])
            elif value.key != name:
                renamed[value.key] = name
    return {"version": RECIPE_VERSION, "merged": merged, "opaque": opaque, "renamed": renamed, "stacked": stacked}


def export_recipe_object(model_sharded_state_dict: ShardedStateDict, rank: Optional[int] = None,
                         world_size: Optional[int] = None, replica_id: ReplicaId = 0) -> ShardedObject:
    """This rank's :func:`export_recipe` as a ShardedObject to put into the saved state dict.

    ``rank`` / ``world_size`` (the object's place in a grid of ``world_size`` recipes) default to
    ``torch.distributed``'s (0 / 1 without it). Ranks holding the same model part may share one
    place, the copies marked by a non-zero ``replica_id`` (e.g. ``rank = pp_rank * tp_size + tp_rank``,
    ``world_size = tp_size * pp_size``, ``replica_id = dp_rank``), so that one copy is written.

    Example::

        sd = {"model": model_sd, "export_recipe": export_recipe_object(model_sd)}
        ci.save(sd, "ckpt")   # later: ckpt-integration export ckpt --to hf out/
    """
    if rank is None or world_size is None:
        import torch.distributed as tdist

        on = tdist.is_available() and tdist.is_initialized()
        rank = tdist.get_rank() if on else 0
        world_size = tdist.get_world_size() if on else 1
    return ShardedObject(EXPORT_RECIPE_KEY, export_recipe(model_sharded_state_dict), (world_size,), (rank,), replica_id)


def _merge_into(total: Dict[str, Any], recipe: Dict[str, Any], where: str) -> None:
    if not isinstance(recipe, dict) or recipe.get("version") != RECIPE_VERSION:
        raise CheckpointingException(f"{where}: unsupported export recipe (version {getattr(recipe, 'get', lambda _: None)('version')!r})")
    for section in ("merged", "opaque", "renamed"):
        for k, v in recipe.get(section, {}).items():
            old = total[section].get(k)
            if old is not None and old != v:
                raise CheckpointingException(
                    f"{where}: the ranks' export recipes disagree about {k!r} ({old!r} vs {v!r}); "
                    "export with module= (the module's own sharded_state_dict)")
            total[section][k] = v
    for key, names in recipe.get("stacked", {}).items():
        entry = total["stacked"].setdefault(key, {})
        for name, index in names.items():
            if entry.get(name, index) != index:
                raise CheckpointingException(
                    f"{where}: {name!r} names different layers of {key!r} on different ranks (layer-local names "
                    "under pipeline parallelism?); export with module=")
            entry[name] = index


def read_recipe(src: TensorSource) -> Optional[Dict[str, Any]]:
    """The union of the export recipes in a :class:`~ckpt_integration.tools.DistCheckpointSource`
    (every rank's ShardedObject), or ``None`` when none was recorded."""
    keys = [k for k in getattr(src, "objects", []) if k.split("/")[0] == EXPORT_RECIPE_KEY]
    if not keys:
        return None
    total: Dict[str, Any] = {"version": RECIPE_VERSION, "merged": {}, "opaque": {}, "renamed": {}, "stacked": {}}
    for k in sorted(keys):
        _merge_into(total, src.read_object(k), f"{src.path}: {k}")
    return total


__all__ = ["EXPORT_RECIPE_KEY", "export_recipe", "export_recipe_object", "read_recipe"]
