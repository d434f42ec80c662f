"""``Trainer(plugins=[DistCkptIO()])`` alone, per stock strategy name; stock Lightning checkpoints imported.

Saves with the plugin alone under "auto" (2 devices: DDP), "ddp", ``ModelParallelStrategy`` (FSDP2,
DP=2) in 2 gloo processes; "ddp_spawn", "ddp_fork" (Lightning launching 2 processes itself), "auto"
(1 device) and "single_device" in the test process, without torch.distributed. Stock Lightning (no
plugin) writes a ``.ckpt`` file (single device) and a ``ModelParallelStrategy`` DCP directory
(FSDP2, DP=2). Every checkpoint is then resumed in one process with the plugin alone, and the state
the resumed run starts from must equal the state the saving run ended with, exactly: weights,
metric states, extra state, hook entries, optimizer and LR-scheduler state, global step. The
resharded checkpoints also load with ``trainer.validate/test/predict(ckpt_path=dir)`` and
``load_from_checkpoint``. FSDP1 and DeepSpeed are refused (explicit test each).
"""

import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.lightning_helpers import TinyModule, assert_same, loader, set_rank_env, trainer

STEPS = 2  # per epoch in every saving run


def _save_run(tmp, name, **kw):
    """One epoch of ``STEPS`` steps; the checkpoint Lightning's default ModelCheckpoint writes."""
    import lightning as L

    L.seed_everything(0, verbose=False)
    m = TinyModule(dump=f"{tmp}/{name}", options={})
    t = trainer(max_epochs=1, limit_train_batches=STEPS, default_root_dir=f"{tmp}/{name}", **kw)
    t.fit(m, loader())
    return t


def _two_procs(rank, world, tmp):
    from lightning.pytorch.strategies import ModelParallelStrategy

    from ckpt_integration.lightning import DistCkptDDPStrategy, DistCkptIO, DistCkptModelParallelStrategy

    set_rank_env(rank, world)
    t = _save_run(tmp, "auto2", devices=2, plugins=[DistCkptIO()])
    assert type(t.strategy) is DistCkptDDPStrategy
    t = _save_run(tmp, "ddp", devices=2, strategy="ddp", plugins=[DistCkptIO()])
    assert type(t.strategy) is DistCkptDDPStrategy
    t = _save_run(tmp, "mp", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                  plugins=[DistCkptIO()])
    assert type(t.strategy) is DistCkptModelParallelStrategy
    _save_run(tmp, "dcp", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))


def _ckpt(tmp, name):
    d = f"{tmp}/{name}/checkpoints"
    (only,) = os.listdir(d)
    return f"{d}/{only}"


def _resume(tmp, name):
    """Resume ``name``'s checkpoint in this process with the plugin alone ("auto", one device)."""
    import lightning as L

    from ckpt_integration.lightning import DistCkptIO, DistCkptSingleDeviceStrategy

    L.seed_everything(0, verbose=False)
    m = TinyModule(dump=f"{tmp}/{name}-resumed", options={})
    t = trainer(max_epochs=2, limit_train_batches=1, default_root_dir=f"{tmp}/{name}-resumed", plugins=[DistCkptIO()])
    assert type(t.strategy) is DistCkptSingleDeviceStrategy
    t.fit(m, loader(), ckpt_path=_ckpt(tmp, name))
    end = torch.load(f"{tmp}/{name}.end", weights_only=False)
    start = torch.load(f"{tmp}/{name}-resumed.start", weights_only=False)
    assert start["global_step"] == STEPS
    if name == "dcp":  # stock DCP writes a replicated tensor from whichever rank its planner picks, and the
        for snap in (end, start):  # torchmetrics states differ per rank: which copy it kept is not ours to say
            snap.pop("metric")
            snap["state_dict"] = {k: v for k, v in snap["state_dict"].items() if not k.startswith("metric.")}
    assert_same(end, start, name)
    assert m.loaded_user == {"empty": {}, "list": [], "nested": [{}], "pair": (1, None), "step": STEPS}, name
    return end


def _one_proc(tmp):
    import lightning as L

    from ckpt_integration.lightning import DistCkptDDPStrategy, DistCkptIO, DistCkptSingleDeviceStrategy, load_from_checkpoint

    # Lightning launches the 2 processes itself (the main process only collects the results)
    for name in ("ddp_spawn", "ddp_fork"):
        os.environ.pop("MASTER_PORT", None)
        t = _save_run(tmp, name, devices=2, strategy=name, plugins=[DistCkptIO()])
        assert type(t.strategy) is DistCkptDDPStrategy
    t = _save_run(tmp, "auto1", devices=1, plugins=[DistCkptIO()])
    assert type(t.strategy) is DistCkptSingleDeviceStrategy
    t = _save_run(tmp, "single", devices=1, strategy="single_device", plugins=[DistCkptIO()])
    assert type(t.strategy) is DistCkptSingleDeviceStrategy
    _save_run(tmp, "stock", devices=1)  # stock Lightning: a .ckpt file
    assert os.path.isfile(_ckpt(tmp, "stock"))

    ends = {name: _resume(tmp, name) for name in
            ("auto2", "ddp", "mp", "dcp", "ddp_spawn", "ddp_fork", "auto1", "single", "stock")}

    # Lightning's other ways of loading, in this process without torch.distributed: FSDP2 (DP=2) checkpoint
    weights = ends["mp"]["state_dict"]
    m = load_from_checkpoint(TinyModule, _ckpt(tmp, "mp"))
    assert m.hparams.options == {} and m.net.format_version == STEPS
    assert_same(weights, {k: v for k, v in m.state_dict().items() if k != "counter._extra_state"}, "load_from_checkpoint")
    t = trainer(devices=1, plugins=[DistCkptIO()], limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2)
    m = TinyModule(options={})
    metrics = t.validate(m, loader(), ckpt_path=_ckpt(tmp, "mp"))
    assert_same(weights["net.fc1.weight"], m.net.fc1.weight.detach(), "validate")
    assert metrics[0]["val_loss"] > 0
    m = TinyModule(options={})
    t.test(m, loader(), ckpt_path=_ckpt(tmp, "ddp"))
    assert_same(ends["ddp"]["state_dict"]["net.fc2.bias"], m.net.fc2.bias.detach(), "test")
    m = TinyModule(options={})
    preds = t.predict(m, loader(), ckpt_path=_ckpt(tmp, "auto2"))
    assert len(preds) == 2 and m.counter.calls == STEPS
    L.seed_everything(0, verbose=False)


@pytest.mark.slow
def test_plugin_alone_on_every_stock_strategy_and_stock_import(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_two_procs, 2, tmp, timeout=300)
    env = dict(os.environ)
    try:  # here, without torch.distributed (Lightning's ddp_spawn / ddp_fork launchers set MASTER_PORT etc.)
        _one_proc(tmp)
    finally:
        os.environ.clear()
        os.environ.update(env)


def test_strategies_without_cpu_support_or_own_format(tmp_path):
    """DeepSpeed writes its own checkpoints: refused, naming what to use; a stock FSDPStrategy becomes
    DistCkptFSDPStrategy, a subclass of it is refused naming the mixin. Lightning itself refuses
    ``strategy="fsdp"`` on CPU and ``"deepspeed"`` without the package, so the check is called directly."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

    from ckpt_integration.lightning import DistCkptFSDPStrategy, DistCkptIO, UnsupportedStrategyError, check_strategy

    assert check_strategy(FSDPStrategy()) is DistCkptFSDPStrategy
    with pytest.raises(UnsupportedStrategyError,
                       match="DeepSpeedStrategy.*DeepSpeed writes its own.*DistCkptFSDPStrategy.*DistCkptStrategyMixin"):
        check_strategy(object.__new__(DeepSpeedStrategy))

    class MyFSDP(FSDPStrategy):
        pass

    with pytest.raises(UnsupportedStrategyError, match="MyFSDP: it is a subclass of FSDPStrategy.*DistCkptStrategyMixin"):
        check_strategy(MyFSDP())

    class MyDDP(DDPStrategy):  # may override save_checkpoint: not silently replaced
        pass

    with pytest.raises(UnsupportedStrategyError, match="MyDDP: it is a subclass of DDPStrategy"):
        trainer(devices=2, strategy=MyDDP(), plugins=[DistCkptIO()], default_root_dir=str(tmp_path))
