"""Lightning integration: ``Trainer(plugins=[DistCkptIO()])`` with sharded, reshardable checkpoints.

See ``docs/lightning.md``. Modules, each importing only those before it (``tests/test_layers.py``):
``paths`` (checkpoint directories), ``io`` (:class:`DistCkptIO`), ``entries`` (RNG states and other
non-model entries), ``memory`` (memory snapshots), ``callbacks``, ``fsdp`` (FSDP1 state), ``stock``
(importing stock Lightning checkpoints), ``strategy``, ``connect`` (the plugin on stock strategies),
``fabric`` (Lightning Fabric), ``loading`` (:func:`load_from_checkpoint`).
"""

from .callbacks import DistCkptAsyncFinalizer, DistCkptModelCheckpoint
from .connect import check_strategy
from .fabric import (
    DistCkptFabricDDPStrategy,
    DistCkptFabricFSDPStrategy,
    DistCkptFabricMixin,
    DistCkptFabricModelParallelStrategy,
    DistCkptFabricSingleDeviceStrategy,
    check_fabric_strategy,
)
from .io import DistCkptIO, UnsupportedStrategyError, start_async_save
from .loading import load_checkpoint_dict, load_from_checkpoint
from .memory import DistCkptMemorySnapshots
from .paths import is_complete_checkpoint, latest_complete_checkpoint, resolve_checkpoint_path
from .strategy import (
    DistCkptDDPStrategy,
    DistCkptFSDPStrategy,
    DistCkptModelParallelStrategy,
    DistCkptSingleDeviceStrategy,
    DistCkptStrategyMixin,
    optimizer_key,
)

__all__ = [
    "DistCkptIO",
    "DistCkptDDPStrategy",
    "DistCkptFSDPStrategy",
    "DistCkptModelParallelStrategy",
    "DistCkptSingleDeviceStrategy",
    "DistCkptStrategyMixin",
    "DistCkptFabricMixin",
    "DistCkptFabricSingleDeviceStrategy",
    "DistCkptFabricDDPStrategy",
    "DistCkptFabricModelParallelStrategy",
    "DistCkptFabricFSDPStrategy",
    "check_fabric_strategy",
    "DistCkptAsyncFinalizer",
    "DistCkptModelCheckpoint",
    "DistCkptMemorySnapshots",
    "UnsupportedStrategyError",
    "check_strategy",
    "start_async_save",
    "is_complete_checkpoint",
    "latest_complete_checkpoint",
    "load_checkpoint_dict",
    "load_from_checkpoint",
    "optimizer_key",
    "resolve_checkpoint_path",
]
