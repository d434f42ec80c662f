"""Nothing a training job keeps is lost through the Trainer (one process, no torch.distributed).

``TinyModule`` (tests/lightning_helpers.py) keeps torchmetrics ``persistent(True)`` states, extra state,
a state-dict hook entry, an HF-style ``LambdaLR(functools.partial(...))`` scheduler, empty
hyper-parameters and ``on_save_checkpoint`` additions: a resumed run starts from exactly the state the
saving run ended with. Also: ``strict_loading``, and ``last.ckpt`` being the newest state whatever top-k
decides.
"""

import dataclasses
import os

import pytest
import torch
from torch import nn

from tests.lightning_helpers import TinyModule, assert_same, loader, trainer


def _fit(tmp, name, epochs, ckpt_path=None, strategy=None, module=None, io=None, **kw):
    import lightning as L

    from ckpt_integration.lightning import DistCkptIO

    L.seed_everything(0, verbose=False)
    m = module or TinyModule(dump=f"{tmp}/{name}", options={})
    if strategy is not None:
        kw["strategy"] = strategy
    t = trainer(max_epochs=epochs, limit_train_batches=3, default_root_dir=f"{tmp}/{name}", plugins=[io or DistCkptIO()],
                **kw)
    t.fit(m, loader(), ckpt_path=ckpt_path)
    return m, t


@pytest.mark.parametrize("how", ["plugin", "strategy"])
def test_resume_restores_every_kind_of_state(tmp_path, how):
    from ckpt_integration.lightning import DistCkptSingleDeviceStrategy

    tmp = str(tmp_path)
    strategy = DistCkptSingleDeviceStrategy if how == "strategy" else lambda: None
    _, t = _fit(tmp, "a", 1, strategy=strategy())
    ckpt = t.checkpoint_callback.best_model_path
    m, t2 = _fit(tmp, "b", 2, ckpt_path=ckpt, strategy=strategy())
    end, start = torch.load(f"{tmp}/a.end", weights_only=False), torch.load(f"{tmp}/b.start", weights_only=False)
    assert start["scheduler"]["lr_lambdas"] == [{}] and start["hparams"] == {"options": {}, "lr": 1e-2}
    assert start["metric"][1] == 3 and start["state_dict"]["net.format_version"].item() == 3
    assert_same(end, start)
    assert m.loaded_user == {"empty": {}, "list": [], "nested": [{}], "pair": (1, None), "step": 3}
    assert m.counter.restored_extra == {"calls": 3, "history": [0, 1, 2], "empty": {}, "pair": (3, None)}
    assert t2.global_step == 6


class _Renamed(TinyModule):
    """``net.fc2`` has become ``net.out`` (missing ``net.out.*``, unexpected ``net.fc2.*``)."""

    def __init__(self, strict: bool = True, **kw):
        super().__init__(**kw)
        self.net.out = self.net.fc2
        del self.net.fc2
        self.net.forward = lambda x: self.net.out(torch.relu(self.net.fc1(x))).squeeze(-1)
        self.strict_loading = strict


def test_strict_loading(tmp_path):
    from ckpt_integration.lightning import DistCkptIO
    from ckpt_integration.modules import StateDictMismatchError

    tmp = str(tmp_path)
    m0, t = _fit(tmp, "a", 1)
    ckpt = t.checkpoint_callback.best_model_path
    val = trainer(plugins=[DistCkptIO()], limit_val_batches=1, default_root_dir=f"{tmp}/v")
    with pytest.raises(StateDictMismatchError, match=r"missing key\(s\).*'net.out.bias', 'net.out.weight'.*"
                                                     r"unexpected key\(s\).*'net.fc2.bias', 'net.fc2.weight'"):
        val.validate(_Renamed(options={}), loader(), ckpt_path=ckpt)
    m = _Renamed(strict=False, options={})
    before = m.net.out.weight.detach().clone()
    with pytest.warns(UserWarning, match="not in the checkpoint: \\['net.out.bias', 'net.out.weight'\\]"):
        val.validate(m, loader(), ckpt_path=ckpt)
    assert torch.equal(m.net.out.weight, before)  # kept: not in the checkpoint
    assert torch.equal(m.net.fc1.weight, m0.net.fc1.weight) and m.counter.calls == 3


class _Rising(TinyModule):
    """Monitors a value that only gets worse: after epoch 0 no step makes it into the top 1."""

    def training_step(self, batch, idx):
        self.log("rising", float(self.global_step))
        return super().training_step(batch, idx)


@pytest.mark.parametrize("save_last", [True, "link"])
def test_last_is_the_newest_state_whatever_top_k_says(tmp_path, save_last):
    import ckpt_integration as ci
    from ckpt_integration.lightning import DistCkptModelCheckpoint

    tmp = str(tmp_path)
    cb = DistCkptModelCheckpoint(dirpath=f"{tmp}/ck", monitor="rising", mode="min", save_top_k=1, save_last=save_last)
    _fit(tmp, "a", 3, module=_Rising(options={}), callbacks=[cb])
    assert sorted(os.listdir(f"{tmp}/ck")) == ["epoch=0-step=3.ckpt", "last.ckpt"]
    assert ci.load_common_state_dict(f"{tmp}/ck/last.ckpt")["global_step"] == 9
    m, t = _fit(tmp, "b", 4, ckpt_path="last", module=_Rising(options={}), callbacks=[
        DistCkptModelCheckpoint(dirpath=f"{tmp}/ck", monitor="rising", mode="min", save_top_k=1, save_last=save_last)])
    assert m.counter.history[:1] == [0] and m.counter.calls == 12  # resumed from step 9, not from step 3
    assert ci.load_common_state_dict(f"{tmp}/ck/last.ckpt")["global_step"] == 12


class _Scored(TinyModule):
    """Epoch 1 does not make the top 1 (``last.ckpt`` is written itself), epoch 2 does (it becomes a link)."""

    def training_step(self, batch, idx):
        self.log("score", {0: 1.0, 1: 2.0}.get(self.current_epoch, 0.5))
        return super().training_step(batch, idx)


def test_linking_last_to_an_async_save_keeps_what_it_replaced_until_that_save_commits(tmp_path, monkeypatch):
    """``save_last="link"``: Lightning deleted a ``last.ckpt`` written as a checkpoint itself as soon as
    the link to the new top-k checkpoint was made, while that save was still being written. When the
    save then failed (or the job was killed), the newest state was gone and ``ckpt_path="last"``
    resumed two epochs back."""
    import ckpt_integration as ci
    from ckpt_integration.execution import save as save_mod
    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint

    tmp = str(tmp_path)

    def run(name, ck, epochs, resume=None, module=None):
        cb = DistCkptModelCheckpoint(dirpath=ck, monitor="score", mode="min", save_top_k=1, save_last="link")
        return _fit(tmp, name, epochs, ckpt_path=resume, module=module or _Scored(options={}), callbacks=[cb],
                    io=DistCkptIO(async_save=True))[1]

    run("ok", f"{tmp}/ok", 3)  # the link's save commits: the checkpoint it replaced is removed then
    assert sorted(os.listdir(f"{tmp}/ok")) == ["epoch=2-step=9.ckpt", "last.ckpt"]
    assert os.path.islink(f"{tmp}/ok/last.ckpt") and ci.load_common_state_dict(f"{tmp}/ok/last.ckpt")["global_step"] == 9
    ck = f"{tmp}/ck"
    run("a", ck, 2)
    assert not os.path.islink(f"{ck}/last.ckpt") and ci.load_common_state_dict(f"{ck}/last.ckpt")["global_step"] == 6
    real = save_mod.write_data_files

    def failing(target, *args, **kwargs):
        if "epoch=2" in target.path:
            raise OSError(28, "No space left on device")
        return real(target, *args, **kwargs)

    monkeypatch.setattr(save_mod, "write_data_files", failing)
    with pytest.raises(ci.errors.CheckpointWriteError, match="no space left on device"):
        run("b", ck, 3, resume="last")
    monkeypatch.undo()
    m = _Scored(options={})
    t = run("c", ck, 3, resume="last", module=m)
    assert m.loaded_user["step"] == 6, t.ckpt_path  # the step-6 state, kept aside
    assert os.path.basename(t.ckpt_path).startswith("last.replaced-")
    assert not any(n.startswith("last.replaced-") for n in os.listdir(ck))  # (removed once a newer last committed)


class _Stepped:
    """A Linear(64, 64) module logging ``scores[global_step]`` as "m"; fails at step ``fail_at``."""

    @staticmethod
    def fit(ck, scores, io, ckpt_path=None, fail_at=None, manual=None, callbacks=None, sigterm_at=None, **cb):
        import lightning as L
        from lightning.pytorch.utilities.exceptions import SIGTERMException
        from torch.utils.data import DataLoader, TensorDataset

        from ckpt_integration.lightning import DistCkptModelCheckpoint, DistCkptSingleDeviceStrategy

        class Stepped(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(64, 64)

            def training_step(self, batch, idx):
                if self.global_step == fail_at:
                    raise RuntimeError("crash")
                if self.global_step == sigterm_at:  # (what Lightning raises at the batch after a SIGTERM)
                    raise SIGTERMException(1)
                self.log("m", float(scores[self.global_step]))
                return self.lin(batch[0]).pow(2).mean()

            def on_train_batch_end(self, *args):
                if manual is not None and self.global_step == manual[0]:
                    self.trainer.save_checkpoint(manual[1])

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)

        torch.manual_seed(0)
        t = L.Trainer(accelerator="cpu", max_steps=len(scores), logger=False, enable_progress_bar=False,
                      enable_model_summary=False, strategy=DistCkptSingleDeviceStrategy(checkpoint_io=io),
                      callbacks=callbacks or [DistCkptModelCheckpoint(dirpath=ck, **cb)])
        try:
            t.fit(Stepped(), DataLoader(TensorDataset(torch.randn(4 * len(scores), 64)), batch_size=4),
                  ckpt_path=ckpt_path)
        except RuntimeError as e:
            if fail_at is None or "crash" not in str(e):
                raise
        except SIGTERMException:
            if sigterm_at is None:
                raise
        return t


@pytest.mark.parametrize("async_save", [False, True])
def test_a_run_resumed_from_its_first_checkpoint_keeps_last_and_top_k_true(tmp_path, async_save):
    """``save_last="link"``, crash after the first checkpoint, resume "last". That checkpoint's callback state
    was saved before the link existed, so the resumed run wrote ``last-v1.ckpt`` beside a stale ``last.ckpt``
    (async: the deferred top-k deletion then left ``last.ckpt`` dangling and ``fit`` failed on it); the
    checkpoint "last" picked (a top-k one) was never deleted (Lightning keeps the one a run resumed from);
    and a ``last.replaced-*`` a killed run left stayed for good."""
    import shutil

    import ckpt_integration as ci
    from ckpt_integration.lightning import DistCkptIO

    ck = f"{tmp_path}/ck"
    scores = [5, 3, 8, 9, 1, 7, 2, 6, 4, 0, 9, 8, 7, 6, 5, 4, 3, 2]
    kw = dict(save_top_k=1, monitor="m", mode="min", every_n_train_steps=3, save_last="link")
    _Stepped.fit(ck, scores, DistCkptIO(async_save=async_save), fail_at=5, **kw)
    assert sorted(os.listdir(ck)) == ["epoch=0-step=3.ckpt", "last.ckpt"], sorted(os.listdir(ck))
    shutil.copytree(f"{ck}/epoch=0-step=3.ckpt", f"{ck}/last.replaced-0000abcd.ckpt")  # (as a killed run leaves)
    t = _Stepped.fit(ck, scores, DistCkptIO(async_save=async_save), ckpt_path="last", **kw)
    assert t.global_step == len(scores)
    assert ci.load_common_state_dict(f"{ck}/last.ckpt")["global_step"] == len(scores)
    names = sorted(os.listdir(ck))
    assert len(names) == 2 and "last.ckpt" in names and os.path.islink(f"{ck}/last.ckpt"), names


def test_a_manual_save_to_a_last_link_waits_for_the_save_it_names(tmp_path):
    """``max_in_flight=2``: ``trainer.save_checkpoint(<dirpath>/last.ckpt)`` while ``last.ckpt`` linked to a
    checkpoint still being written failed with ``SaveConflictError`` (the job's own save held the lock)."""
    import ckpt_integration as ci
    from ckpt_integration.lightning import DistCkptIO

    ck = f"{tmp_path}/ck"
    _Stepped.fit(ck, [0.0] * 6, DistCkptIO(async_save=True, max_in_flight=2), manual=(4, f"{ck}/last.ckpt"),
                 save_top_k=-1, every_n_train_steps=3, save_last="link")
    assert os.path.islink(f"{ck}/last.ckpt") and ci.load_common_state_dict(f"{ck}/last.ckpt")["global_step"] == 6


def test_linking_last_waits_for_a_last_ckpt_save_still_in_flight(tmp_path):
    """``max_in_flight=2``, ``save_last="link"``: a step that made no top-k save wrote ``last.ckpt`` itself
    (async). At the next top-k save the link moved that directory aside while its save was writing it
    (``fit`` failed, debris left), or, when that save overwrote ``last.ckpt`` through a staging directory,
    its swap later put the older state over the link: ``last.ckpt`` silently held step 4 of 5."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    import ckpt_integration as ci
    from ckpt_integration.lightning import (DistCkptIO, DistCkptModelCheckpoint, DistCkptSingleDeviceStrategy,
                                           is_complete_checkpoint)

    class Stepped(L.LightningModule):
        def __init__(self, scores):
            super().__init__()
            self.lin, self.scores = nn.Linear(64, 64), scores

        def training_step(self, batch, idx):
            self.log("m", float(self.scores[self.global_step]))
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    # steps 1, 2 and 5 (or 4 and 6 ...) make the top 2; the others write last.ckpt themselves
    for name, scores in [("overwrite", [5, 3, 8, 9, 1]), ("fresh", [5, 3, 8, 1, 9, 2, 7, 4, 6, 0])]:
        ck = f"{tmp_path}/{name}"
        torch.manual_seed(0)
        t = L.Trainer(accelerator="cpu", max_steps=len(scores), logger=False, enable_progress_bar=False,
                      enable_model_summary=False,
                      strategy=DistCkptSingleDeviceStrategy(checkpoint_io=DistCkptIO(async_save=True, max_in_flight=2)),
                      callbacks=[DistCkptModelCheckpoint(dirpath=ck, save_top_k=2, monitor="m", mode="min",
                                                         every_n_train_steps=1, save_last="link")])
        t.fit(Stepped(scores), DataLoader(TensorDataset(torch.randn(4 * len(scores), 64)), batch_size=4))
        last = f"{ck}/last.ckpt"
        assert ci.load_common_state_dict(last)["global_step"] == len(scores), name
        assert not any(n.startswith("last.replaced-") for n in os.listdir(ck)), sorted(os.listdir(ck))
        assert all(is_complete_checkpoint(f"{ck}/{n}") for n in os.listdir(ck)), sorted(os.listdir(ck))
        assert os.path.islink(last) and len(os.listdir(ck)) == 3, sorted(os.listdir(ck))


@pytest.mark.parametrize("async_save", [False, True])
def test_two_checkpoint_callbacks_in_one_directory_keep_their_own_checkpoints(tmp_path, async_save):
    """A "best" and a "latest" callback save at the same step under the same name. Lightning gives
    the second one ``-v1`` when the first's checkpoint exists; an async save still being written did
    not count, so both kept one checkpoint and "latest" later deleted "best"'s."""
    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint, is_complete_checkpoint

    tmp = str(tmp_path)
    best = DistCkptModelCheckpoint(dirpath=f"{tmp}/ck", monitor="rising", mode="min", save_top_k=1)
    latest = DistCkptModelCheckpoint(dirpath=f"{tmp}/ck", save_top_k=1)
    _fit(tmp, "a", 3, module=_Rising(options={}), callbacks=[best, latest], io=DistCkptIO(async_save=async_save))
    assert sorted(os.listdir(f"{tmp}/ck")) == ["epoch=0-step=3.ckpt", "epoch=2-step=9.ckpt"]
    assert best.best_model_path.endswith("epoch=0-step=3.ckpt") and is_complete_checkpoint(best.best_model_path)
    assert latest.best_model_path.endswith("epoch=2-step=9.ckpt") and is_complete_checkpoint(latest.best_model_path)


def test_loading_a_checkpoint_this_job_is_still_saving_waits_for_its_commit(tmp_path, monkeypatch):
    """``trainer.save_checkpoint(p)`` with async saves, then at once ``validate(ckpt_path=p)``: the load
    was refused as an incomplete checkpoint ("the save was interrupted or is still running")."""
    import time

    import ckpt_integration as ci
    from ckpt_integration.execution import save as save_mod
    from ckpt_integration.lightning import DistCkptIO

    tmp = str(tmp_path)
    m, t = _fit(tmp, "a", 1, io=DistCkptIO(async_save=True))
    real = save_mod.write_data_files

    def slow(*args, **kwargs):  # (a bigger model's write: still running when validate starts)
        out = real(*args, **kwargs)
        time.sleep(0.5)
        return out

    monkeypatch.setattr(save_mod, "write_data_files", slow)
    t.save_checkpoint(f"{tmp}/final.ckpt")
    assert not os.path.exists(f"{tmp}/final.ckpt/metadata.json")
    fresh = TinyModule(options={})
    t.validate(fresh, loader(), ckpt_path=f"{tmp}/final.ckpt")
    assert ci.check_is_distributed_checkpoint(f"{tmp}/final.ckpt")
    assert_same(dict(fresh.state_dict()), dict(m.state_dict()))


def test_a_callback_that_replaces_the_state_dict_with_plain_tensors_is_named(tmp_path):
    """Lightning's WeightAveraging puts the averaged model's plain tensors in ``checkpoint["state_dict"]``:
    they were replaced by the live module's weights (lost), then the module's, moved to
    ``current_model_state``, collided with them ("main replicas overlap", naming no cause)."""
    import ckpt_integration as ci
    from lightning.pytorch.callbacks import WeightAveraging

    with pytest.raises(ci.CheckpointingException, match=r"plain tensors.*WeightAveraging"):
        _fit(str(tmp_path), "a", 1, callbacks=[WeightAveraging()])


class _Queue(TinyModule):
    """A MoCo-style queue: a large buffer changed in place in ``training_step`` (before the optimizer step)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.register_buffer("queue", torch.zeros(512, 1024))  # 2 MiB: copied in the background by default

    def training_step(self, batch, idx):
        with torch.no_grad():
            self.queue[self.global_step % 512].add_(1.0)
        return super().training_step(batch, idx)

    def on_save_checkpoint(self, checkpoint):
        super().on_save_checkpoint(checkpoint)
        self.queue_at_save = self.queue.clone()


def test_a_buffer_changed_in_forward_saves_with_snapshot_caller(tmp_path):
    """In the background such a save can fail (the copy would be torn; tests/test_async_snapshot.py, whose
    message names this option); with ``snapshot="caller"`` every epoch saves, holding the buffer
    exactly as it was at the save."""
    import ckpt_integration as ci
    from ckpt_integration.lightning import DistCkptIO

    tmp = str(tmp_path)
    m, t = _fit(tmp, "caller", 2, module=_Queue(options={}), io=DistCkptIO(async_save=True, snapshot="caller"))
    saved = ci.load_plain_tensors(t.checkpoint_callback.best_model_path)
    assert torch.equal(saved["queue"], m.queue_at_save) and m.queue_at_save.sum() == 6 * 1024
    with pytest.raises(ValueError, match="snapshot must be one of"):
        DistCkptIO(snapshot="later")


def test_saving_again_to_a_path_still_being_written_waits_for_that_save(tmp_path):
    """``max_in_flight=2``: a second save to the path of one still writing raised ``SaveConflictError``."""
    import ckpt_integration as ci
    from ckpt_integration.lightning import DistCkptIO

    tmp = str(tmp_path)
    m, t = _fit(tmp, "a", 1, io=DistCkptIO(async_save=True, max_in_flight=2))
    t.save_checkpoint(f"{tmp}/p.ckpt")
    with torch.no_grad():
        m.net.fc1.weight.add_(1.0)
    t.save_checkpoint(f"{tmp}/p.ckpt")
    t.strategy.checkpoint_io.teardown()
    assert torch.equal(ci.load_plain_tensors(f"{tmp}/p.ckpt")["net.fc1.weight"], m.net.fc1.weight)


def test_an_optimizer_that_keeps_no_state_resumes_with_its_param_groups(tmp_path):
    """Plain SGD (no momentum) saves param groups and no per-parameter state: its resume was refused
    (``OptimizerStateNotFoundError``, "pass missing_ok=True", which a Lightning user cannot pass)."""
    import lightning as L

    from ckpt_integration.lightning import DistCkptIO

    class Plain(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def training_step(self, batch, idx):
            if self.global_step == 1:
                self.optimizers().param_groups[0]["lr"] = 0.05  # saved with the groups, restored by the resume
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_start(self):
            self.started = (int(self.global_step), self.optimizers().param_groups[0]["lr"])

    def fit(epochs, ckpt_path=None):
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 4)), batch_size=4)
        t = trainer(max_epochs=epochs, default_root_dir=str(tmp_path), plugins=[DistCkptIO()])
        m = Plain()
        t.fit(m, data, ckpt_path=ckpt_path)
        return m, t

    saved, t = fit(1)
    resumed, _ = fit(2, ckpt_path=t.checkpoint_callback.best_model_path)
    assert resumed.started == (3, 0.05)


def test_default_sharded_state_dict_is_what_state_dict_holds(tmp_path):
    """Hooked children (ShardedModuleMixin) and state_dict semantics side by side, without Lightning."""
    import ckpt_integration as ci
    from ckpt_integration.modules import (ParallelLayout, ShardedModuleMixin, load_module_state_dict,
                                          module_sharded_state_dict)
    from tests.lightning_helpers import Counter, Net

    class Col(ShardedModuleMixin, nn.Module):
        tp_axes = {"weight": 0}

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 2))
            self.inner = Counter()  # children of a hooked module: state_dict semantics too

    def build(seed):
        torch.manual_seed(seed)
        root = nn.Module()
        root.col, root.net, root.counter = Col(), Net(), Counter()
        root.register_buffer("scratch", torch.ones(1), persistent=False)
        root.counter.calls, root.col.inner.calls, root.net.format_version = 5 + seed, 7 + seed, 9 + seed
        return root

    src = build(0)
    sd = module_sharded_state_dict(src, "m.", {"layout": ParallelLayout()})
    assert set(sd) == {"m." + k for k in src.state_dict()} and "m.scratch" not in sd
    assert isinstance(sd["m.col.weight"], ci.ShardedTensor) and sd["m.counter._extra_state"]["calls"] == 5
    ci.save(sd, f"{tmp_path}/c")
    dst = build(1)
    loaded = ci.load(module_sharded_state_dict(dst, "m.", {"layout": ParallelLayout()}), f"{tmp_path}/c")
    assert load_module_state_dict(dst, loaded, "m.") == ([], [])
    assert (dst.counter.calls, dst.col.inner.calls, dst.net.format_version) == (5, 7, 9)
    assert_same(dict(src.state_dict()), dict(dst.state_dict()))


def test_stock_checkpoint_of_fused_module_is_refused_and_checkpoint_dict(tmp_path):
    """A stock ``.ckpt`` holds whole tensors: a module storing fused parts (factories) cannot take it;
    ``load_checkpoint_dict`` reads a directory checkpoint without any module."""
    import sys

    import lightning as L

    from ckpt_integration.errors import UnsupportedCheckpointError
    from ckpt_integration.lightning import DistCkptIO, load_checkpoint_dict

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import gpt

    def fit(root, ckpt=None, **kw):
        L.seed_everything(0, verbose=False)
        m = gpt.GPTModule(vocab_size=gpt.vocab_size(300), corpus_chars=300, n_layers=1, d_model=8, n_heads=2)
        t = trainer(max_epochs=1, limit_train_batches=1, default_root_dir=f"{tmp_path}/{root}", **kw)
        t.fit(m, gpt.make_dataloader(16, 4, 1, 300), ckpt_path=ckpt)
        return t

    stock = fit("stock").checkpoint_callback.best_model_path  # stock Lightning: a .ckpt file
    with pytest.raises(UnsupportedCheckpointError, match="'model.blocks.0.qkv.weight' is described by a ShardedTensorFactory"):
        fit("ours", stock, plugins=[DistCkptIO()])
    ours = fit("ours2", plugins=[DistCkptIO()]).checkpoint_callback.best_model_path
    ckpt = load_checkpoint_dict(ours)
    assert ckpt["global_step"] == 1 and ckpt["hyper_parameters"]["d_model"] == 8
    assert ckpt["state_dict"]["model.blocks.0.qkv.weight.part1"].shape == (8, 8)
    assert not [k for k in ckpt["state_dict"] if k.startswith("optimizer")]


def test_model_weights_named_like_the_optimizer_are_kept_by_the_checkpoint_dict(tmp_path):
    """``load_checkpoint_dict`` and ``DistCkptIO.load_checkpoint`` dropped every tensor whose key began
    with "optimizer" (a submodule ``optimizer_net``, or one named ``optimizer``), not only the optimizer's
    state (``optimizer.state.*``, ``optimizer_1.state.*``)."""
    from ckpt_integration.lightning import DistCkptIO, load_checkpoint_dict
    from ckpt_integration.optimizer import is_optimizer_state_key

    assert is_optimizer_state_key("optimizer.state.exp_avg.net.w") and is_optimizer_state_key("optimizer_2.state.x.y")
    assert not any(map(is_optimizer_state_key, ["optimizer_net.weight", "optimizer.weight", "optimizer_x.state.a",
                                                "optimizer.statex.a", "net.optimizer.state.a"]))

    class WithOptimizerNames(TinyModule):
        def __init__(self) -> None:
            super().__init__()
            self.optimizer_net, self.optimizer = nn.Linear(3, 3), nn.Linear(3, 3)

    m = WithOptimizerNames()
    t = trainer(max_epochs=1, limit_train_batches=1, default_root_dir=str(tmp_path), plugins=[DistCkptIO()])
    t.fit(m, loader())
    path = t.checkpoint_callback.best_model_path
    want = {k: v for k, v in m.state_dict().items()}
    for got in (load_checkpoint_dict(path)["state_dict"], DistCkptIO().load_checkpoint(path)["state_dict"]):
        assert {"optimizer_net.weight", "optimizer.bias"} <= set(got)
        assert all(torch.equal(got[k], want[k]) for k in ("optimizer_net.weight", "optimizer_net.bias", "optimizer.weight"))
        assert not [k for k in got if is_optimizer_state_key(k)]


@pytest.mark.parametrize("key", ["optimizer", "content_metadata", "export_recipe", "rng_states"])
def test_an_addition_under_a_name_the_integration_stores_its_state_under_is_refused(tmp_path, key):
    """``on_save_checkpoint`` additions are saved and read back equal, but one named like the
    integration's own entries was overwritten (``optimizer``, ``rng_states``, ``export_recipe``) or
    replaced on load (``content_metadata``) without a word. Refused now, naming it."""
    from ckpt_integration.errors import CheckpointingException
    from ckpt_integration.lightning import DistCkptIO

    class Adds(TinyModule):
        def on_save_checkpoint(self, checkpoint):
            checkpoint[key] = {"mine": 1}

    t = trainer(max_epochs=1, limit_train_batches=1, default_root_dir=str(tmp_path), plugins=[DistCkptIO()])
    with pytest.raises(CheckpointingException, match=f"checkpoint\\['{key}'\\] .* rename it; nothing was saved"):
        t.fit(Adds(), loader())


def test_incomplete_checkpoints_a_killed_run_left_are_removed_when_fitting_starts(tmp_path):
    """A top-k save killed before its commit left ``epoch=1-step=38.ckpt`` without ``metadata.json``;
    a resumed run that did not save that step again kept it for good. Fitting now starts by removing
    such directories of dead saves (ours, unlocked), also those one directory down where the file
    name has a "/"; anything else in dirpath is left alone."""
    import ckpt_integration as ci
    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint

    ck = tmp_path / "ck"
    # a file name with "/" (a metric like train/loss) puts each checkpoint one directory down
    for dead in (ck / "epoch=1-step=38.ckpt", ck / "epoch=1-train" / "loss=0.5.ckpt"):
        ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(2))}, str(dead))
        (dead / "metadata.json").unlink()  # what a save killed before its commit leaves
    (ck / "notes.ckpt").mkdir()
    (ck / "notes.ckpt" / "mine.txt").write_text("user data")
    cb = DistCkptModelCheckpoint(dirpath=str(ck), save_top_k=1, monitor="train_loss",
                                 filename="{epoch}-train/loss={train_loss:.1f}")
    t = trainer(max_epochs=1, limit_train_batches=1, default_root_dir=str(tmp_path), plugins=[DistCkptIO()], callbacks=[cb])
    t.fit(TinyModule(), loader())
    names = sorted(os.listdir(ck))
    assert "epoch=1-step=38.ckpt" not in names and "notes.ckpt" in names, names
    assert not (ck / "epoch=1-train" / "loss=0.5.ckpt").exists(), sorted(os.listdir(ck / "epoch=1-train"))
    assert (ck / "notes.ckpt" / "mine.txt").read_text() == "user data"


def test_a_deferred_removal_of_a_relative_path_removes_what_was_named(tmp_path, monkeypatch):
    """``DistCkptIO.remove_checkpoint("ckpts/old.ckpt")`` while an async save is in flight is deferred;
    it ran against the working directory of its later moment and deleted another run's checkpoint."""
    import ckpt_integration as ci
    from ckpt_integration.lightning import DistCkptIO

    def state(v):
        return {"w": ci.ShardedTensor.from_rank_offsets("w", torch.full((256, 256), float(v))), "global_step": v}

    for run, v in (("a", 1), ("b", 7)):
        ci.save(state(v), str(tmp_path / run / "ckpts" / "old.ckpt"))
    monkeypatch.chdir(tmp_path / "a")
    io = DistCkptIO(async_save=True)
    io.save_sharded(state(2), "ckpts/new.ckpt")
    io.remove_checkpoint("ckpts/old.ckpt")  # (deferred: a save is in flight)
    monkeypatch.chdir(tmp_path / "b")
    io.maybe_finalize(blocking=True, collective=False)
    io.teardown()
    assert sorted(os.listdir(tmp_path / "a" / "ckpts")) == ["new.ckpt"]
    assert sorted(os.listdir(tmp_path / "b" / "ckpts")) == ["old.ckpt"]


class _Falling(TinyModule):
    """A score that improves every epoch: the top 1 moves each epoch, deleting the one before."""

    def training_step(self, batch, idx):
        self.log("score", 5.0 - self.current_epoch)
        return super().training_step(batch, idx)


def test_a_last_link_left_by_save_last_link_is_replaced_when_resumed_with_save_last_true(tmp_path):
    """A run with ``save_last="link"`` leaves ``last.ckpt -> epoch=1-step=N.ckpt``; resumed with
    ``save_last=True``, the top 1 moved to epoch 2 and deleted the link's target, and the sync save of
    ``last.ckpt`` then met a dangling link: ``fit`` failed (a bare ``FileExistsError`` before, a refusal
    of the link after this session's check). The link is dropped and ``last.ckpt`` written itself; the
    top-k checkpoint it named is never written into."""
    import ckpt_integration as ci
    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint

    ck = tmp_path / "ck"

    def run(epochs, save_last, resume=None):
        cb = DistCkptModelCheckpoint(dirpath=str(ck), monitor="score", mode="min", save_top_k=1, save_last=save_last)
        t = trainer(max_epochs=epochs, limit_train_batches=2, default_root_dir=str(tmp_path), plugins=[DistCkptIO()],
                    callbacks=[cb])
        t.fit(_Falling(options={}), loader(), ckpt_path=resume)
        return t

    run(2, "link")
    assert os.path.islink(ck / "last.ckpt")
    run(3, True, resume="last")
    assert not os.path.islink(ck / "last.ckpt") and sorted(os.listdir(ck)) == ["epoch=2-step=6.ckpt", "last.ckpt"]
    assert ci.load_common_state_dict(str(ck / "last.ckpt"))["global_step"] == 6


def test_memory_persists_use_the_plugins_backend(tmp_path):
    """``DistCkptIO(backend="zarr", memory_persist_every_n=1)``: the memory tier's durable persists were
    written as torch_dist beside zarr checkpoints (the plugin's backend was not passed on)."""
    import json

    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint

    class Small(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def training_step(self, batch, idx):
            return self.lin(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    io = DistCkptIO(backend="zarr", memory_every_n_train_steps=1, memory_persist_every_n=1, memory_replicas=1,
                    memory_dir=str(tmp_path / "shm"))
    t = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, plugins=[io], logger=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=[DistCkptModelCheckpoint(dirpath=str(tmp_path / "ck"))])
    t.fit(Small(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2))
    names = sorted(os.listdir(tmp_path / "ck"))
    assert any(n.startswith("memory-step=") for n in names), names
    for n in names:
        assert json.load(open(tmp_path / "ck" / n / "metadata.json"))["sharded_backend"] == "zarr", n


def test_memory_persists_of_earlier_runs_are_pruned_too(tmp_path):
    """``memory_persist_every_n``: "the two newest kept" held within one run only; each crash and resume
    left its persists for good (8 after three runs of the probe)."""
    from ckpt_integration.lightning import DistCkptIO

    ck = f"{tmp_path}/ck"

    def io():
        return DistCkptIO(memory_every_n_train_steps=2, memory_persist_every_n=1, memory_replicas=1,
                          memory_dir=str(tmp_path / "shm"))

    scores = [0.0] * 16
    _Stepped.fit(ck, scores[:10], io(), fail_at=9, save_top_k=1, monitor="m", save_last=True, every_n_train_steps=4)
    first = sorted(n for n in os.listdir(ck) if n.startswith("memory-step="))
    assert len(first) >= 2, first
    _Stepped.fit(ck, scores, io(), ckpt_path="last", save_top_k=1, monitor="m", save_last=True, every_n_train_steps=4)
    persisted = sorted(n for n in os.listdir(ck) if n.startswith("memory-step="))
    step = lambda n: int(n[len("memory-step="):-len(".ckpt")])  # noqa: E731
    assert len(persisted) == 2 and min(map(step, persisted)) > max(map(step, first)), (first, persisted)


def test_last_resumes_the_full_checkpoint_of_a_step_not_a_weights_only_one(tmp_path):
    """Two callbacks in one directory, one ``save_weights_only=True``, both saving at step 4: "last" picked
    the weights-only checkpoint (committed later) and the resume failed with Lightning's "checkpoint contains
    only the model", though the full checkpoint of that step was there."""
    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint

    ck = f"{tmp_path}/ck"

    def callbacks():
        return [DistCkptModelCheckpoint(dirpath=ck, save_top_k=1, monitor="m", save_last=True, every_n_train_steps=2),
                DistCkptModelCheckpoint(dirpath=ck, save_top_k=-1, every_n_train_steps=2, save_weights_only=True,
                                        filename="weights-{step}")]

    scores = [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]  # (each save the new best of both)
    _Stepped.fit(ck, scores[:6], DistCkptIO(), fail_at=5, callbacks=callbacks())
    assert "weights-step=4.ckpt" in os.listdir(ck), os.listdir(ck)
    t = _Stepped.fit(ck, scores, DistCkptIO(), ckpt_path="last", callbacks=callbacks())
    assert t.global_step == len(scores) and "weights" not in os.path.basename(t.ckpt_path), t.ckpt_path


@pytest.mark.parametrize("save_last", [True, False])
def test_last_follows_a_rollback_not_the_timeline_it_abandoned(tmp_path, save_last):
    """Run 1 trains to step 16; run 2 is resumed from its step-4 checkpoint (a rollback, say past a loss
    spike) and crashes at step 7 after saving step 6. ``ckpt_path="last"`` resumed run 1's step 16 (ordered by
    step first), silently undoing the rollback; stock Lightning (``last.ckpt``) and Megatron-LM (its tracker
    file) both continue the run that ran last. It resumes run 2's step 6 now, then that timeline's newest,
    also once it has saved past step 16."""
    from lightning.pytorch.callbacks import Callback

    from ckpt_integration.checkpoints import ordered_checkpoints
    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint

    ck = f"{tmp_path}/ck"
    scores = [float(s) for s in range(16, 0, -1)] + [0.0] * 8
    started = []

    class Started(Callback):
        def on_train_start(self, trainer, pl_module):
            started.append((trainer.global_step, float(pl_module.lin.weight.sum())))

    def fit(n, ckpt_path=None, fail_at=None):
        cbs = [DistCkptModelCheckpoint(dirpath=ck, save_top_k=-1, every_n_train_steps=2, save_last=save_last), Started()]
        t = _Stepped.fit(ck, scores[:n], DistCkptIO(), ckpt_path=ckpt_path, fail_at=fail_at, callbacks=cbs)
        return started[-1][0], t.ckpt_path

    fit(16)
    four = next(c.path for c in ordered_checkpoints(ck) if c.step == 4)
    fit(16, ckpt_path=four, fail_at=7)
    run2 = [c.path for c in ordered_checkpoints(ck) if c.step == 6][-1]  # (run 1 saved step 6 too)
    step, path = fit(16, ckpt_path="last", fail_at=9)
    assert step == 6 and os.path.samefile(path, run2), (started, path, run2)
    # run 3 saved step 8 and crashed; run 4 continues that timeline and passes run 1's last step
    assert fit(20, ckpt_path="last", fail_at=19)[0] == 8, started
    assert fit(24, ckpt_path="last")[0] == 18, started


def test_last_after_a_rollback_takes_no_full_checkpoint_of_the_timeline_it_left(tmp_path):
    """A rollback whose newest checkpoint is weights-only (a second callback): "last" then looked for a full
    checkpoint of that step among every checkpoint, and resumed run 1's ``epoch=0-step=6.ckpt``, which it had
    just left out as abandoned. It resumes the newest full checkpoint of the rolled-back run's timeline."""
    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint

    ck = f"{tmp_path}/ck"

    def callbacks():
        return [DistCkptModelCheckpoint(dirpath=ck, save_top_k=1, monitor="m", mode="min", every_n_train_steps=2),
                DistCkptModelCheckpoint(dirpath=ck, save_top_k=-1, every_n_train_steps=2, save_weights_only=True,
                                        filename="weights-{step}"),
                DistCkptModelCheckpoint(dirpath=ck, save_top_k=-1, every_n_train_steps=4, filename="full-{step}")]

    run1 = [9, 8, 7, 6, 1, 0.5, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]  # the top-k callback's best: step 6
    run2 = [9, 8, 7, 6, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]  # worse after the rollback: it saves nothing
    _Stepped.fit(ck, run1, DistCkptIO(), callbacks=callbacks())
    _Stepped.fit(ck, run2, DistCkptIO(), ckpt_path=f"{ck}/full-step=4.ckpt", fail_at=7, callbacks=callbacks())
    t = _Stepped.fit(ck, run2, DistCkptIO(), ckpt_path="last", fail_at=9, callbacks=callbacks())
    assert os.path.basename(t.ckpt_path) == "full-step=4.ckpt", t.ckpt_path


def test_last_after_a_rollback_resumes_the_memory_tier_not_the_timeline_left(tmp_path):
    """The memory tier on: run 2 rolls back from step 16 to 4, takes snapshots of steps 5-7 and crashes before
    its first durable save. "last" compared memory's step 7 with the newest durable checkpoint, run 1's step 16
    (no durable checkpoint of run 2 to say a rollback happened), and resumed the abandoned timeline. A durable
    checkpoint of a later step committed before the snapshot's run started is of the timeline it left."""
    from lightning.pytorch.callbacks import Callback

    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint

    ck, started = f"{tmp_path}/ck", []

    class Started(Callback):
        def on_train_start(self, trainer, pl_module):
            started.append(trainer.global_step)

    def fit(n, ckpt_path=None, fail_at=None):
        io = DistCkptIO(memory_every_n_train_steps=1, memory_replicas=1, memory_dir=f"{tmp_path}/shm")
        cbs = [DistCkptModelCheckpoint(dirpath=ck, save_top_k=-1, every_n_train_steps=4, save_last=True), Started()]
        _Stepped.fit(ck, [0.0] * n, io, ckpt_path=ckpt_path, fail_at=fail_at, callbacks=cbs)

    fit(16)
    fit(16, ckpt_path=f"{ck}/epoch=0-step=4.ckpt", fail_at=7)
    fit(20, ckpt_path="last", fail_at=9)
    assert started == [0, 4, 7], started


@pytest.mark.parametrize("layout", ["one", "two_dirs", "nested"])
def test_a_resume_from_memory_keeps_top_k_true(tmp_path, layout):
    """The memory snapshot of a step is taken before ``ModelCheckpoint`` saves that step: restored from it (a tie
    with the durable checkpoint of the step goes to memory), the callback did not know its own step-4 checkpoint,
    which stayed for good beside ``save_top_k=1``'s best. The callbacks' states now come from the checkpoint of
    that step committed last: also of a second callback in another directory (``two_dirs``: read from the first
    callback's directory only, the second kept one checkpoint per resume) and below a file name with "/"."""
    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint

    ck, ck2 = f"{tmp_path}/ck", f"{tmp_path}/ck2"
    scores = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0.5, 0.4, 0.3]

    def fit(ckpt_path=None, fail_at=None):
        io = DistCkptIO(memory_every_n_train_steps=2, memory_replicas=1, memory_dir=f"{tmp_path}/shm")
        kw = dict(save_top_k=1, monitor="m", mode="min")
        cbs = [DistCkptModelCheckpoint(dirpath=ck, every_n_train_steps=2, save_last=layout != "nested",
                                       **({"filename": "g/{step}"} if layout == "nested" else {}), **kw)]
        if layout == "two_dirs":
            cbs.append(DistCkptModelCheckpoint(dirpath=ck2, every_n_train_steps=4, **kw))
        return _Stepped.fit(ck, scores, io, ckpt_path=ckpt_path, fail_at=fail_at, callbacks=cbs)

    fit(fail_at=5)
    fit(ckpt_path="last", fail_at=9)
    t = fit(ckpt_path="last")
    assert t.global_step == len(scores)
    if layout == "nested":
        assert os.listdir(f"{ck}/g") == ["step=12.ckpt"], os.listdir(f"{ck}/g")
    else:
        assert sorted(os.listdir(ck)) == ["epoch=0-step=12.ckpt", "last.ckpt"], os.listdir(ck)
    if layout == "two_dirs":
        assert os.listdir(ck2) == ["epoch=0-step=12.ckpt"], os.listdir(ck2)


def test_memory_persists_of_earlier_runs_are_pruned_when_a_run_makes_fewer_than_two(tmp_path):
    """``memory_persist_every_n=1``: a persist starts at the batch end after its snapshot, so a resumed run that ends
    soon makes one; the earlier runs' persists were pruned only once this run held two, and four stayed for good
    (docs: the two newest are kept). At the end of ``fit`` the newest of them make up the two."""
    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint

    ck = f"{tmp_path}/ck"

    def fit(ckpt_path=None, fail_at=None):
        io = DistCkptIO(memory_every_n_train_steps=2, memory_persist_every_n=1, memory_replicas=1,
                        memory_dir=f"{tmp_path}/shm")
        cbs = [DistCkptModelCheckpoint(dirpath=ck, save_top_k=1, monitor="m", mode="min", every_n_train_steps=4)]
        return _Stepped.fit(ck, [10.0 - i for i in range(20)], io, ckpt_path=ckpt_path, fail_at=fail_at, callbacks=cbs)

    fit(fail_at=17)
    assert len([n for n in os.listdir(ck) if n.startswith("memory-step=")]) >= 3, os.listdir(ck)
    assert fit(ckpt_path="last").global_step == 20
    assert sorted(n for n in os.listdir(ck) if n.startswith("memory-step=")) == ["memory-step=16.ckpt",
                                                                                  "memory-step=18.ckpt"], os.listdir(ck)


@dataclasses.dataclass
class _RunConfig:
    """A user's config object in the checkpoint (hyper-parameters): loads need ``allowed_globals=[_RunConfig]``."""

    lr: float = 0.01


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_resume_with_allowed_globals_in_the_common_state(tmp_path, optimizer):
    """``DistCkptIO(allowed_globals=[cls])`` for a user class the checkpoint holds (``save_hyperparameters`` of a
    config object): every resume failed with UntrustedObjectError naming the class, as the optimizers' loads
    dropped the plugin's ``allowed_globals`` (an SGD without momentum read the common state for its param groups,
    an Adam loaded it with its state); and "last" after a rollback read the content metadata without them, so it
    resumed the abandoned timeline."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from ckpt_integration.checkpoints import ordered_checkpoints
    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint, DistCkptSingleDeviceStrategy

    ck, started = f"{tmp_path}/ck", []

    class Module(L.LightningModule):
        def __init__(self, config: _RunConfig, fail_at=None):
            super().__init__()
            self.save_hyperparameters()
            self.lin = nn.Linear(8, 8)

        def training_step(self, batch, idx):
            if self.global_step == self.hparams.fail_at:
                raise RuntimeError("crash")
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return getattr(torch.optim, optimizer)(self.parameters(), lr=self.hparams.config.lr)

    class Started(Callback):
        def on_train_start(self, trainer, pl_module):
            started.append(trainer.global_step)

    def fit(ckpt_path=None, fail_at=None):
        t = L.Trainer(accelerator="cpu", max_steps=16, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[
                          DistCkptModelCheckpoint(dirpath=ck, save_top_k=-1, every_n_train_steps=2, save_last=True),
                          Started()],
                      strategy=DistCkptSingleDeviceStrategy(checkpoint_io=DistCkptIO(allowed_globals=[_RunConfig])))
        try:
            t.fit(Module(_RunConfig(), fail_at), DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=4),
                  ckpt_path=ckpt_path)
        except RuntimeError as e:
            assert "crash" in str(e)

    fit()
    fit(ckpt_path=next(c.path for c in ordered_checkpoints(ck) if c.step == 4), fail_at=7)
    fit(ckpt_path="last", fail_at=9)
    assert started == [0, 4, 6], started


def test_hydra_hyper_parameters_resume_with_the_default_plugin(tmp_path):
    """``save_hyperparameters(cfg)`` with Hydra's DictConfig (nested, a list, None): every resume failed with
    UntrustedObjectError ("omegaconf.base.ContainerMetadata", then "typing.Any", then "dict"): the plugin allowed
    the containers, not what a pickled one is made of. Docs: DictConfig hyper-parameters load without trusted."""
    import lightning as L
    from omegaconf import OmegaConf
    from torch.utils.data import DataLoader, TensorDataset

    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint, DistCkptSingleDeviceStrategy

    cfg = OmegaConf.create({"lr": 0.1, "model": {"width": 8, "layers": [1, 2], "bias": True}, "name": "run", "x": None})

    class Module(L.LightningModule):
        def __init__(self, cfg):
            super().__init__()
            self.save_hyperparameters(cfg)
            self.lin = nn.Linear(8, 8)

        def training_step(self, batch, idx):
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def fit(steps, ckpt_path=None):
        t = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[DistCkptModelCheckpoint(dirpath=f"{tmp_path}/ck")],
                      strategy=DistCkptSingleDeviceStrategy(checkpoint_io=DistCkptIO()))
        m = Module(cfg)
        t.fit(m, DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=4), ckpt_path=ckpt_path)
        return t, m

    fit(4)
    t, m = fit(6, ckpt_path="last")
    assert t.global_step == 6 and m.hparams.model.layers == [1, 2] and m.hparams.name == "run"


def test_an_explicit_incomplete_last_ckpt_falls_back_to_the_newest_complete_one(tmp_path):
    """``fit(ckpt_path=".../last.ckpt")`` with a ``last.ckpt`` a killed save left incomplete: the callback's setup
    removed it as debris before the strategy loaded the path, and the fit failed with "does not exist" instead
    of falling back to the newest complete checkpoint beside it (as documented, with a warning)."""
    from lightning.pytorch.callbacks import Callback

    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint

    ck, started = f"{tmp_path}/ck", []

    class Started(Callback):
        def on_train_start(self, trainer, pl_module):
            started.append(trainer.global_step)

    def fit(n, ckpt_path=None):
        cbs = [DistCkptModelCheckpoint(dirpath=ck, save_top_k=-1, every_n_train_steps=4, save_last=True), Started()]
        return _Stepped.fit(ck, [0.0] * n, DistCkptIO(), ckpt_path=ckpt_path, callbacks=cbs)

    fit(8)
    os.remove(f"{ck}/last.ckpt/metadata.json")  # (what a save of last killed before its commit leaves)
    t = fit(12, ckpt_path=f"{ck}/last.ckpt")
    assert started == [0, 8] and t.global_step == 12, started
    assert os.path.exists(f"{ck}/last.ckpt/metadata.json")  # (replaced by the resumed run's save of last)


@pytest.mark.parametrize("save_last,recreated", [(False, False), (True, False), (False, True)])
def test_a_checkpoint_out_of_the_top_k_when_a_run_died_is_removed_on_resume(tmp_path, monkeypatch, save_last,
                                                                            recreated):
    """A run killed after the save of step N committed and before the checkpoint it pushed out of the top k
    was removed (Lightning removes it after the save; an async save defers that to its commit): the resume
    took step N, whose callback state no longer named the one pushed out, so it stayed for good, one per such
    crash (found by a probe). The state now lists the removals still due, and the resume makes them; only of
    the very checkpoint meant (``recreated``: another one saved under its name since is kept)."""
    import ckpt_integration as ci

    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint

    ck = f"{tmp_path}/ck"
    scores = [float(s) for s in range(20, 0, -1)]  # (lower is better: each step is the best so far)
    real = DistCkptModelCheckpoint._remove_checkpoint

    def killed_before_removal(self, trainer, filepath):  # (run 1 "dies" after its last save committed)
        if trainer.global_step < 6:
            real(self, trainer, filepath)

    def fit(n, ckpt_path=None):
        cb = DistCkptModelCheckpoint(dirpath=ck, save_top_k=2, monitor="m", mode="min", every_n_train_steps=1,
                                     save_last=save_last)
        _Stepped.fit(ck, scores[:n], DistCkptIO(), ckpt_path=ckpt_path, callbacks=[cb])
        return cb

    monkeypatch.setattr(DistCkptModelCheckpoint, "_remove_checkpoint", killed_before_removal)
    fit(6)
    monkeypatch.setattr(DistCkptModelCheckpoint, "_remove_checkpoint", real)
    kept = sorted(n for n in os.listdir(ck) if not n.startswith("last"))
    assert kept == ["epoch=0-step=4.ckpt", "epoch=0-step=5.ckpt", "epoch=0-step=6.ckpt"], kept
    if recreated:  # (as a run resumed from an earlier step would)
        ci.save({"x": ci.ShardedTensor.from_rank_offsets("x", torch.ones(2))}, f"{ck}/epoch=0-step=4.ckpt",
                overwrite=True)
    cb = fit(9, ckpt_path="last")
    kept = sorted(n for n in os.listdir(ck) if not n.startswith("last"))
    assert [n.split("-")[-1] for n in kept] == ["step=4.ckpt"] * recreated + ["step=8.ckpt", "step=9.ckpt"], kept
    assert sorted(os.path.basename(p) for p in cb.best_k_models) == kept[recreated:]


def test_async_saves_slower_than_a_step_remove_what_left_the_top_k_as_they_commit(tmp_path, monkeypatch):
    """Async saves each step, each slower than a step: a removal that waited for the save in flight ran only
    once no save was in flight at all, which never happened while training, so every checkpoint out of the top
    k stayed until the end (and a run killed meanwhile left them all: found by a probe). Each removal now
    runs once the saves in flight when it was asked committed."""
    import time

    from lightning.pytorch.callbacks import Callback

    from ckpt_integration.execution import save as save_mod
    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint
    from ckpt_integration.lightning.paths import is_complete_checkpoint

    ck, seen = f"{tmp_path}/ck", []
    real = save_mod.write_data_files

    def slow(*args, **kwargs):
        time.sleep(0.3)
        return real(*args, **kwargs)

    class Count(Callback):
        def on_train_batch_start(self, trainer, *args):
            seen.append(sum(is_complete_checkpoint(os.path.join(ck, n)) for n in os.listdir(ck)) if os.path.isdir(ck) else 0)

    monkeypatch.setattr(save_mod, "write_data_files", slow)
    cb = DistCkptModelCheckpoint(dirpath=ck, save_top_k=2, monitor="m", mode="min", every_n_train_steps=1)
    _Stepped.fit(ck, [float(s) for s in range(12, 0, -1)], DistCkptIO(async_save=True), callbacks=[cb, Count()])
    assert max(seen) <= 3, seen  # the top 2, and the newest committed one whose removal of the oldest is due
    assert sorted(os.listdir(ck)) == ["epoch=0-step=11.ckpt", "epoch=0-step=12.ckpt"]


def test_a_checkpoint_whose_replacement_failed_is_not_removed_on_resume(tmp_path, monkeypatch):
    """The top-k callback's async save of step 4 fails (no space); a second callback's save of that step, in the
    same directory, commits and carries the first callback's state. That state listed step 3 as due for removal
    (pushed out by the failed save), and the resume removed it: the one checkpoint of the first callback, kept
    on purpose when its replacement failed, was gone (found by a probe of ``pending_removals``). A removal is
    made only once what replaced it committed, and the top k then holds what committed."""
    import errno
    import time

    from lightning.pytorch.callbacks import Callback

    from ckpt_integration.execution import save as save_mod
    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint

    ck = f"{tmp_path}/ck"
    scores = [5.0, 4.0, 3.0, 1.0, 9.0, 9.0, 9.0, 9.0]  # (step 4 would be the best)
    real = save_mod.write_data_files

    def no_space(target, *args, **kwargs):
        if os.path.basename(target.path.rstrip("/")).startswith("epoch=0-step=4.ckpt"):
            raise OSError(errno.ENOSPC, "No space left on device", target.path)
        return real(target, *args, **kwargs)

    class Settle(Callback):  # (each step starts once the saves before it are written: a slow step)
        def on_train_batch_start(self, trainer, *args):
            while not all(r.is_done() for r in trainer.strategy.checkpoint_io._requests):
                time.sleep(0.01)

    def fit(n, ckpt_path=None):
        cbs = [DistCkptModelCheckpoint(dirpath=ck, save_top_k=1, monitor="m", mode="min", every_n_train_steps=1),
               DistCkptModelCheckpoint(dirpath=ck, filename="all-{step}", save_top_k=-1, every_n_train_steps=1),
               Settle()]
        try:
            _Stepped.fit(ck, scores[:n], DistCkptIO(async_save=True, max_in_flight=2), ckpt_path=ckpt_path,
                         callbacks=cbs)
        except Exception as e:  # noqa: BLE001 - the failed save, raised at a later step
            assert "no space left on device" in str(e), e
        return cbs[0]

    monkeypatch.setattr(save_mod, "write_data_files", no_space)
    fit(6)
    monkeypatch.setattr(save_mod, "write_data_files", real)
    assert "epoch=0-step=3.ckpt" in os.listdir(ck)
    top = fit(8, ckpt_path="last")
    assert "epoch=0-step=3.ckpt" in os.listdir(ck), sorted(os.listdir(ck))
    # the state resumed names the failed save in the top k, where it held the place of one that exists (a probe:
    # restored from a memory snapshot taken while that save was written, the next save removed a kept one):
    # the top k after the resume holds what committed, the failed save's place given back
    assert [os.path.basename(p) for p in top.best_k_models] == ["epoch=0-step=3.ckpt"], top.best_k_models


def test_a_second_fit_keeps_a_checkpoint_the_first_fit_saved_again_over_debris_in_the_top_k(tmp_path):
    """One callback, two fits. The first fit's setup removed the incomplete ``epoch=0-step=2.ckpt`` a killed save
    left, then saved that step again, complete and in the top k. The second fit took the paths the first fit's
    setup had removed for saves that never committed, and dropped that checkpoint from the top k."""
    import ckpt_integration as ci
    from ckpt_integration.lightning import DistCkptIO, DistCkptModelCheckpoint

    ck = f"{tmp_path}/ck"
    dead = f"{ck}/epoch=0-step=2.ckpt"
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(2))}, dead)
    os.remove(f"{dead}/metadata.json")  # (what a save killed before its commit leaves)
    cb = DistCkptModelCheckpoint(dirpath=ck, save_top_k=2, monitor="m", mode="min", every_n_train_steps=1)
    _Stepped.fit(ck, [3.0, 2.0, 1.0], DistCkptIO(), callbacks=[cb])
    assert sorted(os.path.basename(p) for p in cb.best_k_models) == ["epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt"]
    _Stepped.fit(ck, [3.0, 2.0, 1.0, 9.0], DistCkptIO(), ckpt_path="last", callbacks=[cb])
    assert sorted(os.path.basename(p) for p in cb.best_k_models) == ["epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt"]
    assert sorted(n for n in os.listdir(ck)) == ["epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt"]


@pytest.mark.parametrize("copy", ["memory", "preempted"])
def test_a_resume_from_a_durable_copy_of_a_snapshot_keeps_top_k_true(tmp_path, copy):
    """The memory tier lost (a restart on other nodes), ``ckpt_path="last"`` resumes from the durable copy of the
    newest snapshot (``memory-step=6.ckpt`` of ``memory_persist_every_n``, ``preempted-step=6.ckpt`` written at a
    SIGTERM). The snapshot is taken before ``ModelCheckpoint`` saves its step, so the copy's callback state did not
    know ``epoch=0-step=6.ckpt``: it stayed for good beside the top 1, and so did every ``preempted-step=*`` copy.
    The callbacks' states now come from the checkpoint of that step, as for a restore from memory; a copy of a
    preemption is removed once a newer one is durable, and at the end of a fit that saved a newer checkpoint."""
    import shutil

    from ckpt_integration.lightning import DistCkptIO

    ck, shm = f"{tmp_path}/ck", f"{tmp_path}/shm"
    scores = [10.0 - i for i in range(13)]

    def fit(**kw):
        io = DistCkptIO(memory_every_n_train_steps=2, memory_replicas=1, memory_dir=shm,
                        memory_persist_every_n=1 if copy == "memory" else None)
        return _Stepped.fit(ck, scores, io, save_top_k=1, monitor="m", mode="min", every_n_train_steps=2,
                            save_last=True, **kw)

    def names(prefix=""):
        return sorted(n for n in os.listdir(ck) if n.startswith(prefix) and not n.startswith("memory-step="))

    if copy == "memory":  # (memory-step=6 is made durable at the batch end of step 7)
        fit(fail_at=7)
    else:
        fit(sigterm_at=6)
        assert names("preempted") == ["preempted-step=6.ckpt"], names()
    shutil.rmtree(shm)
    if copy == "preempted":  # a second preemption: the newer copy replaces the older one
        t = fit(ckpt_path="last", sigterm_at=10)
        assert os.path.basename(str(t.ckpt_path)) == "preempted-step=6.ckpt", t.ckpt_path
        assert names() == ["epoch=0-step=10.ckpt", "last.ckpt", "preempted-step=10.ckpt"], names()
        shutil.rmtree(shm)
    t = fit(ckpt_path="last")
    assert t.global_step == len(scores) and "-step=" in os.path.basename(str(t.ckpt_path)), t.ckpt_path
    assert names() == ["epoch=0-step=12.ckpt", "last.ckpt"], names()
