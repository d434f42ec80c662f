"""Exception types raised by ckpt_integration.

Every error names what went wrong and where (key, rank, file) so that a failed
save or load can be diagnosed from the message alone.
"""


class CheckpointingException(Exception):
    """Base class of every checkpointing error (same name as Megatron-Core's)."""


class ShardingIntegrityError(CheckpointingException):
    """Shards of a tensor overlap, leave gaps, or disagree on shape/dtype across ranks."""


class CheckpointNotFoundError(CheckpointingException, FileNotFoundError):
    """The path does not exist or is not a checkpoint directory."""


class IncompleteCheckpointError(CheckpointingException):
    """The directory holds a save that never committed (no ``metadata.json``)."""


class CorruptCheckpointError(CheckpointingException):
    """A checkpoint file is truncated, damaged, or inconsistent with the metadata."""


class UnsupportedCheckpointError(CheckpointingException):
    """Unknown backend or format version."""


class UnsafeCheckpointError(CheckpointingException):
    """The checkpoint would execute code (pickled globals outside the allow-list)."""


class MismatchError(CheckpointingException):
    """Requested state dict and checkpoint disagree (keys, shapes, dtypes)."""


class DistributedCheckpointingError(CheckpointingException):
    """A save or load failed on another rank; raised on the healthy ranks with the causes."""
