"""Conventions every family shares: the neighbor layout and the accumulation dtype.

Neighbor layout: a destination row ``m`` has ``K`` neighbor slots. Neighbor tensors are either
dense (``[M, K, ...]``) or rows of a table (``[U, ...]``) addressed by an index ``[M, K]``.
Which slots are valid is given by a boolean ``mask [M, K]`` or by a CSR ``indptr [M + 1]`` whose
counts ``indptr[m + 1] - indptr[m]`` say that the first slots of the row are valid (the
sampler's padded layout); with neither, every slot is valid. A row without a valid slot yields
zeros, never NaN.

Dtypes: references and kernels compute in float64 when given float64, else in float32
(half-precision inputs are upcast, results cast back to the input dtype).

This module holds what the references (:func:`valid_slots`, :func:`gather`, :func:`scatter`) and
the launchers (:func:`mask_form`, :func:`mask_args`) read the layout with; the argument checks
are in :mod:`fastopt.codegen.checks`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["acc_dtype", "valid_slots", "gather", "scatter", "mask_form", "mask_args"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a computation on ``dtype`` inputs accumulates in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def valid_slots(mask: Optional[Tensor], indptr: Optional[Tensor], rows: int, slots: int,
                device: torch.device) -> Tensor:
    """The ``[M, K]`` boolean validity of neighbor slots from a mask, a CSR indptr, or neither."""
    if mask is not None:
        return mask.to(torch.bool)
    if indptr is not None:
        counts = (indptr[1:] - indptr[:-1]).to(device=device, dtype=torch.int64)
        return torch.arange(slots, device=device)[None, :] < counts[:, None]
    return torch.ones(rows, slots, dtype=torch.bool, device=device)


def gather(x: Tensor, index: Optional[Tensor]) -> Tensor:
    """Dense neighbor rows: ``x`` itself, or the table rows ``x[index]``."""
    return x if index is None else x[index.long()]


def scatter(grad: Tensor, index: Optional[Tensor], table_rows: int) -> Tensor:
    """Adjoint of :func:`gather`: sum per-slot gradients into their table rows."""
    if index is None:
        return grad
    out = grad.new_zeros((table_rows,) + tuple(grad.shape[2:]))
    flat = grad.reshape((-1,) + tuple(grad.shape[2:]))
    return out.index_add_(0, index.reshape(-1).long(), flat)


def mask_form(mask: Optional[Tensor], indptr: Optional[Tensor]) -> str:
    """The template's name for how valid slots are given: ``"mask"``, ``"csr"`` or ``"none"``."""
    if mask is not None:
        return "mask"
    return "csr" if indptr is not None else "none"


def mask_args(mask: Optional[Tensor], indptr: Optional[Tensor],
              dummy: Tensor) -> Tuple[Tensor, Tensor]:
    """The kernel arguments of the mask and the indptr (``dummy`` for the one not given)."""
    mask_arg = mask.view(torch.uint8) if mask is not None else dummy
    return mask_arg, indptr if indptr is not None else dummy
