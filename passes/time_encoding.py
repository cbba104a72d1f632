"""``fuse_time_encoding``: the cosine time encoding ``cos(Linear(1, T)(dt[..., None]))`` -> one op.

Pattern (TGAT's functional encoding, TGN's ``TimeEncode``)::

    enc = torch.cos(self.w(dt.unsqueeze(-1)))      # self.w = nn.Linear(1, T); dt[..., None] too

Replacement: :func:`fused_time_encode` (below; ``fastopt.codegen.time_encode``),
reading the frequencies and phases straight from the Linear's parameters.

Order: after the attention passes.

``factor_time_encoding`` (runs before ``fuse_time_encoding``): an explicit attention whose keys
and values are one merged projection ``Linear(cat([x, e]))`` of an input ending in the encoding
``e = cos(Linear(1, T)(dt[..., None]))`` ->
:func:`time_factored_attention` (below), which multiplies the queries into
the encoding's weight columns instead of projecting the encoding of every slot
(``fastopt.codegen.shared_attention``; ``config.passes.factor_time_encoding``).
"""

from __future__ import annotations

import operator
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor, fx, nn

from fastopt import codegen
from fastopt.config import default_config
from fastopt.passes.attention import dropout_probability, fused_attention, scale_of
from fastopt.passes.attention_layout import AttentionLayout, attention_layout, canonical_attention
from fastopt.passes.pattern import Match, RewritePass, call, module_of, unsqueeze_dim
from fastopt.passes.sites import record
from fastopt.passes.split_linear_lowering import can_stack, linears_over_parts, stacked_product
from fastopt.runtime import capturing

__all__ = ["FuseTimeEncoding", "FactorTimeEncoding", "time_encoding_of", "fused_time_encode",
           "time_factored_attention"]


def time_encoding_of(gm: fx.GraphModule, cos: fx.Node) -> Union[Tuple[fx.Node, fx.Node], str]:
    """``(linear_node, unsqueeze_node)`` of ``cos(Linear(1, T)(dt.unsqueeze(-1)))``, or the reason
    ``cos`` is not such an encoding."""
    if not call(cos, (torch.cos,), ("cos",)):
        return "not a cosine"
    lin_node = cos.args[0]
    lin = module_of(gm, lin_node, (nn.Linear,))
    if lin is None:
        return "cos of something other than an nn.Linear"
    if lin.in_features != 1:
        return f"cos(Linear({lin.in_features}, {lin.out_features})): not a scalar time encoding"
    unsq = lin_node.args[0]
    if not isinstance(unsq, fx.Node) or unsqueeze_dim(unsq) not in (-1,):
        return "the Linear's input is not dt.unsqueeze(-1)"
    return lin_node, unsq


class FuseTimeEncoding(RewritePass):
    """``cos(Linear(1, T)(dt.unsqueeze(-1)))`` -> ``fastopt.codegen.time_encode``."""

    name = "fuse_time_encoding"

    def anchors(self, gm: fx.GraphModule) -> List[fx.Node]:
        return [n for n in gm.graph.nodes if call(n, (torch.cos,), ("cos",))]

    def match(self, gm: fx.GraphModule, cos: fx.Node) -> Union[Match, str]:
        got = time_encoding_of(gm, cos)
        if isinstance(got, str):
            return got
        lin_node, unsq = got
        return Match(
            anchor=cos, output=cos, nodes=[cos, lin_node, unsq], target=fused_time_encode,
            args=(unsq.args[0], ("module", lin_node.target)), kwargs={},
            op="time_encode", pattern="cos(Linear(1,T)(dt[...,None]))")


def _view_of(node: object, block: int, of: fx.Node) -> Optional[fx.Node]:
    """The ``getitem(of, block)`` that ``node`` (a ``.view``/``.reshape`` with one user) views."""
    if not isinstance(node, fx.Node) or node.op != "call_method" or \
            node.target not in ("view", "reshape") or len(node.users) != 1:
        return None
    item = node.args[0]
    if not call(item, (operator.getitem,)) or item.args[0] is not of or item.args[1] != block \
            or len(item.users) != 1:
        return None
    return item


class FactorTimeEncoding(RewritePass):
    """Keys/values ``Linear(cat([x, cos(Linear(1, T)(dt))]))`` of a fused explicit attention ->
    :func:`time_factored_attention`."""

    name = "factor_time_encoding"

    def anchors(self, gm: fx.GraphModule) -> List[fx.Node]:
        return [n for n in gm.graph.nodes if call(n, (fused_attention,))]

    def match(self, gm: fx.GraphModule, attention: fx.Node) -> Union[Match, str, None]:
        if len(attention.args) != 5:
            return None
        q, k_view, v_view, fill_mask, dropout = attention.args
        product = k_view.args[0].args[0] if isinstance(k_view, fx.Node) and k_view.args and \
            isinstance(k_view.args[0], fx.Node) and k_view.args[0].args else None
        if not call(product, (linears_over_parts,)):
            return None  # keys not from one merged projection: nothing to factor
        k_item, v_item = _view_of(k_view, 0, product), _view_of(v_view, 1, product)
        if k_item is None or v_item is None or len(product.users) != 2:
            return "keys and values are not the two blocks of one projection, viewed once each"
        if tuple(k_view.args[1:]) != tuple(v_view.args[1:]) or len(k_view.args) != 5:
            return "keys and values are not viewed as one [M, K, H, d] shape"
        linears, *parts = product.args
        if len(linears) != 2 or not parts:
            return "not a projection of keys and values"
        if not attention.kwargs.get("zeroed"):
            return ("the weights of masked slots are not zeroed after the softmax: the factored "
                    "attention gives rows without neighbors zeros")
        modules = [gm.get_submodule(n.target) if isinstance(n, fx.Node) and n.op == "get_attr"
                   else None for n in linears]
        if not all(isinstance(m, nn.Linear) for m in modules) or \
                len({(m.in_features, m.bias is None) for m in modules}) != 1:
            return "keys and values are not two nn.Linear of one input width, both with or without bias"
        cos = parts[-1]
        got = time_encoding_of(gm, cos) if isinstance(cos, fx.Node) else "no time encoding"
        if isinstance(got, str):
            return f"the projected input does not end in a time encoding ({got})"
        if len(cos.users) != 1 or cos in parts[:-1]:
            return "the time encoding is used elsewhere"
        lin_node, unsq = got
        kwargs = {k: v for k, v in attention.kwargs.items() if k != "site"}
        kwargs.update(kv_shape=tuple(k_view.args[1:]), attention_site=attention.kwargs["site"],
                      linear_site=product.kwargs.get("site", ""))
        return Match(
            anchor=attention, output=attention,
            nodes=[attention, k_view, v_view, k_item, v_item, product, cos, lin_node, unsq],
            target=time_factored_attention,
            args=(q, fill_mask, dropout, tuple(linears), ("module", lin_node.target),
                  unsq.args[0], *parts[:-1]),
            kwargs=kwargs, op="shared_attention",
            pattern="attention(Linear(cat([x, cos(Linear(1,T)(dt))])))")


# ----------------------------------------------------------------------------------------------
# lowering: what the rewritten graphs call
# ----------------------------------------------------------------------------------------------


def fused_time_encode(dt: Tensor, linear: torch.nn.Linear, *, site: str = "") -> Tensor:
    """``torch.cos(linear(dt.unsqueeze(-1)))`` for a ``Linear(1, T)``, fused: always, or only
    while a CUDA graph is being captured (``config.passes.fuse_time_encoding``)."""
    w = linear.weight
    mode = default_config().passes.fuse_time_encoding
    fuse = mode == "always" or (mode == "graphs" and dt.is_cuda and capturing())
    if fuse and dt.dtype == w.dtype and w.shape[1] == 1 and dt.is_floating_point():
        b = linear.bias if linear.bias is not None else w.new_zeros(w.shape[0])
        record(site, (w.shape[0],))
        return codegen.time_encode(dt, w[:, 0], b)
    return torch.cos(linear(dt.unsqueeze(-1)))


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
    p = dropout_probability(dropout, dropout_p)
    fuse = zeroed and (p == 0.0 or default_config().passes.fuse_dropout)
    lay = attention_layout(scores, weighted, softmax_dim, q.dim(), len(shape), len(shape))
    factor = (mode == "always" or (mode == "auto" and codegen.select_backend(q) == "triton"))
    siblings = len(linears) == 2 and parts and linears[0].weight.dtype == q.dtype \
        and can_stack(linears, (*parts, enc))
    if factor and fuse and siblings and isinstance(lay, AttentionLayout):
        rest = linears[0].in_features - enc.shape[-1]
        k, v = stacked_product([linear.weight[:, :rest] for linear in linears], linears, parts,
                               linear_site)
        time_part = (enc, linears[0].weight[:, rest:], linears[1].weight[:, rest:])
        out = canonical_attention(q, k.view(shape), v.view(shape), lay, ~fill_mask,
                                  scale=scale_of(scale_ops), dropout_p=p, empty="zero",
                                  site=attention_site, time_part=time_part)
        if out is not None:
            record(site, (enc.shape[-1],))
            return out
    record(site, ())
    k, v = linears_over_parts(linears, *parts, enc, site=linear_site)
    return fused_attention(q, k.view(shape), v.view(shape), fill_mask, dropout, scores=scores,
                           weighted=weighted, softmax_dim=softmax_dim, scale_ops=scale_ops,
                           fill=fill, zeroed=zeroed, dropout_p=dropout_p, site=attention_site)
