import json

import pytest

from fastopt import config as fconfig
from fastopt.config import Config, _from_env
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
                               "FASTOPT_TRAIN_LR": "0.001", "FASTOPT_UNRELATED": "x"})
    assert cfg.sampler.threads == 4 and cfg.sampler.pin_threads is True and cfg.train.lr == 0.001
    with pytest.raises(ConfigError, match="FASTOPT|sampler.threads must be of type int"):
        _from_env(Config(), {"FASTOPT_SAMPLER_THREADS": "many"})


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
])
def test_bad_values_name_value_and_limit(key, value, fragment):
    with pytest.raises(ConfigError, match=fragment):
        Config().set(key, value)
