"""``split_linear_inputs``: ``Linear(cat(parts, -1))`` -> one product per group of parts.

Pattern::

    kv_in = torch.cat([h_nbr, edge_feat, self.time_enc(dt)], dim=-1)
    key = self.w_k(kv_in)
    value = self.w_v(kv_in)

TGAT's and TGN's keys and values are projections of a concatenation of neighbor state, edge
features and time encodings. Autograd then computes the gradient of the whole concatenation in
the backward (one ``[rows, in]`` product per projection), also of the columns that need none
(edge and raw node features are data), and the concatenation itself is written out once more in
the forward. The replacement (:func:`~fastopt.passes.split_linear_lowering.linear_over_parts`)
multiplies the parts that need no gradient and those that do by their own column blocks of the
weight, summed by ``addmm``: ``y = x_free W_free^T + b + x_grad W_grad^T``. Same function; the
backward skips the input gradient of the free group (for a 172-d edge feature and 100-d encoding,
63 % of the input gradient's work) and the concatenation is not materialized. Which parts need
gradients is decided per call on the actual tensors; with nothing to split (inference, all parts
free or all needing gradients) or ``config.passes.split_linear_inputs`` off, it runs the original
``linear(torch.cat(parts, -1))``.

Left alone: concatenation along another dimension (``dim`` must be the literal -1), a Linear
called with more than its input.

Sibling projections (several Linears of the same concatenation, each called on it alone: TGAT's
keys and values) become one :func:`~fastopt.passes.split_linear_lowering.linears_over_parts`
call, which multiplies by their stacked weights once and returns column blocks of the product;
merged only where every user of each projection accepts such a view (no in-place op, no ``view``
that merges the features with another dimension, not returned or handed to a submodule), else
each is split on its own.

A part gathered by an index (``rows[index]``, the batch's unique edge features read per slot)
and used by the concatenation alone is passed on as the pair ``(rows, index)``: where it is the
only part without gradient and ``rows`` has fewer rows than the index selects, the lowering
projects the rows once and gathers the projected rows (the projection commutes with the gather).

Order: after the attention passes (their matches read the projections, not the concatenation).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import fx, nn

from fastopt.passes.pattern import (Match, RewritePass, arg, call, gather_of, is_lowering,
                                    module_of, writes_in_place)
from fastopt.passes.split_linear_lowering import linear_over_parts, linears_over_parts

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
        gathers = [p for p in parts if len(p.users) == 1 and gather_of(p) is not None]
        parts = [gather_of(p) if p in gathers else p for p in parts]  # (rows, index) pairs
        siblings = _siblings(gm, node, cat)
        if len(siblings) > 1:
            return _Siblings(anchor=node, output=node, nodes=[*siblings, cat, *gathers],
                             target=linears_over_parts, args=tuple(parts), kwargs={},
                             op="linears_over_parts", siblings=siblings,
                             pattern=f"{len(siblings)} x Linear(cat([{len(parts)} parts], -1))")
        return Match(anchor=node, output=node, nodes=[node, cat, *gathers],
                     target=linear_over_parts,
                     args=(("module", node.target), *parts), kwargs={}, op="linear_over_parts",
                     pattern=f"Linear(cat([{len(parts)} parts], -1))")

    def check(self, gm: fx.GraphModule, m: Match) -> Optional[str]:
        # The concatenation may feed other projections (keys and values): it is removed once
        # the last of them is rewritten, and kept for any other user.
        return None

    def _replace(self, gm: fx.GraphModule, m: Match) -> None:
        if not isinstance(m, _Siblings):
            return super()._replace(gm, m)
        graph = gm.graph
        m.kwargs["site"] = self.new_site(m.anchor)
        with graph.inserting_before(m.siblings[0]):
            modules = tuple(graph.get_attr(s.target) for s in m.siblings)
            merged = graph.call_function(m.target, (modules, *m.args), dict(m.kwargs))
            blocks = [graph.call_function(operator.getitem, (merged, i))
                      for i in range(len(m.siblings))]
        for sibling, block in zip(m.siblings, blocks):
            block.meta.update({k: v for k, v in sibling.meta.items() if k == "nn_module_stack"})
            sibling.replace_all_uses_with(block)
        merged.meta.update(blocks[0].meta)
        for node in reversed(list(graph.nodes)):
            if node in m.nodes and not node.users:
                graph.erase_node(node)


@dataclasses.dataclass
class _Siblings(Match):
    """Linears of one concatenation, in graph order, rewritten together."""

    siblings: Sequence[fx.Node] = ()


def _siblings(gm: fx.GraphModule, node: fx.Node, cat: fx.Node) -> List[fx.Node]:
    """The Linears called on ``cat`` alone (``node`` among them) that can share one product: same
    input width, each user accepting a column block of the product; ``[node]`` if fewer than two."""
    first = module_of(gm, node, (nn.Linear,))
    found = []
    for user in cat.users:  # in insertion order, which is graph order
        lin = module_of(gm, user, (nn.Linear,))
        if lin is None or len(user.args) != 1 or user.kwargs or \
                lin.in_features != first.in_features:
            continue
        if all(_accepts_column_block(u, lin.out_features) for u in user.users):
            found.append(user)
    found.sort(key=lambda n: list(n.graph.nodes).index(n))
    return found if node in found and len(found) > 1 else [node]


# Calls that read a column block and return a new tensor (never an alias of it, never writing it).
_PURE_METHODS = {"add", "sub", "mul", "div", "sum", "mean", "amax", "softmax", "exp", "tanh",
                 "sigmoid", "relu", "matmul", "bmm", "neg", "pow", "clamp", "masked_fill"}
_PURE_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
                   operator.pow, operator.matmul, torch.add, torch.sub, torch.mul, torch.div,
                   torch.matmul, torch.bmm, torch.sum, torch.softmax, torch.exp, torch.tanh,
                   torch.sigmoid, torch.relu, torch.masked_fill, F.relu, F.leaky_relu, F.gelu,
                   F.softmax}


def _accepts_column_block(user: fx.Node, width: int, depth: int = 0) -> bool:
    """Whether ``user`` computes the same from a column block of a wider product (a view with a
    larger row stride, which may not be written in place) as from its own tensor.

    Allowed: a ``view`` that only splits the ``width`` features (its users checked the same way),
    the fused operators of the passes (:func:`~fastopt.passes.pattern.is_lowering`), and calls
    that return a new tensor (:data:`_PURE_METHODS`, :data:`_PURE_FUNCTIONS`) without writing in
    place. Anything else (another alias such as ``reshape``, ``contiguous`` or ``transpose``, whose
    in-place writes would miss or fail on the block; a submodule; the graph's output) keeps the
    Linear apart.
    """
    if depth > 4 or writes_in_place(user) or user.op != "call_method" and \
            user.op != "call_function":
        return False
    target = user.target
    if target == "view" or target is torch.Tensor.view:
        return _splits_only_features(user, width) and \
            all(_accepts_column_block(u, width, depth + 1) for u in user.users)
    if user.op == "call_method":
        return target in _PURE_METHODS
    if is_lowering(target):
        return True
    return target in _PURE_FUNCTIONS


def _splits_only_features(view: fx.Node, width: int) -> bool:
    """``x.view(..., a, b)`` whose trailing literal sizes multiply to ``width``: the feature
    dimension is split (or kept), never merged with the leading ones."""
    shape = view.args[1:]
    if len(shape) == 1 and isinstance(shape[0], (list, tuple)):
        shape = shape[0]
    product = 1
    for size in reversed(shape):
        if not isinstance(size, int) or size < 1:
            return False
        product *= size
        if product == width:
            return True
        if product > width:
            return False
    return False
