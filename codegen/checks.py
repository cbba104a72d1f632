"""Argument checks the families share: every bad input becomes a :class:`KernelError`.

Shapes, dtypes and devices are always checked (free). Index ranges and CSR counts need the
values, i.e. one device synchronization on CUDA; they are checked when
``config.kernels.check_inputs`` is on (the default) and the call is not being traced by
``torch.compile`` (:func:`values_checked`); benchmarks and tuned runs switch them off. Each
family's own ``check`` composes these for its operator.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import Tensor

from fastopt.config import default_config
from fastopt.errors import KernelError

__all__ = ["NeighborLayout", "is_tensor", "floating", "has_shape", "has_ndim", "same_device",
           "values_checked", "values_known", "table_index", "neighbor_slots", "valid_form"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class NeighborLayout:
    """Sizes of one operator call: destinations ``M``, slots ``K``."""

    rows: int
    slots: int


def is_tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise KernelError(f"{name} must be a torch.Tensor (got {type(value).__name__}); pass a tensor")
    return value


def floating(name: str, t: Tensor, dtype: Optional[torch.dtype] = None) -> None:
    """``t`` has a supported float dtype (``dtype``, that of ``q``, where given)."""
    if t.dtype not in FLOAT_DTYPES:
        raise KernelError(
            f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32, float64. "
            f"Cast it with {name}.float()"
        )
    if dtype is not None and t.dtype != dtype:
        raise KernelError(f"{name} has dtype {t.dtype} but q has {dtype}; cast both to one dtype")


def has_shape(name: str, t: Tensor, expected: tuple, meaning: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise KernelError(
            f"{name} has shape {tuple(t.shape)}, expected {tuple(expected)} ({meaning}); "
            f"reshape it or pass matching tensors"
        )


def has_ndim(name: str, t: Tensor, ndim: int, meaning: str) -> None:
    if t.dim() != ndim:
        raise KernelError(
            f"{name} must have {ndim} dimensions {meaning} (got shape {tuple(t.shape)}); reshape it"
        )


def same_device(reference: Tensor, **tensors: Optional[Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != reference.device:
            raise KernelError(
                f"{name} is on {t.device} but q/x is on {reference.device}; move it with "
                f"{name}.to({str(reference.device)!r})"
            )


_VALUES_KNOWN: contextvars.ContextVar[bool] = contextvars.ContextVar("values_known", default=False)


def values_checked() -> bool:
    """Whether checks may read tensor values (inside a torch.compile trace there are none, and
    inside :func:`values_known` the caller has checked them)."""
    return (not torch.compiler.is_compiling() and default_config().kernels.check_inputs
            and not _VALUES_KNOWN.get())


@contextlib.contextmanager
def values_known() -> Iterator[None]:
    """Calls inside take index values as valid: for an operator built on another whose index
    tensors it made itself and checked in its own (single) host read."""
    token = _VALUES_KNOWN.set(True)
    try:
        yield
    finally:
        _VALUES_KNOWN.reset(token)


def table_index(name: str, index: Tensor, rows: int, table_rows: int) -> int:
    """Validate an ``[M, K]`` table index; returns K."""
    has_ndim(name, index, 2, "[M, K]")
    if index.dtype not in INDEX_DTYPES:
        raise KernelError(f"{name} has dtype {index.dtype}; supported: int32, int64. Use {name}.long()")
    if index.shape[0] != rows:
        raise KernelError(
            f"{name} has {index.shape[0]} rows but there are {rows} destinations; pass one row each"
        )
    if values_checked() and index.numel() > 0:
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= table_rows:
            bad = low if low < 0 else high
            raise KernelError(
                f"{name} holds {bad}, outside the table's rows [0, {table_rows}); pad invalid slots "
                f"with a valid row (e.g. 0) and mask them"
            )
    return int(index.shape[1])


def neighbor_slots(name: str, t: Tensor, index: Optional[Tensor], index_name: str, rows: int,
                   feature_dims: int) -> int:
    """Validate dense ``[M, K, ...]`` or indexed ``[U, ...]`` neighbors; returns K."""
    if index is None:
        has_ndim(name, t, 2 + feature_dims, "(dense neighbors [M, K, ...])")
        if t.shape[0] != rows:
            raise KernelError(
                f"{name} has {t.shape[0]} rows but there are {rows} destinations; pass "
                f"[M, K, ...] neighbors or a table with {index_name}"
            )
        return int(t.shape[1])
    has_ndim(name, t, 1 + feature_dims, f"(a table [U, ...] addressed by {index_name})")
    return table_index(index_name, index, rows, int(t.shape[0]))


def valid_form(mask: Optional[Tensor], indptr: Optional[Tensor], layout: NeighborLayout,
               reference: Tensor) -> None:
    """Validate the valid slots, given by a mask, a CSR indptr, or neither."""
    if mask is not None and indptr is not None:
        raise KernelError("pass either mask or indptr, not both; they describe the same valid slots")
    same_device(reference, mask=mask, indptr=indptr)
    if mask is not None:
        is_tensor("mask", mask)
        if mask.dtype != torch.bool:
            raise KernelError(f"mask has dtype {mask.dtype}; it must be bool. Use mask.bool()")
        has_shape("mask", mask, (layout.rows, layout.slots), "[M, K]")
    if indptr is not None:
        is_tensor("indptr", indptr)
        if indptr.dtype not in INDEX_DTYPES:
            raise KernelError(f"indptr has dtype {indptr.dtype}; supported: int32, int64. Use indptr.long()")
        has_shape("indptr", indptr, (layout.rows + 1,), "[M + 1] CSR offsets")
        if values_checked() and layout.rows > 0:
            counts = indptr[1:] - indptr[:-1]
            low, high = int(counts.min()), int(counts.max())
            if low < 0 or high > layout.slots:
                bad = low if low < 0 else high
                raise KernelError(
                    f"indptr gives a row {bad} valid neighbors, outside [0, K={layout.slots}]; "
                    f"indptr must be non-decreasing with at most K entries per row"
                )
