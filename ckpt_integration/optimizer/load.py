"""Loading optimizer state into an optimizer under the current layout, without existing state."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import torch

from ..dict_utils import nested_values
from ..execution.dist import Group, all_gather_object, all_reduce_ints
from ..mapping import ShardedObject, ShardedStateDict, ShardedTensor, ShardedTensorFactory
from ..dtensors import is_dtensor
from ..serialization import load, load_common_state_dict, load_sharded_metadata
from .sharding import (
    DEFAULT_PREFIX,
    EXTRA_STATE_NAMES,
    PARAM_META_KEY,
    OptimizerStateMismatchError,
    OptimizerStateNotFoundError,
    ShardedParam,
    built_tensors,
    grid_object,
    make_sharded_optimizer_tensor,
    merge_part_scalars,
    names_from_module,
    param_map_and_aliases,
)
from .state import expected_states, fill_empty_shards, like_param, optimizer_params

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------
def has_optimizer_state(checkpoint_dir: Union[str, "os.PathLike[str]"], prefix: str = DEFAULT_PREFIX) -> bool:
    """True if the checkpoint holds any tensor or object under ``f"{prefix}."``."""
    return any(k.startswith(prefix + ".") for k in load_sharded_metadata(checkpoint_dir))


def saved_param_groups_only(checkpoint_dir: Union[str, "os.PathLike[str]"], key: str, *, trusted: bool = False,
                            allowed_globals: Optional[Iterable[Any]] = None) -> bool:
    """True if the checkpoint's common state holds the param groups of an optimizer under ``key``
    and no state: what an optimizer that keeps no state (SGD without momentum) saves. ``trusted`` /
    ``allowed_globals``: as the load's (the common state holds what the job put there)."""
    entry = load_common_state_dict(checkpoint_dir, trusted=trusted, allowed_globals=allowed_globals).get(key)
    return isinstance(entry, dict) and isinstance(entry.get("param_groups"), (list, dict)) and not entry.get("state")


def gather_problems(problems: List[str], group: Group) -> List[str]:
    """Every rank's problems on every rank (one small all-reduce when there are none), so that all
    ranks raise together instead of some waiting in the next collective."""
    if not all_reduce_ints([1 if problems else 0], "max", group)[0]:
        return []
    out: List[str] = []
    for ps in all_gather_object(problems, group):
        for p in ps:
            if p not in out:
                out.append(p)
    return out


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


def raise_mismatch(problems: List[str], checkpoint_dir: Union[str, "os.PathLike[str]"], prefix: str,
                    why: str = "does not fit the current parameters (changed names or shapes?)") -> None:
    """Raise :class:`OptimizerStateMismatchError` listing ``problems`` (every rank's), if there are any."""
    if problems:
        raise OptimizerStateMismatchError(
            f"optimizer state {prefix!r} in {checkpoint_dir} {why}:\n  " + "\n  ".join(problems)
        )


def report_missing_state(checkpoint_dir: Union[str, "os.PathLike[str]"], prefix: str, missing_ok: bool) -> None:
    """A checkpoint without optimizer state under ``prefix``: :class:`OptimizerStateNotFoundError`, or a
    warning with ``missing_ok``."""
    msg = (
        f"{checkpoint_dir} was saved without optimizer state (nothing under {prefix + '.'!r}); "
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


def _with_saved_state(sp: ShardedParam, others: List[ShardedParam], saved: Tuple[Any, ...]) -> ShardedParam:
    """``sp``, or the first of a tied param's ``others`` under whose key the checkpoint holds its state when
    it holds none under ``sp``'s (the module declares the tied entries in another order than the saver did:
    the state was silently left out, found by a probe)."""
    def has_state(c: ShardedParam) -> bool:
        return any(k in table for k in {c.key, *(part.key for part in _param_parts(c))} for table in saved)
    return sp if has_state(sp) else next((c for c in others if has_state(c)), sp)


def _param_parts(sp: ShardedParam) -> List[ShardedTensor]:
    """The ShardedTensors a param's tensors are stored as: itself, or what its factory builds."""
    return built_tensors(sp)


def _fused_owner(key: str, saved: Set[str], tensors: Dict[str, Any]) -> Optional[str]:
    """The key of the fused param that ``key`` is a part of in the checkpoint (``a.qkv.weight`` for
    ``a.qkv.weight.part0``): a saved key that is a dotted prefix of ``key`` and holds no tensor state
    itself (a factory stores its tensors under its parts' keys only)."""
    head = key
    while "." in head:
        head = head.rsplit(".", 1)[0]
        if head in saved and head not in tensors:
            return head
    return None


def _scalar_sources(sp: ShardedParam, parts: List[ShardedTensor], saved: Dict[str, Set[str]],
                    tensors: Dict[str, Any], label: str) -> Tuple[List[Tuple[str, ShardedTensor]], Optional[str]]:
    """Where a param's per-param objects (scalar states, or an earlier version's metadata object) are
    in the checkpoint, as ``[(saved key, tensor to place the request like)]``, and a problem if any.

    Scalars follow the weights between a fused param (one factory storing parts) and its unfused
    counterpart (separate params keyed like the parts), in both directions: the param's own key
    first; for a fused param its parts' keys (saved by the unfused params, or per part by this
    version); for a part, the fused owner's key (checkpoints of earlier versions, which saved a
    fused param's scalars once under its own key).
    """
    if sp.key in saved:
        return [(sp.key, parts[0])], None
    keys = [t.key for t in parts]
    if keys != [sp.key]:
        have = [t for t in parts if t.key in saved]
        if have:
            names = {t.key: saved.get(t.key, set()) for t in parts}
            if len({frozenset(n) for n in names.values()}) > 1:
                return [], (f"{label}: the parts it is fused from have different scalar states in the checkpoint: "
                            + ", ".join(f"{k!r}: {sorted(n)}" for k, n in names.items()))
            return [(t.key, t) for t in have], None
    owner = _fused_owner(sp.key, set(saved), tensors)
    if owner is not None:
        return [(owner, parts[0])], None
    return [], None


def read_optimizer_state(
    checkpoint_dir: Union[str, "os.PathLike[str]"],
    prefix: str,
    id_map: Dict[int, ShardedParam],
    object_request: Callable[[int, str, ShardedTensor], ShardedObject],
    make_requests: Callable[[int, str, torch.dtype], Any],
    param_groups_template: List[Dict[str, Any]],
    labels: Dict[str, str],
    state_dict_key: str,
    load_kwargs: Dict[str, Any],
    aliases: Optional[Dict[int, List[ShardedParam]]] = None,
) -> Tuple[Dict[int, Dict[str, Any]], Dict[int, Dict[str, Any]], List[Dict[str, Any]]]:
    """Read every saved state of the params in ``id_map`` in one ``load`` (collective).

    State names and dtypes come from the checkpoint's metadata, so nothing has to exist in
    the optimizer first. Returns ``(tensor states, scalar states, param groups)``; the
    scalars are those saved as objects in place (also across a fused param and its unfused
    counterpart: :func:`_scalar_sources`), those of an earlier version's per-param object,
    or Megatron-Core's ``common_step`` (as ``step``). ``aliases``: a tied param's other entries
    (:func:`~.sharding.param_map_and_aliases`); ``id_map`` is changed in place to the one its state
    was saved under.
    """
    group = load_kwargs.get("process_group")
    ckpt_meta = load_sharded_metadata(checkpoint_dir)
    tensors, objects, legacy = _saved_layout(ckpt_meta, prefix)
    legacy_map = {k: set() for k in legacy}
    for pid, others in (aliases or {}).items():
        id_map[pid] = _with_saved_state(id_map[pid], others, (tensors, objects, legacy))
    requests: Dict[int, Dict[str, Any]] = {}
    scalar_names: Dict[int, Set[str]] = {}
    requested_objects: Set[str] = set()  # objects this rank requests as their main replica
    multi: Dict[int, Set[str]] = {}  # names requested from several parts: {part key: object} to merge
    checked: List[Any] = []
    problems: List[str] = []
    for pid, sp in id_map.items():
        parts = _param_parts(sp)
        label = labels.get(sp.key) or sp.key
        names: Dict[str, torch.dtype] = {}
        for part in parts:
            names.update(tensors.get(part.key, {}))
        sources, problem = _scalar_sources(sp, parts, objects, tensors, label)
        legacy_sources, legacy_problem = _scalar_sources(sp, parts, legacy_map, tensors, label)
        problems += [p for p in (problem, legacy_problem) if p]
        scalar_names[pid] = set().union(*(objects[k] for k, _ in sources)) if sources else set()
        requests[pid] = {}
        multi[pid] = set()
        if not names and not scalar_names[pid] and not legacy_sources:
            # a param without state at save time is in the checkpoint as a model tensor
            if not any(part.key in ckpt_meta for part in parts):
                problems.append(f"{label}: no optimizer state in the checkpoint, nor the parameter itself (renamed?)")
            continue
        for name, dtype in sorted(names.items()):
            req = make_requests(pid, name, dtype)
            if req is not None:
                requests[pid][name] = req
                checked.extend(req if isinstance(req, list) else [req])
        for name, srcs in [(n, sources) for n in sorted(scalar_names[pid])] + (
                [(PARAM_META_KEY, legacy_sources)] if legacy_sources else []):
            base = f"{prefix}.state.{name}." if name != PARAM_META_KEY else f"{prefix}.param_state."
            objs = {key: object_request(pid, base + key, st) for key, st in srcs}
            for key, obj in objs.items():
                # q, k and v all read their fused owner's object: one main request of it per rank
                if obj.replica_id == 0 and obj.unique_key in requested_objects:
                    objs[key] = replace(obj, replica_id=1)
                elif obj.replica_id == 0:
                    requested_objects.add(obj.unique_key)
            checked.extend(objs.values())
            if len(objs) == 1:
                requests[pid][name] = next(iter(objs.values()))
            else:
                requests[pid][name] = objs
                multi[pid].add(name)
    problems += _check_requests(checked, ckpt_meta, labels)
    raise_mismatch(gather_problems(problems, group), checkpoint_dir, prefix)
    # the result holds the saved common state too: param_groups (and Megatron's common_step)
    loaded = load({state_dict_key: {"state": requests}}, checkpoint_dir, **load_kwargs)[state_dict_key]
    saved_groups = loaded.get("param_groups")
    if isinstance(saved_groups, dict):
        saved_groups = [saved_groups[k] for k in sorted(saved_groups)]
    if not isinstance(saved_groups, list) or len(saved_groups) != len(param_groups_template):
        count = len(saved_groups) if isinstance(saved_groups, list) else "no"
        raise OptimizerStateMismatchError(
            f"{checkpoint_dir}: the checkpoint's optimizer {state_dict_key!r} has {count} "
            f"param groups, this optimizer {len(param_groups_template)}: build the optimizer with the same groups"
        )
    groups = [{**g, "params": t["params"]} for g, t in zip(saved_groups, param_groups_template)]
    loaded_state = loaded.get("state", {})
    common_step = loaded_state.get("common_step")
    state: Dict[int, Dict[str, Any]] = {}
    scalars: Dict[int, Dict[str, Any]] = {}
    problems = []
    for pid in id_map:
        got = dict(loaded_state.get(pid, {}))
        for name in multi.get(pid, ()):
            try:
                got[name] = _merge_parts(f"{prefix}.state.{name}.{id_map[pid].key}", name, got[name])
            except OptimizerStateMismatchError as e:
                problems.append(f"{labels.get(id_map[pid].key) or id_map[pid].key}: {e}")
        meta = got.pop(PARAM_META_KEY, None) or {}
        scalars[pid] = {**meta.get("scalars", {}), **{n: got.pop(n) for n in scalar_names[pid] if n in got}}
        if common_step is not None and got and "step" not in scalars[pid]:
            scalars[pid]["step"] = common_step.clone() if isinstance(common_step, torch.Tensor) else common_step
        state[pid] = got
    raise_mismatch(gather_problems(problems, group), checkpoint_dir, prefix)
    return state, scalars, groups


def _merge_parts(key: str, name: str, values: Dict[str, Any]) -> Any:
    """One value from the parts' copies of a per-param object (they must agree)."""
    if name != PARAM_META_KEY:
        return merge_part_scalars(key, values)
    # an earlier version's metadata objects: the scalars must agree, the tensor names are the union
    scalars = [v.get("scalars", {}) for v in values.values()]
    merged = {n: merge_part_scalars(f"{key}:{n}", {k: v.get("scalars", {}).get(n) for k, v in values.items()})
              for n in set().union(*scalars)}
    tensors: Dict[str, Any] = {}
    for v in values.values():
        tensors.update(v.get("tensors", {}))
    return {"scalars": merged, "tensors": tensors}


def param_labels(id_map: Dict[int, ShardedParam], params: Sequence[torch.Tensor], names: Dict[int, str], prefix: str) -> Dict[str, str]:
    """How errors name each param: by its key (and module name), for the optimizer keys of its state."""
    out = {}
    for pid, sp in id_map.items():
        label = f"parameter {sp.key!r}" + (f" ({names[pid]})" if pid in names else "")
        out[f"{prefix}.param_state.{sp.key}"] = label
        out[sp.key] = label
    return out


class LabelDict(dict):
    """Looks up a label by the param key at the end of an optimizer key."""

    def get(self, key: str, default: object = None) -> Any:  # type: ignore[override]
        hits = [k for k in self.keys() if key == k or key.endswith("." + k) or ("." + k + ".") in key]
        return self[max(hits, key=len)] if hits else default


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
    **load_kwargs: object,
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
    if not has_optimizer_state(checkpoint_dir, prefix) and not saved_param_groups_only(
            checkpoint_dir, state_dict_key, trusted=bool(load_kwargs.get("trusted")),
            allowed_globals=load_kwargs.get("allowed_globals")):  # type: ignore[arg-type]
        report_missing_state(checkpoint_dir, prefix, missing_ok)
        return None
    params = optimizer_params(optimizer)
    identity = list(model_params) if model_params is not None else params
    names = names_from_module(module, identity)
    # (a DTensor param with an empty shard on this rank is not in the map: nothing to load here)
    id_map, aliases = param_map_and_aliases(model_sharded_state_dict, identity, module=module)

    def make_requests(pid: int, name: str, dtype: torch.dtype) -> Any:
        sp = id_map[pid]
        shape = sp.data.shape if isinstance(sp, ShardedTensorFactory) else sp.local_shape
        return make_sharded_optimizer_tensor(sp, torch.empty(shape, dtype=dtype), f"{prefix}.state.{name}")

    template_groups = optimizer.state_dict()["param_groups"]
    state, scalars, groups = read_optimizer_state(
        checkpoint_dir, prefix, id_map, lambda pid, key, st: grid_object(key, st, None), make_requests,
        template_groups, LabelDict(param_labels(id_map, params, names, prefix)), state_dict_key, load_kwargs, aliases,
    )
    extracted: Dict[int, Dict[str, torch.Tensor]] = {}
    torch_state: Dict[int, Dict[str, Any]] = {}
    for pid in range(len(params)):
        st = state.get(pid, {})
        for name in list(st):
            if name in extract:
                extracted.setdefault(pid, {})[name] = st.pop(name)
            elif isinstance(st[name], torch.Tensor):
                st[name] = like_param(st[name], params[pid])
        st.update(scalars.get(pid, {}))
        if st:
            torch_state[pid] = st
    # a DTensor param with an empty shard here had nothing saved on this rank: its peers' state, emptied
    fill_empty_shards(params, torch_state, load_kwargs.get("process_group"))  # type: ignore[arg-type]
    pids, groups_pids = iter(range(len(params))), []
    for g in optimizer.param_groups:
        groups_pids.append([next(pids) for _ in g["params"]])
    label = lambda p: f"{id_map[p].key!r}" + (f" ({names[p]})" if p in names else "")  # noqa: E731
    problems = check_state_names(optimizer, optimizer.param_groups, groups_pids,
                                  {p: s for p, s in torch_state.items() if p in id_map}, extract, label)
    raise_mismatch(gather_problems(problems, load_kwargs.get("process_group")), checkpoint_dir, prefix,
                    f"does not fit {type(optimizer).__name__} (saved by another optimizer, with other options, or "
                    "for other parameters?)")
    optimizer.load_state_dict({"state": torch_state, "param_groups": groups})
    return extracted


def check_state_names(
    optimizer: torch.optim.Optimizer, groups: Sequence[Dict[str, Any]], groups_pids: Sequence[Sequence[Any]],
    torch_state: Dict[Any, Dict[str, Any]], extract: Sequence[str], label: Callable[[Any], str],
) -> List[str]:
    """What would fail in ``optimizer.load_state_dict`` or at the next step (torch raises a bare
    ``KeyError`` there): a param lacking a state the optimizer keeps (a checkpoint of another
    optimizer kind, SGD into Adam), or lacking a state the other params of its group have.
    ``groups[i]`` holds group ``i``'s options, ``groups_pids[i]`` the ids of its params."""
    problems = []
    for group, pids in zip(groups, groups_pids):
        expected = expected_states(optimizer, group)
        have = [p for p in pids if torch_state.get(p)]
        common = set().union(*(torch_state[p].keys() for p in have)) if have else set()
        for p in have:
            st = torch_state[p]
            lacking = [n for n in (expected if expected is not None else ()) if n not in st and n not in extract]
            lacking += sorted(n for n in common if n not in st and n not in lacking)
            if lacking:
                problems.append(f"parameter {label(p)}: no {', '.join(lacking)} (saved: {sorted(st)})")
    if len(problems) > 20:
        problems = problems[:20] + [f"... and {len(problems) - 20} more"]
    return problems
