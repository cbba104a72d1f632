"""``fuse_multihead_attention``: ``nn.MultiheadAttention`` over neighbors -> one fused operator.

Pattern (the original TGN and TGAT code's style)::

    out, _ = self.attn(query, key, value, key_padding_mask=padding, need_weights=False)

with a query of length one (``[M, 1, E]`` batch_first, ``[1, M, E]`` otherwise), keys and values
``[M, K, kdim]`` (``[K, M, kdim]``) and a boolean ``key_padding_mask [M, K]`` (True = padding).

Replacement: :func:`fused_multihead_attention` (below): the in/out projections
stay dense matmuls on the module's own parameters; the per-neighbor scores, softmax, dropout and
weighted sum run in ``fastopt.codegen.temporal_attention``. Query length, mask dtype, bias_kv and
add_zero_attn are checked on each call; the module runs as before when they do not hold.

Left alone: calls whose attention weights are used, calls with ``attn_mask`` or ``is_causal``,
calls without ``key_padding_mask``.

Order: independent of the other attention passes (it anchors on a module call); runs first.
"""

from __future__ import annotations

import operator
from typing import List, Optional, Union

import torch
from torch import Tensor, fx, nn

from fastopt import codegen
from fastopt.config import default_config
from fastopt.passes.pattern import Match, RewritePass, arg, call, module_of
from fastopt.passes.sites import record
from fastopt.passes.split_linear_lowering import column_blocks, projection

__all__ = ["FuseMultiheadAttention", "fused_multihead_attention"]


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
            anchor=node, output=node, nodes=[node], target=fused_multihead_attention,
            args=(("module", node.target), bound["query"], bound["key"], bound["value"],
                  bound["key_padding_mask"]),
            kwargs=dict(need_weights=True if need_weights is None else need_weights),
            op="temporal_attention", pattern=f"nn.MultiheadAttention[{layout},key_padding_mask]")


# ----------------------------------------------------------------------------------------------
# lowering: what the rewritten graph calls
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
        q = projection(query[:, 0], wq, bq).view(m, h, d)
        if shared:  # keys and values of one sequence: one product, read as column blocks
            kv = projection(key, torch.cat([wk, wv]), None if bk is None else torch.cat([bk, bv]))
            k, v = (block.view(m, kk, h, d)
                    for block in column_blocks(kv, (mha.embed_dim, mha.embed_dim)))
        else:
            k = projection(key, wk, bk).view(m, kk, h, d)
            v = projection(value, wv, bv).view(m, kk, h, d)
        record(site, (kk, h, d))
        seed = codegen.dropout_seed(q) if p > 0 else 0
        out = codegen.temporal_attention(q, k, v, ~key_padding_mask, scale=d ** -0.5,
                                         dropout_p=p, seed=seed)
        out = projection(out.reshape(m, mha.embed_dim), mha.out_proj.weight, mha.out_proj.bias)
        return out.unsqueeze(1 if mha.batch_first else 0), None
    return mha(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights)
