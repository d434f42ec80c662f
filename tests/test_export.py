"""Export to stock tools (HF ``from_pretrained``, Lightning ``load_from_checkpoint`` / resume) and import
from stock Lightning (``.ckpt`` file, ``ModelParallelStrategy`` DCP directory) through ``convert``.

Every check compares tensors exactly (``torch.equal``) with the module that was saved.
"""

import copy
import os

import pytest
import torch
from torch import nn

import ckpt_integration as ci
from ckpt_integration.cli import main as cli_main
from ckpt_integration.modules import ParallelLayout, ShardedModuleMixin, module_sharded_state_dict
from ckpt_integration.tools import ExportError, convert_checkpoint, export_checkpoint, export_recipe_object
from tests.dist_utils import run_distributed
from ckpt_integration.storage.filesystem import locate

# --------------------------------------------------------------------------- a small LightningModule with a fused layer
class FusedLinear(ShardedModuleMixin, nn.Linear):
    """``nn.Linear`` whose weight and bias are stored as 3 column-parallel parts (``weight.part0/1/2``)."""

    def __init__(self, d_in, d_out, layout=None):
        super().__init__(d_in, d_out)
        self.parallel_layout = layout
        self.tp_axes = {"weight": "fused:3", "bias": "fused:3"}


_CLASSES = {}


def __getattr__(name):
    """``Lit`` is built on first use, so that spawned ranks importing this file do not import Lightning
    (``ckpt-integration convert --module tests.test_export:Lit`` finds it here)."""
    if name != "Lit":
        raise AttributeError(name)
    if "Lit" not in _CLASSES:
        import lightning as L

        class Lit(L.LightningModule):
            def __init__(self, hidden=6, lr=0.05, fused=True):
                super().__init__()
                self.save_hyperparameters()
                torch.manual_seed(0)
                self.qkv = FusedLinear(4, 3 * hidden) if fused else nn.Linear(4, 3 * hidden)
                self.head = nn.Linear(3 * hidden, 1)
                self.register_buffer("seen", torch.zeros((), dtype=torch.long))

            def training_step(self, batch, idx):
                x, y = batch
                self.seen += 1
                return ((self.head(torch.tanh(self.qkv(x))).squeeze(-1) - y) ** 2).mean()

            def configure_model(self):
                pass  # stock ModelParallelStrategy requires the hook; nothing is parallelized here

            def configure_optimizers(self):
                opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
                return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

        Lit.__module__, Lit.__qualname__ = __name__, "Lit"
        _CLASSES["Lit"] = Lit
    return _CLASSES["Lit"]


def _loader():
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=4)


def _trainer(root, strategy=None, plugins=None, **kw):
    args = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=str(root), max_epochs=1, limit_train_batches=3, num_sanity_val_steps=0)
    args.update(kw)
    if strategy is not None:
        args["strategy"] = strategy
    import lightning as L

    return L.Trainer(plugins=plugins, **args)


def _fit_dist_ckpt(root):
    """Train ``Lit`` 3 steps with our single-device strategy; returns (module, optimizer, checkpoint dir)."""
    from ckpt_integration.lightning import DistCkptIO, DistCkptSingleDeviceStrategy

    m = __getattr__("Lit")()
    t = _trainer(root, DistCkptSingleDeviceStrategy(), [DistCkptIO()])
    t.fit(m, _loader())
    return m, t.optimizers[0], t.checkpoint_callback.best_model_path


def _assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def cli(*args):
    return cli_main([str(a) for a in args])


# --------------------------------------------------------------------------- export
def test_export_hf_loads_with_from_pretrained(tmp_path, monkeypatch, capsys):
    """A transformers GPT-2 (built from a config, no download) saved inside a wrapper with optimizer state and
    an extra tensor; the export under ``model.`` loads with ``from_pretrained`` and equals it tensor by tensor."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=16, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.Adam(hf.parameters())
    hf(torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
    opt.step()
    model_sd = module_sharded_state_dict(hf, "model.", {"layout": ParallelLayout()})
    from ckpt_integration.optimizer import optimizer_sharded_state_dict

    sd = {"model": model_sd, "optimizer": optimizer_sharded_state_dict(opt, model_sd),
          "metric.total": ci.ShardedTensor.from_rank_offsets("metric.total", torch.tensor(7.0)),
          "recipe": export_recipe_object(model_sd)}
    ci.save(sd, str(tmp_path / "ckpt"))
    cfg.save_pretrained(str(tmp_path / "cfg"))

    out = tmp_path / "hf"
    assert cli("export", tmp_path / "ckpt", out, "--to", "hf", "--strip-prefix", "model.", "--config",
               tmp_path / "cfg", "--max-shard-size", "40KB") == 0
    text = capsys.readouterr().out
    assert "not exported: optimizer state" in text and "outside prefix 'model.': metric.total" in text
    names = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in names and "config.json" in names
    assert len([n for n in names if n.startswith("model-0")]) > 1  # sharded
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(out))
    _assert_same(loaded.state_dict(), hf.state_dict())


def _save_tp2(rank, world, path):
    """TP=2: the fused layer's local weight is [q_r; k_r; v_r]; every rank records its export recipe."""
    lay = ParallelLayout.initialize(2)
    torch.manual_seed(0)
    full = FusedLinear(4, 12)
    m = nn.Sequential(FusedLinear(4, 6, lay), nn.Linear(12, 2))
    with torch.no_grad():
        for name in ("weight", "bias"):
            parts = getattr(full, name).chunk(3)
            getattr(m[0], name).copy_(torch.cat([p.chunk(2)[rank] for p in parts]))
        m[1].weight.fill_(0.5)
        m[1].bias.fill_(-1.0)
    sd = module_sharded_state_dict(m, "", {"layout": lay})
    ci.save({**sd, "export_recipe": export_recipe_object(sd)}, path)
    if rank == 0:
        torch.save(full.state_dict(), path + ".ref.pt")


def test_export_merges_tp2_fused_parts_per_recipe(tmp_path):
    path = str(tmp_path / "tp2")
    run_distributed(_save_tp2, 2, path, timeout=240)
    ref = torch.load(path + ".ref.pt")
    assert "0.weight.part1" in ci.load_tensors_metadata(path)
    result = export_checkpoint(path, str(tmp_path / "hf"), "hf")
    assert sorted(result.merged) == ["0.bias", "0.weight"]
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(got) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert torch.equal(got["0.weight"], ref["weight"]) and torch.equal(got["0.bias"], ref["bias"])
    assert torch.equal(got["1.weight"], torch.full((2, 12), 0.5))
    # the same, one block of rows at a time (a block crosses the boundary between two parts)
    export_checkpoint(path, str(tmp_path / "hf2"), "hf", memory_budget=5 * 4 * 4)
    assert torch.equal(load_file(str(tmp_path / "hf2" / "model.safetensors"))["0.weight"], ref["weight"])


def test_export_without_recipe_refuses_part_groups(tmp_path, capsys):
    m = nn.Sequential(FusedLinear(4, 6))
    ci.save(module_sharded_state_dict(m, "", {"layout": ParallelLayout()}), str(tmp_path / "c"))
    with pytest.raises(ExportError, match=r"0\.weight: part0, part1, part2.*--merge-parts"):
        export_checkpoint(str(tmp_path / "c"), str(tmp_path / "o"), "hf")
    assert cli("export", tmp_path / "c", tmp_path / "o", "--to", "hf") == 2
    assert "no export recipe" in capsys.readouterr().err and not os.path.exists(tmp_path / "o")
    kept = export_checkpoint(str(tmp_path / "c"), str(tmp_path / "k"), "hf", merge_parts=False)
    assert kept.tensors == 6 and not kept.merged
    merged = export_checkpoint(str(tmp_path / "c"), str(tmp_path / "m"), "hf", merge_parts=True)
    from safetensors.torch import load_file

    _assert_same(load_file(str(tmp_path / "m" / "model.safetensors")), m.state_dict())


class _Transposed(nn.Module):
    """A hand-written hook: the weight stored transposed through a factory (its merge is no concatenation)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 5))

    def sharded_state_dict(self, prefix="", metadata=None):
        build = lambda k, t, rid, _: {"t": ci.ShardedTensor.from_rank_offsets(k + ".t", t.t().contiguous())}  # noqa: E731
        return {prefix + "weight": ci.ShardedTensorFactory(prefix + "weight", self.weight.detach(), build,
                                                           lambda sd: sd["t"].t())}


class _Stacked(nn.Module):
    """A transposed factory and 3 layers stacked along a layer axis (``stack_layers``)."""

    def __init__(self):
        super().__init__()
        self.tr = _Transposed()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))

    def sharded_state_dict(self, prefix="", metadata=None, with_tr=True):
        from ckpt_integration.modules import stack_layers

        per_layer = [module_sharded_state_dict(l, f"{prefix}layers.{i}.") for i, l in enumerate(self.layers)]
        tr = module_sharded_state_dict(self.tr, prefix + "tr.") if with_tr else {}
        return {**tr, **stack_layers(per_layer, 0, 3, prefix + "layers.")}


def test_export_recipe_opaque_factory_and_stacked_layers(tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    m = _Stacked()
    sd = m.sharded_state_dict()
    assert sd["layers.0.weight"].key == "layers.weight" and sd["layers.0.weight"].global_shape == (3, 2, 2)
    path = str(tmp_path / "c")
    ci.save({**sd, "r": export_recipe_object(sd)}, path)
    # the transposed factory can only be merged by its own code: refused from disk, exported through the module
    with pytest.raises(ExportError, match=r"'tr\.weight'.*module="):
        export_checkpoint(path, str(tmp_path / "o"), "hf")
    export_checkpoint(path, str(tmp_path / "m"), "hf", module=_Stacked())
    _assert_same(load_file(str(tmp_path / "m" / "model.safetensors")), m.state_dict())
    # without the factory, the stacked layers come back under their per-layer names from disk
    sd = m.sharded_state_dict(with_tr=False)
    ci.save({**sd, "r": export_recipe_object(sd)}, str(tmp_path / "s"))
    export_checkpoint(str(tmp_path / "s"), str(tmp_path / "so"), "hf")
    _assert_same(load_file(str(tmp_path / "so" / "model.safetensors")),
                 {k: v for k, v in m.state_dict().items() if k.startswith("layers.")})


def test_export_lightning_ckpt_loads_and_resumes_in_stock_lightning(tmp_path):
    import lightning as L

    Lit = __getattr__("Lit")
    trained, opt, path = _fit_dist_ckpt(tmp_path / "run")
    expected = {k: v.clone() for k, v in trained.state_dict().items()}
    assert "qkv.weight.part2" in ci.load_tensors_metadata(path)

    # weights only, from disk: stock load_from_checkpoint (weights_only torch.load) gets the module back
    out = tmp_path / "weights.ckpt"
    assert cli("export", path, out, "--to", "lightning", "--merge-parts") == 0
    ck = torch.load(out, weights_only=True)
    assert "optimizer_states" not in ck and ck["global_step"] == 3
    _assert_same(Lit.load_from_checkpoint(out).state_dict(), expected)

    # with the module: optimizer state included; stock Trainer resumes fit from the file
    full = tmp_path / "full.ckpt"
    result = export_checkpoint(path, str(full), "lightning", module=Lit(), include_optimizer=True)
    assert result.tensors == len(expected)
    seen = {}

    class Check(L.Callback):
        def on_train_start(self, trainer, module):
            seen["state"] = {k: v.clone() for k, v in module.state_dict().items()}
            seen["opt"] = copy.deepcopy(trainer.optimizers[0].state_dict())
            seen["step"] = trainer.global_step

    t = _trainer(tmp_path / "stock", callbacks=[Check()], max_epochs=2, enable_checkpointing=False)
    t.fit(Lit(), _loader(), ckpt_path=str(full))
    assert seen["step"] == 3 and t.global_step == 6
    _assert_same(seen["state"], expected)
    ref = opt.state_dict()
    for i, st in ref["state"].items():
        for name, v in st.items():
            assert torch.equal(seen["opt"]["state"][i][name], v), (i, name)
    assert seen["opt"]["param_groups"][0]["lr"] == ref["param_groups"][0]["lr"]


# --------------------------------------------------------------------------- import from stock Lightning
class _Snapshot:
    """A Lightning callback (built lazily) recording weights, optimizer state and step when training starts."""

    def __new__(cls, seen):
        import lightning as L

        class Snap(L.Callback):
            def on_train_start(self, trainer, module):
                seen["state"] = {k: v.clone() for k, v in module.state_dict().items()}
                seen["opt"] = copy.deepcopy(trainer.optimizers[0].state_dict())
                seen["sched"] = trainer.lr_scheduler_configs[0].scheduler.state_dict()
                seen["step"] = trainer.global_step

        return Snap()


def _resume_dist_ckpt(root, path, fused=True):
    """Resume ``fit`` from our checkpoint ``path`` with the single-device DistCkpt strategy."""
    from ckpt_integration.lightning import DistCkptIO, DistCkptSingleDeviceStrategy

    seen = {}
    t = _trainer(root, DistCkptSingleDeviceStrategy(), [DistCkptIO()], callbacks=[_Snapshot(seen)], max_epochs=2,
                 enable_checkpointing=False)
    t.fit(__getattr__("Lit")(fused=fused), _loader(), ckpt_path=str(path))
    return seen, t


def _assert_resumed(seen, module, optimizer, step, sched=None):
    assert seen["step"] == step
    _assert_same(seen["state"], module.state_dict())
    ref = optimizer.state_dict()
    assert sorted(seen["opt"]["state"]) == sorted(ref["state"])
    for i, st in ref["state"].items():
        _assert_same(seen["opt"]["state"][i], st)
    assert [{k: v for k, v in g.items() if k != "params"} for g in seen["opt"]["param_groups"]] == \
        [{k: v for k, v in g.items() if k != "params"} for g in ref["param_groups"]]
    if sched is not None:
        assert seen["sched"] == sched


def test_convert_stock_lightning_ckpt_then_resume(tmp_path, capsys):
    """Stock Trainer saves a .ckpt -> ``convert --to torch_dist`` -> the DistCkpt strategy resumes ``fit``."""
    Lit = __getattr__("Lit")
    m = Lit()
    t = _trainer(tmp_path / "stock")
    t.fit(m, _loader())
    stock = t.checkpoint_callback.best_model_path
    assert os.path.isfile(stock) and t.global_step == 3

    # without the module: weights and training state under their names; optimizer state not carried, said so
    assert cli("convert", stock, tmp_path / "plain", "--to", "torch_dist") == 0
    text = capsys.readouterr().out
    assert "imported a stock Lightning checkpoint (ckpt)" in text and "not carried: optimizer_states" in text
    _assert_same(ci.load_plain_tensors(str(tmp_path / "plain")), m.state_dict())
    assert ci.load_common_state_dict(str(tmp_path / "plain"))["global_step"] == 3
    from ckpt_integration.storage import checkpoint_dir as ckdir
    assert ckdir.read_manifest(locate(tmp_path / "plain")).step == 3  # the commit order knows the step

    # with the module class: everything, stored as its sharded_state_dict asks (fused parts)
    assert cli("convert", stock, tmp_path / "full", "--to", "torch_dist", "--module", "tests.test_export:Lit") == 0
    assert "not carried" not in capsys.readouterr().out
    assert "qkv.weight.part1" in ci.load_tensors_metadata(str(tmp_path / "full"))
    seen, t2 = _resume_dist_ckpt(tmp_path / "resume", tmp_path / "full")
    _assert_resumed(seen, m, t.optimizers[0], 3, t.lr_scheduler_configs[0].scheduler.state_dict())
    assert t2.global_step == 6


def _stock_model_parallel(rank, world, root):
    """Stock ModelParallelStrategy writing Lightning's own DCP directory checkpoint."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    from lightning.pytorch.strategies import ModelParallelStrategy

    m = __getattr__("Lit")(fused=False)
    t = _trainer(root, ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1))
    t.fit(m, _loader())
    torch.save({"state": m.state_dict(), "opt": t.optimizers[0].state_dict(),
                "sched": t.lr_scheduler_configs[0].scheduler.state_dict(), "path": t.checkpoint_callback.best_model_path},
               os.path.join(root, "ref.pt"))


def test_convert_stock_model_parallel_dcp_then_resume(tmp_path):
    """A stock ``ModelParallelStrategy`` DCP directory (names, not positions) is carried whole without the module."""
    root = str(tmp_path / "mp")
    os.makedirs(root)
    run_distributed(_stock_model_parallel, 1, root, timeout=300)
    ref = torch.load(os.path.join(root, "ref.pt"), weights_only=False)
    assert os.path.isdir(ref["path"]) and os.path.isfile(os.path.join(ref["path"], "meta.pt"))
    result = convert_checkpoint(ref["path"], "torch_dist", str(tmp_path / "imported"))
    assert result.source_kind == "dcp" and not result.not_carried
    seen, t = _resume_dist_ckpt(tmp_path / "resume", tmp_path / "imported", fused=False)
    assert seen["step"] == 3 and t.global_step == 6
    _assert_same(seen["state"], ref["state"])
    for i, st in ref["opt"]["state"].items():
        _assert_same(seen["opt"]["state"][i], st)
    assert seen["sched"] == ref["sched"]
