"""Tiny LightningModules keeping every kind of state, and helpers shared by the Lightning tests.

Importable by workers Lightning spawns itself (``ddp_spawn``), so everything lives at module level.
``TinyModule`` keeps, besides its weights: a torchmetrics metric with ``persistent(True)`` states
(``_save_to_state_dict`` override), a submodule with ``get_extra_state`` / ``set_extra_state``, a
state-dict post hook + load pre hook pair adding an entry of their own, an HF-style
``LambdaLR(functools.partial(...))`` scheduler (``state_dict()["lr_lambdas"] == [{}]``), empty
hyper-parameters and ``on_save_checkpoint`` additions with empty containers and tuples.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Dict, Optional

import lightning as L
import torch
import torchmetrics
from torch import nn

N, D = 16, 4  # samples, features


def loader(batch_size: int = 4) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(N, D, generator=g), torch.randn(N, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=batch_size)


def warmup(step: int, steps: int) -> float:
    """An HF-style schedule: ``LambdaLR(opt, functools.partial(warmup, steps=...))``."""
    return min(1.0, (step + 1) / steps)


class Counter(nn.Module):
    """State outside parameters and buffers: ``get_extra_state`` / ``set_extra_state``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.calls, self.history = 0, []

    def get_extra_state(self) -> Dict[str, Any]:
        return {"calls": self.calls, "history": list(self.history), "empty": {}, "pair": (self.calls, None)}

    def set_extra_state(self, state: Dict[str, Any]) -> None:
        self.calls, self.history = state["calls"], list(state["history"])
        self.restored_extra = state


def _add_version(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    state_dict[prefix + "format_version"] = torch.tensor([module.format_version])


def _read_version(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    v = state_dict.pop(prefix + "format_version", None)
    if v is not None:
        module.format_version = int(v[0])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 8), nn.Linear(8, 1)
        self.format_version = 0
        self.register_state_dict_post_hook(_add_version)  # an entry of the hooks' own
        self.register_load_state_dict_pre_hook(_read_version)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))).squeeze(-1)


class TinyModule(L.LightningModule):
    def __init__(self, dump: Optional[str] = None, options: Optional[dict] = None, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["dump"])  # ``options`` may be {}: an empty hyper-parameter
        torch.manual_seed(0)
        self.net, self.counter = Net(), Counter()
        self.metric = torchmetrics.MeanMetric()
        self.metric.persistent(True)
        self.dump = dump
        self.loaded_user: Any = None

    def configure_model(self) -> None:
        mesh = getattr(self, "_device_mesh", None)
        if mesh is not None and mesh["data_parallel"].size() > 1:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=mesh["data_parallel"])  # every parameter: FSDP2 keeps them in sync
            fully_shard(self.counter.lin, mesh=mesh["data_parallel"])

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.metric.update(loss.detach())
        self.counter.calls += 1
        self.counter.history.append(int(self.global_step))
        self.net.format_version = int(self.global_step) + 1
        self.log("train_loss", loss.detach())
        return loss

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((self.net(self.counter.lin(x)) - y) ** 2).mean()

    def validation_step(self, batch: Any, idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: Any, idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: Any, idx: int) -> torch.Tensor:
        return self.net(self.counter.lin(batch[0]))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(warmup, steps=3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        checkpoint["user"] = {"empty": {}, "list": [], "nested": [{}], "pair": (1, None), "step": int(self.global_step)}

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        self.loaded_user = checkpoint.get("user")

    def on_train_start(self) -> None:
        if self.dump:  # the state a resumed run starts from
            snap = snapshot(self)
            if self.global_rank == 0:
                torch.save(snap, self.dump + ".start")

    def on_train_end(self) -> None:
        if self.dump:  # the state the last checkpoint holds
            snap = snapshot(self)
            if self.global_rank == 0:
                torch.save(snap, self.dump + ".end")


def _full(t: Any) -> Any:
    """A whole, detached copy (DTensors gathered: collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor().detach().clone()
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def _tree(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_tree(v) for v in x)
    return _full(x)


def snapshot(m: TinyModule) -> Dict[str, Any]:
    """Everything a resume must restore (call on every rank: DTensors are gathered)."""
    opt = m.trainer.optimizers[0]
    opt_sd = opt.state_dict()
    return {
        "state_dict": {k: _full(v) for k, v in m.state_dict().items() if k != "counter._extra_state"},
        "extra": m.counter.get_extra_state(),
        "metric": (_full(m.metric.mean_value), _full(m.metric.weight)),
        "optimizer": {"state": _tree(opt_sd["state"]), "param_groups": opt_sd["param_groups"]},
        "scheduler": m.trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "global_step": m.trainer.global_step,
        "epoch": m.trainer.current_epoch,
        "hparams": dict(m.hparams),
    }


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Exact equality of nested snapshots (tensors with ``torch.equal``, the rest with ``==``, types too)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: {len(a)} != {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def trainer(**kw: Any) -> L.Trainer:
    """A quiet CPU Trainer (no logger, no progress bar, no validation)."""
    base = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0, limit_val_batches=0)
    base.update(kw)
    return L.Trainer(**base)


def set_rank_env(rank: int, world: int) -> None:
    """Lightning attaches to an existing process group (``run_distributed``) through these."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")


def assert_losses_continue(losses, ref, steps):
    """``losses`` (step -> loss, keys as JSON strings) are exactly ``steps`` and equal the
    uninterrupted run's ``ref`` at each step (a resumed run continues where the saved one stopped)."""
    import pytest

    losses = {int(k): v for k, v in losses.items()}
    assert sorted(losses) == list(steps), sorted(losses)
    for s in steps:
        assert losses[s] == pytest.approx(ref[str(s)], abs=1e-5), (s, losses[s], ref[str(s)])
