"""Default ``sharded_state_dict`` for ``nn.Module`` s and helpers for model parallelism.

* :func:`default_sharded_state_dict` works for any module, so most users write no
  hook at all: ordinary parameters/buffers become replicated ShardedTensors
  (``replica_id`` = data-parallel rank, so each is written once) and DTensor
  parameters (``torch.distributed.tensor``: ``Shard(dim)`` / ``Replicate`` on a
  DeviceMesh, uneven shards included) become ShardedTensors at their global
  offsets. Children with their own ``sharded_state_dict`` hook are asked for
  theirs.
* :class:`ShardedModuleMixin` is a base for modules with hand-written tensor /
  pipeline parallelism: declare which parameters are column- or row-parallel in
  ``tp_axes`` and the mixin builds the ShardedTensors; :func:`column_parallel`,
  :func:`row_parallel`, :func:`replicated`, :func:`fused_column_parallel` and
  :func:`stack_layers` are the building blocks (layers stacked along a layer axis
  with a pipeline-stage offset via ``prepend_axis_num``).
* :class:`ParallelLayout` holds TP/PP/DP sizes, ranks and process groups.
* :func:`load_into_module` copies loaded values that were not filled in place
  (factory merges) back into the module.

Dict paths of the returned state dicts are the module's ``state_dict()`` names
(with ``prefix``); ShardedTensor keys are the same names except for stacked
layers, whose layer index moves into the global tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Collection, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as tdist
from torch import nn

from .dtensors import dtensor_to_sharded_tensor, is_dtensor, mesh_replica_index  # noqa: F401 (public here too)
from .errors import MismatchError
from .mapping import ReplicaId, ShardedTensor, ShardedTensorFactory

__all__ = [
    "ParallelLayout",
    "ShardedModuleMixin",
    "default_sharded_state_dict",
    "module_sharded_state_dict",
    "dtensor_to_sharded_tensor",
    "mesh_replica_index",
    "column_parallel",
    "row_parallel",
    "replicated",
    "fused_column_parallel",
    "stack_layers",
    "load_into_module",
    "load_module_state_dict",
    "state_dict_sharded",
    "StateDictMismatchError",
]


def _world() -> Tuple[int, int]:
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


@dataclass
class ParallelLayout:
    """Tensor / pipeline / data-parallel sizes, this rank's coordinates and groups.

    Rank order follows Megatron-Core (TP fastest, then DP, then PP):
    ``rank = (pp_rank * dp_size + dp_rank) * tp_size + tp_rank``.
    Build one collectively with :meth:`initialize` (every rank, same arguments).
    """

    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    tp_group: Optional[tdist.ProcessGroup] = None
    pp_group: Optional[tdist.ProcessGroup] = None
    dp_group: Optional[tdist.ProcessGroup] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def rank_replica_id(self) -> int:
        """A replica id unique per rank within a DP x TP grid (0 only at tp_rank = dp_rank = 0)."""
        return self.tp_rank + self.tp_size * self.dp_rank

    @classmethod
    def initialize(cls, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, backend: Optional[str] = None) -> "ParallelLayout":
        """Create the TP, PP and DP groups (collective when ``torch.distributed`` is initialized).

        Without ``torch.distributed`` (or world size 1) returns the trivial layout.
        ``data_parallel_size = world_size / (tp * pp)``.
        """
        rank, world = _world()
        tp, pp = int(tensor_parallel_size), int(pipeline_parallel_size)
        if tp < 1 or pp < 1 or world % (tp * pp):
            raise ValueError(
                f"world size {world} is not divisible by tensor_parallel_size={tp} x pipeline_parallel_size={pp}"
            )
        dp = world // (tp * pp)
        tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        layout = cls(tp, pp, dp, tp_rank, pp_rank, dp_rank)
        if world == 1 or not tdist.is_initialized():
            return layout
        kw = {"backend": backend} if backend else {}

        def rank_of(t: int, d: int, p: int) -> int:
            return (p * dp + d) * tp + t

        for p in range(pp):  # every rank creates every group, in the same order
            for d in range(dp):
                g = tdist.new_group([rank_of(t, d, p) for t in range(tp)], **kw)
                if (p, d) == (pp_rank, dp_rank):
                    layout.tp_group = g
        for p in range(pp):
            for t in range(tp):
                g = tdist.new_group([rank_of(t, d, p) for d in range(dp)], **kw)
                if (p, t) == (pp_rank, tp_rank):
                    layout.dp_group = g
        for d in range(dp):
            for t in range(tp):
                g = tdist.new_group([rank_of(t, d, p) for p in range(pp)], **kw)
                if (d, t) == (dp_rank, tp_rank):
                    layout.pp_group = g
        return layout


# ---------------------------------------------------------------------------------------------
# building blocks
# ---------------------------------------------------------------------------------------------
def replicated(key: str, tensor: torch.Tensor, replica_id: ReplicaId = 0) -> ShardedTensor:
    """A tensor held whole by every rank; only ``replica_id == 0`` writes it."""
    return ShardedTensor.from_rank_offsets(key, tensor, replica_id=replica_id)


def column_parallel(key: str, tensor: torch.Tensor, tp_rank: int, tp_size: int, replica_id: ReplicaId = 0) -> ShardedTensor:
    """Column-parallel weight/bias (``nn.Linear`` output features split): axis 0 split in ``tp_size``."""
    return ShardedTensor.from_rank_offsets(key, tensor, (0, tp_rank, tp_size), replica_id=replica_id)


def row_parallel(key: str, tensor: torch.Tensor, tp_rank: int, tp_size: int, replica_id: ReplicaId = 0) -> ShardedTensor:
    """Row-parallel weight (``nn.Linear`` input features split): axis 1 split in ``tp_size``."""
    return ShardedTensor.from_rank_offsets(key, tensor, (1, tp_rank, tp_size), replica_id=replica_id)


def fused_column_parallel(
    key: str, tensor: torch.Tensor, tp_rank: int, tp_size: int, num_parts: int = 3, replica_id: ReplicaId = 0
) -> ShardedTensorFactory:
    """A fused column-parallel tensor (e.g. QKV: local ``[q_r; k_r; v_r]``) stored as ``num_parts``
    separate column-parallel tensors ``{key}.part{i}``, so it reshards under any TP size."""

    def build(k: str, t: torch.Tensor, rid: ReplicaId, _: Optional[slice]) -> Dict[str, ShardedTensor]:
        parts = t.chunk(num_parts, dim=0)
        return {f"part{i}": ShardedTensor.from_rank_offsets(f"{k}.part{i}", p, (0, tp_rank, tp_size), replica_id=rid)
                for i, p in enumerate(parts)}

    def merge(sd: Dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([sd[f"part{i}"] for i in range(num_parts)], dim=0)

    return ShardedTensorFactory(key, tensor, build, merge, replica_id)


def stack_layers(
    layer_state_dicts: Sequence[Dict[str, Any]], layer_offset: int, num_layers: int, layer_key_prefix: str, index_tag: str = "{i}"
) -> Dict[str, Any]:
    """Stack per-layer sharded state dicts along a leading layer axis (``prepend_axis_num``).

    ``layer_state_dicts[i]`` is local layer ``i`` (global index ``layer_offset + i`` of
    ``num_layers``, e.g. ``layer_offset = pp_rank * layers_per_stage``). Every
    ShardedTensor key containing ``f"{layer_key_prefix}{i}."`` is renamed to
    ``f"{layer_key_prefix}"`` + rest, and gets a prepended global axis of size
    ``num_layers``, so a checkpoint written with one pipeline split loads with another.
    Dict paths are unchanged. Factories are not supported here.
    """
    out: Dict[str, Any] = {}
    for i, sd in enumerate(layer_state_dicts):
        g = layer_offset + i
        tag = f"{layer_key_prefix}{index_tag.format(i=i)}."
        for path, st in sd.items():
            if isinstance(st, ShardedTensorFactory):
                raise TypeError(f"stack_layers: factory {st.key!r} cannot be stacked; use plain ShardedTensors")
            if not isinstance(st, ShardedTensor):
                out[path] = st
                continue
            key = st.key.replace(tag, layer_key_prefix, 1)
            frag = None if st.axis_fragmentations is None else (num_layers, *st.axis_fragmentations)
            out[path] = replace(
                st,
                key=key,
                global_shape=(num_layers, *st.global_shape),
                global_offset=(g, *st.global_offset),
                axis_fragmentations=frag,
                prepend_axis_num=st.prepend_axis_num + 1,
            )
    return out


# ---------------------------------------------------------------------------------------------
# defaults: everything ``module.state_dict()`` returns
# ---------------------------------------------------------------------------------------------
def _has_own_hook(module: nn.Module) -> bool:
    hook = getattr(type(module), "sharded_state_dict", None)
    return callable(hook)


def _local_tensors(module: nn.Module) -> Iterable[Tuple[str, torch.Tensor]]:
    for name, p in module._parameters.items():
        if p is not None:
            yield name, p
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            yield name, b


def _default_replica_id(metadata: Optional[dict]) -> ReplicaId:
    if metadata and "replica_id" in metadata:
        return metadata["replica_id"]
    if metadata and isinstance(metadata.get("layout"), ParallelLayout):
        return metadata["layout"].rank_replica_id
    return _world()[0]


def _hooked_descendants(module: nn.Module, prefix: str) -> List[Tuple[str, nn.Module]]:
    """The topmost descendants of ``module`` with a ``sharded_state_dict`` hook, with their key prefixes."""
    out: List[Tuple[str, nn.Module]] = []
    for name, child in module._modules.items():
        if child is None:
            continue
        p = f"{prefix}{name}."
        if _has_own_hook(child):
            out.append((p, child))
        else:
            out.extend(_hooked_descendants(child, p))
    return out


def _default_entry(key: str, value: object, rid: ReplicaId, metadata: Optional[dict]) -> Any:
    """One ``state_dict()`` entry as saved: a tensor as a ShardedTensor (a DTensor as its shard, ``None``
    when this rank's shard is empty), anything else (``get_extra_state()`` objects, list states) as is:
    common state, taken from the first rank."""
    if is_dtensor(value):
        root = metadata.get("dtensor_mesh") if metadata else None
        return dtensor_to_sharded_tensor(key, value, None if root is None else mesh_replica_index(value, root))
    if isinstance(value, torch.Tensor):
        # a frozen parameter stays one (it needs no detaching): saves keep it in data files of their
        # own, which incremental saves then link (storage.incremental)
        frozen = isinstance(value, nn.Parameter) and not value.requires_grad
        return ShardedTensor.from_rank_offsets(key, value if frozen else value.detach(), replica_id=rid)
    return value


def state_dict_sharded(
    module: nn.Module, prefix: str = "", metadata: Optional[dict] = None, own_tensor: Optional[Any] = None
) -> Dict[str, Any]:
    """The sharded state dict of everything ``module.state_dict(prefix=prefix)`` returns.

    ``module.state_dict()`` runs with every hook it has (``_save_to_state_dict`` overrides such as
    torchmetrics' persistent metric states, ``get_extra_state``, state-dict pre/post hooks), so its keys
    and values are exactly what a plain ``torch.save(module.state_dict())`` would hold. Descendants
    with their own ``sharded_state_dict`` hook are asked for theirs instead (their keys are skipped
    here). ``own_tensor(name, tensor, key)`` may describe ``module``'s own parameters and buffers
    (returning ``None`` falls back to the default); every other entry goes through the default: tensors
    replicated (``replica_id`` from ``metadata``), DTensors as their shard, other values as common state.
    """
    rid = _default_replica_id(metadata)
    sd = module.state_dict(prefix=prefix, keep_vars=True)
    out: Dict[str, Any] = {}
    hooked = _hooked_descendants(module, prefix)
    for child_prefix, child in hooked:
        out.update(child.sharded_state_dict(prefix=child_prefix, metadata=metadata))
    skip = tuple(p for p, _ in hooked)
    own = {id(t): name for name, t in _local_tensors(module)} if own_tensor is not None else {}
    for key, value in sd.items():
        if skip and key.startswith(skip):
            continue
        entry = None
        name = own.get(id(value))
        if name is not None and key == f"{prefix}{name}":
            entry = own_tensor(name, value, key)
        if entry is None:
            entry = _default_entry(key, value, rid, metadata)
            if entry is None:  # a DTensor whose shard on this rank is empty: nothing to save or load here
                continue
        out[key] = entry
    return out


def default_sharded_state_dict(module: nn.Module, prefix: str = "", metadata: Optional[dict] = None) -> Dict[str, Any]:
    """The sharded state dict of ``module`` without a hand-written hook: what ``module.state_dict()`` holds.

    Keys and entries are those of ``module.state_dict(prefix=prefix)`` (non-persistent buffers
    excluded; extra state, ``_save_to_state_dict`` overrides and state-dict hooks included).
    DTensors become their shard (:func:`dtensor_to_sharded_tensor`; with ``metadata["dtensor_mesh"]``
    = the whole device mesh, a DTensor on a sub-mesh of it is marked replicated along the other dims,
    see :func:`mesh_replica_index`); other tensors are replicated with ``replica_id`` = this rank
    (``metadata["replica_id"]`` or ``metadata["layout"].rank_replica_id`` override it), so each is
    written once; non-tensor values (``get_extra_state()`` objects, list states) are common state.
    A descendant with its own ``sharded_state_dict`` hook is asked with its prefix instead.
    Restore with :func:`load_module_state_dict` so the module's own ``load_state_dict`` hooks run.
    """
    return state_dict_sharded(module, prefix, metadata)


def module_sharded_state_dict(module: nn.Module, prefix: str = "", metadata: Optional[dict] = None) -> Dict[str, Any]:
    """``module.sharded_state_dict(prefix, metadata)`` if the module has that hook, else the default."""
    if _has_own_hook(module):
        return module.sharded_state_dict(prefix=prefix, metadata=metadata)
    return default_sharded_state_dict(module, prefix, metadata)


class ShardedModuleMixin:
    """Mixin for ``nn.Module`` s with hand-written tensor/pipeline parallelism.

    Set ``self.parallel_layout`` (a :class:`ParallelLayout`) and declare the split
    of local parameters in ``tp_axes``: ``{"weight": 0}`` (column-parallel),
    ``{"weight": 1}`` (row-parallel), or ``"fused:3"`` for a fused column-parallel
    tensor stored as 3 reshardable parts (QKV). Parameters not listed are
    replicated (norms, row-parallel biases). Override :meth:`sharded_state_dict`
    for anything else, using the module-level helpers.

    Example::

        class ColumnParallelLinear(ShardedModuleMixin, nn.Module):
            tp_axes = {"weight": 0, "bias": 0}
    """

    tp_axes: Dict[str, Any] = {}
    parallel_layout: Optional[ParallelLayout] = None

    def _layout(self, metadata: Optional[dict]) -> ParallelLayout:
        if metadata and isinstance(metadata.get("layout"), ParallelLayout):
            return metadata["layout"]
        return self.parallel_layout or ParallelLayout()

    def sharded_state_dict(self, prefix: str = "", metadata: Optional[dict] = None) -> Dict[str, Any]:
        """ShardedTensors for own parameters per ``tp_axes``; everything else ``state_dict()`` holds
        (children, buffers, extra state) as :func:`default_sharded_state_dict` describes it."""
        lay = self._layout(metadata)

        def own(name: str, t: torch.Tensor, key: str) -> Any:
            data = t.detach()
            spec = self.tp_axes.get(name)
            if spec is None:
                return replicated(key, data, lay.rank_replica_id)
            if isinstance(spec, str) and spec.startswith("fused:"):
                return fused_column_parallel(key, data, lay.tp_rank, lay.tp_size, int(spec.split(":")[1]), lay.dp_rank)
            if spec == 0:
                return column_parallel(key, data, lay.tp_rank, lay.tp_size, lay.dp_rank)
            if spec == 1:
                return row_parallel(key, data, lay.tp_rank, lay.tp_size, lay.dp_rank)
            raise ValueError(f"{type(self).__name__}.tp_axes[{name!r}] = {spec!r}; use 0, 1 or 'fused:N'")

        return state_dict_sharded(self, prefix, {**(metadata or {}), "layout": lay}, own)  # type: ignore[arg-type]


def load_into_module(module: nn.Module, loaded: Dict[str, Any], prefix: str = "") -> List[str]:
    """Copy loaded tensors into ``module`` where they were not filled in place.

    ``loaded`` is the result of ``ci.load`` for a request built by
    :func:`module_sharded_state_dict` (dict paths = state-dict names). Tensors
    already sharing the target's memory are skipped; factory merges (new tensors)
    are copied. Returns the names that were copied.

    Raises ``ValueError`` naming every loaded tensor (under ``prefix``) that could not
    be put back: its key is no state-dict name of ``module`` and it shares no memory
    with the module's parameters or buffers (e.g. a ``sharded_state_dict`` hook that
    returned ``weight.t().contiguous()`` under a key of its own). Such weights would
    otherwise silently keep their old values.
    """
    copied: List[str] = []
    targets = dict(module.state_dict(keep_vars=True))
    unplaced: List[str] = []
    storages = None  # built on first need: only hooks with keys of their own get here
    for name, value in loaded.items():
        if not isinstance(value, torch.Tensor) or not name.startswith(prefix):
            continue
        target = targets.get(name[len(prefix):])
        if target is None:
            if value.numel() == 0:
                continue
            if storages is None:
                storages = set()
                for t in [*targets.values(), *module.parameters(), *module.buffers()]:
                    if isinstance(t, torch.Tensor):
                        t = t.to_local() if is_dtensor(t) else t
                        storages.add(t.untyped_storage().data_ptr())
            # a view of a parameter / buffer (any key) was filled in place by the load
            if value.untyped_storage().data_ptr() not in storages:
                unplaced.append(name)
            continue
        local = target.to_local() if is_dtensor(target) else target
        local = local.detach()
        if local.data_ptr() == value.data_ptr() and local.numel() == value.numel():
            continue
        with torch.no_grad():
            local.copy_(value.view(local.shape))
        copied.append(name)
    if unplaced:
        raise ValueError(
            f"load_into_module: {len(unplaced)} loaded tensor(s) could not be put back into "
            f"{type(module).__name__}: {sorted(unplaced)}. Their keys are not state-dict names "
            f"(prefix {prefix!r}) and they share no memory with the module's parameters or buffers, so "
            "the module's weights would not be restored. In sharded_state_dict(), give such entries the "
            "parameter's memory (a view, not a copy such as .t().contiguous()), or use a "
            "ShardedTensorFactory whose merge_fn returns the tensor under the parameter's state-dict name."
        )
    return copied


class StateDictMismatchError(MismatchError, RuntimeError):
    """Strict loading found keys of the module missing from the checkpoint, or checkpoint keys the module
    does not have (a ``RuntimeError`` too, like ``torch.nn.Module.load_state_dict(strict=True)``'s)."""


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _as_target(value: object, target: object) -> Any:
    """A loaded value shaped for ``target``'s ``load_state_dict``: the target itself when the load filled
    its memory in place, a DTensor with the target's mesh and placements for a loaded local shard."""
    if not isinstance(value, torch.Tensor) or not isinstance(target, torch.Tensor):
        return value
    if is_dtensor(target) and not is_dtensor(value):
        local = target.to_local()
        if _shares_memory(value, local) and value.data_ptr() == local.data_ptr():
            return target
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(value.reshape(local.shape), target.device_mesh, target.placements,
                                  run_check=False, shape=target.shape, stride=target.stride())
    if value.data_ptr() == target.data_ptr() and value.shape == target.shape:
        return target
    return value


def load_module_state_dict(
    module: nn.Module,
    loaded: Dict[str, Any],
    prefix: str = "",
    strict: bool = True,
    *,
    missing_keys: Iterable[str] = (),
    unexpected_keys: Iterable[str] = (),
    requested_keys: Optional[Iterable[str]] = None,
) -> Tuple[List[str], List[str]]:
    """Restore ``module`` from ``loaded`` through its own ``load_state_dict`` (hooks, ``set_extra_state``,
    torchmetrics' ``_load_from_state_dict`` all run).

    ``loaded`` is what :func:`ckpt_integration.load` returned for a request built by
    :func:`module_sharded_state_dict` (keys: ``prefix`` + state-dict names). Tensors the load filled in
    place are passed as the module's own tensors (no copy); loaded local shards of DTensor parameters
    are passed as DTensors. Entries that are not in ``loaded`` keep the module's value: with a
    ``sharded_state_dict`` hook the load may have filled them in place under keys of its own (a loaded
    tensor under a key that is no state-dict name must share memory with the module, else
    ``ValueError``, as in :func:`load_into_module`). With ``requested_keys`` (the keys of the request
    that held ShardedTensors / factories), other entries under keys the module does not have (e.g.
    added to ``checkpoint["state_dict"]`` by ``on_save_checkpoint``) are unexpected keys instead.

    ``missing_keys`` (in the module, not in the checkpoint) and ``unexpected_keys`` (in the checkpoint,
    not in the module) come from the load (``strict="return_all"``); non-tensor entries that are not
    in ``loaded`` are missing too. With ``strict`` any of them raises :class:`StateDictMismatchError`
    naming them all, like ``torch.nn.Module.load_state_dict(strict=True)``; otherwise they are returned.
    Returns ``(missing_keys, unexpected_keys)``.
    """
    targets = module.state_dict(keep_vars=True)
    sd: Dict[str, Any] = {}
    missing = {k[len(prefix):] if k.startswith(prefix) else k for k in missing_keys}
    for name, target in targets.items():
        key = f"{prefix}{name}"
        if key in loaded:
            sd[name] = _as_target(loaded[key], target)
        else:
            sd[name] = target  # keeps the module's value (missing, filled in place under another key, empty shard)
            if not isinstance(target, torch.Tensor):
                missing.add(name)  # a common-state entry the checkpoint does not have
    extra = {k: v for k, v in loaded.items() if k.startswith(prefix) and k[len(prefix):] not in targets}
    if requested_keys is not None:
        requested = set(requested_keys)
        unexpected_keys = [*unexpected_keys, *(k for k in extra if k not in requested)]
        extra = {k: v for k, v in extra.items() if k in requested}
    if extra:  # a tensor under a key of a hook's own must have been loaded into the module's memory
        load_into_module(module, extra, prefix)
    result = module.load_state_dict(sd, strict=False)
    missing_out = sorted(missing | set(result.missing_keys))
    unexpected_out = sorted({k[len(prefix):] if k.startswith(prefix) else k for k in unexpected_keys}
                            | set(result.unexpected_keys))
    if strict:
        raise_on_key_mismatch(module, missing_out, unexpected_out)
    return missing_out, unexpected_out


def raise_on_key_mismatch(module: nn.Module, missing: Collection[str], unexpected: Collection[str]) -> None:
    """Raise :class:`StateDictMismatchError` naming ``module``'s missing and unexpected keys, if any
    (the strict check of every module-loading path)."""
    if not (missing or unexpected):
        return
    parts = []
    if missing:
        parts.append(f"missing key(s) (in the module, not in the checkpoint): {sorted(missing)}")
    if unexpected:
        parts.append(f"unexpected key(s) (in the checkpoint, not in the module): {sorted(unexpected)}")
    raise StateDictMismatchError(
        f"error(s) loading the state dict of {type(module).__name__}: " + "; ".join(parts)
        + ". Pass strict=False (Lightning: LightningModule.strict_loading = False) to load the matching keys only."
    )
