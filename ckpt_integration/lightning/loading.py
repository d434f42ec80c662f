"""Lightning's ways of loading, for directory checkpoints, in one process.

``trainer.validate/test/predict(ckpt_path=dir)`` and ``trainer.fit(ckpt_path=dir)`` go through the
strategy (``Trainer(plugins=[DistCkptIO()])``) and need nothing here. ``LightningModule.load_from_checkpoint``
calls ``torch.load`` on the path itself, which cannot read a directory: :func:`load_from_checkpoint`
is its equivalent, and :func:`load_checkpoint_dict` returns the checkpoint as a plain dict.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Dict, Iterable, Optional

import torch

from .. import serialization
from ..execution.save import CONTENT_METADATA_KEY
from ..modules import ParallelLayout, load_module_state_dict, module_sharded_state_dict
from ..optimizer import is_optimizer_state_key, optimizer_key
from ..storage.opened import OpenedCheckpoint, opened
from .entries import RNG_KEY, model_key_report, sharded_keys
from .io import MARKER, DistCkptIO
from .paths import resolve_checkpoint_path

_NOT_LIGHTNING = ("rng_states", MARKER, CONTENT_METADATA_KEY)


def _lightning_part(common: Dict[str, Any], num_optimizers: int) -> Dict[str, Any]:
    """Lightning's checkpoint dict from our common state: without our bookkeeping and optimizer parts."""
    drop = {*_NOT_LIGHTNING, *(optimizer_key(i) for i in range(num_optimizers))}
    return {k: v for k, v in common.items() if k not in drop}


def load_checkpoint_dict(
    checkpoint_dir: Any, *, trusted: bool = False, allowed_globals: Optional[Iterable[Any]] = None
) -> Dict[str, Any]:
    """A directory checkpoint as Lightning's checkpoint dict, in one process, without a module.

    Everything Lightning saved (``epoch``, ``global_step``, ``loops``, ``callbacks``, ``lr_schedulers``,
    ``hyper_parameters``, ``on_save_checkpoint`` additions) plus ``state_dict``: every model tensor whole,
    under its saved key (the module's state-dict names; parts of fused parameters stay parts, stacked
    layers stay stacked), and non-tensor model state (extra state). Optimizer tensors are left out: read
    them with ``ckpt_integration.load_plain_tensors`` (keys ``optimizer.state.<state>.<param name>``).

    Example::

        ckpt = load_checkpoint_dict("ckpt/epoch=3-step=40.ckpt")
        ckpt["global_step"], ckpt["state_dict"]["net.fc1.weight"].shape
    """
    io = DistCkptIO(trusted=trusted, allowed_globals=list(allowed_globals or ()))
    with opened(_resolved(checkpoint_dir), trusted) as ck:  # the common state and the tensors of one commit
        common = dict(serialization.load_common_state_dict(ck, **io.read_kwargs()))
        tensors = serialization.load_plain_tensors(ck, trusted=trusted, verify_state=io.verify_state)
    meta = serialization.load_content_metadata(preloaded_state_dict=common) or {}
    out = _lightning_part(common, int(meta.get("num_optimizers", 0)))
    model = dict(common.get("state_dict") or {})
    model.update({k: v for k, v in tensors.items() if not is_optimizer_state_key(k) and not k.startswith(RNG_KEY)})
    out["state_dict"] = model
    return out


def _instantiate(cls: Any, checkpoint: Dict[str, Any], kwargs: Dict[str, Any]) -> Any:
    """``cls`` built from the saved hyper-parameters (as ``save_hyperparameters()`` recorded them) with
    ``kwargs`` taking precedence, like ``LightningModule.load_from_checkpoint``."""
    hparams: Any = dict(checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_KEY) or {})
    kind = checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_TYPE)
    if kind is not None:
        if isinstance(kind, str):  # very old checkpoints name the type
            from lightning.fabric.utilities.data import AttributeDict as kind
        hparams = kind(hparams)
    params = inspect.signature(cls.__init__).parameters
    names = [n for n, p in list(params.items())[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    single = checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_NAME)
    init: Dict[str, Any] = {single: hparams} if single and single in names else dict(hparams)
    init.update(kwargs)
    if not takes_any:
        init = {k: v for k, v in init.items() if k in names}
    return cls(**init)


def load_from_checkpoint(
    cls: Any,
    checkpoint_dir: Any,
    map_location: Any = None,
    strict: Optional[bool] = None,
    *,
    trusted: bool = False,
    allowed_globals: Optional[Iterable[Any]] = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(checkpoint_dir, ...)`` for a directory checkpoint saved by any layout.

    In one process without ``torch.distributed`` (or on every rank of a job): builds ``cls`` from the
    saved hyper-parameters (``kwargs`` override them), runs ``configure_model()`` if the module has it,
    loads every tensor whole into the module's own (unparallelized) layout, merging fused parts
    and stacked layers through the module's ``sharded_state_dict``, calls ``on_load_checkpoint`` and
    restores through ``load_state_dict`` (``strict`` defaults to ``cls.strict_loading``). The module
    stays on the CPU unless ``map_location`` names a device. A stock Lightning ``.ckpt`` file is handed
    to ``cls.load_from_checkpoint`` itself.

    Example::

        model = load_from_checkpoint(MyModule, "ckpt/last.ckpt", lr=1e-4)
    """
    if not isinstance(checkpoint_dir, OpenedCheckpoint) and os.path.isfile(os.fspath(checkpoint_dir)):
        return cls.load_from_checkpoint(os.fspath(checkpoint_dir), map_location=map_location, strict=strict, **kwargs)
    with opened(_resolved(checkpoint_dir), trusted) as ck:  # the common state and the tensors of one commit
        return _load_module(cls, ck, map_location, strict, trusted, allowed_globals, kwargs)


def _resolved(checkpoint_dir: Any) -> Any:
    """An opened checkpoint as it is; a path with an incomplete ``last.ckpt`` resolved first."""
    if isinstance(checkpoint_dir, OpenedCheckpoint):
        return checkpoint_dir
    return resolve_checkpoint_path(os.fspath(checkpoint_dir))


def _load_module(cls: Any, path: Any, map_location: Any, strict: Optional[bool], trusted: bool,
                 allowed_globals: Optional[Iterable[Any]], kwargs: Dict[str, Any]) -> Any:
    from lightning.pytorch.utilities.model_helpers import is_overridden

    io = DistCkptIO(trusted=trusted, allowed_globals=list(allowed_globals or ()))
    common = dict(serialization.load_common_state_dict(path, **io.read_kwargs()))
    meta = serialization.load_content_metadata(preloaded_state_dict=common) or {}
    checkpoint = _lightning_part(common, int(meta.get("num_optimizers", 0)))
    model = _instantiate(cls, checkpoint, kwargs)
    if model._strict_loading is not None and strict is not None and strict != model.strict_loading:
        raise ValueError(f"load_from_checkpoint(..., strict={strict!r}) conflicts with "
                         f"{cls.__name__}.strict_loading={model.strict_loading!r}; set the same value for both")
    strict = model.strict_loading if strict is None else strict
    if is_overridden("configure_model", model):
        model.configure_model()
    request = module_sharded_state_dict(model, "", {"layout": ParallelLayout(), "replica_id": 0})
    loaded, ckpt_only, request_only = serialization.load(
        {"state_dict": request}, path, strict="return_all", validate_access_integrity=False, **io.read_kwargs(),
        thread_count=io.thread_count)
    missing, unexpected = model_key_report(ckpt_only, request_only)
    checkpoint["state_dict"] = dict(loaded.get("state_dict") or {})
    model.on_load_checkpoint(checkpoint)
    missing, unexpected = load_module_state_dict(model, checkpoint["state_dict"], strict=strict, missing_keys=missing,
                                                 unexpected_keys=unexpected, requested_keys=sharded_keys(request))
    if missing or unexpected:
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(f"{path}: keys missing from the checkpoint: {missing}; keys the module does not have: {unexpected}")
    if map_location is not None and not callable(map_location) and not isinstance(map_location, dict):
        model = model.to(torch.device(map_location))
    return model


__all__ = ["load_checkpoint_dict", "load_from_checkpoint"]
