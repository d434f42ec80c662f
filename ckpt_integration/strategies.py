"""Strategy objects for ``save``/``load``'s ``sharded_strategy`` argument (Megatron-Core's names).

Megatron-Core passes strategy objects that carry the backend and its format version;
code written for it builds them with ``get_default_save_sharded_strategy()`` /
``get_default_load_sharded_strategy(dir)`` and reads ``backend`` / ``version``. Here a
strategy only names the backend: how the work is parallelised is chosen by ``save`` /
``load`` arguments (``balance``, ``thread_count``, ``load_strategy``), see
``docs/strategies.md``. A string (``"zarr"``) or a tuple (``("torch_dist", 1)``) works as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, Optional, Protocol, Tuple, Union

from .errors import CheckpointingException, UnsupportedCheckpointError
from .storage.checkpoint_dir import SUPPORTED_BACKENDS


class LoadStrategy(str, Enum):
    """How the ranks of a load read a checkpoint (``load(..., load_strategy=...)``, docs/strategies.md).

    ``auto`` (default): read once when that reads fewer bytes, else ``local``; ``read_once``: every
    stored block a load touches is read and verified by one rank, the others copy or receive their
    parts; ``local``: each rank reads what it requested; ``fully_parallel`` / ``two_stage``
    (Megatron-Core's names): ``read_once`` over the load's process group on any backend, always
    planned (``two_stage`` logs a per-rank timing summary). Members are strings, so the plain value
    works everywhere a member does.

    Example: ``load(request, path, load_strategy=LoadStrategy.read_once)``
    """

    auto = "auto"
    read_once = "read_once"
    local = "local"
    fully_parallel = "fully_parallel"
    two_stage = "two_stage"

    def __str__(self) -> str:  # "read_once", not "LoadStrategy.read_once", in messages
        return self.value

    @classmethod
    def parse(cls, value: Union[str, "LoadStrategy"], who: str = "") -> "LoadStrategy":
        """The member named ``value``; ValueError naming the choices for anything else."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{who}unknown load_strategy {value!r}; choose one of {[m.value for m in cls]}") from None


@dataclass
class SaveShardedStrategy:
    """The backend ``save`` writes tensors with: ``"torch_dist"`` (DCP format) or ``"zarr"``.

    Example: ``save(sd, path, sharded_strategy=SaveShardedStrategy("zarr"))``
    """

    backend: str = "torch_dist"
    version: int = 1
    #: read by Megatron-Core code: objects are saved by the sharded backend itself
    can_handle_sharded_objects: bool = True

    def __post_init__(self) -> None:
        check_backend(self.backend, self.version)

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.backend}, {self.version})"


@dataclass
class LoadShardedStrategy:
    """The backend ``load`` expects; :func:`~ckpt_integration.serialization.get_default_load_sharded_strategy`
    returns the one a checkpoint was written with.

    Example: ``load(request, path, sharded_strategy=get_default_load_sharded_strategy(path))``
    """

    backend: str = "torch_dist"
    version: int = 1
    can_handle_sharded_objects: bool = True

    def __post_init__(self) -> None:
        check_backend(self.backend, self.version)

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Raise if the checkpoint was written by another backend."""
        if loaded_backend != self.backend:
            raise CheckpointingException(f"strategy for {self.backend!r} cannot load a {loaded_backend!r} checkpoint")

    def check_version_compatibility(self, loaded_version: int) -> None:
        """Raise if the checkpoint's format version cannot be read."""
        check_backend(self.backend, loaded_version)


class TorchDistSaveShardedStrategy(SaveShardedStrategy):
    """Megatron-Core's ``TorchDistSaveShardedStrategy(backend, version, keep_only_main_replica=True,
    thread_count=2, cached_metadata=False, separation_hint=None)``: the ``torch_dist`` backend.

    ``separation_hint``: tensors and objects whose keys start with it are written to data files of
    their own (``<hint>__<rank>_<n>.distcp``, next to ``__<rank>_<n>.distcp``), so that
    :func:`~ckpt_integration.remove_sharded_tensors` with that prefix deletes whole files, e.g. the
    optimizer state of a checkpoint kept for its weights. ``thread_count`` is used when ``save`` gets
    none; the other arguments are accepted for compatibility (this library always writes the main
    replicas once and caches plans itself).

    Example::

        save(sd, path, sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1, separation_hint="optimizer."))
        remove_sharded_tensors(path, "optimizer.")   # deletes the optimizer files
    """

    def __init__(self, backend: str = "torch_dist", version: int = 1, keep_only_main_replica: bool = True,
                 thread_count: int = 2, cached_metadata: bool = False, separation_hint: Optional[str] = None):
        super().__init__(backend, version)
        if backend != "torch_dist":
            raise UnsupportedCheckpointError(f"TorchDistSaveShardedStrategy writes 'torch_dist', not {backend!r}")
        self.keep_only_main_replica = keep_only_main_replica
        self.thread_count = thread_count
        self.cached_metadata = cached_metadata
        self.separation_hint = separation_hint


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Megatron-Core's ``TorchDistLoadShardedStrategy()``: loads ``torch_dist`` checkpoints."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1)


class StrategyLike(Protocol):
    """A strategy object, ours or Megatron-Core's: its ``backend`` and ``version``."""

    backend: str
    version: int


#: a strategy as ``save``/``load`` take it: None (the default), a backend name, ``(name, version)``
#: or a strategy object
StrategySpec = Union[None, str, Tuple[str, int], StrategyLike]


def check_backend(backend: object, version: object = 1) -> None:
    """Raise :class:`UnsupportedCheckpointError` for an unknown backend or format version."""
    versions = SUPPORTED_BACKENDS.get(backend) if isinstance(backend, str) else None
    if versions is None:
        raise UnsupportedCheckpointError(f"unknown sharded backend {backend!r}; supported: {sorted(SUPPORTED_BACKENDS)}")
    if version not in versions:
        raise UnsupportedCheckpointError(f"{backend} format version {version!r} is not supported (supported: {list(versions)})")


def backend_and_version(strategy: StrategySpec, default: str = "torch_dist") -> Tuple[str, int]:
    """``(backend, version)`` of a strategy given as ``None``, a name, a ``(name, version)`` tuple
    or an object with ``backend``/``version`` attributes (ours or Megatron-Core's)."""
    if strategy is None:
        return default, 1
    if isinstance(strategy, str):
        return strategy, 1
    if isinstance(strategy, tuple):
        return strategy[0], (strategy[1] if len(strategy) > 1 else 1)
    return getattr(strategy, "backend", default), getattr(strategy, "version", 1)


def strategy_option(strategy: StrategySpec, name: str) -> Any:
    """A save strategy's option ``name`` (``separation_hint``, ``thread_count``), or None: also through wrappers
    such as Megatron-Core's ``FullyParallelSaveStrategyWrapper`` (its ``base_strategy`` holds them)."""
    while strategy is not None and not isinstance(strategy, (str, tuple)):
        value = getattr(strategy, name, None)
        if value is not None:
            return value
        strategy = getattr(strategy, "base_strategy", None)
    return None


def save_strategy_options(strategy: StrategySpec) -> Dict[str, Any]:
    """What a save strategy decides of a save: ``backend`` (checked with its format version) and, where the
    strategy has one, ``separation_hint`` (``TorchDistSaveShardedStrategy(separation_hint=...)``, also inside a
    wrapper)."""
    backend, version = backend_and_version(strategy)
    check_backend(backend, version)
    hint = strategy_option(strategy, "separation_hint")
    return {"backend": backend, **({"separation_hint": hint} if hint else {})}


__all__ = ["SaveShardedStrategy", "LoadShardedStrategy", "TorchDistSaveShardedStrategy", "TorchDistLoadShardedStrategy",
           "check_backend", "backend_and_version", "strategy_option"]
