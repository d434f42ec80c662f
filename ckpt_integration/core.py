"""The checkpoint's ``metadata.json`` config, as Megatron-Core's ``dist_checkpointing.core``.

``metadata.json`` records which backends wrote a checkpoint; it is written last, so its
presence also marks a complete (committed) checkpoint.
"""

from __future__ import annotations

import os
from typing import Optional, Union

from .errors import CheckpointingException, CheckpointNotFoundError, IncompleteCheckpointError
from .storage.checkpoint_dir import CONFIG_FILE, CheckpointingConfig, read_config, write_config
from .storage.filesystem import locate

#: name of the config file inside a checkpoint directory (Megatron-Core's ``CONFIG_FNAME``)
CONFIG_FNAME = CONFIG_FILE

PathLike = Union[str, "os.PathLike[str]"]


def maybe_load_config(checkpoint_dir: PathLike) -> Optional[CheckpointingConfig]:
    """The checkpoint's :class:`CheckpointingConfig`, or ``None`` if ``checkpoint_dir`` is not
    a distributed checkpoint (missing, empty, a file, or an uncommitted save).

    A ``metadata.json`` that is damaged or names a backend/version this library cannot read
    raises (:class:`~ckpt_integration.errors.CorruptCheckpointError` /
    :class:`~ckpt_integration.errors.UnsupportedCheckpointError`) instead of passing as
    "not a checkpoint". Works with fsspec URLs too.

    Example: ``maybe_load_config("ckpt/iter_100").sharded_backend == "torch_dist"``
    """
    if not checkpoint_dir:
        return None
    try:
        return read_config(locate(checkpoint_dir))  # (an opened checkpoint: what it read at open)
    except (CheckpointNotFoundError, IncompleteCheckpointError):
        return None


def check_is_distributed_checkpoint(checkpoint_dir: PathLike) -> bool:
    """True if ``checkpoint_dir`` holds a committed checkpoint (see :func:`maybe_load_config`).

    Example: ``if check_is_distributed_checkpoint(path): state = load(request, path)``
    """
    return maybe_load_config(checkpoint_dir) is not None


def save_config(config: CheckpointingConfig, checkpoint_dir: PathLike) -> None:
    """Write ``metadata.json`` (atomically). ``save`` does this itself as its commit step;
    writing it by hand marks the directory as a complete checkpoint.

    Example: ``save_config(CheckpointingConfig("torch_dist"), path)``
    """
    write_config(locate(checkpoint_dir), config)


__all__ = [
    "CONFIG_FNAME",
    "CheckpointingConfig",
    "CheckpointingException",
    "maybe_load_config",
    "check_is_distributed_checkpoint",
    "save_config",
]
