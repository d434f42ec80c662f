"""Strict-handling modes for mismatches between a load request and a checkpoint.

Direction of the words, as in Megatron-Core:

* **unexpected** keys are requested by the caller's sharded state dict but are
  *not in the checkpoint*;
* **missing** keys are *in the checkpoint* but not requested by any rank.
"""

from __future__ import annotations

from enum import Enum
from typing import Iterable, Set, Tuple, Union


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


def mismatched_keys(
    requested_local: Iterable[str], requested_global: Iterable[str], in_checkpoint: Iterable[str]
) -> Tuple[Set[str], Set[str]]:
    """Return ``(missing, unexpected)``: missing from all ranks' requests, unexpected locally."""
    ckpt = set(in_checkpoint)
    unexpected = set(requested_local) - ckpt
    missing = ckpt - set(requested_global)
    return missing, unexpected


def mismatch_message(missing: Iterable[str], unexpected: Iterable[str]) -> str:
    """Megatron-Core's words for a key mismatch ("Missing keys" / "Unexpected keys"), then ours.

    Example: ``"Unexpected keys (not found in the checkpoint) encountered in the provided
    sharded state dict. Unexpected keys (for this rank): ['b']. ..."``
    """
    missing, unexpected = sorted(missing), sorted(unexpected)
    titles, bodies = [], []
    if missing:
        titles.append("Some keys found in the checkpoint are missing in the provided sharded state dict.")
        bodies.append(f"Missing keys (for all ranks): {missing}.")
    if unexpected:
        titles.append("Unexpected keys (not found in the checkpoint) encountered in the provided sharded state dict.")
        bodies.append(f"Unexpected keys (for this rank): {unexpected}.")
    ours = []
    if unexpected:
        ours.append("unexpected = requested but not in the checkpoint")
    if missing:
        ours.append("missing = in the checkpoint but requested by no rank")
    return " ".join(titles + bodies) + f" ({'; '.join(ours)})"
