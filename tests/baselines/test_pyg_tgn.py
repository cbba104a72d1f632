"""The PyG TGN baseline: it learns on a real graph, reports every field, and needs PyG only when run."""

from __future__ import annotations

import math
import sys

import pytest

from fastopt.data import TemporalGraph, load_dataset
from fastopt.errors import FastOptError

EVENTS = 20_000  # CollegeMsg prefix: about 2 s an epoch on a 2-core CPU


@pytest.fixture(scope="module")
def college(shared_data) -> TemporalGraph:
    """The first 20,000 CollegeMsg events (no edge features, integer unix timestamps)."""
    g = load_dataset(shared_data / "CollegeMsg.txt.gz")
    return TemporalGraph(g.src[:EVENTS], g.dst[:EVENTS], g.ts[:EVENTS], g.num_nodes,
                         name=f"CollegeMsg-head{EVENTS}")


def test_learns_on_collegemsg(college):
    pytest.importorskip("torch_geometric")
    from fastopt.baselines.pyg_tgn import run_pyg_tgn

    epochs = 3
    out = run_pyg_tgn(college, batch_size=200, epochs=epochs, seed=0)

    assert set(out) >= {"epoch_seconds", "test", "val", "h2d_bytes_per_epoch", "peak_device_bytes", "loss"}
    assert len(out["epoch_seconds"]) == epochs and all(s > 0 for s in out["epoch_seconds"])
    assert len(out["loss"]) == epochs and all(math.isfinite(x) and x > 0 for x in out["loss"])
    assert out["loss"][-1] < out["loss"][0]
    assert out["h2d_bytes_per_epoch"] == 0 and out["peak_device_bytes"] == 0  # CPU: nothing copied
    for split in ("val", "test"):
        for metric in ("ap", "auc"):
            assert 0.0 <= out[split][metric] <= 1.0, (split, metric, out[split])
    # seen 0.75-0.77 over seeds 0-3; chance is 0.5
    assert out["test"]["ap"] > 0.65, out
    assert out["test"]["auc"] > 0.65, out
    assert out["val"]["ap"] > 0.65, out


def test_missing_pyg_names_the_extra(college, monkeypatch):
    from fastopt.baselines.pyg_tgn import run_pyg_tgn

    monkeypatch.setitem(sys.modules, "torch_geometric", None)
    with pytest.raises(FastOptError, match=r"fastopt\[pyg\]"):
        run_pyg_tgn(college)


def test_perturb_scales_the_initial_parameters_and_nothing_else(small_graph, monkeypatch):
    """``perturb`` changes each initial parameter by that relative amount, from a generator of its
    own: the parameters of two plain runs of a seed are equal, and torch's stream (dropout,
    everything after) is where the plain run has it."""
    pytest.importorskip("torch_geometric")
    import torch

    from fastopt.baselines.pyg_tgn import run_pyg_tgn

    class Built(Exception):
        pass

    def stop(params, lr):  # the optimizer is made right after the model: look, then stop
        params = list(params)
        raise Built([p.detach().clone() for p in params], torch.rand(1))

    monkeypatch.setattr(torch.optim, "Adam", stop)
    seen = {}
    for name, perturb in [("plain", 0.0), ("again", 0.0), ("perturbed", 1e-3)]:
        with pytest.raises(Built) as got:
            run_pyg_tgn(small_graph, batch_size=200, epochs=1, seed=3, perturb=perturb)
        seen[name] = got.value.args
    (plain, draw), (again, draw_again), (perturbed, draw_perturbed) = seen.values()
    assert all(torch.equal(a, b) for a, b in zip(plain, again, strict=True))
    assert torch.equal(draw, draw_again) and torch.equal(draw, draw_perturbed)
    changed = [((p - q).abs() / q.abs().clamp(min=1e-12)).max() for p, q in zip(perturbed, plain) if q.abs().sum() > 0]
    assert changed and all(1e-5 < c < 1e-1 for c in changed)


@pytest.mark.parametrize("perturb", [-1e-7, 1.0, float("nan"), "1e-7", True])
def test_a_bad_perturbation_is_refused(small_graph, perturb):
    pytest.importorskip("torch_geometric")
    from fastopt.baselines.pyg_tgn import run_pyg_tgn

    with pytest.raises(FastOptError, match=r"perturb must be a number in \[0, 1\) .*pass 1e-7"):
        run_pyg_tgn(small_graph, batch_size=200, epochs=1, perturb=perturb)
