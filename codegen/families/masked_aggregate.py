"""Masked neighbor aggregation: the sum or mean of each destination's valid neighbor rows.

Neighbors are dense ``[M, K, F...]`` or table rows ``[U, F...]`` gathered by an index (the
layout of :mod:`fastopt.codegen.layout`). The kernel (``masked_aggregate.py.jinja``) processes
slots ``block_k`` at a time as a ``[block_k, block_d]`` tile; the gradient of an indexed table
is summed per row by atomics or, deterministically, by
:func:`~fastopt.codegen.families.segment_reduce.segment_reduce`.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from fastopt.codegen import checks, kernels
from fastopt.codegen.families.segment_reduce import segment_reduce, slot_segments
from fastopt.codegen.layout import acc_dtype, gather, mask_args, mask_form, scatter, valid_slots
from fastopt.codegen.library import fused_op
from fastopt.config import default_config
from fastopt.errors import KernelError

__all__ = ["masked_aggregate", "reference", "reference_backward"]


def check(x: Tensor, mask: Optional[Tensor], indptr: Optional[Tensor], index: Optional[Tensor],
          reduce: str) -> checks.NeighborLayout:
    """Validate the arguments of :func:`masked_aggregate`."""
    checks.is_tensor("x", x)
    checks.floating("x", x)
    if reduce not in ("mean", "sum"):
        raise KernelError(f"reduce must be 'mean' or 'sum' (got {reduce!r})")
    if index is None:
        if x.dim() < 3:
            raise KernelError(
                f"x has shape {tuple(x.shape)}; dense neighbors need [M, K, F...] "
                f"(or pass a table [U, F...] with index [M, K])"
            )
        rows = int(x.shape[0])
    else:
        checks.is_tensor("index", index)
        checks.same_device(x, index=index)
        if x.dim() < 2:
            raise KernelError(f"x has shape {tuple(x.shape)}; a table needs [U, F...]")
        rows = int(index.shape[0]) if index.dim() == 2 else -1
    slots = checks.neighbor_slots("x", x, index, "index", rows,
                                  x.dim() - (1 if index is not None else 2))
    layout = checks.NeighborLayout(rows, slots)
    checks.valid_form(mask, indptr, layout, x)
    return layout


# ----------------------------------------------------------------------------------------------
# reference
# ----------------------------------------------------------------------------------------------


def reference(x: Tensor, mask: Optional[Tensor] = None, indptr: Optional[Tensor] = None, *,
              index: Optional[Tensor] = None, reduce: str = "mean") -> Tensor:
    """Sum or mean of each destination's valid neighbor rows.

    Args:
        x: Neighbor features, dense ``[M, K, *F]`` or a table ``[U, *F]`` when ``index`` is given.
        mask: Valid neighbor slots ``[M, K]`` (bool); exclusive with ``indptr``.
        indptr: CSR offsets ``[M + 1]`` (first slots of each row valid).
        index: Table rows ``[M, K]`` (int32/int64).
        reduce: ``"mean"`` or ``"sum"``.

    Returns:
        ``[M, *F]`` in the dtype of ``x``; zeros for rows without a valid neighbor.
    """
    cdt = acc_dtype(x.dtype)
    xd = gather(x, index).to(cdt)
    rows, slots = xd.shape[0], xd.shape[1]
    valid = valid_slots(mask, indptr, rows, slots, x.device)
    weight = _weights(valid, reduce, cdt)
    return torch.einsum("mk,mk...->m...", weight, xd).to(x.dtype)


def _weights(valid: Tensor, reduce: str, dtype: torch.dtype) -> Tensor:
    """Per-slot weights ``[M, K]``: 1 (sum) or 1/count (mean) on valid slots, 0 elsewhere."""
    weight = valid.to(dtype)
    if reduce == "mean":
        weight = weight / weight.sum(-1, keepdim=True).clamp_min(1.0)
    return weight


def reference_backward(grad_out: Tensor, x: Tensor, mask: Optional[Tensor] = None,
                       indptr: Optional[Tensor] = None, *, index: Optional[Tensor] = None,
                       reduce: str = "mean") -> Tensor:
    """Gradient of :func:`reference` with respect to ``x`` (dense or table rows)."""
    cdt = acc_dtype(x.dtype)
    rows = grad_out.shape[0]
    slots = (index if index is not None else x).shape[1]
    valid = valid_slots(mask, indptr, rows, slots, grad_out.device)
    weight = _weights(valid, reduce, cdt)
    grad = torch.einsum("mk,m...->mk...", weight, grad_out.to(cdt))
    return scatter(grad, index, x.shape[0]).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


def _launch(stage: str, x: Tensor, mask, indptr, index, reduce: str, rows: int, slots: int,
            features: int, *outputs: Tensor, backward_mode: str = ""):
    kernel = kernels.specialize(
        "masked_aggregate", x.device, (slots, 1, features),
        lambda cfg: {"k_blocks": -(-slots // cfg.block_k)}, row_tiles=False, stage=stage,
        K=slots, F=features, dtype=kernels.TL_DTYPES[x.dtype],
        acc=kernels.TL_DTYPES[acc_dtype(x.dtype)], mask_form=mask_form(mask, indptr),
        indexed=index is not None, reduce=reduce, backward_mode=backward_mode)
    mask_arg, indptr_arg = mask_args(mask, indptr, x)
    grid = (kernel.cfg.grid(rows, 1)[0], -(-features // kernel.cfg.block_d))
    kernel.launch(grid, x, mask_arg, indptr_arg, index if index is not None else x, *outputs, rows)


def _shape(x: Tensor, index: Optional[Tensor]) -> Tuple[int, int, Tuple[int, ...]]:
    if index is None:
        return x.shape[0], x.shape[1], tuple(x.shape[2:])
    return index.shape[0], index.shape[1], tuple(x.shape[1:])


def launch(x: Tensor, mask=None, indptr=None, *, index=None, reduce="mean") -> Tensor:
    """Forward kernel of ``fastopt::masked_aggregate``."""
    rows, slots, feature_shape = _shape(x, index)
    features = math.prod(feature_shape)
    out = kernels.empty((rows, *feature_shape), x.dtype, x.device)
    _launch("forward", x, mask, indptr, index, reduce, rows, slots, features, out)
    return out


def launch_backward(grad_out: Tensor, x: Tensor, mask=None, indptr=None, *, index=None,
                    reduce="mean") -> Tensor:
    """Backward kernels of ``fastopt::masked_aggregate``: the gradient of ``x``."""
    rows, slots, feature_shape = _shape(x, index)
    features = math.prod(feature_shape)
    mode = default_config().kernels.backward_mode if index is not None else ""
    acc = acc_dtype(x.dtype)
    if index is None:
        dx, coef = kernels.empty_like(x), x
    elif mode == "atomic":
        dx, coef = torch.zeros(x.shape, device=x.device, dtype=acc), x
    else:
        dx, coef = x, kernels.empty((rows, 1, slots), acc, x.device)
    _launch("backward", x, mask, indptr, index, reduce, rows, slots, features, grad_out, dx, coef,
            backward_mode=mode)
    if index is None:
        return dx
    if mode == "atomic":
        return dx.to(x.dtype)
    # padded slots (zero coefficients) stay out of the sums: they all name one row
    segments = slot_segments(mask, indptr, rows, slots, x.device)
    (table,) = segment_reduce(((coef, grad_out.reshape(rows, 1, features)),), index, x.shape[0],
                              x.dtype, segments, op="masked_aggregate")
    return table.view(x.shape)


# ----------------------------------------------------------------------------------------------
# operator
# ----------------------------------------------------------------------------------------------


@fused_op("masked_aggregate", grad_inputs=("x",), forward=(launch, reference),
          backward=(launch_backward, reference_backward))
def masked_aggregate_op(x: Tensor, mask: Optional[Tensor], indptr: Optional[Tensor],
                        index: Optional[Tensor], reduce: str) -> Tensor:
    rows = x.shape[0] if index is None else index.shape[0]
    features = x.shape[2:] if index is None else x.shape[1:]
    return x.new_empty((rows, *features))


def masked_aggregate(
    x: Tensor,
    mask: Optional[Tensor] = None,
    indptr: Optional[Tensor] = None,
    *,
    index: Optional[Tensor] = None,
    reduce: str = "mean",
) -> Tensor:
    """Sum or mean of each destination's valid neighbor rows, gathered by index if given.

    Args:
        x: Neighbor features, dense ``[M, K, F...]`` or a table ``[U, F...]`` when ``index`` is
            given (the expanded ``[M, K, F...]`` is never built).
        mask: Valid neighbor slots ``[M, K]`` (bool); exclusive with ``indptr``.
        indptr: CSR offsets ``[M + 1]`` (first slots of each row valid).
        index: Table rows ``[M, K]`` (int32/int64).
        reduce: ``"mean"`` (over valid slots) or ``"sum"``.

    Returns:
        ``[M, F...]`` in the dtype of ``x``; rows without a valid neighbor are zeros.

    Raises:
        KernelError: on shapes, dtypes, devices or index values that do not fit.
    """
    check(x, mask, indptr, index, reduce)
    return masked_aggregate_op(x.contiguous(), mask, indptr, index, reduce)
