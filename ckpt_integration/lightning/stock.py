"""Resume from checkpoints written by stock Lightning (without ckpt_integration).

Two layouts are recognised by :func:`stock_layout`:

* ``"file"``: a single ``.ckpt`` file (``torch.save`` of Lightning's checkpoint dict, written by
  ``SingleDeviceStrategy`` / ``DDPStrategy`` / ``ModelParallelStrategy(save_distributed_checkpoint=False)``):
  ``state_dict`` holds whole tensors under the module's state-dict names, ``optimizer_states`` the
  optimizers' ``state_dict()`` (parameters numbered in ``param_groups`` order).
* ``"dcp"``: a ``ModelParallelStrategy`` directory (``torch.distributed.checkpoint`` files + ``.metadata``
  + Lightning's ``meta.pt``, no ``metadata.json``): tensors under ``state_dict.<name>``, optimizer state
  under ``optimizer_<i>.state.<param name>.<state>`` and ``optimizer_<i>.param_groups``.

:func:`load_stock_checkpoint` maps either onto the current module and layout: every ShardedTensor
the module's sharded state dict asks for (state-dict name = its key) gets its region of the whole
tensor, written in place; optimizer states are sliced like their parameter (DTensors for DTensor
parameters) and loaded with ``optimizer.load_state_dict``. Pickled parts are read with
``torch.load(weights_only=True)`` (plus the plugin's ``allowed_globals``) unless the plugin says
``trusted=True``. Each rank reads the whole tensors it needs (an import happens once). Entries built
by a ``ShardedTensorFactory`` (fused parameters stored as parts) cannot be cut out of a whole tensor
without knowing how it was fused: such a module raises, naming the key.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import CheckpointingException, UnsupportedCheckpointError
from ..mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from ..optimizer import fill_empty_shards, get_param_id_to_sharded_param_map
from ..storage.checkpoint_dir import CONFIG_FILE
from ..storage.safe_pickle import safe_torch_load

#: files of a stock Lightning ``ModelParallelStrategy`` / FSDP directory checkpoint
DCP_METADATA = ".metadata"
LIGHTNING_META = "meta.pt"


def stock_layout(path: Any) -> Optional[str]:
    """``"file"`` (a stock Lightning ``.ckpt`` file), ``"dcp"`` (a stock ``ModelParallelStrategy``
    directory) or ``None`` (anything else, e.g. a ckpt_integration checkpoint). Local paths only."""
    p = os.fspath(path)
    if "://" in p:
        return None
    if os.path.isfile(p):
        return "file"
    if (os.path.isdir(p) and not os.path.exists(os.path.join(p, CONFIG_FILE))
            and os.path.isfile(os.path.join(p, DCP_METADATA)) and os.path.isfile(os.path.join(p, LIGHTNING_META))):
        return "dcp"
    return None


def _box(st: ShardedTensor) -> Tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(st.global_offset, st.local_shape))


def _region(full: torch.Tensor, st: ShardedTensor, what: str) -> torch.Tensor:
    """This rank's region of the whole tensor ``full`` as ``st`` describes it."""
    if st.prepend_axis_num or tuple(full.shape) != tuple(st.global_shape):
        raise UnsupportedCheckpointError(
            f"{what}: the checkpoint holds shape {tuple(full.shape)}, the module expects the global shape "
            f"{tuple(st.global_shape)}" + (" (stacked layers)" if st.prepend_axis_num else "")
        )
    return full[_box(st)]


class _Source:
    """The whole tensors and the rest of a stock checkpoint (file or DCP directory)."""

    def __init__(self, path: str, layout: str, trusted: bool, allowed_globals: List[Any]):
        self.path, self.layout, self.trusted, self.allowed = path, layout, trusted, allowed_globals
        if layout == "file":
            ckpt = safe_torch_load(path, trusted=trusted, allowed_globals=allowed_globals, what=path)
            if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
                raise UnsupportedCheckpointError(f"{path} is not a Lightning checkpoint (no 'state_dict')")
            self.model: Dict[str, Any] = dict(ckpt.pop("state_dict"))
            self.optimizer_states = ckpt.pop("optimizer_states", None)
            self.rest = ckpt
        else:
            from torch.distributed.checkpoint import FileSystemReader

            self.reader = FileSystemReader(path)
            md = self.reader.read_metadata()
            self.metadata = md.state_dict_metadata
            # DCP flattens nested values (an extra-state dict becomes one item per entry); its planner
            # data maps every stored key back to its path in the saved dict
            mappings = md.planner_data if isinstance(md.planner_data, dict) else {}
            self.paths = {k: tuple(mappings.get(k, tuple(k.split(".", 1)))) for k in self.metadata}
            self.rest = safe_torch_load(os.path.join(path, LIGHTNING_META), trusted=trusted,
                                        allowed_globals=allowed_globals, what=os.path.join(path, LIGHTNING_META))
            self.model = {}
            for k, p in self.paths.items():
                if p[0] == "state_dict" and len(p) > 1:
                    self.model.setdefault(p[1], []).append((k, p[2:]))
            self.optimizer_states = None

    def model_values(self, keys: List[str]) -> Dict[str, Any]:
        """The whole tensors (or other values) saved for the module keys ``keys`` (read at once)."""
        if self.layout == "file":
            return {k: self.model[k] for k in keys}
        read = self._read([fqn for k in keys for fqn, _ in self.model[k]])
        out: Dict[str, Any] = {}
        for k in keys:
            parts = self.model[k]
            if len(parts) == 1 and not parts[0][1]:
                out[k] = read[parts[0][0]]
                continue
            nested: Dict[Any, Any] = {}
            for fqn, sub in parts:
                _set_path(nested, sub, read[fqn])
            out[k] = _lists(nested)
        return out

    def has_optimizer_states(self) -> bool:
        if self.layout == "file":
            return self.optimizer_states is not None
        return any(p[:2] == ("optimizer_0", "param_groups") for p in self.paths.values())

    def _read(self, keys: List[str]) -> Dict[str, Any]:
        """Whole values of DCP keys: tensors at their saved shape/dtype, other items unpickled safely."""
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        targets: Dict[str, Any] = {}
        for k in keys:
            md = self.metadata[k]
            targets[k] = (torch.empty(tuple(md.size), dtype=md.properties.dtype)
                          if isinstance(md, TensorStorageMetadata) else None)
        source, objects = self, {}

        class SafePlanner(DefaultLoadPlanner):  # DCP unpickles byte items with weights_only=False
            def load_bytes(self, read_item: Any, value: Any) -> None:
                fqn = read_item.dest_index.fqn
                objects[fqn] = safe_torch_load(value, trusted=source.trusted, allowed_globals=source.allowed,
                                               what=f"{source.path}: {fqn}")

        load(targets, storage_reader=self.reader, planner=SafePlanner(flatten_state_dict=False), no_dist=True)
        targets.update(objects)
        return targets

    def optimizer(self, idx: int, params_by_name: Dict[int, str], n_params: int) -> Optional[Dict[str, Any]]:
        """Optimizer ``idx``'s state dict with parameters numbered 0..n-1 like the current optimizer."""
        if self.layout == "file":
            states = self.optimizer_states
            return None if states is None or idx >= len(states) else states[idx]
        top = f"optimizer_{idx}"
        keys = [k for k, p in self.paths.items() if p[0] == top]
        if not any(self.paths[k][1:2] == ("param_groups",) for k in keys):
            return None
        tree: Dict[Any, Any] = {}
        for k, v in self._read(keys).items():
            _set_path(tree, self.paths[k][1:], v)
        tree = _lists(tree)
        by_name = {n: i for i, n in params_by_name.items()}
        unknown = sorted(set(tree.get("state", {})) - set(by_name))
        if unknown:
            raise UnsupportedCheckpointError(f"{self.path}: optimizer {idx} holds state of parameters the module does not have: {unknown}")
        state = {by_name[n]: st for n, st in tree.get("state", {}).items()}
        groups = [{**g, "params": [by_name[n] for n in g["params"]]} for g in tree["param_groups"]]
        return {"state": state, "param_groups": groups}


def _set_path(root: Dict[Any, Any], path: Tuple[Any, ...], value: Any) -> None:
    node = root
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def _lists(x: Any) -> Any:
    """DCP's flattened paths rebuilt: dicts keyed 0..n-1 were lists."""
    if not isinstance(x, dict):
        return x
    x = {k: _lists(v) for k, v in x.items()}
    if x and all(isinstance(k, int) for k in x) and sorted(x) == list(range(len(x))):
        return [x[i] for i in range(len(x))]
    return x


def _load_model(source: _Source, request: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str], List[str]]:
    """Fill ``request`` (the module's sharded state dict) from ``source``; returns (loaded, missing, unexpected)."""
    loaded: Dict[str, Any] = {}
    missing: List[str] = []
    wanted: Dict[str, str] = {}  # dict path -> module key
    for path, entry in request.items():
        if isinstance(entry, ShardedTensorFactory):
            raise UnsupportedCheckpointError(
                f"{source.path} is a stock Lightning checkpoint with whole tensors; {entry.key!r} is described by a "
                "ShardedTensorFactory (e.g. a fused QKV stored as parts) and cannot be cut out of the whole tensor. "
                "Resume it in one process with the module's plain (unfused) layout, or convert it first"
            )
        key = entry.key if isinstance(entry, ShardedTensor) else path
        if isinstance(entry, ShardedObject) or key not in source.model:
            missing.append(key)
        else:
            wanted[path] = key
    values = source.model_values(sorted(set(wanted.values())))
    for path, key in wanted.items():
        entry = request[path]
        if isinstance(entry, ShardedTensor):
            region = _region(values[key], entry, f"{source.path}: {key!r}")
            with torch.no_grad():
                entry.data.copy_(region)
            loaded[path] = entry.data
        else:
            loaded[path] = values[key]
    used = set(wanted.values())
    unexpected = sorted(k for k in source.model if k not in used and k not in request)
    return loaded, missing, unexpected


def _load_optimizer(source: _Source, idx: int, opt: Any, module: Any, request: Dict[str, Any]) -> None:
    """Load optimizer ``idx`` of ``source`` into ``opt``, each state tensor sliced like its parameter."""
    from torch.distributed.tensor import DTensor

    params = [p for g in opt.param_groups for p in g["params"]]
    ident = {id(p): n for n, p in module.named_parameters()}
    names = {i: ident.get(id(p), str(i)) for i, p in enumerate(params)}
    sd = source.optimizer(idx, names, len(params))
    if sd is None:
        raise UnsupportedCheckpointError(f"{source.path} holds no state for optimizer {idx}")
    n_saved = sum(len(g["params"]) for g in sd["param_groups"])
    if n_saved != len(params) or len(sd["param_groups"]) != len(opt.param_groups):
        raise UnsupportedCheckpointError(
            f"{source.path}: optimizer {idx} was saved with {n_saved} parameters in {len(sd['param_groups'])} group(s), "
            f"the module's optimizer has {len(params)} in {len(opt.param_groups)}"
        )
    owners = get_param_id_to_sharded_param_map(request, params, strict=False)
    state: Dict[int, Dict[str, Any]] = {}
    for pid, st in sd["state"].items():
        pid = int(pid)
        p, sp = params[pid], owners.get(pid)
        if sp is None:  # this rank holds an empty shard of a DTensor parameter: nothing of it here
            continue
        if isinstance(sp, ShardedTensorFactory):
            raise UnsupportedCheckpointError(f"{source.path}: optimizer state of {names[pid]!r} (a ShardedTensorFactory)")
        out: Dict[str, Any] = {}
        for name, v in st.items():
            if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(sp.global_shape) and v.dim() > 0:
                local = _region(v, sp, f"{source.path}: optimizer {idx} {name} of {names[pid]!r}").clone()
                if isinstance(p, DTensor):
                    local = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                               shape=p.shape, stride=p.stride())
                else:
                    local = local.view(p.shape)
                out[name] = local
            else:
                out[name] = v
        state[pid] = out
    fill_empty_shards(params, state)  # (empty shards of DTensor params: their peers' state, emptied)
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def load_stock_checkpoint(strategy: Any, path: str, request: Dict[str, Any], fitting: bool) -> Tuple[Dict[str, Any], Tuple[List[str], List[str]]]:
    """Lightning's checkpoint dict from the stock checkpoint at ``path``, loaded into ``strategy``'s module
    (in place) and, when ``fitting``, optimizers. Returns ``(checkpoint, (missing, unexpected))`` for
    ``load_model_state_dict``."""
    layout = stock_layout(path)
    if layout is None:
        raise CheckpointingException(f"{path} is not a stock Lightning checkpoint")
    io = strategy.dist_checkpoint_io()
    source = _Source(path, layout, **io.read_kwargs())
    loaded, missing, unexpected = _load_model(source, request)
    checkpoint = dict(source.rest)
    checkpoint["state_dict"] = loaded
    if fitting and source.has_optimizer_states():  # else Lightning says the checkpoint holds only the model
        optimizers = list(strategy.optimizers)
        for i, opt in enumerate(optimizers):
            _load_optimizer(source, i, opt, strategy.lightning_module, request)
        checkpoint["optimizer_states"] = [opt.state_dict() for opt in optimizers]
    return checkpoint, (missing, unexpected)


__all__ = ["stock_layout", "load_stock_checkpoint"]
