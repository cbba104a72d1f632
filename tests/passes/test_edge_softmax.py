"""``fuse_edge_softmax_aggregation``: hand-written PyG-style message passing (``softmax`` over
``edge_index`` then ``scatter``/``index_add_`` of the weighted values) traced and rewritten, with
outputs and gradients as the user's code on graphs with empty rows, multi-edges and self-loops."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("torch_geometric")
from torch_geometric.utils import scatter, softmax  # noqa: E402

import fastopt  # noqa: E402
from fastopt.passes.edge_softmax import FuseEdgeSoftmaxAggregation  # noqa: E402
from fastopt.passes.tracing import trace  # noqa: E402

NODES, EDGES, DIM, HEADS = 12, 50, 8, 2


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def heads(self, x, edge_index):
        src, dst = edge_index[0], edge_index[1]
        q = self.q(x).view(-1, HEADS, DIM // HEADS)[dst]
        k = self.k(x).view(-1, HEADS, DIM // HEADS)[src]
        v = self.v(x).view(-1, HEADS, DIM // HEADS)[src]
        return (q * k).sum(-1), v, dst


class ScatterSum(Base):
    reduce = "sum"

    def forward(self, x, edge_index):
        scores, v, dst = self.heads(x, edge_index)
        alpha = softmax(scores, dst, num_nodes=x.size(0))
        return scatter(alpha.unsqueeze(-1) * v, dst, dim=0, dim_size=x.size(0), reduce=self.reduce)


class ScatterAddNoSizes(Base):
    def forward(self, x, edge_index):
        scores, v, dst = self.heads(x, edge_index)
        alpha = softmax(scores, dst)
        return scatter(v * alpha[..., None], dst, 0, reduce="add")


class IndexAddInPlace(Base):
    def forward(self, x, edge_index):
        scores, v, dst = self.heads(x, edge_index)
        alpha = F.dropout(softmax(scores, dst, num_nodes=x.size(0)), 0.2, self.training)
        out = x.new_zeros(x.size(0), HEADS, DIM // HEADS)
        out.index_add_(0, dst, alpha.view(-1, HEADS, 1) * v)
        return out.reshape(-1, DIM).relu()


class OneHeadIndexAdd(Base):
    def forward(self, x, edge_index):
        src, dst = edge_index[0], edge_index[1]
        scores = (self.q(x)[dst] * self.k(x)[src]).sum(-1)
        alpha = softmax(scores, dst, num_nodes=x.size(0))
        return torch.zeros_like(x).index_add(0, dst, alpha.reshape(-1, 1) * self.v(x)[src])


MODELS = {"scatter-sum": ScatterSum, "scatter-add-no-sizes": ScatterAddNoSizes,
          "index-add-inplace-dropout": IndexAddInPlace, "one-head-index-add": OneHeadIndexAdd}


def _graph(seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, NODES, (EDGES,), generator=g)
    dst = torch.randint(0, NODES - 2, (EDGES,), generator=g)  # the last two get no edge
    src[:3], dst[:3] = 3, 3                                  # self-loops
    src[3:6], dst[3:6] = 1, 4                                # a repeated edge
    dst[-1] = NODES - 1                                      # the largest id has an edge
    return torch.randn(NODES, DIM, generator=g), torch.stack([src, dst])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_rewritten_and_equal_to_the_users_code(name, reference_backend):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    fast = fastopt.optimize(copy.deepcopy(model))
    report = fast.fastopt_report
    patterns = {r.pattern for r in report.rewrites if r.op == "edge_softmax_aggregate"}
    assert len(patterns) == 1, str(report)
    x, edge_index = _graph()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = model(xa, edge_index), fast(xb, edge_index)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    for a, b in zip(torch.autograd.grad(got, [xb, *fast.parameters()], grad),
                    torch.autograd.grad(want, [xa, *model.parameters()], grad)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_pass_counts_and_the_graph_calls_the_lowering():
    gm = trace(ScatterSum(), False)
    rewrite = FuseEdgeSoftmaxAggregation()
    gm, modified = rewrite(gm)
    assert modified and rewrite.matches == 1
    targets = [getattr(n.target, "__name__", n.target) for n in gm.graph.nodes]
    assert "fused_edge_softmax_aggregate" in targets
    assert "softmax" not in targets and "scatter" not in targets


def test_in_place_index_add_result_read_through_the_zeros(reference_backend):
    """``out.index_add_(...)`` then ``out`` read: the later reads get the fused result."""
    gm = trace(IndexAddInPlace(), False)
    gm, modified = FuseEdgeSoftmaxAggregation()(gm)
    assert modified
    assert not any(n.target == "index_add_" for n in gm.graph.nodes)


class WrongIndex(Base):
    def forward(self, x, edge_index):
        scores, v, dst = self.heads(x, edge_index)
        alpha = softmax(scores, dst, num_nodes=x.size(0))
        return scatter(alpha.unsqueeze(-1) * v, edge_index[0], dim=0, dim_size=x.size(0))


class MeanReduce(ScatterSum):
    reduce = "mean"


class WeightsReused(Base):
    def forward(self, x, edge_index):
        scores, v, dst = self.heads(x, edge_index)
        alpha = softmax(scores, dst, num_nodes=x.size(0))
        w = alpha.unsqueeze(-1)
        return scatter(w * v, dst, dim=0, dim_size=x.size(0)), w


class DynamicView(Base):
    def forward(self, x, edge_index):
        scores, v, dst = self.heads(x, edge_index)
        alpha = softmax(scores, dst, num_nodes=x.size(0))
        return scatter(alpha.view(-1, v.size(1), 1) * v, dst, dim=0, dim_size=x.size(0))


class ReadBeforeWrite(Base):
    def forward(self, x, edge_index):
        scores, v, dst = self.heads(x, edge_index)
        alpha = softmax(scores, dst, num_nodes=x.size(0))
        out = x.new_zeros(x.size(0), HEADS, DIM // HEADS)
        before = out.sum()
        out.index_add_(0, dst, alpha.unsqueeze(-1) * v)
        return out, before


@pytest.mark.parametrize("model, reason", [
    (WrongIndex, "not summed by the softmax's index"),
    (MeanReduce, "not summed by the softmax's index"),
    (WeightsReused, "also used by"),
    (DynamicView, "sizes computed in the graph"),
    (ReadBeforeWrite, "read before it"),
])
def test_left_alone_with_the_reason(model, reason, reference_backend):
    torch.manual_seed(0)
    m = model().eval()
    fast = fastopt.optimize(copy.deepcopy(m))
    report = fast.fastopt_report
    assert report.count("edge_softmax_aggregate") == 0
    found = [a.reason for a in report.left_alone if a.pass_name == "fuse_edge_softmax_aggregation"]
    assert found and reason in found[0], str(report)
    x, edge_index = _graph()
    for a, b in zip(torch.utils._pytree.tree_leaves(fast(x, edge_index)),
                    torch.utils._pytree.tree_leaves(m(x, edge_index))):
        torch.testing.assert_close(a, b)
