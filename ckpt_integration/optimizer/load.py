"""Loading optimizer state into an optimizer under the current layout, without existing state."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as tdist

from ..dict_utils import nested_values
from ..mapping import LocalNonpersistentObject, ShardedObject, ShardedStateDict, ShardedTensor, ShardedTensorFactory
from .sharding import (
    DEFAULT_PREFIX,
    EXTRA_STATE_NAMES,
    PARAM_META_KEY,
    OptimizerStateMismatchError,
    OptimizerStateNotFoundError,
    ShardedParam,
    _is_dtensor,
    _meta_object,
    _names_from_module,
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
    from ..serialization import load, load_sharded_metadata

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
