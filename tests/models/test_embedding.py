"""Learnable node embeddings (``model.node_embedding``): they train, the unique-node lookup equals
the per-slot one, they survive a state_dict round trip, and sizes are checked."""

import dataclasses

import numpy as np
import pytest
import torch

from fastopt.config import Config
from fastopt.data import TemporalGraph
from fastopt.errors import ConfigError, FastOptError, ModelError
from fastopt.models import MODELS, TGAT, build_model
from fastopt.trainer import Trainer, load_model_state

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {"tgn": dict(memory_dim=8, dim=8, time_dim=4), "tgat": dict(dim=8, time_dim=4, fanouts=(3, 2)),
         "jodie": dict(memory_dim=8, dim=8, time_dim=4), "apan": dict(memory_dim=8, dim=8, time_dim=4)}


def _config(**train) -> Config:
    cfg = Config()
    cfg.train.device, cfg.train.batch_size, cfg.train.mrr_negatives = "cpu", 200, 0
    cfg.sampler.threads = 1
    for k, v in train.items():
        cfg.set(f"train.{k}", v)
    return cfg


def _inputs(trainer, graph, start=1000, n=40):
    roots = np.concatenate([graph.src[start:start + n], graph.dst[start:start + n]])
    times = np.concatenate([graph.ts[start:start + n]] * 2)
    if trainer.sampler is not None:
        trainer.sampler.reset(0)
    return trainer.build_inputs(roots, times)


@pytest.fixture(scope="module")
def pairs_graph() -> TemporalGraph:
    """4,000 events without features in which each of 40 users always meets its own item, at
    random times: every node's history looks alike in time, so only who a neighbor is tells
    the partner from a random item."""
    rng = np.random.default_rng(0)
    users, events = 40, 4000
    src = rng.integers(0, users, events)
    dst = users + src
    ts = np.sort(rng.uniform(0, 1e5, events))
    return TemporalGraph(src, dst, ts, 2 * users)


def test_featureless_tgat_learns_from_node_embeddings(pairs_graph):
    """Three epochs at lr 1e-2: with a 16-wide embedding the loss falls and test AP ends far above
    chance (0.5) and far above the same model without it."""
    runs = {}
    for width in (0, 16):
        torch.manual_seed(0)
        model = build_model("tgat", pairs_graph, dim=16, time_dim=8, fanouts=(4, 3), node_embedding=width)
        trainer = Trainer(model, pairs_graph, _config(lr=1e-2), progress=False)
        history = trainer.fit(3)
        runs[width] = ([h["loss"] for h in history], trainer.test_metrics["ap"])
    loss, ap = runs[16]
    assert loss[-1] < loss[0] - 0.1
    assert ap > 0.9 and ap > runs[0][1] + 0.2, runs


@pytest.mark.parametrize("name", sorted(MODELS))
def test_unique_lookup_equals_per_slot_lookup(name, small_graph):
    """Rows read through the batch's unique nodes (as the loader sends them, also padded with node
    0 as on CUDA) equal each slot's own row, in outputs and in the table's gradient."""
    torch.manual_seed(0)
    model = build_model(name, small_graph, node_embedding=5, **SMALL[name]).eval()
    trainer = Trainer(model, small_graph, _config(), progress=False)
    inputs = _inputs(trainer, small_graph)
    assert inputs.unique_nodes is not None
    padded = torch.cat([inputs.unique_nodes, inputs.unique_nodes.new_zeros(7)])
    variants = [inputs, dataclasses.replace(inputs, unique_nodes=padded),
                dataclasses.replace(inputs, unique_nodes=None, node_inverse=None)]
    weight = None
    results = []
    for variant in variants:
        model.zero_grad()
        h = model.embed(variant)
        weight = torch.randn(h.shape, generator=torch.Generator().manual_seed(1)) if weight is None else weight
        (h * weight).sum().backward()
        results.append((h.detach(), model.node_embedding.weight.grad.clone()))
    assert results[0][1].abs().sum() > 0
    for h, grad in results[1:]:
        torch.testing.assert_close(h, results[0][0])
        torch.testing.assert_close(grad, results[0][1])


@pytest.mark.parametrize("name", ["tgat", "tgn"])
def test_state_dict_round_trip(name, small_graph, tmp_path):
    """The table is a parameter: saved and loaded with the model; a model built without it (or
    with another width) refuses the weights, naming the key."""
    torch.manual_seed(0)
    model = build_model(name, small_graph, node_embedding=6, **SMALL[name])
    trainer = Trainer(model, small_graph, _config(), progress=False)
    trainer.fit(1)
    assert "node_embedding.weight" in model.state_dict()
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    torch.manual_seed(1)
    fresh = build_model(name, small_graph, node_embedding=6, **SMALL[name])
    load_model_state(fresh, torch.load(path, weights_only=True), "test")
    torch.testing.assert_close(fresh.node_embedding.weight, model.node_embedding.weight)
    model.eval(), fresh.eval()
    inputs = _inputs(trainer, small_graph)
    with torch.no_grad():
        torch.testing.assert_close(fresh.embed(inputs), model.embed(inputs))
    for other in (0, 4):
        with pytest.raises(FastOptError, match="node_embedding.weight"):
            load_model_state(build_model(name, small_graph, node_embedding=other, **SMALL[name]),
                             torch.load(path, weights_only=True), "test")


def test_widths_and_sizes_are_checked(small_graph):
    with pytest.raises(ModelError, match="needs num_nodes >= 1"):
        TGAT(0, 0, node_embedding=8)
    with pytest.raises(ModelError, match="node_embedding=-1 is negative"):
        build_model("tgat", small_graph, node_embedding=-1)
    with pytest.raises(ConfigError, match="model.node_embedding"):
        Config().set("model.node_embedding", -1)
    assert TGAT(0, 0).node_embedding is None
    table = TGAT(0, 0, node_embedding=8, num_nodes=11).node_embedding
    assert tuple(table.weight.shape) == (11, 8)


def test_config_reaches_every_model(small_graph):
    cfg = Config()
    cfg.set("model.node_embedding", 3)
    for name in MODELS:
        model = build_model(name, small_graph, cfg, **SMALL[name])
        assert tuple(model.node_embedding.weight.shape) == (small_graph.num_nodes, 3), name
