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
    run = records[0]
    assert run["config"] == t.config.to_dict() and run["seed"] == 0 and run["model"] == "JODIE"
    assert run["start"] and run["command"] and run["dataset"] == small_graph.name
    assert records[1]["epoch"] == 0 and records[1]["val_seconds"] >= 0 and "test" in records[-1]
    assert records[-1]["test_seconds"] == t.test_seconds > 0
    test = t.test_metrics
    for key in ("ap", "auc", "mrr"):
        assert 0.0 <= test[key] <= 1.0
    assert set(hist[0]["stages"]) >= {"forward", "backward", "update"}


def test_training_learns(learnable_graph):
    """Three epochs on a graph where each user meets one item: validation AP climbs and test AP
    ends far above chance (0.5)."""
    t = make(learnable_graph, "tgn", lr=1e-2)
    hist = t.fit(3)
    val = [h["val"]["ap"] for h in hist]
    assert val[-1] > val[0] + 0.2 and val[-1] > 0.8
    assert t.test_metrics["ap"] > 0.8 and t.test_metrics["auc"] > 0.8


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


def test_model_hyperparameters_from_config(small_graph):
    cfg = Config()
    cfg.set("model.fanouts", "4,3")
    cfg.set("model.dim", 12)
    cfg.set("model.heads", 3)
    model = build_model("tgat", small_graph, cfg, time_dim=6)  # keywords override the config
    assert model.fanouts == [4, 3] and model.dim == 12 and model.layers[0].num_heads == 3
    assert model.layers[0].time_enc.w.out_features == 6


def fit_with_val_aps(graph, aps, monkeypatch, tmp_path=None, epochs=None, resume=None, **train):
    """A JODIE trainer whose validation AP per epoch is ``aps`` (the rest of the run is real)."""
    t = make(graph, "jodie", **train)
    t.checkpoint_dir = tmp_path
    real = t.evaluate

    def evaluate(split, mrr_negatives=0):
        out = real(split, mrr_negatives)
        if split == "val":
            out["ap"] = aps[t.epoch]
        return out

    monkeypatch.setattr(t, "evaluate", evaluate)
    t.fit(len(aps) if epochs is None else epochs, resume=resume)
    return t


def test_patience_stops_after_epochs_without_improvement(small_graph, monkeypatch, capsys):
    t = fit_with_val_aps(small_graph, [0.6, 0.7, 0.65, 0.69, 0.9, 0.95], monkeypatch, patience=2)
    assert len(t.history) == 4 and t.best_epoch == 1 and t.epoch == 4
    none = fit_with_val_aps(small_graph, [0.6, 0.7, 0.65, 0.69], monkeypatch)  # patience 0: every epoch
    assert len(none.history) == 4


def same_state(a: Trainer, b: Trainer) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_restore_best_tests_the_best_epochs_weights(small_graph, monkeypatch, tmp_path):
    aps = [0.6, 0.7, 0.65]
    best = fit_with_val_aps(small_graph, aps, monkeypatch, restore_best=True)
    two = make(small_graph, "jodie")
    two.fit(2)  # training that ends at the best epoch holds the same weights and state
    assert best.best_epoch == 1 and len(best.history) == 3 and same_state(best, two)
    last = fit_with_val_aps(small_graph, aps, monkeypatch)  # without restore_best: the last epoch's
    assert not same_state(last, two)
    # interrupted after epoch 2 and resumed: best.pt beside the checkpoint restores epoch 1
    fit_with_val_aps(small_graph, aps, monkeypatch, tmp_path, epochs=3, restore_best=True)
    assert (tmp_path / "best.pt").exists()
    resumed = fit_with_val_aps(small_graph, aps + [0.5], monkeypatch, epochs=4, restore_best=True,
                               resume=tmp_path / "checkpoint.pt")
    assert resumed.best_epoch == 1 and len(resumed.history) == 4 and same_state(resumed, two)
    (tmp_path / "best.pt").unlink()
    with pytest.raises(FastOptError, match="restore_best needs the weights of epoch 1"):
        fit_with_val_aps(small_graph, aps + [0.5], monkeypatch, epochs=4, restore_best=True,
                         resume=tmp_path / "checkpoint.pt")


def test_fit_prints_epochs_and_timed_test(small_graph, capsys):
    t = make(small_graph, "jodie")
    t.progress = "lines"
    t.fit(1)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("epoch   0  loss=") and " val ap=" in out[0]
    assert "sample=0.0s" not in out[0] and "gather=0.0s" not in out[0]
    assert out[-1].startswith("test: ap=") and out[-1].endswith("s)")
    with pytest.raises(ConfigError, match="progress must be True, False or 'lines'"):
        Trainer(build_model("jodie", small_graph, **TINY["jodie"]), small_graph, t.config, progress="bars")


def test_progress_bars_in_a_notebook(monkeypatch):
    """Jupyter's output streams are no terminals; bars are drawn there all the same."""
    import sys
    import types

    from fastopt import progress

    assert isinstance(progress.progress_bar(range(3), "x", True), progress._Quiet)  # pytest: no terminal
    shell = type("ZMQInteractiveShell", (), {})()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    bar = progress.progress_bar(range(3), "x", True)
    assert not isinstance(bar, progress._Quiet) and list(bar) == [0, 1, 2]
    assert isinstance(progress.progress_bar(range(3), "x", "lines"), progress._Quiet)


def test_a_step_that_raises_still_joins_the_rows_read_on_a_side_stream(small_graph, monkeypatch):
    """A training step whose forward raises joins the side stream its rows were read on
    (``cache.read_overlap``) before the error leaves it: a capture left with an unjoined fork would
    end with another error, hiding the step's own."""
    import fastopt.trainer as trainer_module

    t, log = make(small_graph), []
    inputs = t.build_inputs(np.array([0, 1]), np.array([1.0, 1.0]))

    class Reads:
        def apply(self, inputs, event_feat, side):
            inputs.edges_pending = lambda: log.append("joined")
            return inputs, event_feat

    def scores(*args):
        log.append("forward")
        raise RuntimeError("the forward failed")

    monkeypatch.setattr(trainer_module, "unflatten", lambda spec, tensors: (inputs, None, Reads()))
    monkeypatch.setattr(t, "_scores", scores)
    with pytest.raises(RuntimeError, match="the forward failed"):
        t._whole_step([], 1, ())
    assert log == ["forward", "joined"]
