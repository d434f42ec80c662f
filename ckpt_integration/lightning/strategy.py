"""Lightning strategies that save and load sharded checkpoints on every rank."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any, Dict, List, Mapping, Optional, Tuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from .. import serialization
from ..errors import CheckpointingException
from ..mapping import ShardedObject, ShardedTensor, ShardedTensorFactory, is_main_replica
from ..execution import dist as cdist
from ..modules import ParallelLayout, load_module_state_dict, module_sharded_state_dict
from ..optimizer import optimizer_key, optimizer_sharded_state_dict
from ..tools.recipe import export_recipe_object
from . import fsdp
from .callbacks import DistCkptAsyncFinalizer
from .entries import RNG_KEY, model_key_report, rng_from_safe, rng_to_safe, sharded_keys
from .io import MARKER, DistCkptIO
from .memory import DistCkptMemorySnapshots, callback_states_of_copy, restore_newest
from .paths import resolve_checkpoint_path
from .preemption import DistCkptPreemption
from .stock import load_stock_checkpoint, stock_layout

logger = logging.getLogger(__name__)

def _contains_sharded(x: Any) -> bool:
    if isinstance(x, (ShardedTensor, ShardedTensorFactory, ShardedObject)):
        return True
    if isinstance(x, dict):
        return any(_contains_sharded(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_contains_sharded(v) for v in x)
    return False


def main_replica_copies(model_sd: Any, module: Any) -> Any:
    """``model_sd`` with non-parameter tensors of non-main replicas described without data.

    Data parallelism keeps parameters identical on every rank, so a balanced save may write any
    replica's copy. Other tensors (buffers such as BatchNorm statistics updated after DDP's broadcast,
    torchmetrics states, hook entries) can differ between ranks: the checkpoint keeps the main
    replica's copy (rank 0's, as stock Lightning does), so the others must not be candidates.
    """
    from torch.distributed.tensor import DTensor

    params = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
              for p in module.parameters()}

    def visit(x: Any) -> Any:
        if isinstance(x, ShardedTensor):
            if (x.data is not None and not is_main_replica(x.replica_id)
                    and x.data.untyped_storage().data_ptr() not in params):
                return replace(x, data=None)
            return x
        if isinstance(x, dict):
            return type(x)((k, visit(v)) for k, v in x.items())
        if isinstance(x, list):
            return [visit(v) for v in x]
        return x

    return visit(model_sd)


class DistCkptStrategyMixin(Strategy):
    """Strategy mixin: sharded checkpoints through :class:`DistCkptIO` on every rank.

    On save: ``lightning_module.sharded_state_dict()`` (or the default from
    :mod:`ckpt_integration.modules`: everything ``module.state_dict()`` holds) on every rank, the
    optimizers' sharded state (:func:`~ckpt_integration.optimizer.optimizer_sharded_state_dict`),
    per-rank RNG states as ShardedObjects and the rest of Lightning's checkpoint (loops, callbacks,
    LR schedulers, hyper-parameters, precision plugin, epoch/global_step, ``on_save_checkpoint``
    additions) as common state, kept exactly. On load: the request is built from the current
    module (current layout); tensors are loaded resharded in place, then Lightning's
    ``load_model_state_dict`` restores the module through its own ``load_state_dict`` (hooks,
    ``set_extra_state``, ``strict_loading``); optimizer states are loaded resharded; RNG states
    restored (same world size). Checkpoints written by stock Lightning (a ``.ckpt`` file, or a
    ``ModelParallelStrategy`` DCP directory) are imported (:mod:`ckpt_integration.lightning.stock`).

    Mixed into a subclass of Lightning's ``FSDPStrategy`` (FSDP1), model and optimizer state go
    through ``torch.distributed.checkpoint.state_dict`` (:mod:`ckpt_integration.lightning.fsdp`):
    the same keys as under DDP / FSDP2 / one device, so checkpoints move between them.
    """

    # A ``Strategy`` subclass adding no instance layout (no ``__slots__`` entries, no ``__init__`` state):
    # a stock strategy object can become a DistCkpt subclass in place (``strategy.__class__ = ...``,
    # which Python allows only between classes of the same layout; see ``ckpt_integration.lightning.connect``)
    __slots__ = ()

    _load_report: Optional[Tuple[List[str], List[str]]] = None

    # -- configuration ------------------------------------------------------------------------------
    @property
    def parallel_layout(self) -> ParallelLayout:
        """TP/DP layout of this run (trivial unless a tensor-parallel size was given)."""
        lay = getattr(self, "_parallel_layout", None)
        if lay is None and self._is_fsdp1() and getattr(self, "world_size", 1) > 1:
            # FSDP1: every rank is a data-parallel rank (parameters sharded over all of them)
            return ParallelLayout(dp_size=self.world_size, dp_rank=self.global_rank)  # type: ignore[attr-defined]
        return lay if lay is not None else ParallelLayout()

    def _is_fsdp1(self) -> bool:
        return fsdp.is_fsdp1(self)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # optimizers exist when loading, so they are restored in the new layout

    @property
    def checkpoint_io(self) -> DistCkptIO:  # type: ignore[override]
        return self.dist_checkpoint_io()

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io

    def dist_checkpoint_io(self) -> DistCkptIO:
        """The :class:`DistCkptIO` in use (created with defaults if none was given)."""
        io = getattr(self, "_checkpoint_io", None)
        if io is None:
            io = DistCkptIO()
            self._checkpoint_io = io
        if not isinstance(io, DistCkptIO):
            raise TypeError(
                f"{type(self).__name__} needs plugins=[DistCkptIO(...)] (or no CheckpointIO), got {type(io).__name__}"
            )
        return io

    def _module_sharded_state_dict(self) -> Dict[str, Any]:
        if self._is_fsdp1():
            sd, self._fsdp_raw_state = fsdp.model_state(self.model)  # type: ignore[attr-defined]
            return sd
        return module_sharded_state_dict(self.lightning_module, "", {"layout": self.parallel_layout})

    def _optimizer_sharded_state_dict(self, optimizer: Any, model_sd: Dict[str, Any], prefix: str) -> Dict[str, Any]:
        if self._is_fsdp1():
            return fsdp.optimizer_state(self.model, _unwrap_optimizer(optimizer), model_sd, prefix)  # type: ignore[attr-defined]
        return optimizer_sharded_state_dict(optimizer, model_sd, prefix=prefix, module=self.lightning_module)

    def _load_optimizer(self, io: DistCkptIO, optimizer: Any, model_sd: Dict[str, Any], path: str, prefix: str) -> None:
        if self._is_fsdp1():
            kw = io.load_kwargs()
            fsdp.load_optimizer(self.model, _unwrap_optimizer(optimizer), model_sd, path, prefix, **kw)  # type: ignore[attr-defined]
            return
        io.load_optimizer(optimizer, model_sd, path, prefix, module=self.lightning_module)

    def optimizer_state(self, optimizer: Any) -> Dict[str, Any]:
        """The optimizer's own ``state_dict()`` under FSDP1 (its consolidating ``optim_state_dict`` is not
        needed: the sharded optimizer state is built in :meth:`save_checkpoint`)."""
        if self._is_fsdp1():
            return _unwrap_optimizer(optimizer).state_dict()
        return super().optimizer_state(optimizer)

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        """The module's sharded state dict: what ``checkpoint["state_dict"]`` holds in
        ``on_save_checkpoint`` (entries removed or added there are saved so)."""
        return self._module_sharded_state_dict()

    # -- hooks -----------------------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)  # type: ignore[misc]
        io = self.dist_checkpoint_io()
        if io.async_save and not any(isinstance(cb, DistCkptAsyncFinalizer) for cb in trainer.callbacks):
            trainer.callbacks.insert(0, DistCkptAsyncFinalizer())
        if not any(isinstance(cb, DistCkptPreemption) for cb in trainer.callbacks):
            trainer.callbacks.append(DistCkptPreemption())  # after ModelCheckpoint: a save of this step starts first
        if io.memory_enabled:
            if not any(isinstance(cb, DistCkptMemorySnapshots) for cb in trainer.callbacks):
                trainer.callbacks.insert(0, DistCkptMemorySnapshots())

    def on_train_start(self) -> None:
        """Lightning's; then note where this run starts (the restored global step, and rank 0's clock, shared):
        every checkpoint it saves records both, so that after a rollback (a run resumed from an earlier
        checkpoint) ``ckpt_path="last"`` continues this run, not the timeline it left."""
        super().on_train_start()  # type: ignore[misc]
        self._run_record = {"from_step": int(self.lightning_module.trainer.global_step),
                            "started": float(self.broadcast(time.time()))}

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Save on every rank (collective)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        io = self.dist_checkpoint_io()
        path = self.broadcast(os.fspath(filepath))  # type: ignore[attr-defined]
        io.save_checkpoint(self.sharded_checkpoint(checkpoint), path)

    def sharded_checkpoint(self, checkpoint: Dict[str, Any], main_replica_only: bool = True) -> Dict[str, Any]:
        """Lightning's ``checkpoint`` as the sharded state dict this strategy saves (with the plugin's
        marker). ``main_replica_only=False`` keeps every rank's own copy of replicated buffers (a memory
        snapshot restores each rank's own state)."""
        n_opt = len(self.optimizers)  # type: ignore[attr-defined]
        ours = {"content_metadata", "export_recipe", "rng_states", *(optimizer_key(i) for i in range(max(1, n_opt)))}
        taken = sorted(k for k in checkpoint if k in ours)
        if taken:  # (they were overwritten by this integration's state, or dropped on load: lost without a word)
            raise CheckpointingException(
                f"checkpoint[{taken[0]!r}] (added by on_save_checkpoint or a callback) uses a name the DistCkpt strategies "
                f"store their own state under ({', '.join(sorted(ours))}): rename it; nothing was saved")
        state = dict(checkpoint)
        dumped = state.pop("state_dict", None)
        if isinstance(dumped, dict) and not _contains_sharded(dumped) and any(isinstance(v, torch.Tensor) for v in
                                                                              dumped.values()):
            raise CheckpointingException(
                "checkpoint['state_dict'] holds plain tensors instead of the module's sharded state dict: a callback "
                "replaced it (Lightning's WeightAveraging / EMAWeightAveraging put the averaged model's weights there and "
                f"moved the module's to 'current_model_state'). {type(self).__name__} saves the module's sharded state "
                "dict, so these weights would be lost: keep the averaged weights as a module of the LightningModule "
                "(saved and resharded like its other parameters), or save without the DistCkpt plugin")
        model_sd = dumped if _contains_sharded(dumped) else self._module_sharded_state_dict()
        state["state_dict"] = model_sd
        opt_states = state.pop("optimizer_states", None)
        num_opt = 0
        if opt_states is not None:
            for i, opt in enumerate(self.optimizers):  # type: ignore[attr-defined]
                state[optimizer_key(i)] = self._optimizer_sharded_state_dict(opt, model_sd, optimizer_key(i))
                num_opt += 1
        if main_replica_only:
            state["state_dict"] = main_replica_copies(model_sd, self.lightning_module)
        from lightning.fabric.utilities.seed import _collect_rng_states

        rank, world = self.global_rank, self.world_size  # type: ignore[attr-defined]
        state["rng_states"] = ShardedObject(RNG_KEY, rng_to_safe(_collect_rng_states()), (world,), (rank,))
        lay = self.parallel_layout
        # how fused parts / renamed / stacked tensors map back to state-dict names, so that
        # ``ckpt-integration export`` works from the checkpoint alone (one object per TP x PP position)
        state["export_recipe"] = export_recipe_object(
            model_sd, rank=lay.pp_rank * lay.tp_size + lay.tp_rank, world_size=lay.tp_size * lay.pp_size,
            replica_id=lay.dp_rank,
        )
        state[MARKER] = {
            "lightning": 1,
            "world_size": world,
            "num_optimizers": num_opt,
            "has_optimizer_states": opt_states is not None,
            "layout": {"tp": lay.tp_size, "pp": lay.pp_size, "dp": lay.dp_size},
        }
        run = getattr(self, "_run_record", None)
        if run is not None:  # (where this run started: ``ckpt_path="last"`` follows a rollback, see paths.run_of)
            state[MARKER]["run"] = dict(run)
        return state

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Load into the current layout on every rank (collective); returns Lightning's checkpoint dict.

        Tensors are loaded in place; ``load_model_state_dict`` then restores the module through its
        ``load_state_dict``. A stock Lightning checkpoint (``.ckpt`` file, ``ModelParallelStrategy``
        directory) is imported: see :mod:`ckpt_integration.lightning.stock`.
        """
        io = self.dist_checkpoint_io()
        path = self.broadcast(os.fspath(checkpoint_path))  # type: ignore[attr-defined]
        io.wait_if_saving(path)
        if io.memory_enabled:  # the newer of the memory tier's newest step and this checkpoint
            loaded, path = restore_newest(self, path)
            if loaded is not None:
                return loaded
            connector = getattr(getattr(self.lightning_module, "_trainer", None), "_checkpoint_connector", None)
            if connector is not None and path != getattr(connector, "_ckpt_path", path):
                connector._ckpt_path = path  # (``trainer.ckpt_path`` and Lightning's "Restored ..." name what was loaded)
        model_sd = self._module_sharded_state_dict()
        self._loaded_sharded_keys = sharded_keys(model_sd)
        if stock_layout(path) is not None:
            loaded, self._load_report = load_stock_checkpoint(self, path, model_sd, self._fitting())
            return loaded
        path = resolve_checkpoint_path(path, **io.read_kwargs())
        with io.opened_for_load(path) as ck:  # one commit for every read below
            loaded = self._load_opened(io, ck, model_sd)
        callback_states_of_copy(self, loaded, path)  # (a durable copy of a memory snapshot)
        return loaded

    def _load_opened(self, io: DistCkptIO, path: Any, model_sd: Dict[str, Any]) -> Dict[str, Any]:
        meta = serialization.load_content_metadata(path, **io.read_kwargs()) or {}
        request: Dict[str, Any] = {"state_dict": model_sd}
        rank, world = self.global_rank, self.world_size  # type: ignore[attr-defined]
        if meta.get("world_size") == world:
            request["rng_states"] = ShardedObject(RNG_KEY, None, (world,), (rank,))
        loaded, ckpt_only, request_only = io.load_sharded(request, path, strict="return_all")
        loaded = dict(loaded)
        # checkpoints written before the common state kept empty containers recorded them here
        empty = meta.get("empty_keys", {"lr_schedulers": "list"} if meta.get("has_optimizer_states") else {})
        for k, kind in empty.items():
            loaded.setdefault(k, [] if kind == "list" else {})
        self._load_report = model_key_report(ckpt_only, request_only)
        loaded["state_dict"] = dict(loaded.get("state_dict", {}))
        if meta.get("has_optimizer_states") and self._fitting():
            optimizers = list(self.optimizers)  # type: ignore[attr-defined]
            if len(optimizers) != meta.get("num_optimizers", 0):
                raise ValueError(
                    f"{path} holds {meta.get('num_optimizers')} optimizer(s), the module configures {len(optimizers)}"
                )
            for i, opt in enumerate(optimizers):
                self._load_optimizer(io, opt, model_sd, path, optimizer_key(i))
            loaded["optimizer_states"] = [opt.state_dict() for opt in optimizers]
        for i in range(int(meta.get("num_optimizers", 0))):
            loaded.pop(optimizer_key(i), None)
        if meta.get("fabric"):  # written by fabric.save: no Lightning version (nothing to migrate), no loops
            import lightning

            loaded.setdefault("pytorch-lightning_version", lightning.__version__)
            loaded.pop("content_metadata", None)
        rng = loaded.pop("rng_states", None)
        if isinstance(rng, dict):
            from lightning.fabric.utilities.seed import _set_rng_states

            _set_rng_states(rng_from_safe(rng))
        return loaded

    def _fitting(self) -> bool:
        state = getattr(getattr(self.lightning_module, "_trainer", None), "state", None)
        return state is not None and state.fn == TrainerFn.FITTING

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Restore the module through its own ``load_state_dict`` from the tensors :meth:`load_checkpoint`
        loaded in place (after ``on_load_checkpoint``). ``strict`` is ``LightningModule.strict_loading``:
        with ``False``, keys missing from the checkpoint keep their values and checkpoint keys the module
        does not have are skipped (both logged)."""
        missing, unexpected = self._load_report or ([], [])
        self._load_report = None
        if self._is_fsdp1():
            raw, self._fsdp_raw_state = self._fsdp_raw_state, None
            missing, unexpected = fsdp.load_model_state(self.model, raw, dict(checkpoint["state_dict"]), strict,  # type: ignore[attr-defined]
                                                        missing, unexpected)
        else:
            missing, unexpected = load_module_state_dict(
                self.lightning_module, dict(checkpoint["state_dict"]), strict=strict, missing_keys=missing,
                unexpected_keys=unexpected, requested_keys=getattr(self, "_loaded_sharded_keys", None),
            )
        if missing:
            rank_zero_warn(f"Found keys that are in the model state dict but not in the checkpoint: {missing}")
        if unexpected:
            rank_zero_warn(f"Found keys that are not in the model state dict but in the checkpoint: {unexpected}")

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing to do: :meth:`load_checkpoint` already loaded the optimizer states resharded."""

    # -- object collectives ---------------------------------------------------------------------------
    # Lightning's (and ModelCheckpoint's) small collectives go through these. Lightning's own build
    # tensors in Python and drop them as soon as ``wait()`` returns, while the gloo worker thread may
    # still hold them; when the process ends right after (a save at the end of ``fit``), that thread
    # frees the Python tensors during interpreter teardown and aborts the process (see
    # ``execution.dist.settle``). The library's helpers return only once the worker let go.
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of global rank ``src`` on every rank (as Lightning's, on the world group)."""
        return cdist.broadcast_object(obj, src=src) if cdist.is_distributed() else obj

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        """Whether every rank (``all=True``) or any rank decided ``True`` (as Lightning's)."""
        if not cdist.is_distributed():
            return bool(decision)
        total = cdist.all_reduce_ints([int(bool(decision))], "sum")[0]
        return total == cdist.get_world_size() if all else total > 0

    def remove_checkpoint(self, filepath: Any) -> None:
        """Rank 0 removes (deferred by the plugin while an async save is in flight)."""
        if self.is_global_zero:  # type: ignore[attr-defined]
            self.dist_checkpoint_io().remove_checkpoint(filepath)

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)  # type: ignore[misc]
        io = getattr(self, "_checkpoint_io", None)
        if isinstance(io, DistCkptIO):
            from lightning.pytorch.utilities.exceptions import SIGTERMException

            if isinstance(exception, SIGTERMException):
                io.note_preemption()  # the grace period bounds the wait below (noted at the signal already)
            try:
                io.teardown()
            except BaseException as e:  # noqa: BLE001 - do not hide the original error
                logger.error("async checkpoint save failed during exception handling: %s", e)


class DistCkptSingleDeviceStrategy(DistCkptStrategyMixin, SingleDeviceStrategy):
    """``SingleDeviceStrategy`` saving ckpt_integration sharded checkpoints (loadable in any layout)."""

    def __init__(self, device: Any = "cpu", checkpoint_io: Optional[DistCkptIO] = None, **kwargs: Any):
        super().__init__(device=device, checkpoint_io=checkpoint_io, **kwargs)


class DistCkptDDPStrategy(DistCkptStrategyMixin, DDPStrategy):
    """``DDPStrategy`` saving sharded checkpoints on every rank, with optional tensor parallelism.

    Args:
        tensor_parallel_size: TP size for hand-written tensor-parallel modules
            (:mod:`ckpt_integration.modules`); ``world_size / tensor_parallel_size`` ranks do
            data parallelism. DDP then averages gradients over the DP group only, and the
            distributed sampler splits data by DP rank (TP ranks see the same batches).
            The layout is ``strategy.parallel_layout`` (use it in ``configure_model``).
        checkpoint_io: a :class:`DistCkptIO` (default: ``DistCkptIO()``).
        kwargs: as for ``DDPStrategy``.
    """

    _tp_size = 1  # (a stock DDPStrategy given DistCkptIO becomes this class without __init__)

    def __init__(self, tensor_parallel_size: int = 1, checkpoint_io: Optional[DistCkptIO] = None, **kwargs: Any):
        super().__init__(checkpoint_io=checkpoint_io, **kwargs)
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        self._tp_size = int(tensor_parallel_size)

    def setup_distributed(self) -> None:
        super().setup_distributed()
        tp = getattr(self, "_tp_size", 1)
        if self.world_size % tp:
            raise ValueError(f"world size {self.world_size} is not divisible by tensor_parallel_size={tp}")
        self._parallel_layout = ParallelLayout.initialize(tp) if tp > 1 else ParallelLayout(
            dp_size=self.world_size, dp_rank=self.global_rank
        )

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        lay = self.parallel_layout
        if getattr(self, "_tp_size", 1) > 1:
            return dict(num_replicas=lay.dp_size, rank=lay.dp_rank)
        return super().distributed_sampler_kwargs

    def _setup_model(self, model: Any) -> Any:
        if getattr(self, "_tp_size", 1) > 1 and "process_group" not in self._ddp_kwargs:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = self.determine_ddp_device_ids()
            return DistributedDataParallel(
                module=model, device_ids=device_ids, process_group=self.parallel_layout.dp_group, **self._ddp_kwargs
            )
        return super()._setup_model(model)


def _unwrap_optimizer(optimizer: Any) -> Any:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class DistCkptFSDPStrategy(DistCkptStrategyMixin, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1: full / grad-op / hybrid shard, ``use_orig_params`` either
    way, auto-wrap policies) saving sharded checkpoints through :class:`DistCkptIO` on every rank.

    Model and optimizer state come from ``torch.distributed.checkpoint.state_dict`` as this rank's
    shards and are stored under the parameters' names, as DDP / FSDP2 / one-device checkpoints
    are: a checkpoint of any of them resumes under any other, with another world size too.
    Lightning's ``state_dict_type`` does not apply (checkpoints are always sharded directories).
    On a CPU device the model is wrapped with ``device_id=torch.device("cpu")``, which torch's
    FSDP1 needs there (Lightning passes none).
    """

    def _setup_model(self, model: Any) -> Any:
        wrapped = fsdp.setup_cpu_model(self, model)
        return super()._setup_model(model) if wrapped is None else wrapped


def reshard_fsdp2(module: Any) -> None:
    """Register FSDP2's sharded parameters everywhere (after e.g. an eval forward of the root)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class DistCkptModelParallelStrategy(DistCkptStrategyMixin, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` and/or tensor parallelism with
    ``parallelize_module`` in ``LightningModule.configure_model``) saving ckpt_integration
    sharded checkpoints through :class:`DistCkptIO` on every rank.

    Model state is the module's ``sharded_state_dict()`` hook or the default one, which turns
    every DTensor parameter into its shard at its global offsets; optimizer states (DTensors
    too) are saved sharded like their parameters. A checkpoint loads into any other layout:
    another TP / DP size, FSDP2 instead of TP, plain (un-parallelized) modules in one process,
    or :class:`DistCkptDDPStrategy` / :class:`DistCkptSingleDeviceStrategy`. Async saving
    works as with the other DistCkpt strategies.

    Args:
        data_parallel_size: as for ``ModelParallelStrategy`` (the ``"data_parallel"`` dim of the
            device mesh given to ``configure_model``).
        tensor_parallel_size: as for ``ModelParallelStrategy`` (the ``"tensor_parallel"`` dim).
        checkpoint_io: a :class:`DistCkptIO` (default: ``DistCkptIO()``).
        kwargs: as for ``ModelParallelStrategy`` (``process_group_backend``, ``timeout``).
    """

    def __init__(
        self,
        data_parallel_size: Any = "auto",
        tensor_parallel_size: Any = "auto",
        checkpoint_io: Optional[DistCkptIO] = None,
        **kwargs: Any,
    ):
        if "save_distributed_checkpoint" in kwargs:
            raise TypeError(
                f"{type(self).__name__} always saves sharded checkpoints through DistCkptIO; "
                "drop save_distributed_checkpoint (use ModelParallelStrategy without DistCkptIO for Lightning's own format)"
            )
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size, **kwargs)
        if checkpoint_io is not None:
            self.checkpoint_io = checkpoint_io

    def setup_environment(self) -> None:
        super().setup_environment()
        mesh = self.device_mesh
        tp, dp = mesh["tensor_parallel"], mesh["data_parallel"]
        multi = self.world_size > 1
        # plain (non-DTensor) tensors are replicated on every rank: one main replica (rank 0)
        self._parallel_layout = ParallelLayout(
            tp_size=tp.size(), dp_size=dp.size(), tp_rank=tp.get_local_rank(), dp_rank=dp.get_local_rank(),
            tp_group=tp.get_group() if multi else None, dp_group=dp.get_group() if multi else None,
        )

    def _module_sharded_state_dict(self) -> Dict[str, Any]:
        reshard_fsdp2(self.lightning_module)
        # DTensors on a sub-mesh (FSDP2 on "data_parallel" only, TP on "tensor_parallel" only) are
        # replicated along the other mesh dim: one main replica
        meta = {"layout": self.parallel_layout, "dtensor_mesh": self.device_mesh}
        return module_sharded_state_dict(self.lightning_module, "", meta)

    def optimizer_state(self, optimizer: Any) -> Dict[str, Any]:
        """The optimizer's own ``state_dict()`` (references, no copy): the sharded optimizer state
        is built from the optimizer itself in :meth:`save_checkpoint`."""
        return _unwrap_optimizer(optimizer).state_dict()


__all__ = [
    "DistCkptStrategyMixin",
    "DistCkptSingleDeviceStrategy",
    "DistCkptDDPStrategy",
    "DistCkptModelParallelStrategy",
    "DistCkptFSDPStrategy",
    "optimizer_key",
    "RNG_KEY",
]
