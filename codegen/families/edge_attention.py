"""Attention over an edge list: edge softmax per destination and weighted sum, fused.

Graph layers written against an edge list (``edge_index [2, E]``: source ``src[e]``,
destination ``dst[e]``) attend over each destination's incoming edges. These operators bring the
edges to the neighbor layout of :func:`~fastopt.codegen.temporal_attention` and run its kernels:
the edges are sorted by destination (stable, so each row keeps the edges' order), a CSR
``indptr [N + 1]`` counts them per destination, and a slot index ``[N, K]`` names the edge (or
the table row) of each slot, ``K`` being the largest in-degree rounded up to a power of two (the
kernels are specialized per ``K``; the slots past a row's count are masked). Keys and values are never
expanded to the slot layout: the kernels read them by index.

- :func:`edge_attention`: scores ``q[dst] . k_e * scale`` (dot products);
- :func:`edge_softmax_aggregate`: scores given per edge (GAT's LeakyReLU of summed terms), run
  through the same kernels as keys holding the score in their first feature, against one-hot
  queries (``1 * s + 0 * ... = s`` exactly, in every dtype).

Destinations without an incoming edge get zeros (the sum over no edge). Reading ``K`` back is
one host synchronization per call; the index checks (``config.kernels.check_inputs``) read their
ranges in the same one, and the attention kernels below take the indices this module built
without checking them again. A degree distribution so skewed that the padded slots would
outnumber the edges :data:`PADDING_LIMIT` times runs :func:`reference_edge_attention` instead
(segment softmax and ``index_add`` over the edges themselves), which gives the same result.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from fastopt.codegen import checks
from fastopt.codegen.families.degree_stats import degree_stats
from fastopt.codegen.families.segment_reduce import Segments
from fastopt.codegen.families.temporal_attention import sorted_edge_attention, temporal_attention
from fastopt.codegen.layout import acc_dtype
from fastopt.errors import KernelError

__all__ = ["edge_attention", "edge_softmax_aggregate", "edge_slots", "reference_edge_attention",
           "slot_count", "PADDING_LIMIT"]

PADDING_LIMIT = 4
"""Padded slots ``N * K`` allowed per edge (plus one per destination) before the segment path."""


def edge_csr(dst: Tensor, num_dst: int) -> Tuple[Tensor, Tensor]:
    """``(indptr [N + 1], perm [E])``: the edges sorted by destination (stable) as CSR, by the
    segmented reduction's grouping (narrow sort keys, cached row ids)."""
    perm, indptr = Segments().of(dst, num_dst)
    return indptr, perm


def slot_edges(indptr: Tensor, perm: Tensor, slots: int) -> Tensor:
    """``slot_edge [N, K]``: destination ``n``'s ``j``-th incoming edge for ``j`` below its
    in-degree, 0 past it."""
    device, edges = perm.device, perm.numel()
    counts = indptr[1:] - indptr[:-1]
    pos = indptr[:-1, None] + torch.arange(slots, device=device)
    valid = torch.arange(slots, device=device)[None, :] < counts[:, None]
    return torch.where(valid, perm[pos.clamp(max=max(edges - 1, 0))] if edges else
                       torch.zeros_like(pos), 0)


def edge_slots(dst: Tensor, num_dst: int) -> Tuple[Tensor, Tensor]:
    """``(indptr [N + 1], slot_edge [N, K])`` of the edges sorted by destination, ``K`` the largest
    in-degree (at least 1; one host read)."""
    indptr, perm = edge_csr(dst, num_dst)
    counts = indptr[1:] - indptr[:-1]
    slots = max(1, int(counts.max())) if num_dst and dst.numel() else 1
    return indptr, slot_edges(indptr, perm, slots)


def _check(q: Tensor, k: Tensor, v: Tensor, dst: Tensor, k_index: Optional[Tensor],
           v_index: Optional[Tensor]) -> int:
    """Validate the edge-list arguments; returns the number of edges."""
    for name, t in (("q", q), ("k", k), ("v", v), ("dst", dst)):
        checks.is_tensor(name, t)
    checks.has_ndim("q", q, 3, "[N, H, d]")
    checks.has_ndim("dst", dst, 1, "[E], the destination of each edge")
    if dst.dtype not in checks.INDEX_DTYPES:
        raise KernelError(f"dst has dtype {dst.dtype}; supported: int32, int64. Use dst.long()")
    checks.same_device(q, k=k, v=v, dst=dst, k_index=k_index, v_index=v_index)
    edges = dst.numel()
    for name, t, index in (("k", k, k_index), ("v", v, v_index)):
        if index is None:
            if t.shape[0] != edges:
                raise KernelError(f"{name} has {t.shape[0]} rows but there are {edges} edges; pass "
                                  f"one row per edge, or a table with {name}_index [E]")
        else:
            checks.has_ndim(f"{name}_index", index, 1, "[E], the table row of each edge")
            if index.numel() != edges:
                raise KernelError(f"{name}_index has {index.numel()} entries but there are {edges} "
                                  f"edges; pass one table row per edge")
    return edges


def _slots_for(degree: int, rows: int, edges: int) -> Optional[int]:
    """``degree`` (the largest in-degree) rounded up to a power of two, or None where the padded
    slots would outnumber the edges :data:`PADDING_LIMIT` times."""
    # a power of two: the kernels specialize per slot count, and a layer's largest in-degree
    # changes from call to call
    slots = 1 << (degree - 1).bit_length()
    return None if rows * slots > PADDING_LIMIT * (edges + rows) else slots


def _degree_read(dst: Tensor, num_dst: int, named: list) -> int:
    """The largest in-degree of the edges into ``dst`` (at least 1) and, with
    ``config.kernels.check_inputs``, the ranges of ``named`` (``(name, index, rows, fix)``, dst's
    own first), in one host read: :func:`degree_stats` counts the degrees and the range of dst
    and of one more index of the edges' length, in one pass; any further index adds its
    ``aminmax`` to the read. A range error names the index, its bad value and the fix."""
    checked = checks.values_checked()
    others = named[1:] if checked else []
    beside = bool(others) and others[0][1].numel() == dst.numel() and others[0][1].device == dst.device
    parts = [degree_stats(dst, num_dst, others[0][1] if beside else None)]
    rest = others[1:] if beside else others
    for _, t, _, _ in rest:  # as degree_stats keeps them: max(0, max), max(0, -min)
        low, high = torch.aminmax(t.long()) if t.numel() else (t.new_zeros((), dtype=torch.long),) * 2
        parts.append(torch.stack([high.clamp(min=0), (-low).clamp(min=0)]))
    read = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
    if checked:
        pairs = [read[1:3]] + ([read[3:5]] if beside else []) + \
            [read[5 + 2 * i:7 + 2 * i] for i in range(len(rest))]
        for (name, _, rows, fix), (high, negative) in zip([named[0]] + others, pairs):
            _in_range(name, -negative, high, rows, fix)
    return max(1, read[0])


def slot_count(dst: Tensor, num_dst: int, ranged: Sequence[Tuple[str, Tensor, int]] = ()) -> Optional[int]:
    """The ``slots`` of :func:`edge_attention` for edges into ``dst`` (one host read, which also
    checks ``dst`` and the ``(name, index, rows)`` of ``ranged`` with
    ``config.kernels.check_inputs``), or None where the degrees are so skewed that the segment
    path should run (call without ``slots`` then). Read it before a CUDA graph's capture or
    replay: the call with ``slots`` reads nothing back. Destinations outside ``[0, num_dst)``
    are left out of the count (an error with ``check_inputs``)."""
    checks.is_tensor("dst", dst)
    checks.has_ndim("dst", dst, 1, "[E], the destination of each edge")
    _check_count("num_dst", num_dst, "pass the number of destination nodes")
    if dst.numel() == 0 or num_dst == 0:
        return 1
    for name, t, _ in ranged:
        checks.is_tensor(name, t)
        if t.dim() != 1 or t.dtype not in checks.INDEX_DTYPES:
            raise KernelError(f"{name} must be a 1-d int32/int64 index (got {tuple(t.shape)} "
                              f"{t.dtype}); pass the table row of each edge")
    named = [("dst", dst, num_dst, "edges must point at a destination row")] + \
        [(name, t, rows, f"the table has {rows} rows") for name, t, rows in ranged]
    return _slots_for(_degree_read(dst, num_dst, named), num_dst, dst.numel())


def _check_count(name: str, value, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KernelError(f"{name} must be an int >= 0 (got {value!r}); {fix}")


def _in_range(name: str, low: int, high: int, rows: int, fix: str) -> None:
    if low < 0 or high >= rows:
        bad = low if low < 0 else high
        raise KernelError(f"{name} holds {bad}, outside [0, {rows}); {fix}")


def edge_attention(q: Tensor, k: Tensor, v: Tensor, dst: Tensor, *,
                   k_index: Optional[Tensor] = None, v_index: Optional[Tensor] = None,
                   scale: Optional[float] = None, dropout_p: float = 0.0,
                   seed: Union[int, Tensor] = 0, slots: Union[int, str, None] = None) -> Tensor:
    """Per destination ``n``: ``sum_e softmax_e(q[n] . k_e * scale) v_e`` over edges into ``n``.

    Args:
        q: Queries ``[N, H, d]``, one per destination node.
        k: Keys, one per edge ``[E, H, d]``, or a table ``[U, H, d]`` read through ``k_index``.
        v: Values, as ``k`` (through ``v_index``).
        dst: Destination of each edge ``[E]`` (int32/int64, in ``[0, N)``).
        k_index: Table row of each edge's key ``[E]`` (e.g. its source node).
        v_index: Table row of each edge's value ``[E]``.
        scale: Score scale; default ``1 / sqrt(d)``.
        dropout_p: Dropout of the attention weights (kept ones scaled by ``1 / (1 - p)``).
        seed: Philox key of the dropout draws (see :func:`~fastopt.codegen.temporal_attention`).
        slots: The slot count from :func:`slot_count`, read (and the indices checked) by the
            caller: then nothing is read back (a CUDA graph can capture the call), and an edge
            whose destination is ``N`` (one past the last) is padding, left out. Or
            ``"edges"``: no slot layout and no slot count (see
            :func:`~fastopt.codegen.families.temporal_attention.sorted_edge_attention`): nothing is read back and nothing
            checked, whatever the degrees; keys and values one per edge (no ``k_index`` /
            ``v_index``), no dropout; destinations must lie in ``[0, N]`` (``N``: padding).

    Returns:
        ``[N, H, d]``; destinations without an incoming edge are zeros.

    Raises:
        KernelError: on shapes, dtypes, devices or index values that do not fit.
    """
    edges = _check(q, k, v, dst, k_index, v_index)
    rows = q.shape[0]
    if rows == 0 and edges:
        raise KernelError(f"there are {edges} edges but no destination (q has shape "
                          f"{tuple(q.shape)}); pass one query row per destination node")
    if edges == 0:
        # zeros that stay connected to q, k and v (zero gradients, as the sum over no edge has)
        return q.new_zeros(q.shape) + (q[:0].sum() + k[:0].sum() + v[:0].sum())
    if slots == "edges":
        return _sorted_edges(q, k, v, dst, k_index, v_index, scale, dropout_p)
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1
                              or slots & (slots - 1)):
        raise KernelError(f"slots must be a power of two >= 1 (got {slots!r}); pass the value of "
                          f"edge_slot_count(dst, {rows}), or slots=None to read it here")
    if slots is None:
        named = [("dst", dst, rows, "q needs one row per destination node")]
        for name, index, table in (("k_index", k_index, k), ("v_index", v_index, v)):
            if index is not None:
                named.append((name, index, table.shape[0], f"the table has {table.shape[0]} rows"))
        slots = _slots_for(_degree_read(dst, rows, named), rows, edges)
        if slots is None:
            return reference_edge_attention(q, k, v, dst, k_index=k_index, v_index=v_index,
                                            scale=scale, dropout_p=dropout_p, seed=seed)
    indptr, perm = edge_csr(dst, rows)
    slot_edge = slot_edges(indptr, perm, slots)
    k_slots = slot_edge if k_index is None else k_index[slot_edge]
    v_slots = k_slots if v_index is k_index else (  # one index: one sort of it in the backward
        slot_edge if v_index is None else v_index[slot_edge])
    with checks.values_known():  # valid by construction, and checked above
        return temporal_attention(q, k, v, indptr=indptr, k_index=k_slots, v_index=v_slots,
                                  scale=scale, dropout_p=dropout_p, seed=seed)


def _sorted_edges(q: Tensor, k: Tensor, v: Tensor, dst: Tensor, k_index: Optional[Tensor],
                  v_index: Optional[Tensor], scale: Optional[float], dropout_p: float) -> Tensor:
    """:func:`edge_attention` with ``slots="edges"``."""
    if k_index is not None or v_index is not None or dropout_p:
        raise KernelError("slots='edges' takes keys and values one per edge and no dropout (got "
                          f"k_index={k_index is not None}, v_index={v_index is not None}, "
                          f"dropout_p={dropout_p}); gather them per edge, or pass slots=None")
    indptr, perm = edge_csr(dst, q.shape[0])
    return sorted_edge_attention(q, k, v, indptr, perm, scale=scale)


def edge_softmax_aggregate(scores: Tensor, v: Tensor, dst: Tensor, num_dst: int, *,
                           v_index: Optional[Tensor] = None, dropout_p: float = 0.0,
                           seed: Union[int, Tensor] = 0) -> Tensor:
    """Per destination ``n``: ``sum_e softmax_e(scores[e]) v_e`` over edges into ``n``.

    Args:
        scores: Attention logits ``[E, H]``, one per edge and head.
        v: Values ``[E, H, d]``, or a table ``[U, H, d]`` read through ``v_index``.
        dst: Destination of each edge ``[E]``.
        num_dst: Destination nodes ``N``.
        v_index: Table row of each edge's value ``[E]`` (e.g. its source node).
        dropout_p, seed: As in :func:`edge_attention`.

    Returns:
        ``[N, H, d]``; destinations without an incoming edge are zeros.
    """
    checks.is_tensor("scores", scores)
    checks.is_tensor("v", v)
    checks.has_ndim("scores", scores, 2, "[E, H], one logit per edge and head")
    if v.dim() != 3 or v.shape[1] != scores.shape[1]:
        raise KernelError(f"v has shape {tuple(v.shape)} but scores have {scores.shape[1]} heads; "
                          f"pass values [E or U, H={scores.shape[1]}, d]")
    _check_count("num_dst", num_dst, "pass the number of destination nodes")
    dim = v.shape[-1]
    keys = F.pad(scores.unsqueeze(-1), (0, dim - 1))
    query = torch.zeros(num_dst, scores.shape[1], dim, dtype=scores.dtype, device=scores.device)
    query[..., 0] = 1.0
    return edge_attention(query, keys.to(v.dtype), v, dst, v_index=v_index, scale=1.0,
                          dropout_p=dropout_p, seed=seed)


def reference_edge_attention(q: Tensor, k: Tensor, v: Tensor, dst: Tensor, *,
                             k_index: Optional[Tensor] = None, v_index: Optional[Tensor] = None,
                             scale: Optional[float] = None, dropout_p: float = 0.0,
                             seed: Union[int, Tensor] = 0) -> Tensor:
    """:func:`edge_attention` over the edges themselves: segment max, ``exp``, ``index_add``.

    The path of very skewed degrees and the oracle of the tests. Dropout, where active, draws
    with torch's generator (equal in distribution to the kernels', not draw for draw).
    """
    cdt = acc_dtype(q.dtype)
    rows, heads, dim = q.shape
    index = dst.long()
    kd = (k if k_index is None else k[k_index.long()]).to(cdt)
    vd = (v if v_index is None else v[v_index.long()]).to(cdt)
    scores = (q.to(cdt)[index] * kd).sum(-1) * (1.0 / math.sqrt(dim) if scale is None else scale)
    top = scores.new_full((rows, heads), float("-inf")).scatter_reduce(
        0, index[:, None].expand_as(scores), scores.detach(), "amax", include_self=True)
    e = torch.exp(scores - top[index])
    total = e.new_zeros((rows, heads)).index_add(0, index, e)
    p = e / total[index]
    if dropout_p > 0.0:
        p = F.dropout(p, dropout_p)
    out = vd.new_zeros((rows, heads, dim)).index_add(0, index, p[..., None] * vd)
    return out.to(q.dtype)
