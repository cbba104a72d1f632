"""Launchers of the attention kernels (``temporal_attention.py.jinja``).

A launcher reads the shapes and forms of its inputs into the template's specialization (K, H, d,
dtype, mask form, indexing, row strides, dropout, shared block) and launches the forward, or the
backward and, for indexed keys and values in ``"deterministic"`` mode, the segmented reductions
that sum slot gradients into table rows.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from fastopt.codegen import kernels
from fastopt.codegen.families.segment_reduce import segment_reduce, slot_segments
from fastopt.codegen.families.temporal_attention.checks import row_stride, sorted_edges
from fastopt.codegen.families.temporal_attention.reference import DROPOUT_BITS, dropout_threshold
from fastopt.codegen.kernel_config import FORWARD_ELEMENTS_PER_WARP
from fastopt.codegen.layout import acc_dtype, mask_args, mask_form
from fastopt.config import default_config
from fastopt.errors import KernelError

__all__ = ["attention_forward", "attention_backward", "shared_attention_forward",
           "shared_attention_backward", "packed_blocks"]


def _dropout_args(dropout_p: float) -> Tuple[int, float]:
    return dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p)


def _attention_spec(q: Tensor, k: Tensor, v: Tensor, mask, indptr, k_index, v_index,
                    dropout_p: float, stage: str, seed=0) -> dict:
    rows, heads, dim = q.shape
    edges = sorted_edges(indptr, k_index)
    slots = 0 if edges else (k_index if k_index is not None else k).shape[1]
    strides = [row_stride(t, index is None) for t, index in ((k, k_index), (v, v_index))]
    if None in strides:
        raise KernelError("attention keys and values need rows of H*d contiguous elements, evenly "
                          f"spaced (strides {tuple(k.stride())}, {tuple(v.stride())}); pass "
                          ".contiguous() tensors")
    align = 16 // q.element_size() if default_config().kernels.aligned_rows else 1
    return dict(stage=stage, K=slots, H=heads, D=dim, k_stride=strides[0], v_stride=strides[1],
                shared_index=_same_index(k_index, v_index), align=align, shared_dim=0,
                dk_stride=heads * dim, dv_stride=heads * dim, dtype=kernels.TL_DTYPES[q.dtype],
                acc=kernels.TL_DTYPES[acc_dtype(q.dtype)],
                mask_form="edges" if edges else mask_form(mask, indptr),
                k_indexed=k_index is not None, v_indexed=v_index is not None,
                dropout=dropout_p > 0.0, dropout_bits=DROPOUT_BITS,
                seed_in_memory=isinstance(seed, Tensor))


def _attention_forward(q, k, v, mask, indptr, k_index, v_index, scale, dropout_p, seed,
                       shared: Optional[Tuple[Tensor, Tensor]] = None):
    """``(out, lse, shared_out)``; ``shared_out`` is None without a shared block ``(sq, se)``."""
    rows, heads, dim = q.shape
    spec = _attention_spec(q, k, v, mask, indptr, k_index, v_index, dropout_p, "forward", seed)
    if shared is not None:
        spec["shared_dim"] = shared[0].shape[-1]
    # a slot's shared-block gradient sums over heads: the shared variant keeps them together
    kernel = kernels.specialize("temporal_attention", q.device, (max(spec["K"], 1), heads, dim),
                                row_tiles=True, warp_elements=FORWARD_ELEMENTS_PER_WARP,
                                all_heads=shared is not None, backward_mode="", write_coef=False,
                                softmax=default_config().kernels.attention_softmax, **spec)
    out = kernels.empty_like(q)
    lse = kernels.empty((rows, heads), acc_dtype(q.dtype), q.device)
    shared_out = None
    shared_args: Tuple[Tensor, ...] = ()
    if shared is not None:
        shared_out = kernels.empty_like(shared[0])
        shared_args = (*shared, shared_out)
    mask_arg, indptr_arg = mask_args(mask, indptr, q)
    threshold, drop_scale = _dropout_args(dropout_p)
    kernel.launch(kernel.cfg.tile_grid(rows, heads), q, k, v, mask_arg, indptr_arg,
                  k_index if k_index is not None else q, v_index if v_index is not None else q,
                  *shared_args, out, lse, rows, scale, seed, threshold,
                  drop_scale)
    return out, lse, shared_out


def packed_blocks(k: Tensor, v: Tensor) -> bool:
    """Whether dense keys and values are the two column blocks ``[..., :H*d]``, ``[..., H*d:]``
    of one ``[M, K, 2*H*d]`` product (projected together): their gradients then fill one such
    buffer, which the product's backward takes without concatenating them."""
    width = k.shape[-2] * k.shape[-1]
    return (k.dim() == 4 and k.shape == v.shape and k.stride() == v.stride() and k.numel() > 0
            and k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
            and v.storage_offset() == k.storage_offset() + width
            and row_stride(k, True) == 2 * width)


def _attention_backward(grad_out, q, k, v, out, lse, mask, indptr, k_index, v_index, scale,
                        dropout_p, seed, pack: bool = False,
                        shared: Optional[Tuple[Tensor, ...]] = None):
    """Returns ``(dq, dk, dv, dsq, dse)``; ``dsq, dse`` only with a shared block ``shared = (sq,
    se, shared_out, grad_shared_out)`` (else None).

    With ``pack`` and keys/values that are :func:`packed_blocks`, dk and dv are the two halves
    of one ``[M, K, 2*H*d]`` buffer (views of it, laid out as the keys and values were).
    """
    rows, heads, dim = q.shape
    mode = default_config().kernels.backward_mode
    spec = _attention_spec(q, k, v, mask, indptr, k_index, v_index, dropout_p, "backward", seed)
    if shared is not None:
        spec["shared_dim"] = shared[0].shape[-1]
    packed = pack and k_index is None and v_index is None and packed_blocks(k, v)
    if packed:
        spec.update(dk_stride=2 * heads * dim, dv_stride=2 * heads * dim)
    slots = spec["K"]
    edges = spec["mask_form"] == "edges"
    indexed = k_index is not None or v_index is not None
    # per-slot coefficients that segment_reduce sums per table row (the edges form stores rows)
    write_coef = indexed and mode == "deterministic" and not edges
    kernel = kernels.specialize("temporal_attention", q.device, (max(slots, 1), heads, dim),
                                row_tiles=True, backward_mode=mode, all_heads=shared is not None,
                                write_coef=write_coef, grad_dtype=spec["dtype"], **spec)
    acc = acc_dtype(q.dtype)
    dq = kernels.empty_like(q)

    def grad_buffer(t: Tensor, index: Optional[Tensor]) -> Tensor:
        if index is None:
            return kernels.empty_like(t)
        if edges:  # the rows of no sorted position (edges into no row) stay zero
            return torch.zeros(t.shape, device=t.device, dtype=t.dtype)
        if mode == "atomic":
            return torch.zeros(t.shape, device=t.device, dtype=acc)
        return q  # unused: rows are produced by segment_reduce below

    if packed:
        both = kernels.empty((*k.shape[:2], 2 * heads * dim), k.dtype, k.device)
        dk, dv = (half.view(k.shape) for half in both.split(heads * dim, -1))
    else:
        dk, dv = grad_buffer(k, k_index), grad_buffer(v, v_index)
    if write_coef:
        ds_coef = kernels.empty((rows, heads, slots), acc, q.device)
        pd_coef = kernels.empty((rows, heads, slots), acc, q.device)
    else:
        ds_coef = pd_coef = q  # unused by a kernel generated without write_coef
    dsq = dse = None
    shared_in: Tuple[Tensor, ...] = ()
    shared_grads: Tuple[Tensor, ...] = ()
    if shared is not None:
        sq, se, shared_out, grad_shared_out = shared
        dsq, dse = kernels.empty_like(sq), kernels.empty_like(se)
        shared_in, shared_grads = (sq, se, shared_out), (grad_shared_out, dsq, dse)
    mask_arg, indptr_arg = mask_args(mask, indptr, q)
    threshold, drop_scale = _dropout_args(dropout_p)
    kernel.launch(kernel.cfg.tile_grid(rows, heads), q, k, v, mask_arg, indptr_arg,
                  k_index if k_index is not None else q, v_index if v_index is not None else q,
                  *shared_in, out, grad_out, lse, dq, dk, dv, ds_coef,
                  pd_coef, *shared_grads, rows, scale, seed, threshold, drop_scale)
    if edges:
        return dq, dk, dv, dsq, dse
    if mode == "atomic":
        dk = dk.to(k.dtype) if k_index is not None else dk
        dv = dv.to(v.dtype) if v_index is not None else dv
        return dq, dk, dv, dsq, dse
    if not indexed:
        return dq, dk, dv, dsq, dse
    # padded slots (zero coefficients) stay out of the sums: they all name one row
    segments = slot_segments(mask, indptr, rows, slots, q.device)
    if _same_index(k_index, v_index) and k.shape[0] == v.shape[0] and k.dtype == v.dtype:
        dk, dv = segment_reduce(((ds_coef, q), (pd_coef, grad_out)), k_index, k.shape[0],
                                k.dtype, segments, op="temporal_attention")
    else:
        if k_index is not None:
            (dk,) = segment_reduce(((ds_coef, q),), k_index, k.shape[0], k.dtype, segments,
                                   op="temporal_attention")
        if v_index is not None:
            (dv,) = segment_reduce(((pd_coef, grad_out),), v_index, v.shape[0], v.dtype, segments,
                                   op="temporal_attention")
    return dq, dk, dv, dsq, dse


def _same_index(a: Optional[Tensor], b: Optional[Tensor]) -> bool:
    """Whether two indices are one tensor (the common case: keys and values of one table set)."""
    return (a is not None and b is not None and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)


def attention_forward(q, k, v, mask=None, indptr=None, *, k_index=None, v_index=None, scale,
                      dropout_p=0.0, seed=0) -> Tuple[Tensor, Tensor]:
    """Forward kernel of ``fastopt::temporal_attention``: ``(out, lse)``."""
    out, lse, _ = _attention_forward(q, k, v, mask, indptr, k_index, v_index, scale, dropout_p,
                                     seed)
    return out, lse


def attention_backward(grad_out, q, k, v, out, lse, mask=None, indptr=None, *, k_index=None,
                       v_index=None, scale, dropout_p=0.0, seed=0,
                       pack: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward kernels of ``fastopt::temporal_attention``: ``(dq, dk, dv)``; ``pack``: see
    :func:`_attention_backward` (not for the custom op, whose outputs may not alias)."""
    dq, dk, dv, *_ = _attention_backward(grad_out, q, k, v, out, lse, mask, indptr, k_index,
                                         v_index, scale, dropout_p, seed, pack)
    return dq, dk, dv


def shared_attention_forward(q, k, v, sq, se, mask=None, indptr=None, *, k_index=None,
                             v_index=None, scale, dropout_p=0.0,
                             seed=0) -> Tuple[Tensor, Tensor, Tensor]:
    """Forward kernel of ``fastopt::shared_attention``: ``(out, shared_out, lse)``."""
    out, lse, shared_out = _attention_forward(q, k, v, mask, indptr, k_index, v_index, scale,
                                              dropout_p, seed, (sq, se))
    return out, shared_out, lse


def shared_attention_backward(grad_out, grad_shared_out, q, k, v, sq, se, out, shared_out, lse,
                              mask=None, indptr=None, *, k_index=None, v_index=None, scale,
                              dropout_p=0.0, seed=0, pack: bool = False):
    """Backward kernels of ``fastopt::shared_attention``: ``(dq, dk, dv, dsq, dse)``."""
    return _attention_backward(grad_out, q, k, v, out, lse, mask, indptr, k_index, v_index, scale,
                               dropout_p, seed, pack, (sq, se, shared_out, grad_shared_out))
