"""ZeRO-1: optimizer state as one flat slice per data-parallel rank, saved in model space."""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.distributed as tdist

from ..errors import CheckpointingException
from ..execution.dist import buffer_device, global_rank, python_refs, settle
from ..mapping import (
    LocalNonpersistentObject,
    ReplicaId,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    flat_range_to_boxes,
    is_main_replica,
)
from ..planning.flat_pieces import row_aligned_save, row_unit
from .load import LabelDict, has_optimizer_state, param_labels, read_optimizer_state, report_missing_state
from .sharding import (DEFAULT_PREFIX, EXTRA_STATE_NAMES, OptimizerStateMismatchError, is_origin, is_view_factory,
                       param_map_and_aliases, param_object, same_scalar)
from .state import expected_tensor_states


# ---------------------------------------------------------------------------------------------
# ZeRO-1
# ---------------------------------------------------------------------------------------------
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
    resumes under any DP/TP size and with or without ZeRO. A save stores whole rows: each row of a
    param by the DP rank holding its first element, after the less-than-a-row heads of the next
    ranks' slices arrived point-to-point (:mod:`ckpt_integration.planning.flat_pieces`), so each
    rank writes one chunk per 2-D param and the checkpoint's chunk count grows one, not three, per
    DP rank (``sharded_state_dict`` is therefore collective over ``dp_group``).

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
        dp_group: Optional[tdist.ProcessGroup] = None,
        replica_id_fn: Optional[Callable[[ReplicaId], ReplicaId]] = None,
        **optimizer_kwargs: object,
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
        # where the group moves tensors (dist.buffer_device): CUDA on NCCL, host memory on gloo
        dev = buffer_device(self.dp_group) if self.dp_size > 1 else self.main_param.device
        local = torch.zeros(self.shard_size, device=dev)
        local[: self.end - self.start] = self.main_param.detach()
        if self.dp_size > 1:
            parts = [torch.empty(self.shard_size, device=dev) for _ in range(self.dp_size)]
            before = python_refs([local, *parts])
            tdist.all_gather(parts, local, group=self.dp_group)
            settle([local, *parts], before)  # the worker thread must not be the one to free them (see settle)
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
        return self._boxes(sp, prefix, name, flat[a - self.start:], a - ps, b - ps)

    def _boxes(self, sp: ShardedTensor, prefix: str, name: str, data: torch.Tensor, lo: int, hi: int,
               ) -> List[ShardedTensor]:
        """ShardedTensors of the boxes covering elements ``[lo, hi)`` of ``sp``'s local shard, viewed
        from ``data`` (which starts at element ``lo``)."""
        out: List[ShardedTensor] = []
        pos = 0
        p = sp.prepend_axis_num
        rid = self.replica_id_fn(sp.replica_id)
        for off, size in flat_range_to_boxes(sp.local_shape, lo, hi):
            n = math.prod(size)
            piece = data[pos:pos + n].view(size)
            pos += n
            goff = tuple(sp.global_offset[:p]) + tuple(g + o for g, o in zip(sp.global_offset[p:], off))
            out.append(ShardedTensor.from_global_offsets(
                f"{prefix}.state.{name}.{sp.key}", piece, sp.global_shape, goff, replica_id=rid, prepend_axis_num=p,
            ))
        return out

    @torch.no_grad()
    def _row_aligned(self, id_map: Dict[int, ShardedTensor], tensors: Dict[str, torch.Tensor]) -> Dict[Any, Any]:
        """``(pid, state name) -> (lo, data)``: the whole rows of each param this rank saves
        (:mod:`ckpt_integration.planning.flat_pieces`), after the heads of the next ranks' slices
        that complete its last row arrived and its own head went to the rank that began that row.

        Collective over the DP group (point-to-point with the neighbours that share a row). Only
        the param at the end of the slice needs a new buffer (its own part plus less than a row);
        every other saved range is a view into the flat state.
        """
        units = [1] * len(self.params)
        for pid, sp in id_map.items():
            units[pid] = row_unit(sp.local_shape)
        plan = row_aligned_save(self.numels, units, self.shard_size, self.dp_rank) if self.end > self.start else None
        out: Dict[Any, Any] = {}
        if plan is None:
            return out
        names = sorted(tensors)  # the same order on every rank: messages pair up by position
        dev = buffer_device(self.dp_group)  # gloo's point-to-point takes host tensors only
        ops, inbox = [], []
        for t in plan.sends:
            for name in names:
                buf = tensors[name][self.offsets[t.pid] + t.lo - self.start: self.offsets[t.pid] + t.hi - self.start]
                ops.append(tdist.P2POp(tdist.isend, buf.to(dev).contiguous(), global_rank(self.dp_group, t.dst), self.dp_group))
        for t in plan.receives:
            for name in names:
                buf = torch.empty(t.hi - t.lo, dtype=tensors[name].dtype, device=dev)
                inbox.append((t, name, buf))
                ops.append(tdist.P2POp(tdist.irecv, buf, global_rank(self.dp_group, t.src), self.dp_group))
        if ops:
            for req in tdist.batch_isend_irecv(ops):
                req.wait()
        for pid, (lo, hi) in plan.saved.items():
            ps = self.offsets[pid]
            own_hi = min(hi, self.end - ps)
            for name in names:
                own = tensors[name][ps + lo - self.start: ps + own_hi - self.start]
                if own_hi >= hi:
                    out[(pid, name)] = (lo, own)
                    continue
                full = torch.empty(hi - lo, dtype=own.dtype, device=own.device)
                full[: own_hi - lo].copy_(own)
                out[(pid, name)] = (lo, full)
        for t, name, buf in inbox:
            ps = self.offsets[t.pid]
            lo, full = out[(t.pid, name)]
            full[t.lo - lo: t.hi - lo].copy_(buf)
        return out

    def _saved_pieces(self, sp: ShardedTensor, prefix: str, name: str, saved: Optional[Tuple[int, torch.Tensor]]) -> List[ShardedTensor]:
        """The boxes of a saved row-aligned range (one for a 2-D shard; none if the rank saves
        nothing of this param)."""
        if saved is None:
            return []
        lo, data = saved
        return self._boxes(sp, prefix, name, data, lo, lo + data.numel())

    def _id_map(self, model_sharded_state_dict: ShardedStateDict) -> Dict[int, ShardedTensor]:
        return self._id_map_and_aliases(model_sharded_state_dict)[0]

    def _id_map_and_aliases(self, model_sharded_state_dict: ShardedStateDict
                            ) -> Tuple[Dict[int, ShardedTensor], Dict[int, List[ShardedTensor]]]:
        id_map, aliases = param_map_and_aliases(model_sharded_state_dict, self.params)
        for sp in id_map.values():
            problem = _zero_problem(sp)
            if problem is not None:
                raise CheckpointingException(f"ZeroShardedOptimizer: parameter {sp.key!r} {problem}")
        # (a tied param's other entries: only those its state can be read through, as for its own)
        return id_map, {p: [a for a in alts if _zero_problem(a) is None] for p, alts in aliases.items()}  # type: ignore[return-value]

    def _object(self, key: str, sp: ShardedTensor, pid: int, data: object) -> ShardedObject:
        """A per-param object (a scalar state), saved by the DP rank owning the param's first element."""
        owner = self.start <= self.offsets[pid] < self.end or (self.numels[pid] == 0 and self.dp_rank == 0)
        main = owner and is_main_replica(self.replica_id_fn(sp.replica_id)) and is_origin(sp)
        return param_object(key, sp, data, main=main)

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
        state: Dict[int, Dict[str, Any]] = {}
        saved = self._row_aligned(id_map, tensors)
        for pid, sp in id_map.items():
            entry: Dict[str, Any] = {}
            for name in tensors:
                pieces = self._saved_pieces(sp, prefix, name, saved.get((pid, name)))
                if pieces:
                    entry[name] = pieces
            for name, value in scalars.items():  # the inner optimizer's scalars are every param's
                entry[name] = self._object(f"{prefix}.state.{name}.{sp.key}", sp, pid, value)
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
        checkpoint_dir: Union[str, "os.PathLike[str]"],
        *,
        prefix: str = DEFAULT_PREFIX,
        state_dict_key: Optional[str] = None,
        missing_ok: bool = False,
        **load_kwargs: object,
    ) -> bool:
        """Load this rank's slice of masters and state from a checkpoint of any layout.

        Works with a checkpoint of a non-ZeRO optimizer too (masters then come from the
        current params if the checkpoint has no ``fp32_param``). Returns False if the
        checkpoint has no optimizer state and ``missing_ok`` is set. Collective.
        """
        state_dict_key = state_dict_key or prefix
        if not has_optimizer_state(checkpoint_dir, prefix):
            report_missing_state(checkpoint_dir, prefix, missing_ok)
            return False
        id_map, aliases = self._id_map_and_aliases(model_sharded_state_dict)
        n_local = self.end - self.start
        buffers: Dict[str, torch.Tensor] = {}

        def make_requests(pid: int, name: str, dtype: torch.dtype) -> Any:
            if name not in buffers:  # (masters of a param the checkpoint has none of are its loaded weights:
                # one frozen at the save, unfrozen now; zeros there were written into the model at the next step)
                buffers[name] = self._own_weights().to(dtype) if name == "fp32_param" else torch.zeros(n_local, dtype=dtype)
            pieces = self._pieces(id_map[pid], pid, prefix, name, buffers[name])
            return pieces or None

        groups_template = self.optimizer.state_dict()["param_groups"]
        labels = LabelDict(param_labels(id_map, self.params, {}, prefix))
        _, scalars, groups = read_optimizer_state(
            checkpoint_dir, prefix, id_map, lambda pid, key, st: self._object(key, id_map[pid], pid, None),
            make_requests, groups_template, labels, state_dict_key, load_kwargs, aliases,
        )
        self._place_element_scalars(scalars, buffers, groups_template)
        # a ZeRO optimizer steps all its params as one: one value of each scalar (every rank reads every
        # param's object, so all ranks agree). A plain optimizer's checkpoint may hold several (a param first
        # stepped later): taking one would change the others' bias correction without a word
        all_scalars = next((s for s in scalars.values() if s), {})
        differ = sorted({name for s in scalars.values() for name, v in s.items()
                         if name in all_scalars and not same_scalar(v, all_scalars[name])})
        if differ:
            values = "; ".join(f"{id_map[pid].key!r}: " + ", ".join(f"{n}={_shown(s[n])}" for n in differ if n in s)
                               for pid, s in sorted(scalars.items()) if s)
            raise OptimizerStateMismatchError(
                f"ZeroShardedOptimizer keeps one {', '.join(map(repr, differ))} for all its parameters, but the "
                f"checkpoint's parameters have different values ({values}): load it into an optimizer of its kind "
                "(e.g. with load_optimizer_state), which keeps one per parameter")
        master = buffers.pop("fp32_param", None)
        self.main_param.copy_(master if master is not None else self._own_weights())
        inner_state = {name: buf for name, buf in buffers.items() if name not in EXTRA_STATE_NAMES}
        inner_state.update(all_scalars)
        self.optimizer.load_state_dict({"state": {0: inner_state} if inner_state else {}, "param_groups": groups})
        return True

    def _own_weights(self) -> torch.Tensor:
        """This rank's slice of the params, flat, in fp32 (the masters when none are loaded)."""
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])[self.start:self.end]

    def _place_element_scalars(self, scalars: Dict[int, Dict[str, Any]], buffers: Dict[str, torch.Tensor],
                               groups: List[Dict[str, Any]]) -> None:
        """A 0-dim param's tensor states (``exp_avg`` of a learned scalar) come as objects from a plain optimizer's
        checkpoint: they are its element of the flat buffers, not the optimizer-wide scalars such as ``step``
        (taken for those, they replaced a whole buffer or were lost: found by a probe). In place."""
        per_element = set(buffers) | set(expected_tensor_states(self.optimizer, groups[0] if groups else {}) or ())
        n_local = self.end - self.start
        for pid, s in scalars.items():
            if self.params[pid].dim() != 0:
                continue
            for name in [n for n in s if n in per_element and isinstance(s[n], torch.Tensor)]:
                value = s.pop(name)
                buf = buffers.setdefault(name, torch.zeros(n_local, dtype=value.dtype))
                if self.start <= self.offsets[pid] < self.end:
                    buf[self.offsets[pid] - self.start] = value

    def state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()


def _zero_problem(sp: Any) -> Optional[str]:
    """Why ZeRO cannot keep a param saved as ``sp`` in its flat buffer, or None."""
    if is_view_factory(sp):  # (its flat buffer is in the param's order, the view's pieces in another)
        return ("is saved as a transposed or permuted view; ZeRO checkpoints need the ShardedTensor to hold the "
                "parameter in its own element order")
    if isinstance(sp, ShardedTensorFactory):
        return "is a ShardedTensorFactory; ZeRO checkpoints support plain ShardedTensor params only"
    return None


def _shown(v: object) -> str:
    return repr(v.item()) if isinstance(v, torch.Tensor) and v.numel() == 1 else repr(v)
