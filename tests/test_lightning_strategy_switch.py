"""The example's strategy switch on resume carries the optimizer (examples/gpt.py, 2 gloo processes).

``DistCkptDDPStrategy`` with hand-written TP=2 (``Block``: one fused QKV parameter, stored as
``qkv.weight.part0/1/2``) -> ``DistCkptModelParallelStrategy`` with DTensor TP=2 (``DTensorBlock``:
separate q/k/v parameters keyed like the parts) -> back to DDP TP=2, each phase one epoch, as
``python examples/train.py strategy=model_parallel parallel=tp2_dp1 resume=true`` does. Right after
each resume, the optimizer state (Adam moments and ``step`` per part, param groups) and the LR
scheduler equal what the checkpoint holds, exactly (read back in global form through a save of the
loaded state); the losses equal those of the uninterrupted DDP run to fp32 rounding (hand-written
TP and DTensor TP reduce in another order: |diff| <= 1e-5, observed ~1e-7).
"""

import json
import os
import sys

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.lightning_helpers import assert_losses_continue

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HP = dict(d_model=16, n_heads=2, n_layers=1, block_size=16, lr=1e-2, corpus_chars=1200)
GBS = 16  # (1200 - 1) // 16 = 74 windows: 4 steps per epoch


def _module(dump):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import gpt

    class Module(gpt.GPTModule):
        def on_train_start(self):
            """Save the state the run starts from (just loaded) through the library, in global form."""
            if dump is None:
                return
            import ckpt_integration as ci
            from ckpt_integration.lightning.strategy import optimizer_key
            from ckpt_integration.optimizer import optimizer_sharded_state_dict

            msd = self.trainer.strategy._module_sharded_state_dict()
            opt = self.optimizers().optimizer
            sched = self.trainer.lr_scheduler_configs[0].scheduler
            ci.save({"state_dict": msd, optimizer_key(0): optimizer_sharded_state_dict(opt, msd),
                     "lr_schedulers": [sched.state_dict()]}, dump)

    return Module(vocab_size=gpt.vocab_size(HP["corpus_chars"]), **HP), gpt


def _fit(rank, world, kind, ckdir, max_epochs, resume=None, dump=None):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    import lightning as L

    from ckpt_integration.lightning import (DistCkptDDPStrategy, DistCkptIO, DistCkptModelCheckpoint,
                                            DistCkptModelParallelStrategy)

    L.seed_everything(0, verbose=False)
    module, gpt = _module(dump)
    strategy = (DistCkptModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2) if kind == "mp"
                else DistCkptDDPStrategy(tensor_parallel_size=2))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, plugins=[DistCkptIO()], max_epochs=max_epochs,
        callbacks=[DistCkptModelCheckpoint(dirpath=ckdir, save_top_k=-1, every_n_epochs=1, save_last=True)],
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, gpt.make_dataloader(HP["block_size"], GBS, 1, HP["corpus_chars"]), ckpt_path=resume)
    return dict(module.step_losses)


def _switch(rank, world, tmp):
    out = {"ref": _fit(rank, world, "ddp", f"{tmp}/ref", 3)}
    out["ddp"] = _fit(rank, world, "ddp", f"{tmp}/a", 1)
    out["mp"] = _fit(rank, world, "mp", f"{tmp}/b", 2, f"{tmp}/a/last.ckpt", dump=f"{tmp}/b_loaded")
    out["back"] = _fit(rank, world, "ddp", f"{tmp}/c", 3, f"{tmp}/b/last.ckpt", dump=f"{tmp}/c_loaded")
    if rank == 0:
        json.dump(out, open(f"{tmp}/out.json", "w"))


def _objects(path):
    """Every ShardedObject of the checkpoint (one process): ``{unique key: value}``."""
    import ckpt_integration as ci
    from ckpt_integration import ShardedObject

    meta = ci.load_sharded_metadata(path)
    req = {k: ShardedObject(v.key, None, v.global_shape, v.global_offset, 0)
           for k, v in meta.items() if isinstance(v, ShardedObject) and v.key.startswith("optimizer")}
    loaded = ci.load(req, path)  # (with the common state)
    return {k: loaded[k] for k in req}


def _assert_loaded_equals_saved(dump, ckpt):
    import ckpt_integration as ci

    saved, loaded = ci.load_plain_tensors(ckpt), ci.load_plain_tensors(dump)
    opt_keys = {k for k in saved if k.startswith("optimizer.")}
    assert opt_keys == {k for k in loaded if k.startswith("optimizer.")}
    assert "optimizer.state.exp_avg_sq.model.blocks.0.qkv.weight.part1" in opt_keys, sorted(opt_keys)
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k
    steps_saved, steps_loaded = _objects(ckpt), _objects(dump)
    assert steps_saved.keys() == steps_loaded.keys() and any(".qkv.weight.part2/" in k for k in steps_saved)
    for k, v in steps_saved.items():
        assert torch.equal(v, steps_loaded[k]), k
    cs, cl = ci.load_common_state_dict(ckpt), ci.load_common_state_dict(dump)
    assert cs["optimizer"]["param_groups"] == cl["optimizer"]["param_groups"]  # "params" is never saved
    assert cs["lr_schedulers"] == cl["lr_schedulers"]


@pytest.mark.slow
def test_ddp_to_model_parallel_and_back_carries_optimizer(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_switch, 2, tmp, timeout=300)
    out = json.load(open(f"{tmp}/out.json"))
    ref = out["ref"]
    assert sorted(int(k) for k in ref) == list(range(12)) and ref["11"] < ref["0"] - 0.3  # it trains
    assert_losses_continue(out["ddp"], ref, range(4))
    assert_losses_continue(out["mp"], ref, range(4, 8))    # DDP (fused QKV) -> FSDP2/TP (separate q/k/v)
    assert_losses_continue(out["back"], ref, range(8, 12))  # and back
    _assert_loaded_equals_saved(f"{tmp}/b_loaded", f"{tmp}/a/last.ckpt")
    _assert_loaded_equals_saved(f"{tmp}/c_loaded", f"{tmp}/b/last.ckpt")
