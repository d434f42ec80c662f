"""Megatron-compatible optimizer helpers: which model ShardedTensor each optimizer param belongs
to, and ``optimizer.state_dict()`` <-> optimizer sharded state dict.

Each per-param tensor state becomes a copy of the parameter's ShardedTensor (or factory) keyed
``f"{prefix}.state.{state_name}.{param_key}"`` (Megatron-Core's keys); each scalar state
(``step``, ...) a ShardedObject under the same key scheme, in its place, so the dict ``load``
returns is a plain ``optimizer.state_dict()`` (a fused param's scalars once per part, keyed like
the parts' tensor states, so that they follow the weights to separate params and back). Checkpoints of earlier versions kept the
scalars in one ShardedObject ``f"{prefix}.param_state.{param_key}"`` per param; they still load
with :func:`~ckpt_integration.optimizer.load_optimizer_state`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from ..dict_utils import nested_values
from ..errors import CheckpointingException, MismatchError
from ..foreign import sharded_kind, to_native
from ..mapping import (
    LocalNonpersistentObject,
    ReplicaId,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    is_main_replica,
)
from ..dtensors import is_dtensor

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "optimizer"


def is_optimizer_state_key(key: str) -> bool:
    """Whether a stored tensor key is optimizer state as the Lightning integration and the tools store it
    (``optimizer.state.<name>.<param>``, ``optimizer_1.state.…``), not a model weight whose name starts
    alike (a submodule ``optimizer_net``, or one named ``optimizer``)."""
    head, _, rest = key.partition(".")
    return rest.startswith("state.") and (head == DEFAULT_PREFIX or (
        head.startswith(DEFAULT_PREFIX + "_") and head[len(DEFAULT_PREFIX) + 1:].isdigit()))


def optimizer_key(idx: int) -> str:
    """Prefix and top-level key of optimizer ``idx`` of several (``optimizer``, ``optimizer_1``, ...), as the
    Lightning integration and the tools store them."""
    return DEFAULT_PREFIX if idx == 0 else f"{DEFAULT_PREFIX}_{idx}"

#: key of the per-parameter metadata object inside ``state[param_id]`` of earlier versions
PARAM_META_KEY = "_ckpt_param_state"
#: state names that are not torch-optimizer state (returned to the caller, never put into torch state)
EXTRA_STATE_NAMES = ("fp32_param",)

ShardedParam = Union[ShardedTensor, ShardedTensorFactory]


class OptimizerStateNotFoundError(CheckpointingException):
    """The checkpoint holds no optimizer state (it was saved without it)."""


class OptimizerStateMismatchError(MismatchError):
    """The optimizer state in the checkpoint does not fit the current parameters (names/shapes)."""


class UnmatchedParameterError(CheckpointingException):
    """An optimizer parameter has no counterpart in the model's sharded state dict."""


# ---------------------------------------------------------------------------------------------
# identity mapping
# ---------------------------------------------------------------------------------------------
def _local(t: object) -> Any:
    """This rank's shard of a DTensor (``torch.distributed.tensor``: FSDP2 / TP params and their
    optimizer states); any other value unchanged."""
    return t.to_local() if is_dtensor(t) else t


def empty_local_shard(p: object) -> bool:
    """A param with no elements on this rank (a zero-size param, or a DTensor whose shard here is
    empty after an uneven FSDP2 / TP split): nothing to save or load here."""
    return isinstance(p, torch.Tensor) and _local(p).numel() == 0


def _identity(t: torch.Tensor) -> Optional[Tuple[int, int, torch.dtype]]:
    """Identity of a tensor's memory: same for a parameter, its ``.detach()``/``.data`` and reshapes.

    A DTensor is identified by its local shard (what its ShardedTensor holds).
    """
    t = _local(t)
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return None
    return (t.data_ptr(), t.numel(), t.dtype)


def get_optim_param_to_id_map(optim_params_iter: Iterable[torch.Tensor]) -> Dict[Any, int]:
    """``{identity(param): param_id}`` with ids numbered like ``optimizer.state_dict()`` (0, 1, ...)."""
    out: Dict[Any, int] = {}
    for i, p in enumerate(optim_params_iter):
        ident = _identity(p)
        if ident is not None:
            out.setdefault(ident, i)
    return out


def _param_label(i: int, p: torch.Tensor, names: Optional[Dict[int, str]]) -> str:
    name = names.get(i) if names else None
    desc = f"shape {tuple(p.shape)}, {p.dtype}"
    return f"{name!r} (optimizer param id {i}, {desc})" if name else f"optimizer param id {i} ({desc})"


def names_from_module(module: Optional[torch.nn.Module], params: Sequence[torch.Tensor]) -> Dict[int, str]:
    """Position in ``params`` -> the parameter's name in ``module`` (empty without a module)."""
    if module is None:
        return {}
    by_ident = {_identity(p): n for n, p in module.named_parameters()}
    return {i: by_ident[_identity(p)] for i, p in enumerate(params) if _identity(p) in by_ident}


def get_param_id_to_sharded_param_map(
    model_sharded_state_dict: ShardedStateDict,
    optim_params_iter: Iterable[torch.Tensor],
    *,
    strict: bool = True,
    module: Optional[torch.nn.Module] = None,
) -> Dict[int, ShardedParam]:
    """Map each optimizer param id to the model ShardedTensor/ShardedTensorFactory holding it.

    Matching is by tensor identity (same memory: the parameter itself, ``p.detach()``,
    ``p.data`` or a reshaped view; for a DTensor parameter its local shard, as
    :func:`~ckpt_integration.modules.default_sharded_state_dict` puts it), never by name
    or shape. DTensor params whose shard on this rank is empty are left out. Param ids follow
    ``optimizer.state_dict()`` numbering (all groups' params in order).
    With ``strict`` (default) a parameter without a sharded counterpart raises
    :class:`UnmatchedParameterError` naming it (names come from ``module`` if given);
    ``strict=False`` only logs, like Megatron-Core.
    """
    return param_map_and_aliases(model_sharded_state_dict, optim_params_iter, strict=strict, module=module)[0]


def param_map_and_aliases(
    model_sharded_state_dict: ShardedStateDict,
    optim_params_iter: Iterable[torch.Tensor],
    *,
    strict: bool = True,
    module: Optional[torch.nn.Module] = None,
) -> Tuple[Dict[int, ShardedParam], Dict[int, List[ShardedParam]]]:
    """:func:`get_param_id_to_sharded_param_map`, and the other entries over each param's memory (a tied
    weight: ``emb.weight`` and ``head.weight``). A param's optimizer state is keyed by the entry seen first;
    a load into a module that declares the two in another order finds it under the other one."""
    params = list(optim_params_iter)
    param_to_id = get_optim_param_to_id_map(params)
    out: Dict[int, ShardedParam] = {}
    aliases: Dict[int, List[ShardedParam]] = {}
    for v in nested_values(model_sharded_state_dict):
        if sharded_kind(v) not in ("ShardedTensor", "ShardedTensorFactory") or not isinstance(v.data, torch.Tensor):
            continue
        pid = param_to_id.get(_identity(v.data))
        if pid is None:
            continue
        sp = to_native(v)  # Megatron-Core's classes (a Megatron model's state dict) become ours
        if isinstance(sp, ShardedTensor) and permuted(v.data, _local(params[pid])):
            sp = view_factory(sp, _local(params[pid]))
        if pid not in out:
            out[pid] = sp
        elif sp.key != out[pid].key:
            aliases.setdefault(pid, []).append(sp)
    # a DTensor param with an empty shard on this rank has no ShardedTensor here (nothing to save or load)
    unmatched = [i for i in range(len(params)) if i not in out and not empty_local_shard(params[i])]
    if unmatched:
        names = names_from_module(module, params)
        labels = ", ".join(_param_label(i, params[i], names) for i in unmatched)
        msg = (
            f"{len(unmatched)} optimizer parameter(s) have no ShardedTensor/ShardedTensorFactory in the "
            f"model sharded state dict (matched by tensor identity): {labels}. Put the parameter (or "
            "p.detach()) as the data of its ShardedTensor"
        )
        if strict:
            raise UnmatchedParameterError(msg)
        logger.warning(msg)
    return out, aliases


def permuted(view: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether ``view``, a tensor over ``param``'s memory, lists the elements in another order than a
    reshape of ``param`` would: a transpose or permutation (e.g. a Conv1D weight saved as ``w.t()``)."""
    if view.is_contiguous() and param.is_contiguous():
        return False
    return not (view.shape == param.shape and view.stride() == param.stride())


def _as_view(t: torch.Tensor, size: Tuple[int, ...], stride: Tuple[int, ...], pshape: Tuple[int, ...],
             pstride: Tuple[int, ...]) -> torch.Tensor:
    """``t`` (shaped like the param) seen as the param's saved view sees the param (``size``, ``stride``)."""
    if tuple(t.shape) != pshape:
        raise OptimizerStateMismatchError(f"optimizer tensor of shape {tuple(t.shape)} for a parameter of shape {pshape}")
    if t.stride() != pstride:  # (laid out like the param first: the view's strides are the param's memory order)
        t = torch.empty_strided(pshape, pstride, dtype=t.dtype, device=t.device).copy_(t)
    return t.as_strided(size, stride, t.storage_offset())


def view_factory(sp: ShardedTensor, param: torch.Tensor) -> ShardedTensorFactory:
    """The parameter of a ShardedTensor that holds a permuted view of it (:func:`permuted`), as a factory
    that shows each param-shaped optimizer tensor the same way, and puts a loaded one back in the param's
    order: reshaping it instead files each state element under another weight element."""
    geometry = (tuple(sp.data.shape), tuple(sp.data.stride()), tuple(param.shape), tuple(param.stride()))

    def build(key: str, data: torch.Tensor, replica_id: ReplicaId, _: Optional[slice]) -> ShardedTensor:
        view = _as_view(data, *geometry)
        return replace(sp, key=key, data=view, dtype=view.dtype, replica_id=replica_id)

    def merge(loaded: torch.Tensor) -> torch.Tensor:
        out = torch.empty_strided(geometry[2], geometry[3], dtype=loaded.dtype, device=loaded.device)
        _as_view(out, *geometry).copy_(loaded)
        return out

    return ShardedTensorFactory(sp.key, param.detach(), build, merge, sp.replica_id)


def is_view_factory(sp: object) -> bool:
    """Whether ``sp`` is what :func:`view_factory` made of a permuted view."""
    return isinstance(sp, ShardedTensorFactory) and getattr(sp.build_fn, "__qualname__", "").startswith("view_factory.")


# ---------------------------------------------------------------------------------------------
# building the optimizer sharded state dict
# ---------------------------------------------------------------------------------------------
def make_sharded_optimizer_tensor(model_param: ShardedParam, optim_param: torch.Tensor, prefix: str) -> ShardedParam:
    """A copy of the parameter's ShardedTensor (or factory) for ``optim_param``, keyed ``f"{prefix}.{key}"``.

    Same global shape, offsets, replica_id and prepend_axis_num as the parameter;
    the dtype is ``optim_param``'s (e.g. fp32 state of a bf16 parameter).
    """
    model_param = to_native(model_param)
    key = f"{prefix}.{model_param.key}"
    if isinstance(model_param, ShardedTensorFactory):
        return replace(model_param, key=key, data=optim_param)
    if optim_param.numel() != model_param.local_numel():
        raise OptimizerStateMismatchError(
            f"optimizer tensor {key!r} has shape {tuple(optim_param.shape)} but the parameter "
            f"{model_param.key!r} has local shape {model_param.local_shape}"
        )
    if tuple(optim_param.shape) != model_param.local_shape and isinstance(model_param.data, torch.Tensor) and \
            not model_param.data.is_contiguous():  # (a permuted view: get_param_id_to_sharded_param_map maps those)
        raise OptimizerStateMismatchError(
            f"optimizer tensor {key!r}: the parameter's ShardedTensor {model_param.key!r} holds a non-contiguous view of "
            f"shape {model_param.local_shape} (a transpose?), the state has the parameter's shape {tuple(optim_param.shape)}: "
            "a reshape would file its elements under other weights. Build the optimizer's sharded state dict with "
            "optimizer_sharded_state_dict(), or give the ShardedTensor the parameter in its own shape")
    data = optim_param if tuple(optim_param.shape) == model_param.local_shape else optim_param.view(model_param.local_shape)
    return replace(model_param, key=key, data=data, dtype=data.dtype)


def built_tensors(sp: ShardedParam, data: Optional[torch.Tensor] = None) -> List[ShardedTensor]:
    """The ShardedTensors a param is stored as, sorted by key: itself, or what its factory builds."""
    if isinstance(sp, ShardedTensor):
        return [sp]
    built = sp.build_fn(sp.key, sp.data if data is None else data, sp.replica_id, None)
    tensors = [to_native(v) for v in nested_values(built) if sharded_kind(v) == "ShardedTensor"]
    if not tensors:
        raise CheckpointingException(f"ShardedTensorFactory {sp.key!r} builds no ShardedTensor")
    return sorted(tensors, key=lambda t: t.key)


def _first_built_tensor(sp: ShardedParam, data: Optional[torch.Tensor] = None) -> ShardedTensor:
    return built_tensors(sp, data)[0]


def _meta_grid(st: ShardedTensor) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    p = st.prepend_axis_num
    if p:
        return st.global_shape[:p], st.global_offset[:p]
    return (1,), (0,)


def is_origin(st: ShardedTensor) -> bool:
    """Whether ``st`` is the shard at offset 0 of every (non-prepended) axis."""
    return all(o == 0 for o in st.global_offset[st.prepend_axis_num:])


def grid_object(key: str, st: ShardedTensor, data: object, main: Optional[bool] = None) -> ShardedObject:
    """A ShardedObject ``key`` placed like ``st``: one grid position per stacked layer (its
    prepended axes), saved by the main replica holding the origin shard."""
    shape, offset = _meta_grid(st)
    if main is None:
        main = is_main_replica(st.replica_id) and is_origin(st)
    return ShardedObject(key, data, shape, offset, 0 if main else 1)


def param_object(key: str, sp: ShardedParam, data: object, main: Optional[bool] = None) -> ShardedObject:
    """A ShardedObject ``key`` that belongs to one param, placed like its first stored tensor."""
    return grid_object(key, _first_built_tensor(sp), data, main)


def _is_fused(sp: ShardedParam) -> bool:
    """A param stored under keys other than its own (a factory building parts, e.g. fused QKV)."""
    return isinstance(sp, ShardedTensorFactory) and [t.key for t in built_tensors(sp)] != [sp.key]


def same_scalar(a: Any, b: Any) -> bool:
    """Whether two scalar states (``step``, numbers, 0-dim tensors) are one value: tensors equal and of one
    dtype, anything else of one type and equal."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b) and a.dtype == b.dtype
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and type(a) is type(b) and a == b


def merge_part_scalars(key: str, values: Dict[str, Any]) -> Any:
    """The one value of a fused param's scalar state saved once per part (``{part key: value}``):
    the parts must agree (they were built from one value, or are separate params stepped together)."""
    items = sorted(values.items())
    first = items[0][1]
    for _, v in items[1:]:
        if not same_scalar(v, first):
            raise OptimizerStateMismatchError(
                f"optimizer state {key!r} differs between the parts the parameter is fused from, so it cannot "
                "become one value: " + ", ".join(f"{k!r} = {v!r}" for k, v in items)
            )
    return first.clone() if isinstance(first, torch.Tensor) else first


def state_object(prefix: str, name: str, sp: ShardedParam, data: object, main: Optional[bool] = None) -> Any:
    """A scalar state (``step``, a number, a 0-dim tensor, ...) of one param, saved in its place
    as ShardedObject ``f"{prefix}.state.{name}.{param_key}"``.

    A fused param (a factory storing parts) saves it once per part instead, keyed like the parts'
    tensor states (``f"{prefix}.state.{name}.{part_key}"``), so that it follows the weights into
    the unfused counterpart (separate params keyed like the parts) and back: the result is a
    factory building those objects, merged into one value on load (:func:`merge_part_scalars`).
    """
    if not _is_fused(sp):
        return param_object(f"{prefix}.state.{name}.{sp.key}", sp, data, main)
    parts = built_tensors(sp)
    owner = f"{prefix}.state.{name}.{sp.key}"

    def build(key: str, value: object, replica_id: ReplicaId, flattened_range: Optional[slice]) -> Dict[str, ShardedObject]:
        return {t.key: grid_object(f"{prefix}.state.{name}.{t.key}", t, value, main) for t in parts}

    return ShardedTensorFactory(owner, data, build, lambda loaded: merge_part_scalars(owner, loaded))


def _is_split(sp: ShardedParam) -> bool:
    """Whether the param's tensor is split across ranks (its local shard is not the whole tensor)."""
    st = _first_built_tensor(sp)
    return tuple(st.local_shape) != tuple(st.global_shape[st.prepend_axis_num:])


def _is_param_tensor_state(v: object, param_numel: int) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == param_numel


def optim_state_to_sharding_state(
    optim_state_dict: Dict[str, Any],
    id_to_sharded_param_map: Dict[int, ShardedParam],
    exclude_keys: Union[str, Sequence[str]] = (),
    *,
    prefix: str = DEFAULT_PREFIX,
) -> None:
    """Turn ``optimizer.state_dict()`` into a sharded state dict, in place (Megatron-compatible).

    Every per-param tensor state with the parameter's number of elements becomes
    :func:`make_sharded_optimizer_tensor` keyed ``f"{prefix}.state.{name}.{param_key}"``
    (Megatron-Core's keys); every other state (``step``, numbers, 0-dim tensors) becomes a
    ShardedObject under the same key scheme, in its place. ``param_groups[*]['params']``
    become LocalNonpersistentObjects. States named in ``exclude_keys`` are dropped (a
    string is tested by ``in``, as in Megatron-Core: ``exclude_keys="step"``). A state for a
    param id missing from the map raises.

    The dict ``load`` returns for such a request is what ``optimizer.load_state_dict``
    takes, scalars included; a Megatron-Core-style wrapper that saves
    ``state["common_step"]`` next to it (with ``exclude_keys="step"``) gets it back there.

    Example::

        osd = optimizer.state_dict()
        optim_state_to_sharding_state(osd, get_param_id_to_sharded_param_map(model_sd, params))
        save({"model": model_sd, "optimizer": osd}, path)
        ...
        optimizer.load_state_dict(load({"model": model_sd, "optimizer": osd}, path)["optimizer"])
    """
    sharded_state: Dict[Any, Any] = {}
    for param_id, param_state in optim_state_dict["state"].items():
        if not isinstance(param_id, int):  # e.g. Megatron-Core's "common_step": common state
            sharded_state[param_id] = param_state
            continue
        sp = id_to_sharded_param_map.get(param_id)
        if sp is None:
            raise UnmatchedParameterError(f"optimizer param id {param_id} does not match any model sharded param")
        numel = sp.data.numel() if isinstance(sp, ShardedTensorFactory) else sp.local_numel()
        entry: Dict[str, Any] = {}
        for name, value in param_state.items():
            if name in exclude_keys:
                continue
            value = _local(value)  # DTensor states (FSDP2 / TP params) are saved as this rank's shard
            if _is_param_tensor_state(value, numel):
                entry[name] = make_sharded_optimizer_tensor(sp, value, f"{prefix}.state.{name}")
            elif isinstance(value, torch.Tensor) and value.dim() > 0 and _is_split(sp):
                # e.g. Adafactor's row_var/col_var: shaped unlike the param, so it cannot follow the
                # param's sharding; saved as one object it would silently hand every rank rank 0's copy
                raise CheckpointingException(
                    f"optimizer state {name!r} of param {sp.key!r} (id {param_id}) has shape {tuple(value.shape)}, "
                    f"unlike the parameter's local shard ({numel} elements), and the parameter is sharded "
                    f"across ranks: it cannot be resharded with the parameter. Pass exclude_keys=({name!r},) "
                    "to leave it out of the checkpoint (re-create it after loading), or keep such optimizers on replicated params"
                )
            else:
                data = value.detach().clone() if isinstance(value, torch.Tensor) else value
                entry[name] = state_object(prefix, name, sp, data)
        sharded_state[param_id] = entry
    optim_state_dict["state"] = sharded_state
    for group in optim_state_dict["param_groups"]:
        group["params"] = LocalNonpersistentObject(group["params"])


def sharding_state_to_optim_state(loaded: Dict[str, Any], *, extract: Sequence[str] = EXTRA_STATE_NAMES) -> Dict[str, Any]:
    """The optimizer part of a ``load`` result, ready for ``optimizer.load_state_dict``, for the
    cases a plain ``optimizer.load_state_dict(loaded)`` does not cover.

    States named in ``extract`` (default ``fp32_param``: master weights that are not
    torch-optimizer state) are removed and returned under the extra key ``"extracted"``
    (``{param_id: {name: tensor}}``; pop it before calling ``load_state_dict``); a
    Megatron-Core ``state["common_step"]`` becomes every param's ``step``; a request built
    by an older version (with per-param ``_ckpt_param_state`` objects) gets its scalars back
    in place. Param groups given as ``{index: group}`` become a list.
    """
    state: Dict[Any, Dict[str, Any]] = {}
    extracted: Dict[int, Dict[str, Any]] = {}
    not_loaded: List[str] = []
    saved_state = dict(loaded.get("state", {}))
    common_step = saved_state.pop("common_step", None)
    for pid, pstate in saved_state.items():
        pstate = dict(pstate)
        meta = pstate.pop(PARAM_META_KEY, None) or {}
        lacking = [n for n in meta.get("tensors", {}) if n not in pstate]
        if lacking:
            not_loaded.append(f"param id {pid}: {', '.join(lacking)}")
        for name in list(pstate):
            if name in extract:
                extracted.setdefault(pid, {})[name] = pstate.pop(name)
        pstate.update(meta.get("scalars", {}))
        if common_step is not None and pstate and "step" not in pstate:
            pstate["step"] = common_step.clone() if isinstance(common_step, torch.Tensor) else common_step
        state[pid] = pstate
    if not_loaded:
        # the request had no tensors for these states: the optimizer had no state yet when its
        # sharded state dict was built; loading only the scalars would fail at the next step
        raise OptimizerStateMismatchError(
            "the checkpoint holds optimizer tensor states that were not requested (the optimizer had no state "
            "when optimizer_sharded_state_dict was called): build the request with init_state=True, or use "
            "load_optimizer_state(), which needs no existing state:\n  " + "\n  ".join(not_loaded[:20])
        )
    groups = loaded.get("param_groups", [])
    if isinstance(groups, dict):
        groups = [groups[k] for k in sorted(groups)]
    out = {"state": state, "param_groups": [dict(g) for g in groups]}
    if extracted:
        out["extracted"] = extracted
    return out
