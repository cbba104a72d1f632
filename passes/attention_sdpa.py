"""``fuse_sdpa_attention``: ``F.scaled_dot_product_attention`` with a boolean mask -> fused operator.

Pattern::

    out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid, dropout_p=p, scale=s)

with ``q [..., L, E]``, ``k [..., K, E]``, ``v [..., K, E]`` and a boolean ``valid`` (True = the
neighbor takes part) broadcastable to ``[..., L, K]``. Batch dimensions along which the mask is
constant become heads of the fused operator; the others become destination rows.

Replacement: :func:`fastopt.passes.lowering.fused_sdpa`; it checks the mask dtype on each call
and runs SDPA itself for a float mask that the graph could not prove boolean.

Left alone: masks that are provably not boolean (additive float masks), ``is_causal``,
``enable_gqa``, a dropout probability or scale that is a tensor.

Order: independent of the other attention passes.
"""

from __future__ import annotations

from typing import List, Union

import torch.nn.functional as F
from torch import fx

from fastopt.passes import lowering
from fastopt.passes.pattern import Match, RewritePass, arg, bool_provenance, call, literal

__all__ = ["FuseSdpaAttention"]


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
            anchor=node, output=node, nodes=[node], target=lowering.fused_sdpa,
            args=(q, k, v, mask),
            kwargs=dict(dropout_p=float(p), scale=None if scale is None else float(scale)),
            op="temporal_attention", pattern="F.scaled_dot_product_attention[bool mask]")
