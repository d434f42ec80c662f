"""Megatron-Core's ``dist_checkpointing.validation`` names: how a load treats keys the request and the
checkpoint do not share.

Example::

    from ckpt_integration.validation import StrictHandling, parse_strict_flag

    ci.load(request, "ckpt", strict=parse_strict_flag("log_all"))  # or StrictHandling.LOG_ALL, or "log_all"

The checks themselves run inside :func:`ckpt_integration.load` (Megatron-Core's
``validate_integrity_and_strict_load`` and the steps around it are internal here).
"""

from .planning.strict import StrictHandling, parse_strict_flag

__all__ = ["StrictHandling", "parse_strict_flag"]
