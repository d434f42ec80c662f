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
    with pytest.raises(ValueError, match="checkpoint.load_strategy='three_stage'"):
        validate_config(_compose("checkpoint.load_strategy=three_stage"))
    with pytest.raises(ValueError, match="checkpoint.backend='tensorstore'"):
        validate_config(_compose("checkpoint.backend=tensorstore"))
    validate_config(_compose("checkpoint.backend=zarr"))  # the second backend is a valid switch
    from hydra.errors import InstantiationException

    with pytest.raises(InstantiationException, match="unknown load_strategy 'three_stage'"):
        instantiate(_compose("checkpoint.load_strategy=three_stage").checkpoint)
