"""Strict-handling modes for mismatches between a load request and a checkpoint.

Direction of the words, as in Megatron-Core:

* **unexpected** keys are requested by the caller's sharded state dict but are
  *not in the checkpoint*;
* **missing** keys are *in the checkpoint* but not requested by any rank.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Iterable, Set, Tuple, Union

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata


class StrictHandling(Enum):
    """What ``load`` does on missing/unexpected keys (see module docstring for the words).

    * ``ASSUME_OK_UNEXPECTED``: no up-front check; a requested key that is not in
      the checkpoint still fails during the read, naming the key.
    * ``LOG_UNEXPECTED`` / ``LOG_ALL``: log a warning, skip the unexpected keys.
    * ``RAISE_UNEXPECTED`` / ``RAISE_ALL``: raise before reading anything.
    * ``RETURN_UNEXPECTED`` / ``RETURN_ALL``: skip them and return
      ``(state_dict, missing_keys, unexpected_keys)``.
    * ``IGNORE_ALL``: skip silently.

    The ``*_ALL`` modes also consider missing keys, which needs the keys
    requested by all ranks (one metadata exchange).
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: "StrictHandling") -> bool:
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: "StrictHandling") -> bool:
        return val in (
            StrictHandling.IGNORE_ALL,
            StrictHandling.RAISE_ALL,
            StrictHandling.RETURN_ALL,
            StrictHandling.LOG_ALL,
        )

    @staticmethod
    def requires_returning_mismatch_keys(val: "StrictHandling") -> bool:
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: Union[str, bool, StrictHandling, None]) -> StrictHandling:
    """Accept a StrictHandling, its value string, Megatron-Core's ``StrictHandling`` (same
    values), or a bool (True = assume ok, False = log)."""
    if isinstance(strict, StrictHandling):
        return strict
    if strict is None or strict is True:
        return StrictHandling.ASSUME_OK_UNEXPECTED
    if strict is False:
        return StrictHandling.LOG_UNEXPECTED
    if isinstance(getattr(strict, "value", None), str):  # another library's enum of the same values
        strict = strict.value
    try:
        return StrictHandling(str(strict).lower())
    except ValueError:
        choices = ", ".join(m.value for m in StrictHandling)
        raise ValueError(f"unknown strict mode {strict!r}; choose one of: {choices}") from None


#: the ``/shard_<offset>_<shape>`` suffix of a ShardedObject's storage (unique) key
_OBJECT_SHARD = re.compile(r"/shard_\d+(?:\.\d+)*_\d+(?:\.\d+)*$")


def report_key(storage_key: str) -> str:
    """The key a mismatch is reported under: a ShardedObject's key (``'ObjB'``) for the storage key of
    one of its shards (``'ObjB/shard_0.1_1.8'``), as Megatron-Core reports it; any other key as is."""
    return _OBJECT_SHARD.sub("", storage_key)


def mismatched_keys(
    requested_local: Iterable[str], requested_global: Iterable[str], in_checkpoint: Iterable[str],
    objects: Iterable[str] = (),
) -> Tuple[Set[str], Set[str]]:
    """Return ``(missing, unexpected)``: in the checkpoint but requested by no rank, and requested here
    but not in the checkpoint. Keys are storage keys; ``objects``: those of ShardedObject shards
    (requested or stored), which are compared, and reported, by their object's key (:func:`report_key`),
    as Megatron-Core does: a shard of an object whose key is in the checkpoint is not unexpected
    (reading it fails naming the shard if that shard is absent). A tensor's key is compared as it is,
    also one that ends like a shard's (``'a/shard_0_1'``)."""
    objects = set(objects)

    def named(keys: Iterable[str]) -> Set[str]:
        return {report_key(k) if k in objects else k for k in keys}

    ckpt = named(in_checkpoint)
    return ckpt - named(requested_global), named(requested_local) - ckpt


def object_keys(md: Metadata) -> Set[str]:
    """The storage keys of the objects of the checkpoint ``md`` (DCP ``Metadata``) describes, those
    left out of a load's metadata (``other_objects``) included."""
    out = {k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    return out.union(getattr(md, "other_objects", None) or ())


def _key_set(keys: Iterable[str]) -> str:
    """A key set as Megatron-Core prints it (a Python set), in sorted order: ``{'a', 'b'}``."""
    return "{" + ", ".join(repr(k) for k in sorted(keys)) + "}"


def mismatch_message(missing: Iterable[str], unexpected: Iterable[str], context: str = "") -> str:
    """Megatron-Core's message for a key mismatch, sentence for sentence (its
    ``maybe_report_missing_and_unexpected_keys``), then ``context`` and what the words mean on a line
    of their own.

    Example: ``"Unexpected keys (not found in the checkpoint) encountered in the provided sharded
    state dict. \nUnexpected keys (for this rank): {'b'}. \n(...)"``
    """
    missing, unexpected = set(missing), set(unexpected)
    msg = ""
    if missing:
        msg += "Some keys found in the checkpoint are missing in the provided sharded state dict. "
    if unexpected:
        msg += "Unexpected keys (not found in the checkpoint) encountered in the provided sharded state dict. "
    msg += "\n"
    if missing:
        msg += f"Missing keys (for all ranks): {_key_set(missing)}. "
    if unexpected:
        msg += f"Unexpected keys (for this rank): {_key_set(unexpected)}. "
    ours = []
    if unexpected:
        ours.append("unexpected = requested but not in the checkpoint")
    if missing:
        ours.append("missing = in the checkpoint but requested by no rank")
    return msg + "\n" + (f"{context}: " if context else "") + "; ".join(ours)
