"""The search space lists only knobs that can change this run's speed."""

from __future__ import annotations

import importlib.util

import optuna
import pytest

from fastopt.config import Config
from fastopt.errors import ConfigError
from fastopt.models import build_model
from fastopt.tuner import build_space
from fastopt.tuner.space import knob_fields

SMALL = {"tgn": {"memory_dim": 8, "dim": 8, "time_dim": 8}, "tgat": {"dim": 8, "time_dim": 8},
         "jodie": {"memory_dim": 8, "dim": 8, "time_dim": 8}, "apan": {"memory_dim": 8, "dim": 8, "time_dim": 8}}
CPU_PIPELINE = {"pipeline.prefetch_depth", "pipeline.stage_threads"}
CUDA_ONLY = {"cache.placement", "cache.budget_fraction", "cache.policy", "passes.cuda_graphs",
             "pipeline.step_graphs"}


def space_for(name, graph, device="cpu", config=None, **kwargs):
    config = config or Config()
    return build_space(build_model(name, graph, **SMALL[name]), graph, config, device, **kwargs)


@pytest.mark.parametrize("name,searched", [
    ("tgn", {"sampler.threads"} | CPU_PIPELINE),
    ("tgat", {"sampler.threads", "sampler.hop_dedup"} | CPU_PIPELINE),  # two layers
    ("jodie", CPU_PIPELINE),  # samples no neighbors
    ("apan", CPU_PIPELINE),
])
def test_cpu_space_of_each_model(small_graph, name, searched):
    space = space_for(name, small_graph)
    assert set(space.names) == searched
    assert not set(space.names) & CUDA_ONLY and not any(n.startswith("kernels.") for n in space.names)
    assert space.fixed == {}


def test_cuda_space_adds_placement_graphs_and_kernels(small_graph):
    """Built for a CUDA device (nothing runs on it): cache knobs for the feature tables, CUDA
    graphs for the optimized model, the kernels' mapping where triton is installed."""
    space = space_for("tgn", small_graph, device="cuda")
    assert CUDA_ONLY <= set(space.names)
    kernels = {n for n in space.names if n.startswith("kernels.")}
    assert bool(kernels) == (importlib.util.find_spec("triton") is not None)
    eager = Config()
    eager.set("train.optimize", "off")
    space = space_for("tgn", small_graph, device="cuda", config=eager)
    assert "passes.cuda_graphs" not in space.names and not any(n.startswith("kernels.") for n in space.names)
    assert dict((k.name, k.choices) for k in space.knobs)["pipeline.step_graphs"] == ("auto", "on")


def test_knobs_under_other_knobs_are_suggested_only_when_they_matter(small_graph):
    space = space_for("tgn", small_graph, device="cuda")
    base = {"pipeline.prefetch_depth": 2, "sampler.threads": 0, "pipeline.stage_threads": 0,
            "cache.placement": "device", "passes.cuda_graphs": "auto", "pipeline.step_graphs": "auto"}
    base.update({k.name: k.choices[0] for k in space.knobs if k.name.startswith("kernels.")})
    on_device = space.suggest(optuna.trial.FixedTrial(base))
    assert "cache.budget_fraction" not in on_device and "cache.policy" not in on_device
    host = space.suggest(optuna.trial.FixedTrial({**base, "cache.placement": "host",
                                                  "cache.budget_fraction": 0.25, "cache.policy": "lru"}))
    assert host["cache.budget_fraction"] == 0.25 and host["cache.policy"] == "lru"
    no_cache = space.suggest(optuna.trial.FixedTrial({**base, "cache.placement": "host",
                                                      "cache.budget_fraction": 0.0}))
    assert "cache.policy" not in no_cache
    shallow = space.suggest(optuna.trial.FixedTrial({**base, "pipeline.prefetch_depth": 1}))
    assert "pipeline.stage_threads" not in shallow


def test_the_baseline_is_the_config_and_comes_first(small_graph):
    config = Config()
    config.set("sampler.threads", 1)
    config.set("pipeline.prefetch_depth", 3)  # not among the usual choices: added, first
    space = space_for("tgat", small_graph, config=config)
    assert space.baseline() == {"sampler.threads": 1, "sampler.hop_dedup": False,
                                "pipeline.prefetch_depth": 3, "pipeline.stage_threads": 0}
    assert all(len(set(k.choices)) == len(k.choices) for k in space.knobs)
    applied = space.apply(config, space.baseline())
    assert applied.to_dict() == config.to_dict()


def test_batch_size_only_from_the_list_the_user_allows(small_graph):
    assert "train.batch_size" not in space_for("tgn", small_graph).names
    space = space_for("tgn", small_graph, batch_sizes=[600, 200, 600])
    assert dict((k.name, k.choices) for k in space.knobs)["train.batch_size"] == (200, 600)
    other = space_for("tgn", small_graph, batch_sizes=[100, 300])
    assert dict((k.name, k.choices) for k in other.knobs)["train.batch_size"] == (100, 300)
    single = space_for("tgn", small_graph, batch_sizes=[300])
    assert "train.batch_size" not in single.names and single.fixed == {"train.batch_size": 300}
    assert single.apply(Config(), {}).train.batch_size == 300
    with pytest.raises(ConfigError, match="batch sizes to tune over must be >= 1"):
        space_for("tgn", small_graph, batch_sizes=[200, 0])


def test_a_refused_value_names_the_field(small_graph):
    space = space_for("tgn", small_graph)
    with pytest.raises(ConfigError, match="pipeline.prefetch_depth must be >= 0"):
        space.apply(Config(), {"pipeline.prefetch_depth": -1})


def test_every_candidate_is_a_config_field():
    fields = {f"{group}.{name}" for group, values in Config().to_dict().items() for name in values}
    assert set(knob_fields()) <= fields
