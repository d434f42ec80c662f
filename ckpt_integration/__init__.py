"""ckpt_integration: distributed checkpointing for PyTorch.

Every rank saves only what it owns; any checkpoint loads into any other
parallel layout. Public names follow Megatron-Core's ``dist_checkpointing``.
"""

from .version import __version__
from . import dcp, errors
from .checkpoints import list_checkpoints
# The few exceptions callers catch; every other one lives in ckpt_integration.errors (see __getattr__).
from .errors import CheckpointingException, CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError
from .execution.snapshot import wait_for_snapshot
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)
from .core import check_is_distributed_checkpoint
from .planning.strict import StrictHandling
from .storage.opened import OpenedCheckpoint
from .serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    open_checkpoint,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
)
from .storage.checkpoint_dir import CheckpointingConfig
from .storage.safe_pickle import add_safe_globals
from .memory import MemoryCheckpoints

__all__ = [
    "__version__",
    "save",
    "load",
    "load_common_state_dict",
    "load_tensors_metadata",
    "load_sharded_metadata",
    "load_plain_tensors",
    "open_checkpoint",
    "OpenedCheckpoint",
    "load_content_metadata",
    "remove_sharded_tensors",
    "list_checkpoints",
    "check_is_distributed_checkpoint",
    "get_default_save_sharded_strategy",
    "get_default_load_sharded_strategy",
    "wait_for_snapshot",
    "MemoryCheckpoints",
    "StrictHandling",
    "ShardedBase",
    "ShardedTensor",
    "ShardedObject",
    "ShardedTensorFactory",
    "LocalNonpersistentObject",
    "ShardedStateDict",
    "StateDict",
    "apply_factories",
    "apply_factory_merges",
    "is_main_replica",
    "CheckpointingConfig",
    "add_safe_globals",
    "CheckpointingException",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
]


def __getattr__(name: str):
    # Exceptions that the package root exported before they moved to ckpt_integration.errors:
    # still found here (with a DeprecationWarning), so code written against the old root keeps working.
    if isinstance(getattr(errors, name, None), type) and issubclass(getattr(errors, name), BaseException) \
            and not name.startswith("_"):
        import warnings

        warnings.warn(f"ckpt_integration.{name} moved to ckpt_integration.errors.{name}", DeprecationWarning,
                      stacklevel=2)
        return getattr(errors, name)
    raise AttributeError(f"module 'ckpt_integration' has no attribute {name!r}")
