"""Argument checks of the attention operators, and the key/value row layout the kernels read."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fastopt.codegen import checks
from fastopt.codegen.checks import INDEX_DTYPES, NeighborLayout
from fastopt.errors import KernelError

__all__ = ["MAX_SEED", "check_attention", "check_shared_block", "edge_slots", "row_stride",
           "key_rows", "sorted_edges"]

MAX_SEED = 2**31


def check_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                    indptr: Optional[Tensor], k_index: Optional[Tensor], v_index: Optional[Tensor],
                    scale: Optional[float], dropout_p: float, seed) -> NeighborLayout:
    """Validate the arguments of :func:`fastopt.codegen.temporal_attention`."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.is_tensor(name, t)
    checks.has_ndim("q", q, 3, "[M, H, d]")
    checks.floating("q", q)
    rows, heads, dim = q.shape
    checks.floating("k", k, q.dtype)
    checks.floating("v", v, q.dtype)
    checks.same_device(q, k=k, v=v, k_index=k_index, v_index=v_index)
    slots = checks.neighbor_slots("k", k, k_index, "k_index", rows, 2)
    v_slots = checks.neighbor_slots("v", v, v_index, "v_index", rows, 2)
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
    checks.valid_form(mask, indptr, layout, q)
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
    checks.same_device(q, seed=seed)


def check_shared_block(q: Tensor, sq: Tensor, se: Tensor, layout: NeighborLayout) -> None:
    """Validate the shared feature block of :func:`fastopt.codegen.shared_attention`."""
    checks.is_tensor("sq", sq)
    checks.is_tensor("se", se)
    checks.same_device(q, sq=sq, se=se)
    checks.floating("sq", sq, q.dtype)
    checks.floating("se", se, q.dtype)
    width = sq.shape[-1] if sq.dim() == 3 else 0
    checks.has_shape("sq", sq, (layout.rows, q.shape[1], width),
                     "[M, H, S], the queries' shared part")
    if width < 1:
        raise KernelError(f"sq has shape {tuple(sq.shape)}; the shared block needs S >= 1 "
                          f"features (pass the attention without it instead)")
    checks.has_shape("se", se, (layout.rows, layout.slots, width), "[M, K, S], one block per slot")


def sorted_edges(indptr: Optional[Tensor], k_index: Optional[Tensor]) -> bool:
    """Whether the attention runs in the edges form: ``indptr [M + 1]`` over a list of edges
    sorted by row, ``k_index [E]`` (one-dimensional) naming each position's key/value row
    (``v_index`` is the same tensor), as :func:`fastopt.codegen.edge_attention` passes them."""
    return indptr is not None and k_index is not None and k_index.dim() == 1


def edge_slots(indptr: Tensor, index: Tensor) -> Tensor:
    """The slot layout ``[M, K]`` of the edges form (``K`` the longest row, at least 1; one host
    read): row ``m``'s slot ``j`` holds ``index[indptr[m] + j]`` for ``j`` below its count, 0
    past it (masked by ``indptr``). For the references, which run on slots."""
    counts = indptr[1:] - indptr[:-1]
    slots = max(1, int(counts.max())) if counts.numel() else 1
    j = torch.arange(slots, device=index.device)
    pos = (indptr[:-1, None] + j).clamp(max=max(index.numel() - 1, 0))
    return torch.where(j[None, :] < counts[:, None], index[pos] if index.numel() else 0, 0)


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
