"""Golden tests of the other pattern families, and near misses that must be left alone."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import fastopt.config as fconfig
from fastopt.passes import (FuseMaskedAggregation, FuseMultiheadAttention, FuseSdpaAttention,
                            FuseTemporalAttention, FuseTimeEncoding, ProjectBeforeGather,
                            SplitLinearInputs, trace)
from fastopt.passes.aggregate import fused_masked_aggregate
from fastopt.passes.attention_mha import fused_multihead_attention
from fastopt.passes.attention_sdpa import fused_sdpa
from fastopt.passes.project_before_gather import project_rows
from fastopt.passes.sites import site_shapes
from fastopt.passes.split_linear_lowering import (adjacent_blocks, column_blocks, linear_over_parts,
                                                  linears_over_parts)
from fastopt.passes.time_encoding import fused_time_encode

from passes_helpers import graph_signature, neighbor_mask

for _name in ("fused_masked_aggregate", "fused_multihead_attention", "fused_sdpa",
              "fused_time_encode", "project_rows", "linear_over_parts"):
    fx.wrap(_name)

M, K, E = 6, 7, 8


def _check(before, expected, pass_cls, inputs, grads=True):
    gm = trace(before, training=False)
    p = pass_cls()
    gm, modified = p(gm)
    assert modified and p.matches == 1
    exp = trace(expected, training=False)
    exp.graph.eliminate_dead_code()
    assert graph_signature(gm) == graph_signature(exp)
    args = inputs()
    leaves = [a.requires_grad_() for a in args if a.is_floating_point()]
    ref, got = before(*args), gm(*args)
    ref, got = (ref[0], got[0]) if isinstance(ref, tuple) else (ref, got)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    if grads:
        params = leaves + list(before.parameters())
        ga = torch.autograd.grad(ref.sum(), params, allow_unused=True)
        gb = torch.autograd.grad(got.sum(), params, allow_unused=True)
        for a, b in zip(ga, gb):
            if a is not None:
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention(batch_first):
    class Before(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(E, 2, kdim=5, vdim=5, batch_first=batch_first)

        def forward(self, query, kv, padding):
            out, _ = self.attn(query, kv, kv, key_padding_mask=padding, need_weights=False)
            return out

    class Expected(Before):
        def forward(self, query, kv, padding):
            out, _ = fused_multihead_attention(self.attn, query, kv, kv, padding, need_weights=False)
            return out

    def inputs():
        q, kv = torch.randn(M, 1, E), torch.randn(M, K, 5)
        if not batch_first:
            q, kv = q.transpose(0, 1), kv.transpose(0, 1)
        padding = ~neighbor_mask(M, K, empty_rows=0)
        padding[:, 0] = False
        return q, kv, padding

    torch.manual_seed(0)
    before = Before().eval()
    expected = Expected().eval()
    expected.load_state_dict(before.state_dict())
    _check(before, expected, FuseMultiheadAttention, inputs)


def test_sdpa_with_boolean_mask():
    class Before(nn.Module):
        def forward(self, q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])

    class Expected(nn.Module):
        def forward(self, q, k, v, mask):
            return fused_sdpa(q, k, v, mask[:, None, None, :], dropout_p=0.0, scale=None)

    def inputs():
        return (torch.randn(M, 2, 1, 4), torch.randn(M, 2, K, 4), torch.randn(M, 2, K, 4),
                neighbor_mask(M, K))

    _check(Before(), Expected(), FuseSdpaAttention, inputs)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_masked_aggregation(reduce):
    class Before(nn.Module):
        def forward(self, x, mask):
            s = (x * mask.unsqueeze(-1)).sum(1)
            return s / mask.sum(1, keepdim=True).clamp(min=1) if reduce == "mean" else s

    class Expected(nn.Module):
        def forward(self, x, mask):
            weight = mask.unsqueeze(-1)
            count = mask.sum(1, keepdim=True).clamp(min=1) if reduce == "mean" else None
            return fused_masked_aggregate(x, weight, count, form="mul", dim=1, reduce=reduce,
                                          proven=False)

    _check(Before(), Expected(), FuseMaskedAggregation,
           lambda: (torch.randn(M, K, 3), neighbor_mask(M, K)))


def test_masked_fill_aggregation():
    class Before(nn.Module):
        def forward(self, x, mask):
            return x.masked_fill(~mask[..., None], 0.0).sum(dim=1)

    class Expected(nn.Module):
        def forward(self, x, mask):
            return fused_masked_aggregate(x, ~mask[..., None], None, form="fill", dim=1,
                                          reduce="sum", proven=True)

    _check(Before(), Expected(), FuseMaskedAggregation,
           lambda: (torch.randn(M, K, 3), neighbor_mask(M, K)))


def test_time_encoding():
    class Before(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(1, 5)

        def forward(self, dt):
            return torch.cos(self.w(dt.unsqueeze(-1)))

    class Expected(Before):
        def forward(self, dt):
            return fused_time_encode(dt, self.w)

    torch.manual_seed(0)
    before, expected = Before(), Expected()
    expected.load_state_dict(before.state_dict())
    _check(before, expected, FuseTimeEncoding, lambda: (torch.rand(M, K) * 100,))


def test_project_before_gather():
    class Before(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 3)

        def forward(self, table, index):
            return self.proj(table[index])

    class Expected(Before):
        def forward(self, table, index):
            return project_rows(self.proj, table, index)

    torch.manual_seed(0)
    before, expected = Before(), Expected()
    expected.load_state_dict(before.state_dict())
    _check(before, expected, ProjectBeforeGather,
           lambda: (torch.randn(5, 4), torch.randint(0, 5, (M, K))))



def test_lone_gathered_part_is_projected_before_its_gather(monkeypatch):
    """Keys and values whose input is one gathered table beside a zero-width part (TGAT's first
    layer once its time encoding is factored out): the table's rows are projected, then gathered,
    and values and weight gradients are the concatenation's."""
    import fastopt.passes.split_linear_lowering as lowering

    calls = []
    projected = lowering._ProjectedRows.apply
    monkeypatch.setattr(lowering._ProjectedRows, "apply",
                        lambda *a: calls.append(a[0].shape) or projected(*a))
    torch.manual_seed(0)
    w_k, w_v = nn.Linear(5 + 3, 4), nn.Linear(5 + 3, 4)
    table, index, empty = torch.randn(9, 5), torch.randint(0, 9, (M, K)), torch.zeros(M, K, 0)
    keep = [w[:, :5] for w in (w_k.weight, w_v.weight)]
    k, v = lowering.stacked_product(keep, [w_k, w_v], (empty, (table, index)), "")
    assert calls == [(9, 5)]
    ref = [F.linear(table[index], w[:, :5], lin.bias) for w, lin in zip(keep, (w_k, w_v))]
    g = torch.randn(M, K, 8)
    got_grads = torch.autograd.grad((torch.cat([k, v], -1) * g).sum(), [w_k.weight, w_k.bias, w_v.weight])
    ref_grads = torch.autograd.grad((torch.cat(ref, -1) * g).sum(), [w_k.weight, w_k.bias, w_v.weight])
    torch.testing.assert_close(torch.cat([k, v], -1), torch.cat(ref, -1))
    for got, want in zip(got_grads, ref_grads):
        torch.testing.assert_close(got, want)

class KeysValuesOverParts(nn.Module):
    """TGAT's keys and values: two projections of [neighbor state, edge features, encoding]."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(1, 3)
        self.w_k = nn.Linear(2 + 5 + 3, 4)
        self.w_v = nn.Linear(2 + 5 + 3, 4)

    def forward(self, h, edge, dt):
        kv_in = torch.cat([h, edge, torch.cos(self.enc(dt))], dim=-1)
        return self.w_k(kv_in), self.w_v(kv_in)


def test_split_linear_inputs():
    class Expected(KeysValuesOverParts):
        def forward(self, h, edge, dt):
            t = torch.cos(self.enc(dt))
            return linear_over_parts(self.w_k, h, edge, t), linear_over_parts(self.w_v, h, edge, t)

    torch.manual_seed(0)
    before, expected = KeysValuesOverParts(), Expected()
    expected.load_state_dict(before.state_dict())
    gm = trace(before, training=False)
    p = SplitLinearInputs()
    gm, modified = p(gm)
    assert modified and p.matches == 2
    assert not [n for n in gm.graph.nodes if n.target is torch.cat]  # no concatenation left
    exp = trace(expected, training=False)
    assert graph_signature(gm) == graph_signature(exp)
    # h needs gradients (an embedding), edge features do not: two groups, as in training
    for split in (True, False):
        h = torch.randn(M, K, 2, requires_grad=True)
        edge, dt = torch.randn(M, K, 5), torch.rand(M, K, 1)
        params = [h] + list(before.parameters())
        with fconfig.patch(passes__split_linear_inputs=split):
            ref, got = before(h, edge, dt), gm(h, edge, dt)
            for r, g in zip(ref, got):
                torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
            weights = [torch.randn_like(r) for r in ref]
            want = torch.autograd.grad(sum((w * r).sum() for w, r in zip(weights, ref)), params)
            have = torch.autograd.grad(sum((w * g).sum() for w, g in zip(weights, got)), params)
        for a, b in zip(want, have):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # nothing to split: the original concatenation and product
        torch.testing.assert_close(gm(h, edge, dt)[0], before(h, edge, dt)[0])


def test_split_linear_inputs_runs_the_original_where_splitting_would_change_it():
    """Hooks, a zero-width part that needs a gradient: the concatenation and the Linear as written."""
    torch.manual_seed(1)
    before = KeysValuesOverParts()
    gm, _ = SplitLinearInputs()(trace(before, training=False))
    edge, dt = torch.randn(M, K, 5), torch.rand(M, K, 1)
    handle = before.w_k.register_forward_hook(lambda mod, inp, out: out * 3.0)
    h = torch.randn(M, K, 2, requires_grad=True)
    torch.testing.assert_close(gm(h, edge, dt)[0], before(h, edge, dt)[0])
    handle.remove()

    class ZeroWidth(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(5, 4)

        def forward(self, h, edge):
            return self.proj(torch.cat([h, edge], dim=-1))

    z = ZeroWidth()
    gm, _ = SplitLinearInputs()(trace(z, training=False))
    h = torch.randn(M, 0, requires_grad=True)
    (grad,) = torch.autograd.grad(gm(h, torch.randn(M, 5)).sum(), [h])
    assert grad.shape == (M, 0)


class KeysValuesAttended(KeysValuesOverParts):
    """Keys and values viewed per head and consumed, as an attention layer does."""

    def forward(self, h, edge, dt):
        kv_in = torch.cat([h, edge, torch.cos(self.enc(dt))], dim=-1)
        key = self.w_k(kv_in).view(M, K, 2, 2)
        value = self.w_v(kv_in).view(M, K, 2, 2)
        return (key * value).sum(-1).softmax(1)


class KeysValuesOfRows(KeysValuesOverParts):
    """The edge part read per slot from a table of rows by an index (the batch's unique edges)."""

    def forward(self, h, rows, index, dt):
        kv_in = torch.cat([h, rows[index], torch.cos(self.enc(dt))], dim=-1)
        key = self.w_k(kv_in).view(M, K, 2, 2)
        value = self.w_v(kv_in).view(M, K, 2, 2)
        return (key * value).sum(-1).softmax(1)


@pytest.mark.parametrize("table_rows,rows_need_grad", [(5, False), (100, False), (5, True)])
def test_a_gathered_part_is_projected_before_its_gather(table_rows, rows_need_grad):
    """rows[index] inside the concatenation reaches the lowering as (rows, index): projected once
    per row when it is the part without gradient and the table is the smaller, else gathered first;
    the same values and gradients either way."""
    torch.manual_seed(0)
    before = KeysValuesOfRows().double()
    p = SplitLinearInputs()
    gm, modified = p(trace(before, training=False))
    assert modified and p.matches == 1
    (merged,) = _sibling_calls(gm)
    assert isinstance(merged.args[2], tuple)  # (rows, index), not a gathered tensor
    assert not [n for n in gm.graph.nodes if n.target is operator.getitem and n.args[0].op == "placeholder"]
    h = torch.randn(M, K, 2, dtype=torch.float64, requires_grad=True)
    rows = torch.randn(table_rows, 5, dtype=torch.float64, requires_grad=rows_need_grad)
    index = torch.randint(0, table_rows, (M, K))
    dt = torch.rand(M, K, 1, dtype=torch.float64)
    params = [h] + ([rows] if rows_need_grad else []) + list(before.parameters())
    ref, got = before(h, rows, index, dt), gm(h, rows, index, dt)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(ref)
    want = torch.autograd.grad((weights * ref).sum(), params)
    have = torch.autograd.grad((weights * got).sum(), params)
    for a, b in zip(want, have):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    projected_first = table_rows < M * K and not rows_need_grad
    shape = site_shapes(merged.kwargs["site"]) or ()  # (widths, rows, slots) if projected first
    assert (shape[2:] == (table_rows, M * K)) == projected_first


def _sibling_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and n.target is linears_over_parts]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sibling_linears_share_one_product(dtype):
    """w_k and w_v of one concatenation: one product of the stacked weights, same values and
    gradients (to rounding in float64), with the knob on or off, with and without gradients."""
    torch.manual_seed(0)
    before = KeysValuesAttended().to(dtype)
    p = SplitLinearInputs()
    gm, modified = p(trace(before, training=False))
    assert modified and p.matches == 1 and p.rewrites[0].op == "linears_over_parts"
    (merged,) = _sibling_calls(gm)
    modules = merged.args[0]
    assert [m.op for m in modules] == ["get_attr", "get_attr"]
    assert [m.target for m in modules] == ["w_k", "w_v"]
    assert not [n for n in gm.graph.nodes if n.target is torch.cat]
    assert not [n for n in gm.graph.nodes if n.op == "call_module" and n.target in ("w_k", "w_v")]
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for merge in (True, False):
        h = torch.randn(M, K, 2, dtype=dtype, requires_grad=True)
        edge, dt = torch.randn(M, K, 5, dtype=dtype), torch.rand(M, K, 1, dtype=dtype)
        params = [h] + list(before.parameters())
        with fconfig.patch(passes__merge_sibling_linears=merge):
            ref, got = before(h, edge, dt), gm(h, edge, dt)
            torch.testing.assert_close(got, ref, **tol)
            weight = torch.randn_like(ref)
            want = torch.autograd.grad((weight * ref).sum(), params)
            have = torch.autograd.grad((weight * gm(h, edge, dt)).sum(), params)
            for a, b in zip(want, have):
                torch.testing.assert_close(b, a, **tol)
            with torch.no_grad():  # stacked weights without the split
                torch.testing.assert_close(gm(h, edge, dt), before(h, edge, dt), **tol)


def test_sibling_linears_left_apart_where_a_user_needs_its_own_tensor():
    """Returned, modified in place, or viewed across the features: each Linear split on its own
    (and the in-place write, whose result nobody reads, survives the rewrite's dead-code pass)."""

    class InPlace(KeysValuesOverParts):
        def forward(self, h, edge, dt):
            kv_in = torch.cat([h, edge, torch.cos(self.enc(dt))], dim=-1)
            key = self.w_k(kv_in)
            key.add_(1.0)  # (``key += 1`` traces to an out-of-place add)
            return key * self.w_v(kv_in).view(M, K, 4)

    class Flattened(KeysValuesOverParts):
        def forward(self, h, edge, dt):
            kv_in = torch.cat([h, edge, torch.cos(self.enc(dt))], dim=-1)
            return self.w_k(kv_in).view(M, K * 4) * self.w_v(kv_in).view(M, K * 4)

    class FunctionalInPlace(KeysValuesOverParts):
        def forward(self, h, edge, dt):
            kv_in = torch.cat([h, edge, torch.cos(self.enc(dt))], dim=-1)
            key = F.relu(self.w_k(kv_in), inplace=True)
            return key * self.w_v(kv_in)

    class ViewThenInPlace(KeysValuesOverParts):
        def forward(self, h, edge, dt):
            kv_in = torch.cat([h, edge, torch.cos(self.enc(dt))], dim=-1)
            key = self.w_k(kv_in)
            key.view(M, K, 2, 2).mul_(2.0)
            return key * self.w_v(kv_in)

    class CopyThenInPlace(KeysValuesOverParts):
        def forward(self, h, edge, dt):
            kv_in = torch.cat([h, edge, torch.cos(self.enc(dt))], dim=-1)
            key = self.w_k(kv_in)
            key.contiguous().mul_(2.0)  # an alias of key in eager mode, a copy of a column block
            return key * self.w_v(kv_in)

    class ReturnedView(KeysValuesOverParts):
        def forward(self, h, edge, dt):
            kv_in = torch.cat([h, edge, torch.cos(self.enc(dt))], dim=-1)
            return self.w_k(kv_in).view(M, K, 2, 2), self.w_v(kv_in).view(M, K, 2, 2)

    for cls in (KeysValuesOverParts, InPlace, Flattened, FunctionalInPlace, ViewThenInPlace,
                CopyThenInPlace, ReturnedView):
        torch.manual_seed(0)
        before = cls()
        p = SplitLinearInputs()
        gm, modified = p(trace(before, training=False))
        assert modified and p.matches == 2 and not _sibling_calls(gm), cls.__name__
        h = torch.randn(M, K, 2, requires_grad=True)
        edge, dt = torch.randn(M, K, 5), torch.rand(M, K, 1)
        ref, got = before(h, edge, dt), gm(h, edge, dt)
        for r, g in zip(ref if isinstance(ref, tuple) else (ref,), got if isinstance(got, tuple) else (got,)):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_rewrites_keep_in_place_modules_and_drop_dead_masks():
    """Dead-code elimination after a rewrite keeps a module built with inplace=True whose result
    nobody reads, and still removes pure dead nodes (``a & b``)."""
    from fastopt.passes.pattern import writes_in_place

    class ActInPlace(KeysValuesOverParts):
        def __init__(self):
            super().__init__()
            self.act = nn.ReLU(inplace=True)

        def forward(self, h, edge, dt):
            kv_in = torch.cat([h, edge, torch.cos(self.enc(dt))], dim=-1)
            key = self.w_k(kv_in)
            self.act(key)
            return key

    torch.manual_seed(0)
    before = ActInPlace()
    gm, modified = SplitLinearInputs()(trace(before, training=False))
    assert modified and any(n.op == "call_module" and n.target == "act" for n in gm.graph.nodes)
    h = torch.randn(M, K, 2, requires_grad=True)
    edge, dt = torch.randn(M, K, 5), torch.rand(M, K, 1)
    torch.testing.assert_close(gm(h, edge, dt), before(h, edge, dt))
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    dead = graph.call_function(operator.and_, (a, b))
    graph.output(a)
    assert not writes_in_place(dead)
    graph.eliminate_dead_code(is_impure_node=writes_in_place)
    assert dead not in graph.nodes


def test_split_linear_inputs_leaves_other_concatenations():
    class AlongRows(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(5, 4)

        def forward(self, a, b):
            return self.proj(torch.cat([a, b], dim=0))

    p = SplitLinearInputs()
    gm, modified = p(trace(AlongRows(), training=False))
    assert not modified and p.matches == 0
    assert "dim 0" in p.left_alone[0].reason


# ----------------------------------------------------------------------------- near misses


class WrongDim(nn.Module):  # softmax over heads, sum over neighbors
    def forward(self, q, k, v, mask):
        s = (q * k).sum(-1).masked_fill(~mask[..., None], -1e9)
        a = torch.softmax(s, dim=2)
        return (a.unsqueeze(-1) * v).sum(1)


class AdditiveMask(nn.Module):  # float mask added to the scores
    def forward(self, q, k, v, mask):
        s = (q * k).sum(-1) + (mask[..., None].float() - 1.0) * 1e9
        a = torch.softmax(s, dim=1)
        return (a.unsqueeze(-1) * v).sum(1)


class SmallFill(nn.Module):  # -10 does not remove masked neighbors
    def forward(self, q, k, v, mask):
        s = (q * k).sum(-1).masked_fill(~mask[..., None], -10.0)
        return (torch.softmax(s, dim=1).unsqueeze(-1) * v).sum(1)


class LeakyScores(nn.Module):  # GAT-style activation on the scores
    def forward(self, q, k, v, mask):
        s = F.leaky_relu((q * k).sum(-1), 0.2).masked_fill(~mask[..., None], -1e9)
        return (torch.softmax(s, dim=1).unsqueeze(-1) * v).sum(1)


class WeightsReturned(nn.Module):  # the weights leave the subgraph
    def forward(self, q, k, v, mask):
        s = (q * k).sum(-1).masked_fill(~mask[..., None], -1e9)
        a = torch.softmax(s, dim=1)
        return (a.unsqueeze(-1) * v).sum(1), a


@pytest.mark.parametrize("cls, reason", [
    (WrongDim, "weighted sum reduces another dimension"),
    (AdditiveMask, "not masked with masked_fill"),
    (SmallFill, "is not -inf"),
    (LeakyScores, "LeakyReLU"),
    (WeightsReturned, "several users"),
])
def test_near_misses_are_left_alone(cls, reason):
    gm = trace(cls(), training=False)
    p = FuseTemporalAttention()
    _, modified = p(gm)
    assert not modified and p.matches == 0
    assert len(p.left_alone) == 1 and reason in p.left_alone[0].reason


def test_sdpa_with_float_mask_is_left_alone():
    class FloatMask(nn.Module):
        def forward(self, q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.float() * -1e9)

    p = FuseSdpaAttention()
    _, modified = p(trace(FloatMask(), training=False))
    assert not modified and "not boolean" in p.left_alone[0].reason


def test_float_weights_are_not_aggregated():
    class Weighted(nn.Module):
        def forward(self, x, w):
            return (x.float() * (w * 2.0).unsqueeze(-1)).sum(1)

    p = FuseMaskedAggregation()
    _, modified = p(trace(Weighted(), training=False))
    assert not modified and "0/1 mask" in p.left_alone[0].reason


def test_float_mask_of_unknown_dtype_runs_eager():
    x, w = torch.randn(M, K, 3), torch.rand(M, K, 1)
    torch.testing.assert_close(fused_masked_aggregate(x, w, None, form="mul", dim=1, reduce="sum", proven=False),
                               (x * w).sum(1))


@pytest.mark.parametrize("merge", [True, False])
def test_multihead_attention_keys_and_values_of_one_tensor(merge):
    """``attn(q, kv, kv)``: keys and values from one product of the stacked weights (or two),
    equal to ``nn.MultiheadAttention`` to rounding in float64, gradients included."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, 2, kdim=5, vdim=5, batch_first=True).double()
    query = torch.randn(M, 1, E, dtype=torch.float64)
    kv = torch.randn(M, K, 5, dtype=torch.float64, requires_grad=True)
    padding = torch.rand(M, K, generator=torch.Generator().manual_seed(1)) < 0.3
    padding[:, 0] = False
    params = [kv] + [p for p in mha.parameters() if p.requires_grad]
    with fconfig.patch(passes__merge_sibling_linears=merge):
        got, _ = fused_multihead_attention(mha, query, kv, kv, padding, need_weights=False)
        have = torch.autograd.grad(got.sum(), params, allow_unused=True)
    ref, _ = mha(query, kv, kv, key_padding_mask=padding, need_weights=False)
    want = torch.autograd.grad(ref.sum(), params, allow_unused=True)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(want, have):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_column_blocks_backward_is_splits():
    """Gradients of column blocks: taken whole when they are adjacent blocks of one tensor,
    concatenated otherwise (a missing one counts as zeros); equal to torch.split's either way."""
    y = torch.randn(3, 4, 10, requires_grad=True)
    k, v = column_blocks(y, (6, 4))
    whole = torch.randn(3, 4, 10)
    gk, gv = whole.split((6, 4), -1)
    layout = (y.shape, y.stride(), y.dtype)
    assert adjacent_blocks([gk, gv], *layout, (6, 4)).data_ptr() == whole.data_ptr()
    assert adjacent_blocks([gv, gk], *layout, (4, 6)) is None
    assert adjacent_blocks([gk.clone(), gv], *layout, (6, 4)) is None
    assert adjacent_blocks([gk, gv.neg()], *layout, (6, 4)) is None
    one_row = torch.randn(3, 1, 10)  # a size-1 dimension's stride does not matter
    assert adjacent_blocks(list(one_row.split((6, 4), -1)), (3, 1, 10), (10, 7, 1),
                           torch.float32, (6, 4)) is not None
    for grads in ((gk, gv), (gk.clone(), gv.clone()), (gk, None)):
        outs, used = zip(*[(o, g) for o, g in zip((k, v), grads) if g is not None])
        (got,) = torch.autograd.grad(outs, y, used, retain_graph=True)
        (want,) = torch.autograd.grad([o for o in y.split((6, 4), -1)][:len(used)], y, used)
        assert torch.equal(got, want)


def test_column_blocks_twice_differentiable():
    """create_graph=True: the blocks' backward is itself differentiable (torch.split's is)."""
    y = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)

    def second_derivative(blocks):
        k, v = blocks
        (g,) = torch.autograd.grad((k.sin().sum(1) * v.cos().sum(1)).sum(), y, create_graph=True)
        return torch.autograd.grad(g.square().sum(), y)[0]

    torch.testing.assert_close(second_derivative(column_blocks(y, (6, 4))),
                               second_derivative(y.split((6, 4), -1)))
