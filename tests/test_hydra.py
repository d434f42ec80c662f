"""Hydra configs: composition, structured-config validation, plugin instantiation."""

import os

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from hydra.errors import ConfigCompositionException

from ckpt_integration.hydra_config import register_configs, validate_config
from ckpt_integration.lightning import DistCkptIO

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
register_configs()


def _compose(*overrides):
    with initialize_config_dir(config_dir=os.path.abspath(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_defaults_and_groups():
    cfg = _compose()
    assert (cfg.parallel.tp, cfg.parallel.dp) == (2, 1) and cfg.checkpoint.async_save is True
    for name, (tp, dp) in {"tp1_dp2": (1, 2), "tp1_dp4": (1, 4), "tp2_dp2": (2, 2)}.items():
        c = _compose(f"parallel={name}", "resume=true")
        assert (c.parallel.tp, c.parallel.dp, c.resume) == (tp, dp, True)
    c = _compose("checkpoint=two_stage")
    assert c.checkpoint.load_strategy == "two_stage"
    assert cfg.strategy.name == "ddp"
    for name in ("ddp", "model_parallel", "single_device"):
        assert _compose(f"strategy={name}", "parallel=tp1_dp1").strategy.name == name


def test_plugin_from_config():
    cfg = _compose("checkpoint=default", "checkpoint.async_save=true", "checkpoint.load_strategy=fully_parallel",
                   "checkpoint.thread_count=3")
    io = instantiate(cfg.checkpoint)
    assert isinstance(io, DistCkptIO)
    assert (io.async_save, io.load_strategy, io.thread_count, io.backend) == (True, "fully_parallel", 3, "torch_dist")


def test_wrong_keys_and_values_fail_fast():
    with pytest.raises(ConfigCompositionException, match="asynk_save"):
        _compose("checkpoint.asynk_save=true")  # typo: unknown key
    with pytest.raises(ConfigCompositionException, match="thread_count=many"):
        _compose("checkpoint.thread_count=many")  # wrong type
    with pytest.raises(ConfigCompositionException, match="tp3"):
        _compose("parallel=tp3_dp9")  # no such option
    # Enum-typed choices fail at composition (so also under --cfg job), listing the valid values
    for override, choices in {"checkpoint.backend=foo": "torch_dist, zarr",
                              "checkpoint.load_strategy=three_stage": "auto, read_once, local, fully_parallel, two_stage",
                              "trainer.accelerator=tpu": "cpu, gpu, cuda"}.items():
        with pytest.raises(ConfigCompositionException) as e:
            _compose(override)
        msg = str(e.value) + str(e.value.__cause__)
        assert override.split("=")[1] in msg and choices in msg, msg
    validate_config(_compose("checkpoint=zarr"))  # the second backend is a valid switch
    validate_config(_compose("checkpoint.backend=zarr"))


def test_validate_config_before_spawning():
    from omegaconf import OmegaConf

    for override, match in {"checkpoint.thread_count=0": "checkpoint.thread_count=0 must be >= 1",
                            "checkpoint.max_in_flight=0": "checkpoint.max_in_flight=0 must be >= 1",
                            "parallel.dp=0": "parallel.dp=0 must be >= 1",
                            "parallel.tp=-1": "parallel.tp=-1 must be >= 1",
                            "model.n_heads=3": "model.n_heads=3 must be divisible by parallel.tp=2",
                            "parallel=tp1_dp4 trainer.global_batch_size=6": "global_batch_size=6 .* parallel.dp=4",
                            # (each was accepted, then failed in every spawned worker, or after the demo's phase 1)
                            "checkpoint.staging_budget=0": "checkpoint.staging_budget=0 must be >= 1",
                            "checkpoint.sigterm_grace_s=nan": "checkpoint.sigterm_grace_s=nan must be >= 0",
                            "trainer.max_epochs=-1": "trainer.max_epochs=-1 must be >= 1",
                            "trainer.save_top_k=-5": "trainer.save_top_k=-5 must be >= -1",
                            "model.n_layers=0": "model.n_layers=0 must be >= 1",
                            "model.block_size=0": "model.block_size=0 must be >= 1",
                            "checkpoint.backend=zarr checkpoint.staging_budget=1000": "staging_budget is not supported "
                                                                                       "with checkpoint.backend=zarr",
                            "demo=true trainer.max_epochs=1": "demo=true .* trainer.max_epochs >= 2",
                            "demo=true strategy=single_device parallel=tp1_dp1": "demo=true resumes with parallel.dp=2",
                            "demo=true trainer.global_batch_size=3 parallel=tp1_dp1": "global_batch_size=3 must be even",
                            # (accepted before, then every spawned rank died in the model or the loader: probe)
                            "model.d_model=0": "model.d_model=0 must be >= 1",
                            "model.d_model=-32": "model.d_model=-32 must be >= 1",
                            "model.corpus_chars=0": "model.corpus_chars=0 must be >= 1",
                            "model.corpus_chars=200": "corpus_chars=200 gives 6 training windows .*global_batch_size=8",
                            "trainer.log_every_n_steps=-1": "trainer.log_every_n_steps=-1 must be >= 1",
                            "port=-1": "port=-1 must be a TCP port",
                            "port=99999": "port=99999 must be a TCP port",
                            # (the optimizer refused it in every spawned rank; a file as ckpt_dir gave a traceback)
                            "model.lr=-1": "model.lr=-1.0 must be >= 0",
                            f"ckpt_dir={__file__}": "is a file, not a directory",
                            f"ckpt_dir={__file__}/sub": "is a file, not a directory",
                            }.items():
        with pytest.raises(ValueError, match=match):
            validate_config(_compose(*override.split()))
    validate_config(_compose("parallel=tp4_dp1"))  # 4 heads over 4 ranks
    validate_config(_compose("demo=true"))  # (the README's main job)
    validate_config(_compose("port=29512", "model.corpus_chars=265"))  # 8 windows of 33 characters: one batch
    with pytest.raises(ValueError, match="strategy=single_device runs one process.*tp=2, dp=1"):
        validate_config(_compose("strategy=single_device"))
    validate_config(_compose("strategy=single_device", "parallel=tp1_dp1"))
    with pytest.raises(ConfigCompositionException, match="strategy.name"):
        _compose("strategy.name=deepspeed")
    # configs built without the schemas get the same choice checks
    with pytest.raises(ValueError, match="checkpoint.backend='tensorstore' is not allowed"):
        validate_config(OmegaConf.create({"checkpoint": {"backend": "tensorstore"}}))


def test_enum_values_reach_the_plugin_as_strings():
    cfg = _compose("checkpoint=zarr", "checkpoint.load_strategy=two_stage")
    assert cfg.checkpoint.backend == "zarr" and f"{cfg.checkpoint.load_strategy}" == "two_stage"
    io = instantiate(cfg.checkpoint)
    assert (type(io.backend), io.backend, type(io.load_strategy), io.load_strategy) == (str, "zarr", str, "two_stage")


def test_fresh_run_refuses_to_delete_complete_checkpoints(tmp_path):
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from train import prepare_ckpt_dir

    d = tmp_path / "ck"
    (d / "last.ckpt").mkdir(parents=True)
    (d / "last.ckpt" / "metadata.json").write_text("{}")
    (d / "partial.ckpt").mkdir()  # an interrupted save: no metadata.json
    with pytest.raises(FileExistsError, match="1 complete checkpoint.*last.ckpt.*resume=true.*overwrite=true"):
        prepare_ckpt_dir(_compose(f"ckpt_dir={d}"))
    assert (d / "last.ckpt" / "metadata.json").exists()
    prepare_ckpt_dir(_compose(f"ckpt_dir={d}", "resume=true"))  # resuming keeps everything
    assert sorted(os.listdir(d)) == ["last.ckpt", "partial.ckpt"]
    # what is not this run's to clear stays: a multirun job's directory (its checkpoints one level down: before,
    # a fresh run without overwrite=true deleted them, with the rest of ckpt_dir) and other files
    (d / "parallel=tp2_dp1" / "last.ckpt").mkdir(parents=True)
    (d / "parallel=tp2_dp1" / "last.ckpt" / "metadata.json").write_text("{}")
    (d / "NOTES.txt").write_text("results")
    prepare_ckpt_dir(_compose(f"ckpt_dir={d}", "overwrite=true"))  # explicit: start over
    assert sorted(os.listdir(d)) == ["NOTES.txt", "parallel=tp2_dp1"]
    (d / "partial.ckpt").mkdir()
    (d / "last.ckpt.tmp-1a2b").mkdir()
    prepare_ckpt_dir(_compose(f"ckpt_dir={d}"))  # only leftovers of interrupted saves: removed without asking
    assert sorted(os.listdir(d)) == ["NOTES.txt", "parallel=tp2_dp1"]
    assert (d / "parallel=tp2_dp1" / "last.ckpt" / "metadata.json").exists()


@pytest.mark.slow
def test_multirun_jobs_get_their_own_checkpoint_directories(tmp_path):
    """``-m`` over two layouts (DTensor TP=2, then FSDP2 DP=2 with strategy=model_parallel): one directory each."""
    import sys

    import ckpt_integration as ci
    from tests import forked

    root = os.path.join(os.path.dirname(__file__), "..")
    ck = tmp_path / "ck"
    small = ["model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.corpus_chars=600", "trainer.max_epochs=1"]
    cmd = [sys.executable, os.path.join(root, "examples", "train.py"), "-m", "parallel=tp2_dp1,tp1_dp2",
           "strategy=model_parallel", f"ckpt_dir={ck}", f"hydra.sweep.dir={tmp_path / 'sweep'}", *small]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # train.py's own process forked with Hydra and Lightning imported; it starts its job processes itself
    out = forked.run(cmd, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    jobs = sorted(os.listdir(ck))  # named by each job's overrides (sorted by key; trainer.max_epochs left out)
    prefix = "model.corpus_chars=600,model.d_model=16,model.n_heads=2,model.n_layers=1,"
    assert jobs == [prefix + "parallel=tp1_dp2,strategy=model_parallel", prefix + "parallel=tp2_dp1,strategy=model_parallel"]
    for job, layout in zip(jobs, ({"tp": 1, "pp": 1, "dp": 2}, {"tp": 2, "pp": 1, "dp": 1})):
        assert ci.load_content_metadata(ck / job / "last.ckpt")["layout"] == layout
    # the DTensor checkpoints hold the hand-written model's keys (fused QKV parts): any strategy resumes them
    assert "model.blocks.0.qkv.weight.part2" in ci.load_tensors_metadata(ck / jobs[1] / "last.ckpt")


def test_memory_group_builds_the_plugin_with_the_memory_tier():
    cfg = _compose("checkpoint=memory", "checkpoint.memory.every_n_train_steps=5", "checkpoint.memory.replicas=3",
                   "checkpoint.memory.dir=/dev/shm/x", "checkpoint.memory.persist_every_n=4")
    io = instantiate(cfg.checkpoint)
    assert io.memory_enabled and io.async_save
    assert (io.memory_every_n_train_steps, io.memory_replicas, io.memory_dir, io.memory_persist_every_n) == (5, 3, "/dev/shm/x", 4)
    off = instantiate(_compose().checkpoint)  # the default: no memory snapshots
    assert not off.memory_enabled and off.memory_tier is None
    with pytest.raises(ConfigCompositionException, match="every_n_trian_steps"):
        _compose("checkpoint.memory.every_n_trian_steps=5")
    with pytest.raises(ValueError, match="checkpoint.memory.every_n_train_steps=0 must be >= 1"):
        validate_config(_compose("checkpoint.memory.every_n_train_steps=0"))
