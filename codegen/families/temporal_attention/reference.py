"""Plain-PyTorch reference of the attention operators: the CPU path and the kernels' oracle.

Each generated kernel must match these (float32: relative error < 1e-4; tests compare against
float64). They take the arguments of the public operators, already validated, in the layout of
:mod:`fastopt.codegen.layout`.

Dropout draws one 32-bit Philox-4x32-10 number per attention weight (:func:`dropout_keep`), the
same generator ``tl.randint`` runs inside the kernels, so a seed gives bit-identical masks on
every backend.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from fastopt.codegen.layout import acc_dtype, gather, scatter, valid_slots
from fastopt.codegen.families.temporal_attention.checks import edge_slots, sorted_edges

__all__ = [
    "DROPOUT_BITS", "dropout_threshold", "dropout_keep", "attention_dropout",
    "temporal_attention_forward", "temporal_attention", "temporal_attention_backward",
    "shared_attention_forward", "shared_attention", "shared_attention_backward",
]

_MASK32 = 0xFFFFFFFF
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
# Dropout compares the top 24 bits of a Philox draw against round(p * 2**24).
DROPOUT_BITS = 24

Optional_ = Optional[Tensor]


# ----------------------------------------------------------------------------------------------
# Philox dropout (bit-identical to triton.language.randint)
# ----------------------------------------------------------------------------------------------


def _umulhi32(a: int, b: Tensor) -> Tensor:
    """High 32 bits of ``a * b`` for a 32-bit constant and int64 tensor holding uint32 values."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    return (a * b_hi + ((a * b_lo) >> 16)) >> 16


def dropout_threshold(p: float) -> int:
    """Integer threshold: a weight is kept when the top 24 bits of its draw are ``>=`` this."""
    return int(round(p * (1 << DROPOUT_BITS)))


def dropout_keep(seed: int, offsets: Tensor, p: float) -> Tensor:
    """Keep-mask of dropout with probability ``p`` for counter ``offsets`` (int64, < 2**31).

    Runs Philox-4x32-10 with key ``seed`` and counter ``(offset, 0, 0, 0)`` and keeps the first
    output word, exactly as ``tl.randint(seed, offset)`` does inside the kernels.
    """
    c0 = offsets.to(torch.int64) & _MASK32
    c1 = torch.zeros_like(c0)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(10):
        prev0, prev2 = c0, c2
        c0 = _umulhi32(_PHILOX_ROUND_B, prev2) ^ c1 ^ k0
        c2 = _umulhi32(_PHILOX_ROUND_A, prev0) ^ c3 ^ k1
        c1 = (_PHILOX_ROUND_B * prev2) & _MASK32
        c3 = (_PHILOX_ROUND_A * prev0) & _MASK32
        k0 = (k0 + _PHILOX_KEY_A) & _MASK32
        k1 = (k1 + _PHILOX_KEY_B) & _MASK32
    return (c0 >> (32 - DROPOUT_BITS)) >= dropout_threshold(p)


def attention_dropout(seed: int, p: float, rows: int, heads: int, slots: int,
                      device: torch.device) -> Tensor:
    """``[M, H, K]`` keep-mask; the counter of weight ``(m, h, j)`` is ``(m * H + h) * K + j``."""
    offsets = torch.arange(rows * heads * slots, device=device, dtype=torch.int64)
    return dropout_keep(seed, offsets, p).view(rows, heads, slots)


# ----------------------------------------------------------------------------------------------
# temporal attention
# ----------------------------------------------------------------------------------------------


def _scale(dim: int, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(dim) if scale is None else float(scale)


def _probabilities(q: Tensor, k: Tensor, valid: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
    """Edge softmax ``p [M, H, K]`` over valid slots and its log-sum-exp ``[M, H]``.

    The log-sum-exp of a row without valid slots is ``+inf`` so that ``exp(s - lse)`` is 0.
    """
    scores = torch.einsum("mhd,mkhd->mhk", q, k) * scale
    keep = valid[:, None, :]
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    p = torch.exp(scores - lse[..., None]).masked_fill(~keep, 0.0)
    return p, lse


def temporal_attention_forward(q: Tensor, k: Tensor, v: Tensor, mask: Optional_ = None,
                               indptr: Optional_ = None, *, k_index: Optional_ = None,
                               v_index: Optional_ = None, scale: Optional[float] = None,
                               dropout_p: float = 0.0, seed: int = 0) -> Tuple[Tensor, Tensor]:
    """:func:`temporal_attention` that also returns the log-sum-exp ``[M, H]`` (float32/64)."""
    if sorted_edges(indptr, k_index):
        k_index = v_index = edge_slots(indptr, k_index)
    cdt = acc_dtype(q.dtype)
    rows, heads, dim = q.shape
    kd = gather(k, k_index).to(cdt)
    vd = gather(v, v_index).to(cdt)
    slots = kd.shape[1]
    valid = valid_slots(mask, indptr, rows, slots, q.device)
    p, lse = _probabilities(q.to(cdt), kd, valid, _scale(dim, scale))
    if dropout_p > 0.0:
        keep = attention_dropout(seed, dropout_p, rows, heads, slots, q.device)
        p = p * keep / (1.0 - dropout_p)
    out = torch.einsum("mhk,mkhd->mhd", p, vd)
    return out.to(q.dtype), lse


def temporal_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional_ = None,
                       indptr: Optional_ = None, *, k_index: Optional_ = None,
                       v_index: Optional_ = None, scale: Optional[float] = None,
                       dropout_p: float = 0.0, seed: int = 0) -> Tensor:
    """Each destination attends over its valid neighbors: gather, score, edge softmax, sum.

    The reference of :func:`fastopt.codegen.temporal_attention`, whose arguments it takes (an
    int ``seed`` only). Returns ``[M, H, d]`` in the dtype of ``q``; zeros for rows without a
    valid neighbor.
    """
    out, _ = temporal_attention_forward(q, k, v, mask, indptr, k_index=k_index, v_index=v_index,
                                        scale=scale, dropout_p=dropout_p, seed=seed)
    return out


def temporal_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                lse: Tensor, mask: Optional_ = None, indptr: Optional_ = None, *,
                                k_index: Optional_ = None, v_index: Optional_ = None,
                                scale: Optional[float] = None, dropout_p: float = 0.0,
                                seed: int = 0) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`temporal_attention` from the saved output and lse.

    With ``dp_j = dout . v_j`` (dropout-scaled) and ``D = dout . out``, the score gradient is
    ``ds_j = p_j (dp_j - D)``; ``dq = scale sum_j ds_j k_j``, ``dk_j = scale ds_j q``,
    ``dv_j = p_j dout``. Indexed keys/values get their slot gradients summed into table rows.
    """
    if sorted_edges(indptr, k_index):
        k_index = v_index = edge_slots(indptr, k_index)
    cdt = acc_dtype(q.dtype)
    kd = gather(k, k_index).to(cdt)
    vd = gather(v, v_index).to(cdt)
    dq, dk, dv = _slot_gradients(grad_out, q, kd, vd, out, lse, mask, indptr, scale, dropout_p,
                                 seed)
    dk = scatter(dk, k_index, k.shape[0])
    dv = scatter(dv, v_index, v.shape[0])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _slot_gradients(grad_out: Tensor, q: Tensor, kd: Tensor, vd: Tensor, out: Tensor, lse: Tensor,
                    mask: Optional[Tensor], indptr: Optional[Tensor], scale: Optional[float],
                    dropout_p: float, seed: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``dq [M, H, d]`` and per-slot ``dk, dv [M, K, H, d]`` in the compute dtype of ``kd``."""
    cdt = kd.dtype
    rows, heads, dim = q.shape
    slots = kd.shape[1]
    scale = _scale(dim, scale)
    valid = valid_slots(mask, indptr, rows, slots, q.device)
    qc, go = q.to(cdt), grad_out.to(cdt)
    scores = torch.einsum("mhd,mkhd->mhk", qc, kd) * scale
    p = torch.exp(scores - lse.to(cdt)[..., None]).masked_fill(~valid[:, None, :], 0.0)
    dp = torch.einsum("mhd,mkhd->mhk", go, vd)
    pd = p
    if dropout_p > 0.0:
        keep = attention_dropout(seed, dropout_p, rows, heads, slots, q.device).to(cdt)
        keep = keep / (1.0 - dropout_p)
        pd = p * keep
        dp = dp * keep
    delta = (go * out.to(cdt)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.einsum("mhk,mkhd->mhd", ds, kd) * scale
    dk = torch.einsum("mhk,mhd->mkhd", ds, qc) * scale
    dv = torch.einsum("mhk,mhd->mkhd", pd, go)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# attention with a feature block shared by all heads
# ----------------------------------------------------------------------------------------------


def _with_shared(q: Tensor, k: Tensor, v: Tensor, sq: Tensor, se: Tensor,
                 k_index: Optional[Tensor], v_index: Optional[Tensor]):
    """Queries ``[q ; sq]`` and dense keys/values ``[k_j ; se_j]``, ``[v_j ; se_j]`` per head."""
    cdt = acc_dtype(q.dtype)
    heads = q.shape[1]
    block = se.to(cdt)[:, :, None, :].expand(-1, -1, heads, -1)
    kd = torch.cat([gather(k, k_index).to(cdt), block], -1)
    vd = torch.cat([gather(v, v_index).to(cdt), block], -1)
    return torch.cat([q.to(cdt), sq.to(cdt)], -1), kd, vd


def shared_attention_forward(q: Tensor, k: Tensor, v: Tensor, sq: Tensor, se: Tensor,
                             mask: Optional_ = None, indptr: Optional_ = None, *,
                             k_index: Optional_ = None, v_index: Optional_ = None,
                             scale: Optional[float] = None, dropout_p: float = 0.0,
                             seed: int = 0) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`shared_attention` that also returns the log-sum-exp: ``(out, shared_out, lse)``."""
    dim = q.shape[-1]
    qa, kd, vd = _with_shared(q, k, v, sq, se, k_index, v_index)
    out, lse = temporal_attention_forward(qa, kd, vd, mask, indptr, scale=_scale(dim, scale),
                                          dropout_p=dropout_p, seed=seed)
    # copies, not views of one tensor: a custom op's outputs may not alias
    return out[..., :dim].to(q.dtype).contiguous(), out[..., dim:].to(sq.dtype).contiguous(), lse


def shared_attention(q: Tensor, k: Tensor, v: Tensor, sq: Tensor, se: Tensor,
                     mask: Optional_ = None, indptr: Optional_ = None, *,
                     k_index: Optional_ = None, v_index: Optional_ = None,
                     scale: Optional[float] = None, dropout_p: float = 0.0,
                     seed: int = 0) -> Tuple[Tensor, Tensor]:
    """Temporal attention whose keys and values share a feature block across heads.

    Head ``h`` of row ``m`` attends with query ``[q[m, h] ; sq[m, h]]`` over keys
    ``[k_j[h] ; se[m, j]]`` and values ``[v_j[h] ; se[m, j]]`` (``k_j``, ``v_j`` dense or table
    rows): the block ``se [M, K, S]`` is the same for every head. Returns ``(out [M, H, d],
    shared_out [M, H, S])``, the two parts of the weighted sum. A key or value projection
    ``x_j W`` whose input has a per-slot part ``e_j`` (a time encoding) factors into this form:
    ``q . (e_j W_e) = (q W_e^T) . e_j`` and ``sum_j p_j e_j W_e = (sum_j p_j e_j) W_e``. The
    reference of :func:`fastopt.codegen.shared_attention`.
    """
    out, shared_out, _ = shared_attention_forward(q, k, v, sq, se, mask, indptr,
                                                  k_index=k_index, v_index=v_index, scale=scale,
                                                  dropout_p=dropout_p, seed=seed)
    return out, shared_out


def shared_attention_backward(grad_out: Tensor, grad_shared_out: Tensor, q: Tensor, k: Tensor,
                              v: Tensor, sq: Tensor, se: Tensor, out: Tensor, shared_out: Tensor,
                              lse: Tensor, mask: Optional_ = None, indptr: Optional_ = None, *,
                              k_index: Optional_ = None, v_index: Optional_ = None,
                              scale: Optional[float] = None, dropout_p: float = 0.0,
                              seed: int = 0) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv, dsq, dse)`` of :func:`shared_attention`: those of the
    concatenated attention, the shared block's key and value parts summed over heads."""
    dim = q.shape[-1]
    qa, kd, vd = _with_shared(q, k, v, sq, se, k_index, v_index)
    cdt = qa.dtype
    dqa, dka, dva = _slot_gradients(
        torch.cat([grad_out.to(cdt), grad_shared_out.to(cdt)], -1), qa, kd, vd,
        torch.cat([out.to(cdt), shared_out.to(cdt)], -1), lse, mask, indptr, _scale(dim, scale),
        dropout_p, seed)
    dse = dka[..., dim:].sum(2) + dva[..., dim:].sum(2)
    dk = scatter(dka[..., :dim], k_index, k.shape[0])
    dv = scatter(dva[..., :dim], v_index, v.shape[0])
    return (dqa[..., :dim].to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(),
            dv.to(v.dtype).contiguous(), dqa[..., dim:].to(sq.dtype).contiguous(),
            dse.to(se.dtype))
