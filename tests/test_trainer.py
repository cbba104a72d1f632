"""Training loop: negatives, reproducibility, checkpoint/resume equality, metrics and logs."""

import json

import numpy as np
import pytest
import torch

from fastopt.config import Config
from fastopt.errors import ConfigError, FastOptError
from fastopt.models import build_model
from fastopt.trainer import NegativeSampler, Trainer, resolve_device

TINY = {"tgn": dict(memory_dim=8, dim=8, time_dim=4), "tgat": dict(dim=8, time_dim=4, fanouts=(3, 2)),
        "jodie": dict(memory_dim=8, dim=8, time_dim=4)}


pytestmark = pytest.mark.usefixtures("one_thread")  # bitwise reproducibility needs fixed BLAS threads


def make(graph, name="tgn", seed=0, **train):
    cfg = Config()
    cfg.train.device, cfg.train.batch_size, cfg.train.mrr_negatives = "cpu", 200, 3
    for k, v in train.items():
        cfg.set(f"train.{k}", v)
    torch.manual_seed(seed)
    return Trainer(build_model(name, graph, **TINY[name]), graph, cfg, progress=False)


def test_negatives_come_from_destinations_and_are_keyed(small_graph):
    neg = NegativeSampler(small_graph.destination_pool(), seed=1)
    a = neg.draw(500, epoch=0, split="train", batch=3)
    assert set(a.tolist()) <= set(small_graph.dst.tolist())
    np.testing.assert_array_equal(a, neg.draw(500, epoch=0, split="train", batch=3))
    assert not np.array_equal(a, neg.draw(500, epoch=1, split="train", batch=3))
    assert not np.array_equal(a, neg.draw(500, epoch=0, split="val", batch=3))


def test_same_seed_same_run(small_graph):
    h1 = make(small_graph).fit(1)
    h2 = make(small_graph).fit(1)
    assert h1[0]["loss"] == h2[0]["loss"] and h1[0]["val"] == h2[0]["val"]


@pytest.mark.parametrize("name", ["tgn", "tgat"])
def test_resume_from_checkpoint_ends_with_same_metrics(small_graph, tmp_path, name):
    straight = make(small_graph, name)
    straight.fit(2)
    first = make(small_graph, name)
    first.checkpoint_dir = tmp_path
    first.fit(1)  # "interrupted" after epoch 0
    resumed = make(small_graph, name, seed=123)  # different init: everything must come from the file
    resumed.fit(2, resume=tmp_path / "checkpoint.pt")
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history]
    assert resumed.history[-1]["val"] == straight.history[-1]["val"]
    assert resumed.test_metrics == straight.test_metrics


def test_metrics_and_log(small_graph, tmp_path):
    t = make(small_graph, "jodie")
    t.log_path = tmp_path / "log.jsonl"
    hist = t.fit(1)
    records = [json.loads(line) for line in t.log_path.read_text().splitlines()]
    assert records[0]["epoch"] == 0 and "test" in records[-1]
    test = t.test_metrics
    for key in ("ap", "auc", "mrr"):
        assert 0.0 <= test[key] <= 1.0
    assert set(hist[0]["stages"]) >= {"forward", "backward", "update"}


def test_bad_training_config(small_graph):
    with pytest.raises(ConfigError, match="batch_size must be >= 1"):
        make(small_graph, batch_size=0)
    with pytest.raises(ConfigError, match="epochs must be >= 1"):
        make(small_graph).fit(0)
    with pytest.raises(ConfigError, match="device"):
        resolve_device("tpu")
    with pytest.raises(FastOptError, match="does not exist"):
        make(small_graph).fit(1, resume="/nonexistent/checkpoint.pt")


@pytest.mark.parametrize("name", ["tgn", "tgat"])
def test_sampling_ahead_on_a_thread_changes_nothing(small_graph, name):
    """Neighborhoods sampled up to two batches ahead on a background thread give the same run."""
    runs = []
    for async_sampling, depth in ((False, 0), (True, 2)):
        t = make(small_graph, name)
        t.config.set("pipeline.async_sampling", async_sampling)
        t.config.set("pipeline.prefetch_depth", depth)
        t.fit(1)
        runs.append((t.history[0]["loss"], t.history[0]["val"], t.test_metrics))
    assert runs[0] == runs[1]


def test_plan_covers_the_split_in_order(small_graph):
    t = make(small_graph, "jodie", batch_size=700)
    batches = list(t.plan("train", epoch=0, mrr_negatives=4))
    r = small_graph.split_range("train")
    assert [b.start for b in batches] == list(range(r.start, r.stop, 700))
    assert batches[-1].stop == r.stop
    b = batches[1]
    assert b.extra.shape == (700, 4) and b.roots.shape == (700 * 7,)
    np.testing.assert_array_equal(b.roots[:700], small_graph.src[700:1400])
    np.testing.assert_array_equal(b.times, np.tile(small_graph.ts[700:1400], 7))
