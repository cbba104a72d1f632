"""Generated column sums (``codegen.column_sum``) and the projections whose bias gradients they
sum (``codegen.linear(bias_grad="column_sum")``, the rewritten Linears with
``passes.bias_grad_kernel``) against float64 and the unfused layers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fastopt.codegen as cg
import fastopt.config as fconfig
from codegen_inputs import rel_error
from fastopt.errors import ConfigError, KernelError

pytestmark = pytest.mark.usefixtures("triton_backend")


def _randn(*shape, device, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


@pytest.mark.parametrize("rows, cols", [(1, 1), (7, 3), (600, 200), (5000, 100), (300, 513),
                                        (0, 4), (4, 0)])
def test_column_sums_match_float64(rows, cols, device):
    """Row chunks and column blocks of every size class: one chunk, many chunks, a column block
    wider than the tile (513 > 256), empty matrices; summed twice, bit for bit the same."""
    x = _randn(rows, cols, device=device, seed=rows + cols)
    got = cg.column_sum(x)
    assert got.shape == (cols,) and got.dtype == x.dtype and got.device == x.device
    if rows and cols:
        assert rel_error(got, x.double().sum(0)) < 1e-5
    else:
        assert torch.equal(got.cpu(), torch.zeros(cols))
    assert torch.equal(cg.column_sum(x), got), "the order of the sums must not vary"


def test_column_sums_of_strided_rows_and_half_precision(device):
    """A column block of a wider matrix is read in place; bfloat16 accumulates in float32."""
    wide = _randn(300, 50, device=device, seed=1)
    assert rel_error(cg.column_sum(wide[:, 7:37]), wide[:, 7:37].double().sum(0)) < 1e-5
    half = _randn(900, 40, device=device, seed=2, dtype=torch.bfloat16)
    got = cg.column_sum(half)
    assert got.dtype == torch.bfloat16
    assert rel_error(got.float(), half.double().sum(0)) < 1e-2  # bfloat16's own rounding
    transposed = _randn(40, 30, device=device, seed=3).t()  # column stride 30: torch sums it
    assert rel_error(cg.column_sum(transposed), transposed.double().sum(0)) < 1e-5


def test_column_sum_names_what_is_not_a_matrix():
    with pytest.raises(KernelError, match=r"\[M, N\] matrix; got shape \(2, 3, 4\)"):
        cg.column_sum(torch.zeros(2, 3, 4))


@pytest.mark.parametrize("residual", [False, True])
def test_linear_with_column_sum_bias_gradient_matches_float64(residual, device):
    x = _randn(700, 45, device=device, seed=4).requires_grad_()
    w = _randn(30, 45, device=device, seed=5).requires_grad_()
    bias = _randn(30, device=device, seed=6).requires_grad_()
    res = _randn(700, 30, device=device, seed=7).requires_grad_() if residual else None
    grad = _randn(700, 30, device=device, seed=8)
    inputs = [t for t in (x, w, bias, res) if t is not None]
    out = cg.linear(x, w, bias, res, bias_grad="column_sum")
    assert out.grad_fn is not None and "ColumnSumBias" in type(out.grad_fn).__name__
    got = torch.autograd.grad(out, inputs, grad)
    doubles = [t.detach().double().requires_grad_() for t in inputs]
    ref = doubles[0] @ doubles[1].t() + doubles[2] + (doubles[3] if residual else 0)
    want = torch.autograd.grad(ref, doubles, grad.double())
    assert rel_error(out, ref) < 1e-5
    for name, a, b in zip("x w bias residual".split(), got, want):
        assert rel_error(a, b) < 1e-5, name


def test_linear_without_bias_gradient_stays_addmm():
    x, w, b = torch.randn(6, 5), torch.randn(4, 5), torch.randn(4)
    out = cg.linear(x, w, b, bias_grad="column_sum")  # the bias needs no gradient
    assert out.grad_fn is None and torch.equal(out, torch.addmm(b, x, w.t()))


def test_bias_grad_kernel_knob_is_checked():
    with pytest.raises(ConfigError, match="passes.bias_grad_kernel"):
        with fconfig.patch(passes__bias_grad_kernel="sometimes"):
            pass


def test_rewritten_projections_sum_bias_gradients_by_the_kernel(device, monkeypatch):
    """``passes.bias_grad_kernel="always"``: split and merged Linears (TGAT's style) and a fused
    nn.MultiheadAttention's projections (TGN's) give the eager layers' values and gradients."""
    import fastopt
    from fastopt.codegen.families import column_sum
    from fastopt.models.layers import MultiheadTemporalAttention, TemporalAttention

    summed = []
    monkeypatch.setattr(column_sum, "launch",
                        lambda x, sum_=column_sum.launch: summed.append(x.shape) or sum_(x))

    torch.manual_seed(0)
    rows, slots = 6, 5
    for layer in (TemporalAttention(8, 7, 6, 8, 2, 0.0),
                  MultiheadTemporalAttention(8, 7, 6, 8, 2, 0.0)):
        layer = layer.to(device).train()
        h_dst = _randn(rows, 8, device=device, seed=9).requires_grad_()
        h_nbr = _randn(rows, slots, 8, device=device, seed=10).requires_grad_()
        edge = _randn(rows, slots, 7, device=device, seed=11)
        dt = _randn(rows, slots, device=device, seed=12).abs()
        mask = torch.rand(rows, slots, generator=torch.Generator().manual_seed(13)) < 0.7
        args = (h_dst, h_nbr, edge, dt, mask.to(device))
        params = [h_dst, h_nbr] + list(layer.parameters())
        want = layer(*args)
        want_grads = torch.autograd.grad(want.square().sum(), params)
        # the exact values: the layer in float64 (its LayerNorm's backward cancels, so float32
        # gradients carry rounding errors far above float32's epsilon relative to their size)
        exact = copy.deepcopy(layer).double()
        exact_args = [a.detach().double().requires_grad_() if a.is_floating_point() else a for a in args]
        exact_out = exact(*exact_args)
        exact_grads = torch.autograd.grad(exact_out.square().sum(), exact_args[:2] + list(exact.parameters()))
        with fconfig.patch(passes__bias_grad_kernel="always", passes__cuda_graphs="off"):
            fast = fastopt.optimize(layer)
            got = fast(*args)
            got_grads = torch.autograd.grad(got.square().sum(), params)
        assert fast.fastopt_report.rewrites, "the layer was not rewritten"
        assert len(summed) >= 2, "the projections' bias gradients did not reach the kernel"
        summed.clear()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b, x in zip(got_grads, want_grads, exact_grads):
            # as close to the exact gradient as eager float32 is, within a small factor
            error, eager_error = (a.double() - x).abs().max(), (b.double() - x).abs().max()
            assert error <= 4 * eager_error + 1e-6, (error, eager_error)
