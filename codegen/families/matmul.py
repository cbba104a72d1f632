"""Matrix products of the projections (``matmul.py.jinja``) and :func:`linear`, which runs them.

``a @ b (+ residual) (+ bias)`` for float32 operands of any strides, in TensorFloat-32 parts
(``"tf32x3"``) or float32 multiply-adds (``"ieee"``); weight gradients, whose K spans the batch
rows, split K over programs when C has too few tiles to fill the GPU and sum the partials in a
fixed order. No custom op: :func:`linear` runs the products inside an ``autograd.Function`` where
:func:`~fastopt.codegen.library.eager_kernels` holds, and ``torch.addmm`` elsewhere.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from fastopt.codegen import kernels
from fastopt.codegen.families.column_sum import ColumnSumBias
from fastopt.codegen.kernel_config import KernelConfig
from fastopt.codegen.library import eager_kernels
from fastopt.config import default_config
from fastopt.errors import KernelError

__all__ = ["linear", "matmul"]

# Default tile of C per program and K slice per step (config.kernels.matmul_block_* override);
# K spans of weight-gradient products (K = batch rows) are split over programs when C has too
# few tiles to occupy the GPU.
MATMUL_TILE = (64, 64, 32)
MAX_SPLITS = 64


def _tile() -> Tuple[int, int, int, int]:
    knobs = default_config().kernels
    return (knobs.matmul_block_m or MATMUL_TILE[0], knobs.matmul_block_n or MATMUL_TILE[1],
            knobs.matmul_block_k or MATMUL_TILE[2], knobs.matmul_warps or 4)


def _kernel(device: torch.device, tile: Tuple[int, int, int, int],
                   **spec) -> kernels.Specialized:
    block_m, block_n, block_k, warps = tile
    cfg = KernelConfig(block_m=block_m, block_k=block_k, block_d=block_n, num_warps=warps,
                       num_stages=kernels.pipeline_stages(device))
    return kernels.fixed("matmul", device, cfg, block_m=block_m, block_n=block_n, block_k=block_k,
                         **spec)


class _Strides(tuple):
    """Element strides of a product's operands (A, B, C, the residual) by name, hashable."""

    am, ak, bk, bn, cm, cn, rm, rn = (property(lambda self, i=i: self[i]) for i in range(8))


def _strides(a: Tensor, b: Tensor, out: Optional[Tensor] = None,
             res: Optional[Tensor] = None) -> _Strides:
    # a split product writes contiguous partials and reads no residual: those strides are unused
    c = out.stride() if out is not None else (0, 0)
    r = res.stride() if res is not None else (0, 0)
    return _Strides((*a.stride(), *b.stride(), *c, *r))


def _splits(tiles: int, depth: int, block_k: int, device: torch.device) -> int:
    """K spans for a product of ``tiles`` C tiles over ``depth`` rows of K: enough programs for
    two per multiprocessor, each span at least four K slices deep."""
    processors = kernels.multiprocessors(device)
    if tiles >= processors:
        return 1
    return max(1, min(MAX_SPLITS, -(-2 * processors // tiles), depth // (4 * block_k)))


def matmul(a: Tensor, b: Tensor, *, bias: Optional[Tensor] = None,
           residual: Optional[Tensor] = None, precision: str = "tf32x3",
           row_sums: bool = False):
    """``a @ b (+ residual) (+ bias)`` for float32 ``a [M, K]``, ``b [K, N]`` of any strides;
    with ``row_sums``, ``(product, a.sum(1))``, the sums from the product's own reads of ``a``."""
    rows, depth = a.shape
    cols = b.shape[1]
    tile = _tile()
    block_m, block_n, block_k, _ = tile
    out = kernels.empty((rows, cols), torch.float32, a.device)
    if rows == 0 or cols == 0 or depth == 0:
        if depth == 0 and rows * cols:
            out.zero_()
            if residual is not None:
                out += residual
            if bias is not None:
                out += bias
        return (out, a.sum(1, dtype=torch.float32)) if row_sums else out
    tiles = (-(-rows // block_m), -(-cols // block_n))
    splits = _splits(tiles[0] * tiles[1], depth, block_k, a.device)
    span = -(-depth // splits)
    span = -(-span // block_k) * block_k
    splits = -(-depth // span)
    sums = kernels.empty((splits, rows), torch.float32, a.device) if row_sums else out
    if splits > 1:
        part = kernels.empty((splits, rows, cols), torch.float32, a.device)
        kernel = _kernel(a.device, tile, precision=precision, split=True, residual=False,
                                bias=False, row_sums=row_sums, strides=_strides(a, b))
        kernel.fn[(tiles[0], tiles[1], splits)](
            a, b, part, part, part, sums, rows, cols, depth, span, num_warps=kernel.cfg.num_warps,
            num_stages=kernel.cfg.num_stages)
        torch.sum(part, 0, out=out)
        if residual is not None:
            out += residual
        if bias is not None:
            out += bias
    else:
        res = residual if residual is not None else out
        kernel = _kernel(a.device, tile, precision=precision, split=False,
                                residual=residual is not None, bias=bias is not None,
                                row_sums=row_sums, strides=_strides(a, b, out, res))
        kernel.fn[(tiles[0], tiles[1], 1)](
            a, b, out, res, bias if bias is not None else out, sums, rows, cols, depth, depth,
            num_warps=kernel.cfg.num_warps, num_stages=kernel.cfg.num_stages)
    return (out, sums.sum(0)) if row_sums else out


class _Linear(torch.autograd.Function):
    """``x @ w^T (+ bias) (+ residual)`` and its gradients by the generated matmul kernels."""

    @staticmethod
    def forward(ctx, x, w, bias, residual, precision):
        ctx.save_for_backward(x, w)
        ctx.precision = precision
        return matmul(x, w.t(), bias=bias, residual=residual, precision=precision)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        need_x, need_w, need_bias, need_residual, _ = ctx.needs_input_grad
        dx = matmul(grad, w, precision=ctx.precision) if need_x else None
        dw = dbias = None
        if need_w and need_bias:  # the bias gradient from the weight gradient's reads of grad
            dw, dbias = matmul(grad.t(), x, precision=ctx.precision, row_sums=True)
        elif need_w:
            dw = matmul(grad.t(), x, precision=ctx.precision)
        elif need_bias:
            dbias = grad.sum(0)
        return dx, dw, dbias, grad if need_residual else None, None


def linear(x: Tensor, w: Tensor, bias: Optional[Tensor] = None,
           residual: Optional[Tensor] = None, *, bias_grad: str = "torch") -> Tensor:
    """``x @ w.T (+ bias) (+ residual)`` for ``x [M, K]``, ``w [N, K]``: a projection.

    With ``config.kernels.matmul_precision`` ``"tf32x3"`` or ``"ieee"`` and the Triton backend,
    float32 operands of any strides, the product and its gradients run in the generated matmul
    kernels (``"tf32x3"``: tensor-core products of high and low TensorFloat-32 parts, about
    float32's accuracy; ``"ieee"``: float32 multiply-adds); weight gradients split the batch rows
    over programs and sum the partials in a fixed order. Otherwise (the default ``"off"``) one
    ``torch.addmm``, as ``F.linear`` runs it; with ``bias_grad="column_sum"`` (and a bias that
    needs a gradient) its backward sums the bias gradient by
    :func:`~fastopt.codegen.families.column_sum.column_sum` rather than
    torch's reduction (cuBLAS products for the rest).

    Returns:
        ``[M, N]``.

    Raises:
        KernelError: ``x`` and ``w`` are not matrices of one inner width.
    """
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise KernelError(
            f"linear needs x [M, K] and w [N, K]; got x {tuple(x.shape)} and w {tuple(w.shape)}. "
            f"Flatten x's leading dimensions (x.reshape(-1, x.shape[-1])) and pass w as "
            f"nn.Linear stores it ([out_features, in_features])")
    precision = default_config().kernels.matmul_precision
    tensors = (x, w, bias, residual)
    if precision != "off" and (bias is None or bias.shape == (w.shape[0],)) and \
            (residual is None or residual.shape == (x.shape[0], w.shape[0])) and \
            all(t is None or t.dtype == torch.float32 for t in tensors) and \
            not torch.is_autocast_enabled(x.device.type) and eager_kernels(*tensors):
        return _Linear.apply(x, w, None if bias is None else bias.contiguous(), residual,
                             precision)
    if bias_grad == "column_sum" and bias is not None and bias.requires_grad and \
            torch.is_grad_enabled() and eager_kernels(*tensors):
        return ColumnSumBias.apply(x, w, bias, residual)
    if residual is not None:
        out = torch.addmm(residual, x, w.t())
        return out if bias is None else out + bias
    return torch.mm(x, w.t()) if bias is None else torch.addmm(bias, x, w.t())
