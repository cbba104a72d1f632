import json

import pytest

from fastopt import config as fconfig
from fastopt.config import Config, ConfigWarning, _from_env
from fastopt.errors import ConfigError


def test_roundtrip_json():
    cfg = Config()
    cfg.set("sampler.threads", 3)
    cfg.set("cache.policy", "lru")
    back = Config.from_json(cfg.to_json())
    assert back == cfg
    assert json.loads(cfg.to_json())["kernels"]["backward_mode"] == "deterministic"


def test_env_overrides_are_typed():
    cfg = _from_env(Config(), {"FASTOPT_SAMPLER_THREADS": "4", "FASTOPT_SAMPLER_PIN_THREADS": "yes",
                               "FASTOPT_TRAIN_LR": "0.001", "FASTOPT_MODEL_FANOUTS": "5,5",
                               "FASTOPT_SHARED_DATA": "/data"})
    assert cfg.sampler.threads == 4 and cfg.sampler.pin_threads is True and cfg.train.lr == 0.001
    assert cfg.model_fanouts() == [5, 5]
    with pytest.raises(ConfigError, match="environment variable FASTOPT_SAMPLER_THREADS='many': "
                                          "sampler.threads must be of type int"):
        _from_env(Config(), {"FASTOPT_SAMPLER_THREADS": "many"})


def test_unknown_env_variables_are_reported_with_the_closest_knob():
    with pytest.warns(ConfigWarning, match="FASTOPT_CACHE_POLICIES is not a fastopt setting and is "
                                           "ignored; did you mean FASTOPT_CACHE_POLICY"):
        cfg = _from_env(Config(), {"FASTOPT_CACHE_POLICIES": "lru", "OTHER": "1"})
    assert cfg.cache.policy == Config().cache.policy


def test_refused_value_leaves_config_unchanged():
    cfg = Config()
    with pytest.raises(ConfigError, match="train.batch_size must be >= 1"):
        cfg.set("train.batch_size", 0)
    assert cfg.train.batch_size == Config().train.batch_size


def test_config_file_over_a_base(tmp_path):
    base = Config()
    base.set("sampler.threads", 3)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"train": {"epochs": 4}, "model": {"heads": 4}}))
    cfg = Config.from_file(path, base=base)
    assert (cfg.train.epochs, cfg.model.heads, cfg.sampler.threads) == (4, 4, 3)
    assert base.train.epochs == Config().train.epochs  # the base is not changed
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="a config must be a JSON object of groups"):
        Config.from_file(path)
    path.write_text(json.dumps({"model": {"dropout": 2}}))
    with pytest.raises(ConfigError, match=r"config file '.*cfg.json': model.dropout must be in \[0, 1\)"):
        Config.from_file(path)


def test_patch_restores_defaults():
    before = fconfig.default_config().to_dict()
    with fconfig.patch(sampler__threads=1, cache__policy="future") as cfg:
        assert cfg.sampler.threads == 1 and cfg.cache.policy == "future"
    assert fconfig.default_config().to_dict() == before


@pytest.mark.parametrize("key,value,fragment", [
    ("train.batch_size", 0, "train.batch_size must be >= 1"),
    ("cache.budget_fraction", 1.5, r"in \[0, 1\]"),
    ("cache.policy", "fifo", "one of 'static'"),
    ("train.epochs", 2.5, "of type int"),
    ("nope.x", 1, "unknown config group"),
    ("train.nope", 1, "unknown config field"),
    ("train.epoch", 1, "did you mean 'train.epochs'"),
    ("model.fanouts", "10,x", "comma-separated neighbor counts >= 1"),
    ("model.heads", 0, "model.heads must be >= 1"),
])
def test_bad_values_name_value_and_limit(key, value, fragment):
    with pytest.raises(ConfigError, match=fragment):
        Config().set(key, value)


def test_adam_implementation_is_chosen_and_checked():
    import torch

    from fastopt.config import Config
    from fastopt.errors import ConfigError
    from fastopt.trainer import make_optimizer

    params = [torch.nn.Parameter(torch.zeros(3))]
    picked = {k: make_optimizer(params, 1e-3, torch.device("cpu"), kind=k).defaults
              for k in ("auto", "fused", "foreach", "single")}
    assert picked["fused"]["fused"] and picked["foreach"]["foreach"]
    assert not picked["single"]["foreach"] and not picked["single"]["fused"]
    assert not picked["auto"]["foreach"] and not picked["auto"]["fused"]  # the CPU's single-tensor Adam
    cfg = Config()
    with pytest.raises(ConfigError, match="train.adam"):
        cfg.set("train.adam", "sgd")
        cfg.validate()
