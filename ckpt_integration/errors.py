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


class CheckpointWriteError(CheckpointingException, OSError):
    """Writing a checkpoint file failed (no space left on device, permission denied, I/O error).

    Also an ``OSError`` (``errno`` set), so ``except OSError`` keeps working; the message
    names the file, e.g. ``no space left on device while writing ckpt/__0_0.distcp``.
    """


class SaveConflictError(CheckpointingException):
    """The target directory is not this save's to write: another save is writing or has
    committed there, or it holds files this library did not write (named in the message)."""


class CheckpointReadError(CheckpointingException, OSError):
    """Reading a checkpoint file failed in the operating system (permission denied, I/O error);
    also an ``OSError`` (``errno`` set). A missing or damaged file is a CorruptCheckpointError."""
