"""``fuse_edge_softmax_aggregation``: PyG-style edge softmax and sum over ``edge_index`` -> one
fused operator.

Pattern (user code fx traces, with ``from torch_geometric.utils import softmax, scatter``)::

    alpha = softmax(scores, index, num_nodes=N)          # scores [E] or [E, H]; ptr=None, dim=0
    alpha = F.dropout(alpha, p, training=self.training)  # optional
    msg = alpha.unsqueeze(-1) * values                   # or alpha[..., None], .view(-1, H, 1),
                                                         # .reshape(...), either operand order
    out = scatter(msg, index, dim=0, dim_size=N, reduce="sum")   # or "add"
    out = x.new_zeros(N, ...).index_add_(0, index, msg)          # or torch.zeros(...) / zeros_like,
                                                                 # the zeros read afterwards

Replacement: :func:`fused_edge_softmax_aggregate` (below), running
``fastopt.codegen.edge_softmax_aggregate`` (the temporal-attention kernels over the
destination-sorted edges) when the tensors fit: the weights broadcast as ``[E, H, 1]`` against
values ``[E, H, C]`` (``[E, 1]`` against ``[E, C]``), one index for softmax and sum, equal sizes.
Otherwise, and on the CPU with ``kernels.backend="auto"`` (where the original code is faster than
the operator's reference), it runs the original calls.

Left alone: a softmax with ``ptr`` or over another dimension, a sum by another index or another
reduction, weights reshaped by sizes computed in the graph, intermediates read elsewhere.

Order: independent of the other passes (its anchor, PyG's softmax, is theirs to ignore); PyG's
functions are graph calls only where :func:`fastopt.passes.tracing.leaf_functions` made them so.
"""

from __future__ import annotations

import operator
from typing import Any, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, fx

from fastopt import codegen
from fastopt.config import default_config
from fastopt.passes.pattern import Match, RewritePass, arg, call, literal, single_user, unsqueeze_dim
from fastopt.passes.sites import record

__all__ = ["FuseEdgeSoftmaxAggregation", "fused_edge_softmax_aggregate"]

_RESHAPES = ("view", "reshape")
_ZEROS = (torch.zeros, torch.zeros_like)


def _pyg(node: Any, name: str) -> bool:
    """Whether ``node`` calls torch_geometric's ``name`` (``softmax``/``scatter``)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"):
        return False
    target = node.target
    return getattr(target, "__name__", "") == name and \
        (getattr(target, "__module__", "") or "").startswith("torch_geometric.utils")


def _shape_step(node: fx.Node) -> Optional[tuple]:
    """``node`` as a replayable shape step on its first argument, or None."""
    dim = unsqueeze_dim(node)
    if dim is not None:
        return ("unsqueeze", dim)
    if call(node, (torch.reshape,), _RESHAPES):
        shape = node.args[1:] if node.op == "call_method" else (node.args[1],)
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if shape and all(literal(s) for s in shape):
            return ("reshape", tuple(shape))
        return ("dynamic",)
    return None


def _replay(steps: Tuple[tuple, ...], t: Tensor) -> Tensor:
    for step in steps:
        t = t.unsqueeze(step[1]) if step[0] == "unsqueeze" else t.reshape(step[1])
    return t


class FuseEdgeSoftmaxAggregation(RewritePass):
    """PyG ``softmax`` + weighted ``scatter``/``index_add_`` -> ``codegen.edge_softmax_aggregate``."""

    name = "fuse_edge_softmax_aggregation"

    def anchors(self, gm: fx.GraphModule) -> List[fx.Node]:
        return [n for n in gm.graph.nodes if _pyg(n, "softmax")]

    def match(self, gm: fx.GraphModule, soft: fx.Node) -> Union[Match, str]:
        scores, index = arg(soft, 0, "src"), arg(soft, 1, "index")
        if arg(soft, 2, "ptr") is not None or arg(soft, 4, "dim", 0) != 0:
            return "a softmax with ptr or over another dimension than the edges (dim=0)"
        if not isinstance(index, fx.Node):
            return "a softmax without an index tensor"
        nodes, node = [soft], soft
        user = single_user(node)
        dropout_p, training = 0.0, False
        if call(user, (F.dropout,)) and user.args[0] is node:
            dropout_p, training = arg(user, 1, "p", 0.5), arg(user, 2, "training", True)
            if not (literal(dropout_p) and isinstance(training, bool)) or arg(user, 3, "inplace", False):
                return "a dropout whose probability or mode is not a constant"
            nodes.append(user)
            node, user = user, single_user(user)
        steps = []
        while user is not None and (step := _shape_step(user)) is not None:
            if step[0] == "dynamic":
                return "the weights are reshaped by sizes computed in the graph"
            steps.append(step)
            nodes.append(user)
            node, user = user, single_user(user)
        if len(node.users) > 1:
            return (f"intermediate {node.name} is also used by {list(node.users)[1].name}; fusing "
                    f"would drop it")
        if not (call(user, (operator.mul, torch.mul)) and node in user.args[:2]):
            return "the softmax weights are not multiplied into values"
        values = user.args[1] if user.args[0] is node else user.args[0]
        mul = user
        nodes.append(mul)
        agg = single_user(mul)
        common = dict(steps=tuple(steps), dropout_p=float(dropout_p), training=training)
        if _pyg(agg, "scatter"):
            reduce = arg(agg, 4, "reduce", "sum")
            if arg(agg, 0, "src") is not mul or arg(agg, 1, "index") is not index \
                    or arg(agg, 2, "dim", 0) != 0 or reduce not in ("sum", "add"):
                return "the weighted values are not summed by the softmax's index over dim 0"
            nodes.append(agg)
            return Match(anchor=soft, output=agg, nodes=nodes, target=fused_edge_softmax_aggregate,
                         args=(scores, values, index, arg(soft, 3, "num_nodes"),
                               arg(agg, 3, "dim_size"), None),
                         kwargs=dict(form="scatter", **common), op="edge_softmax_aggregate",
                         pattern=f"pyg_softmax_scatter[{'dropout,' if dropout_p else ''}{reduce}]")
        if call(agg, (torch.index_add,), ("index_add_", "index_add")) and len(agg.args) >= 4 \
                and agg.args[1] == 0 and agg.args[2] is index and agg.args[3] is mul \
                and agg.kwargs.get("alpha", 1) == 1:
            base = agg.args[0]
            if not call(base, _ZEROS, ("new_zeros",)):
                return "index_add_ into a tensor that is not freshly zeroed"
            nodes.append(agg)
            form = "index_add_" if agg.op == "call_method" and agg.target == "index_add_" \
                else "index_add"
            return Match(anchor=soft, output=agg, nodes=nodes, target=fused_edge_softmax_aggregate,
                         args=(scores, values, index, arg(soft, 3, "num_nodes"), None, base),
                         kwargs=dict(form=form, **common), op="edge_softmax_aggregate",
                         pattern=f"pyg_softmax_{form}{'[dropout]' if dropout_p else ''}")
        return "the weighted values are not summed by scatter(reduce='sum') or index_add_"

    def check(self, gm: fx.GraphModule, m: Match) -> Optional[str]:
        reason = super().check(gm, m)
        if reason is not None or m.kwargs["form"] != "index_add_":
            return reason
        base, agg = m.args[5], m.output
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        early = [u for u in base.users if u is not agg and order[u] < order[agg]]
        if early:
            return f"the zeros index_add_ writes into are read before it by {early[0].name}"
        return None

    def _replace(self, gm: fx.GraphModule, m: Match) -> None:
        base, agg = (m.args[5], m.output) if m.kwargs["form"] == "index_add_" else (None, None)
        later = [u for u in base.users if u is not agg] if base is not None else []
        super()._replace(gm, m)
        if later:
            # index_add_ wrote the zeros in place: what read them afterwards reads the result
            new = next(n for n in gm.graph.nodes if n.target is fused_edge_softmax_aggregate
                       and n.args[5] is base)
            for user in later:
                user.replace_input_with(base, new)


# ----------------------------------------------------------------------------------------------
# lowering: what the rewritten graph calls
# ----------------------------------------------------------------------------------------------


def _original(scores, values, index, num_nodes, dim_size, base, *, form, steps, dropout_p,
              training):
    from torch_geometric.utils import scatter, softmax

    alpha = softmax(scores, index, None, num_nodes, 0)
    if dropout_p:
        alpha = F.dropout(alpha, dropout_p, training)
    msg = _replay(steps, alpha) * values
    if form == "scatter":
        return scatter(msg, index, 0, dim_size, "sum")
    if form == "index_add_":
        return base.index_add_(0, index, msg)
    return base.index_add(0, index, msg)


def fused_edge_softmax_aggregate(scores: Tensor, values: Tensor, index: Tensor,
                                 num_nodes: Optional[int], dim_size: Optional[int],
                                 base: Optional[Tensor], *, form: str, steps: tuple,
                                 dropout_p: float, training: bool, site: str = "") -> Tensor:
    """``sum over edges e into n of softmax_n(scores)[e] * values[e]``, fused where it fits.

    ``steps`` replays the shape ops between the softmax and the product; ``form`` says how the
    matched code summed (``"scatter"`` with ``dim_size``, or ``"index_add_"``/``"index_add"``
    into the zeros ``base``). Anything that does not fit runs the matched code.
    """
    kw = dict(form=form, steps=steps, dropout_p=dropout_p, training=training)
    edges = scores.shape[0] if scores.dim() else -1
    fits = (scores.dim() in (1, 2) and index.dim() == 1 and index.numel() == edges
            and values.dim() == scores.dim() + 1 and values.shape[0] == edges
            and scores.is_floating_point() and values.dtype == scores.dtype
            and not (default_config().kernels.backend == "auto"
                     and codegen.select_backend(values) != "triton")
            and not (training and dropout_p and not default_config().passes.fuse_dropout))
    heads = scores.shape[1] if scores.dim() == 2 else 1
    if fits:
        weight = _replay(steps, torch.empty(scores.shape, device="meta"))
        fits = tuple(weight.shape) == (edges, *scores.shape[1:], 1) and \
            (scores.dim() == 1 or values.shape[1] == heads)
    sizes = [s for s in (num_nodes, dim_size) if s is not None]
    if base is not None:
        sizes.append(base.shape[0])
        fits = fits and base.dtype == values.dtype and tuple(base.shape[1:]) == tuple(values.shape[1:])
    if not fits or len(set(sizes)) > 1:
        return _original(scores, values, index, num_nodes, dim_size, base, **kw)
    nodes = sizes[0] if sizes else (int(index.max()) + 1 if edges else 0)
    p = dropout_p if training else 0.0
    seed = codegen.dropout_seed(values) if p > 0.0 else 0
    out = codegen.edge_softmax_aggregate(scores.reshape(edges, heads),
                                         values.reshape(edges, heads, -1), index, nodes,
                                         dropout_p=p, seed=seed)
    record(site, (heads, values.shape[-1]))
    return out.reshape(nodes, *values.shape[1:])
