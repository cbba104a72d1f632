"""Plain-PyTorch reference implementations of every fused operator.

These functions are the CPU path of :mod:`fastopt.codegen` and the oracle of its tests: each
generated kernel must match them (float32: relative error < 1e-4; tests compare against float64).
They take exactly the arguments of the public operators, already validated (see
:mod:`fastopt.codegen.checks`), and compute in float64 when given float64, else in float32
(half-precision inputs are upcast, results cast back to the input dtype).

Neighbor layout shared by all operators: a destination row ``m`` has ``K`` neighbor slots.
Neighbor tensors are either dense (``[M, K, ...]``) or rows of a table (``[U, ...]``) addressed
by an index ``[M, K]``. Which slots are valid is given by a boolean ``mask [M, K]`` or by a CSR
``indptr [M + 1]`` whose counts ``indptr[m + 1] - indptr[m]`` say that the first slots of the row
are valid (the sampler's padded layout); with neither, every slot is valid. A row without a valid
slot yields zeros, never NaN.

Dropout draws one 32-bit Philox-4x32-10 number per attention weight (:func:`dropout_keep`), the
same generator ``tl.randint`` runs inside the kernels, so a seed gives bit-identical masks on
every backend.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = [
    "temporal_attention",
    "temporal_attention_forward",
    "temporal_attention_backward",
    "shared_attention",
    "shared_attention_forward",
    "shared_attention_backward",
    "masked_aggregate",
    "masked_aggregate_backward",
    "time_encode",
    "time_encode_backward",
    "valid_slots",
    "dropout_keep",
    "dropout_threshold",
]

_MASK32 = 0xFFFFFFFF
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
# Dropout compares the top 24 bits of a Philox draw against round(p * 2**24).
DROPOUT_BITS = 24


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def valid_slots(mask: Optional[Tensor], indptr: Optional[Tensor], rows: int, slots: int,
                device: torch.device) -> Tensor:
    """The ``[M, K]`` boolean validity of neighbor slots from a mask, a CSR indptr, or neither."""
    if mask is not None:
        return mask.to(torch.bool)
    if indptr is not None:
        counts = (indptr[1:] - indptr[:-1]).to(device=device, dtype=torch.int64)
        return torch.arange(slots, device=device)[None, :] < counts[:, None]
    return torch.ones(rows, slots, dtype=torch.bool, device=device)


def _gather(x: Tensor, index: Optional[Tensor]) -> Tensor:
    """Dense neighbor rows: ``x`` itself, or the table rows ``x[index]``."""
    return x if index is None else x[index.long()]


def _scatter(grad: Tensor, index: Optional[Tensor], table_rows: int) -> Tensor:
    """Adjoint of :func:`_gather`: sum per-slot gradients into their table rows."""
    if index is None:
        return grad
    out = grad.new_zeros((table_rows,) + tuple(grad.shape[2:]))
    flat = grad.reshape((-1,) + tuple(grad.shape[2:]))
    return out.index_add_(0, index.reshape(-1).long(), flat)


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


def _attention_dropout(seed: int, p: float, rows: int, heads: int, slots: int,
                       device: torch.device) -> Tensor:
    """``[M, H, K]`` keep-mask; the counter of weight ``(m, h, j)`` is ``(m * H + h) * K + j``."""
    offsets = torch.arange(rows * heads * slots, device=device, dtype=torch.int64)
    return dropout_keep(seed, offsets, p).view(rows, heads, slots)


# ----------------------------------------------------------------------------------------------
# temporal attention
# ----------------------------------------------------------------------------------------------


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


def temporal_attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor] = None,
    indptr: Optional[Tensor] = None,
    *,
    k_index: Optional[Tensor] = None,
    v_index: Optional[Tensor] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    seed: int = 0,
) -> Tuple[Tensor, Tensor]:
    """:func:`temporal_attention` that also returns the log-sum-exp ``[M, H]`` (float32/64)."""
    cdt = _compute_dtype(q)
    rows, heads, dim = q.shape
    kd = _gather(k, k_index).to(cdt)
    vd = _gather(v, v_index).to(cdt)
    slots = kd.shape[1]
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    valid = valid_slots(mask, indptr, rows, slots, q.device)
    p, lse = _probabilities(q.to(cdt), kd, valid, scale)
    if dropout_p > 0.0:
        keep = _attention_dropout(seed, dropout_p, rows, heads, slots, q.device)
        p = p * keep / (1.0 - dropout_p)
    out = torch.einsum("mhk,mkhd->mhd", p, vd)
    return out.to(q.dtype), lse


def temporal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor] = None,
    indptr: Optional[Tensor] = None,
    *,
    k_index: Optional[Tensor] = None,
    v_index: Optional[Tensor] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    seed: int = 0,
) -> Tensor:
    """Each destination attends over its valid neighbors: gather, score, edge softmax, sum.

    Args:
        q: Queries ``[M, H, d]``.
        k: Keys, dense ``[M, K, H, d]`` or a table ``[U, H, d]`` when ``k_index`` is given.
        v: Values, dense ``[M, K, H, d]`` or a table ``[U, H, d]`` when ``v_index`` is given.
        mask: Valid neighbor slots ``[M, K]`` (bool); exclusive with ``indptr``.
        indptr: CSR offsets ``[M + 1]``; row ``m`` has its first ``indptr[m+1]-indptr[m]`` slots valid.
        k_index: Table rows of the keys ``[M, K]`` (int32/int64).
        v_index: Table rows of the values ``[M, K]`` (int32/int64).
        scale: Score scale; default ``1 / sqrt(d)``.
        dropout_p: Probability of dropping an attention weight (kept ones scaled by ``1/(1-p)``).
        seed: Philox key of the dropout draws (``0 <= seed < 2**31``).

    Returns:
        ``[M, H, d]`` in the dtype of ``q``; zeros for rows without a valid neighbor.
    """
    out, _ = temporal_attention_forward(q, k, v, mask, indptr, k_index=k_index, v_index=v_index,
                                        scale=scale, dropout_p=dropout_p, seed=seed)
    return out


def temporal_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: Optional[Tensor] = None,
    indptr: Optional[Tensor] = None,
    *,
    k_index: Optional[Tensor] = None,
    v_index: Optional[Tensor] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    seed: int = 0,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`temporal_attention` from the saved output and lse.

    With ``dp_j = dout . v_j`` (dropout-scaled) and ``D = dout . out``, the score gradient is
    ``ds_j = p_j (dp_j - D)``; ``dq = scale sum_j ds_j k_j``, ``dk_j = scale ds_j q``,
    ``dv_j = p_j dout``. Indexed keys/values get their slot gradients summed into table rows.
    """
    cdt = _compute_dtype(q)
    kd = _gather(k, k_index).to(cdt)
    vd = _gather(v, v_index).to(cdt)
    dq, dk, dv = _slot_gradients(grad_out, q, kd, vd, out, lse, mask, indptr, scale, dropout_p,
                                 seed)
    dk = _scatter(dk, k_index, k.shape[0])
    dv = _scatter(dv, v_index, v.shape[0])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _slot_gradients(grad_out: Tensor, q: Tensor, kd: Tensor, vd: Tensor, out: Tensor, lse: Tensor,
                    mask: Optional[Tensor], indptr: Optional[Tensor], scale: Optional[float],
                    dropout_p: float, seed: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``dq [M, H, d]`` and per-slot ``dk, dv [M, K, H, d]`` in the compute dtype of ``kd``."""
    cdt = kd.dtype
    rows, heads, dim = q.shape
    slots = kd.shape[1]
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    valid = valid_slots(mask, indptr, rows, slots, q.device)
    qc, go = q.to(cdt), grad_out.to(cdt)
    scores = torch.einsum("mhd,mkhd->mhk", qc, kd) * scale
    p = torch.exp(scores - lse.to(cdt)[..., None]).masked_fill(~valid[:, None, :], 0.0)
    dp = torch.einsum("mhd,mkhd->mhk", go, vd)
    pd = p
    if dropout_p > 0.0:
        keep = _attention_dropout(seed, dropout_p, rows, heads, slots, q.device).to(cdt)
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
# time encoding
# ----------------------------------------------------------------------------------------------


def _with_shared(q: Tensor, k: Tensor, v: Tensor, sq: Tensor, se: Tensor,
                 k_index: Optional[Tensor], v_index: Optional[Tensor]):
    """Queries ``[q ; sq]`` and dense keys/values ``[k_j ; se_j]``, ``[v_j ; se_j]`` per head."""
    cdt = _compute_dtype(q)
    heads = q.shape[1]
    block = se.to(cdt)[:, :, None, :].expand(-1, -1, heads, -1)
    kd = torch.cat([_gather(k, k_index).to(cdt), block], -1)
    vd = torch.cat([_gather(v, v_index).to(cdt), block], -1)
    return torch.cat([q.to(cdt), sq.to(cdt)], -1), kd, vd


def shared_attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sq: Tensor,
    se: Tensor,
    mask: Optional[Tensor] = None,
    indptr: Optional[Tensor] = None,
    *,
    k_index: Optional[Tensor] = None,
    v_index: Optional[Tensor] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    seed: int = 0,
) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`shared_attention` that also returns the log-sum-exp: ``(out, shared_out, lse)``."""
    dim = q.shape[-1]
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    qa, kd, vd = _with_shared(q, k, v, sq, se, k_index, v_index)
    out, lse = temporal_attention_forward(qa, kd, vd, mask, indptr, scale=scale,
                                          dropout_p=dropout_p, seed=seed)
    # copies, not views of one tensor: a custom op's outputs may not alias
    return out[..., :dim].to(q.dtype).contiguous(), out[..., dim:].to(sq.dtype).contiguous(), lse


def shared_attention(q: Tensor, k: Tensor, v: Tensor, sq: Tensor, se: Tensor,
                     mask: Optional[Tensor] = None, indptr: Optional[Tensor] = None, *,
                     k_index: Optional[Tensor] = None, v_index: Optional[Tensor] = None,
                     scale: Optional[float] = None, dropout_p: float = 0.0,
                     seed: int = 0) -> Tuple[Tensor, Tensor]:
    """Temporal attention whose keys and values share a feature block across heads.

    Head ``h`` of row ``m`` attends with query ``[q[m, h] ; sq[m, h]]`` over keys
    ``[k_j[h] ; se[m, j]]`` and values ``[v_j[h] ; se[m, j]]`` (``k_j``, ``v_j`` dense or table
    rows): the block ``se [M, K, S]`` is the same for every head. Returns ``(out [M, H, d],
    shared_out [M, H, S])``, the two parts of the weighted sum. A key or value projection
    ``x_j W`` whose input has a per-slot part ``e_j`` (a time encoding) factors into this form:
    ``q . (e_j W_e) = (q W_e^T) . e_j`` and ``sum_j p_j e_j W_e = (sum_j p_j e_j) W_e``.
    """
    out, shared_out, _ = shared_attention_forward(q, k, v, sq, se, mask, indptr,
                                                  k_index=k_index, v_index=v_index, scale=scale,
                                                  dropout_p=dropout_p, seed=seed)
    return out, shared_out


def shared_attention_backward(
    grad_out: Tensor,
    grad_shared_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sq: Tensor,
    se: Tensor,
    out: Tensor,
    shared_out: Tensor,
    lse: Tensor,
    mask: Optional[Tensor] = None,
    indptr: Optional[Tensor] = None,
    *,
    k_index: Optional[Tensor] = None,
    v_index: Optional[Tensor] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    seed: int = 0,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv, dsq, dse)`` of :func:`shared_attention`: those of the
    concatenated attention, the shared block's key and value parts summed over heads."""
    dim = q.shape[-1]
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    qa, kd, vd = _with_shared(q, k, v, sq, se, k_index, v_index)
    cdt = qa.dtype
    dqa, dka, dva = _slot_gradients(
        torch.cat([grad_out.to(cdt), grad_shared_out.to(cdt)], -1), qa, kd, vd,
        torch.cat([out.to(cdt), shared_out.to(cdt)], -1), lse, mask, indptr, scale, dropout_p,
        seed)
    dse = dka[..., dim:].sum(2) + dva[..., dim:].sum(2)
    dk = _scatter(dka[..., :dim], k_index, k.shape[0])
    dv = _scatter(dva[..., :dim], v_index, v.shape[0])
    return (dqa[..., :dim].to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(),
            dv.to(v.dtype).contiguous(), dqa[..., dim:].to(sq.dtype).contiguous(),
            dse.to(se.dtype))


def time_encode(dt: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Harmonic time encoding ``cos(dt[..., None] * w + b)``.

    Args:
        dt: Time differences of any shape ``[...]``.
        w: Frequencies ``[T]``.
        b: Phases ``[T]``.

    Returns:
        ``[..., T]`` in the dtype of ``w``.
    """
    cdt = _compute_dtype(w)
    enc = torch.cos(dt.to(cdt)[..., None] * w.to(cdt) + b.to(cdt))
    return enc.to(w.dtype)


def time_encode_backward(grad_out: Tensor, dt: Tensor, w: Tensor,
                         b: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(ddt, dw, db)`` of :func:`time_encode`."""
    cdt = _compute_dtype(w)
    dtc = dt.to(cdt)
    dphase = -torch.sin(dtc[..., None] * w.to(cdt) + b.to(cdt)) * grad_out.to(cdt)
    ddt = (dphase * w.to(cdt)).sum(-1)
    flat = dphase.reshape(-1, w.shape[0])
    dw = (flat * dtc.reshape(-1, 1)).sum(0)
    return ddt.to(dt.dtype), dw.to(w.dtype), flat.sum(0).to(b.dtype)


# ----------------------------------------------------------------------------------------------
# masked aggregation
# ----------------------------------------------------------------------------------------------


def masked_aggregate(
    x: Tensor,
    mask: Optional[Tensor] = None,
    indptr: Optional[Tensor] = None,
    *,
    index: Optional[Tensor] = None,
    reduce: str = "mean",
) -> Tensor:
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
    cdt = _compute_dtype(x)
    xd = _gather(x, index).to(cdt)
    rows, slots = xd.shape[0], xd.shape[1]
    valid = valid_slots(mask, indptr, rows, slots, x.device)
    weight = _aggregate_weights(valid, reduce, cdt)
    return torch.einsum("mk,mk...->m...", weight, xd).to(x.dtype)


def _aggregate_weights(valid: Tensor, reduce: str, dtype: torch.dtype) -> Tensor:
    """Per-slot weights ``[M, K]``: 1 (sum) or 1/count (mean) on valid slots, 0 elsewhere."""
    weight = valid.to(dtype)
    if reduce == "mean":
        weight = weight / weight.sum(-1, keepdim=True).clamp_min(1.0)
    return weight


def masked_aggregate_backward(
    grad_out: Tensor,
    x: Tensor,
    mask: Optional[Tensor] = None,
    indptr: Optional[Tensor] = None,
    *,
    index: Optional[Tensor] = None,
    reduce: str = "mean",
) -> Tensor:
    """Gradient of :func:`masked_aggregate` with respect to ``x`` (dense or table rows)."""
    cdt = _compute_dtype(x)
    rows = grad_out.shape[0]
    slots = (index if index is not None else x).shape[1]
    valid = valid_slots(mask, indptr, rows, slots, grad_out.device)
    weight = _aggregate_weights(valid, reduce, cdt)
    grad = torch.einsum("mk,m...->mk...", weight, grad_out.to(cdt))
    return _scatter(grad, index, x.shape[0]).to(x.dtype)
