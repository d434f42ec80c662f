"""Lightning Fabric with ``plugins=[DistCkptIO()]``: ``fabric.save`` / ``fabric.load`` / ``fabric.load_raw``.

One process here (Fabric's one-device strategy, in the test process): a round trip of model, AdamW,
scheduler and plain values, ``strict`` as Fabric defines it, ``load_raw``, ``load`` without a state, and
checkpoints of the Trainer and of Fabric loading into each other. Multi-process (``ddp``,
``ModelParallelStrategy`` with DTensor TP and with FSDP2 on 2 processes, gloo) runs through
``examples/fabric_pretrain.py``, a LitGPT-style loop, resumed across strategies and world sizes: the
state each resume loaded is compared exactly with the state the saving run held.
Fabric's ``"fsdp"`` needs a GPU and is not run here.
"""

from __future__ import annotations

import json
import dataclasses
import os
import shutil
import subprocess
import sys

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import DDPStrategy
from torch import nn

import ckpt_integration as ci
from ckpt_integration.lightning import DistCkptFabricSingleDeviceStrategy, DistCkptIO, UnsupportedStrategyError
from tests import forked
from tests.layouts import assert_same_state as _same

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "fabric_pretrain.py")


class Small(L.LightningModule):
    """A LightningModule usable by the Trainer and, as a plain module, by Fabric."""

    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.register_buffer("seen", torch.zeros(()))
        if extra:
            self.extra = nn.Linear(2, 2)
        self.at_start = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def training_step(self, batch, _):
        self.seen += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    def on_train_start(self) -> None:  # what a resumed fit starts from
        self.at_start = (_copy(self.state_dict()), _copy(self.trainer.optimizers[0].state_dict()))


def _copy(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_copy(v) for v in x)
    return x


def _batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 4, generator=g), torch.randn(4, generator=g)) for _ in range(n)]


def _fabric(**kw) -> L.Fabric:
    return L.Fabric(accelerator="cpu", devices=1, plugins=[DistCkptIO(**kw)])


def _setup(fabric: L.Fabric, extra: bool = False):
    model = fabric.setup(Small(extra))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def _train(fabric, model, opt, sched, steps: int, seed: int = 1) -> None:
    for x, y in _batches(steps, seed):
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        sched.step()


def test_fabric_round_trip_strict_and_load_raw(tmp_path):
    fabric = _fabric()
    assert isinstance(fabric.strategy, DistCkptFabricSingleDeviceStrategy)
    model, opt, sched = _setup(fabric)
    _train(fabric, model, opt, sched, 3)
    path = tmp_path / "step-3"
    fabric.save(path, {"model": model, "optimizer": opt, "scheduler": sched, "step": 3, "meta": {"name": "x"}})
    assert (path / "metadata.json").is_file() and any(f.endswith(".distcp") for f in os.listdir(path))
    want = (_copy(model.state_dict()), _copy(opt.state_dict()), sched.state_dict())

    m2, o2, s2 = _setup(_fabric())
    state = {"model": m2, "optimizer": o2, "scheduler": s2, "step": 0}
    rest = fabric.load(path, state)
    _same(want[0], m2.state_dict(), "model")
    _same(want[1], o2.state_dict(), "optimizer")
    assert s2.state_dict() == want[2] and state["step"] == 3
    assert rest == {"meta": {"name": "x"}}  # what ``state`` did not ask for, as Fabric returns it
    # both continue the same
    _train(fabric, model, opt, sched, 2, seed=5)
    _train(fabric, m2, o2, s2, 2, seed=5)
    _same(model.state_dict(), m2.state_dict(), "continued")

    # strict as Fabric defines it: a requested key the checkpoint lacks is a KeyError in Fabric's words
    m3, o3, _ = _setup(_fabric())
    with pytest.raises(KeyError, match="The requested state contains a key 'epoch' that does not exist"):
        fabric.load(path, {"model": m3, "epoch": 0})
    st = {"model": m3, "epoch": 7}
    fabric.load(path, st, strict=False)
    assert st["epoch"] == 7 and torch.equal(m3.net[0].weight, want[0]["net.0.weight"])
    # a module with a parameter the checkpoint lacks: strict raises naming it, strict=False loads the rest
    m4, _, _ = _setup(_fabric(), extra=True)
    with pytest.raises(Exception, match="extra.weight"):
        fabric.load(path, {"model": m4})
    fabric.load(path, {"model": m4}, strict=False)
    assert torch.equal(m4.net[2].weight, want[0]["net.2.weight"])

    # load_raw: the module's weights; load without a state: everything, tensors whole
    m5, _, _ = _setup(_fabric())
    fabric.load_raw(path, m5)
    _same(want[0], m5.state_dict(), "load_raw")
    full = fabric.load(path)
    assert full["step"] == 3 and full["meta"] == {"name": "x"}
    _same(want[0], full["model"], "load()")


def test_fabric_load_returns_what_it_did_not_place_and_refuses_what_was_never_saved(tmp_path):
    """Three differences from Fabric's own load, each a way to lose state without a word:
    * ``fabric.load(p, {"head": module})`` after saving ``{"model": m}`` whose ``m.head`` has the same
      tensor names: it loaded ``m.head``'s weights, where Fabric raises ``KeyError``;
    * the remainder left modules out (``ema``) and returned an optimizer not asked for as its common part
      alone (``{"param_groups": ...}``: ``load_state_dict`` of it fails);
    * a ``torch.save`` file (which the docs say loads as Fabric loads it) was refused as no directory."""
    fabric = _fabric()
    model, opt, _ = _setup(fabric)
    _train(fabric, model, opt, _setup(fabric)[2], 2)
    ema = fabric.setup(nn.Linear(8, 1))
    path = tmp_path / "ck"
    fabric.save(path, {"model": model, "optimizer": opt, "ema": ema, "step": 2})
    m2, _, _ = _setup(_fabric())
    rest = fabric.load(path, {"model": m2})
    assert set(rest) == {"ema", "step"} and rest["step"] == 2, sorted(rest)  # (no half optimizer entry)
    _same(_copy(ema.state_dict()), rest["ema"], "ema")
    with pytest.raises(KeyError, match="'net' that does not exist"):
        fabric.load(path, {"net": nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))})
    # a module saved under the name of one of the model's submodules: both would be saved as "net.*"
    with pytest.raises(ci.CheckpointingException, match="modules 'model' and 'net' both have a tensor saved as 'net"):
        fabric.save(tmp_path / "clash", {"model": model, "net": nn.Sequential(nn.Linear(4, 8))})
    # an optimizer saved without the model it optimizes: the advice says to save them together (it said to
    # "put the parameter as the data of its ShardedTensor", which a Fabric user never builds)
    with pytest.raises(ci.optimizer.UnmatchedParameterError, match=r"fabric\.save: optimizer 'optimizer' .*save the model"):
        fabric.save(tmp_path / "alone", {"optimizer": opt, "step": 2})
    assert not (tmp_path / "alone").exists()
    stock = tmp_path / "plain.pt"
    torch.save({"model": _copy(model.state_dict()), "step": 5}, stock)
    m3, _, _ = _setup(_fabric())
    state = {"model": m3, "step": 0}
    fabric.load(stock, state)
    assert state["step"] == 5
    _same(_copy(model.state_dict()), m3.state_dict(), "torch.save file")


def test_fabric_async_save_as_the_last_line_of_a_script_is_committed(tmp_path):
    """Fabric has no teardown call: the plugin's exit hook commits the save in flight. It ran after
    Python had shut its thread pools down, so the save failed ("cannot schedule new futures after
    interpreter shutdown"), was only logged, and the script exited 0 without its checkpoint."""
    script = tmp_path / "last_line.py"
    script.write_text(
        "import sys, torch, lightning as L\n"
        "from ckpt_integration.lightning import DistCkptIO\n"
        "fabric = L.Fabric(accelerator='cpu', devices=1, plugins=[DistCkptIO(async_save=True, thread_count=2)])\n"
        "model = fabric.setup(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]))\n"
        "torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, sys.argv[1] + '.pt')\n"
        "fabric.save(sys.argv[1], {'model': model, 'step': 1})\n")
    out = str(tmp_path / "ck")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), out], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "save failed" not in proc.stderr, proc.stderr[-3000:]
    import ckpt_integration as ci

    want = torch.load(out + ".pt", weights_only=True)
    got = ci.load_plain_tensors(out)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_trainer_and_fabric_checkpoints_interchange(tmp_path):
    """A Trainer checkpoint loads into Fabric's model and optimizer, and a Fabric checkpoint resumes a Trainer."""
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8)), batch_size=4)
    kw = dict(accelerator="cpu", devices=1, plugins=[DistCkptIO()], logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False)
    module = Small()
    trainer = L.Trainer(max_steps=2, **kw)
    trainer.fit(module, data)
    trainer.save_checkpoint(tmp_path / "trainer")
    fabric = _fabric()
    model, opt, _ = _setup(fabric)
    rest = fabric.load(tmp_path / "trainer", {"model": model, "optimizer": opt})  # strict: nothing lacking
    _same(_copy(module.state_dict()), model.state_dict(), "trainer -> fabric model")
    _same(trainer.optimizers[0].state_dict(), opt.state_dict(), "trainer -> fabric optimizer")
    assert rest["global_step"] == 2

    # Fabric trains on and saves; a Trainer resumes from that checkpoint with its model and optimizer
    _train(fabric, model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1), 2)
    fabric.save(tmp_path / "fabric", {"model": model, "optimizer": opt})
    resumed = Small()
    L.Trainer(max_steps=1, **kw).fit(resumed, data, ckpt_path=str(tmp_path / "fabric"))
    sd, osd = resumed.at_start
    _same(_copy(model.state_dict()), sd, "fabric -> trainer model")
    _same(_copy(opt.state_dict())["state"], osd["state"], "fabric -> trainer optimizer")


def test_fabric_refuses_a_strategy_it_cannot_connect():
    class MyDDP(DDPStrategy):
        pass

    with pytest.raises(UnsupportedStrategyError, match="DistCkptFabricMixin"):
        L.Fabric(accelerator="cpu", devices=1, strategy=MyDDP(), plugins=[DistCkptIO()])


def _example(tmp_path, name: str, *args: str, fresh: bool = False):
    """Run the example; ``fresh``: in a new interpreter, as a user does, else forked with Lightning
    imported (tests/forked.py). The second process of a 2-process run is always a new interpreter
    (Lightning's launcher starts it)."""
    log = tmp_path / f"{name}.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, EXAMPLE, "--log", str(log), *args]
    if fresh:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    else:
        r = forked.run(cmd, env=env, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {int(k): v for k, v in json.loads(log.read_text()).items()}, r.stdout


def _same_state(loaded_file, saved_file) -> None:
    """The state a run resumed (``--dump-state``'s ``loaded-<step>.pt``) is, tensor by tensor and value by
    value, the state the run that saved it held (its ``saved-<step>.pt``): model, AdamW moments and steps,
    param groups, scheduler and loop counter."""
    loaded, saved = torch.load(loaded_file, weights_only=False), torch.load(saved_file, weights_only=False)
    assert loaded["model"] and loaded["optimizer"]["state"]
    _same(loaded, saved, "state")


def test_fabric_example_resumes_across_strategies_and_world_sizes(tmp_path):
    """LitGPT-style loop: one device uninterrupted; one device resumed (exactly the same losses); 2-process
    ModelParallelStrategy with DTensor TP resumed from the one-device checkpoint; 2-process FSDP2
    (ModelParallelStrategy, data_parallel_size=2) resumed from the TP checkpoint; 2-process DDP with async
    saves resumed from the FSDP2 checkpoint. At every resume the whole loaded state (model, optimizer,
    scheduler, counter) equals, exactly, the state the saving run held; the losses match the uninterrupted
    run's (another reduction order: to float precision)."""
    d = lambda name: str(tmp_path / f"dump-{name}")  # noqa: E731
    ref, _ = _example(tmp_path, "ref", "--out-dir", str(tmp_path / "ref"), "--max-steps", "14", "--dump-state", d("ref"),
                      fresh=True)
    assert sorted(ref) == list(range(14))
    (tmp_path / "a").mkdir()
    shutil.copytree(tmp_path / "ref" / "step-00000004", tmp_path / "a" / "step-00000004")
    again, out = _example(tmp_path, "again", "--out-dir", str(tmp_path / "a"), "--max-steps", "8", "--resume",
                          "--dump-state", d("again"))
    assert "Resumed from" in out and "at step 4" in out, out
    assert again == {i: ref[i] for i in range(4, 8)}  # same layout: exactly the uninterrupted run
    _same_state(os.path.join(d("again"), "loaded-4.pt"), os.path.join(d("ref"), "saved-4.pt"))
    tp, out = _example(tmp_path, "tp", "--out-dir", str(tmp_path / "a"), "--max-steps", "10", "--resume",
                       "--devices", "2", "--strategy", "model_parallel", "--save-interval", "2", "--dump-state", d("tp"))
    assert "at step 8 (2 process(es), strategy model_parallel)" in out, out
    _same_state(os.path.join(d("tp"), "loaded-8.pt"), os.path.join(d("again"), "saved-8.pt"))
    fsdp2, out = _example(tmp_path, "fsdp2", "--out-dir", str(tmp_path / "a"), "--max-steps", "12", "--resume",
                          "--devices", "2", "--strategy", "model_parallel", "--data-parallel-size", "2",
                          "--save-interval", "2", "--dump-state", d("fsdp2"))
    assert "at step 10 (2 process(es), strategy model_parallel)" in out, out
    _same_state(os.path.join(d("fsdp2"), "loaded-10.pt"), os.path.join(d("tp"), "saved-10.pt"))
    dp, out = _example(tmp_path, "dp", "--out-dir", str(tmp_path / "a"), "--max-steps", "14", "--resume",
                       "--devices", "2", "--strategy", "ddp", "--save-interval", "2", "--async-save",
                       "--dump-state", d("dp"))
    assert "at step 12 (2 process(es), strategy ddp)" in out, out
    _same_state(os.path.join(d("dp"), "loaded-12.pt"), os.path.join(d("fsdp2"), "saved-12.pt"))
    got = {**tp, **fsdp2, **dp}
    assert sorted(got) == list(range(8, 14))
    for i in got:  # another reduction order: equal to float precision
        assert abs(got[i] - ref[i]) <= 1e-5 * abs(ref[i]), (i, got[i], ref[i])
    # the async save of the last step committed before the script ended
    from ckpt_integration.lightning import latest_complete_checkpoint

    assert latest_complete_checkpoint(str(tmp_path / "a"), suffix="").endswith("step-00000014")


def test_fabric_example_resume_with_nothing_to_resume(tmp_path):
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    try:
        import fabric_pretrain
    finally:
        sys.path.remove(os.path.dirname(EXAMPLE))
    with pytest.raises(SystemExit, match="--resume: no complete checkpoint in"):
        fabric_pretrain.setup(fabric_pretrain.parse(["--out-dir", str(tmp_path / "none"), "--resume"]))


JOB = os.path.join(ROOT, "tests", "fabric_sharded_job.py")


def test_fabric_sharded_strategies_resume_each_other_exactly(tmp_path):
    """``fabric.save`` / ``fabric.load`` / ``fabric.load_raw`` with model, AdamW and StepLR through the
    sharded Fabric strategies, each resuming the previous one's checkpoint in another world size: one
    device -> FSDP1 on 2 CPU processes (``DistCkptFabricFSDPStrategy``) -> FSDP2 (``ModelParallelStrategy``)
    on 2 -> DDP on 4. The state each run loaded (read back in global form through a save of it) equals the
    checkpoint it loaded, tensor by tensor (weights, both AdamW moments), with param groups, scheduler and
    step; ``load_raw``'s weights too."""
    import ckpt_integration as ci

    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    for strategy, devices, load, save in (("single", 1, "-", "a"), ("fsdp1", 2, "a", "b"), ("fsdp2", 2, "b", "c"),
                                          ("ddp", 4, "c", "d")):
        r = subprocess.run([sys.executable, JOB, strategy, str(devices), str(tmp_path), load, save], env=env,
                           capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
        assert r.returncode == 0, f"{strategy} x{devices}:\n{r.stdout[-2000:]}{r.stderr[-3000:]}"
        if load == "-":
            continue
        want, got = ci.load_plain_tensors(str(tmp_path / load)), ci.load_plain_tensors(str(tmp_path / f"reload-{save}"))
        assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in want)
        _same(got, want, f"{strategy} loading {load}")
        raw = ci.load_plain_tensors(str(tmp_path / f"raw-{save}"))
        _same(raw, {k: v for k, v in want.items() if not k.startswith("optimizer.")}, f"{strategy} load_raw")
        common, loaded = ci.load_common_state_dict(str(tmp_path / load)), ci.load_common_state_dict(str(tmp_path / f"reload-{save}"))
        assert loaded["step"] == common["step"] and loaded["scheduler"] == common["scheduler"], strategy
        _same(loaded["optimizer"], common["optimizer"], f"{strategy} param groups")


@dataclasses.dataclass
class _Config:
    """A user's object in the saved state: loads need ``allowed_globals=[_Config]``."""

    width: int = 8


def test_fabric_load_with_allowed_globals_loads_the_optimizer_too(tmp_path):
    """``DistCkptIO(allowed_globals=[cls])`` for a user object in the state: ``fabric.load`` of a state with an
    optimizer failed with UntrustedObjectError naming the class (the optimizer's load dropped them)."""
    fabric = _fabric(allowed_globals=[_Config])
    model, opt, _ = _setup(fabric)
    _train(fabric, model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1), 2)
    fabric.save(tmp_path / "ck", {"model": model, "optimizer": opt, "config": _Config(3)})
    m2, o2, _ = _setup(_fabric(allowed_globals=[_Config]))
    state = {"model": m2, "optimizer": o2, "config": None}
    fabric.load(tmp_path / "ck", state)
    assert state["config"] == _Config(3)
    _same(_copy(opt.state_dict()), o2.state_dict(), "optimizer")
