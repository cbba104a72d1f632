"""``fuse_time_encoding``: the cosine time encoding ``cos(Linear(1, T)(dt[..., None]))`` -> one op.

Pattern (TGAT's functional encoding, TGN's ``TimeEncode``)::

    enc = torch.cos(self.w(dt.unsqueeze(-1)))      # self.w = nn.Linear(1, T); dt[..., None] too

Replacement: :func:`fastopt.passes.lowering.fused_time_encode` (``fastopt.codegen.time_encode``),
reading the frequencies and phases straight from the Linear's parameters.

Order: after the attention passes.

``factor_time_encoding`` (runs before ``fuse_time_encoding``): an explicit attention whose keys
and values are one merged projection ``Linear(cat([x, e]))`` of an input ending in the encoding
``e = cos(Linear(1, T)(dt[..., None]))`` ->
:func:`fastopt.passes.lowering.time_factored_attention`, which multiplies the queries into
the encoding's weight columns instead of projecting the encoding of every slot
(``fastopt.codegen.shared_attention``; ``config.passes.factor_time_encoding``).
"""

from __future__ import annotations

import operator
from typing import List, Optional, Tuple, Union

import torch
from torch import fx, nn

from fastopt.passes import lowering
from fastopt.passes.pattern import Match, RewritePass, call, module_of, unsqueeze_dim

__all__ = ["FuseTimeEncoding", "FactorTimeEncoding", "time_encoding_of"]


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
            anchor=cos, output=cos, nodes=[cos, lin_node, unsq], target=lowering.fused_time_encode,
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
    :func:`fastopt.passes.lowering.time_factored_attention`."""

    name = "factor_time_encoding"

    def anchors(self, gm: fx.GraphModule) -> List[fx.Node]:
        return [n for n in gm.graph.nodes if call(n, (lowering.fused_attention,))]

    def match(self, gm: fx.GraphModule, attention: fx.Node) -> Union[Match, str, None]:
        if len(attention.args) != 5:
            return None
        q, k_view, v_view, fill_mask, dropout = attention.args
        product = k_view.args[0].args[0] if isinstance(k_view, fx.Node) and k_view.args and \
            isinstance(k_view.args[0], fx.Node) and k_view.args[0].args else None
        if not call(product, (lowering.linears_over_parts,)):
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
            target=lowering.time_factored_attention,
            args=(q, fill_mask, dropout, tuple(linears), ("module", lin_node.target),
                  unsq.args[0], *parts[:-1]),
            kwargs=kwargs, op="shared_attention",
            pattern="attention(Linear(cat([x, cos(Linear(1,T)(dt))])))")
