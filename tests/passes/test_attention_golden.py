"""Golden tests of fuse_temporal_attention: each style variant's Before becomes its Expected."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from fastopt.passes import FuseTemporalAttention, trace
from fastopt.passes.attention import fused_attention

from passes_helpers import graph_signature, neighbor_mask

fx.wrap("fused_attention")

M, K, H, D = 6, 5, 2, 3


def _run(before: nn.Module):
    gm = trace(before, training=False)
    p = FuseTemporalAttention()
    gm, modified = p(gm)
    return gm, p, modified


def _expected_graph(expected: nn.Module):
    gm = trace(expected, training=False)
    gm.graph.eliminate_dead_code()
    return gm


# ---------------------------------------------------------------------------- style variants
# Each variant: Before (user code), Expected (the fused call), inputs(q, k, v, mask) factory.


class MulSumBefore(nn.Module):  # TGAT's reference style
    def forward(self, q, k, v, mask):
        s = (q * k).sum(dim=-1) * 0.5
        s = s.masked_fill(~mask.unsqueeze(-1), -1e9)
        a = torch.softmax(s, dim=1).masked_fill(~mask.unsqueeze(-1), 0.0)
        return (a.unsqueeze(-1) * v).sum(dim=1)


class MulSumExpected(nn.Module):
    def forward(self, q, k, v, mask):
        return fused_attention(q, k, v, ~mask.unsqueeze(-1), None, scores="mul_sum:-1",
                               weighted="mul_sum:-1:1", softmax_dim=1, scale_ops=(("mul", 0.5),),
                               fill=-1e9, zeroed=True, dropout_p=0.0)


def mul_sum_inputs(mask):
    return (torch.randn(M, 1, H, D), torch.randn(M, K, H, D), torch.randn(M, K, H, D), mask)


class EinsumBefore(nn.Module):
    def forward(self, q, k, v, mask):
        s = torch.einsum("mhd,mkhd->mhk", q, k) / math.sqrt(3)
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
        a = F.softmax(s, dim=-1)
        a = a.masked_fill(~mask[:, None, :], 0.0)
        return torch.einsum("mhk,mkhd->mhd", a, v)


class EinsumExpected(nn.Module):
    def forward(self, q, k, v, mask):
        return fused_attention(q, k, v, ~mask[:, None, :], None, scores="einsum:mhd,mkhd->mhk",
                               weighted="einsum:mhk,mkhd->mhd", softmax_dim=-1,
                               scale_ops=(("div", math.sqrt(3)),), fill=float("-inf"),
                               zeroed=True, dropout_p=0.0)


def einsum_inputs(mask):
    return (torch.randn(M, H, D), torch.randn(M, K, H, D), torch.randn(M, K, H, D), mask)


class MatmulBefore(nn.Module):  # heads-first [M, H, 1, d] @ [M, H, d, K]
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.2)

    def forward(self, q, k, v, mask):
        s = q @ k.transpose(-2, -1) * 0.25
        fill = ~mask[:, None, None, :]
        a = s.masked_fill(fill, -1e10).softmax(-1)
        a = self.drop(a.masked_fill(fill, 0.0))
        return a @ v


class MatmulExpected(MatmulBefore):
    def forward(self, q, k, v, mask):
        return fused_attention(q, k, v, ~mask[:, None, None, :], self.drop, scores="matmul_t",
                               weighted="matmul", softmax_dim=-1, scale_ops=(("mul", 0.25),),
                               fill=-1e10, zeroed=True, dropout_p=0.0)


def matmul_inputs(mask):
    return (torch.randn(M, H, 1, D), torch.randn(M, H, K, D), torch.randn(M, H, K, D), mask)


class BmmBefore(nn.Module):  # single head, [M, 1, d] bmm [M, d, K]
    def forward(self, q, k, v, mask):
        s = torch.bmm(q, k.transpose(1, 2))
        s = s.masked_fill(~mask.unsqueeze(1), -1e9)
        a = torch.softmax(s, -1)
        a = a.masked_fill(~mask.unsqueeze(1), 0.0)
        return torch.bmm(a, v)


class BmmExpected(nn.Module):
    def forward(self, q, k, v, mask):
        return fused_attention(q, k, v, ~mask.unsqueeze(1), None, scores="matmul_t",
                               weighted="matmul", softmax_dim=-1, scale_ops=(), fill=-1e9,
                               zeroed=True, dropout_p=0.0)


def bmm_inputs(mask):
    return (torch.randn(M, 1, D), torch.randn(M, K, D), torch.randn(M, K, D), mask)


class UnzeroedInfBefore(nn.Module):  # rows without neighbors are NaN in eager, kept NaN
    def forward(self, q, k, v, mask):
        s = (q * k).sum(-1).masked_fill(~mask[..., None], float("-inf"))
        return (torch.softmax(s, dim=1)[..., None] * v).sum(1)


class UnzeroedInfExpected(nn.Module):
    def forward(self, q, k, v, mask):
        return fused_attention(q, k, v, ~mask[..., None], None, scores="mul_sum:-1",
                               weighted="mul_sum:-1:1", softmax_dim=1, scale_ops=(),
                               fill=float("-inf"), zeroed=False, dropout_p=0.0)


class UnzeroedLargeBefore(nn.Module):  # rows without neighbors average all values in eager
    def forward(self, q, k, v, mask):
        s = (q * k).sum(-1).masked_fill(~mask[..., None], -1e9)
        a = F.dropout(torch.softmax(s, dim=1), 0.1, training=False)
        return (a.unsqueeze(-1) * v).sum(1)


class UnzeroedLargeExpected(nn.Module):
    def forward(self, q, k, v, mask):
        return fused_attention(q, k, v, ~mask[..., None], None, scores="mul_sum:-1",
                               weighted="mul_sum:-1:1", softmax_dim=1, scale_ops=(), fill=-1e9,
                               zeroed=False, dropout_p=0.0)


VARIANTS = {
    "mul_sum": (MulSumBefore, MulSumExpected, mul_sum_inputs),
    "einsum": (EinsumBefore, EinsumExpected, einsum_inputs),
    "matmul": (MatmulBefore, MatmulExpected, matmul_inputs),
    "bmm": (BmmBefore, BmmExpected, bmm_inputs),
    "unzeroed_inf": (UnzeroedInfBefore, UnzeroedInfExpected, mul_sum_inputs),
    "unzeroed_large": (UnzeroedLargeBefore, UnzeroedLargeExpected, mul_sum_inputs),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_before_becomes_expected(name):
    before_cls, expected_cls, _ = VARIANTS[name]
    gm, p, modified = _run(before_cls().eval())
    assert modified and p.matches == 1
    assert graph_signature(gm) == graph_signature(_expected_graph(expected_cls().eval()))


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("k", [1, 7])
def test_numerics_on_fresh_inputs(name, k):
    global K
    before_cls, _, inputs = VARIANTS[name]
    saved, K = K, k
    try:
        torch.manual_seed(k)
        args = inputs(neighbor_mask(M, k))
    finally:
        K = saved
    before = before_cls().eval()
    gm, p, _ = _run(before)
    leaves = [a.requires_grad_() for a in args[:3]]
    expected, got = before(*args), gm(*args)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, equal_nan=True)
    finite = torch.isfinite(expected)
    ge = torch.autograd.grad(expected[finite].sum(), leaves, allow_unused=True)
    gg = torch.autograd.grad(got[finite].sum(), leaves, allow_unused=True)
    rows = args[3].any(1)  # eager gradients of NaN rows are NaN; compare rows with neighbors
    for a, b in zip(ge, gg):
        torch.testing.assert_close(b[rows], a[rows], rtol=1e-4, atol=1e-5)


@pytest.mark.usefixtures("reference_backend")
def test_fused_operator_runs_not_the_fallback(monkeypatch):
    calls = []
    import fastopt.codegen as codegen

    real = codegen.temporal_attention
    monkeypatch.setattr(codegen, "temporal_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gm, _, _ = _run(MulSumBefore().eval())
    gm(*mul_sum_inputs(neighbor_mask(M, K)))
    assert calls == [1]


def test_heads_with_their_own_mask_become_rows():
    # The mask varies along heads: each (row, head) pair becomes its own destination row.
    gm, p, _ = _run(MulSumBefore().eval())
    q, k, v, _ = mul_sum_inputs(None)
    mask = torch.rand(M, K, H) < 0.6

    class PerHead(nn.Module):
        def forward(self, q, k, v, mask):
            s = (q * k).sum(dim=-1) * 0.5
            s = s.masked_fill(~mask, -1e9)
            a = torch.softmax(s, dim=1).masked_fill(~mask, 0.0)
            return (a.unsqueeze(-1) * v).sum(dim=1)

    before = PerHead()
    gm, p, _ = _run(before)
    assert p.matches == 1
    torch.testing.assert_close(gm(q, k, v, mask), before(q, k, v, mask), rtol=1e-4, atol=1e-5)
