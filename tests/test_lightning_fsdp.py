"""FSDP1 (Lightning's ``FSDPStrategy``) under ``DistCkptIO``, and resume across DDP, FSDP1, FSDP2 and one device.

Real ``Trainer.fit`` (AdamW + StepLR) in 2 gloo processes, one epoch (4 steps) per phase, each phase
resuming from the previous one's ``last.ckpt`` under another strategy:

DDP -> FSDP1 (``DistCkptStrategyMixin`` + ``FSDPStrategy``, ``use_orig_params=True``, auto-wrap per
Linear) -> FSDP1 (``DistCkptFSDPStrategy``, ``use_orig_params=False``, one flat parameter) -> FSDP2
(``ModelParallelStrategy``) -> FSDP1 (mixin, ``use_orig_params=False``, auto-wrap) -> DDP; then in one
process: FSDP1 with world size 1 from the 2-rank FSDP1 checkpoint -> one device (``"auto"`` + plugin).

Lightning refuses FSDP on CPU unless the strategy is a subclass of ``FSDPStrategy``, and torch's FSDP1
needs ``device_id=torch.device("cpu")`` there, which Lightning does not pass: ``CPUFSDP`` is the mixin
on ``FSDPStrategy`` with that one change (``DistCkptFSDPStrategy`` does it itself on CPU). The plain
``strategy="fsdp"`` string needs a GPU (not run here).

Right after each resume the state the run starts from (every model tensor, Adam moments and ``step``,
param groups, LR scheduler) equals what the checkpoint holds, exactly (read back in global form through
a save of the loaded state); the losses equal the uninterrupted DDP run to fp32 rounding (another
reduction order: |diff| <= 1e-5; one process sums the global batch at once).
"""

import json
import os

import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn

from ckpt_integration.lightning import DistCkptStrategyMixin
from tests.dist_utils import run_distributed
from tests.lightning_helpers import assert_losses_continue

D_IN, HID, N, GBS = 8, 16, 64, 16  # 4 steps per epoch


class CPUFSDP(DistCkptStrategyMixin, FSDPStrategy):
    """A user's own FSDP strategy combined with the plugin through the mixin; on CPU."""

    def _setup_model(self, model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), sharding_strategy=self.sharding_strategy,
                                        **self.kwargs)


def _module_class():
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self, mode, dump=None):
            super().__init__()
            torch.manual_seed(0)
            # the last bias has 1 element: FSDP1 / FSDP2 leave rank 1's shard of it empty
            self.net = nn.Sequential(nn.Linear(D_IN, HID), nn.ReLU(), nn.LayerNorm(HID), nn.Linear(HID, HID),
                                     nn.ReLU(), nn.Linear(HID, 1))
            self.register_buffer("seen", torch.zeros(2))
            self.mode, self.dump = mode, dump
            self.step_losses = {}

        def configure_model(self):
            if self.mode == "fsdp2" and self.device_mesh["data_parallel"].size() > 1:
                from torch.distributed.fsdp import fully_shard

                for i in (0, 3, 5):
                    fully_shard(self.net[i], mesh=self.device_mesh["data_parallel"])
                fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, idx):
            x, y = batch
            loss = ((self.net(x).squeeze(-1) - y) ** 2).mean()
            rec = loss.detach().clone()
            if torch.distributed.is_initialized() and self.trainer.world_size > 1:
                torch.distributed.all_reduce(rec)
                rec /= self.trainer.world_size
            self.step_losses[self.global_step] = float(rec)
            with torch.no_grad():
                self.seen += 1
            return loss

        def configure_optimizers(self):
            params = self.trainer.model.parameters() if self.mode == "fsdp1_flat" else self.parameters()
            opt = torch.optim.AdamW(params, lr=2e-2, weight_decay=0.05)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def on_train_start(self):
            """Save the state this run starts from (just loaded) through the library, in global form."""
            if self.dump is None:
                return
            import ckpt_integration as ci
            from ckpt_integration.lightning.strategy import optimizer_key

            strategy = self.trainer.strategy
            msd = strategy._module_sharded_state_dict()
            opt = self.optimizers().optimizer
            ci.save({"state_dict": msd, optimizer_key(0): strategy._optimizer_sharded_state_dict(opt, msd, "optimizer"),
                     "lr_schedulers": [self.trainer.lr_scheduler_configs[0].scheduler.state_dict()]}, self.dump)

    return Module


def _strategy(kind, world):
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from ckpt_integration.lightning import DistCkptDDPStrategy, DistCkptFSDPStrategy, DistCkptModelParallelStrategy

    if kind == "ddp":
        return DistCkptDDPStrategy()
    if kind == "fsdp1_mixin":
        return CPUFSDP(auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    if kind == "fsdp1_flat":  # one flat parameter for the whole model, optimizer over it
        return DistCkptFSDPStrategy(use_orig_params=False)
    if kind == "fsdp1_mixin_flat":
        return CPUFSDP(auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=False)
    if kind == "fsdp2":
        return DistCkptModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    return "auto"  # one device: Lightning's choice, the plugin alone


def _fit(rank, world, kind, ckdir, max_epochs, resume=None, dump=None):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    import lightning as L

    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(N, D_IN, generator=g), torch.randn(N, generator=g))
    # split by rank by Lightning's DistributedSampler (it shuffles, seed 0, set_epoch each epoch); one device
    # gets no sampler from Lightning: the same one, so that every run sees the same global batches
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=1, rank=0, seed=0) if kind == "one" else None
    loader = torch.utils.data.DataLoader(ds, batch_size=GBS // world, sampler=sampler)
    mode = "fsdp1_flat" if kind.endswith("flat") else kind
    module = _module_class()(mode, dump)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=_strategy(kind, world), plugins=[DistCkptIO()],
        max_epochs=max_epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[DistCkptModelCheckpoint(dirpath=ckdir, save_top_k=-1, every_n_epochs=1, save_last=True)],
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(module, loader, ckpt_path=resume)
    if kind.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel

        assert isinstance(trainer.strategy.model, FullyShardedDataParallel)
    return module.step_losses


CHAIN = [("ddp", None), ("fsdp1_mixin", "p0"), ("fsdp1_flat", "p1"), ("fsdp2", "p2"), ("fsdp1_mixin_flat", "p3"),
         ("ddp", "p4")]


def _two_procs(rank, world, tmp):
    out = {"ref": _fit(rank, world, "ddp", f"{tmp}/ref", 7)}
    for i, (kind, src) in enumerate(CHAIN):
        resume = None if src is None else f"{tmp}/{src}/last.ckpt"
        out[f"p{i}"] = _fit(rank, world, kind, f"{tmp}/p{i}", i + 1, resume, dump=resume and f"{tmp}/p{i}_loaded")
    if rank == 0:
        json.dump(out, open(f"{tmp}/out2.json", "w"))


def _one_proc(rank, world, tmp):
    out = {"p6": _fit(rank, world, "fsdp1_mixin", f"{tmp}/p6", 6, f"{tmp}/p4/last.ckpt", dump=f"{tmp}/p6_loaded")}
    out["p7"] = _fit(rank, world, "one", f"{tmp}/p7", 7, f"{tmp}/p6/last.ckpt", dump=f"{tmp}/p7_loaded")
    json.dump(out, open(f"{tmp}/out1.json", "w"))


def _objects(path):
    import ckpt_integration as ci
    from ckpt_integration import ShardedObject

    meta = ci.load_sharded_metadata(path)
    req = {k: ShardedObject(v.key, None, v.global_shape, v.global_offset, 0)
           for k, v in meta.items() if isinstance(v, ShardedObject) and v.key.startswith("optimizer")}
    loaded = ci.load(req, path)
    return {k: loaded[k] for k in req}


def _assert_loaded_equals_saved(dump, ckpt):
    import ckpt_integration as ci

    saved, loaded = ci.load_plain_tensors(ckpt), ci.load_plain_tensors(dump)
    keys = {k for k in saved if k.startswith(("optimizer.", "net.", "seen"))}
    assert keys == set(loaded), (sorted(keys ^ set(loaded)), dump)
    assert {"net.5.bias", "optimizer.state.exp_avg_sq.net.5.bias", "optimizer.state.exp_avg.net.3.weight", "seen"} <= keys
    for k in keys:
        assert torch.equal(saved[k], loaded[k]), (k, dump)
    steps_saved, steps_loaded = _objects(ckpt), _objects(dump)
    assert steps_saved.keys() == steps_loaded.keys() and "optimizer.state.step.net.5.bias/shard_0_1" in steps_saved
    for k, v in steps_saved.items():
        assert torch.equal(v, steps_loaded[k]), (k, dump)
    cs, cl = ci.load_common_state_dict(ckpt), ci.load_common_state_dict(dump)
    assert cs["optimizer"]["param_groups"] == cl["optimizer"]["param_groups"]
    assert cs["lr_schedulers"] == cl["lr_schedulers"]


def _assert_continues(losses, ref, epoch):
    assert_losses_continue(losses, ref, range(4 * epoch, 4 * epoch + 4))


@pytest.mark.slow
def test_resume_across_ddp_fsdp1_fsdp2_and_one_device(tmp_path):
    import ckpt_integration as ci

    tmp = str(tmp_path)
    run_distributed(_two_procs, 2, tmp, timeout=400)
    out = json.load(open(f"{tmp}/out2.json"))
    ref = out["ref"]
    assert sorted(int(k) for k in ref) == list(range(28)) and ref["27"] < ref["0"]  # it trains
    for i, (kind, src) in enumerate(CHAIN):
        _assert_continues(out[f"p{i}"], ref, i)
        if src is not None:
            _assert_loaded_equals_saved(f"{tmp}/p{i}_loaded", f"{tmp}/{src}/last.ckpt")
    # an FSDP1 checkpoint: the parameters' names and global shapes, like DDP's
    meta = ci.load_tensors_metadata(f"{tmp}/p2/last.ckpt")
    assert tuple(meta["net.3.weight"].global_shape) == (HID, HID)
    assert tuple(meta["optimizer.state.exp_avg.net.5.bias"].global_shape) == (1,)
    assert ci.load_content_metadata(f"{tmp}/p2/last.ckpt")["layout"] == {"tp": 1, "pp": 1, "dp": 2}

    run_distributed(_one_proc, 1, tmp, timeout=200)
    one = json.load(open(f"{tmp}/out1.json"))
    _assert_loaded_equals_saved(f"{tmp}/p6_loaded", f"{tmp}/p4/last.ckpt")
    _assert_loaded_equals_saved(f"{tmp}/p7_loaded", f"{tmp}/p6/last.ckpt")
    _assert_continues(one["p6"], ref, 5)  # FSDP1 on 2 ranks -> FSDP1 on 1
    _assert_continues(one["p7"], ref, 6)  # -> one device
