"""``DistCkptModelParallelStrategy``: Lightning's ModelParallelStrategy (DTensor tensor parallelism via
``parallelize_module`` / FSDP2 ``fully_shard`` in ``configure_model``) saving through ``DistCkptIO``.

Real ``Trainer.fit`` in 2 gloo processes (and 4, 1): TP=2 (async save) -> TP=2 (same layout, sync save)
-> FSDP2 with DP=2 -> FSDP2 DP=2 x TP=2 on 4 processes (async) -> one process without any parallelism. Tolerances: same layout -> next-step
losses equal the uninterrupted run to 1e-6; another layout -> within 1e-5 (fp32 summation order;
observed <= 2e-7). Loaded parameters (and Adam ``exp_avg``) equal the saved tensors exactly.
Plus the optimizer API alone with FSDP2 DTensor params (uneven and empty shards).
"""

import json
import os

import pytest
import torch
from torch import nn

from tests.dist_utils import run_distributed

D_IN, HID, N, GBS = 8, 16, 32, 8  # 4 steps per epoch


def _module_class():
    import lightning as L

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(D_IN)       # not parallelized under TP: replicated plain params
            self.fc1 = nn.Linear(D_IN, HID)    # TP: column-parallel
            self.fc2 = nn.Linear(HID, 1)       # TP: row-parallel; FSDP2: the bias (1 element) is empty on rank 1

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(self.ln(x)))).squeeze(-1)

    class MPModule(L.LightningModule):
        def __init__(self, mode, dump=None, scheduler=True):
            super().__init__()
            torch.manual_seed(0)
            self.net = Net()
            self.mode, self.dump, self.scheduler = mode, dump, scheduler
            self.step_losses = {}

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh = self.device_mesh
            if self.mode in ("tp", "2d"):
                parallelize_module(self.net, mesh["tensor_parallel"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
            if self.mode in ("fsdp", "2d"):  # 2d: TP-sharded params get FSDP2's _StridedShard; ln is on the DP sub-mesh
                fully_shard(self.net.fc1, mesh=mesh["data_parallel"])
                fully_shard(self.net, mesh=mesh["data_parallel"])

        def training_step(self, batch, idx):
            x, y = batch
            loss = ((self.net(x) - y) ** 2).mean()
            dp = self.device_mesh["data_parallel"]
            rec = loss.detach().clone()
            if dp.size() > 1:  # the loss of the global batch (each DP rank has an equal part of it)
                torch.distributed.all_reduce(rec, group=dp.get_group())
                rec /= dp.size()
            self.step_losses[self.global_step] = float(rec)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=2e-2)
            if not self.scheduler:
                return opt
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def on_train_start(self):
            """After the resume: the loaded parameters and Adam ``exp_avg`` as full tensors (collective)."""
            if self.dump is None:
                return
            from torch.distributed.tensor import DTensor

            full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()  # noqa: E731
            opt = self.optimizers().optimizer
            out = {n: full(p) for n, p in self.named_parameters()}
            for n, p in self.named_parameters():
                # every rank has the state, a rank whose FSDP2 shard is empty (fc2 has 1 row) too: empty
                # tensors and its peers' step (before: none, and full_tensor() below waited forever)
                assert sorted(opt.state[p]) == ["exp_avg", "exp_avg_sq", "step"], (n, sorted(opt.state[p]))
                assert int(opt.state[p]["step"]) == self.trainer.global_step, n
                out[f"optimizer.state.exp_avg.{n}"] = full(opt.state[p]["exp_avg"])
            if self.global_rank == 0:
                torch.save(out, self.dump)

    return MPModule


def _fit(rank, world, mode, tp, ckdir, max_epochs, resume, async_save=False, dump=None, scheduler=True):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    import lightning as L

    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint, DistCkptModelParallelStrategy

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(N, D_IN, generator=g), torch.randn(N, generator=g))
    dp = world // tp
    loader = torch.utils.data.DataLoader(ds, batch_size=GBS // dp)  # sampler split by DP rank (Lightning)
    module = _module_class()(mode, dump, scheduler)
    cb = DistCkptModelCheckpoint(dirpath=ckdir, save_top_k=-1, every_n_epochs=1, save_last=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=world,
        strategy=DistCkptModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp),
        plugins=[DistCkptIO(async_save=async_save)], max_epochs=max_epochs, callbacks=[cb],
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, loader, ckpt_path=resume)
    return module.step_losses


def _two_procs(rank, world, tmp):
    out = {}
    # uninterrupted TP=2 run, async checkpoints every epoch
    out["ref"] = _fit(rank, world, "tp", 2, f"{tmp}/ref", 5, None, async_save=True)
    # same layout from the (async) epoch-0 checkpoint, sync saves
    out["same"] = _fit(rank, world, "tp", 2, f"{tmp}/same", 2, f"{tmp}/ref/epoch=0-step=4.ckpt",
                       dump=f"{tmp}/same_loaded.pt")
    # TP=2 -> FSDP2 (DP=2, TP=1) from the (sync) epoch-1 checkpoint of the same-layout run
    out["fsdp"] = _fit(rank, world, "fsdp", 1, f"{tmp}/fsdp", 3, f"{tmp}/same/epoch=1-step=8.ckpt",
                       dump=f"{tmp}/fsdp_loaded.pt")
    if rank == 0:
        json.dump(out, open(f"{tmp}/out2.json", "w"))


def _four_procs(rank, world, tmp):
    # FSDP2 DP=2 (saved with empty shards on rank 1) -> FSDP2 DP=2 x TP=2 on 4 processes, async save
    losses = _fit(rank, world, "2d", 2, f"{tmp}/2d", 4, f"{tmp}/fsdp/epoch=2-step=12.ckpt", async_save=True,
                  dump=f"{tmp}/2d_loaded.pt")
    if rank == 0:
        json.dump({"2d": losses}, open(f"{tmp}/out4.json", "w"))


def _one_proc(rank, world, tmp):
    # 2-D (FSDP2 x TP) -> one process, plain module (no parallelism)
    losses = _fit(rank, world, "plain", 1, f"{tmp}/one", 5, f"{tmp}/2d/epoch=3-step=16.ckpt",
                  dump=f"{tmp}/one_loaded.pt")
    json.dump({"one": losses}, open(f"{tmp}/out1.json", "w"))


def _ints(d):
    return {int(k): v for k, v in d.items()}


def _assert_loaded_equal_saved(dump, ckpt):
    import ckpt_integration as ci

    saved = ci.load_plain_tensors(ckpt)
    loaded = torch.load(dump)
    names = {"net.ln.weight", "net.ln.bias", "net.fc1.weight", "net.fc1.bias", "net.fc2.weight", "net.fc2.bias"}
    assert {k for k in loaded if not k.startswith("optimizer")} == names
    assert {k for k in loaded if k.startswith("optimizer")} == {f"optimizer.state.exp_avg.{n}" for n in names}
    for k, v in loaded.items():
        assert torch.equal(v, saved[k]), k


def _assert_continues(losses, ref, steps, tol):
    """The resumed run's losses are those of the uninterrupted run ``ref`` at ``steps`` (within ``tol``)."""
    assert sorted(losses) == list(steps), sorted(losses)
    for s, v in losses.items():
        assert v == pytest.approx(ref[s], abs=tol), (s, v, ref[s])


@pytest.mark.slow
def test_model_parallel_strategy_resume_across_layouts(tmp_path):
    import ckpt_integration as ci

    tmp = str(tmp_path)
    run_distributed(_two_procs, 2, tmp, timeout=240)
    out = json.load(open(f"{tmp}/out2.json"))
    ref, same, fsdp = _ints(out["ref"]), _ints(out["same"]), _ints(out["fsdp"])
    assert sorted(ref) == list(range(20))
    assert ref[11] < ref[0]  # it trains
    _assert_continues(same, ref, range(4, 8), 1e-6)  # same layout: the uninterrupted run's losses
    _assert_continues(fsdp, ref, range(8, 12), 1e-5)  # TP=2 -> FSDP2 DP=2
    _assert_loaded_equal_saved(f"{tmp}/same_loaded.pt", f"{tmp}/ref/epoch=0-step=4.ckpt")
    _assert_loaded_equal_saved(f"{tmp}/fsdp_loaded.pt", f"{tmp}/same/epoch=1-step=8.ckpt")

    # what is in the checkpoints: whole tensors, keys as in state_dict(), optimizer sharded like them
    meta = ci.load_tensors_metadata(f"{tmp}/fsdp/epoch=2-step=12.ckpt")
    assert tuple(meta["net.fc1.weight"].global_shape) == (HID, D_IN)
    assert tuple(meta["optimizer.state.exp_avg_sq.net.fc2.bias"].global_shape) == (1,)
    content = ci.load_content_metadata(f"{tmp}/fsdp/epoch=2-step=12.ckpt")
    assert content["layout"] == {"tp": 1, "pp": 1, "dp": 2} and content["world_size"] == 2
    assert ci.load_content_metadata(f"{tmp}/ref/last.ckpt")["layout"] == {"tp": 2, "pp": 1, "dp": 1}

    # FSDP2 DP=2 -> FSDP2 DP=2 x TP=2 (4 processes) -> 1 process without parallelism
    run_distributed(_four_procs, 4, tmp, timeout=180)
    _assert_continues(_ints(json.load(open(f"{tmp}/out4.json"))["2d"]), ref, range(12, 16), 1e-5)
    _assert_loaded_equal_saved(f"{tmp}/2d_loaded.pt", f"{tmp}/fsdp/epoch=2-step=12.ckpt")
    assert ci.load_content_metadata(f"{tmp}/2d/epoch=3-step=16.ckpt")["layout"] == {"tp": 2, "pp": 1, "dp": 2}
    run_distributed(_one_proc, 1, tmp, timeout=120)
    _assert_continues(_ints(json.load(open(f"{tmp}/out1.json"))["one"]), ref, range(16, 20), 1e-5)
    _assert_loaded_equal_saved(f"{tmp}/one_loaded.pt", f"{tmp}/2d/epoch=3-step=16.ckpt")


def _fsdp2_optimizer_api(rank, world, tmp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import ckpt_integration as ci
    from ckpt_integration.modules import default_sharded_state_dict
    from ckpt_integration.optimizer import load_optimizer_state, optimizer_sharded_state_dict

    mesh = init_device_mesh("cpu", (world,))

    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))  # 3 rows: uneven 2/1; 1 row: empty on rank 1
        fully_shard(m, mesh=mesh)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    def step(m, opt, seed):
        g = torch.Generator().manual_seed(seed)
        m(torch.randn(5, 4, generator=g)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    m, opt = make()
    for i in range(2):
        step(m, opt, i)
    msd = default_sharded_state_dict(m)
    ci.save({"model": msd, "optimizer": optimizer_sharded_state_dict(opt, msd)}, tmp)
    # a fresh FSDP2 model and optimizer (no state yet) resume from it
    m2, opt2 = make()
    msd2 = default_sharded_state_dict(m2)
    ci.load({"model": msd2}, tmp)
    load_optimizer_state(opt2, msd2, tmp)
    for (n, p), p2 in zip(m.named_parameters(), m2.parameters()):
        assert isinstance(p2, DTensor) and torch.equal(p.full_tensor(), p2.full_tensor()), n
        st, st2 = opt.state[p], opt2.state[p2]
        # a rank whose shard is empty saved nothing of the param, and still gets its state back: empty
        # tensors and the same step as its peers (before: no state, so the ranks' states differed in shape)
        assert sorted(st2) == sorted(st), n
        assert isinstance(st2["exp_avg"], DTensor) and st2["exp_avg"].placements == p2.placements
        assert st2["exp_avg"].to_local().shape == p2.to_local().shape
        assert torch.equal(st["exp_avg_sq"].to_local(), st2["exp_avg_sq"].to_local()), n
        assert torch.equal(st2["step"], st["step"]) and float(st2["step"]) == 2.0
    # torch's own full optimizer state dict (a collective over the states' shards): equal, and no rank
    # left waiting (it hung when the empty shard's rank had no state for that param)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True)
    saved_full, loaded_full = get_optimizer_state_dict(m, opt, options=full), get_optimizer_state_dict(m2, opt2, options=full)
    assert sorted(saved_full["state"]) == sorted(loaded_full["state"])
    for k, s1 in saved_full["state"].items():
        assert sorted(s1) == sorted(loaded_full["state"][k]), k
        assert all(torch.equal(v, loaded_full["state"][k][name]) for name, v in s1.items()), k
    for i in (2, 3):  # training continues identically
        step(m, opt, i)
        step(m2, opt2, i)
    for (n, p), p2 in zip(m.named_parameters(), m2.parameters()):
        assert torch.equal(p.full_tensor(), p2.full_tensor()), n


def _fsdp2_memory_restore(rank, world, tmp):
    """FSDP2 under ``DistCkptModelParallelStrategy`` with memory snapshots: a run that dies at step 4, then
    ``ckpt_path="last"`` restores step 4 from memory and trains on. The restore's optimizer states were plain
    tensors beside DTensor params, and the first step failed ("got mixed torch.Tensor and DTensor")."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    import lightning as L
    from torch.distributed.fsdp import fully_shard

    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint, DistCkptModelParallelStrategy

    started = []

    class Crashing(L.LightningModule):
        def __init__(self, crash_at):
            super().__init__()
            torch.manual_seed(0)
            self.net, self.crash_at = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 1)), crash_at

        def configure_model(self):
            fully_shard(self.net[0], mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, idx):
            if self.global_step == self.crash_at:
                raise RuntimeError("crash")
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def on_train_start(self):
            started.append(self.global_step)

    def fit(crash_at, resume):
        io = DistCkptIO(memory_every_n_train_steps=1, memory_replicas=1, memory_dir=f"{tmp}/shm/node{rank}",
                        memory_job_id="m", memory_ranks_per_node=1)
        t = L.Trainer(accelerator="cpu", devices=world, max_steps=8, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[io], default_root_dir=tmp,
                      strategy=DistCkptModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                      callbacks=[DistCkptModelCheckpoint(dirpath=f"{tmp}/ck", every_n_train_steps=100)])
        data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=torch.Generator().manual_seed(0)))
        try:
            t.fit(Crashing(crash_at), torch.utils.data.DataLoader(data, batch_size=2), ckpt_path=resume)
        except RuntimeError as e:
            assert "crash" in str(e), e
            assert io.memory_tier is None  # (closed at teardown; its snapshots stay, as a killed job leaves them)
        return t

    fit(4, None)
    t = fit(None, "last")
    assert started == [0, 4] and t.global_step == 8, (started, t.global_step)


def test_fsdp2_optimizer_state_roundtrip(tmp_path):
    """optimizer_sharded_state_dict / load_optimizer_state with FSDP2 DTensor params and states; a restore from
    the memory tier under FSDP2 (same processes)."""
    run_distributed(_fsdp2_optimizer_api, 2, str(tmp_path / "c"), timeout=120)
    run_distributed(_fsdp2_memory_restore, 2, str(tmp_path / "m"), timeout=120)


def _no_scheduler(rank, world, tmp):
    first = _fit(rank, world, "plain", 1, f"{tmp}/a", 1, None, scheduler=False)
    # no LR scheduler: Lightning's ``lr_schedulers: []`` must survive the checkpoint for the resume
    resumed = _fit(rank, world, "plain", 1, f"{tmp}/b", 2, f"{tmp}/a/last.ckpt", scheduler=False)
    json.dump({"first": first, "resumed": resumed}, open(f"{tmp}/out.json", "w"))


def test_resume_without_lr_scheduler(tmp_path):
    """One process (mesh 1x1, no parallelism), a module without LR scheduler: save, then resume."""
    tmp = str(tmp_path)
    run_distributed(_no_scheduler, 1, tmp, timeout=120)
    out = json.load(open(f"{tmp}/out.json"))
    assert sorted(_ints(out["first"])) == [0, 1, 2, 3] and sorted(_ints(out["resumed"])) == [4, 5, 6, 7]
