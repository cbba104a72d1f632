"""Input validation of the fused operators: every bad input becomes a :class:`KernelError`.

Shapes, dtypes and devices are always checked (free). Index ranges and CSR counts need the
values, i.e. one device synchronization on CUDA; they are checked when
``config.kernels.check_inputs`` is on (the default) and the call is not being traced by
``torch.compile``; benchmarks and tuned runs switch them off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from fastopt.config import default_config
from fastopt.errors import KernelError

__all__ = ["NeighborLayout", "check_attention", "check_aggregate", "check_time_encode"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_SEED = 2**31


@dataclass(frozen=True)
class NeighborLayout:
    """Sizes of one operator call: destinations ``M``, slots ``K``."""

    rows: int
    slots: int


def _is_tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise KernelError(f"{name} must be a torch.Tensor (got {type(value).__name__}); pass a tensor")
    return value


def _float(name: str, t: Tensor, dtype: Optional[torch.dtype] = None) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise KernelError(
            f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32, float64. "
            f"Cast it with {name}.float()"
        )
    if dtype is not None and t.dtype != dtype:
        raise KernelError(f"{name} has dtype {t.dtype} but q has {dtype}; cast both to one dtype")


def _shape(name: str, t: Tensor, expected: tuple, meaning: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise KernelError(
            f"{name} has shape {tuple(t.shape)}, expected {tuple(expected)} ({meaning}); "
            f"reshape it or pass matching tensors"
        )


def _ndim(name: str, t: Tensor, ndim: int, meaning: str) -> None:
    if t.dim() != ndim:
        raise KernelError(
            f"{name} must have {ndim} dimensions {meaning} (got shape {tuple(t.shape)}); reshape it"
        )


def _same_device(reference: Tensor, **tensors: Optional[Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != reference.device:
            raise KernelError(
                f"{name} is on {t.device} but q/x is on {reference.device}; move it with "
                f"{name}.to({str(reference.device)!r})"
            )


def _check_values() -> bool:
    # Value checks read data; inside a torch.compile trace there is none (they run eagerly only).
    return not torch.compiler.is_compiling() and default_config().kernels.check_inputs


def _index(name: str, index: Tensor, rows: int, table_rows: int) -> int:
    """Validate an ``[M, K]`` table index; returns K."""
    _ndim(name, index, 2, "[M, K]")
    if index.dtype not in INDEX_DTYPES:
        raise KernelError(f"{name} has dtype {index.dtype}; supported: int32, int64. Use {name}.long()")
    if index.shape[0] != rows:
        raise KernelError(
            f"{name} has {index.shape[0]} rows but there are {rows} destinations; pass one row each"
        )
    if _check_values() and index.numel() > 0:
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= table_rows:
            bad = low if low < 0 else high
            raise KernelError(
                f"{name} holds {bad}, outside the table's rows [0, {table_rows}); pad invalid slots "
                f"with a valid row (e.g. 0) and mask them"
            )
    return int(index.shape[1])


def _neighbors(name: str, t: Tensor, index: Optional[Tensor], index_name: str, rows: int,
               feature_dims: int) -> int:
    """Validate dense ``[M, K, ...]`` or indexed ``[U, ...]`` neighbors; returns K."""
    if index is None:
        _ndim(name, t, 2 + feature_dims, "(dense neighbors [M, K, ...])")
        if t.shape[0] != rows:
            raise KernelError(
                f"{name} has {t.shape[0]} rows but there are {rows} destinations; pass "
                f"[M, K, ...] neighbors or a table with {index_name}"
            )
        return int(t.shape[1])
    _ndim(name, t, 1 + feature_dims, f"(a table [U, ...] addressed by {index_name})")
    return _index(index_name, index, rows, int(t.shape[0]))


def _valid_form(mask: Optional[Tensor], indptr: Optional[Tensor], layout: NeighborLayout,
                reference: Tensor) -> None:
    if mask is not None and indptr is not None:
        raise KernelError("pass either mask or indptr, not both; they describe the same valid slots")
    _same_device(reference, mask=mask, indptr=indptr)
    if mask is not None:
        _is_tensor("mask", mask)
        if mask.dtype != torch.bool:
            raise KernelError(f"mask has dtype {mask.dtype}; it must be bool. Use mask.bool()")
        _shape("mask", mask, (layout.rows, layout.slots), "[M, K]")
    if indptr is not None:
        _is_tensor("indptr", indptr)
        if indptr.dtype not in INDEX_DTYPES:
            raise KernelError(f"indptr has dtype {indptr.dtype}; supported: int32, int64. Use indptr.long()")
        _shape("indptr", indptr, (layout.rows + 1,), "[M + 1] CSR offsets")
        if _check_values() and layout.rows > 0:
            counts = indptr[1:] - indptr[:-1]
            low, high = int(counts.min()), int(counts.max())
            if low < 0 or high > layout.slots:
                bad = low if low < 0 else high
                raise KernelError(
                    f"indptr gives a row {bad} valid neighbors, outside [0, K={layout.slots}]; "
                    f"indptr must be non-decreasing with at most K entries per row"
                )


def check_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                    indptr: Optional[Tensor], k_index: Optional[Tensor], v_index: Optional[Tensor],
                    scale: Optional[float], dropout_p: float, seed) -> NeighborLayout:
    """Validate the arguments of :func:`fastopt.codegen.temporal_attention`."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _is_tensor(name, t)
    _ndim("q", q, 3, "[M, H, d]")
    _float("q", q)
    rows, heads, dim = q.shape
    _float("k", k, q.dtype)
    _float("v", v, q.dtype)
    _same_device(q, k=k, v=v, k_index=k_index, v_index=v_index)
    slots = _neighbors("k", k, k_index, "k_index", rows, 2)
    v_slots = _neighbors("v", v, v_index, "v_index", rows, 2)
    if v_slots != slots:
        raise KernelError(f"keys have K={slots} slots but values have K={v_slots}; pass equal K")
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape[-2:]) != (heads, dim):
            raise KernelError(
                f"{name} has heads x dim {tuple(t.shape[-2:])} but q has {(heads, dim)}; "
                f"project {name} to H={heads}, d={dim}"
            )
    if dim == 0 or heads == 0:
        raise KernelError(f"q has shape {tuple(q.shape)}; H and d must be >= 1")
    layout = NeighborLayout(rows, slots)
    _valid_form(mask, indptr, layout, q)
    if scale is not None and not (isinstance(scale, (int, float)) and scale == scale):
        raise KernelError(f"scale must be a finite float (got {scale!r}); omit it for 1/sqrt(d)")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise KernelError(f"dropout_p must be in [0, 1) (got {dropout_p}); use 0.0 to disable dropout")
    if isinstance(seed, Tensor):
        _seed_tensor(seed, q)
    elif not (isinstance(seed, int) and 0 <= seed < MAX_SEED):
        raise KernelError(f"seed must be an int in [0, 2**31) (got {seed!r}); reduce it modulo 2**31")
    return layout


def _seed_tensor(seed: Tensor, q: Tensor) -> None:
    """A dropout key held in device memory: one int32/int64 element on q's device (value unread)."""
    if seed.dtype not in INDEX_DTYPES or seed.numel() != 1:
        raise KernelError(
            f"a tensor seed must hold one int32/int64 element (got dtype {seed.dtype}, shape "
            f"{tuple(seed.shape)}); pass torch.randint(0, 2**31 - 1, (1,), device=q.device)"
        )
    _same_device(q, seed=seed)


def check_time_encode(dt: Tensor, w: Tensor, b: Tensor) -> None:
    """Validate the arguments of :func:`fastopt.codegen.time_encode`."""
    for name, t in (("dt", dt), ("w", w), ("b", b)):
        _is_tensor(name, t)
        _float(name, t)
    _ndim("w", w, 1, "[T]")
    _shape("b", b, tuple(w.shape), "[T], like w")
    if b.dtype != w.dtype:
        raise KernelError(f"b has dtype {b.dtype} but w has {w.dtype}; cast both to one dtype")
    _same_device(dt, w=w, b=b)


def check_shared_block(q: Tensor, sq: Tensor, se: Tensor, layout: NeighborLayout) -> None:
    """Validate the shared feature block of :func:`fastopt.codegen.shared_attention`."""
    _is_tensor("sq", sq)
    _is_tensor("se", se)
    _same_device(q, sq=sq, se=se)
    _float("sq", sq, q.dtype)
    _float("se", se, q.dtype)
    width = sq.shape[-1] if sq.dim() == 3 else 0
    _shape("sq", sq, (layout.rows, q.shape[1], width), "[M, H, S], the queries' shared part")
    if width < 1:
        raise KernelError(f"sq has shape {tuple(sq.shape)}; the shared block needs S >= 1 "
                          f"features (pass the attention without it instead)")
    _shape("se", se, (layout.rows, layout.slots, width), "[M, K, S], one block per slot")


def check_aggregate(x: Tensor, mask: Optional[Tensor], indptr: Optional[Tensor],
                    index: Optional[Tensor], reduce: str) -> NeighborLayout:
    """Validate the arguments of :func:`fastopt.codegen.masked_aggregate`."""
    _is_tensor("x", x)
    _float("x", x)
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
        _is_tensor("index", index)
        _same_device(x, index=index)
        if x.dim() < 2:
            raise KernelError(f"x has shape {tuple(x.shape)}; a table needs [U, F...]")
        rows = int(index.shape[0]) if index.dim() == 2 else -1
    slots = _neighbors("x", x, index, "index", rows, x.dim() - (1 if index is not None else 2))
    layout = NeighborLayout(rows, slots)
    _valid_form(mask, indptr, layout, x)
    return layout


def row_stride(t: Tensor, dense: bool) -> Optional[int]:
    """Elements between consecutive key/value rows of ``t``, or None if they are not evenly spaced.

    A row is one slot's (dense ``[M, K, H, d]``, rows ``m * K + j``) or one table row's
    (``[U, H, d]``) ``H * d`` elements, which must be contiguous; the kernels read rows that far
    apart, so the key and value column blocks of one wider product need no copy.
    """
    heads, dim = t.shape[-2], t.shape[-1]
    width = heads * dim
    if t.numel() == 0:
        return width  # nothing is read
    if (dim > 1 and t.stride(-1) != 1) or (heads > 1 and t.stride(-2) != dim):
        return None
    if dense:
        rows, slots = t.shape[0], t.shape[1]
        if slots == 1:
            step = t.stride(0) if rows > 1 else width
        else:
            step = t.stride(1)
            if rows > 1 and t.stride(0) != slots * step:
                return None
    else:
        step = t.stride(0) if t.shape[0] > 1 else width
    return step if step >= width else None


def key_rows(t: Tensor, dense: bool) -> Tensor:
    """``t`` itself where its rows are evenly spaced (see :func:`row_stride`), else a contiguous
    copy."""
    return t if row_stride(t, dense) is not None else t.contiguous()
