"""Structured (dataclass) Hydra configs, registered in Hydra's ConfigStore.

Groups (``configs/`` holds the YAML files; these schemas validate them so a wrong
key, a wrongly typed value or a value outside a fixed set of choices (the Enum-typed
fields: backend, load strategy, accelerator) fails when the config is composed, with a
readable message; :func:`validate_config` checks the rest, e.g. sizes, before any
process is spawned):

* ``checkpoint``: :class:`CheckpointConfig` — builds :class:`~ckpt_integration.lightning.DistCkptIO`
  with ``hydra.utils.instantiate(cfg.checkpoint)``; its ``checkpoint.memory.*`` keys
  (:class:`MemoryConfig`) switch on the in-memory tier (``checkpoint.memory.every_n_train_steps=10``;
  the ``checkpoint=memory`` preset does so with async durable saves);
* ``parallel``: :class:`ParallelConfig` — tensor / pipeline / data parallel sizes;
* ``strategy``: :class:`StrategyConfig` — which Lightning strategy runs the layout (``ddp``:
  ``DistCkptDDPStrategy`` with hand-written TP; ``model_parallel``: ``DistCkptModelParallelStrategy``
  with DTensor TP and FSDP2; ``single_device``: Lightning's own choice for one device with the plugin
  alone);
* ``trainer``: :class:`TrainerConfig`; ``model``: :class:`ModelConfig`;
* :class:`TrainConfig` is the top-level schema of ``examples/train.py``.

Call :func:`register_configs` once before ``@hydra.main`` (``examples/train.py`` does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional

from omegaconf import MISSING

from .strategies import LoadStrategy  # (checkpoint.load_strategy: the enum load takes)

__all__ = [
    "Backend",
    "Snapshot",
    "LoadStrategy",
    "Accelerator",
    "StrategyName",
    "CheckpointConfig",
    "MemoryConfig",
    "ParallelConfig",
    "StrategyConfig",
    "TrainerConfig",
    "ModelConfig",
    "TrainConfig",
    "register_configs",
    "validate_config",
]


class _Choice(str, Enum):
    """A fixed set of string choices: OmegaConf rejects anything else at composition.

    Members are also ``str`` (``LoadStrategy.local == "local"``), so code reading the
    config and the :class:`DistCkptIO` built from it see plain strings.
    """

    def __str__(self) -> str:  # "zarr", not "Backend.zarr", in messages and f-strings
        return self.value


class Backend(_Choice):
    """``checkpoint.backend``: the sharded tensor format."""

    torch_dist = "torch_dist"
    zarr = "zarr"


class Snapshot(_Choice):
    """``checkpoint.snapshot``: when an async save copies large tensors (``DistCkptIO(snapshot=...)``)."""

    background = "background"
    caller = "caller"


class StrategyName(_Choice):
    """``strategy.name``: the Lightning strategy of ``examples/train.py``."""

    ddp = "ddp"
    model_parallel = "model_parallel"
    single_device = "single_device"


class Accelerator(_Choice):
    """``trainer.accelerator``."""

    cpu = "cpu"
    gpu = "gpu"
    cuda = "cuda"


@dataclass
class MemoryConfig:
    """``checkpoint.memory.*``: the in-memory tier (``DistCkptIO(memory=...)``; off while
    ``every_n_train_steps`` is null). See docs/memory.md."""

    every_n_train_steps: Optional[int] = None  # >= 1 switches snapshots on
    replicas: int = 2  # copies on distinct nodes, the rank's own included
    dir: Optional[str] = None  # the node's shared memory (default /dev/shm/ckpt_integration)
    job_id: Optional[str] = None
    ranks_per_node: Optional[int] = None
    persist_every_n: Optional[int] = None
    sigterm_grace_s: Optional[float] = None  # null: what is left of checkpoint.sigterm_grace_s


@dataclass
class CheckpointConfig:
    """Arguments of :class:`DistCkptIO` (``_target_`` makes it instantiable)."""

    _target_: str = "ckpt_integration.lightning.DistCkptIO"
    backend: Backend = Backend.torch_dist
    async_save: bool = False
    load_strategy: LoadStrategy = LoadStrategy.auto
    thread_count: int = 2  # >= 1 (validate_config)
    max_in_flight: int = 1
    durable: bool = True
    balance: bool = True
    trusted: bool = False
    # resumes prove that the loaded state equals what was saved (fingerprints, docs/reliability.md)
    verify_state: bool = True
    # each save hard-links (object stores: copies server-side) the data files an earlier checkpoint in
    # its directory holds unchanged, e.g. a fine-tuning job's frozen base (docs/incremental.md)
    incremental: bool = True
    # async saves stage at most this many bytes of tensor data in host memory (null: all of it)
    staging_budget: Optional[int] = None
    # async saves copy large tensors while training goes on (background) or before returning (caller:
    # for models that change a large buffer in place in forward)
    snapshot: Snapshot = Snapshot.background
    # after a SIGTERM: the async save in flight commits within this many seconds or is abandoned
    # (null: wait however long it takes); keep it below the scheduler's grace before SIGKILL
    sigterm_grace_s: Optional[float] = 25.0
    memory: MemoryConfig = field(default_factory=MemoryConfig)


@dataclass
class ParallelConfig:
    """Parallel layout: ``world_size = tp * pp * dp``."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass
class StrategyConfig:
    """How the ``parallel`` layout runs: ``ddp`` (``DistCkptDDPStrategy``: DDP over the DP group,
    hand-written TP), ``model_parallel`` (``DistCkptModelParallelStrategy``: DTensor TP via
    ``parallelize_module`` + FSDP2 ``fully_shard`` over DP) or ``single_device`` (``Trainer(plugins=[DistCkptIO()])``
    alone on one device, ``tp = dp = 1``). See docs/hydra.md for what resumes across them."""

    name: StrategyName = StrategyName.ddp


@dataclass
class TrainerConfig:
    """The subset of ``lightning.Trainer`` arguments the example uses."""

    max_epochs: int = 4
    accelerator: Accelerator = Accelerator.cpu
    global_batch_size: int = 8
    save_top_k: int = 2
    save_last: bool = True
    log_every_n_steps: int = 1
    seed: int = 0


@dataclass
class ModelConfig:
    """Tiny GPT hyper-parameters (``examples/gpt.py``)."""

    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    block_size: int = 32
    lr: float = 3e-3
    corpus_chars: int = 4000


@dataclass
class TrainConfig:
    """Top-level config of ``examples/train.py``."""

    checkpoint: CheckpointConfig = MISSING
    parallel: ParallelConfig = MISSING
    strategy: StrategyConfig = MISSING
    trainer: TrainerConfig = MISSING
    model: ModelConfig = MISSING
    ckpt_dir: str = "checkpoints/tiny_gpt"
    resume: bool = False
    overwrite: bool = False  # a fresh run may delete complete checkpoints in ckpt_dir
    demo: bool = False  # a fresh run by definition: always starts from an empty ckpt_dir
    port: Optional[int] = None


# the same choices as the Enums, for configs built without the schemas (plain dicts / YAML)
_ALLOWED = {
    "checkpoint.load_strategy": tuple(m.value for m in LoadStrategy),
    "checkpoint.backend": tuple(m.value for m in Backend),
    "checkpoint.snapshot": tuple(m.value for m in Snapshot),
    "trainer.accelerator": tuple(m.value for m in Accelerator),
    "strategy.name": tuple(m.value for m in StrategyName),
}
_AT_LEAST_ONE = ("checkpoint.thread_count", "checkpoint.max_in_flight", "parallel.tp", "parallel.pp", "parallel.dp",
                 "trainer.global_batch_size", "model.n_heads", "checkpoint.memory.every_n_train_steps",
                 "checkpoint.memory.replicas", "checkpoint.memory.persist_every_n", "checkpoint.memory.ranks_per_node",
                 "checkpoint.staging_budget", "trainer.max_epochs", "model.n_layers", "model.block_size",
                 "model.d_model", "model.corpus_chars", "trainer.log_every_n_steps")


def _ckpt_dir_errors(ckpt_dir: Optional[str]) -> List[str]:
    """A local ``ckpt_dir`` that is a file, or lies under one, cannot hold checkpoints."""
    if not ckpt_dir or "://" in str(ckpt_dir):
        return []
    path = os.path.abspath(str(ckpt_dir))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return [f"ckpt_dir={ckpt_dir}: {path} is a file, not a directory"]
    return []


def _config_errors(cfg: Any) -> List[str]:
    """Every problem :func:`validate_config` reports, one message per key."""
    from omegaconf import OmegaConf

    errors = []
    for path, choices in _ALLOWED.items():
        v = OmegaConf.select(cfg, path)
        if v is not None and v not in choices:
            errors.append(f"{path}={str(v)!r} is not allowed; choose one of {list(choices)}")
    for path in _AT_LEAST_ONE:
        v = OmegaConf.select(cfg, path)
        if v is not None and v < 1:
            errors.append(f"{path}={v} must be >= 1")
    for path in ("checkpoint.sigterm_grace_s", "checkpoint.memory.sigterm_grace_s"):
        v = OmegaConf.select(cfg, path)
        if v is not None and not v >= 0:  # (also NaN)
            errors.append(f"{path}={v} must be >= 0 (or null)")
    port = OmegaConf.select(cfg, "port")
    if port is not None and not 1 <= port <= 65535:
        errors.append(f"port={port} must be a TCP port, 1 to 65535 (or null: a free one)")
    lr = OmegaConf.select(cfg, "model.lr")
    if lr is not None and not lr >= 0:  # (also NaN; the optimizer refuses it in every spawned rank)
        errors.append(f"model.lr={lr} must be >= 0")
    errors += _ckpt_dir_errors(OmegaConf.select(cfg, "ckpt_dir"))
    top_k = OmegaConf.select(cfg, "trainer.save_top_k")
    if top_k is not None and top_k < -1:  # (Lightning: -1 keeps every checkpoint, 0 none)
        errors.append(f"trainer.save_top_k={top_k} must be >= -1")
    if OmegaConf.select(cfg, "checkpoint.backend") == "zarr" and OmegaConf.select(cfg, "checkpoint.staging_budget"):
        errors.append("checkpoint.staging_budget is not supported with checkpoint.backend=zarr (the zarr backend "
                      "stages the whole state): unset one of them")
    if errors:  # the checks below divide by these values
        return errors
    tp, pp, dp = (OmegaConf.select(cfg, f"parallel.{k}") for k in ("tp", "pp", "dp"))
    if pp is not None and pp != 1:
        errors.append("parallel.pp > 1 is not supported by examples/train.py (the checkpoint API supports it)")
    heads, d_model = OmegaConf.select(cfg, "model.n_heads"), OmegaConf.select(cfg, "model.d_model")
    # the example's attention splits heads over TP ranks; it would assert inside every spawned worker
    if tp is not None and heads is not None and heads % tp:
        errors.append(f"model.n_heads={heads} must be divisible by parallel.tp={tp} (attention heads are split "
                      "over tensor-parallel ranks)")
    if heads is not None and d_model is not None and d_model % heads:
        errors.append(f"model.d_model={d_model} must be divisible by model.n_heads={heads}")
    if OmegaConf.select(cfg, "strategy.name") == "single_device" and (tp, dp) != (1, 1):
        errors.append(f"strategy=single_device runs one process: it needs parallel.tp=1 and parallel.dp=1 "
                      f"(got tp={tp}, dp={dp}); use strategy=ddp or strategy=model_parallel")
    gbs = OmegaConf.select(cfg, "trainer.global_batch_size")
    if dp is not None and gbs is not None and gbs % dp:
        errors.append(f"trainer.global_batch_size={gbs} must be divisible by parallel.dp={dp}")
    chars, block = OmegaConf.select(cfg, "model.corpus_chars"), OmegaConf.select(cfg, "model.block_size")
    if None not in (chars, block, gbs) and (chars - 1) // block < gbs:  # (windows of block_size + 1 characters)
        errors.append(f"model.corpus_chars={chars} gives {(chars - 1) // block} training windows of "
                      f"model.block_size={block}: fewer than one global batch (trainer.global_batch_size={gbs})")
    if OmegaConf.select(cfg, "demo"):  # its second phase resumes with TP=1, DP=2 (examples/train.py)
        epochs = OmegaConf.select(cfg, "trainer.max_epochs")
        if epochs is not None and epochs < 2:
            errors.append(f"demo=true trains half of trainer.max_epochs, then resumes for the rest: it needs "
                          f"trainer.max_epochs >= 2 (got {epochs})")
        if OmegaConf.select(cfg, "strategy.name") == "single_device":
            errors.append("demo=true resumes with parallel.dp=2: it needs strategy=ddp or strategy=model_parallel")
        if gbs is not None and gbs % 2:
            errors.append(f"demo=true resumes with parallel.dp=2: trainer.global_batch_size={gbs} must be even")
    return errors


def validate_config(cfg: Any) -> None:
    """Check what the schemas cannot (sizes >= 1, divisibility, choices of untyped configs) before spawning.

    Raises ``ValueError`` listing every problem, each with its key.
    """
    errors = _config_errors(cfg)
    if errors:
        raise ValueError("invalid config:\n  " + "\n  ".join(errors))


def register_configs() -> None:
    """Register the schemas: ``train_schema`` and ``<group>/base_<group>`` for each group.

    YAML files in ``configs/<group>/`` list ``base_<group>`` in their defaults, so Hydra
    validates them against the dataclass (unknown keys and wrong types are errors).
    """
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="checkpoint", name="base_checkpoint", node=CheckpointConfig)
    cs.store(group="parallel", name="base_parallel", node=ParallelConfig)
    cs.store(group="strategy", name="base_strategy", node=StrategyConfig)
    cs.store(group="trainer", name="base_trainer", node=TrainerConfig)
    cs.store(group="model", name="base_model", node=ModelConfig)
