"""Run-time side of the rewrites: the functions a rewritten graph calls in place of a subgraph.

A pass replaces a matched subgraph by one ``call_function`` node whose target lives here. Every
such function first checks, on the actual tensors, the conditions a graph pattern cannot see
(ranks, which dimension holds the neighbors, boolean masks, a query of length one, dropout
activity); when they hold it calls the fused operator of :mod:`fastopt.codegen`, otherwise it
runs the original computation op for op. A rewrite therefore never changes what a model
computes, only how fast.

Attention in any written layout is brought to the operator's layout by naming tensor dimensions
with letters, as in an einsum: ``q`` and ``k`` share one contracted letter, the scores carry a
*slot* letter (the neighbor dimension the softmax runs over), and every other letter is a batch
letter. Batch letters along which the mask varies become destination rows ``M``; the rest become
heads ``H`` (they share one mask row). The fused operator then sees ``q [M, H, d]``,
``k/v [M, K, H, d]`` and ``mask [M, K]``.

Rows without a valid neighbor keep the eager semantics of the matched code: zeros when the
weights are zeroed after the softmax (the operator's own convention), NaN when masked scores are
``-inf`` and nothing zeroes them, the plain mean of the values when masked scores are a large
finite negative number (softmax of equal scores is uniform).
"""

from __future__ import annotations

import functools
import itertools
import math
import string
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from fastopt import codegen
from fastopt.config import default_config
from fastopt.runtime import capturing

__all__ = [
    "AttentionLayout",
    "attention_layout",
    "fused_attention",
    "fused_multihead_attention",
    "fused_sdpa",
    "fused_masked_aggregate",
    "fused_time_encode",
    "time_factored_attention",
    "linear_over_parts",
    "linears_over_parts",
    "column_blocks",
    "project_rows",
    "site_shapes",
]

_LETTERS = string.ascii_lowercase

# Problem sizes (K, H, d) each rewrite site saw on its first call; the report reads them to show
# the kernel configuration chosen for that shape. An empty record: the first call declined and
# ran the code it replaced (the factored time encoding, whose conditions are checked per call).
_SITE_SHAPES: Dict[str, Tuple[int, ...]] = {}


def site_shapes(site: str) -> Optional[Tuple[int, ...]]:
    """``(K, H, d)`` the rewrite ``site`` ran with first, or None before its first fused call."""
    return _SITE_SHAPES.get(site)


def _record(site: str, shape: Tuple[int, ...]) -> None:
    if site and site not in _SITE_SHAPES:
        _SITE_SHAPES[site] = shape


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
            them (see :func:`time_factored_attention`).

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
    _record(site, (kk, h, d))
    seed = codegen.dropout_seed(qc) if dropout_p > 0 else 0
    if time_part is not None:
        width = enc.shape[-1]
        wk3, wv3 = wk.reshape(h, d, width), wv.reshape(h, d, width)
        out, shared_out = codegen.shared_attention(
            qc, kc, vc, torch.einsum("rhd,hdt->rht", qc, wk3), enc.reshape(r, kk, width), mc,
            scale=scale, dropout_p=dropout_p, seed=seed)
        out = out + torch.einsum("rht,hdt->rhd", shared_out, wv3)
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


# ----------------------------------------------------------------------------------------------
# explicit attention (passes/attention.py)
# ----------------------------------------------------------------------------------------------


def _dropout_probability(dropout, functional_p: float) -> float:
    """Active dropout probability: a module's ``p`` in training mode, or a traced functional p."""
    if dropout is not None:
        return float(dropout.p) if dropout.training else 0.0
    return float(functional_p)


def _scores(q: Tensor, k: Tensor, style: str) -> Tensor:
    kind, _, arg = style.partition(":")
    if kind == "mul_sum":
        return (q * k).sum(int(arg))
    if kind == "einsum":
        return torch.einsum(arg, q, k)
    return q @ (k.transpose(-2, -1) if kind == "matmul_t" else k)


def _weighted(a: Tensor, v: Tensor, style: str) -> Tensor:
    kind, _, arg = style.partition(":")
    if kind == "mul_sum":
        unsq, red = (int(x) for x in arg.split(":"))
        return (a.unsqueeze(unsq) * v).sum(red)
    if kind == "einsum":
        return torch.einsum(arg, a, v)
    return a @ v


def fused_attention(q: Tensor, k: Tensor, v: Tensor, fill_mask: Tensor, dropout=None, *,
                    scores: str, weighted: str, softmax_dim: int, scale_ops=(), fill: float,
                    zeroed: bool, dropout_p: float = 0.0, site: str = "") -> Tensor:
    """Explicit masked attention: scores, scale, ``masked_fill``, softmax, weighted sum.

    Computes what this code computes, fused when the tensors fit::

        s = scores(q, k)                                  # style `scores`
        s = s * c  (or s / c) for each (op, c) in scale_ops
        a = softmax(s.masked_fill(fill_mask, fill), softmax_dim)
        a = a.masked_fill(fill_mask, 0.0) if zeroed       # zero weights of masked slots
        a = dropout(a)                                    # module, or functional p
        out = weighted(a, v)                              # style `weighted`

    Dropout in training runs inside the kernel (Philox stream keyed by
    :func:`fastopt.codegen.dropout_seed`: the device's generator where the kernels run, no host
    sync, a new key per CUDA-graph replay): equal in distribution to eager dropout, not draw for
    draw. With
    ``config.passes.fuse_dropout`` off, attention with active dropout runs the code above, and so
    does any call whose tensors are where no generated kernel runs (the CPU without the Triton
    interpreter: the reference operator there is slower than this code).
    """
    p = _dropout_probability(dropout, dropout_p)
    fuse = p == 0.0 or (zeroed and default_config().passes.fuse_dropout)
    lay = attention_layout(scores, weighted, softmax_dim, q.dim(), k.dim(), v.dim())
    if default_config().kernels.backend == "auto" and codegen.select_backend(q) != "triton":
        # no generated kernel here (the CPU): the reference operator is slower than this code
        # (TGAT on 2 cores: 1.3-1.5x); kernels.backend="reference" asks for it all the same
        _record(site, ())
        fuse = False
    if fuse and isinstance(lay, AttentionLayout):
        empty = "zero" if zeroed else ("nan" if fill == float("-inf") else "mean")
        out = canonical_attention(q, k, v, lay, ~fill_mask, scale=_scale_of(scale_ops),
                                  dropout_p=p, empty=empty, site=site)
        if out is not None:
            return out
    s = _scores(q, k, scores)
    for op, c in scale_ops:
        s = s * c if op == "mul" else s / c
    a = torch.softmax(s.masked_fill(fill_mask, fill), softmax_dim)
    if zeroed:
        a = a.masked_fill(fill_mask, 0.0)
    if dropout is not None:
        a = dropout(a)
    elif dropout_p > 0.0:
        a = F.dropout(a, dropout_p, training=True)
    return _weighted(a, v, weighted)


def _scale_of(scale_ops) -> float:
    """The one factor that the traced products and quotients by constants multiply scores by."""
    scale = 1.0
    for op, c in scale_ops:
        scale = scale * c if op == "mul" else scale / c
    return scale


def time_factored_attention(q: Tensor, fill_mask: Tensor, dropout, linears, time_linear, dt: Tensor,
                            *parts: Tensor, kv_shape, scores: str, weighted: str,
                            softmax_dim: int, scale_ops=(), fill: float, zeroed: bool,
                            dropout_p: float = 0.0, attention_site: str = "",
                            linear_site: str = "", site: str = "") -> Tensor:
    """:func:`fused_attention` of keys and values ``Linear(cat([*parts, cos(time_linear(dt))]))``
    viewed as ``kv_shape``, the time encoding's part of the projections factored out.

    With ``e_j`` the encoding of slot j and ``W_e`` the weight columns that multiply it, the
    scores ``q . (x_j W_x + e_j W_e)`` are ``q . x_j W_x + (q W_e^T) . e_j`` and the output's
    ``sum_j p_j e_j W_e`` is ``(sum_j p_j e_j) W_e``: :func:`fastopt.codegen.shared_attention`
    takes ``e`` as a block shared by the heads, and the ``[M, K, H, d]`` products of the
    encoding (forward, input and weight gradients) are never computed. TGAT, K = 10, T = 100:
    three products of ``M K x T x 2 H d`` become two of ``M x H d x T``. Runs the unfactored
    computation where ``config.passes.factor_time_encoding`` or the tensors do not allow it.
    """
    enc = fused_time_encode(dt, time_linear)
    shape = tuple(int(s) for s in kv_shape)
    mode = default_config().passes.factor_time_encoding
    p = _dropout_probability(dropout, dropout_p)
    fuse = zeroed and (p == 0.0 or default_config().passes.fuse_dropout)
    lay = attention_layout(scores, weighted, softmax_dim, q.dim(), len(shape), len(shape))
    factor = (mode == "always" or (mode == "auto" and codegen.select_backend(q) == "triton"))
    siblings = len(linears) == 2 and parts and linears[0].weight.dtype == q.dtype \
        and _siblings(linears, (*parts, enc))
    if factor and fuse and siblings and isinstance(lay, AttentionLayout):
        rest = linears[0].in_features - enc.shape[-1]
        k, v = _stacked_product([linear.weight[:, :rest] for linear in linears], linears, parts,
                                linear_site)
        time_part = (enc, linears[0].weight[:, rest:], linears[1].weight[:, rest:])
        out = canonical_attention(q, k.view(shape), v.view(shape), lay, ~fill_mask,
                                  scale=_scale_of(scale_ops), dropout_p=p, empty="zero",
                                  site=attention_site, time_part=time_part)
        if out is not None:
            _record(site, (enc.shape[-1],))
            return out
    _record(site, ())
    k, v = linears_over_parts(linears, *parts, enc, site=linear_site)
    return fused_attention(q, k.view(shape), v.view(shape), fill_mask, dropout, scores=scores,
                           weighted=weighted, softmax_dim=softmax_dim, scale_ops=scale_ops,
                           fill=fill, zeroed=zeroed, dropout_p=dropout_p, site=attention_site)


# ----------------------------------------------------------------------------------------------
# F.scaled_dot_product_attention (passes/attention_sdpa.py)
# ----------------------------------------------------------------------------------------------


def fused_sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor, *, dropout_p: float = 0.0,
               scale: Optional[float] = None, site: str = "") -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask)`` with a boolean mask, fused.

    A row whose mask is all False yields zeros, as eager SDPA does in torch >= 2.5.
    """
    lay = attention_layout("matmul_t", "matmul", -1, q.dim(), k.dim(), v.dim())
    fuse = dropout_p == 0.0 or default_config().passes.fuse_dropout
    if fuse and isinstance(lay, AttentionLayout) and attn_mask.dtype == torch.bool:
        sc = q.shape[-1] ** -0.5 if scale is None else float(scale)
        out = canonical_attention(q, k, v, lay, attn_mask, scale=sc, dropout_p=dropout_p,
                                  empty="zero", site=site)
        if out is not None:
            return out
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          scale=scale)


# ----------------------------------------------------------------------------------------------
# nn.MultiheadAttention (passes/attention_mha.py)
# ----------------------------------------------------------------------------------------------


def _mha_fits(mha: torch.nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor,
              key_padding_mask: Optional[Tensor]) -> bool:
    if key_padding_mask is None or key_padding_mask.dtype != torch.bool:
        return False
    if mha.bias_k is not None or mha.add_zero_attn or query.dim() != 3 or key.dim() != 3:
        return False
    if key.shape[:2] != value.shape[:2]:
        return False
    return (query.shape[1] if mha.batch_first else query.shape[0]) == 1


def _mha_projections(mha: torch.nn.MultiheadAttention):
    e = mha.embed_dim
    if mha._qkv_same_embed_dim:
        wq, wk, wv = mha.in_proj_weight.split(e)
    else:
        wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
    bias = mha.in_proj_bias
    bq, bk, bv = bias.split(e) if bias is not None else (None, None, None)
    return (wq, bq), (wk, bk), (wv, bv)


def fused_multihead_attention(mha: torch.nn.MultiheadAttention, query: Tensor, key: Tensor,
                              value: Tensor, key_padding_mask: Optional[Tensor] = None, *,
                              need_weights: bool = True, site: str = ""):
    """``mha(query, key, value, key_padding_mask=...)`` for a query of length one, fused.

    Returns ``(output, None)`` like ``nn.MultiheadAttention`` with ``need_weights=False``; the
    rewrite only happens where the weights are unused. Rows whose keys are all padding yield
    ``out_proj(0)``, as eager attention does in torch >= 2.5. Keys and values of one tensor (the
    TGN style ``attn(q, kv, kv)``) are projected by one product of the stacked weights
    (``config.passes.merge_sibling_linears``) whose column blocks the kernel reads in place.
    """
    p = mha.dropout if mha.training else 0.0
    fuse = p == 0.0 or default_config().passes.fuse_dropout
    if fuse and _mha_fits(mha, query, key, value, key_padding_mask):
        shared = key is value and default_config().passes.merge_sibling_linears
        if not mha.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        (wq, bq), (wk, bk), (wv, bv) = _mha_projections(mha)
        m, kk = key.shape[:2]
        h = mha.num_heads
        d = mha.embed_dim // h
        q = _projection(query[:, 0], wq, bq).view(m, h, d)
        if shared:  # keys and values of one sequence: one product, read as column blocks
            kv = _projection(key, torch.cat([wk, wv]), None if bk is None else torch.cat([bk, bv]))
            k, v = (block.view(m, kk, h, d)
                    for block in column_blocks(kv, (mha.embed_dim, mha.embed_dim)))
        else:
            k = _projection(key, wk, bk).view(m, kk, h, d)
            v = _projection(value, wv, bv).view(m, kk, h, d)
        _record(site, (kk, h, d))
        seed = codegen.dropout_seed(q) if p > 0 else 0
        out = codegen.temporal_attention(q, k, v, ~key_padding_mask, scale=d ** -0.5,
                                         dropout_p=p, seed=seed)
        out = _projection(out.reshape(m, mha.embed_dim), mha.out_proj.weight, mha.out_proj.bias)
        return out.unsqueeze(1 if mha.batch_first else 0), None
    return mha(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights)


# ----------------------------------------------------------------------------------------------
# masked aggregation (passes/aggregate.py)
# ----------------------------------------------------------------------------------------------


def fused_masked_aggregate(x: Tensor, weight: Tensor, count: Optional[Tensor] = None, *,
                           form: str, dim: int, reduce: str, proven: bool = True,
                           site: str = "") -> Tensor:
    """Masked sum or mean of neighbor rows over ``dim``, fused.

    Computes, with ``form="mul"``: ``s = (x * weight).sum(dim)``; with ``form="fill"``:
    ``s = x.masked_fill(weight, 0).sum(dim)``; then for ``reduce="mean"``: ``s / count``, where
    ``count`` is the clamped number of valid slots. ``weight`` of form ``"mul"`` must hold 0/1
    values of a boolean mask: ``proven`` says the pass saw it cast from a boolean; otherwise
    ``weight`` itself must be boolean when called. ``weight`` of form ``"fill"`` is True on the
    slots to drop.
    """
    d = _norm(dim, x.dim())
    fits = d is not None and d >= 1 and x.dim() >= 2 and weight.dim() <= x.dim() and \
        (proven or weight.dtype == torch.bool)
    if fits:
        w = weight.reshape((1,) * (x.dim() - weight.dim()) + tuple(weight.shape))
        fits = all(n == 1 for n in w.shape[d + 1:]) and x.is_floating_point()
    if fits:
        lead = tuple(x.shape[:d + 1])
        valid = (w != 0) if form == "mul" else ~w
        valid = valid.reshape(w.shape[:d + 1]).expand(lead)
        rows = math.prod(lead[:-1])
        if rows > 0 and lead[-1] > 0:
            xs = x.reshape(rows, lead[-1], *x.shape[d + 1:])
            out = codegen.masked_aggregate(xs, valid.reshape(rows, lead[-1]), reduce=reduce)
            _record(site, (lead[-1],) + tuple(x.shape[d + 1:]))
            return out.reshape(lead[:-1] + tuple(x.shape[d + 1:]))
    s = (x * weight).sum(dim) if form == "mul" else x.masked_fill(weight, 0).sum(dim)
    return s if count is None else s / count


# ----------------------------------------------------------------------------------------------
# time encoding (passes/time_encoding.py)
# ----------------------------------------------------------------------------------------------


def fused_time_encode(dt: Tensor, linear: torch.nn.Linear, *, site: str = "") -> Tensor:
    """``torch.cos(linear(dt.unsqueeze(-1)))`` for a ``Linear(1, T)``, fused: always, or only
    while a CUDA graph is being captured (``config.passes.fuse_time_encoding``)."""
    w = linear.weight
    mode = default_config().passes.fuse_time_encoding
    fuse = mode == "always" or (mode == "graphs" and dt.is_cuda and capturing())
    if fuse and dt.dtype == w.dtype and w.shape[1] == 1 and dt.is_floating_point():
        b = linear.bias if linear.bias is not None else w.new_zeros(w.shape[0])
        _record(site, (w.shape[0],))
        return codegen.time_encode(dt, w[:, 0], b)
    return torch.cos(linear(dt.unsqueeze(-1)))


# ----------------------------------------------------------------------------------------------
# projection before gather (passes/project_before_gather.py)
# ----------------------------------------------------------------------------------------------


def _split_groups(linear: torch.nn.Module, parts: Sequence[Tensor]
                  ) -> Optional[Tuple[List[int], List[int]]]:
    """The parts :func:`linear_over_parts` multiplies apart: ``(no gradient, gradient)`` indices.

    None (run the original) when: the knob is off; no gradient is recorded (nothing to save);
    autocast would round the first product before the sum; the module is not a plain
    ``nn.Linear`` call (a subclass forward, forward hooks or pre-hooks such as old-style weight
    norm, global module hooks); the parts are not all same-dtype tensors of one leading shape
    whose widths sum to the weight's; a zero-width part needs a gradient (it would get none); or
    all parts fall in one group.
    """
    if not _plain_linear(linear):
        return None
    return _weight_groups(linear.weight, parts)


def _weight_groups(weight: Tensor, parts: Sequence[Part]
                   ) -> Optional[Tuple[List[int], List[int]]]:
    """:func:`_split_groups` of a projection by ``weight`` (any module checks done)."""
    if not default_config().passes.split_linear_inputs or not torch.is_grad_enabled():
        return None
    if any(torch.is_autocast_enabled(t) for t in ("cpu", "cuda")):
        return None
    if any(_tensor(p) is None or len(_shape(p)) == 0 for p in parts):
        return None
    lead = _shape(parts[0])[:-1]
    free, grad, width = [], [], 0
    for i, p in enumerate(parts):
        shape, t = _shape(p), _tensor(p)
        if shape[:-1] != lead or t.dtype != weight.dtype:
            return None
        width += shape[-1]
        if shape[-1] == 0:
            if t.requires_grad:
                return None
            continue
        (grad if t.requires_grad else free).append(i)
    if width != weight.shape[1] or not free or not grad:
        return None
    return free, grad


# A part of a concatenation: a tensor, or ``(rows, index)`` standing for ``rows[index]`` (a
# gather the pass handed over unevaluated, so that a projection can run on the rows).
Part = Union[Tensor, Tuple[Tensor, Tensor]]


def _is_rows(p: Part) -> bool:
    return isinstance(p, tuple)


def _tensor(p: Part) -> Optional[Tensor]:
    """The tensor holding a part's values (the rows of a gathered part), or None if not one."""
    t = p[0] if _is_rows(p) else p
    return t if isinstance(t, Tensor) else None


def _shape(p: Part) -> tuple:
    """The shape of the part's value (``(*index.shape, width)`` for a gathered part)."""
    return (*p[1].shape, *p[0].shape[1:]) if _is_rows(p) else tuple(p.shape)


def _gathered(parts: Sequence[Part], keep: Sequence[int] = ()) -> Tuple[Part, ...]:
    """``parts`` with each ``(rows, index)`` evaluated to ``rows[index]``, except those at ``keep``
    whose rows are fewer than the slots they fill (projecting the rows first is then cheaper)."""
    return tuple(p if i in keep and _is_rows(p) and p[0].shape[0] < p[1].numel()
                 else (p[0][p[1]] if _is_rows(p) else p) for i, p in enumerate(parts))


def linear_over_parts(linear: torch.nn.Linear, *parts: Tensor, site: str = "") -> Tensor:
    """``linear(torch.cat(parts, -1))``, the parts that need no gradient multiplied apart.

    ``y = x_free W_free^T + bias + x_grad W_grad^T`` where ``x_free`` / ``x_grad`` concatenate the
    parts that do not / do require gradients and ``W_*`` are their column blocks of the weight:
    the backward computes no input gradient for the free parts and the full concatenation is never
    written. Runs the original when there is nothing to split or ``config.passes.split_linear_inputs``
    is off.
    """
    groups = _split_groups(linear, parts)
    if groups is None:
        x = torch.cat(_gathered(parts), dim=-1)
        if _plain_linear(linear) and _bias_grad(linear.bias) == "column_sum":
            return _projection(x, linear.weight, linear.bias)
        return linear(x)
    return _product_over_parts(linear.weight, linear.bias, _gathered(parts, _rows_kept(groups)),
                               groups, site)


def _rows_kept(groups: Tuple[List[int], List[int]]) -> Tuple[int, ...]:
    """The gathered part projected before its gather: the free group's, when it is alone there."""
    free, _ = groups
    return tuple(free) if len(free) == 1 else ()


def linears_over_parts(linears: Sequence[torch.nn.Linear], *parts: Tensor,
                       site: str = "") -> Tuple[Tensor, ...]:
    """``tuple(linear(torch.cat(parts, -1)) for linear in linears)`` as one product.

    Sibling projections of one input (TGAT's keys and values) multiply the input once by their
    weights stacked (``torch.cat`` of the weights, so each Linear's gradient flows to its own
    parameters): one read of the input and one wider, better-occupied product in the forward; in
    the backward one weight-gradient product, one bias reduction and one input gradient instead
    of one per sibling plus their sum. The parts are split as in :func:`linear_over_parts`. The
    results are column blocks of the product (views with the product's row stride; the pass
    merges only siblings whose users accept such views). Each Linear runs on its own when
    ``config.passes.merge_sibling_linears`` is off or they cannot be stacked (another class or
    hooks, other input widths, dtypes or devices, biases on some only).
    """
    if not default_config().passes.merge_sibling_linears or not _siblings(linears, parts):
        return tuple(linear_over_parts(linear, *parts, site=site) for linear in linears)
    return _stacked_product([linear.weight for linear in linears], linears, parts, site)


def _stacked_product(weights: Sequence[Tensor], linears: Sequence[torch.nn.Linear],
                     parts: Sequence[Tensor], site: str) -> Tuple[Tensor, ...]:
    """The column blocks of ``F.linear(cat(parts), cat(weights), cat(biases))``: sibling
    projections (or column slices ``weights`` of their weights) as one product, split over the
    parts as :func:`linear_over_parts` splits them."""
    weight = torch.cat(list(weights))
    bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
    groups = _weight_groups(weight, parts)
    if groups is None:
        y = _projection(torch.cat(_gathered(parts), dim=-1), weight, bias)
    else:
        y = _product_over_parts(weight, bias, _gathered(parts, _rows_kept(groups)), groups, site)
    return column_blocks(y, [linear.out_features for linear in linears])


def column_blocks(y: Tensor, widths: Sequence[int]) -> Tuple[Tensor, ...]:
    """``torch.split(y, widths, -1)``, whose backward takes the blocks' gradients as they lie when
    they are the blocks of one tensor laid out as ``y`` (the fused attention writes the key and
    value gradients so): no concatenation. Only where gradients are recorded; the blocks may not
    be written in place (as ``split``'s)."""
    if not torch.is_grad_enabled() or not y.requires_grad:
        return torch.split(y, list(widths), dim=-1)
    return _ColumnBlocks.apply(y, tuple(widths))


def adjacent_blocks(grads: Sequence[Optional[Tensor]], shape: Sequence[int],
                    stride: Sequence[int], dtype: torch.dtype,
                    widths: Sequence[int]) -> Optional[Tensor]:
    """The tensor of ``shape`` and ``stride`` whose column blocks of ``widths`` are ``grads``, if
    they already are exactly that (one storage, adjacent offsets, the same strides wherever a
    dimension has more than one element, no lazy conjugation or negation); else None."""
    if any(g is None for g in grads) or stride[-1] != 1:
        return None
    first = grads[0]
    offset, storage = first.storage_offset(), first.untyped_storage().data_ptr()
    for g, start in zip(grads, itertools.accumulate([0, *widths[:-1]])):
        if (g.untyped_storage().data_ptr() != storage or g.dtype != dtype or g.is_conj()
                or g.is_neg() or g.storage_offset() != offset + start
                or any(n > 1 and s != t for n, s, t in zip(g.shape, g.stride(), stride))):
            return None
    return first.as_strided(shape, stride, offset)


class _ColumnBlocks(torch.autograd.Function):
    """See :func:`column_blocks`."""

    @staticmethod
    def forward(ctx, y, widths):
        ctx.widths = widths
        ctx.layout = (tuple(y.shape), tuple(y.stride()), y.dtype, y.device)
        return tuple(y.split(list(widths), dim=-1))

    @staticmethod
    def backward(ctx, *grads):
        shape, stride, dtype, device = ctx.layout
        whole = None
        if not torch.is_grad_enabled():  # the shortcut is not differentiable (create_graph=True)
            whole = adjacent_blocks(grads, shape, stride, dtype, ctx.widths)
        if whole is None:
            whole = torch.cat([g if g is not None else
                               torch.zeros(*shape[:-1], w, dtype=dtype, device=device)
                               for g, w in zip(grads, ctx.widths)], dim=-1)
        return whole, None


def _siblings(linears: Sequence[torch.nn.Module], parts: Sequence[Tensor]) -> bool:
    """Whether ``linears`` (two or more) can multiply ``parts`` as one stacked product: plain
    Linears of one input width, dtype and device, all with or all without bias."""
    if len(linears) < 2:
        return False
    first = linears[0]
    for linear in linears:
        if not _plain_linear(linear):
            return False
        if (linear.in_features != first.in_features or linear.weight.dtype != first.weight.dtype
                or linear.weight.device != first.weight.device
                or (linear.bias is None) != (first.bias is None)):
            return False
    return all(_tensor(p) is not None and _tensor(p).device == first.weight.device for p in parts)


def _plain_linear(linear: torch.nn.Module) -> bool:
    """A plain ``nn.Linear`` call: its own forward, no module hooks, no global module hooks."""
    from torch.nn.modules import module as module_hooks

    return (isinstance(linear, torch.nn.Linear) and type(linear).forward is torch.nn.Linear.forward
            and not linear._forward_hooks and not linear._forward_pre_hooks
            and not module_hooks._global_forward_hooks
            and not module_hooks._global_forward_pre_hooks)


def _product_over_parts(weight: Tensor, bias: Optional[Tensor], parts: Sequence[Tensor],
                        groups: Tuple[List[int], List[int]], site: str) -> Tensor:
    """``F.linear(torch.cat(parts, -1), weight, bias)`` as ``x_free W_free^T + b + x_grad W_grad^T``
    (``groups``: the part indices without and with gradient)."""
    free, grad = groups
    starts = [0]
    for p in parts:
        starts.append(starts[-1] + _shape(p)[-1])

    def group(members: List[int]) -> Tuple[Tensor, Tensor]:
        x = parts[members[0]] if len(members) == 1 else torch.cat([parts[i] for i in members], -1)
        blocks = [weight[:, starts[i]:starts[i + 1]] for i in members]
        w = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        return (x if _is_rows(x) else x.reshape(-1, x.shape[-1])), w

    x_free, w_free = group(free)
    x_grad, w_grad = group(grad)
    # addmm, or generated (config.kernels.matmul_precision)
    if _is_rows(x_free):  # gathered rows (the batch's unique edges): project each row once
        rows, index = x_free
        y = _ProjectedRows.apply(rows, index.reshape(-1), w_free, bias)
        _record(site, (rows.shape[1], x_grad.shape[1], rows.shape[0], index.numel()))
    else:
        y = codegen.linear(x_free, w_free, bias, bias_grad=_bias_grad(bias))
        _record(site, (x_free.shape[1], x_grad.shape[1]))
    y = codegen.linear(x_grad, w_grad, residual=y)
    return y.view(*_shape(parts[0])[:-1], weight.shape[0])


class _ProjectedRows(torch.autograd.Function):
    """``F.linear(rows[index], weight, bias)`` computed as ``F.linear(rows, weight, bias)[index]``
    for rows that need no gradient. The backward forms the weight gradient from the gathered rows
    (``grad^T rows[index]``, the product the unsplit projection computes) rather than scattering
    the gradient onto the rows: a scatter-add serializes on rows that many slots share (every
    padded slot reads one row), a gather and a product do not, and the sum stays in a fixed order."""

    @staticmethod
    def forward(ctx, rows: Tensor, index: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        ctx.save_for_backward(rows, index)
        ctx.has_bias = bias is not None
        return F.linear(rows, weight, bias)[index]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        rows, index = ctx.saved_tensors
        grad_w = grad.t() @ rows[index] if ctx.needs_input_grad[2] else None
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return None, None, grad_w, grad_b


def _bias_grad(bias: Optional[Tensor]) -> str:
    """How a rewritten projection sums its bias gradient (``config.passes.bias_grad_kernel``):
    ``"column_sum"`` (the generated kernel) always, or only while a CUDA graph is being captured
    (where its autograd node costs no host time); else ``"torch"``."""
    if bias is None:
        return "torch"
    mode = default_config().passes.bias_grad_kernel
    if mode == "always" or (mode == "graphs" and bias.is_cuda and capturing()):
        return "column_sum"
    return "torch"


def _projection(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``F.linear(x, weight, bias)``, the bias gradient as :func:`_bias_grad` says."""
    mode = _bias_grad(bias)
    if mode == "torch":
        return F.linear(x, weight, bias)
    y = codegen.linear(x.reshape(-1, x.shape[-1]), weight, bias, bias_grad=mode)
    return y.view(*x.shape[:-1], weight.shape[0])


def project_rows(linear: torch.nn.Module, table: Tensor, index: Tensor, *, site: str = "") -> Tensor:
    """``linear(table[index])``, computed as ``linear(table)[index]`` when the table is smaller.

    A row-wise projection commutes with a row gather; projecting the unique table rows once is
    cheaper whenever the table has fewer rows than the index selects.
    """
    if table.dim() >= 1 and index.dtype in (torch.int32, torch.int64) and \
            table.shape[0] < index.numel():
        _record(site, (table.shape[0], index.numel()))
        return linear(table)[index]
    return linear(table[index])
