"""``fused_op``, the one registration helper: what it registers for a toy operator.

The toy ``fastopt::test_row_scale`` has an output with a gradient, one without (saved for the
backward), two inputs with gradients around an optional tensor and a float; its "launcher" is
the reference with a call counter, so the tests see which implementation ran.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import pytest
import torch
from torch import Tensor

import fastopt.config as fconfig
from fastopt.codegen.library import fused_op
from fastopt.errors import KernelError

CALLS = []


def _forward(x: Tensor, s: Tensor, *, weight: Optional[Tensor], shift: float):
    out = x * s[:, None] + shift
    if weight is not None:
        out = out * weight
    return out, out.square().sum(-1)


def _backward(grad_out: Tensor, x: Tensor, s: Tensor, out: Tensor, norm: Tensor, *,
              weight: Optional[Tensor], shift: float):
    assert norm.shape == s.shape and out.shape == x.shape, "the saved outputs come in order"
    g = grad_out if weight is None else grad_out * weight
    return g * s[:, None], (g * x).sum(-1)


def _launch(*args, **kwargs):
    CALLS.append("forward")
    return _forward(*args, **kwargs)


def _launch_backward(*args, **kwargs):
    CALLS.append("backward")
    return _backward(*args, **kwargs)


def _eager_backward(*args, **kwargs):
    CALLS.append("eager backward")
    return _backward(*args, **kwargs)


@fused_op("test_row_scale", grad_inputs=("x", "s"), outputs=("out", "norm"),
          nondifferentiable=("norm",), save_outputs=True, forward=(_launch, _forward),
          backward=(_launch_backward, _backward), eager_backward=_eager_backward)
def row_scale(x: Tensor, weight: Optional[Tensor], s: Tensor,
              shift: float) -> Tuple[Tensor, Tensor]:
    return torch.empty_like(x), s.new_empty(s.shape)


def _inputs(weighted: bool):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    s = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 3, generator=gen, dtype=torch.float64) if weighted else None
    return x, weight, s, 0.5


def test_the_schemas_follow_the_fake_and_the_declared_outputs():
    assert str(torch.ops.fastopt.test_row_scale.default._schema) == (
        "fastopt::test_row_scale(Tensor x, Tensor? weight, Tensor s, float shift) "
        "-> (Tensor, Tensor)")
    assert str(torch.ops.fastopt.test_row_scale_backward.default._schema) == (
        "fastopt::test_row_scale_backward(Tensor grad_out, Tensor x, Tensor s, Tensor out, "
        "Tensor norm, Tensor? weight, float shift) -> (Tensor, Tensor)")


@pytest.mark.parametrize("weighted", [False, True])
def test_opcheck_passes(weighted):
    """torch's own checks of a custom op: schema, fake, autograd registration, dispatch."""
    with fconfig.patch(kernels__backend="reference"):
        torch.library.opcheck(torch.ops.fastopt.test_row_scale.default, _inputs(weighted))


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("backend,forward,backward", [
    ("reference", [], []),
    pytest.param("triton", ["forward"], ["backward"], marks=pytest.mark.interpreter),  # backend 'triton' needs it
])
def test_values_gradients_and_the_implementation_that_ran(backend, forward, backward, eager):
    x, weight, s, shift = _inputs(True)
    want = x.detach() * s.detach()[:, None] * weight + shift * weight
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend on CPU tensors needs the interpreter")
    CALLS.clear()
    with fconfig.patch(kernels__backend=backend):
        out = row_scale(x, weight, s, shift, eager=eager)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
        dx, ds = torch.autograd.grad(out, (x, s), grad)
    assert isinstance(out, Tensor), "the output without a gradient is not returned"
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(dx, grad * weight * s.detach()[:, None])
    torch.testing.assert_close(ds, (grad * weight * x.detach()).sum(-1))
    if eager:  # the twin runs the launchers whatever the backend
        assert CALLS == ["forward", "eager backward"]
    else:
        assert CALLS == forward + backward


def test_fake_tensors_and_compile_see_one_op():
    x, weight, s, shift = _inputs(False)
    with torch._subclasses.FakeTensorMode():
        fx, fs = torch.empty(4, 2), torch.empty(4)
        out = row_scale(fx, None, fs, 1.0)
        assert out.shape == (4, 2)
    compiled = torch.compile(lambda x, s: row_scale(x, None, s, 0.25), backend="aot_eager",
                             fullgraph=True)
    with fconfig.patch(kernels__backend="reference"):
        torch.testing.assert_close(compiled(x, s), row_scale(x, None, s, 0.25))


def test_a_declaration_that_names_no_argument_is_refused():
    def fake(x: Tensor) -> Tensor:
        return torch.empty_like(x)

    with pytest.raises(KernelError, match="grad_inputs \\('y',\\) must name inputs of \\('x',\\)"):
        fused_op("test_misnamed", grad_inputs=("y",), forward=(_forward, _forward),
                 backward=(_backward, _backward))(fake)
    with pytest.raises(KernelError, match="nondifferentiable"):
        fused_op("test_misnamed", grad_inputs=("x",), nondifferentiable=("out",),
                 forward=(_forward, _forward), backward=(_backward, _backward))(fake)
