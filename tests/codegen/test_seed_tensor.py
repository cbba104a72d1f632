"""Dropout keys held in device memory (what a captured CUDA graph needs): same masks as int keys."""

from __future__ import annotations

import pytest
import torch

import fastopt.codegen as cg
import fastopt.config as fconfig
from codegen_inputs import neighbors
from fastopt.errors import KernelError


def _args(device, rows=5, slots=6, heads=2, dim=8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, heads, dim, generator=g).to(device).requires_grad_()
    k = torch.randn(rows, slots, heads, dim, generator=g).to(device).requires_grad_()
    v = torch.randn(rows, slots, heads, dim, generator=g).to(device).requires_grad_()
    return q, k, v, neighbors(rows, slots, g, device).mask


def test_tensor_seed_gives_the_int_seeds_mask_forward_and_backward(device, triton_backend):
    """Same mask: equal up to float order (the two keys compile to two kernels, which may contract
    multiply-adds differently), while another key's mask changes outputs by O(1)."""
    q, k, v, mask = _args(device)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device)
    by_int = cg.temporal_attention(q, k, v, mask, dropout_p=0.3, seed=12345)
    seed = torch.tensor([12345], device=device)
    by_tensor = cg.temporal_attention(q, k, v, mask, dropout_p=0.3, seed=seed)
    torch.testing.assert_close(by_tensor, by_int, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(by_int, (q, k, v), grad),
                    torch.autograd.grad(by_tensor, (q, k, v), grad)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    other = cg.temporal_attention(q, k, v, mask, dropout_p=0.3, seed=torch.tensor([777], device=device))
    assert float((other - by_int).abs().max()) > 1e-2  # the kernel reads the key, it does not ignore it


def test_dropout_seed_is_a_device_tensor_where_the_kernels_run(device, triton_backend):
    q, _, _, _ = _args(device)
    seed = cg.dropout_seed(q)
    assert isinstance(seed, torch.Tensor) and seed.device == q.device and seed.numel() == 1
    with fconfig.patch(kernels__backend="reference"):
        assert isinstance(cg.dropout_seed(q), int)


def test_tensor_seed_on_the_reference_path_is_read_back():
    q, k, v, mask = _args("cpu")
    with fconfig.patch(kernels__backend="reference"):
        a = cg.temporal_attention(q, k, v, mask, dropout_p=0.3, seed=99)
        b = cg.temporal_attention(q, k, v, mask, dropout_p=0.3, seed=torch.tensor([99]))
    assert torch.equal(a, b)


@pytest.mark.parametrize("seed, match", [
    (torch.tensor([1.0]), "one int32/int64 element"),
    (torch.tensor([1, 2]), "one int32/int64 element"),
])
def test_bad_tensor_seed_names_value_and_fix(seed, match):
    q, k, v, mask = _args("cpu")
    with pytest.raises(KernelError, match=match):
        cg.temporal_attention(q, k, v, mask, dropout_p=0.3, seed=seed)


def test_tensor_seed_beyond_the_key_range_is_reduced_as_the_op_reduces_it(device, triton_backend):
    """A key of 2**31 + 5 in memory draws the mask of key 5, in the kernels and in the op that
    reads the key back (unchecked: checking would need a device sync)."""
    q, k, v, mask = _args(device)
    by_int = cg.temporal_attention(q, k, v, mask, dropout_p=0.3, seed=5)
    big = torch.tensor([2**31 + 5], device=device)
    torch.testing.assert_close(cg.temporal_attention(q, k, v, mask, dropout_p=0.3, seed=big),
                               by_int, rtol=1e-5, atol=1e-6)
    with fconfig.patch(kernels__backend="reference"):
        ref = cg.temporal_attention(q.cpu(), k.cpu(), v.cpu(), mask.cpu(), dropout_p=0.3,
                                    seed=big.cpu())
    torch.testing.assert_close(ref, by_int.cpu(), rtol=1e-5, atol=1e-6)


def test_backward_keeps_the_forward_key_when_the_tensor_changes(device, triton_backend):
    q, k, v, mask = _args(device)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(device)
    want = torch.autograd.grad(cg.temporal_attention(q, k, v, mask, dropout_p=0.3, seed=11),
                               (q, k, v), grad)
    seed = torch.tensor([11], device=device)
    out = cg.temporal_attention(q, k, v, mask, dropout_p=0.3, seed=seed)
    seed.fill_(12)  # e.g. the next step's key drawn into the same buffer
    for a, b in zip(want, torch.autograd.grad(out, (q, k, v), grad)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
