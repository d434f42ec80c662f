"""Loading optimizer state into an optimizer under the current layout, without existing state."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as tdist

from ..dict_utils import nested_values
from ..foreign import sharded_kind
from ..mapping import ShardedObject, ShardedStateDict, ShardedTensor, ShardedTensorFactory
from .sharding import (
    DEFAULT_PREFIX,
    EXTRA_STATE_NAMES,
    PARAM_META_KEY,
    OptimizerStateMismatchError,
    OptimizerStateNotFoundError,
    ShardedParam,
    _is_dtensor,
    _names_from_module,
    _param_object,
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
)
from .state import _expected_tensor_states, _optimizer_params

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------
def has_optimizer_state(checkpoint_dir: Union[str, "os.PathLike[str]"], prefix: str = DEFAULT_PREFIX) -> bool:
    """True if the checkpoint holds any tensor or object under ``f"{prefix}."``."""
    from ..serialization import load_sharded_metadata

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


def _saved_layout(ckpt_meta: Dict[str, Any], prefix: str) -> Tuple[Dict[str, Dict[str, torch.dtype]], Dict[str, Set[str]], Set[str]]:
    """What the checkpoint holds under ``prefix``: ``{param part: {tensor state: dtype}}``,
    ``{param key: {scalar state names}}`` and the param keys with a per-param object of
    earlier versions. Keys are ``f"{prefix}.state.{name}.{param part}"``; state names hold no dot."""
    state, legacy_prefix = prefix + ".state.", prefix + ".param_state."
    tensors: Dict[str, Dict[str, torch.dtype]] = {}
    objects: Dict[str, Set[str]] = {}
    legacy: Set[str] = set()
    for key, v in ckpt_meta.items():
        if isinstance(v, ShardedObject):
            if v.key.startswith(legacy_prefix):
                legacy.add(v.key[len(legacy_prefix):])
            elif v.key.startswith(state):
                name, _, part = v.key[len(state):].partition(".")
                objects.setdefault(part, set()).add(name)
        elif key.startswith(state):
            name, _, part = key[len(state):].partition(".")
            tensors.setdefault(part, {})[name] = v.dtype
    return tensors, objects, legacy


def _param_parts(sp: ShardedParam) -> List[str]:
    """The keys a param's tensors are stored under: its key, or the keys its factory builds."""
    if isinstance(sp, ShardedTensor):
        return [sp.key]
    built = sp.build_fn(sp.key, sp.data, sp.replica_id, None)
    return sorted({v.key for v in nested_values(built) if sharded_kind(v) == "ShardedTensor"})


def _load_state(
    checkpoint_dir: Any,
    prefix: str,
    id_map: Dict[int, ShardedParam],
    object_request: Callable[[int, str], ShardedObject],
    make_requests: Callable[[int, str, torch.dtype], Any],
    param_groups_template: List[Dict[str, Any]],
    labels: Dict[str, str],
    state_dict_key: str,
    load_kwargs: Dict[str, Any],
) -> Tuple[Dict[int, Dict[str, Any]], Dict[int, Dict[str, Any]], List[Dict[str, Any]]]:
    """Read every saved state of the params in ``id_map`` in one ``load`` (collective).

    State names and dtypes come from the checkpoint's metadata, so nothing has to exist in
    the optimizer first. Returns ``(tensor states, scalar states, param groups)``; the
    scalars are those saved as objects in place, those of an earlier version's per-param
    object, or Megatron-Core's ``common_step`` (as ``step``).
    """
    from ..serialization import load, load_sharded_metadata

    group = load_kwargs.get("process_group")
    ckpt_meta = load_sharded_metadata(checkpoint_dir)
    tensors, objects, legacy = _saved_layout(ckpt_meta, prefix)
    requests: Dict[int, Dict[str, Any]] = {}
    scalar_names: Dict[int, Set[str]] = {}
    checked: List[Any] = []
    problems: List[str] = []
    for pid, sp in id_map.items():
        parts = _param_parts(sp)
        names: Dict[str, torch.dtype] = {}
        for part in parts:
            names.update(tensors.get(part, {}))
        scalar_names[pid] = objects.get(sp.key, set())
        requests[pid] = {}
        if not names and not scalar_names[pid] and sp.key not in legacy:
            # a param without state at save time is in the checkpoint as a model tensor
            if not any(part in ckpt_meta for part in parts):
                problems.append(f"{labels.get(sp.key) or sp.key}: no optimizer state in the checkpoint, nor the "
                                "parameter itself (renamed?)")
            continue
        for name, dtype in sorted(names.items()):
            req = make_requests(pid, name, dtype)
            if req is not None:
                requests[pid][name] = req
                checked.extend(req if isinstance(req, list) else [req])
        for name in sorted(scalar_names[pid]):
            requests[pid][name] = object_request(pid, f"{prefix}.state.{name}.{sp.key}")
            checked.append(requests[pid][name])
        if sp.key in legacy:
            requests[pid][PARAM_META_KEY] = object_request(pid, f"{prefix}.param_state.{sp.key}")
            checked.append(requests[pid][PARAM_META_KEY])
    problems += _check_requests(checked, ckpt_meta, labels)
    _raise_mismatch(_gather_problems(problems, group), checkpoint_dir, prefix)
    # the result holds the saved common state too: param_groups (and Megatron's common_step)
    loaded = load({state_dict_key: {"state": requests}}, checkpoint_dir, **load_kwargs)[state_dict_key]
    saved_groups = loaded.get("param_groups")
    if isinstance(saved_groups, dict):
        saved_groups = [saved_groups[k] for k in sorted(saved_groups)]
    if not isinstance(saved_groups, list) or len(saved_groups) != len(param_groups_template):
        count = len(saved_groups) if isinstance(saved_groups, list) else "no"
        raise OptimizerStateMismatchError(
            f"{os.fspath(checkpoint_dir)}: the checkpoint's optimizer {state_dict_key!r} has {count} "
            f"param groups, this optimizer {len(param_groups_template)}: build the optimizer with the same groups"
        )
    groups = [{**g, "params": t["params"]} for g, t in zip(saved_groups, param_groups_template)]
    loaded_state = loaded.get("state", {})
    common_step = loaded_state.get("common_step")
    state: Dict[int, Dict[str, Any]] = {}
    scalars: Dict[int, Dict[str, Any]] = {}
    for pid in id_map:
        got = dict(loaded_state.get(pid, {}))
        meta = got.pop(PARAM_META_KEY, None) or {}
        scalars[pid] = {**meta.get("scalars", {}), **{n: got.pop(n) for n in scalar_names[pid] if n in got}}
        if common_step is not None and got and "step" not in scalars[pid]:
            scalars[pid]["step"] = common_step.clone() if isinstance(common_step, torch.Tensor) else common_step
        state[pid] = got
    return state, scalars, groups


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

    Works for an optimizer without state (nothing needs to run first): state names and
    dtypes come from the checkpoint's metadata, and every state tensor and scalar is read
    resharded for this rank in one ``load``. Reads checkpoints written by Megatron-Core's
    ``optim_state_to_sharding_state`` (``step`` from its ``common_step``) and by earlier
    versions of this library too. Collective: call on every rank.

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
    # (a DTensor param with an empty shard on this rank is not in the map: nothing to load here)
    id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, identity, module=module)

    def make_requests(pid: int, name: str, dtype: torch.dtype) -> Any:
        sp = id_map[pid]
        shape = sp.data.shape if isinstance(sp, ShardedTensorFactory) else sp.local_shape
        return make_sharded_optimizer_tensor(sp, torch.empty(shape, dtype=dtype), f"{prefix}.state.{name}")

    template_groups = optimizer.state_dict()["param_groups"]
    state, scalars, groups = _load_state(
        checkpoint_dir, prefix, id_map, lambda pid, key: _param_object(key, id_map[pid], None), make_requests,
        template_groups, _LabelDict(_labels(id_map, params, names, prefix)), state_dict_key, load_kwargs,
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
