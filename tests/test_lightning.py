"""Lightning integration: real Trainer.fit in 1, 2 and 4 gloo processes (batched scenarios).

Every resume is checked exactly: at ``on_train_start`` the resumed run saves what it loaded (in its
own layout) and that checkpoint's tensors (weights, Adam states), scheduler, optimizer param groups
and step equal the source checkpoint's. The next-step losses are compared with the uninterrupted
run as a second, looser check (the reference run is TP1 x DP2: resumed TP2 runs within 1e-5; other
TP/DP/world sizes: 2e-3, fp32 summation order only).
"""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from tests.dist_utils import run_distributed  # noqa: E402

CHARS, BLOCK, GBS = 2000, 32, 8  # 7 steps per epoch


def _trainer(rank, world, tp, ckdir, max_epochs, async_save=False, top_k=2, io=None):
    import lightning as L

    from ckpt_integration.lightning import DistCkptDDPStrategy, DistCkptIO, DistCkptModelCheckpoint

    cb = DistCkptModelCheckpoint(dirpath=ckdir, save_top_k=top_k, monitor="train_loss", save_last=True, every_n_epochs=1)
    return L.Trainer(accelerator="cpu", devices=world, strategy=DistCkptDDPStrategy(tensor_parallel_size=tp),
                     plugins=[io or DistCkptIO(async_save=async_save)], max_epochs=max_epochs, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                     num_sanity_val_steps=0, limit_val_batches=0)


def _dump_loaded(path):
    """A callback saving, right after the resume, what was loaded (a checkpoint in the new layout)."""
    import lightning as L

    class DumpLoaded(L.Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.save_checkpoint(path)
            trainer.strategy.checkpoint_io.maybe_finalize(blocking=True)  # an async save: done now

    return DumpLoaded()


def assert_resumed_exactly(loaded, source):
    """``loaded`` (saved by :func:`_dump_loaded`) holds exactly the state of ``source``."""
    import ckpt_integration as ci

    a, b = ci.load_plain_tensors(loaded), ci.load_plain_tensors(source)
    assert set(a) == set(b) and any(k.startswith("optimizer.state.exp_avg.") for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (k, loaded, source)
    ca, cb = ci.load_common_state_dict(loaded), ci.load_common_state_dict(source)
    for k in ("lr_schedulers", "optimizer", "global_step", "hyper_parameters"):  # not "epoch": +1 once resumed
        assert ca.get(k) == cb.get(k), (k, ca.get(k), cb.get(k))
    assert ca["lr_schedulers"] and ca["optimizer"]["param_groups"]


def _fit(rank, world, tp, ckdir, max_epochs, resume, dump=None, **kw):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    import lightning as L

    import gpt

    L.seed_everything(0, verbose=False)
    m = gpt.GPTModule(vocab_size=gpt.vocab_size(CHARS), corpus_chars=CHARS)
    tr = _trainer(rank, world, tp, ckdir, max_epochs, **kw)
    if dump:
        tr.callbacks.append(_dump_loaded(dump))
    tr.fit(m, gpt.make_dataloader(BLOCK, GBS, world // tp, CHARS), ckpt_path=resume)
    return dict(m.step_losses)


def _complete(d):
    from ckpt_integration.lightning import is_complete_checkpoint

    return sorted(n for n in os.listdir(d) if is_complete_checkpoint(os.path.join(d, n)))


def _phase_2proc(rank, world, tmp):
    out = {}
    out["ref"] = _fit(rank, world, 1, f"{tmp}/ref", 4, None)                     # uninterrupted, TP1 DP2
    out["tp2"] = _fit(rank, world, 2, f"{tmp}/tp2", 2, None, async_save=True)    # TP2 DP1, async
    assert _complete(f"{tmp}/tp2") == ["epoch=0-step=7.ckpt", "epoch=1-step=14.ckpt", "last.ckpt"]
    out["same"] = _fit(rank, world, 2, f"{tmp}/tp2", 3, "last", async_save=True,  # TP2 -> TP2
                       dump=f"{tmp}/loaded/same")
    # top-k keeps exactly k complete directories (+ last), with async save
    out["dirs"] = sorted(os.listdir(f"{tmp}/tp2"))
    out["tp1dp2"] = _fit(rank, world, 1, f"{tmp}/tp1", 4, f"{tmp}/tp2/epoch=1-step=14.ckpt",  # TP2 -> TP1 DP2
                         dump=f"{tmp}/loaded/tp1dp2")
    if rank == 0:
        json.dump(out, open(f"{tmp}/out2.json", "w"))


def _phase_4proc(rank, world, tmp):
    losses = _fit(rank, world, 2, f"{tmp}/w4", 3, f"{tmp}/tp2/epoch=1-step=14.ckpt", async_save=True,  # 2 -> 4
                  dump=f"{tmp}/loaded/w4")
    if rank == 0:
        json.dump(losses, open(f"{tmp}/out4.json", "w"))


@pytest.mark.slow
def test_resume_across_layouts_and_topk(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_phase_2proc, 2, tmp, timeout=400)
    out = json.load(open(f"{tmp}/out2.json"))
    ref = {int(k): v for k, v in out["ref"].items()}
    assert len(ref) == 28
    same = {int(k): v for k, v in out["same"].items()}
    assert sorted(same) == list(range(14, 21))
    # resumed in its own layout (TP2), compared with the uninterrupted run, which is TP1 x DP2: another
    # summation order (2.4e-7 apart here). What it loaded is compared exactly below
    for s, v in same.items():
        assert v == pytest.approx(ref[s], abs=1e-5), (s, v, ref[s])
    tp2 = {int(k): v for k, v in out["tp2"].items()}
    for s in range(14):
        assert tp2[s] == pytest.approx(ref[s], abs=2e-3)
    tp1 = {int(k): v for k, v in out["tp1dp2"].items()}
    assert min(tp1) == 14
    # what each resume loaded is exactly what the checkpoint holds (the epoch-1 checkpoint was
    # "last" before the same-layout run; both are the state at step 14)
    assert_resumed_exactly(f"{tmp}/loaded/same", f"{tmp}/tp2/epoch=1-step=14.ckpt")
    assert_resumed_exactly(f"{tmp}/loaded/tp1dp2", f"{tmp}/tp2/epoch=1-step=14.ckpt")
    for s in range(14, 21):  # TP 2 -> 1, DP 1 -> 2
        assert tp1[s] == pytest.approx(ref[s], abs=2e-3), (s, tp1[s], ref[s])
    # top-k = 2 directories + last.ckpt, all complete, nothing left behind
    assert len([d for d in out["dirs"] if d.startswith("epoch=")]) == 2 and "last.ckpt" in out["dirs"]
    assert not [d for d in out["dirs"] if ".tmp-" in d]
    assert _complete(f"{tmp}/tp2") == sorted(out["dirs"]) == ["epoch=1-step=14.ckpt", "epoch=2-step=21.ckpt", "last.ckpt"]

    # world size 2 -> 4 (TP2 x DP2), then 4 -> 1, both vs the uninterrupted run
    run_distributed(_phase_4proc, 4, tmp, timeout=400)
    w4 = {int(k): v for k, v in json.load(open(f"{tmp}/out4.json")).items()}
    assert_resumed_exactly(f"{tmp}/loaded/w4", f"{tmp}/tp2/epoch=1-step=14.ckpt")
    for s in range(14, 21):
        assert w4[s] == pytest.approx(ref[s], abs=2e-3), (s, w4[s], ref[s])
    run_distributed(_phase_1proc_last, 1, tmp, timeout=400)
    w1 = {int(k): v for k, v in json.load(open(f"{tmp}/out1.json")).items()}
    assert sorted(w1) == list(range(21, 28))
    assert_resumed_exactly(f"{tmp}/loaded/w1", f"{tmp}/w4/epoch=2-step=21.ckpt")
    for s in range(21, 28):  # world size 4 -> 1
        assert w1[s] == pytest.approx(ref[s], abs=2e-3), (s, w1[s], ref[s])


def _phase_1proc_last(rank, world, tmp):
    losses = _fit(rank, world, 1, f"{tmp}/w4", 4, "last", dump=f"{tmp}/loaded/w1")  # 4 -> 1 via ckpt_path="last"
    json.dump(losses, open(f"{tmp}/out1.json", "w"))


def _single_process_scenarios(rank, world, tmp):
    import lightning as L

    import ckpt_integration as ci
    from ckpt_integration.lightning import DistCkptIO, latest_complete_checkpoint

    # 1) sync run, then a save "killed halfway": the writer raises -> previous checkpoints stay loadable
    _fit(rank, world, 1, f"{tmp}/a", 2, None)
    before = _complete(f"{tmp}/a")

    def broken(state, path, queue, kwargs):
        raise RuntimeError("simulated crash while writing")

    io = DistCkptIO(async_save=True)
    io.save_fn = broken
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(rank, world, 1, f"{tmp}/a", 3, "last", io=io)
    assert _complete(f"{tmp}/a") == before
    # last.ckpt is still exactly the state of the end of epoch 1
    kept, epoch1 = ci.load_plain_tensors(f"{tmp}/a/last.ckpt"), ci.load_plain_tensors(f"{tmp}/a/epoch=1-step=14.ckpt")
    assert set(kept) == set(epoch1) and all(torch.equal(kept[k], epoch1[k]) for k in kept)
    assert ci.load_common_state_dict(f"{tmp}/a/last.ckpt")["lr_schedulers"][0]["last_epoch"] == 14
    # 2) an incomplete last.ckpt (no metadata.json) is never chosen by ckpt_path="last"
    os.remove(f"{tmp}/a/last.ckpt/metadata.json")
    newest = latest_complete_checkpoint(f"{tmp}/a")
    assert newest.endswith("epoch=1-step=14.ckpt")
    losses = _fit(rank, world, 1, f"{tmp}/a", 3, "last")
    assert min(losses) == 14  # resumed from epoch=1-step=14, not from scratch
    # an explicitly given incomplete checkpoint is refused with a clear error
    os.makedirs(f"{tmp}/a/partial.ckpt")
    open(f"{tmp}/a/partial.ckpt/__0_0.distcp", "w").close()
    with pytest.raises(ci.IncompleteCheckpointError, match="not a complete checkpoint"):
        _fit(rank, world, 1, f"{tmp}/a", 4, f"{tmp}/a/partial.ckpt")
    L.seed_everything(0)


@pytest.mark.slow
def test_crash_and_incomplete_checkpoints(tmp_path):
    run_distributed(_single_process_scenarios, 1, str(tmp_path), timeout=300)


def test_plugin_arguments_and_foreign_checkpoint_io(tmp_path):
    """Which strategies the plugin accepts is tested per strategy name in test_lightning_plugin.py."""
    import lightning as L
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from ckpt_integration.lightning import DistCkptIO, DistCkptSingleDeviceStrategy

    kw = dict(accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=str(tmp_path))
    # a DistCkpt strategy with another CheckpointIO
    t = L.Trainer(devices=1, strategy=DistCkptSingleDeviceStrategy(), plugins=[TorchCheckpointIO()], **kw)
    with pytest.raises(TypeError, match="needs plugins=\\[DistCkptIO"):
        t.strategy.checkpoint_io
    with pytest.raises(ValueError, match="load_strategy"):
        DistCkptIO(load_strategy="nope")
    with pytest.raises(ValueError, match="backend"):
        DistCkptIO(backend="nope")


def test_single_device_plugin_only_roundtrip(tmp_path):
    """``DistCkptSingleDeviceStrategy`` + ``DistCkptIO`` on one device, no torch.distributed: save, resume, reload."""
    import lightning as L

    import ckpt_integration as ci
    import gpt
    from ckpt_integration.lightning import DistCkptIO, DistCkptSingleDeviceStrategy

    def run(epochs, ckpt):
        L.seed_everything(0, verbose=False)
        m = gpt.GPTModule(vocab_size=gpt.vocab_size(CHARS), corpus_chars=CHARS, n_layers=1)
        t = L.Trainer(accelerator="cpu", devices=1, strategy=DistCkptSingleDeviceStrategy(), plugins=[DistCkptIO()], max_epochs=epochs, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                      limit_train_batches=3)
        t.fit(m, gpt.make_dataloader(BLOCK, GBS, 1, CHARS), ckpt_path=ckpt)
        return m, t

    m, t = run(1, None)
    path = t.checkpoint_callback.best_model_path
    assert os.path.isdir(path) and os.path.isfile(os.path.join(path, "metadata.json"))
    meta = ci.load_tensors_metadata(path)
    assert "model.blocks.0.qkv.weight.part0" in meta and "optimizer.state.exp_avg.model.head.weight" in meta
    m2, t2 = run(2, path)
    assert min(dict(m2.step_losses)) == 3
    assert t2.global_step == 6
    # the module's final weights are exactly those of the checkpoint saved at the end of the run
    final = ci.load_plain_tensors(t2.checkpoint_callback.best_model_path)
    params = dict(m2.named_parameters())
    assert params["model.tok.weight"].shape == (gpt.vocab_size(CHARS), 32)
    compared = [n for n in params if n in final]
    assert len(compared) >= len(params) - 2  # the fused qkv is saved as parts
    for n in compared:
        assert torch.equal(params[n].detach(), final[n]), n
