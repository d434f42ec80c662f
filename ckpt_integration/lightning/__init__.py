"""Lightning integration: ``Trainer(plugins=[DistCkptIO()])`` with sharded, reshardable checkpoints.

See ``docs/lightning.md``. Public names: :class:`DistCkptIO`,
:class:`DistCkptDDPStrategy`, :class:`DistCkptSingleDeviceStrategy`,
:class:`DistCkptModelParallelStrategy`,
:class:`DistCkptStrategyMixin`, :class:`DistCkptAsyncFinalizer`,
:class:`DistCkptModelCheckpoint`, :class:`UnsupportedStrategyError`,
:func:`is_complete_checkpoint`, :func:`latest_complete_checkpoint`.
"""

from .callbacks import DistCkptAsyncFinalizer, DistCkptModelCheckpoint
from .io import DistCkptIO, UnsupportedStrategyError, check_strategy, start_async_save
from .strategy import (
    DistCkptDDPStrategy,
    DistCkptModelParallelStrategy,
    DistCkptSingleDeviceStrategy,
    DistCkptStrategyMixin,
    is_complete_checkpoint,
    latest_complete_checkpoint,
    optimizer_key,
    resolve_checkpoint_path,
)

__all__ = [
    "DistCkptIO",
    "DistCkptDDPStrategy",
    "DistCkptModelParallelStrategy",
    "DistCkptSingleDeviceStrategy",
    "DistCkptStrategyMixin",
    "DistCkptAsyncFinalizer",
    "DistCkptModelCheckpoint",
    "UnsupportedStrategyError",
    "check_strategy",
    "start_async_save",
    "is_complete_checkpoint",
    "latest_complete_checkpoint",
    "optimizer_key",
    "resolve_checkpoint_path",
]
