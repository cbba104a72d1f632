"""``fuse_sdpa_attention``: ``F.scaled_dot_product_attention`` with a boolean mask -> fused operator.

Pattern::

    out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid, dropout_p=p, scale=s)

with ``q [..., L, E]``, ``k [..., K, E]``, ``v [..., K, E]`` and a boolean ``valid`` (True = the
neighbor takes part) broadcastable to ``[..., L, K]``. Batch dimensions along which the mask is
constant become heads of the fused operator; the others become destination rows.

Replacement: :func:`fused_sdpa` (below); it checks the mask dtype on each call
and runs SDPA itself for a float mask that the graph could not prove boolean.

Left alone: masks that are provably not boolean (additive float masks), ``is_causal``,
``enable_gqa``, a dropout probability or scale that is a tensor.

Order: independent of the other attention passes.
"""

from __future__ import annotations

from typing import List, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, fx

from fastopt.config import default_config
from fastopt.passes.attention_layout import AttentionLayout, attention_layout, canonical_attention
from fastopt.passes.pattern import Match, RewritePass, arg, bool_provenance, call, literal

__all__ = ["FuseSdpaAttention", "fused_sdpa"]


class FuseSdpaAttention(RewritePass):
    """``F.scaled_dot_product_attention`` with a boolean mask -> ``fastopt.codegen.temporal_attention``."""

    name = "fuse_sdpa_attention"

    def anchors(self, gm: fx.GraphModule) -> List[fx.Node]:
        return [n for n in gm.graph.nodes if call(n, (F.scaled_dot_product_attention,))]

    def match(self, gm: fx.GraphModule, node: fx.Node) -> Union[Match, str]:
        q, k, v = (arg(node, i, name) for i, name in enumerate(("query", "key", "value")))
        mask = arg(node, 3, "attn_mask")
        p = arg(node, 4, "dropout_p", 0.0)
        if mask is None:
            return "no attn_mask: not neighbor attention over padded slots"
        if bool_provenance(mask) is False:
            return f"attn_mask {mask.name} is not boolean (an additive float mask); left as SDPA"
        if arg(node, 5, "is_causal", False) or node.kwargs.get("enable_gqa", False):
            return "is_causal or enable_gqa: not a per-slot neighbor mask"
        scale = node.kwargs.get("scale")
        if not literal(p) or (scale is not None and not literal(scale)):
            return "dropout_p or scale is not a Python number"
        return Match(
            anchor=node, output=node, nodes=[node], target=fused_sdpa,
            args=(q, k, v, mask),
            kwargs=dict(dropout_p=float(p), scale=None if scale is None else float(scale)),
            op="temporal_attention", pattern="F.scaled_dot_product_attention[bool mask]")


# ----------------------------------------------------------------------------------------------
# lowering: what the rewritten graph calls
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
