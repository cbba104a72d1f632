"""Every reference model: optimized vs eager outputs and gradients, report, training losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastopt
from fastopt.config import Config
from fastopt.models import build_model
from fastopt.trainer import Trainer

from fastopt.data import TemporalGraph

from passes_helpers import small_graph

# Attention layers each model's report must name as rewritten.
EXPECTED_LAYERS = {
    "tgn": ["layers.0"],
    "tgat": ["layers.0", "layers.1"],
    "apan": ["updater"],
    "jodie": [],
}


def _model(name, graph, **kw):
    torch.manual_seed(0)
    model = build_model(name, graph, dim=8, time_dim=6, **kw) if name != "jodie" else \
        build_model(name, graph, dim=8, time_dim=6, memory_dim=8)
    return model


def _warm_state(model):
    """Random memory and mailbox so memory-based models have something to attend to."""
    mem = getattr(model, "memory", None)
    if mem is None:
        return
    g = torch.Generator().manual_seed(1)
    mem.memory.copy_(torch.randn(mem.memory.shape, generator=g))
    mem.mails.copy_(torch.randn(mem.mails.shape, generator=g))
    mem.mail_ts.copy_(torch.rand(mem.mail_ts.shape, generator=g) * 1e4)
    mem.mail_count.copy_(torch.randint(0, mem.slots + 2, mem.mail_count.shape, generator=g))
    mem.mail_count[:3] = 0  # nodes with an empty mailbox: attention over no valid slot
    mem.pending.fill_(True)


def _inputs(model, graph):
    cfg = Config()
    cfg.set("train.device", "cpu")
    cfg.set("sampler.threads", 1)
    trainer = Trainer(model, graph, cfg, progress=False)
    roots = np.concatenate([graph.src[100:140], graph.dst[100:140]])
    times = np.concatenate([graph.ts[100:140], graph.ts[100:140]])
    return trainer.build_inputs(roots, times)


@pytest.mark.parametrize("name, node_embedding", [("tgn", 0), ("tgat", 0), ("apan", 0), ("jodie", 0),
                                                  ("tgat", 5), ("tgn", 5)])
def test_outputs_and_gradients_match_eager(name, node_embedding):
    """Eval mode; with ``node_embedding`` the table's gradient is compared too."""
    graph = small_graph()
    model = _model(name, graph, node_embedding=node_embedding).eval()
    _warm_state(model)
    fast = fastopt.optimize(model, verify=True)
    report = fast.fastopt_report
    attention = [r.where for r in report.rewrites if r.op == "temporal_attention"]
    assert len(attention) == len(EXPECTED_LAYERS[name])
    for layer, where in zip(EXPECTED_LAYERS[name], attention):
        assert where.startswith(layer)
    assert list(fast.state_dict()) == list(model.state_dict())
    inputs = _inputs(model, graph)
    params = [p for p in model.parameters()]
    weight = torch.randn(inputs.num_roots, 8)
    h_eager = model.embed(inputs)
    g_eager = torch.autograd.grad((h_eager * weight).sum(), params, allow_unused=True)
    h_fast = fast.embed(inputs)
    g_fast = torch.autograd.grad((h_fast * weight).sum(), params, allow_unused=True)
    torch.testing.assert_close(h_fast, h_eager, rtol=1e-4, atol=1e-5)
    # float32 summation order differs (fused softmax, merged products): tolerance relative to the
    # largest gradient, since an element summed from large terms keeps their rounding
    scale = max(float(a.abs().max()) for a in g_eager if a is not None)
    for a, b in zip(g_eager, g_fast):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6 * max(scale, 1.0))
    text = str(report)
    for layer in EXPECTED_LAYERS[name]:
        assert layer in text


def test_reports_name_rewritten_layers():
    graph = small_graph()
    tgn = fastopt.optimize(_model("tgn", graph)).fastopt_report
    assert [r.op for r in tgn.rewrites if r.where.startswith("layers.0")].count("temporal_attention") == 1
    assert any("nn.MultiheadAttention" in r.pattern for r in tgn.rewrites)
    tgat = fastopt.optimize(_model("tgat", graph)).fastopt_report
    assert sum(r.op == "temporal_attention" for r in tgat.rewrites) == 2
    assert "<root>" in " ".join(a.where for a in tgat.left_alone)  # top level does not trace


def test_jodie_has_no_attention_and_comes_back_unchanged():
    graph = small_graph()
    model = _model("jodie", graph)
    # its one candidate, the mail time encoding, is fused by default only where CUDA graphs capture
    fast = fastopt.optimize(model, config={"passes": {"cuda_graphs": "off"}})
    report = fast.fastopt_report
    assert not report.rewrites
    assert any("cannot be traced" in a.reason for a in report.left_alone)
    rewrites = fastopt.optimize(model, config={"passes": {"fuse_time_encoding": "always"}}
                                ).fastopt_report.rewrites
    assert [(r.where, r.op) for r in rewrites] == [("mail_time:cos", "time_encode")]


def test_optimizer_on_either_module_trains_both():
    graph = small_graph()
    model = _model("tgat", graph)
    fast = fastopt.optimize(model)
    assert {id(p) for p in fast.parameters()} == {id(p) for p in model.parameters()}
    before = model.layers[0].w_q.weight.detach().clone()
    opt = torch.optim.SGD(fast.parameters(), lr=0.1)
    inputs = _inputs(model, graph)
    fast.embed(inputs).sum().backward()
    opt.step()
    assert not torch.equal(model.layers[0].w_q.weight, before)


def test_user_model_is_not_modified():
    graph = small_graph()
    model = _model("tgn", graph)
    layer = model.layers[0]
    fastopt.optimize(model)
    assert model.layers[0] is layer and type(layer).__name__ == "MultiheadTemporalAttention"
    assert model._fresh is None


@pytest.mark.parametrize("name", ["tgn", "tgat"])
def test_training_epoch_matches_eager(name):
    full = fastopt.data.load_dataset("wikipedia")
    n = 2500
    graph = TemporalGraph(src=full.src[:n], dst=full.dst[:n], ts=full.ts[:n],
                          num_nodes=full.num_nodes, name="wikipedia[:2500]")
    history = {}
    for optimized in (False, True):
        torch.manual_seed(0)
        model = build_model(name, graph, dim=16, time_dim=8, dropout=0.0,
                            **({"memory_dim": 16} if name == "tgn" else {"fanouts": [5, 5]}))
        if optimized:
            model = fastopt.optimize(model)
            assert model.fastopt_report.count("temporal_attention") >= 1
        cfg = Config()
        for key, value in (("train.device", "cpu"), ("train.epochs", 1), ("train.batch_size", 200),
                           ("sampler.threads", 1), ("train.mrr_negatives", 0)):
            cfg.set(key, value)
        history[optimized] = Trainer(model, graph, cfg, progress=False).fit()
    eager, fast = history[False][0], history[True][0]
    np.testing.assert_allclose(fast["loss"], eager["loss"], rtol=1e-4)
