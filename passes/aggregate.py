"""``fuse_masked_aggregation``: masked sum/mean over the neighbor dimension -> one fused operator.

Pattern::

    s = (x * m.unsqueeze(-1)).sum(1)            # m boolean (or m.float(), m.to(x.dtype))
    s = x.masked_fill(~m.unsqueeze(-1), 0).sum(1)
    s = s / m.sum(1, keepdim=True).clamp(min=1)  # optional: the mean (clamp_min(1) as well)

Replacement: :func:`fused_masked_aggregate` (below)
(``fastopt.codegen.masked_aggregate``); rows without a valid neighbor are zeros in both, which
is why an unclamped mean (NaN for those rows) is left alone.

Left alone: multipliers that are not provably 0/1 (float weights; the mask must be boolean
before any cast), counts of another mask, unclamped means.

Order: after the attention passes (an attention's weighted sum is also a ``(a * v).sum``, which
they consume first).
"""

from __future__ import annotations

import math
import operator
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor, fx

from fastopt import codegen
from fastopt.passes.pattern import (Match, RewritePass, arg, bool_provenance, call, literal,
                                    same_value, single_user, unsqueeze_dim)
from fastopt.passes.sites import record

__all__ = ["FuseMaskedAggregation", "fused_masked_aggregate"]

_CASTS = ("float", "double", "half", "bfloat16", "to", "type_as")


def _mask_source(node) -> Tuple[Optional[fx.Node], bool]:
    """``(base, inverted)``: the boolean node under casts, unsqueezes and ``~`` of ``node``."""
    inverted = False
    while isinstance(node, fx.Node):
        if call(node, (), _CASTS) or unsqueeze_dim(node) is not None:
            node = node.args[0]
        elif call(node, (operator.invert, torch.logical_not), ("logical_not",)):
            inverted = not inverted
            node = node.args[0]
        else:
            return node, inverted
    return None, inverted


def _count(node, base: fx.Node) -> bool:
    """Whether ``node`` is ``base.sum(dim, keepdim=True).clamp(min=1)`` (with casts)."""
    if call(node, (torch.clamp,), ("clamp",)):
        low = arg(node, 1, "min")
    elif call(node, (torch.clamp_min,), ("clamp_min",)):
        low = arg(node, 1, "min")
    else:
        return False
    if not (literal(low) and low == 1):
        return False
    total = node.args[0]
    if not (call(total, (torch.sum,), ("sum",)) and arg(total, 2, "keepdim", False)):
        return False
    src, inverted = _mask_source(total.args[0])
    return src is not None and not inverted and same_value(src, base)


class FuseMaskedAggregation(RewritePass):
    """Masked neighbor sum/mean -> ``fastopt.codegen.masked_aggregate``."""

    name = "fuse_masked_aggregation"

    def anchors(self, gm: fx.GraphModule) -> List[fx.Node]:
        return [n for n in gm.graph.nodes if call(n, (torch.sum,), ("sum",))
                and call(n.args[0], (operator.mul, torch.mul, torch.masked_fill), ("masked_fill",))]

    def match(self, gm: fx.GraphModule, red: fx.Node) -> Union[Match, str]:
        dim = arg(red, 1, "dim")
        if not isinstance(dim, int) or arg(red, 2, "keepdim", False) or arg(red, 3, "dtype"):
            return "the sum is not over one dimension without keepdim"
        inner = red.args[0]
        proven = True
        if call(inner, (operator.mul, torch.mul)):
            ranked = []
            for x, w in ((inner.args[0], inner.args[1]), (inner.args[1], inner.args[0])):
                base, inverted = _mask_source(w)
                known = False if base is None or inverted else bool_provenance(base)
                if known is None and bool_provenance(w) is False:
                    known = False  # a cast of a mask of unknown dtype: cannot check it later
                ranked.append((known is True, known is None, x, w, base))
            ranked.sort(key=lambda r: r[:2], reverse=True)
            proven, unknown, x, w, base = ranked[0]
            if not (proven or unknown):
                return "the multiplier is not a 0/1 mask (float weights are not fused)"
            # A mask of unknown dtype is fused only if it is boolean when the model runs.
            form = "mul"
        else:
            x, w = inner.args[0], inner.args[1]
            if not (literal(arg(inner, 2, "value")) and arg(inner, 2, "value") == 0):
                return "masked_fill with a non-zero value before the sum"
            base, inverted = _mask_source(w)
            base = base if inverted else None
            form = "fill"
        nodes = [red, inner]
        out, count, reduce = red, None, "sum"
        div = single_user(red)
        if call(div, (operator.truediv, torch.div)) and div.args[0] is red and base is not None \
                and _count(div.args[1], base):
            out, count, reduce = div, div.args[1], "mean"
            nodes.append(div)
        elif call(div, (operator.truediv, torch.div)) and div.args[0] is red:
            return "a mean whose count is not the clamped count of the same mask (empty rows would be NaN)"
        return Match(
            anchor=red, output=out, nodes=nodes, target=fused_masked_aggregate,
            args=(x, w, count), kwargs=dict(form=form, dim=dim, reduce=reduce, proven=proven),
            op="masked_aggregate", pattern=f"masked_{reduce}[{form}]")


# ----------------------------------------------------------------------------------------------
# lowering: what the rewritten graph calls
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
    d = dim + x.dim() if dim < 0 else dim  # the neighbor dimension; never the first
    fits = 1 <= d < x.dim() and weight.dim() <= x.dim() and (proven or weight.dtype == torch.bool)
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
            record(site, (lead[-1],) + tuple(x.shape[d + 1:]))
            return out.reshape(lead[:-1] + tuple(x.shape[d + 1:]))
    s = (x * weight).sum(dim) if form == "mul" else x.masked_fill(weight, 0).sum(dim)
    return s if count is None else s / count
