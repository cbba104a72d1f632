"""Generated matmul kernels of the projections (``codegen.linear``) against float64 products."""

from __future__ import annotations

import pytest
import torch

import fastopt.codegen as cg
import fastopt.config as fconfig
from codegen_inputs import rel_error
from fastopt.codegen.families import matmul
from fastopt.errors import ConfigError, KernelError

pytestmark = pytest.mark.usefixtures("triton_backend")


def _randn(*shape, device, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize("precision", ["tf32x3", "ieee"])
@pytest.mark.parametrize("rows, depth, cols", [(70, 45, 30), (600, 172, 100), (5, 3, 200)])
def test_linear_and_its_gradients_match_float64(precision, rows, depth, cols, device):
    """Forward, input/weight/bias/residual gradients; 600 rows split the weight gradient's rows
    over programs (partials summed in order)."""
    x = _randn(rows, depth, device=device, seed=0).requires_grad_()
    w = _randn(cols, depth, device=device, seed=1).requires_grad_()
    bias = _randn(cols, device=device, seed=2).requires_grad_()
    residual = _randn(rows, cols, device=device, seed=3).requires_grad_()
    grad = _randn(rows, cols, device=device, seed=4)
    with fconfig.patch(kernels__matmul_precision=precision):
        out = cg.linear(x, w, bias, residual)
        got = torch.autograd.grad(out, (x, w, bias, residual), grad)
    doubles = [t.detach().double().requires_grad_() for t in (x, w, bias, residual)]
    ref = doubles[0] @ doubles[1].t() + doubles[2] + doubles[3]
    want = torch.autograd.grad(ref, doubles, grad.double())
    assert rel_error(out, ref) < 1e-5
    for name, a, b in zip("x w bias residual".split(), got, want):
        assert rel_error(a, b) < 1e-5, name


def test_linear_reads_strided_operands_in_place(device):
    """A column block of a wider tensor (the parts of a split Linear) and a transposed weight."""
    wide = _randn(64, 90, device=device, seed=5)
    x = wide[:, 10:50]
    w = _randn(40, 30, device=device, seed=6).t()  # [30, 40] with strides (1, 30)
    with fconfig.patch(kernels__matmul_precision="ieee"):
        out = cg.linear(x, w)
    assert rel_error(out, x.double() @ w.double().t()) < 1e-5


def test_weight_gradient_rows_split_only_when_tiles_are_few():
    cpu = torch.device("cpu")
    assert matmul._splits(1, 600, 32, cpu) == 4  # 4 "processors" off the GPU, 600 // 128 spans
    assert matmul._splits(1, 100, 32, cpu) == 1  # too shallow to split
    assert matmul._splits(8, 60000, 32, cpu) == 1  # tiles enough to fill the processors


@pytest.mark.parametrize("tile", [dict(kernels__matmul_block_m=16, kernels__matmul_block_n=32,
                                       kernels__matmul_block_k=16, kernels__matmul_warps=2),
                                  dict(kernels__matmul_block_m=128, kernels__matmul_block_k=64)])
def test_matmul_tiles_agree(tile, device):
    x = _randn(150, 70, device=device, seed=10).requires_grad_()
    w = _randn(90, 70, device=device, seed=11).requires_grad_()
    with fconfig.patch(kernels__matmul_precision="ieee", **tile):
        out = cg.linear(x, w)
        dx, dw = torch.autograd.grad(out.sum(), (x, w))
    assert rel_error(out, x.double() @ w.double().t()) < 1e-5
    ones = torch.ones(150, 90, dtype=torch.float64, device=device)
    assert rel_error(dx, ones @ w.double()) < 1e-5 and rel_error(dw, ones.t() @ x.double()) < 1e-5


def test_matmul_tile_knobs_are_checked():
    with pytest.raises(ConfigError, match="kernels.matmul_block_k"):
        with fconfig.patch(kernels__matmul_block_k=24):
            pass


def test_linear_off_is_addmm():
    x, w, b, r = torch.randn(6, 5), torch.randn(4, 5), torch.randn(4), torch.randn(6, 4)
    assert torch.equal(cg.linear(x, w, b), torch.addmm(b, x, w.t()))
    assert torch.equal(cg.linear(x, w, residual=r), torch.addmm(r, x, w.t()))
    assert torch.equal(cg.linear(x, w), torch.mm(x, w.t()))


def test_split_and_merged_projections_run_on_the_generated_matmuls(device):
    """TGAT's keys and values (two Linears of [state, edge, encoding], merged and split by the
    passes) with matmul_precision set: same values and gradients as the eager layer."""
    from torch import nn

    from fastopt.passes import SplitLinearInputs, trace

    class KeysValues(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(1, 6)
            self.w_k = nn.Linear(4 + 7 + 6, 8)
            self.w_v = nn.Linear(4 + 7 + 6, 8)

        def forward(self, h, edge, dt):
            kv_in = torch.cat([h, edge, torch.cos(self.enc(dt))], dim=-1)
            key = self.w_k(kv_in).view(5, 3, 2, 4)
            value = self.w_v(kv_in).view(5, 3, 2, 4)
            return (key * value).sum(-1)

    torch.manual_seed(0)
    model = KeysValues().to(device)
    gm, _ = SplitLinearInputs()(trace(model, training=False))
    h = _randn(5, 3, 4, device=device, seed=7).requires_grad_()
    edge, dt = _randn(5, 3, 7, device=device, seed=8), _randn(5, 3, 1, device=device, seed=9)
    params = [h] + list(model.parameters())
    want = model(h, edge, dt)
    want_grads = torch.autograd.grad(want.sum(), params)
    with fconfig.patch(kernels__matmul_precision="ieee"):
        got = gm(h, edge, dt)
        got_grads = torch.autograd.grad(got.sum(), params)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, depth, cols", [(0, 40, 30), (50, 0, 30), (50, 40, 0)])
def test_linear_of_empty_operands(rows, depth, cols, device):
    x = _randn(rows, depth, device=device, seed=12).requires_grad_()
    w = _randn(cols, depth, device=device, seed=13).requires_grad_()
    bias = _randn(cols, device=device, seed=14).requires_grad_()
    with fconfig.patch(kernels__matmul_precision="ieee"):
        out = cg.linear(x, w, bias)
        dx, dw, db = torch.autograd.grad(out.sum(), (x, w, bias))
    torch.testing.assert_close(out, torch.addmm(bias, x, w.t()))
    assert dx.shape == x.shape and dw.shape == w.shape
    torch.testing.assert_close(db, torch.full_like(bias, float(rows)))


def test_linear_with_a_strided_bias_or_broadcast_residual(device):
    """A bias read with a stride, and a residual broadcast over rows (which the kernels do not
    take: the addmm path runs), give addmm's values."""
    x, w = _randn(20, 8, device=device, seed=15), _randn(6, 8, device=device, seed=16)
    wide = _randn(6, 3, device=device, seed=17)
    with fconfig.patch(kernels__matmul_precision="ieee"):
        torch.testing.assert_close(cg.linear(x, w, wide[:, 1]), torch.addmm(wide[:, 1], x, w.t()))
        torch.testing.assert_close(cg.linear(x, w, residual=wide[:, 2]),
                                   torch.addmm(wide[:, 2], x, w.t()))


@pytest.mark.parametrize("x, w", [(torch.zeros(4, 5), torch.zeros(3, 6)),
                                  (torch.zeros(2, 4, 5), torch.zeros(3, 5))])
def test_linear_names_shapes_that_do_not_fit(x, w):
    with pytest.raises(KernelError, match=r"x \[M, K\] and w \[N, K\]; got x"):
        cg.linear(x, w)
