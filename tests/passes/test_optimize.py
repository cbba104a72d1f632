"""fastopt.optimize end to end: unchanged models, verify, dumps, failures, dropout, config."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import fastopt
import fastopt.config as fconfig
from fastopt.errors import FastOptError, TraceError
from fastopt.models.layers import TemporalAttention
from fastopt.passes import PassManager, default_pipeline, optimize_module

from passes_helpers import neighbor_mask


def _layer_inputs(m=6, k=4):
    return (torch.randn(m, 8), torch.randn(m, k, 8), torch.randn(m, k, 4), torch.rand(m, k) * 10,
            neighbor_mask(m, k))


def test_model_without_attention_comes_back_unchanged():
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    out = fastopt.optimize(mlp)
    assert out is mlp
    assert "no fusable attention" in str(out.fastopt_report)


def test_untraceable_model_comes_back_unchanged():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow
                return self.lin(x)
            return x

    model = Branchy()
    out = fastopt.optimize(model)
    assert out is model
    text = str(out.fastopt_report)
    assert "cannot be traced" in text and "returned unchanged" in text
    assert "torch.fx docs" not in text and "Proxy docstring" not in text  # fx's own advice is left out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only report")
def test_cpu_report_has_no_cuda_graph_lines():
    layer = TemporalAttention(8, 4, 6, 8).eval()
    fast = fastopt.optimize(layer)
    fast(*_layer_inputs())
    assert fast.fastopt_report.graphs and "cuda graphs" not in str(fast.fastopt_report)


def test_verify_passes_and_catches_a_wrong_rewrite(monkeypatch):
    torch.manual_seed(0)
    layer = TemporalAttention(8, 4, 6, 8).eval()
    fast = fastopt.optimize(layer, verify=True)
    report = fast.fastopt_report
    assert "<root>  waiting for its first call" in str(report)
    for _ in range(3):
        fast(*_layer_inputs())
    (record,) = report.verifications
    assert record.where == "<root>" and record.calls == 2  # the first VERIFY_CALLS calls
    assert record.with_gradients == 2  # autograd recorded: parameter gradients compared too
    assert 0.0 < record.largest < 1e-4
    assert ("2 call(s) compared: outputs and, in 2 of them, parameter and input gradients within "
            "tolerance, largest absolute difference") in str(report)

    from fastopt.passes import attention

    real = attention.fused_attention
    monkeypatch.setattr(attention, "fused_attention",
                        lambda *a, **kw: real(*a, **kw) * 1.01)
    bad = optimize_module(layer, verify=True)[0]
    with pytest.raises(FastOptError, match="largest difference"):
        bad(*_layer_inputs())


def test_verify_compares_parameter_and_input_gradients(monkeypatch, wrong_backward):
    torch.manual_seed(0)
    layer = TemporalAttention(8, 4, 6, 8).eval()
    from fastopt.passes import attention

    real = attention.fused_attention
    monkeypatch.setattr(attention, "fused_attention",
                        lambda *a, **kw: wrong_backward.apply(real(*a, **kw)))
    fast, report = optimize_module(layer, verify=True)
    with torch.no_grad():  # outputs alone are right
        fast(*_layer_inputs())
    (record,) = report.verifications
    assert record.calls == 1 and record.with_gradients == 0
    wrong = optimize_module(layer, verify=True)[0]
    with pytest.raises(FastOptError, match=r"gradient of [\w.]+ differs from eager"):
        wrong(*_layer_inputs())
    h_dst, *rest = _layer_inputs()
    h_dst.requires_grad_()
    frozen = optimize_module(layer, verify=True)[0]
    for p in layer.parameters():
        p.requires_grad_(False)
    try:  # no parameter needs a gradient: the input's gradient shows the wrong backward
        with pytest.raises(FastOptError, match=r"gradient of args\[0\] differs from eager"):
            frozen(h_dst, *rest)
    finally:
        for p in layer.parameters():
            p.requires_grad_(True)
    assert h_dst.grad is None  # the check differentiates detached copies: nothing reaches the caller


_Neighbors = collections.namedtuple("_Neighbors", "k v mask")


class _AttentionOverATuple(nn.Module):
    """Attention whose keys, values and mask come in a named tuple."""

    def forward(self, q, nbrs):
        s = (q * nbrs.k).sum(-1).masked_fill(~nbrs.mask[..., None], -1e9)
        a = torch.softmax(s, 1).masked_fill(~nbrs.mask[..., None], 0.0)
        return (a.unsqueeze(-1) * nbrs.v).sum(1)


def test_verify_reaches_inputs_inside_named_tuples(monkeypatch, wrong_backward):
    from fastopt.passes import attention

    real = attention.fused_attention
    monkeypatch.setattr(attention, "fused_attention",
                        lambda *a, **kw: wrong_backward.apply(real(*a, **kw)))
    fast = optimize_module(_AttentionOverATuple(), verify=True)[0]
    keys = torch.randn(5, 4, 2, 3, requires_grad=True)
    nbrs = _Neighbors(keys, torch.randn(5, 4, 2, 3), neighbor_mask(5, 4))
    with pytest.raises(FastOptError, match=r"gradient of args\[1\]\.k differs from eager"):
        fast(torch.randn(5, 1, 2, 3), nbrs)
    assert keys.grad is None


def test_verify_with_active_dropout_compares_the_same_draws():
    torch.manual_seed(0)
    layer = TemporalAttention(8, 4, 6, 8, dropout=0.3).train()
    fast, report = optimize_module(layer, verify=True)
    for _ in range(2):
        fast(*_layer_inputs())
    (record,) = report.verifications
    assert record.calls == 2 and record.with_gradients == 2 and record.largest < 1e-4


class _CountingAttention(nn.Module):
    """Attention that counts its calls in a buffer: an in-place write the graph must keep."""

    def __init__(self):
        super().__init__()
        self.inner = _AttentionWithDropout(0.0)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, q, k, v, mask):
        self.calls.add_(1)
        return self.inner(q, k, v, mask) * self.calls


def test_buffer_writes_stay_in_the_graph_and_verify_restores_them():
    model = _CountingAttention()
    fast, report = optimize_module(model, verify=True)
    assert report.count("temporal_attention") == 2 and model.calls.item() == 0  # tracing wrote nothing
    args = (torch.randn(5, 1, 2, 3), torch.randn(5, 4, 2, 3), torch.randn(5, 4, 2, 3),
            neighbor_mask(5, 4))
    for call in (1, 2, 3):  # verify runs the first two calls three times, the state moves once
        torch.testing.assert_close(fast(*args), model.inner(*args) * call)
        assert model.calls.item() == call
    assert report.verifications[0].calls == 2


def test_dropout_in_training_is_fused_and_keeps_the_expected_scale():
    torch.manual_seed(0)
    layer = TemporalAttention(8, 4, 6, 8, dropout=0.5).train()
    fast = fastopt.optimize(layer)
    args = _layer_inputs(m=64)
    with fastopt.patch(passes__fuse_dropout=False):
        torch.manual_seed(1)
        unfused = fast(*args)
    torch.manual_seed(1)
    eager = layer(*args)
    torch.testing.assert_close(unfused, eager)  # same torch RNG draws in the same order
    torch.manual_seed(1)
    fused = fast(*args)
    assert fused.shape == eager.shape and torch.isfinite(fused).all()
    assert fast.fastopt_report.count("temporal_attention") == 1


class _AttentionWithDropout(nn.Module):
    """Masked attention with functional dropout whose output is its weighted sum: linear in the
    dropped weights."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, q, k, v, mask):
        s = (q * k).sum(-1).masked_fill(~mask[..., None], -1e9)
        a = torch.softmax(s, 1).masked_fill(~mask[..., None], 0.0)
        a = torch.nn.functional.dropout(a, self.p, training=self.training)
        return (a.unsqueeze(-1) * v).sum(1)


@pytest.mark.usefixtures("reference_backend")
def test_fused_dropout_keeps_each_weight_with_probability_1_minus_p_scaled_by_its_inverse():
    """With one-hot values (slot j writes feature j), every output feature of the fused op is
    either 0 (weight dropped) or the weight / (1 - p), kept about half the time at p = 0.5, and the
    mean over rows is the output without dropout: inverted dropout keeps the expected scale."""
    rows, slots, heads = 20000, 4, 2
    model = _AttentionWithDropout(0.5).train()
    fast = fastopt.optimize(model)
    assert fast.fastopt_report.count("temporal_attention") == 2  # the graphs of both modes
    gen = torch.Generator().manual_seed(0)
    # the fused op takes values as wide as the keys: head dim = slots
    q = torch.randn(1, 1, heads, slots, generator=gen).expand(rows, -1, -1, -1).contiguous()
    k = torch.randn(1, slots, heads, slots, generator=gen).expand(rows, -1, -1, -1).contiguous()
    v = torch.eye(slots).reshape(1, slots, 1, slots).expand(rows, -1, heads, -1).contiguous()
    mask = torch.ones(rows, slots, dtype=torch.bool)
    weights = model.eval()(q[:1], k[:1], v[:1], mask[:1])  # [1, H, K]: no dropout
    torch.manual_seed(1)
    out = fast.train()(q, k, v, mask)
    kept = out != 0
    torch.testing.assert_close(out[kept], (weights / 0.5).expand_as(out)[kept])
    assert abs(kept.float().mean().item() - 0.5) < 0.01  # 160,000 draws: 4 standard deviations
    for j in range(slots):  # each slot and head on its own, not only on average
        assert 0.47 < kept[:, :, j].float().mean() < 0.53
    torch.testing.assert_close(out.mean(0, keepdim=True), weights, atol=0.02, rtol=0)
    assert not torch.equal(kept[: rows // 2], kept[rows // 2:])  # rows draw their own masks
    torch.manual_seed(1)
    assert not torch.equal(model.train()(q, k, v, mask), out)  # drawn by the fused op, not torch


def test_graphs_traced_per_mode():
    model = _AttentionWithDropout(0.3).eval()
    fast = fastopt.optimize(model)
    q, k, v = torch.randn(5, 1, 2, 3), torch.randn(5, 4, 2, 3), torch.randn(5, 4, 2, 3)
    mask = neighbor_mask(5, 4)
    torch.testing.assert_close(fast(q, k, v, mask), model(q, k, v, mask))
    assert fast._fastopt_graphs[True] is not fast._fastopt_graphs[False]


def test_dump_graphs(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTOPT_DUMP_GRAPHS", str(tmp_path))
    fastopt.optimize(TemporalAttention(8, 4, 6, 8))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert any("fuse_temporal_attention.before" in n for n in names)
    assert any("fuse_temporal_attention.after" in n for n in names)
    after = next(p for p in tmp_path.iterdir() if "fuse_temporal_attention.after" in p.name)
    assert "fused_attention" in after.read_text()


def test_failing_pass_is_named_with_the_passes_before_it():
    class Boom:
        name = "explode"

        def __call__(self, gm):
            raise RuntimeError("kaboom")

    def pipeline():
        return PassManager(default_pipeline().passes[:2] + [Boom()])

    with pytest.raises(TraceError, match=r"pass explode failed .*fuse_multihead_attention, fuse_sdpa_attention.*kaboom"):
        optimize_module(TemporalAttention(8, 4, 6, 8), make_pipeline=pipeline)


def test_config_group_applies_while_running():
    cfg = fastopt.default_config().copy()  # other fixtures may have patched the defaults
    cfg.set("passes.fuse_dropout", False)
    fast = fastopt.optimize(TemporalAttention(8, 4, 6, 8), config=cfg)
    assert fast._fastopt_changes == {"passes__fuse_dropout": False}
    with pytest.raises(FastOptError):
        fastopt.optimize(TemporalAttention(8, 4, 6, 8), config=3)


@pytest.mark.parametrize("mode", ["always", "graphs"])
def test_time_encoding_fusion_by_config(mode, monkeypatch):
    """passes.fuse_time_encoding adds the pass; "always" runs the fused op, "graphs" only inside
    a CUDA-graph capture (here on the CPU: the original code); outputs and gradients as eager.
    "graphs" rewrites only where graphs can capture (CUDA graphs on, a CUDA device present)."""
    torch.manual_seed(0)
    layer = TemporalAttention(4, 3, 6, 8, num_heads=2, dropout=0.0).eval()
    for cuda, graphs, joins in ((True, "auto", True), (False, "auto", mode == "always"),
                                (True, "off", mode == "always")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        passes = fastopt.optimize(layer, config={"passes": {"fuse_time_encoding": mode,
                                                            "cuda_graphs": graphs}}
                                  ).fastopt_report.passes
        assert ("fuse_time_encoding" in passes) is joins, (cuda, graphs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the pass in, CPU tensors
    # the reference attention operator on the CPU too, as where the kernels run
    fast = fastopt.optimize(layer, config={"passes": {"fuse_time_encoding": mode,
                                                      "factor_time_encoding": "off"},
                                           "kernels": {"backend": "reference"}})
    monkeypatch.undo()
    assert fast.fastopt_report.count("time_encode") == 2  # the zero-Δt query and the keys
    off = fastopt.optimize(layer, config={"passes": {"fuse_time_encoding": "off"}})
    assert "fuse_time_encoding" not in off.fastopt_report.passes
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(5, 4, generator=g), torch.randn(5, 7, 4, generator=g),
            torch.randn(5, 7, 3, generator=g), torch.rand(5, 7, generator=g) * 100,
            torch.rand(5, 7, generator=g) < 0.8)
    params = list(layer.parameters())
    want = layer(*args)
    got = fast(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    grads = zip(torch.autograd.grad(want.sum(), params), torch.autograd.grad(got.sum(), params))
    for a, b in grads:
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_time_encoding_factored_out_of_key_value_projections(backend):
    """TGAT's keys/values Linear(cat([h, e, cos(Linear(dt))])): the encoding's weight columns
    are multiplied into the queries (codegen.shared_attention); outputs and every parameter's
    gradient as eager, on the references and on the interpreted kernels; "off" leaves it."""
    import os

    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernels on the Triton interpreter")
    torch.manual_seed(0)
    layer = TemporalAttention(4, 3, 6, 8, num_heads=2, dropout=0.0).train()
    config = {"passes": {"factor_time_encoding": "always"}, "kernels": {"backend": backend}}
    fast = fastopt.optimize(layer, config=config)
    report = fast.fastopt_report
    assert report.count("shared_attention") == 1 and "factor_time_encoding" in report.passes
    off = fastopt.optimize(layer, config={"passes": {"factor_time_encoding": "off"}})
    assert "factor_time_encoding" not in off.fastopt_report.passes
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, 4, generator=g, requires_grad=True)
    args = (h, torch.randn(5, 7, 4, generator=g), torch.randn(5, 7, 3, generator=g),
            torch.rand(5, 7, generator=g) * 100, torch.rand(5, 7, generator=g) < 0.8)
    params = [h] + list(layer.parameters())
    want = layer(*args)
    with fconfig.patch(**{"kernels__backend": backend}):
        got = fast(*args)
        got_grads = torch.autograd.grad((got * got).sum(), params)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad((want * want).sum(), params), got_grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("heads", [1, 2, 3])
def test_per_head_product_is_the_batched_product(heads):
    """The factored attention's per-head products (one block-diagonal product): the values and
    both gradients of ``einsum("rha,hab->rhb")``, in float64."""
    from fastopt.passes.attention_layout import per_head_product

    g = torch.Generator().manual_seed(heads)
    x = torch.randn(11, heads, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(heads, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    got, want = per_head_product(x, w), torch.einsum("rha,hab->rhb", x, w)
    torch.testing.assert_close(got, want)
    grad = torch.randn(11, heads, 7, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (x, w), grad), torch.autograd.grad(want, (x, w), grad)):
        torch.testing.assert_close(a, b)


class _EinsumValuesHeadFirst(nn.Module):
    """Keys [M, K, H, d] but the weighted sum reads the values as [M, H, K, d] (K == H), or one
    neighbor set broadcast over all rows: layouts the factored attention must not take."""

    def __init__(self, broadcast: bool):
        super().__init__()
        self.broadcast = broadcast
        self.t, self.q = nn.Linear(1, 3), nn.Linear(5, 12)
        self.k, self.v = nn.Linear(8, 12), nn.Linear(8, 12)

    def forward(self, h, x, dt, mask):
        inp = torch.cat([x, torch.cos(self.t(dt.unsqueeze(-1)))], -1)
        if self.broadcast:
            q = self.q(h).view(4, 1, 2, 6)
            k, v = self.k(inp).view(1, 3, 2, 6), self.v(inp).view(1, 3, 2, 6)
            a = torch.softmax(((q * k).sum(-1) * 0.4).masked_fill(~mask[..., None], -1e9), 1)
            return (a.masked_fill(~mask[..., None], 0.0).unsqueeze(-1) * v).sum(1)
        q = self.q(h).view(4, 2, 6)
        k, v = self.k(inp).view(4, 2, 2, 6), self.v(inp).view(4, 2, 2, 6)
        m = ~mask[:, None, :]
        a = torch.softmax(torch.einsum("bhd,bjhd->bhj", q, k).masked_fill(m, -1e9), -1)
        return torch.einsum("bhj,bhjd->bhd", a.masked_fill(m, 0.0), v)


@pytest.mark.parametrize("broadcast", [False, True])
def test_factored_time_encoding_keeps_other_layouts_exact(broadcast):
    """Values read in another letter order than the keys, or keys shared by all rows: the
    factored path declines at run time and the result is eager's."""
    torch.manual_seed(0)
    layer = _EinsumValuesHeadFirst(broadcast)
    fast = fastopt.optimize(layer, config={"passes": {"factor_time_encoding": "always"}})
    slots = 3 if broadcast else 2
    lead = (1,) if broadcast else (4,)
    g = torch.Generator().manual_seed(2)
    args = (torch.randn(4, 5, generator=g), torch.randn(*lead, slots, 5, generator=g),
            torch.rand(*lead, slots, generator=g) * 10, torch.rand(4, slots, generator=g) < 0.9)
    args[3][:, 0] = True
    torch.testing.assert_close(fast(*args), layer(*args), rtol=1e-5, atol=1e-6)
    assert "the first call ran the code it replaces" in str(fast.fastopt_report)
