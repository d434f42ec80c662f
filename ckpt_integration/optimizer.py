"""Optimizer state checkpointing: optimizer state sharded exactly like the model.

The optimizer's per-parameter state tensors (``exp_avg``, ``exp_avg_sq``,
``momentum_buffer``, fp32 master weights, ...) are described with the *same*
sharding as the parameter they belong to: each becomes a copy of the
parameter's :class:`~ckpt_integration.ShardedTensor` (or
:class:`~ckpt_integration.ShardedTensorFactory`) with the key
``f"{prefix}.state.{state_name}.{param_key}"``, e.g.
``optimizer.state.exp_avg.decoder.fc1.weight``. Optimizer state therefore
reshards exactly like the weights (TP/PP/DP changes, fused tensors).

Per parameter, one small :class:`~ckpt_integration.ShardedObject`
``f"{prefix}.param_state.{param_key}"`` stores the scalar states (``step``) and
the names/dtypes of the tensor states, so a job whose optimizer has no state yet
can load without running a training step. ``param_groups`` hyper-parameters are
common state; their ``params`` lists stay local (``LocalNonpersistentObject``).

Public names: :func:`get_param_id_to_sharded_param_map`,
:func:`make_sharded_optimizer_tensor`, :func:`optim_state_to_sharding_state`,
:func:`sharding_state_to_optim_state`, :func:`optimizer_sharded_state_dict`,
:func:`init_optimizer_state`, :func:`load_optimizer_state`,
:func:`has_optimizer_state`, :func:`flat_range_to_boxes`,
:class:`MixedPrecisionOptimizer`, :class:`ZeroShardedOptimizer` and the errors
:class:`OptimizerStateNotFoundError`, :class:`OptimizerStateMismatchError`,
:class:`UnmatchedParameterError`. See ``docs/optimizer.md``.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import replace
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as tdist

from .dict_utils import nested_values
from .errors import CheckpointingException, MismatchError
from .mapping import (
    LocalNonpersistentObject,
    ReplicaId,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    is_main_replica,
)

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "optimizer"
#: key of the per-parameter metadata object inside ``state[param_id]``
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
def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _local(t: Any) -> Any:
    """This rank's shard of a DTensor (``torch.distributed.tensor``: FSDP2 / TP params and their
    optimizer states); any other value unchanged."""
    return t.to_local() if _is_dtensor(t) else t


def _empty_local_shard(p: Any) -> bool:
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


def _names_from_module(module: Optional[torch.nn.Module], params: Sequence[torch.Tensor]) -> Dict[int, str]:
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
    params = list(optim_params_iter)
    param_to_id = get_optim_param_to_id_map(params)
    out: Dict[int, ShardedParam] = {}
    for v in nested_values(model_sharded_state_dict):
        if not isinstance(v, (ShardedTensor, ShardedTensorFactory)) or not isinstance(v.data, torch.Tensor):
            continue
        pid = param_to_id.get(_identity(v.data))
        if pid is not None and pid not in out:
            out[pid] = v
    # a DTensor param with an empty shard on this rank has no ShardedTensor here (nothing to save or load)
    unmatched = [i for i in range(len(params)) if i not in out and not _empty_local_shard(params[i])]
    if unmatched:
        names = _names_from_module(module, params)
        labels = ", ".join(_param_label(i, params[i], names) for i in unmatched)
        msg = (
            f"{len(unmatched)} optimizer parameter(s) have no ShardedTensor/ShardedTensorFactory in the "
            f"model sharded state dict (matched by tensor identity): {labels}. Put the parameter (or "
            "p.detach()) as the data of its ShardedTensor"
        )
        if strict:
            raise UnmatchedParameterError(msg)
        logger.warning(msg)
    return out


# ---------------------------------------------------------------------------------------------
# building the optimizer sharded state dict
# ---------------------------------------------------------------------------------------------
def make_sharded_optimizer_tensor(model_param: ShardedParam, optim_param: torch.Tensor, prefix: str) -> ShardedParam:
    """A copy of the parameter's ShardedTensor (or factory) for ``optim_param``, keyed ``f"{prefix}.{key}"``.

    Same global shape, offsets, replica_id and prepend_axis_num as the parameter;
    the dtype is ``optim_param``'s (e.g. fp32 state of a bf16 parameter).
    """
    key = f"{prefix}.{model_param.key}"
    if isinstance(model_param, ShardedTensorFactory):
        return replace(model_param, key=key, data=optim_param)
    if optim_param.numel() != model_param.local_numel():
        raise OptimizerStateMismatchError(
            f"optimizer tensor {key!r} has shape {tuple(optim_param.shape)} but the parameter "
            f"{model_param.key!r} has local shape {model_param.local_shape}"
        )
    data = optim_param if tuple(optim_param.shape) == model_param.local_shape else optim_param.view(model_param.local_shape)
    return replace(model_param, key=key, data=data, dtype=data.dtype)


def _first_built_tensor(sp: ShardedParam, data: Optional[torch.Tensor] = None) -> ShardedTensor:
    if isinstance(sp, ShardedTensor):
        return sp
    built = sp.build_fn(sp.key, sp.data if data is None else data, sp.replica_id, None)
    tensors = [v for v in nested_values(built) if isinstance(v, ShardedTensor)]
    if not tensors:
        raise CheckpointingException(f"ShardedTensorFactory {sp.key!r} builds no ShardedTensor")
    return min(tensors, key=lambda t: t.key)


def _meta_grid(st: ShardedTensor) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    p = st.prepend_axis_num
    if p:
        return st.global_shape[:p], st.global_offset[:p]
    return (1,), (0,)


def _is_origin(st: ShardedTensor) -> bool:
    return all(o == 0 for o in st.global_offset[st.prepend_axis_num:])


def _meta_object(prefix: str, sp: ShardedParam, data: Any, main: Optional[bool] = None) -> ShardedObject:
    """Per-param object ``{prefix}.param_state.{key}``; saved by the main replica at the origin shard."""
    st = _first_built_tensor(sp)
    shape, offset = _meta_grid(st)
    if main is None:
        main = is_main_replica(st.replica_id) and _is_origin(st)
    return ShardedObject(f"{prefix}.param_state.{sp.key}", data, shape, offset, 0 if main else 1)


def _is_split(sp: ShardedParam) -> bool:
    """Whether the param's tensor is split across ranks (its local shard is not the whole tensor)."""
    st = _first_built_tensor(sp)
    return tuple(st.local_shape) != tuple(st.global_shape[st.prepend_axis_num:])


def _is_param_tensor_state(v: Any, param_numel: int) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == param_numel


def optim_state_to_sharding_state(
    optim_state_dict: Dict[str, Any],
    id_to_sharded_param_map: Dict[int, ShardedParam],
    exclude_keys: Sequence[str] = (),
    *,
    prefix: str = DEFAULT_PREFIX,
) -> None:
    """Turn ``optimizer.state_dict()`` into a sharded state dict, in place (Megatron-compatible).

    Every per-param tensor state with the parameter's number of elements becomes
    :func:`make_sharded_optimizer_tensor` with prefix ``f"{prefix}.state.{name}"``; scalar
    states (``step``, 0-dim tensors, numbers) and the list of tensor-state names go into
    one ShardedObject per param (``state[id][PARAM_META_KEY]``);
    ``param_groups[*]['params']`` become LocalNonpersistentObjects. States named in
    ``exclude_keys`` are dropped. A state for a param id missing from the map raises.
    """
    sharded_state: Dict[int, Dict[str, Any]] = {}
    for param_id, param_state in optim_state_dict["state"].items():
        sp = id_to_sharded_param_map.get(param_id)
        if sp is None:
            raise UnmatchedParameterError(f"optimizer param id {param_id} does not match any model sharded param")
        numel = sp.data.numel() if isinstance(sp, ShardedTensorFactory) else sp.local_numel()
        entry: Dict[str, Any] = {}
        tensors: Dict[str, str] = {}
        scalars: Dict[str, Any] = {}
        for name, value in param_state.items():
            if name in exclude_keys:
                continue
            value = _local(value)  # DTensor states (FSDP2 / TP params) are saved as this rank's shard
            if _is_param_tensor_state(value, numel):
                entry[name] = make_sharded_optimizer_tensor(sp, value, f"{prefix}.state.{name}")
                tensors[name] = str(value.dtype).replace("torch.", "")
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
                scalars[name] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        entry[PARAM_META_KEY] = _meta_object(prefix, sp, {"tensors": tensors, "scalars": scalars})
        sharded_state[param_id] = entry
    optim_state_dict["state"] = sharded_state
    for group in optim_state_dict["param_groups"]:
        group["params"] = LocalNonpersistentObject(group["params"])


def sharding_state_to_optim_state(loaded: Dict[str, Any], *, extract: Sequence[str] = EXTRA_STATE_NAMES) -> Dict[str, Any]:
    """Inverse of :func:`optim_state_to_sharding_state` for the dict returned by ``load``.

    Returns a dict for ``optimizer.load_state_dict`` (scalars merged back into each
    param's state). States named in ``extract`` (default ``fp32_param``) are removed
    and returned under the extra key ``"extracted"`` (``{param_id: {name: tensor}}``);
    pop it before calling ``load_state_dict``.
    """
    state: Dict[int, Dict[str, Any]] = {}
    extracted: Dict[int, Dict[str, Any]] = {}
    not_loaded: List[str] = []
    for pid, pstate in loaded.get("state", {}).items():
        pstate = dict(pstate)
        meta = pstate.pop(PARAM_META_KEY, None) or {}
        lacking = [n for n in meta.get("tensors", {}) if n not in pstate]
        if lacking:
            not_loaded.append(f"param id {pid}: {', '.join(lacking)}")
        for name in list(pstate):
            if name in extract:
                extracted.setdefault(pid, {})[name] = pstate.pop(name)
        pstate.update(meta.get("scalars", {}))
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


def _optimizer_params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _expected_tensor_states(optimizer: torch.optim.Optimizer, group: Dict[str, Any]) -> Optional[Tuple[str, ...]]:
    """Per-param tensor states a known torch optimizer keeps (``None``: unknown optimizer)."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
    if isinstance(optimizer, torch.optim.SGD):
        return ("momentum_buffer",) if group.get("momentum", 0) != 0 else ()
    if isinstance(optimizer, torch.optim.RMSprop):
        return (("square_avg",) + (("momentum_buffer",) if group.get("momentum", 0) > 0 else ())
                + (("grad_avg",) if group.get("centered") else ()))
    return None


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Explicitly create (zero) state for every param without state, without a training step.

    Supported: Adam, AdamW (incl. ``amsgrad``), SGD with momentum, RMSprop, Adagrad
    (state exists at construction). The values are placeholders to be overwritten by
    a load; the parameters are not touched. Other optimizers raise; use
    :func:`load_optimizer_state`, which needs no existing state.
    """
    scalar = torch.tensor(0.0, dtype=torch.float32)
    has_step = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop))
    for group in optimizer.param_groups:
        names = _expected_tensor_states(optimizer, group)
        for p in group["params"]:
            st = optimizer.state[p]
            if st:
                continue
            if names is None:
                raise CheckpointingException(
                    f"init_optimizer_state does not know {type(optimizer).__name__}; use "
                    "load_optimizer_state (it creates the state from the checkpoint)"
                )
            if has_step:
                st["step"] = scalar.clone()
            for name in names:
                st[name] = torch.zeros_like(p, memory_format=torch.preserve_format)


def optimizer_sharded_state_dict(
    optimizer: torch.optim.Optimizer,
    model_sharded_state_dict: ShardedStateDict,
    *,
    prefix: str = DEFAULT_PREFIX,
    exclude_keys: Sequence[str] = (),
    model_params: Optional[Sequence[torch.Tensor]] = None,
    extra_states: Optional[Dict[int, Dict[str, torch.Tensor]]] = None,
    init_state: bool = False,
    module: Optional[torch.nn.Module] = None,
) -> ShardedStateDict:
    """The sharded state dict of any ``torch.optim.Optimizer``, sharded like the model.

    Args:
        optimizer: the optimizer (its params must appear in the model sharded state dict).
        model_sharded_state_dict: the model's sharded state dict (same call's output
            that is saved/loaded next to it).
        prefix: key prefix of every optimizer tensor/object in the checkpoint.
        exclude_keys: state names not to save.
        model_params: tensors to identify each optimizer param with (aligned with the
            optimizer's params), e.g. bf16 model params for fp32 master params.
        extra_states: additional per-param tensors ``{param_id: {name: tensor}}`` saved
            with the same sharding (e.g. ``fp32_param`` master weights).
        init_state: create placeholder state first (:func:`init_optimizer_state`) so the
            result can be used as a load request before any step.
        module: used only to name parameters in errors.

    Example::

        sd = {"model": model_sd, "optimizer": optimizer_sharded_state_dict(opt, model_sd)}
        ckpt.save(sd, path)
    """
    if init_state:
        init_optimizer_state(optimizer)
    params = _optimizer_params(optimizer)
    identity = list(model_params) if model_params is not None else params
    if len(identity) != len(params):
        raise CheckpointingException(f"model_params has {len(identity)} tensors, the optimizer has {len(params)} params")
    id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, identity, module=module)
    sd = optimizer.state_dict()
    sd["state"] = {pid: dict(s) for pid, s in sd["state"].items()}
    for pid, extra in (extra_states or {}).items():
        sd["state"].setdefault(pid, {}).update(extra)
    for pid in range(len(params)):  # params without state still get their (empty) meta object
        sd["state"].setdefault(pid, {})
        if pid not in id_map and _empty_local_shard(identity[pid]):
            del sd["state"][pid]  # empty DTensor shard on this rank: the other ranks save this param
    optim_state_to_sharding_state(sd, id_map, exclude_keys, prefix=prefix)
    return sd


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------
def has_optimizer_state(checkpoint_dir: Union[str, "os.PathLike[str]"], prefix: str = DEFAULT_PREFIX) -> bool:
    """True if the checkpoint holds any tensor or object under ``f"{prefix}."``."""
    from .serialization import load_sharded_metadata

    return any(k.startswith(prefix + ".") for k in load_sharded_metadata(checkpoint_dir))


def _gather_problems(problems: List[str], group: Any) -> List[str]:
    if tdist.is_available() and tdist.is_initialized():
        world = tdist.get_world_size(group)
        gathered: List[Any] = [None] * world
        tdist.all_gather_object(gathered, problems, group=group)
        out: List[str] = []
        for ps in gathered:
            for p in ps:
                if p not in out:
                    out.append(p)
        return out
    return problems


def _check_requests(requests: Iterable[Any], ckpt_meta: Dict[str, Any], labels: Dict[str, str]) -> List[str]:
    """Compare requested ShardedTensors/Objects with the checkpoint; describe every mismatch."""
    problems = []
    for v in requests:
        sts = [v]
        if isinstance(v, ShardedTensorFactory):
            sts = [t for t in nested_values(v.build()) if isinstance(t, ShardedTensor)]
        for st in sts:
            label = labels.get(st.key, "")
            if isinstance(st, ShardedObject):
                if st.unique_key not in ckpt_meta:
                    problems.append(f"{label or st.key}: no optimizer state in the checkpoint (missing {st.unique_key!r})")
                continue
            saved = ckpt_meta.get(st.key)
            if saved is None:
                problems.append(f"{label or st.key}: {st.key!r} is not in the checkpoint")
            elif tuple(saved.global_shape) != st.global_shape and not st.allow_shape_mismatch:
                problems.append(
                    f"{label or st.key}: {st.key!r} has global shape {tuple(saved.global_shape)} in the "
                    f"checkpoint but the parameter needs {st.global_shape}"
                )
    return problems


def _raise_mismatch(problems: List[str], checkpoint_dir: Any, prefix: str) -> None:
    if problems:
        raise OptimizerStateMismatchError(
            f"optimizer state {prefix!r} in {os.fspath(checkpoint_dir)} does not fit the current parameters "
            f"(changed names or shapes?):\n  " + "\n  ".join(problems)
        )


def _missing(checkpoint_dir: Any, prefix: str, missing_ok: bool) -> None:
    msg = (
        f"{os.fspath(checkpoint_dir)} was saved without optimizer state (nothing under {prefix + '.'!r}); "
        "pass missing_ok=True to continue with fresh optimizer state"
    )
    if not missing_ok:
        raise OptimizerStateNotFoundError(msg)
    logger.warning("%s; continuing with fresh optimizer state", msg.split(";")[0])


def _two_phase_load(
    checkpoint_dir: Any,
    prefix: str,
    metas: Dict[int, ShardedObject],
    make_requests: Callable[[int, str, torch.dtype], Any],
    param_groups_template: List[Dict[str, Any]],
    labels: Dict[str, str],
    state_dict_key: str,
    load_kwargs: Dict[str, Any],
) -> Tuple[Dict[int, Dict[str, Any]], Dict[int, Dict[str, Any]], List[Dict[str, Any]]]:
    """Phase 1 reads the per-param meta objects (names, dtypes, scalars); phase 2 the tensors."""
    from .serialization import load, load_sharded_metadata

    group = load_kwargs.get("process_group")
    ckpt_meta = load_sharded_metadata(checkpoint_dir)
    _raise_mismatch(_gather_problems(_check_requests(metas.values(), ckpt_meta, labels), group), checkpoint_dir, prefix)
    # the result holds the saved common state too (param_groups, checked below)
    phase1 = load({state_dict_key: {"state": {pid: {PARAM_META_KEY: m} for pid, m in metas.items()}}},
                  checkpoint_dir, **load_kwargs)[state_dict_key]
    loaded_meta = phase1["state"]
    metas_data = {pid: loaded_meta[pid][PARAM_META_KEY] for pid in metas}
    requests: Dict[int, Dict[str, Any]] = {}
    flat_requests: List[Any] = []
    for pid, meta in metas_data.items():
        requests[pid] = {}
        for name, dtype_name in meta.get("tensors", {}).items():
            req = make_requests(pid, name, getattr(torch, dtype_name))
            if req is None:
                continue
            requests[pid][name] = req
            flat_requests.extend(req if isinstance(req, list) else [req])
    problems = _check_requests(flat_requests, ckpt_meta, labels)
    _raise_mismatch(_gather_problems(problems, group), checkpoint_dir, prefix)
    saved_groups = phase1.get("param_groups")
    if isinstance(saved_groups, (list, dict)) and len(saved_groups) != len(param_groups_template):
        raise OptimizerStateMismatchError(
            f"{os.fspath(checkpoint_dir)}: the checkpoint's optimizer {state_dict_key!r} has {len(saved_groups)} "
            f"param groups, this optimizer {len(param_groups_template)}: build the optimizer with the same groups"
        )
    template = {
        "state": requests,
        "param_groups": [
            {"params": LocalNonpersistentObject(g["params"])} for g in param_groups_template
        ],
    }
    loaded = load({state_dict_key: template}, checkpoint_dir, **load_kwargs)[state_dict_key]
    groups = loaded.get("param_groups", [])
    if isinstance(groups, dict):
        groups = [groups[k] for k in sorted(groups)]
    state = {pid: dict(loaded.get("state", {}).get(pid, {})) for pid in metas}
    scalars = {pid: dict(m.get("scalars", {})) for pid, m in metas_data.items()}
    return state, scalars, [dict(g) for g in groups]


def _labels(id_map: Dict[int, ShardedParam], params: Sequence[torch.Tensor], names: Dict[int, str], prefix: str) -> Dict[str, str]:
    out = {}
    for pid, sp in id_map.items():
        label = f"parameter {sp.key!r}" + (f" ({names[pid]})" if pid in names else "")
        out[f"{prefix}.param_state.{sp.key}"] = label
        out[sp.key] = label
    return out


class _LabelDict(dict):
    """Looks up a label by the param key at the end of an optimizer key."""

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        hits = [k for k in self.keys() if key == k or key.endswith("." + k) or ("." + k + ".") in key]
        return self[max(hits, key=len)] if hits else default


def _like_param(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A loaded state tensor (this rank's shard) shaped like ``param``: a DTensor with the
    param's mesh and placements if the param is one (FSDP2 / TP), else a view of its shape."""
    if not _is_dtensor(param):
        return local.view(param.shape)
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.view(param.to_local().shape), param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    model_sharded_state_dict: ShardedStateDict,
    checkpoint_dir: Union[str, "os.PathLike[str]"],
    *,
    prefix: str = DEFAULT_PREFIX,
    state_dict_key: Optional[str] = None,
    missing_ok: bool = False,
    model_params: Optional[Sequence[torch.Tensor]] = None,
    module: Optional[torch.nn.Module] = None,
    extract: Sequence[str] = EXTRA_STATE_NAMES,
    **load_kwargs: Any,
) -> Optional[Dict[int, Dict[str, torch.Tensor]]]:
    """Load optimizer state from a checkpoint into ``optimizer`` under the current layout.

    Works for an optimizer without state (nothing needs to run first): state names,
    dtypes and scalars are read from the per-param objects, then every state tensor
    is read resharded for this rank. Collective: call on every rank.

    Args:
        state_dict_key: where the optimizer sharded state dict sits in the saved dict
            (default: ``prefix``).
        missing_ok: if the checkpoint has no optimizer state, log and return ``None``
            (fresh state) instead of raising :class:`OptimizerStateNotFoundError`.
        model_params: as in :func:`optimizer_sharded_state_dict`.
        extract: state names returned instead of put into the optimizer (``fp32_param``).
        load_kwargs: passed to :func:`ckpt_integration.load` (``process_group``, ...).

    Returns the extracted states ``{param_id: {name: tensor}}`` ({} if none), or
    ``None`` when nothing was loaded (``missing_ok``). Raises
    :class:`OptimizerStateMismatchError` naming the parameters whose state is missing
    or has another shape.
    """
    state_dict_key = state_dict_key or prefix
    if not has_optimizer_state(checkpoint_dir, prefix):
        _missing(checkpoint_dir, prefix, missing_ok)
        return None
    params = _optimizer_params(optimizer)
    identity = list(model_params) if model_params is not None else params
    names = _names_from_module(module, identity)
    id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, identity, module=module)
    # (a DTensor param with an empty shard on this rank has nothing to load here)
    metas = {pid: _meta_object(prefix, id_map[pid], None) for pid in range(len(params)) if pid in id_map}

    def make_requests(pid: int, name: str, dtype: torch.dtype) -> Any:
        sp = id_map[pid]
        shape = sp.data.shape if isinstance(sp, ShardedTensorFactory) else sp.local_shape
        return make_sharded_optimizer_tensor(sp, torch.empty(shape, dtype=dtype), f"{prefix}.state.{name}")

    template_groups = optimizer.state_dict()["param_groups"]
    state, scalars, groups = _two_phase_load(
        checkpoint_dir, prefix, metas, make_requests, template_groups,
        _LabelDict(_labels(id_map, params, names, prefix)), state_dict_key, load_kwargs,
    )
    extracted: Dict[int, Dict[str, torch.Tensor]] = {}
    torch_state: Dict[int, Dict[str, Any]] = {}
    for pid in range(len(params)):
        st = state.get(pid, {})
        for name in list(st):
            if name in extract:
                extracted.setdefault(pid, {})[name] = st.pop(name)
            elif isinstance(st[name], torch.Tensor):
                st[name] = _like_param(st[name], params[pid])
        st.update(scalars.get(pid, {}))
        if st:
            torch_state[pid] = st
    _check_state_names(optimizer, torch_state, extract, names, id_map, checkpoint_dir)
    optimizer.load_state_dict({"state": torch_state, "param_groups": groups})
    return extracted


def _check_state_names(
    optimizer: torch.optim.Optimizer, torch_state: Dict[int, Dict[str, Any]], extract: Sequence[str],
    names: Dict[int, str], id_map: Dict[int, ShardedParam], checkpoint_dir: Any,
) -> None:
    """A checkpoint of another optimizer kind (SGD into Adam) would load, then fail at the next step."""
    problems = []
    pid = 0
    for group in optimizer.param_groups:
        expected = _expected_tensor_states(optimizer, group)
        for _ in group["params"]:
            st = torch_state.get(pid)
            if expected is not None and st is not None and pid in id_map:
                lacking = [n for n in expected if n not in st and n not in extract]
                if lacking:
                    label = f"{id_map[pid].key!r}" + (f" ({names[pid]})" if pid in names else "")
                    problems.append(f"parameter {label}: no {', '.join(lacking)} (saved: {sorted(st)})")
            pid += 1
    if problems:
        raise OptimizerStateMismatchError(
            f"{os.fspath(checkpoint_dir)}: the saved optimizer state does not fit {type(optimizer).__name__} "
            f"(saved by another optimizer or with other options?):\n  " + "\n  ".join(problems[:20])
            + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        )


# ---------------------------------------------------------------------------------------------
# mixed precision
# ---------------------------------------------------------------------------------------------
class MixedPrecisionOptimizer:
    """fp32 master weights (and fp32 optimizer state) for low-precision (bf16/fp16) model params.

    ``step()`` copies the model grads into the fp32 masters, runs the inner optimizer
    and writes the masters back into the model params (rounded). The masters are
    saved as the per-param state ``fp32_param`` (``optimizer.state.fp32_param.<key>``),
    sharded like the model params, so they reshard with them.

    Example::

        opt = MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        sd = {"model": msd, "optimizer": opt.sharded_state_dict(msd)}
    """

    def __init__(self, params: Iterable[torch.Tensor], optimizer_cls: type = torch.optim.AdamW, **optimizer_kwargs: Any):
        self.model_params = list(params)
        self.main_params = [torch.nn.Parameter(p.detach().float().clone()) for p in self.model_params]
        self.optimizer = optimizer_cls(self.main_params, **optimizer_kwargs)

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        """Drop the model and master grads."""
        for p in self.model_params + self.main_params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One optimizer step on the fp32 masters, then copy them into the model params."""
        for p, m in zip(self.model_params, self.main_params):
            m.grad = None if p.grad is None else p.grad.detach().float()
        self.optimizer.step()
        for p, m in zip(self.model_params, self.main_params):
            p.copy_(m)

    def sharded_state_dict(self, model_sharded_state_dict: ShardedStateDict, *, prefix: str = DEFAULT_PREFIX, init_state: bool = False) -> ShardedStateDict:
        """Inner optimizer state plus ``fp32_param`` masters, sharded like the model params."""
        return optimizer_sharded_state_dict(
            self.optimizer, model_sharded_state_dict, prefix=prefix, model_params=self.model_params,
            extra_states={i: {"fp32_param": m.detach()} for i, m in enumerate(self.main_params)},
            init_state=init_state,
        )

    @torch.no_grad()
    def load_sharded_state_dict(self, loaded: Dict[str, Any]) -> None:
        """Install the optimizer part of a ``load`` result built from :meth:`sharded_state_dict`."""
        sd = sharding_state_to_optim_state(loaded)
        extracted = sd.pop("extracted", {})
        self._set_masters(extracted)
        self.optimizer.load_state_dict(sd)

    def _set_masters(self, extracted: Dict[int, Dict[str, torch.Tensor]]) -> None:
        for i, (p, m) in enumerate(zip(self.model_params, self.main_params)):
            src = extracted.get(i, {}).get("fp32_param")
            if src is None:  # e.g. a checkpoint of a plain fp32 optimizer: masters from the model
                m.copy_(p.detach().float())
            else:
                m.copy_(src.view(m.shape))

    @torch.no_grad()
    def load_checkpoint(self, model_sharded_state_dict: ShardedStateDict, checkpoint_dir: Any, *, prefix: str = DEFAULT_PREFIX, missing_ok: bool = False, **load_kwargs: Any) -> bool:
        """Load masters and state (see :func:`load_optimizer_state`); False if fresh (``missing_ok``)."""
        extracted = load_optimizer_state(
            self.optimizer, model_sharded_state_dict, checkpoint_dir, prefix=prefix, missing_ok=missing_ok,
            model_params=self.model_params, **load_kwargs,
        )
        if extracted is None:
            self._set_masters({})
            return False
        self._set_masters(extracted)
        return True

    def state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()


# ---------------------------------------------------------------------------------------------
# ZeRO-1
# ---------------------------------------------------------------------------------------------
def flat_range_to_boxes(shape: Sequence[int], start: int, end: int) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """Split the row-major flat range ``[start, end)`` of a tensor of ``shape`` into rectangles.

    Returns ``[(offset, size), ...]`` in flat order; concatenating the boxes' elements in
    row-major order gives the flat range. Per axis at most a partial first part, a block
    of whole sub-tensors and a partial last part (3 boxes for 2-D, recursively for N-D).

    Example: ``flat_range_to_boxes((4, 5), 3, 17)`` ->
    ``[((0, 3), (1, 2)), ((1, 0), (2, 5)), ((3, 0), (1, 2))]``
    """
    shape = tuple(int(s) for s in shape)
    if start >= end:
        return []
    if len(shape) == 0:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (end - start,))]
    row = math.prod(shape[1:])
    first, first_off = divmod(start, row)
    last, last_off = divmod(end, row)
    sub = lambda r, a, b: [((r,) + o, (1,) + s) for o, s in flat_range_to_boxes(shape[1:], a, b)]  # noqa: E731
    if first == last:
        return sub(first, first_off, last_off)
    out = []
    if first_off:
        out += sub(first, first_off, row)
        first += 1
    if last > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (last - first,) + shape[1:]))
    if last_off:
        out += sub(last, 0, last_off)
    return out


def _zero_replica_id(replica_id: ReplicaId) -> ReplicaId:
    """Default for tuples: the data-parallel replica is the last replica_id component (Megatron
    convention). Integers are handled by :meth:`ZeroShardedOptimizer._replica_id`."""
    if isinstance(replica_id, int):
        return 0
    return tuple(replica_id[:-1]) + (0,)


class ZeroShardedOptimizer:
    """ZeRO-1: each data-parallel rank keeps fp32 masters and optimizer state for one flat slice.

    All params (any dtype) are flattened into one virtual fp32 vector of ``N`` elements; DP
    rank ``r`` owns ``[r*S, min(N, (r+1)*S))`` with ``S = ceil(N / dp_size)``. ``step()``
    expects grads already averaged over the DP group (as after DDP or a manual all-reduce),
    updates the own slice with the inner optimizer and all-gathers the new params.

    The checkpoint is in *model space*: each owned piece of a param becomes one to a few
    rectangular ShardedTensors (:func:`flat_range_to_boxes`) at the param's global
    coordinates, under the same keys as a non-ZeRO optimizer
    (``optimizer.state.exp_avg.<key>``, plus ``optimizer.state.fp32_param.<key>``), so it
    resumes under any DP/TP size and with or without ZeRO.

    Args:
        params: the model parameters (all of them, identical on the DP ranks).
        optimizer_cls: inner torch optimizer for the flat slice (elementwise ones: Adam,
            AdamW, SGD, ...).
        dp_group: the data-parallel process group (default: world; none without dist).
        replica_id_fn: maps a model ShardedTensor's replica_id to the id of the optimizer
            pieces; default: set the last component (the DP replica) to 0; an integer must
            be 0 or the DP rank (anything else is refused, see :meth:`_replica_id`).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        optimizer_cls: type = torch.optim.AdamW,
        *,
        dp_group: Any = None,
        replica_id_fn: Optional[Callable[[ReplicaId], ReplicaId]] = None,
        **optimizer_kwargs: Any,
    ):
        self.params = list(params)
        self.dp_group = dp_group
        self.replica_id_fn = replica_id_fn or self._replica_id
        initialized = tdist.is_available() and tdist.is_initialized()
        self.dp_size = tdist.get_world_size(dp_group) if initialized else 1
        self.dp_rank = tdist.get_rank(dp_group) if initialized else 0
        self.numels = [p.numel() for p in self.params]
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        total = self.offsets[-1]
        self.shard_size = max(1, math.ceil(total / self.dp_size))
        self.start = min(total, self.dp_rank * self.shard_size)
        self.end = min(total, self.start + self.shard_size)
        flat = torch.cat([p.detach().reshape(-1).float() for p in self.params]) if self.params else torch.zeros(0)
        self.main_param = torch.nn.Parameter(flat[self.start:self.end].clone())
        self.optimizer = optimizer_cls([self.main_param], **optimizer_kwargs)

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        """Drop the model grads."""
        for p in self.params:
            p.grad = None
        self.main_param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """Update the own slice, then all-gather the full params over the DP group."""
        grads = torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in self.params
        ])
        self.main_param.grad = grads[self.start:self.end].clone()
        self.optimizer.step()
        self._gather_params()

    @torch.no_grad()
    def _gather_params(self) -> None:
        local = torch.zeros(self.shard_size)
        local[: self.end - self.start] = self.main_param.detach()
        if self.dp_size > 1:
            parts = [torch.empty(self.shard_size) for _ in range(self.dp_size)]
            tdist.all_gather(parts, local, group=self.dp_group)
            flat = torch.cat(parts)
        else:
            flat = local
        for p, off, n in zip(self.params, self.offsets, self.numels):
            p.copy_(flat[off:off + n].view_as(p))

    # -- checkpointing --------------------------------------------------------------------
    def _replica_id(self, replica_id: ReplicaId) -> ReplicaId:
        """The default ``replica_id_fn``: drop the data-parallel part of a model replica_id.

        A tuple's last component is the DP replica (Megatron convention). An integer is
        taken as the DP replica only if it is 0 or this rank's DP rank; any other integer
        (e.g. a tensor-parallel replica index) cannot be split and is refused, since
        mapping it to 0 would make several ranks the main replica of the same slice.
        """
        if not isinstance(replica_id, int):
            return _zero_replica_id(replica_id)
        if replica_id in (0, self.dp_rank):
            return 0
        raise CheckpointingException(
            f"ZeroShardedOptimizer: a model ShardedTensor has replica_id {replica_id} on data-parallel rank "
            f"{self.dp_rank}: an integer replica_id other than 0 or the DP rank mixes in other replication "
            "(e.g. tensor parallelism), so the DP part cannot be dropped. Use tuple replica_ids with the DP "
            "replica last, e.g. (tp_rank, dp_rank), or pass replica_id_fn"
        )

    def _pieces(self, sp: ShardedTensor, pid: int, prefix: str, name: str, flat: torch.Tensor) -> List[ShardedTensor]:
        ps, pe = self.offsets[pid], self.offsets[pid + 1]
        a, b = max(ps, self.start), min(pe, self.end)
        out: List[ShardedTensor] = []
        pos = a - self.start
        p = sp.prepend_axis_num
        rid = self.replica_id_fn(sp.replica_id)
        for off, size in flat_range_to_boxes(sp.local_shape, a - ps, b - ps):
            n = math.prod(size)
            data = flat[pos:pos + n].view(size)
            pos += n
            goff = tuple(sp.global_offset[:p]) + tuple(g + o for g, o in zip(sp.global_offset[p:], off))
            out.append(ShardedTensor.from_global_offsets(
                f"{prefix}.state.{name}.{sp.key}", data, sp.global_shape, goff, replica_id=rid, prepend_axis_num=p,
            ))
        return out

    def _id_map(self, model_sharded_state_dict: ShardedStateDict) -> Dict[int, ShardedTensor]:
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.params)
        for pid, sp in id_map.items():
            if isinstance(sp, ShardedTensorFactory):
                raise CheckpointingException(
                    f"ZeroShardedOptimizer: parameter {sp.key!r} is a ShardedTensorFactory; ZeRO checkpoints "
                    "support plain ShardedTensor params only"
                )
        return id_map  # type: ignore[return-value]

    def _meta(self, prefix: str, sp: ShardedTensor, pid: int, data: Any) -> ShardedObject:
        owner = self.start <= self.offsets[pid] < self.end or (self.numels[pid] == 0 and self.dp_rank == 0)
        main = owner and is_main_replica(self.replica_id_fn(sp.replica_id)) and _is_origin(sp)
        return _meta_object(prefix, sp, data, main=main)

    def sharded_state_dict(self, model_sharded_state_dict: ShardedStateDict, *, prefix: str = DEFAULT_PREFIX) -> ShardedStateDict:
        """Optimizer state and fp32 masters in model space (see the class docstring)."""
        id_map = self._id_map(model_sharded_state_dict)
        inner = self.optimizer.state.get(self.main_param, {})
        n_local = self.end - self.start
        tensors: Dict[str, torch.Tensor] = {"fp32_param": self.main_param.detach()}
        scalars: Dict[str, Any] = {}
        for name, v in inner.items():
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == n_local:
                tensors[name] = v
            else:
                scalars[name] = v.detach().clone() if isinstance(v, torch.Tensor) else v
        dtypes = {n: str(t.dtype).replace("torch.", "") for n, t in tensors.items()}
        state: Dict[int, Dict[str, Any]] = {}
        for pid, sp in id_map.items():
            entry: Dict[str, Any] = {}
            for name, flat in tensors.items():
                pieces = self._pieces(sp, pid, prefix, name, flat)
                if pieces:
                    entry[name] = pieces
            entry[PARAM_META_KEY] = self._meta(prefix, sp, pid, {"tensors": dtypes, "scalars": scalars})
            state[pid] = entry
        groups = []
        for g in self.optimizer.state_dict()["param_groups"]:
            g = dict(g)
            g["params"] = LocalNonpersistentObject(g["params"])
            groups.append(g)
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_checkpoint(
        self,
        model_sharded_state_dict: ShardedStateDict,
        checkpoint_dir: Any,
        *,
        prefix: str = DEFAULT_PREFIX,
        state_dict_key: Optional[str] = None,
        missing_ok: bool = False,
        **load_kwargs: Any,
    ) -> bool:
        """Load this rank's slice of masters and state from a checkpoint of any layout.

        Works with a checkpoint of a non-ZeRO optimizer too (masters then come from the
        current params if the checkpoint has no ``fp32_param``). Returns False if the
        checkpoint has no optimizer state and ``missing_ok`` is set. Collective.
        """
        state_dict_key = state_dict_key or prefix
        if not has_optimizer_state(checkpoint_dir, prefix):
            _missing(checkpoint_dir, prefix, missing_ok)
            return False
        id_map = self._id_map(model_sharded_state_dict)
        metas = {pid: self._meta(prefix, sp, pid, None) for pid, sp in id_map.items()}
        n_local = self.end - self.start
        buffers: Dict[str, torch.Tensor] = {}

        def make_requests(pid: int, name: str, dtype: torch.dtype) -> Any:
            if name not in buffers:
                buffers[name] = torch.zeros(n_local, dtype=dtype)
            pieces = self._pieces(id_map[pid], pid, prefix, name, buffers[name])
            return pieces or None

        groups_template = self.optimizer.state_dict()["param_groups"]
        labels = _LabelDict(_labels(id_map, self.params, {}, prefix))
        _, scalars, groups = _two_phase_load(
            checkpoint_dir, prefix, metas, make_requests, groups_template, labels, state_dict_key, load_kwargs,
        )
        # scalars are identical for all params of a ZeRO optimizer; take the first one available
        # (every rank reads every param's object, so all ranks agree)
        all_scalars = next((s for s in scalars.values() if s), {})
        master = buffers.pop("fp32_param", None)
        if master is not None:
            self.main_param.copy_(master)
        else:
            flat = torch.cat([p.detach().reshape(-1).float() for p in self.params])
            self.main_param.copy_(flat[self.start:self.end])
        inner_state = {name: buf for name, buf in buffers.items() if name not in EXTRA_STATE_NAMES}
        inner_state.update(all_scalars)
        self.optimizer.load_state_dict({"state": {0: inner_state} if inner_state else {}, "param_groups": groups})
        return True

    def state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()


__all__ = [
    "DEFAULT_PREFIX",
    "PARAM_META_KEY",
    "OptimizerStateNotFoundError",
    "OptimizerStateMismatchError",
    "UnmatchedParameterError",
    "get_optim_param_to_id_map",
    "get_param_id_to_sharded_param_map",
    "make_sharded_optimizer_tensor",
    "optim_state_to_sharding_state",
    "sharding_state_to_optim_state",
    "optimizer_sharded_state_dict",
    "init_optimizer_state",
    "has_optimizer_state",
    "load_optimizer_state",
    "flat_range_to_boxes",
    "MixedPrecisionOptimizer",
    "ZeroShardedOptimizer",
]
