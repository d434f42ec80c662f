"""Device (CUDA) tensors through the paths test_cuda.py does not take: the memory tier (snapshot,
restore, resharded restore, persist), incremental saves, the zarr backend (where zarr >= 3 is installed), damaged files under
every load strategy, and a Lightning run on a GPU that resumes from an async save and from memory.

Skipped where no GPU is present (CI has none); run on a GPU machine with
``python -m pytest -q tests/test_cuda_paths.py``. ``CKPT_TEST_DEVICE=cpu`` runs the same tests on
CPU tensors (how they were written and checked without a GPU). Everything is compared exactly.
"""

from __future__ import annotations

import os

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration import ShardedTensor
from tests.dist_utils import run_distributed
from tests.layouts import global_tensor

DEVICE = "cuda" if torch.cuda.is_available() else os.environ.get("CKPT_TEST_DEVICE")
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA device (CKPT_TEST_DEVICE=cpu: the same on CPU)")

SHAPE = (64, 48)


def _rows(rank, world, key="w", dtype=torch.float32, add=0.0):
    full = global_tensor(key, SHAPE, dtype) + add
    n = SHAPE[0] // world
    return ShardedTensor.from_rank_offsets(key, full[rank * n:(rank + 1) * n].clone().to(DEVICE), (0, rank, world))


def _cols_request(rank, world, key="w", dtype=torch.float32):
    n = SHAPE[1] // world
    return ShardedTensor.from_rank_offsets(key, torch.zeros(SHAPE[0], n, dtype=dtype, device=DEVICE), (1, rank, world))


def _state(rank, world, add=0.0):
    return {"w": _rows(rank, world, "w", torch.float32, add), "h": _rows(rank, world, "h", torch.bfloat16, add),
            "rep": ShardedTensor.from_rank_offsets("rep", torch.full((5,), 3.0 + add, device=DEVICE), replica_id=rank),
            "step": int(add)}


def _expect_cols(out, rank, world, add=0.0):
    n = SHAPE[1] // world
    for key, dtype in (("w", torch.float32), ("h", torch.bfloat16)):
        got = out[key]
        assert got.device.type == DEVICE and got.dtype == dtype, (key, got.device, got.dtype)
        want = (global_tensor(key, SHAPE, dtype) + add)[:, rank * n:(rank + 1) * n]
        assert torch.equal(got.cpu(), want), key


def _memory_tier(rank, world, root):
    """Snapshots of device state in host memory: restore, restore by columns, persist, damage."""
    tier = ci.MemoryCheckpoints(f"{root}/shm/node{rank}", "gpu-job", replicas=2, ranks_per_node=1)
    try:
        for step in (1, 2, 3):
            tier.save(_state(rank, world, float(step)), step)
        tier.wait()
        assert tier.latest() == 3
        same = {k: v for k, v in _state(rank, world, 0.0).items() if k != "step"}
        for v in same.values():
            v.data.zero_()
        out = tier.load({**same, "step": None}, 3)
        assert out["step"] == 3 and tier.last_restore.source == "own memory"
        for key in ("w", "h"):
            assert out[key].device.type == DEVICE
            assert torch.equal(out[key].cpu(), _rows(rank, world, key, out[key].dtype, 3.0).data.cpu()), key
        assert torch.equal(out["rep"].cpu(), torch.full((5,), 6.0))
        # another layout, straight from memory
        cols = {"w": _cols_request(rank, world), "h": _cols_request(rank, world, "h", torch.bfloat16)}
        _expect_cols(tier.load(cols, 3), rank, world, 3.0)
        tier.persist(3, f"{root}/durable").wait()
    finally:
        tier.close(remove=True)
    cols = {"w": _cols_request(rank, world), "h": _cols_request(rank, world, "h", torch.bfloat16), "step": None}
    out = ci.load(cols, f"{root}/durable")
    _expect_cols(out, rank, world, 3.0)
    assert out["step"] == 3


def test_memory_tier_snapshots_restores_and_persists_device_state(tmp_path):
    run_distributed(_memory_tier, 2, str(tmp_path), timeout=240)


def _load_by_columns(rank, world, d, add_w, add_h):
    n = SHAPE[1] // world
    for strategy in ("auto", "local", "fully_parallel"):
        req = {"w": _cols_request(rank, world), "h": _cols_request(rank, world, "h", torch.bfloat16)}
        out = ci.load(req, d, load_strategy=strategy)
        want_w = (global_tensor("w", SHAPE) + add_w)[:, rank * n:(rank + 1) * n]
        want_h = (global_tensor("h", SHAPE, torch.bfloat16) + add_h)[:, rank * n:(rank + 1) * n]
        assert out["w"].device.type == DEVICE and torch.equal(out["w"].cpu(), want_w), (d, strategy)
        assert out["h"].device.type == DEVICE and torch.equal(out["h"].cpu(), want_h), (d, strategy)


def _incremental(rank, world, root):
    frozen = _rows(rank, world, "w")
    for step in (1, 2):
        sd = {"w": frozen, "h": _rows(rank, world, "h", torch.bfloat16, float(step)), "step": step}
        ci.save(sd, f"{root}/s{step}", base=f"{root}/s1" if step == 2 else None)
    _load_by_columns(rank, world, f"{root}/s2", 0.0, 2.0)


def test_incremental_save_of_device_tensors(tmp_path):
    run_distributed(_incremental, 2, str(tmp_path), timeout=240)


def _zarr(rank, world, root):
    ci.save(_state(rank, world, 5.0), f"{root}/zarr", sharded_strategy="zarr")
    _load_by_columns(rank, world, f"{root}/zarr", 5.0, 5.0)


def test_zarr_backend_with_device_tensors(tmp_path):
    zarr = pytest.importorskip("zarr")
    if int(zarr.__version__.split(".")[0]) < 3:
        pytest.skip("the zarr backend needs zarr-python >= 3")
    run_distributed(_zarr, 2, str(tmp_path), timeout=240)


def _damaged(rank, world, root):
    import torch.distributed as tdist

    d = f"{root}/c"
    ci.save(_state(rank, world, 1.0), d)
    tdist.barrier()
    if rank == 0:  # flip one byte inside the first data file's tensor bytes
        data = sorted(f for f in os.listdir(d) if f.endswith(".distcp"))[0]
        with open(os.path.join(d, data), "r+b") as f:
            f.seek(os.path.getsize(os.path.join(d, data)) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x40]))
    tdist.barrier()
    for strategy in ("auto", "read_once", "local", "fully_parallel", "two_stage"):
        req = {"w": _cols_request(rank, world), "h": _cols_request(rank, world, "h", torch.bfloat16)}
        with pytest.raises(ci.CheckpointingException) as info:
            ci.load(req, d, load_strategy=strategy)
        assert isinstance(info.value, (ci.errors.CorruptCheckpointError, ci.errors.DistributedCheckpointingError)), (
            strategy, repr(info.value))
        assert ".distcp" in str(info.value) or "rank" in str(info.value), (strategy, str(info.value))


def test_a_damaged_file_fails_every_strategy_into_device_tensors(tmp_path):
    run_distributed(_damaged, 2, str(tmp_path), timeout=240)


class _Crash(Exception):
    pass


def test_lightning_on_a_device_resumes_from_an_async_save_and_from_memory(tmp_path):
    """Lightning on one device: async saves (every 3 steps) and memory snapshots (every step) of the
    device state; after a crash at step 5, a restore from memory (newer than any durable checkpoint)
    and a resume from the durable step-3 checkpoint give back exactly what the run had at those steps."""
    from lightning.pytorch.callbacks import Callback

    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint, DistCkptSingleDeviceStrategy
    from tests.lightning_helpers import TinyModule, assert_same, loader, snapshot, trainer

    seen = {}

    class Record(Callback):
        def __init__(self, name):
            self.name = name

        def on_train_start(self, trainer, pl_module):
            assert all(p.device.type == DEVICE for p in pl_module.parameters())
            seen[self.name + "@start"] = snapshot(pl_module)

        def on_train_batch_end(self, trainer, pl_module, *args):
            seen[f"{self.name}@{trainer.global_step}"] = snapshot(pl_module)
            if self.name == "first" and trainer.global_step == 5:  # a crash: memory keeps step 5
                trainer.strategy.checkpoint_io.memory_tier.wait()
                raise _Crash()

    def run(name, max_steps, ckpt_path=None):
        device = torch.device(DEVICE, 0) if DEVICE == "cuda" else torch.device("cpu")
        io = DistCkptIO(async_save=True, memory_every_n_train_steps=1, memory_dir=str(tmp_path / "shm"),
                        memory_job_id="gpu-lit", memory_replicas=1)
        t = trainer(accelerator="gpu" if DEVICE == "cuda" else "cpu", devices=1, max_steps=max_steps,
                    strategy=DistCkptSingleDeviceStrategy(device=device), plugins=[io],
                    callbacks=[Record(name), DistCkptModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=3,
                                                                     save_top_k=-1)])
        t.fit(TinyModule(), loader(), ckpt_path=ckpt_path)
        return t

    with pytest.raises(_Crash):
        run("first", 8)
    run("memory", 6, ckpt_path="last")  # memory holds step 5, the newest durable checkpoint is step 3
    assert seen["memory@start"]["global_step"] == 5
    assert_same(seen["memory@start"], seen["first@5"], "restore from memory")
    durable = [f for f in os.listdir(tmp_path / "ck") if "step=3" in f]
    assert len(durable) == 1, os.listdir(tmp_path / "ck")
    run("durable", 4, ckpt_path=str(tmp_path / "ck" / durable[0]))
    assert_same(seen["durable@start"], seen["first@3"], "resume from the async save")


def _optimizer_and_dcp(rank, world, root):
    """Adam state of device parameters, saved row-split and loaded column-split into a fresh optimizer;
    a PyTorch DCP checkpoint of device tensors loaded through ``ci.load``."""
    import torch.distributed.checkpoint as dcp

    from ckpt_integration.optimizer import load_optimizer_state, optimizer_sharded_state_dict

    def model_sd(param, axis):
        return {"w": ShardedTensor.from_rank_offsets("w", param, (axis, rank, world))}

    n = SHAPE[0] // world
    w = torch.nn.Parameter(global_tensor("w", SHAPE)[rank * n:(rank + 1) * n].clone().to(DEVICE))
    opt = torch.optim.Adam([w], lr=0.1)
    for i in range(2):
        w.grad = torch.full_like(w, 0.5 + i)
        opt.step()
    sd = model_sd(w, 0)
    ci.save({"model": sd, "optimizer": optimizer_sharded_state_dict(opt, sd)}, f"{root}/opt")
    full = {}  # the whole tensors, gathered, to compare with
    for name, t in (("w", w.detach()), ("exp_avg", opt.state[w]["exp_avg"]), ("exp_avg_sq", opt.state[w]["exp_avg_sq"])):
        parts = [torch.zeros(t.shape) for _ in range(world)]
        torch.distributed.all_gather(parts, t.detach().cpu())
        full[name] = torch.cat(parts)
    c = SHAPE[1] // world
    w2 = torch.nn.Parameter(torch.zeros(SHAPE[0], c, device=DEVICE))
    opt2 = torch.optim.Adam([w2], lr=0.1)
    sd2 = model_sd(w2, 1)
    ci.load({"model": sd2}, f"{root}/opt")
    load_optimizer_state(opt2, sd2, f"{root}/opt")
    cols = slice(rank * c, (rank + 1) * c)
    assert w2.is_cuda == (DEVICE == "cuda") and torch.equal(w2.detach().cpu(), full["w"][:, cols])
    st = opt2.state[w2]
    for k in ("exp_avg", "exp_avg_sq"):
        assert st[k].device.type == DEVICE and torch.equal(st[k].cpu(), full[k][:, cols]), k
    assert float(st["step"]) == 2.0

    # DCP's own save of device tensors (replicated: plain DCP splits only DTensors), loaded by ours
    # into device tensors of another layout
    rep = global_tensor("r", (16, 8)).to(DEVICE)
    dcp.save({"r": rep}, checkpoint_id=f"{root}/dcp")
    half = torch.zeros(8, 8, device=DEVICE)
    out = ci.load({"r": ShardedTensor.from_global_offsets("r", half, (16, 8), (8 * rank, 0))}, f"{root}/dcp")
    assert out["r"].device.type == DEVICE and torch.equal(half.cpu(), global_tensor("r", (16, 8))[8 * rank:8 * rank + 8])


def test_optimizer_state_and_a_dcp_checkpoint_of_device_tensors(tmp_path):
    run_distributed(_optimizer_and_dcp, 2, str(tmp_path), timeout=240)
