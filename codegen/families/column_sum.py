"""Deterministic column sums ``x.sum(0)`` of a matrix: the bias gradients of the projections.

Row chunks are summed into partial rows by one launch of ``column_sum.py.jinja``, the partials by
a second; the order depends only on ``M``, ``N`` and the GPU. No custom op: the sums run inside
:class:`ColumnSumBias`'s backward and where :func:`column_sum` is called on plain tensors with
the Triton backend (:func:`~fastopt.codegen.library.eager_kernels`), else torch sums.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from fastopt.codegen import kernels
from fastopt.codegen.kernel_config import KernelConfig, next_power_of_2
from fastopt.codegen.layout import acc_dtype
from fastopt.codegen.library import eager_kernels
from fastopt.errors import KernelError

__all__ = ["column_sum", "ColumnSumBias", "launch"]

# Elements of a column-sum program's [block_r, block_n] tile; programs per multiprocessor the
# row chunks aim for.
COLUMN_TILE = 4096
COLUMN_PROGRAMS_PER_SM = 4


def launch(x: Tensor) -> Tensor:
    """``x.sum(0)`` of a ``[M, N]`` matrix with unit column stride, in ``x``'s dtype (float32 or
    float64 accumulation): row chunks summed into partial rows by one launch, the partials by a
    second; the order depends only on ``M``, ``N`` and the GPU, so the result is deterministic."""
    rows, cols = x.shape
    acc = acc_dtype(x.dtype)
    if rows == 0 or cols == 0:
        return torch.zeros(cols, dtype=x.dtype, device=x.device)
    block_n = min(next_power_of_2(cols), 256)
    block_r = max(1, COLUMN_TILE // block_n)
    col_blocks = -(-cols // block_n)
    # row chunks: enough programs to fill the GPU, each at least one tile of rows
    programs = COLUMN_PROGRAMS_PER_SM * kernels.multiprocessors(x.device)
    chunks = max(1, min(-(-rows // block_r), -(-programs // col_blocks)))
    per_chunk = -(-rows // chunks)
    chunk = -(-per_chunk // block_r) * block_r
    chunks = -(-rows // chunk)
    partial = kernels.empty((chunks, cols), acc, x.device)
    _launch(x, partial, rows, chunk, chunks, block_r, block_n)
    out = kernels.empty((1, cols), x.dtype, x.device)
    # the partials in one chunk; column blocks narrow enough to give several programs
    block_n2 = min(block_n, 32)
    _launch(partial, out, chunks, chunks, 1, max(1, COLUMN_TILE // block_n2), block_n2)
    return out[0]


def _launch(x: Tensor, out: Tensor, rows: int, chunk: int, chunks: int, block_r: int,
            block_n: int) -> None:
    cols = x.shape[1]
    cfg = KernelConfig(block_m=block_r, block_d=block_n, num_warps=4,
                       num_stages=kernels.pipeline_stages(x.device))
    kernel = kernels.fixed("column_sum", x.device, cfg, N=cols, stride=x.stride(0),
                           block_r=block_r, block_n=block_n,
                           acc=kernels.TL_DTYPES[acc_dtype(x.dtype)],
                           out_dtype=kernels.TL_DTYPES[out.dtype])
    kernel.launch((chunks, -(-cols // block_n)), x, out, rows, chunk)


def column_sum(x: Tensor) -> Tensor:
    """``x.sum(0)`` of a matrix: by the generated column-sum kernels (deterministic; float32
    accumulation) where they run (Triton backend, unit column stride), else by torch.

    Raises:
        KernelError: ``x`` is not a matrix.
    """
    if x.dim() != 2:
        raise KernelError(f"column_sum needs a [M, N] matrix; got shape {tuple(x.shape)}. "
                          f"Flatten the leading dimensions (x.reshape(-1, x.shape[-1]))")
    if x.stride(1) == 1 and x.is_floating_point() and eager_kernels(x):
        return launch(x)
    return x.sum(0)


class ColumnSumBias(torch.autograd.Function):
    """``addmm`` whose backward sums the bias gradient with :func:`column_sum`."""

    @staticmethod
    def forward(ctx, x, w, bias, residual):
        ctx.save_for_backward(x, w)
        if residual is None:
            return torch.addmm(bias, x, w.t())
        return torch.addmm(residual, x, w.t()) + bias

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        need_x, need_w, need_bias, need_residual = ctx.needs_input_grad
        return (grad @ w if need_x else None, grad.t() @ x if need_w else None,
                column_sum(grad) if need_bias else None, grad if need_residual else None)
