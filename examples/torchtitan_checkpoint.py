"""torchtitan 0.3's ``CheckpointManager`` through ckpt_integration's DCP front door (docs/dcp.md).

2 gloo ranks on CPU, a small FSDP2 model, torchtitan's optimizer and LR-scheduler containers, its
checkpoint configuration (``interval=2``) unchanged; the manager's two DCP calls go through
``ci.dcp.Writer`` / ``ci.dcp.Reader`` (the adapter below). Each mode saves steps 2 and 4, a fresh
manager loads step 4, the model must equal the saved one exactly, and the checkpoint verifies.

torchtitan is not a dependency of this project (its own dependencies: datasets, tensorboard, wandb,
tyro, ...); install it beside it to run this::

    python -m venv --system-site-packages .tt && .tt/bin/pip install -c constraints.txt torchtitan==0.3.0
    .tt/bin/python -m torch.distributed.run --nproc-per-node 2 examples/torchtitan_checkpoint.py /tmp/tt-out

``async_with_pinned_mem`` needs an accelerator (DCP's stager copies with ``non_blocking=True``),
so on CPU only ``disabled`` and ``async`` run; pass ``--pinned`` on a GPU machine to add it.
"""
import os, sys, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
import ckpt_integration as ci
from ckpt_integration.tools import verify_checkpoint
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

class VerifiedCheckpointManager(CheckpointManager):
    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        writer = ci.dcp.Writer(checkpoint_id)
        if async_mode.value == "disabled":
            dcp.save(state_dict, storage_writer=writer)
            return None
        if async_mode.value == "async":
            return dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        return dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg,
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        if from_hf:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        dcp.load(state_dict, storage_reader=ci.dcp.Reader(checkpoint_id))
        if "model" in self.states:
            self.states["model"].load_state_dict(state_dict)

def build(folder, mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    oc = OptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})], implementation="for-loop")
    opts = OptimizersContainer(oc, model_parts=[model])
    scheds = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opts, training_steps=10)
    cfg = CheckpointManager.Config(enable=True, folder=folder, interval=2, async_mode=mode, keep_latest_k=0, last_save_model_only=False)
    cm = VerifiedCheckpointManager(cfg, dataloader=None, model_parts=[model], optimizers=opts, lr_schedulers=scheds, states={}, sd_adapter=None, base_folder=sys.argv[1])
    return model, opts, scheds, cm

def step(model, opts, scheds, s):
    x = torch.arange(64, dtype=torch.float32).reshape(4, 16).add(rank + s) / 64
    model(x).pow(2).mean().backward(); opts.step(); scheds.step(); opts.zero_grad()

def full(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return {k: v.clone() for k, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)).items()}

for mode in ("disabled", "async") + (("async_with_pinned_mem",) if "--pinned" in sys.argv else ()):
    model, opts, scheds, cm = build(f"ckpt-{mode}", mode)
    for s in range(1, 5):
        step(model, opts, scheds, s)
        cm.save(curr_step=s, last_step=(s == 4))
    if mode != "disabled" and cm.save_future is not None:
        cm._wait_for_saving()
    ref = full(model)
    dist.barrier()
    model2, opts2, scheds2, cm2 = build(f"ckpt-{mode}", "disabled")
    assert cm2.load(step=4), "nothing loaded"
    got = full(model2)
    assert all(torch.equal(got[k], ref[k]) for k in ref), mode
    if rank == 0:
        path = os.path.join(sys.argv[1], f"ckpt-{mode}", "step-4")
        print(mode, "files", sorted(os.listdir(path)))
        print(mode, "verify", verify_checkpoint(path).ok, "exact resume OK", flush=True)
    cm.close() if hasattr(cm, "close") else None
dist.barrier()
dist.destroy_process_group()
