"""``fuse_multihead_attention``: ``nn.MultiheadAttention`` over neighbors -> one fused operator.

Pattern (the original TGN and TGAT code's style)::

    out, _ = self.attn(query, key, value, key_padding_mask=padding, need_weights=False)

with a query of length one (``[M, 1, E]`` batch_first, ``[1, M, E]`` otherwise), keys and values
``[M, K, kdim]`` (``[K, M, kdim]``) and a boolean ``key_padding_mask [M, K]`` (True = padding).

Replacement: :func:`fastopt.passes.lowering.fused_multihead_attention`: the in/out projections
stay dense matmuls on the module's own parameters; the per-neighbor scores, softmax, dropout and
weighted sum run in ``fastopt.codegen.temporal_attention``. Query length, mask dtype, bias_kv and
add_zero_attn are checked on each call; the module runs as before when they do not hold.

Left alone: calls whose attention weights are used, calls with ``attn_mask`` or ``is_causal``,
calls without ``key_padding_mask``.

Order: independent of the other attention passes (it anchors on a module call); runs first.
"""

from __future__ import annotations

import operator
from typing import List, Union

from torch import fx, nn

from fastopt.passes import lowering
from fastopt.passes.pattern import Match, RewritePass, arg, call, module_of

__all__ = ["FuseMultiheadAttention"]


class FuseMultiheadAttention(RewritePass):
    """``nn.MultiheadAttention`` with ``key_padding_mask`` -> ``fastopt.codegen.temporal_attention``."""

    name = "fuse_multihead_attention"

    def anchors(self, gm: fx.GraphModule) -> List[fx.Node]:
        return [n for n in gm.graph.nodes if module_of(gm, n, (nn.MultiheadAttention,))]

    def match(self, gm: fx.GraphModule, node: fx.Node) -> Union[Match, str]:
        mha = module_of(gm, node, (nn.MultiheadAttention,))
        names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
                 "average_attn_weights", "is_causal")
        bound = {name: arg(node, i, name) for i, name in enumerate(names)}
        if bound["key_padding_mask"] is None:
            return "no key_padding_mask: not neighbor attention over padded slots"
        if bound["attn_mask"] is not None or bound["is_causal"]:
            return "attn_mask or is_causal given: the fused operator takes one mask per slot"
        for user in node.users:
            if not call(user, (operator.getitem,)) or user.args[1] not in (0, 1):
                return f"the attention output tuple is used as a whole by {user.name}"
            if user.args[1] == 1 and user.users:
                return "the attention weights are used (need_weights); the fused operator does not return them"
        need_weights = bound["need_weights"]
        layout = "batch_first" if mha.batch_first else "seq_first"
        return Match(
            anchor=node, output=node, nodes=[node], target=lowering.fused_multihead_attention,
            args=(("module", node.target), bound["query"], bound["key"], bound["value"],
                  bound["key_padding_mask"]),
            kwargs=dict(need_weights=True if need_weights is None else need_weights),
            op="temporal_attention", pattern=f"nn.MultiheadAttention[{layout},key_padding_mask]")
