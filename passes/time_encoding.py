"""``fuse_time_encoding``: the cosine time encoding ``cos(Linear(1, T)(dt[..., None]))`` -> one op.

Pattern (TGAT's functional encoding, TGN's ``TimeEncode``)::

    enc = torch.cos(self.w(dt.unsqueeze(-1)))      # self.w = nn.Linear(1, T); dt[..., None] too

Replacement: :func:`fastopt.passes.lowering.fused_time_encode` (``fastopt.codegen.time_encode``),
reading the frequencies and phases straight from the Linear's parameters.

Order: after the attention passes. An encoding that feeds the keys of a fused attention keeps
its own op: the attention operator with a time-encoding prologue
(``codegen.time_encoded_attention``) takes the key projection split into node/edge and time
parts, a rewrite of the user's ``Linear(cat(...))`` not done here (see passes/README.md).
"""

from __future__ import annotations

from typing import List, Union

import torch
from torch import fx, nn

from fastopt.passes import lowering
from fastopt.passes.pattern import Match, RewritePass, call, module_of, unsqueeze_dim

__all__ = ["FuseTimeEncoding"]


class FuseTimeEncoding(RewritePass):
    """``cos(Linear(1, T)(dt.unsqueeze(-1)))`` -> ``fastopt.codegen.time_encode``."""

    name = "fuse_time_encoding"

    def anchors(self, gm: fx.GraphModule) -> List[fx.Node]:
        return [n for n in gm.graph.nodes if call(n, (torch.cos,), ("cos",))]

    def match(self, gm: fx.GraphModule, cos: fx.Node) -> Union[Match, str]:
        lin_node = cos.args[0]
        lin = module_of(gm, lin_node, (nn.Linear,))
        if lin is None:
            return "cos of something other than an nn.Linear"
        if lin.in_features != 1:
            return f"cos(Linear({lin.in_features}, {lin.out_features})): not a scalar time encoding"
        unsq = lin_node.args[0]
        if not isinstance(unsq, fx.Node) or unsqueeze_dim(unsq) not in (-1,):
            return "the Linear's input is not dt.unsqueeze(-1)"
        return Match(
            anchor=cos, output=cos, nodes=[cos, lin_node, unsq], target=lowering.fused_time_encode,
            args=(unsq.args[0], ("module", lin_node.target)), kwargs={},
            op="time_encode", pattern="cos(Linear(1,T)(dt[...,None]))")
