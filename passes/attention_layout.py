"""Attention in any written layout brought to the layout of :func:`fastopt.codegen.temporal_attention`.

The attention lowerings (``attention.py``, ``attention_sdpa.py``, and the factored time encoding
of ``time_encoding.py``) share this: :func:`attention_layout` reads the layout of an attention
from the styles its pattern matched, and :func:`canonical_attention` runs the fused operator on
tensors in that layout, or declines (returns None) so that the caller runs the original code.

Tensor dimensions are named with letters, as in an einsum: ``q`` and ``k`` share one contracted
letter, the scores carry a *slot* letter (the neighbor dimension the softmax runs over), and every
other letter is a batch letter. Batch letters along which the mask varies become destination rows
``M``; the rest become heads ``H`` (they share one mask row). The fused operator then sees
``q [M, H, d]``, ``k/v [M, K, H, d]`` and ``mask [M, K]``.

Rows without a valid neighbor keep the eager semantics of the matched code: zeros when the
weights are zeroed after the softmax (the operator's own convention), NaN when masked scores are
``-inf`` and nothing zeroes them, the plain mean of the values when masked scores are a large
finite negative number (softmax of equal scores is uniform).
"""

from __future__ import annotations

import functools
import math
import string
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fastopt import codegen
from fastopt.passes.sites import record

__all__ = ["AttentionLayout", "attention_layout", "canonical_attention"]

_LETTERS = string.ascii_lowercase


# ----------------------------------------------------------------------------------------------
# layouts
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionLayout:
    """Dimension letters of an attention computation (see the module docstring).

    Attributes:
        q, k, v: Letters of the query, key and value tensors (keys as passed to the call).
        scores: Letters of the score tensor.
        slot: The neighbor letter the softmax normalizes over.
        contracted: The letter ``q`` and ``k`` are summed over.
        feature: The value letter that reaches the output.
        out: Letters of the output.
    """

    q: str
    k: str
    v: str
    scores: str
    slot: str
    contracted: str
    feature: str
    out: str


def _norm(dim: int, rank: int) -> Optional[int]:
    d = dim + rank if dim < 0 else dim
    return d if 0 <= d < rank else None


def _parse_einsum(eq: str, operands: int) -> Optional[Tuple[Sequence[str], str]]:
    eq = eq.replace(" ", "")
    if "..." in eq or "->" not in eq:
        return None
    lhs, out = eq.split("->")
    ins = lhs.split(",")
    if len(ins) != operands or not all(s.isalpha() for s in ins + [out]):
        return None
    return ins, out


def _score_letters(scores: str, q_rank: int, k_rank: int):
    """``(q, k, scores)`` letters of a score style, or a reason string."""
    style, _, arg = scores.partition(":")
    if style == "mul_sum":
        r = max(q_rank, k_rank)
        c = _norm(int(arg), r)
        if c is None:
            return f"the score sum over dim {arg} is outside a rank-{r} product"
        letters = _LETTERS[:r]
        return letters[r - q_rank:], letters[r - k_rank:], letters[:c] + letters[c + 1:]
    if style == "einsum":
        parsed = _parse_einsum(arg, 2)
        if parsed is None:
            return f"einsum {arg!r} uses ellipsis or is not 'qk,kk->ss' shaped"
        (qs, ks), ss = parsed
        if len(qs) != q_rank or len(ks) != k_rank:
            return f"einsum {arg!r} does not fit ranks {q_rank}, {k_rank}"
        return qs, ks, ss
    if style in ("matmul", "matmul_t"):
        if q_rank < 2 or k_rank < 2:
            return "matmul with a vector operand"
        nb = max(q_rank, k_rank) - 2
        batch = _LETTERS[:nb]
        a, c, n = _LETTERS[nb:nb + 3]
        qs = batch[nb - (q_rank - 2):] + a + c
        kb = batch[nb - (k_rank - 2):]
        ks = kb + c + n if style == "matmul" else kb + n + c
        return qs, ks, batch + a + n
    return f"unknown score style {scores!r}"


def _weighted_letters(weighted: str, scores: str, slot: str, v_rank: int, taken: str):
    """``(v, out, feature)`` letters of a weighted-sum style, or a reason string."""
    fresh = iter(ch for ch in _LETTERS if ch not in taken)
    style, _, arg = weighted.partition(":")
    if style == "mul_sum":
        unsq, red = (int(x) for x in arg.split(":"))
        rank = len(scores) + 1
        u = _norm(unsq, rank)
        j = _norm(red, rank)
        if u is None or j is None or v_rank > rank:
            return "the weighted sum's dimensions do not fit the score rank"
        e = next(fresh)
        product = scores[:u] + e + scores[u:]
        if product[j] != slot:
            return (f"the softmax normalizes dim {scores.index(slot)} of the scores but the "
                    f"weighted sum reduces another dimension")
        return product[rank - v_rank:], product.replace(slot, ""), e
    if style == "einsum":
        parsed = _parse_einsum(arg, 2)
        if parsed is None:
            return f"einsum {arg!r} uses ellipsis or is not 'aa,vv->oo' shaped"
        (a_s, v_s), o_s = parsed
        if len(a_s) != len(scores) or len(v_s) != v_rank or len(set(a_s)) != len(a_s):
            return f"einsum {arg!r} does not fit the score rank"
        rename = dict(zip(a_s, scores))
        for ch in v_s + o_s:
            if ch not in rename:
                rename[ch] = next(fresh)
        v_l = "".join(rename[ch] for ch in v_s)
        o_l = "".join(rename[ch] for ch in o_s)
        extra = [ch for ch in v_l if ch not in scores]
        if len(extra) != 1 or slot in o_l:
            return f"einsum {arg!r} does not sum the weights over the softmax dimension"
        return v_l, o_l, extra[0]
    if style == "matmul":
        if scores[-1] != slot:
            return "att @ v contracts the last score dimension, not the softmax dimension"
        if v_rank < 2 or v_rank - 2 > len(scores) - 2:
            return "att @ v with a value rank that does not fit"
        e = next(fresh)
        vb = scores[:-2]
        return vb[len(vb) - (v_rank - 2):] + slot + e, scores[:-1] + e, e
    return f"unknown weighted-sum style {weighted!r}"


@functools.lru_cache(maxsize=1024)
def attention_layout(scores: str, weighted: str, softmax_dim: int, q_rank: int, k_rank: int,
                     v_rank: int):
    """The :class:`AttentionLayout` of an attention written in the given styles, or a reason.

    Args:
        scores: ``"mul_sum:<dim>"`` (``(q * k).sum(dim)``), ``"einsum:<eq>"``, ``"matmul"``
            (``q @ k`` with ``k`` already ``[..., d, K]``) or ``"matmul_t"`` (``q @ k.mT``).
        weighted: ``"mul_sum:<unsqueeze dim>:<sum dim>"`` (``(a.unsqueeze(u) * v).sum(j)``),
            ``"einsum:<eq>"`` or ``"matmul"`` (``a @ v``).
        softmax_dim: Dimension of the scores the softmax runs over.
        q_rank, k_rank, v_rank: Ranks of the tensors.

    Returns:
        An :class:`AttentionLayout`, or a string saying why the styles do not form attention.
    """
    got = _score_letters(scores, q_rank, k_rank)
    if isinstance(got, str):
        return got
    qs, ks, ss = got
    sd = _norm(softmax_dim, len(ss))
    if sd is None:
        return f"softmax dim {softmax_dim} is outside the rank-{len(ss)} scores"
    slot = ss[sd]
    contracted = [ch for ch in qs if ch in ks and ch not in ss]
    if len(contracted) != 1 or any(ch not in ss and ch not in contracted for ch in qs + ks):
        return "the scores do not contract exactly one dimension of q and k"
    if slot not in ks:
        return f"the softmax runs over dim {sd} of the scores, which is not a neighbor dimension of k"
    got = _weighted_letters(weighted, ss, slot, v_rank, ss + contracted[0])
    if isinstance(got, str):
        return got
    vs, outs, feature = got
    if slot not in vs or sorted(outs) != sorted(ss.replace(slot, "") + feature):
        return "the weighted sum does not reduce the values over the softmax dimension"
    return AttentionLayout(qs, ks, vs, ss, slot, contracted[0], feature, outs)


# ----------------------------------------------------------------------------------------------
# canonical attention
# ----------------------------------------------------------------------------------------------


def _arrange(t: Tensor, sub: str, order: Sequence[str], sizes: Dict[str, int]) -> Optional[Tensor]:
    """``t`` (letters ``sub``) permuted and broadcast to the letters ``order``; None if impossible."""
    for i in reversed(range(len(sub))):
        if sub[i] not in order:
            if t.shape[i] != 1:
                return None
            t = t.squeeze(i)
    kept = [ch for ch in sub if ch in order]
    missing = [ch for ch in order if ch not in kept]
    t = t.reshape(tuple(t.shape) + (1,) * len(missing))
    letters = kept + missing
    t = t.permute([letters.index(ch) for ch in order])
    return t.expand([sizes[ch] for ch in order])


def _sizes(pairs) -> Optional[Dict[str, int]]:
    sizes: Dict[str, int] = {}
    for t, sub in pairs:
        if t.dim() != len(sub):
            return None
        for ch, n in zip(sub, t.shape):
            cur = sizes.get(ch, 1)
            if n != 1 and cur != 1 and n != cur:
                return None
            sizes[ch] = n if cur == 1 else cur
    return sizes


def _prod(sizes: Dict[str, int], letters: Sequence[str]) -> int:
    return math.prod(sizes[ch] for ch in letters)


def per_head_product(x: Tensor, w: Tensor) -> Tensor:
    """``x [R, H, A]`` times each head's ``w [H, A, B]``: ``[R, H, B]``, as one product with the
    block-diagonal weight ``[H*A, H*B]``.

    A product batched over a few heads (``einsum("rha,hab->rhb")``) has weight gradients of a
    few small outputs each reducing over all R rows, for which the batched kernels run a handful
    of thread blocks. One product of the stacked heads has an output H*H times larger to spread,
    at H times the multiply-adds of products this small; the off-diagonal blocks add exact zeros.
    (H200, TGAT with the factored time encoding: 0.825 -> 0.645 s an epoch.)
    """
    rows, heads = x.shape[0], w.shape[0]
    blocks = w[0] if heads == 1 else torch.block_diag(*w.unbind(0))  # one head: no copy
    return (x.reshape(rows, -1) @ blocks).view(rows, heads, w.shape[2])


def canonical_attention(q: Tensor, k: Tensor, v: Tensor, lay: AttentionLayout, valid: Tensor, *,
                        scale: float, dropout_p: float, empty: str, site: str = "",
                        time_part: Optional[Tuple[Tensor, Tensor, Tensor]] = None
                        ) -> Optional[Tensor]:
    """Run :func:`fastopt.codegen.temporal_attention` on tensors in any layout ``lay``.

    Args:
        q, k, v: Tensors with the letters of ``lay``.
        lay: Their layout.
        valid: Boolean mask broadcastable to the scores (True = neighbor takes part).
        scale: Score scale.
        dropout_p: Dropout probability of the attention weights (0 = none).
        empty: What rows without a valid neighbor produce: ``"zero"``, ``"nan"`` or ``"mean"``.
        site: Rewrite site, for the report.
        time_part: ``(enc, wk, wv)``: keys and values are ``k + enc wk^T`` and ``v + enc wv^T``
            (``enc [..., K, T]`` laid out as the keys without their head letters, ``wk, wv
            [H*d, T]``), computed by :func:`fastopt.codegen.shared_attention` without building
            them (see :func:`fastopt.passes.time_encoding.time_factored_attention`).

    Returns:
        The output with the letters ``lay.out``, or None when the tensors do not fit the
        operator (the caller then runs the original computation).
    """
    if valid.dtype != torch.bool or valid.dim() > len(lay.scores):
        return None
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        return None
    v_sub = lay.scores[len(lay.scores) - valid.dim():]
    sizes = _sizes(((q, lay.q), (k, lay.k), (v, lay.v), (valid, v_sub)))
    if sizes is None or sizes[lay.contracted] != sizes[lay.feature]:
        return None
    if lay.slot in lay.q and q.shape[lay.q.index(lay.slot)] != 1:
        return None
    batch = [ch for ch in lay.scores if ch != lay.slot]
    heads = [ch for ch in batch if sizes[ch] > 1
             and (ch not in v_sub or valid.shape[v_sub.index(ch)] == 1)]
    rows = [ch for ch in batch if ch not in heads]
    r, h, kk, d = _prod(sizes, rows), _prod(sizes, heads), sizes[lay.slot], sizes[lay.contracted]
    if r * kk == 0:
        return None
    qc = _arrange(q, lay.q, rows + heads + [lay.contracted], sizes)
    kc = _arrange(k, lay.k, rows + [lay.slot] + heads + [lay.contracted], sizes)
    vc = _arrange(v, lay.v, rows + [lay.slot] + heads + [lay.feature], sizes)
    mc = _arrange(valid, v_sub, rows + [lay.slot], sizes)
    if qc is None or kc is None or vc is None or mc is None:
        return None
    qc, kc, vc = qc.reshape(r, h, d), kc.reshape(r, kk, h, d), vc.reshape(r, kk, h, d)
    mc = mc.reshape(r, kk)
    if time_part is not None:
        # keys and values laid out [rows, slot, heads, feature] (their H*d columns are the
        # projection's), the encoding [rows, slot, T] at the scores' full sizes
        enc, wk, wv = time_part
        plain = (list(lay.k) == rows + [lay.slot] + heads + [lay.contracted]
                 and list(lay.v) == rows + [lay.slot] + heads + [lay.feature])
        if (empty != "zero" or not plain
                or tuple(enc.shape[:-1]) != tuple(sizes[ch] for ch in rows + [lay.slot])
                or wk.shape != (h * d, enc.shape[-1]) or wv.shape != wk.shape
                or enc.dtype != qc.dtype):
            return None
    record(site, (kk, h, d))
    seed = codegen.dropout_seed(qc) if dropout_p > 0 else 0
    if time_part is not None:
        width = enc.shape[-1]
        wk3, wv3 = wk.reshape(h, d, width), wv.reshape(h, d, width)
        out, shared_out = codegen.shared_attention(
            qc, kc, vc, per_head_product(qc, wk3), enc.reshape(r, kk, width), mc,
            scale=scale, dropout_p=dropout_p, seed=seed)
        out = out + per_head_product(shared_out, wv3.transpose(1, 2))
    else:
        out = codegen.temporal_attention(qc, kc, vc, mc, scale=scale, dropout_p=dropout_p,
                                         seed=seed)
    if empty != "zero":
        none = ~mc.any(1)[:, None, None]
        fill = vc.mean(1) if empty == "mean" else torch.full_like(out, float("nan"))
        out = torch.where(none, fill, out)
    letters = rows + heads + [lay.feature]
    out = out.reshape([sizes[ch] for ch in letters])
    return out.permute([letters.index(ch) for ch in lay.out]).contiguous()
