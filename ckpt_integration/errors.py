"""Exception types raised by ckpt_integration.

Every error names what went wrong and where (key, rank, file) so that a failed
save or load can be diagnosed from the message alone.
"""


class CheckpointingException(Exception):
    """Base class of every checkpointing error (same name as Megatron-Core's)."""


def _dcp_checkpoint_exception() -> type:
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:  # pragma: no cover - torch built without torch.distributed
        return BaseException
    return CheckpointException


class _DCPCompatible(_dcp_checkpoint_exception()):  # type: ignore[misc]
    """Mixin: also an instance of ``torch.distributed.checkpoint.api.CheckpointException``.

    Megatron-Core's ``load`` lets DCP's exception escape when a requested key is not in the
    checkpoint, and DCP raises it on every rank when any rank failed, so code written for
    them catches that type. DCP's class derives from ``BaseException`` and takes
    ``(msg, failures)``; ``failures`` (``{rank: (exc, trace)}``) stays empty here since the
    message names the failing ranks. ``str()`` is our message.
    """

    def __init__(self, msg: str = "", failures: "dict | None" = None):
        super().__init__(msg, failures or {})

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ShardingIntegrityError(CheckpointingException):
    """Shards of a tensor overlap, leave gaps, or disagree on shape/dtype across ranks."""


class CheckpointNotFoundError(CheckpointingException, FileNotFoundError):
    """The path does not exist or is not a checkpoint directory."""


class IncompleteCheckpointError(CheckpointingException):
    """The directory holds a save that never committed (no ``metadata.json``)."""


class CorruptCheckpointError(CheckpointingException):
    """A checkpoint file is truncated, damaged, or inconsistent with the metadata."""


class StateVerificationError(CorruptCheckpointError):
    """The state a load would return is not what was saved: a requested region was not filled
    exactly once (a part never delivered, or delivered twice), or a tensor's layout-independent
    fingerprint differs from the one recorded at save. Raised on every rank; the message names
    the key, the region and, where the ranks' parts tell, the rank. Nothing is returned."""


class UnsupportedCheckpointError(CheckpointingException):
    """Unknown backend or format version."""


class UnknownBlockHashError(UnsupportedCheckpointError):
    """The manifest records block checksums of an algorithm this version does not know (its
    data cannot be verified, so it is refused; the message names the file and the algorithm)."""


class UnsafeCheckpointError(CheckpointingException):
    """The checkpoint would execute code or reach outside its directory (a pickled global
    outside the allow-list, a file name or link leading outside the checkpoint)."""


class UntrustedObjectError(UnsafeCheckpointError):
    """A pickled object outside the safe allow-list; ``trusted=True`` or ``allowed_globals``
    opt in. Unlike the other unsafe cases, this one is the caller's choice to lift.

    Example::

        try:
            state = load_common_state_dict(path)
        except UntrustedObjectError:
            state = load_common_state_dict(path, trusted=True)  # only for checkpoints you trust
    """


class MismatchError(CheckpointingException):
    """Requested state dict and checkpoint disagree (keys, shapes, dtypes)."""


class DistributedCheckpointingError(CheckpointingException, _DCPCompatible):
    """A save or load failed on another rank; raised on the healthy ranks with the causes.

    Also a DCP ``CheckpointException`` (what DCP raises on every rank in that case)."""


class PeerLostError(DistributedCheckpointingError):
    """A collective of a save or load with the other ranks failed in the backend: a peer exited, was
    killed or cannot be reached (gloo's "Connection reset by peer", a timeout). Its own log says why."""


class KeyNotInCheckpointError(MismatchError, _DCPCompatible):
    """A requested tensor or object is not in the checkpoint (an *unexpected* key, in
    Megatron-Core's words). Also a DCP ``CheckpointException``, the type Megatron-Core's
    ``load`` raises there."""


class KeyPrefixError(CheckpointingException, ValueError):
    """A sharded key does not start with the prefix to replace (``replace_prefix_for_sharding``);
    also a ``ValueError``, as in Megatron-Core."""


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


class AsyncSaveAbandonedError(CheckpointingException):
    """An async save could not be committed because another rank left before it was finalized
    (its process exited, was killed, or aborted the save's collectives), or because it was
    cut off at interpreter exit after ``CKPT_INTEGRATION_EXIT_TIMEOUT`` seconds. Nothing was
    committed at the named path; earlier checkpoints are untouched.

    Every rank must let an async save finish: ``request.wait()``, ``queue.close()``, or a normal
    interpreter exit (which waits for the saves in flight) on every rank. Destroying the
    process groups first is fine: the commit runs on the library's own group.
    """


class MemoryCheckpointError(CheckpointingException):
    """The in-memory tier (:class:`~ckpt_integration.MemoryCheckpoints`) cannot save or restore:
    no complete step in memory, every copy of a rank's snapshot refused or lost, a failed
    snapshot or peer transfer. The message names the ranks, steps and copies; callers fall
    back to a durable checkpoint."""


class MemoryLayoutError(MemoryCheckpointError, MismatchError):
    """The state requested from the memory tier is laid out differently from the snapshot
    (other keys, shapes or shards): load the durable checkpoint instead, which reshards."""


class MemorySpaceError(MemoryCheckpointError):
    """The shared-memory directory of a node has not enough free space for the snapshots it
    must hold (the message gives what is needed and what is free, per node)."""


class CheckpointReplacedError(CheckpointingException):
    """A checkpoint opened with :func:`~ckpt_integration.open_checkpoint` was replaced by another
    commit (e.g. ``last.ckpt`` rewritten by a training job) or removed (top-k deletion) while it
    was being read. The message names the path. Nothing read from it is returned: the files are
    intact but belong to another commit, so open the path again to read the new one."""


class SnapshotModifiedError(CheckpointingException):
    """A tensor of an async save was modified in place before its snapshot was complete."""


class StagingMemoryError(CheckpointingException):
    """An async save's staging does not fit: in the host memory available (no ``staging_budget``
    given) or in ``staging_budget`` (a device tensor larger than it). The message names the bytes
    needed and the budget to pass; nothing is committed."""


def format_size(n: int) -> str:
    """Human-readable binary size, as every message and summary shows one: ``1.5 MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover
