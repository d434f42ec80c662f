"""fp32 master weights for low-precision model params, saved sharded like the params."""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, List, Union

import torch

from ..mapping import ShardedStateDict
from .load import load_optimizer_state
from .sharding import DEFAULT_PREFIX, sharding_state_to_optim_state
from .state import optimizer_sharded_state_dict


# ---------------------------------------------------------------------------------------------
# mixed precision
# ---------------------------------------------------------------------------------------------
class MixedPrecisionOptimizer:
    """fp32 master weights (and fp32 optimizer state) for low-precision (bf16/fp16) model params.

    ``step()`` copies the model grads into the fp32 masters, runs the inner optimizer
    and writes the masters back into the model params (rounded). The masters are
    saved as the per-param state ``fp32_param`` (``optimizer.state.fp32_param.<key>``),
    sharded like the model params, so they reshard with them.

    Example::

        opt = MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        sd = {"model": msd, "optimizer": opt.sharded_state_dict(msd)}
    """

    def __init__(self, params: Iterable[torch.Tensor], optimizer_cls: type = torch.optim.AdamW, **optimizer_kwargs: object):
        self.model_params = list(params)
        self.main_params = [torch.nn.Parameter(p.detach().float().clone()) for p in self.model_params]
        self.optimizer = optimizer_cls(self.main_params, **optimizer_kwargs)

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        """Drop the model and master grads."""
        for p in self.model_params + self.main_params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One optimizer step on the fp32 masters, then copy them into the model params."""
        for p, m in zip(self.model_params, self.main_params):
            m.grad = None if p.grad is None else p.grad.detach().float()
        self.optimizer.step()
        for p, m in zip(self.model_params, self.main_params):
            p.copy_(m)

    def sharded_state_dict(self, model_sharded_state_dict: ShardedStateDict, *, prefix: str = DEFAULT_PREFIX, init_state: bool = False) -> ShardedStateDict:
        """Inner optimizer state plus ``fp32_param`` masters, sharded like the model params."""
        return optimizer_sharded_state_dict(
            self.optimizer, model_sharded_state_dict, prefix=prefix, model_params=self.model_params,
            extra_states={i: {"fp32_param": m.detach()} for i, m in enumerate(self.main_params)},
            init_state=init_state,
        )

    @torch.no_grad()
    def load_sharded_state_dict(self, loaded: Dict[str, Any]) -> None:
        """Install the optimizer part of a ``load`` result built from :meth:`sharded_state_dict`."""
        sd = sharding_state_to_optim_state(loaded)
        extracted = sd.pop("extracted", {})
        self._set_masters(extracted)
        self.optimizer.load_state_dict(sd)

    def _set_masters(self, extracted: Dict[int, Dict[str, torch.Tensor]]) -> None:
        for i, (p, m) in enumerate(zip(self.model_params, self.main_params)):
            src = extracted.get(i, {}).get("fp32_param")
            if src is None:  # e.g. a checkpoint of a plain fp32 optimizer: masters from the model
                m.copy_(p.detach().float())
            else:
                m.copy_(src.view(m.shape))

    @torch.no_grad()
    def load_checkpoint(self, model_sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, "os.PathLike[str]"], *, prefix: str = DEFAULT_PREFIX, missing_ok: bool = False, **load_kwargs: object) -> bool:
        """Load masters and state (see :func:`load_optimizer_state`); False if fresh (``missing_ok``)."""
        extracted = load_optimizer_state(
            self.optimizer, model_sharded_state_dict, checkpoint_dir, prefix=prefix, missing_ok=missing_ok,
            model_params=self.model_params, **load_kwargs,
        )
        if extracted is None:
            self._set_masters({})
            return False
        self._set_masters(extracted)
        return True

    def state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()
