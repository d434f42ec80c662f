"""Structured (dataclass) Hydra configs, registered in Hydra's ConfigStore.

Groups (``configs/`` holds the YAML files; these schemas validate them so a wrong
key or a wrongly typed value fails at startup with a readable message):

* ``checkpoint``: :class:`CheckpointConfig` — builds :class:`~ckpt_integration.lightning.DistCkptIO`
  with ``hydra.utils.instantiate(cfg.checkpoint)``;
* ``parallel``: :class:`ParallelConfig` — tensor / pipeline / data parallel sizes;
* ``trainer``: :class:`TrainerConfig`; ``model``: :class:`ModelConfig`;
* :class:`TrainConfig` is the top-level schema of ``examples/train.py``.

Call :func:`register_configs` once before ``@hydra.main`` (``examples/train.py`` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import MISSING

__all__ = [
    "CheckpointConfig",
    "ParallelConfig",
    "TrainerConfig",
    "ModelConfig",
    "TrainConfig",
    "register_configs",
    "validate_config",
]


@dataclass
class CheckpointConfig:
    """Arguments of :class:`DistCkptIO` (``_target_`` makes it instantiable)."""

    _target_: str = "ckpt_integration.lightning.DistCkptIO"
    backend: str = "torch_dist"
    async_save: bool = False
    load_strategy: str = "local"  # local | fully_parallel | two_stage
    thread_count: int = 2
    max_in_flight: int = 1
    durable: bool = True
    balance: bool = True
    trusted: bool = False


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
class TrainerConfig:
    """The subset of ``lightning.Trainer`` arguments the example uses."""

    max_epochs: int = 4
    accelerator: str = "cpu"
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
    trainer: TrainerConfig = MISSING
    model: ModelConfig = MISSING
    ckpt_dir: str = "checkpoints/tiny_gpt"
    resume: bool = False
    demo: bool = False
    port: Optional[int] = None


_ALLOWED = {
    "checkpoint.load_strategy": ("local", "fully_parallel", "two_stage"),
    "checkpoint.backend": ("torch_dist", "zarr"),
    "trainer.accelerator": ("cpu", "gpu", "cuda"),
}


def validate_config(cfg: Any) -> None:
    """Check values the type system cannot (choices, positive sizes); raise ``ValueError`` naming the key."""
    from omegaconf import OmegaConf

    for path, choices in _ALLOWED.items():
        v = OmegaConf.select(cfg, path)
        if v is not None and v not in choices:
            raise ValueError(f"{path}={v!r} is not allowed; choose one of {list(choices)}")
    par = cfg.get("parallel")
    if par is not None:
        for k in ("tp", "pp", "dp"):
            if par[k] < 1:
                raise ValueError(f"parallel.{k}={par[k]} must be >= 1")
        if par.pp != 1:
            raise ValueError("parallel.pp > 1 is not supported by examples/train.py (the checkpoint API supports it)")


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
    cs.store(group="trainer", name="base_trainer", node=TrainerConfig)
    cs.store(group="model", name="base_model", node=ModelConfig)
