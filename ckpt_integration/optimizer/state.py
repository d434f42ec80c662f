"""Building the sharded state dict of a ``torch.optim.Optimizer`` (and placeholder state for it)."""

from __future__ import annotations

import logging
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..dtensors import is_dtensor
from ..errors import CheckpointingException
from ..execution.dist import Group, all_gather_object, all_reduce_ints
from ..mapping import ShardedStateDict
from .sharding import (
    DEFAULT_PREFIX,
    built_tensors,
    empty_local_shard,
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)

logger = logging.getLogger(__name__)


def optimizer_params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """The optimizer's params in ``state_dict()`` order (group by group)."""
    return [p for g in optimizer.param_groups for p in g["params"]]


# per-param tensor states of the other torch optimizers (their first step does not create them as zeros
# everywhere: Rprop's step_size is lr, NAdam's mu_product 1; so no placeholders are made for these)
_OTHER_TENSOR_STATES = (("Adagrad", ("sum",)), ("Adamax", ("exp_avg", "exp_inf")), ("NAdam", ("exp_avg", "exp_avg_sq")),
                        ("RAdam", ("exp_avg", "exp_avg_sq")), ("Adadelta", ("square_avg", "acc_delta")),
                        ("ASGD", ("ax",)), ("Rprop", ("prev", "step_size")), ("Muon", ("momentum_buffer",)))
_SCALAR_STATES = {"NAdam": ("mu_product",), "ASGD": ("eta", "mu")}  # (besides ``step``)


def expected_tensor_states(optimizer: torch.optim.Optimizer, group: Dict[str, Any]) -> Optional[Tuple[str, ...]]:
    """Per-param tensor states a known torch optimizer keeps (``None``: unknown optimizer)."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
    if isinstance(optimizer, torch.optim.SGD):
        return ("momentum_buffer",) if group.get("momentum", 0) != 0 else ()
    if isinstance(optimizer, torch.optim.RMSprop):
        return (("square_avg",) + (("momentum_buffer",) if group.get("momentum", 0) > 0 else ())
                + (("grad_avg",) if group.get("centered") else ()))
    return next((names for cls, names in _OTHER_TENSOR_STATES
                 if isinstance(optimizer, getattr(torch.optim, cls, ()))), None)


def expected_states(optimizer: torch.optim.Optimizer, group: Dict[str, Any]) -> Optional[Tuple[str, ...]]:
    """Per-param states (tensors and scalars such as ``step``) a known torch optimizer needs once a
    param has state (``None``: unknown optimizer): a checkpoint of another kind (RMSprop into Adagrad,
    Adam into NAdam) is refused by name, where torch failed with a bare ``KeyError`` at the next step."""
    tensors = expected_tensor_states(optimizer, group)
    if tensors is None:
        return None
    no_step = isinstance(optimizer, (torch.optim.SGD, getattr(torch.optim, "Muon", ())))
    scalars = next((names for cls, names in _SCALAR_STATES.items() if isinstance(optimizer, getattr(torch.optim, cls, ()))), ())
    return tensors + scalars + (() if no_step else ("step",))


def _zero_state(optimizer: torch.optim.Optimizer, group: Dict[str, Any], p: torch.Tensor) -> Optional[Dict[str, Any]]:
    """Zeros for every state a torch optimizer whose first step starts from zeros keeps for ``p`` (``step`` 0
    first); ``None``: another optimizer."""
    names = expected_states(optimizer, group)
    if names is None or not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD,
                                                   torch.optim.RMSprop)):
        return None
    out: Dict[str, Any] = {"step": torch.tensor(0.0, dtype=torch.float32)} if "step" in names else {}
    out.update({n: torch.zeros_like(p, memory_format=torch.preserve_format) for n in names if n != "step"})
    return out


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Explicitly create (zero) state for every param without state, without a training step.

    Supported: Adam, AdamW (incl. ``amsgrad``), SGD with momentum, RMSprop, Adagrad
    (state exists at construction). The values are placeholders to be overwritten by
    a load; the parameters are not touched. Other optimizers raise; use
    :func:`load_optimizer_state`, which needs no existing state.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            if st:
                continue
            zeros = _zero_state(optimizer, group, p)
            if zeros is None:
                raise CheckpointingException(
                    f"init_optimizer_state does not know {type(optimizer).__name__}; use "
                    "load_optimizer_state (it creates the state from the checkpoint)"
                )
            st.update(zeros)


_WARNED_STATELESS: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


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
    params = optimizer_params(optimizer)
    identity = list(model_params) if model_params is not None else params
    if len(identity) != len(params):
        raise CheckpointingException(f"model_params has {len(identity)} tensors, the optimizer has {len(params)} params")
    id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, identity, module=module)
    sd = optimizer.state_dict()
    sd["state"] = {pid: dict(s) for pid, s in sd["state"].items()}
    if not sd["state"] and params and not init_state and optimizer not in _WARNED_STATELESS:
        _WARNED_STATELESS.add(optimizer)  # (once per optimizer: SGD without momentum never has state)
        logger.warning(
            "%s has no state yet: its sharded state dict holds no per-parameter state, so a save stores "
            "none and, used as a load request, it loads none. To load into it, pass init_state=True or "
            "use load_optimizer_state()", type(optimizer).__name__,
        )
    for pid, extra in (extra_states or {}).items():
        sd["state"].setdefault(pid, {}).update(extra)
    # (an optimizer with no state at all saves none and, as a request, loads none: no placeholders then)
    group_of = [g for g in optimizer.param_groups for _ in g["params"]] if optimizer.state else []
    for pid in range(len(params)):
        if pid not in id_map and empty_local_shard(identity[pid]):
            sd["state"].pop(pid, None)  # empty DTensor shard on this rank: the other ranks save this param
        elif group_of and pid in id_map and pid not in sd["state"] and built_tensors(id_map[pid])[0].prepend_axis_num:
            # a layer of a stacked tensor without state (frozen, or not stepped yet) would leave a hole in the
            # stacked state, which no save accepts: the state the optimizer creates at its first step, from which
            # that step does what it does without state (not so for SGD with dampening: its first step copies
            # the gradient into an absent buffer)
            group = group_of[pid]
            sgd_dampening = isinstance(optimizer, torch.optim.SGD) and group.get("dampening", 0) != 0
            placeholder = None if sgd_dampening else _zero_state(optimizer, group, params[pid])
            if placeholder is not None:
                sd["state"][pid] = placeholder
    optim_state_to_sharding_state(sd, id_map, exclude_keys, prefix=prefix)
    return sd


def _offer(state: Dict[str, Any]) -> Dict[str, Tuple[str, Any, str]]:
    """A param's loaded state as its peers need it for an empty shard: each tensor state's dtype (its
    elements live elsewhere) and each scalar's value (on the host, with the device it was on)."""
    out: Dict[str, Tuple[str, Any, str]] = {}
    for name, v in state.items():
        if is_dtensor(v) or (isinstance(v, torch.Tensor) and v.dim() > 0):
            out[name] = ("tensor", v.dtype, "")
        elif isinstance(v, torch.Tensor):
            out[name] = ("scalar", v.detach().cpu().clone(), v.device.type)
        else:
            out[name] = ("scalar", v, "")
    return out


def _state_from_offer(p: Any, offer: Dict[str, Tuple[str, Any, str]]) -> Dict[str, Any]:
    from torch.distributed.tensor import DTensor

    local = p.to_local()
    out: Dict[str, Any] = {}
    for name, (kind, x, device) in offer.items():
        if kind == "tensor":
            out[name] = DTensor.from_local(torch.empty(local.shape, dtype=x, device=local.device), p.device_mesh,
                                           p.placements, run_check=False, shape=p.shape, stride=p.stride())
        else:
            out[name] = x.to(local.device) if isinstance(x, torch.Tensor) and device not in ("", "cpu") else x
    return out


def like_param(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A loaded state tensor (this rank's shard) shaped like ``param``: a DTensor with the
    param's mesh and placements if the param is one (FSDP2 / TP), else a view of its shape."""
    if not is_dtensor(param):
        return local.view(param.shape)
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.view(param.to_local().shape), param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


def fill_empty_shards(params: Sequence[torch.Tensor], state: Dict[int, Dict[str, Any]], group: Group = None) -> None:
    """Give every DTensor param whose shard on this rank is empty (a parameter with fewer rows than
    FSDP2 / TP ranks) the state its peers loaded, in place: empty tensor states and the same
    scalars (``step``). Nothing of such a param is saved on this rank, so a load finds nothing
    for it here; without this, the ranks' optimizer states differ in shape after a resume (torch's
    ``get_optimizer_state_dict(..., full_state_dict=True)`` then waits forever) and ``step`` restarts.
    A DTensor param's tensor states loaded as this rank's shard (a load through a request) become
    DTensors like it: as plain tensors, the next ``step()`` failed ("got mixed torch.Tensor and DTensor").

    Collective over ``group`` (one small all-reduce), and over each mesh dimension of the params
    when some rank has such a shard (peers are matched by param position, which every rank of a
    mesh shares, and checked by shape)."""
    for pid, st in state.items():
        p = params[pid] if isinstance(pid, int) and 0 <= pid < len(params) else None
        if p is not None and is_dtensor(p) and st:
            local = p.to_local().shape  # type: ignore[attr-defined]
            for name, v in list(st.items()):
                if isinstance(v, torch.Tensor) and not is_dtensor(v) and v.dim() > 0 and v.shape == local:
                    st[name] = like_param(v, p)
    empty = [pid for pid, p in enumerate(params) if is_dtensor(p) and empty_local_shard(p) and not state.get(pid)]
    if not all_reduce_ints([1 if empty else 0], "max", group)[0]:
        return
    meshes: List[Any] = []
    for p in params:
        if is_dtensor(p) and p.device_mesh not in meshes:  # type: ignore[attr-defined]
            meshes.append(p.device_mesh)  # type: ignore[attr-defined]
    for mesh in meshes:
        pids = [pid for pid, p in enumerate(params) if is_dtensor(p) and p.device_mesh == mesh]  # type: ignore[attr-defined]
        for dim in range(mesh.ndim):  # a peer along each dimension in turn reaches every rank of the mesh
            mine = {pid: (tuple(params[pid].shape), _offer(state[pid])) for pid in pids if state.get(pid)}
            peers = all_gather_object(mine, mesh.get_group(dim))
            for pid in pids:
                if state.get(pid) or not empty_local_shard(params[pid]):
                    continue
                offer = next((o[pid][1] for o in peers if pid in o and o[pid][0] == tuple(params[pid].shape)), None)
                if offer is not None:
                    state[pid] = _state_from_offer(params[pid], offer)
