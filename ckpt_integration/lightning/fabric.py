"""Lightning Fabric: ``Fabric(plugins=[DistCkptIO()])`` saves sharded directory checkpoints on every rank.

Fabric hands the plugin to its strategy with ``strategy.checkpoint_io = plugin``; as for the Trainer
(:mod:`ckpt_integration.lightning.connect`), that assignment turns a stock Fabric strategy into its
DistCkpt variant in place (``SingleDeviceStrategy``, ``DDPStrategy``, ``ModelParallelStrategy``,
``FSDPStrategy``), which only adds the checkpoint methods. ``fabric.save(path, state)`` then writes
on every rank (async when the plugin says so) and ``fabric.load(path, state)`` restores in place into
whatever layout the current run has.

What a state entry becomes (keys of the checkpoint):

* a module under ``"model"``: its tensors under its state-dict names, unprefixed, as the Trainer stores
  its LightningModule, so Trainer and Fabric checkpoints load into each other; a module under another
  key ``k``: ``k.<name>``;
* an optimizer under key ``k``: ``k.state.<state>.<param name>`` sharded like the parameter (the
  Trainer's first optimizer is ``optimizer``, its second ``optimizer_1``), param groups as common
  state under ``k``;
* anything with ``state_dict()`` / ``load_state_dict()`` (schedulers, ...): its state dict, and every
  other value, as common state (written once, read back equal).
"""

from __future__ import annotations

import os
import weakref
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Type

import torch
from lightning.fabric.plugins.io import TorchCheckpointIO
from lightning.fabric.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy, Strategy
from torch import nn

from .. import serialization
from ..errors import CheckpointingException
from ..execution.async_save import register_exit_hook
from ..execution.save import CONTENT_METADATA_KEY
from ..mapping import ShardedTensor, ShardedTensorFactory
from ..modules import ParallelLayout, load_module_state_dict, module_sharded_state_dict
from ..optimizer import UnmatchedParameterError, has_optimizer_state, load_optimizer_state, optimizer_sharded_state_dict
from ..storage.opened import OpenedCheckpoint
from ..storage.filesystem import locate
from . import fsdp
from .entries import model_key_report, sharded_keys
from .io import MARKER, DistCkptIO, UnsupportedStrategyError
from .paths import resolve_checkpoint_path
from .stock import stock_layout
from .strategy import main_replica_copies, reshard_fsdp2

MODEL_KEY = "model"  #: the state key whose module is stored unprefixed (as the Trainer stores its module)


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _prefix(key: str) -> str:
    return "" if key == MODEL_KEY else f"{key}."


def _with_prefix(sd: Dict[str, Any], prefix: str) -> Dict[str, Any]:
    if not prefix:
        return sd
    return {prefix + k: (replace(v, key=prefix + v.key) if isinstance(v, (ShardedTensor, ShardedTensorFactory)) else v)
            for k, v in sd.items()}


class DistCkptFabricMixin(Strategy):
    """Fabric strategy mixin: ``fabric.save`` / ``fabric.load`` through :class:`DistCkptIO` on every rank.

    Mix it into your own Fabric strategy (``class S(DistCkptFabricMixin, DDPStrategy)``); the stock ones
    become such a class when given the plugin. ``fabric.load(path, state, strict)`` follows Fabric: with
    ``strict`` a key of ``state`` the checkpoint lacks raises ``KeyError``, and a module's missing or
    unexpected keys raise (:class:`~ckpt_integration.modules.StateDictMismatchError`); it returns what
    ``state`` did not ask for. ``fabric.load(path)`` returns the common state and every module's tensors
    whole; ``fabric.load_raw(path, module)`` loads the module stored under ``"model"`` (or a Trainer's
    LightningModule). Paths that are not checkpoints of this library (a ``torch.save`` file, Fabric's
    own formats) are loaded as the stock strategy loads them.
    """

    __slots__ = ()

    # -- the plugin ----------------------------------------------------------------------------------
    @property
    def checkpoint_io(self) -> DistCkptIO:  # type: ignore[override]
        io = getattr(self, "_checkpoint_io", None)
        if getattr(self, "_loading_stock", False):
            return io  # (_stock_io: Fabric's own loader reads the file)
        if not isinstance(io, DistCkptIO):
            if io is not None and not isinstance(io, TorchCheckpointIO):
                raise TypeError(f"{type(self).__name__} needs plugins=[DistCkptIO(...)], got {type(io).__name__}")
            io = DistCkptIO()
            self._checkpoint_io = io
        if not getattr(io, "_fabric_exit_hook", False):
            # async saves still in flight when the script ends are committed first (Fabric has no teardown call)
            ref = weakref.ref(io)  # (before executors stop at exit: the save may still hand files to threads)
            register_exit_hook(lambda: ref() is not None and ref().teardown())
            io._fabric_exit_hook = True
        return io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io

    @contextmanager
    def _stock_io(self) -> Iterator[None]:
        """Files and foreign directories load as the stock strategy loads them (``torch.load``)."""
        io = getattr(self, "_checkpoint_io", None)
        self._checkpoint_io, self._loading_stock = TorchCheckpointIO(), True
        try:
            yield
        finally:
            self._checkpoint_io, self._loading_stock = io, False

    # -- layout and state ----------------------------------------------------------------------------
    @property
    def parallel_layout(self) -> ParallelLayout:
        mesh = getattr(self, "_device_mesh", None)
        world = getattr(self, "world_size", 1)
        if mesh is not None and world > 1:
            tp, dp = mesh["tensor_parallel"], mesh["data_parallel"]
            return ParallelLayout(tp_size=tp.size(), dp_size=dp.size(), tp_rank=tp.get_local_rank(),
                                  dp_rank=dp.get_local_rank(), tp_group=tp.get_group(), dp_group=dp.get_group())
        if world > 1:
            return ParallelLayout(dp_size=world, dp_rank=self.global_rank)
        return ParallelLayout()

    def _is_fsdp1(self) -> bool:
        return isinstance(self, FSDPStrategy)

    @staticmethod
    def _module(obj: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        return obj.module if isinstance(obj, DistributedDataParallel) else obj

    def _module_state(self, key: str, module: nn.Module) -> Tuple[Dict[str, Any], Any]:
        """``(sharded state dict with this key's prefix, FSDP1's raw state dict or None)``."""
        if self._is_fsdp1():
            sd, raw = fsdp.model_state(module)
            return _with_prefix(sd, _prefix(key)), raw
        module = self._module(module)
        reshard_fsdp2(module)
        meta: Dict[str, Any] = {"layout": self.parallel_layout}
        if getattr(self, "_device_mesh", None) is not None:
            meta["dtensor_mesh"] = self._device_mesh
        return module_sharded_state_dict(module, _prefix(key), meta), None

    # -- save ------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: Any, state: Dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """Save ``state`` on every rank (collective): see the module docstring for what each entry becomes."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        io = self.checkpoint_io
        io.maybe_finalize(blocking=False)  # every rank calls fabric.save: finalize earlier async saves together
        path = self.broadcast(os.fspath(path))
        filter = filter or {}
        out: Dict[str, Any] = {}
        models: Dict[str, Any] = {}
        fsdp_roots: Dict[str, nn.Module] = {}
        for key, obj in state.items():
            if isinstance(obj, nn.Module):
                sd, _ = self._module_state(key, obj)
                models[key] = sd
                if self._is_fsdp1():
                    fsdp_roots[key] = obj
        owner: Dict[str, str] = {}  # tensor key -> the state key of the module that has it
        for key, sd in models.items():
            for v in sd.values():
                k = getattr(v, "key", None)
                if isinstance(k, str) and owner.setdefault(k, key) != key:
                    raise CheckpointingException(
                        f"fabric.save: modules {owner[k]!r} and {key!r} both have a tensor saved as {k!r} (the module "
                        f"under {MODEL_KEY!r} keeps its names without a prefix, so another module named like one of "
                        "its submodules collides): save them under other keys, or only the one holding both")
        merged = {k: v for sd in models.values() for k, v in sd.items()}
        optimizers: List[str] = []
        for key, obj in state.items():
            if isinstance(obj, nn.Module):
                value: Any = main_replica_copies(models[key], self._module(obj))
                if key in filter:
                    value = {k: v for k, v in value.items()
                             if filter[key](k[len(_prefix(key)):], v.data if isinstance(v, ShardedTensor) else v)}
            elif isinstance(obj, torch.optim.Optimizer):
                value = self._optimizer_state(key, obj, merged, fsdp_roots, models)
                optimizers.append(key)
            elif _is_stateful(obj):
                value = obj.state_dict()
            else:
                value = obj
            if key in filter and isinstance(value, dict) and not isinstance(obj, nn.Module):
                value = {k: v for k, v in value.items() if filter[key](k, v)}
            out[key] = value
        lay = self.parallel_layout
        out[MARKER] = {
            "fabric": 1,
            "world_size": self.world_size,
            "layout": {"tp": lay.tp_size, "pp": lay.pp_size, "dp": lay.dp_size},
            "modules": {k: _prefix(k) for k in models},
            "optimizers": optimizers,
            # a Trainer resuming from this checkpoint loads the optimizers it configures
            "has_optimizer_states": bool(optimizers) and optimizers[0] == "optimizer",
            "num_optimizers": len(optimizers),
        }
        io.save_checkpoint(out, path)

    def _optimizer_state(self, key: str, opt: torch.optim.Optimizer, merged: Dict[str, Any],
                         fsdp_roots: Dict[str, nn.Module], models: Dict[str, Any]) -> Dict[str, Any]:
        if self._is_fsdp1():
            root_key, root = self._fsdp_root_of(opt, fsdp_roots)
            sd = {k[len(_prefix(root_key)):]: replace(v, key=v.key[len(_prefix(root_key)):]) for k, v in models[root_key].items()
                  if isinstance(v, ShardedTensor)} if _prefix(root_key) else models[root_key]
            return fsdp.optimizer_state(root, opt, sd, key)
        try:
            return optimizer_sharded_state_dict(opt, merged, prefix=key)
        except UnmatchedParameterError as e:  # (its advice is for hand-built state dicts: here the module is missing)
            raise UnmatchedParameterError(
                f"fabric.save: optimizer {key!r} optimizes parameters of no module in the state; save the model(s) "
                f"it optimizes in the same call, e.g. fabric.save(path, {{'model': model, {key!r}: optimizer}}) ({e})") from None

    @staticmethod
    def _fsdp_root_of(opt: torch.optim.Optimizer, roots: Dict[str, nn.Module]) -> Tuple[str, nn.Module]:
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        for key, root in roots.items():
            if any(id(p) in ids for p in root.parameters()):
                return key, root
        raise UnsupportedStrategyError("an optimizer in the state has no FSDP module of its parameters next to it: "
                                       "save the model and its optimizer together")

    # -- load ------------------------------------------------------------------------------------------
    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Restore ``state`` in place from ``path`` (collective); returns what ``state`` did not ask for."""
        io = self.checkpoint_io
        io.maybe_finalize(blocking=True, collective=False)  # a checkpoint still being written is committed first
        self.barrier()
        given, path = path, self.broadcast(locate(path).path)
        if stock_layout(path) is not None:  # a torch.save file, Fabric's own DCP directory: as without the plugin
            with self._stock_io():
                return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        # an opened checkpoint given is read as it is (one commit, its small files read once); a path:
        # an incomplete last.ckpt falls back, other incomplete ones raise
        path = given if isinstance(given, OpenedCheckpoint) else resolve_checkpoint_path(path, **io.read_kwargs())
        if not state:
            with io.opened_for_load(path) as ck:
                return self._load_full(io, ck)
        if isinstance(state, torch.optim.Optimizer):
            raise TypeError(
                f"{path} is a sharded checkpoint: an optimizer's state can only be placed with its model's "
                "parameters. Use fabric.load(path, {'model': model, 'optimizer': optimizer})"
            )
        with io.opened_for_load(path) as ck:  # the metadata, the state and the optimizers of one commit
            if isinstance(state, nn.Module):  # fabric.load_raw(path, module)
                self._load_into(io, ck, {MODEL_KEY: state}, strict)
                return {}
            return self._load_into(io, ck, state, strict)

    def _load_full(self, io: DistCkptIO, path: OpenedCheckpoint) -> Dict[str, Any]:
        """Everything but optimizer tensors: the common state, and each module's tensors whole (one commit)."""
        meta = serialization.load_content_metadata(path) or {}
        out = dict(serialization.load_common_state_dict(path, **io.read_kwargs()))
        out.pop(CONTENT_METADATA_KEY, None)
        modules = meta.get("modules", {MODEL_KEY: ""} if meta.get("fabric") else {"state_dict": ""})
        optimizers = meta.get("optimizers", [k for k in out if k == "optimizer" or k.startswith("optimizer_")])
        tensors = serialization.load_plain_tensors(path, trusted=io.trusted, verify_state=io.verify_state)
        prefixed = sorted(((p, k) for k, p in modules.items() if p), key=lambda x: -len(x[0]))
        for name, t in tensors.items():
            if any(name.startswith(f"{o}.") for o in optimizers):
                continue
            owner = next((k for p, k in prefixed if name.startswith(p)), None)
            if owner is not None:
                out.setdefault(owner, {})[name[len(_prefix(owner)):]] = t
            else:
                plain = next((k for k, p in modules.items() if not p), MODEL_KEY)
                out.setdefault(plain, {})[name] = t
        return out

    def _load_into(self, io: DistCkptIO, path: Any, state: Dict[str, Any], strict: bool) -> Dict[str, Any]:
        meta = serialization.load_content_metadata(path, **io.read_kwargs()) or {}
        modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
        request: Dict[str, Any] = {}
        raws: Dict[str, Any] = {}
        for key, module in modules.items():
            request[key], raws[key] = self._module_state(key, module)
        loaded, ckpt_only, request_only = io.load_sharded(request, path, strict="return_all")
        loaded = dict(loaded)
        # which keys of ``state`` the checkpoint has
        present = {k for k in loaded if k not in modules}
        saved_modules = meta.get("modules")  # (which keys were saved as modules; checkpoints of older versions: None)
        for key in modules:
            keys = {v.key for v in request[key].values() if isinstance(v, (ShardedTensor, ShardedTensorFactory))}
            if saved_modules is not None and key not in saved_modules:
                continue  # its tensor names may still match another module's (a submodule "head" of "model")
            if not keys or keys - set(request_only):
                present.add(key)
        opt_keys = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
        present |= {k for k in opt_keys if has_optimizer_state(path, k)}
        missing = [k for k in state if k not in present]
        if strict and missing:  # Fabric's own check and words
            raise KeyError(f"The requested state contains a key '{missing[0]}' that does not exist in the loaded "
                           "checkpoint. To disable strict loading, set `strict=False`.")
        # modules: through their own load_state_dict (hooks, set_extra_state), strict as Fabric asks
        others = tuple(f"{k}." for k in meta.get("optimizers", ())) + tuple(
            p for k, p in meta.get("modules", {}).items() if p and k not in modules)
        for key, module in modules.items():
            if key not in present:
                continue
            prefix = _prefix(key)
            mine = {v.key for v in request[key].values() if isinstance(v, (ShardedTensor, ShardedTensorFactory))}
            miss = [k for k in request_only if k in mine]
            if prefix:
                unexp = [k for k in ckpt_only if k.startswith(prefix)]
            else:
                unexp = [k for k in model_key_report(set(ckpt_only), set())[1]
                         if not k.startswith(others) and not any(k.startswith(_prefix(o)) for o in modules if o != key)
                         and not any(k.startswith(f"{o}.") for o in opt_keys)]
            got = dict(loaded.get(key, {}))
            if raws[key] is not None:
                strip = {k[len(prefix):]: v for k, v in got.items()}
                fsdp.load_model_state(module, raws[key], strip, strict, [k[len(prefix):] for k in miss],
                                      [k[len(prefix):] for k in unexp])
            else:
                load_module_state_dict(self._module(module), got, prefix, strict=strict, missing_keys=miss,
                                       unexpected_keys=unexp, requested_keys=sharded_keys(request[key]))
        merged = {k: v for sd in request.values() for k, v in sd.items()}
        kw = io.load_kwargs()
        for key in opt_keys:
            if key not in present:
                continue
            opt = state[key]
            if self._is_fsdp1():
                root_key, root = self._fsdp_root_of(opt, {k: m for k, m in modules.items()})
                p = _prefix(root_key)
                sd = {k[len(p):]: replace(v, key=v.key[len(p):]) for k, v in request[root_key].items()
                      if isinstance(v, ShardedTensor)} if p else request[root_key]
                fsdp.load_optimizer(root, opt, sd, path, key, **kw)
            else:
                load_optimizer_state(opt, merged, path, prefix=key, **kw)
        for key, obj in state.items():
            if key in modules or key in opt_keys or key not in loaded:
                continue
            if _is_stateful(obj):
                obj.load_state_dict(loaded[key])
            else:
                state[key] = loaded[key]
        # what ``state`` did not ask for, as Fabric returns it: modules whole; an optimizer's state can only be
        # placed with its parameters, so one not asked for is left out (its common part alone would not load)
        rest = {k: v for k, v in loaded.items() if k not in state and k != CONTENT_METADATA_KEY
                and k not in meta.get("optimizers", ())}
        unasked = [k for k in (saved_modules or {}) if k not in state]
        if unasked:
            full = self._load_full(io, path)
            rest.update({k: full[k] for k in unasked if k in full})
        return rest


class DistCkptFabricSingleDeviceStrategy(DistCkptFabricMixin, SingleDeviceStrategy):
    """Fabric's ``SingleDeviceStrategy`` with :class:`DistCkptIO` checkpoints."""


class DistCkptFabricDDPStrategy(DistCkptFabricMixin, DDPStrategy):
    """Fabric's ``DDPStrategy`` saving on every rank (replicated tensors written once, balanced)."""


class DistCkptFabricModelParallelStrategy(DistCkptFabricMixin, ModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` (FSDP2 / DTensor TP from ``parallelize_fn``) saving each rank's
    shards through :class:`DistCkptIO` instead of Fabric's own DCP format."""

    @property
    def checkpoint_io(self) -> DistCkptIO:  # type: ignore[override]
        return DistCkptFabricMixin.checkpoint_io.fget(self)  # type: ignore[attr-defined]

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io


class DistCkptFabricFSDPStrategy(DistCkptFabricMixin, FSDPStrategy):
    """Fabric's ``FSDPStrategy`` (FSDP1) with model and optimizer state through
    ``torch.distributed.checkpoint.state_dict`` (:mod:`ckpt_integration.lightning.fsdp`).

    Fabric refuses its stock ``FSDPStrategy`` on CPU; this class, given directly
    (``Fabric(accelerator="cpu", strategy=DistCkptFabricFSDPStrategy(), plugins=[DistCkptIO()])``), runs
    FSDP1 over gloo there, as the Trainer's ``DistCkptFSDPStrategy`` does."""

    def setup_module(self, module: nn.Module) -> nn.Module:
        """As Fabric wraps the module, with the device torch's FSDP1 needs on a CPU device (Fabric passes
        ``root_device.index``, which is ``None`` there)."""
        from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device, _setup_activation_checkpointing
        from torch.distributed.fsdp import FullyShardedDataParallel

        if self.root_device.type != "cpu" or any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
            return super().setup_module(module)
        wrapped = FullyShardedDataParallel(module=module, cpu_offload=self.cpu_offload,
                                           mixed_precision=self.mixed_precision_config,
                                           sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                                           **self._fsdp_kwargs)
        _move_torchmetrics_to_device(wrapped, self.root_device)
        _setup_activation_checkpointing(wrapped, self._activation_checkpointing_kwargs)
        return wrapped


#: stock Fabric strategy class -> the DistCkpt class it becomes when given a DistCkptIO (exact types only)
FABRIC_VARIANTS: Dict[type, type] = {
    SingleDeviceStrategy: DistCkptFabricSingleDeviceStrategy,
    DDPStrategy: DistCkptFabricDDPStrategy,
    ModelParallelStrategy: DistCkptFabricModelParallelStrategy,
    FSDPStrategy: DistCkptFabricFSDPStrategy,
}


def check_fabric_strategy(strategy: Any) -> Optional[Type[Any]]:
    """The DistCkpt class a Fabric ``strategy`` becomes with a :class:`DistCkptIO` (``None``: it is one), or
    :class:`~ckpt_integration.lightning.UnsupportedStrategyError` saying what to use."""
    if isinstance(strategy, DistCkptFabricMixin):
        return None
    variant = FABRIC_VARIANTS.get(type(strategy))
    if variant is not None:
        return variant
    name = type(strategy).__name__
    if name == "DeepSpeedStrategy":
        why = "DeepSpeed writes its own checkpoints (ZeRO partitions in its own format) and never calls CheckpointIO"
    else:
        why = next((f"it is a subclass of {s.__name__} that may save or load its own way, so it is not turned into "
                    f"{v.__name__}" for s, v in FABRIC_VARIANTS.items() if isinstance(strategy, s)),
                   "it calls CheckpointIO on rank 0 only (or not at all)")
    raise UnsupportedStrategyError(
        f"DistCkptIO cannot be used with Fabric's {name}: {why}. Use Fabric's \"ddp\", \"fsdp\", ModelParallelStrategy "
        "(FSDP2 / tensor parallelism) or one device, or mix ckpt_integration.lightning.DistCkptFabricMixin into "
        "your strategy class. To keep Fabric's own checkpoints, drop the DistCkptIO plugin."
    )


_HOOK_FLAG = "_ckpt_integration_connects_fabric"


def install_fabric_hook() -> None:
    """Wrap the ``checkpoint_io`` setters of Fabric's ``Strategy`` and ``ModelParallelStrategy`` (which
    refuses any plugin) so that assigning a :class:`DistCkptIO` turns the strategy into its DistCkpt
    variant first (idempotent)."""
    for cls in (Strategy, ModelParallelStrategy):
        prop = cls.__dict__["checkpoint_io"]
        if getattr(prop.fset, _HOOK_FLAG, False):
            continue

        def fset(self: Any, io: Any, _stock: Any = prop.fset) -> None:
            if isinstance(io, DistCkptIO):
                variant = check_fabric_strategy(self)
                if variant is not None:
                    self.__class__ = variant  # adds checkpoint methods only: same object, same configuration
                self._checkpoint_io = io
                return
            _stock(self, io)

        setattr(fset, _HOOK_FLAG, True)
        setattr(cls, "checkpoint_io", property(prop.fget, fset, prop.fdel, prop.__doc__))


install_fabric_hook()

__all__ = [
    "DistCkptFabricMixin",
    "DistCkptFabricSingleDeviceStrategy",
    "DistCkptFabricDDPStrategy",
    "DistCkptFabricModelParallelStrategy",
    "DistCkptFabricFSDPStrategy",
    "FABRIC_VARIANTS",
    "check_fabric_strategy",
    "install_fabric_hook",
]
