"""One phase of the sharded-Fabric chain of ``tests/test_fabric.py`` (a script: Fabric launches its processes).

``python tests/fabric_sharded_job.py STRATEGY DEVICES WORK_DIR LOAD SAVE``: a small MLP with AdamW and
StepLR under ``Fabric(accelerator="cpu", strategy=..., plugins=[DistCkptIO()])``; ``fsdp1``
(``DistCkptFabricFSDPStrategy``: FSDP1 on CPU), ``fsdp2`` (``ModelParallelStrategy``, FSDP2 over every
device), ``ddp`` or ``single``. With LOAD (a checkpoint directory, or ``-``): ``fabric.load`` of model,
optimizer, scheduler and step, saved again at once to ``WORK_DIR/reload-<SAVE>`` (the loaded state in
global form, whatever the strategy), and ``fabric.load_raw`` into a second model, saved to
``WORK_DIR/raw-<SAVE>``. Then one training step and ``fabric.save`` to ``WORK_DIR/<SAVE>``.
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
from torch import nn

from ckpt_integration.lightning import DistCkptFabricFSDPStrategy, DistCkptIO


def _fsdp2(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _strategy(name: str, devices: int):
    if name == "fsdp1":
        return DistCkptFabricFSDPStrategy()
    if name == "fsdp2":
        from lightning.fabric.strategies import ModelParallelStrategy

        return ModelParallelStrategy(parallelize_fn=_fsdp2, data_parallel_size=devices, tensor_parallel_size=1)
    return "ddp" if name == "ddp" else "auto"


def _setup(fabric: L.Fabric):
    torch.manual_seed(0)
    with fabric.init_module():
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def main(fabric: L.Fabric, work: str, load: str, save: str) -> None:
    model, opt, sched = _setup(fabric)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "step": 0}
    if load != "-":
        fabric.load(os.path.join(work, load), state)
        # the loaded state, read back in global form through a save of it (whatever the strategy)
        fabric.save(os.path.join(work, f"reload-{save}"), state)
        other, _, _ = _setup(fabric)
        fabric.load_raw(os.path.join(work, load), other)
        fabric.save(os.path.join(work, f"raw-{save}"), {"model": other})
    x = torch.arange(8 * 8, dtype=torch.float32).reshape(8, 8).add(fabric.global_rank + state["step"]) / 64
    fabric.backward(model(x).pow(2).mean())
    opt.step()
    opt.zero_grad()
    sched.step()
    state["step"] += 1
    fabric.save(os.path.join(work, save), state)
    fabric.barrier()


if __name__ == "__main__":
    name, devices, work, load, save = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=_strategy(name, devices), plugins=[DistCkptIO()])
    fabric.launch(main, work, load, save)
