"""How ``Trainer(plugins=[DistCkptIO()])`` alone gets sharded checkpoints on Lightning's stock strategies.

Lightning's accelerator connector hands the plugin to the strategy it chose with one assignment,
``strategy.checkpoint_io = plugin`` (for ``"auto"``, ``"single_device"``, ``"ddp"``, ``"ddp_spawn"``,
``"ddp_fork"`` as for a strategy instance). That property of ``lightning.pytorch.strategies.Strategy``
is the one place every strategy receives its ``CheckpointIO``, so :func:`install_connection_hook`
wraps its setter (once, at import of :mod:`ckpt_integration.lightning`): when a :class:`DistCkptIO` is
assigned to a stock strategy, :func:`connect` turns that strategy object into its DistCkpt variant,
a subclass that only adds the checkpoint methods (``SingleDeviceStrategy`` ->
``DistCkptSingleDeviceStrategy``, ``DDPStrategy`` -> ``DistCkptDDPStrategy`` with TP = 1,
``ModelParallelStrategy`` -> ``DistCkptModelParallelStrategy``, ``FSDPStrategy`` (FSDP1) ->
``DistCkptFSDPStrategy``). Everything else the user or
Lightning configured on it (devices, process group backend, start method, DDP kwargs, cluster
environment) stays as it is. Assigning anything else behaves exactly as before.

Strategies with their own checkpoint format (DeepSpeed) and subclasses of the stock strategies
(which may override ``save_checkpoint``; mixing in ``DistCkptStrategyMixin`` is the way for them) are refused with
:class:`~ckpt_integration.lightning.UnsupportedStrategyError` at ``Trainer(...)``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Type

from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy, Strategy

from .io import DistCkptIO, UnsupportedStrategyError
from .strategy import (DistCkptDDPStrategy, DistCkptFSDPStrategy, DistCkptModelParallelStrategy,
                       DistCkptSingleDeviceStrategy, DistCkptStrategyMixin)

#: stock strategy class -> the DistCkpt class it becomes when given a DistCkptIO (exact types only)
DIST_CKPT_VARIANTS: Dict[type, type] = {
    SingleDeviceStrategy: DistCkptSingleDeviceStrategy,
    DDPStrategy: DistCkptDDPStrategy,
    ModelParallelStrategy: DistCkptModelParallelStrategy,
    FSDPStrategy: DistCkptFSDPStrategy,
}

_HOOK_FLAG = "_ckpt_integration_connects_dist_ckpt_io"


def _unsupported_message(strategy: Any) -> str:
    name = type(strategy).__name__
    why = {
        "DeepSpeedStrategy": "DeepSpeed writes its own checkpoints (ZeRO partitions in its own format) and never "
                             "calls CheckpointIO",
    }.get(name)
    if why is None:
        why = "it calls CheckpointIO on rank 0 only (or not at all), so a sharded save would never happen"
        for stock, variant in DIST_CKPT_VARIANTS.items():
            if isinstance(strategy, stock):
                why = (f"it is a subclass of {stock.__name__} that may save or load its own way, so it is not "
                       f"turned into {variant.__name__}")
                break
    return (
        f"DistCkptIO cannot be used with {name}: {why}. Use "
        "strategy=ckpt_integration.lightning.DistCkptDDPStrategy(...) (DDP, optionally with hand-written "
        "tensor parallelism via ckpt_integration.modules), DistCkptModelParallelStrategy(...) (FSDP2 fully_shard / "
        "DTensor tensor parallelism in configure_model), DistCkptFSDPStrategy(...) (FSDP1; in place of DeepSpeed "
        "ZeRO sharding too) or DistCkptSingleDeviceStrategy() for one device "
        "(or mix DistCkptStrategyMixin into your strategy class): they save sharded state on every rank. "
        "To keep Lightning's own checkpoints, drop the DistCkptIO plugin."
    )


def check_strategy(strategy: Any) -> Optional[Type[Any]]:
    """The DistCkpt class ``strategy`` becomes with a :class:`DistCkptIO` (``None``: it already is one), or
    :class:`~ckpt_integration.lightning.UnsupportedStrategyError` saying what to use instead."""
    if strategy is None or isinstance(strategy, DistCkptStrategyMixin):
        return None
    variant = DIST_CKPT_VARIANTS.get(type(strategy))
    if variant is None:
        raise UnsupportedStrategyError(_unsupported_message(strategy))
    return variant


def connect(io: DistCkptIO, strategy: Any) -> None:
    """Make ``strategy`` save and load through ``io`` on every rank: a stock strategy object becomes its
    DistCkpt variant in place (same object, same configuration); unsupported ones raise."""
    variant = check_strategy(strategy)
    if variant is not None:
        strategy.__class__ = variant  # a subclass adding only checkpoint methods: same attributes, same object


def install_connection_hook() -> None:
    """Wrap ``Strategy.checkpoint_io``'s setter so that assigning a :class:`DistCkptIO` calls :func:`connect`
    (idempotent). Strategies overriding the property (the DistCkpt ones, XLA) are not affected."""
    prop = Strategy.__dict__["checkpoint_io"]
    if getattr(prop.fset, _HOOK_FLAG, False):
        return
    stock_set = prop.fset

    def fset(self: Any, io: Any) -> None:
        if isinstance(io, DistCkptIO):
            connect(io, self)  # refuse before the strategy holds the plugin
        stock_set(self, io)

    setattr(fset, _HOOK_FLAG, True)
    Strategy.checkpoint_io = property(prop.fget, fset, prop.fdel, prop.__doc__)  # type: ignore[assignment]


install_connection_hook()

__all__ = ["DIST_CKPT_VARIANTS", "check_strategy", "connect", "install_connection_hook"]
