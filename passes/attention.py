"""``fuse_temporal_attention``: explicit masked attention over neighbors -> one fused operator.

Pattern (every style variant real TGNN code uses)::

    s = (q * k).sum(-1)          | torch.einsum("...", q, k) | q @ k.transpose(-2, -1) | torch.bmm
    s = s * scale                # zero or more products/quotients by a Python number
    s = s.masked_fill(m, -1e9)   # or float("-inf"), any value <= -1e9; m a boolean mask
    a = torch.softmax(s, dim)    # F.softmax, Tensor.softmax, nn.Softmax; over the neighbor dim
    a = a.masked_fill(m, 0.0)    # optional, same mask: rows without neighbors become zeros
    a = dropout(a)               # optional: nn.Dropout, F.dropout
    out = (a.unsqueeze(-1) * v).sum(dim)  | a[..., None] * v | torch.einsum(...) | a @ v | bmm

Replacement: :func:`fused_attention` (below; ``fastopt.codegen.temporal_attention`` on tensors in
any layout, through :mod:`fastopt.passes.attention_layout`).

Left alone, with the reason in the report: scores through an activation (LeakyReLU, GAT style:
the operator has no score activation), a mask applied by addition, a fill value that does not
annihilate masked weights, a softmax over a dimension that is not the one the weighted sum
reduces, a post-softmax mask that is not the pre-softmax one, attention weights used elsewhere.

Order: runs after ``fuse_multihead_attention`` and ``fuse_sdpa_attention`` (their subgraphs are
module/function calls, not softmaxes, so the order only matters for the report) and before
``fuse_masked_aggregation`` and ``fuse_time_encoding``.
"""

from __future__ import annotations

import operator
from typing import List, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from fastopt import codegen
from fastopt.config import default_config
from fastopt.passes.attention_layout import AttentionLayout, attention_layout, canonical_attention
from fastopt.passes.pattern import (Match, RewritePass, arg, call, literal, module_of, single_user,
                                    same_value, unsqueeze_dim)
from fastopt.passes.sites import record

__all__ = ["FuseTemporalAttention", "fused_attention", "dropout_probability", "scale_of",
           "softmax_of", "LARGE_NEGATIVE"]

# masked_fill values at or below this annihilate masked weights in float32 softmax.
LARGE_NEGATIVE = -1e9

_MUL = (operator.mul, torch.mul)
_DIV = (operator.truediv, torch.div, torch.true_divide)
_MATMUL = (operator.matmul, torch.matmul, torch.bmm)
_RANKS = range(6, 1, -1)  # highest first: their reasons name the real mismatch


def softmax_of(gm: fx.GraphModule, node: fx.Node):
    """``(input, dim)`` if ``node`` is a softmax with an explicit dim and no dtype, else None."""
    if call(node, (torch.softmax, F.softmax), ("softmax",)):
        if arg(node, 2, "dtype") is not None or arg(node, 3, "_stacklevel", None) not in (None, 3):
            return None
        dim = arg(node, 1, "dim")
        return (node.args[0], dim) if isinstance(dim, int) else None
    mod = module_of(gm, node, (nn.Softmax,))
    if mod is not None and isinstance(mod.dim, int):
        return node.args[0], mod.dim
    return None


def _dropout(gm: fx.GraphModule, node: fx.Node):
    """``("module", path, 0.0)`` or ``(None, None, p)`` if ``node`` is dropout of its first input."""
    if module_of(gm, node, (nn.Dropout,)) is not None:
        return "module", node.target, 0.0
    if call(node, (F.dropout, torch.dropout), ("dropout",)):
        p = arg(node, 1, "p", 0.5)
        training = arg(node, 2, "training", True if node.target is F.dropout else None)
        if literal(p) and isinstance(training, bool) and not arg(node, 3, "inplace", False):
            return None, None, float(p) if training else 0.0
    return None


def _scores(node: fx.Node):
    """``(style, q, k, nodes)`` of a score computation, or None."""
    if call(node, (torch.sum,), ("sum",)):
        dim = arg(node, 1, "dim")
        prod = node.args[0]
        if isinstance(dim, int) and not arg(node, 2, "keepdim", False) and call(prod, _MUL) \
                and arg(node, 3, "dtype") is None and all(isinstance(a, fx.Node) for a in prod.args):
            return f"mul_sum:{dim}", prod.args[0], prod.args[1], [node, prod]
    if call(node, (torch.einsum,)):
        eq, ops = node.args[0], node.args[1:]
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = ops[0]
        if isinstance(eq, str) and len(ops) == 2:
            return f"einsum:{eq}", ops[0], ops[1], [node]
    if call(node, _MATMUL):
        q, kt = node.args[0], node.args[1]
        if call(kt, (torch.transpose,), ("transpose",)) and \
                {arg(kt, 1, "dim0"), arg(kt, 2, "dim1")} in ({-2, -1}, {1, 2}):
            return "matmul_t", q, kt.args[0], [node, kt]
        if call(kt, (getattr,)) and kt.args[1] == "mT":
            return "matmul_t", q, kt.args[0], [node, kt]
        return "matmul", q, kt, [node]
    return None


def _weighted(a: fx.Node):
    """``(style, v, output, nodes)`` of the weighted sum consuming weights ``a``, or a reason."""
    user = single_user(a)
    if user is None:
        return "the attention weights have several users"
    u = unsqueeze_dim(user)
    if u is not None:
        prod = single_user(user)
        if call(prod, _MUL) and user in prod.args:
            v = prod.args[1] if prod.args[0] is user else prod.args[0]
            red = single_user(prod)
            if call(red, (torch.sum,), ("sum",)) and isinstance(arg(red, 1, "dim"), int) \
                    and not arg(red, 2, "keepdim", False) and isinstance(v, fx.Node):
                return f"mul_sum:{u}:{arg(red, 1, 'dim')}", v, red, [user, prod, red]
        return "the unsqueezed weights are not multiplied with values and summed"
    if call(user, (torch.einsum,)):
        eq, ops = user.args[0], user.args[1:]
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = ops[0]
        if isinstance(eq, str) and len(ops) == 2 and ops[0] is a:
            return f"einsum:{eq}", ops[1], user, [user]
    if call(user, _MATMUL) and user.args[0] is a:
        return "matmul", user.args[1], user, [user]
    return "the attention weights do not feed a weighted sum of values"


def _layout_reason(scores: str, weighted: str, dim: int) -> Optional[str]:
    """None if some ranks make the styles an attention; else the reason none do."""
    reason = None
    for qr in _RANKS:
        for kr in _RANKS:
            for vr in _RANKS:
                got = attention_layout(scores, weighted, dim, qr, kr, vr)
                if not isinstance(got, str):
                    return None
                reason = reason or got
    return reason


class FuseTemporalAttention(RewritePass):
    """Explicit masked neighbor attention -> ``fastopt.codegen.temporal_attention``."""

    name = "fuse_temporal_attention"

    def anchors(self, gm: fx.GraphModule) -> List[fx.Node]:
        return [n for n in gm.graph.nodes if softmax_of(gm, n) is not None]

    def match(self, gm: fx.GraphModule, sm: fx.Node) -> Union[Match, str]:
        x, dim = softmax_of(gm, sm)
        if not call(x, (torch.masked_fill,), ("masked_fill",)):
            return ("the softmax input is not masked with masked_fill(bool mask, -inf or large "
                    "negative); additive or missing masks are not fused")
        fill_mask, fill = x.args[1], arg(x, 2, "value")
        if not literal(fill) or not (fill == float("-inf") or fill <= LARGE_NEGATIVE):
            return f"masked_fill value {fill!r} is not -inf or <= {LARGE_NEGATIVE:g}"
        nodes = [sm, x]
        s, scale_ops = x.args[0], []
        while isinstance(s, fx.Node):
            if call(s, _MUL) and literal(s.args[1]):
                op, c, nxt = "mul", s.args[1], s.args[0]
            elif call(s, _MUL) and literal(s.args[0]):
                op, c, nxt = "mul", s.args[0], s.args[1]
            elif call(s, _DIV) and literal(s.args[1]):
                op, c, nxt = "div", s.args[1], s.args[0]
            else:
                break
            scale_ops.insert(0, (op, float(c)))
            nodes.append(s)
            s = nxt
        if call(s, (F.leaky_relu,), ("leaky_relu",)) or module_of(gm, s, (nn.LeakyReLU,)):
            return ("LeakyReLU on the scores (GAT style): fastopt.codegen.temporal_attention has "
                    "no score activation")
        got = _scores(s) if isinstance(s, fx.Node) else None
        if got is None:
            return "the masked scores are not (q * k).sum, einsum, matmul or bmm of q and k"
        scores, q, k, score_nodes = got
        nodes += score_nodes
        cur, zeroed, dropout, dropout_p, pattern = sm, False, None, 0.0, [scores.split(":")[0]]
        while True:
            user = single_user(cur)
            if user is None:
                break
            if call(user, (torch.masked_fill,), ("masked_fill",)) and not zeroed \
                    and arg(user, 2, "value") == 0 and same_value(user.args[1], fill_mask):
                zeroed, cur = True, user
                nodes.append(user)
                continue
            drop = _dropout(gm, user) if dropout is None and dropout_p == 0.0 else None
            if drop is not None and user.args[0] is cur:
                dropout = ("module", drop[1]) if drop[0] else None
                dropout_p = drop[2]
                cur = user
                nodes.append(user)
                pattern.append("dropout")
                continue
            break
        if call(single_user(cur), (torch.masked_fill,), ("masked_fill",)):
            return "the weights are zeroed after the softmax with a mask other than the score mask"
        got = _weighted(cur)
        if isinstance(got, str):
            return got
        weighted, v, out, w_nodes = got
        nodes += w_nodes
        reason = _layout_reason(scores, weighted, dim)
        if reason is not None:
            return reason
        pattern[1:1] = ["-inf" if fill == float("-inf") else "large_negative"]
        pattern.insert(2, "zeroed" if zeroed else "unzeroed")
        pattern.append(weighted.split(":")[0])
        return Match(
            anchor=sm, output=out, nodes=nodes, target=fused_attention,
            args=(q, k, v, fill_mask, dropout),
            kwargs=dict(scores=scores, weighted=weighted, softmax_dim=dim,
                        scale_ops=tuple(scale_ops), fill=float(fill), zeroed=zeroed,
                        dropout_p=dropout_p),
            op="temporal_attention", pattern=f"explicit[{','.join(pattern)}]")


# ----------------------------------------------------------------------------------------------
# lowering: what the rewritten graph calls
# ----------------------------------------------------------------------------------------------


def dropout_probability(dropout, functional_p: float) -> float:
    """Active dropout probability: a module's ``p`` in training mode, or a traced functional p."""
    if dropout is not None:
        return float(dropout.p) if dropout.training else 0.0
    return float(functional_p)


def _eager_scores(q: Tensor, k: Tensor, style: str) -> Tensor:
    kind, _, rest = style.partition(":")
    if kind == "mul_sum":
        return (q * k).sum(int(rest))
    if kind == "einsum":
        return torch.einsum(rest, q, k)
    return q @ (k.transpose(-2, -1) if kind == "matmul_t" else k)


def _eager_weighted(a: Tensor, v: Tensor, style: str) -> Tensor:
    kind, _, rest = style.partition(":")
    if kind == "mul_sum":
        unsq, red = (int(x) for x in rest.split(":"))
        return (a.unsqueeze(unsq) * v).sum(red)
    if kind == "einsum":
        return torch.einsum(rest, a, v)
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
    p = dropout_probability(dropout, dropout_p)
    fuse = p == 0.0 or (zeroed and default_config().passes.fuse_dropout)
    lay = attention_layout(scores, weighted, softmax_dim, q.dim(), k.dim(), v.dim())
    if default_config().kernels.backend == "auto" and codegen.select_backend(q) != "triton":
        # no generated kernel here (the CPU): the reference operator is slower than this code
        # (TGAT on 2 cores: 1.3-1.5x); kernels.backend="reference" asks for it all the same
        record(site, ())
        fuse = False
    if fuse and isinstance(lay, AttentionLayout):
        empty = "zero" if zeroed else ("nan" if fill == float("-inf") else "mean")
        out = canonical_attention(q, k, v, lay, ~fill_mask, scale=scale_of(scale_ops),
                                  dropout_p=p, empty=empty, site=site)
        if out is not None:
            return out
    s = _eager_scores(q, k, scores)
    for op, c in scale_ops:
        s = s * c if op == "mul" else s / c
    a = torch.softmax(s.masked_fill(fill_mask, fill), softmax_dim)
    if zeroed:
        a = a.masked_fill(fill_mask, 0.0)
    if dropout is not None:
        a = dropout(a)
    elif dropout_p > 0.0:
        a = F.dropout(a, dropout_p, training=True)
    return _eager_weighted(a, v, weighted)


def scale_of(scale_ops) -> float:
    """The one factor that the traced products and quotients by constants multiply scores by."""
    scale = 1.0
    for op, c in scale_ops:
        scale = scale * c if op == "mul" else scale / c
    return scale
