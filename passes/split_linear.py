"""``split_linear_inputs``: ``Linear(cat(parts, -1))`` -> one product per group of parts.

Pattern::

    kv_in = torch.cat([h_nbr, edge_feat, self.time_enc(dt)], dim=-1)
    key = self.w_k(kv_in)
    value = self.w_v(kv_in)

TGAT's and TGN's keys and values are projections of a concatenation of neighbor state, edge
features and time encodings. Autograd then computes the gradient of the whole concatenation in
the backward (one ``[rows, in]`` product per projection), also of the columns that need none
(edge and raw node features are data), and the concatenation itself is written out once more in
the forward. The replacement (:func:`fastopt.passes.lowering.linear_over_parts`) multiplies the
parts that need no gradient and those that do by their own column blocks of the weight, summed
by ``addmm``: ``y = x_free W_free^T + b + x_grad W_grad^T``. Same function; the backward skips the
input gradient of the free group (for a 172-d edge feature and 100-d encoding, 63 % of the input
gradient's work) and the concatenation is not materialized. Which parts need gradients is
decided per call on the actual tensors; with nothing to split (inference, all parts free or all
needing gradients) or ``config.passes.split_linear_inputs`` off, it runs the original
``linear(torch.cat(parts, -1))``.

Left alone: concatenation along another dimension (``dim`` must be the literal -1), a Linear
called with more than its input.

Order: after the attention passes (their matches read the projections, not the concatenation).
"""

from __future__ import annotations

from typing import List, Optional, Union

import torch
from torch import fx, nn

from fastopt.passes import lowering
from fastopt.passes.pattern import Match, RewritePass, arg, call, module_of

__all__ = ["SplitLinearInputs"]


class SplitLinearInputs(RewritePass):
    """Multiply a Linear's concatenated inputs group by group."""

    name = "split_linear_inputs"

    def anchors(self, gm: fx.GraphModule) -> List[fx.Node]:
        return [n for n in gm.graph.nodes if module_of(gm, n, (nn.Linear,)) is not None]

    def match(self, gm: fx.GraphModule, node: fx.Node) -> Union[Match, str, None]:
        if len(node.args) != 1 or node.kwargs:
            return None
        cat = node.args[0]
        if not call(cat, (torch.cat, torch.concat, torch.concatenate)):
            return None
        parts = arg(cat, 0, "tensors")
        if not isinstance(parts, (list, tuple)) or len(parts) < 2 or \
                not all(isinstance(p, fx.Node) for p in parts):
            return None
        dim = arg(cat, 1, "dim", cat.kwargs.get("axis", 0))
        if dim != -1:
            return f"concatenation along dim {dim!r}; splitting needs the features dim, -1"
        return Match(anchor=node, output=node, nodes=[node, cat], target=lowering.linear_over_parts,
                     args=(("module", node.target), *parts), kwargs={}, op="linear_over_parts",
                     pattern=f"Linear(cat([{len(parts)} parts], -1))")

    def check(self, gm: fx.GraphModule, m: Match) -> Optional[str]:
        # The concatenation may feed other projections (keys and values): it is removed once
        # the last of them is rewritten, and kept for any other user.
        return None
