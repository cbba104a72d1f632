"""PyG's attention layers under ``fastopt.optimize``: replaced by class, outputs and gradients as
the original's on random graphs with nodes without incoming edges, multi-edges and self-loops;
options the replacement does not take left alone and reported, or run by the original forward."""

from __future__ import annotations

import copy
import re
import sys

import pytest
import torch

pytest.importorskip("torch_geometric")
from torch_geometric.nn import GATConv, GATv2Conv, TransformerConv  # noqa: E402

import fastopt  # noqa: E402
import fastopt.config as fconfig  # noqa: E402

NODES, EDGES, IN, EDGE_DIM = 14, 60, 12, 5


def _graph(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, NODES, (EDGES,), generator=g)
    dst = torch.randint(0, NODES - 3, (EDGES,), generator=g)  # the last three get no edge
    src[:4], dst[:4] = 5, 5                                    # self-loops
    src[4:8], dst[4:8] = 2, 7                                  # one edge four times
    x = torch.randn(NODES, IN, generator=g, dtype=dtype)
    edge_attr = torch.randn(EDGES, EDGE_DIM, generator=g, dtype=dtype)
    return x, torch.stack([src, dst]), edge_attr


LAYERS = {
    "transformer": lambda: TransformerConv(IN, 6, heads=2, edge_dim=EDGE_DIM, dropout=0.1),
    "transformer-beta-mean": lambda: TransformerConv(IN, 5, heads=3, concat=False, beta=True,
                                                     edge_dim=EDGE_DIM),
    "transformer-noedge-noroot": lambda: TransformerConv(IN, 7, heads=1, root_weight=False),
    "transformer-bipartite": lambda: TransformerConv((IN, IN), 4, heads=2, edge_dim=EDGE_DIM),
    "gat": lambda: GATConv(IN, 6, heads=2, edge_dim=EDGE_DIM, dropout=0.2),
    "gat-mean-noloops": lambda: GATConv(IN, 5, heads=3, concat=False, add_self_loops=False),
    "gat-residual-bipartite": lambda: GATConv((IN, IN), 4, heads=2, residual=True, bias=False),
    "gatv2": lambda: GATv2Conv(IN, 6, heads=2, edge_dim=EDGE_DIM),
    "gatv2-shared-mean": lambda: GATv2Conv(IN, 5, heads=2, concat=False, share_weights=True,
                                           residual=True, fill_value=0.5, edge_dim=EDGE_DIM),
}


def _inputs(name, x, edge_index, edge_attr):
    if "bipartite" in name:
        x = (x, x[: NODES - 2].clone())
        edge_index = edge_index.clone()
        edge_index[1] = edge_index[1] % (NODES - 2)
    attr = None if "noedge" in name or name.startswith("gat-") else edge_attr
    return x, edge_index, attr


def _leaves(x, edge_attr):
    xs = tuple(t.detach().clone().requires_grad_() for t in (x if isinstance(x, tuple) else (x,)))
    attr = None if edge_attr is None else edge_attr.detach().clone().requires_grad_()
    return (xs if len(xs) == 2 else xs[0]), attr


def _run(layer, x, edge_index, edge_attr, grad):
    out = layer(x, edge_index, edge_attr) if edge_attr is not None else layer(x, edge_index)
    wrt = [*(x if isinstance(x, tuple) else (x,)), *([edge_attr] if edge_attr is not None else []),
           *layer.parameters()]
    return out, torch.autograd.grad(out, wrt, grad, allow_unused=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_matches_the_original(name, dtype, reference_backend):
    torch.manual_seed(0)
    layer = LAYERS[name]().to(dtype).eval()  # eval: dropout off, so both are deterministic
    original = copy.deepcopy(layer)
    fast = fastopt.optimize(layer)
    assert type(fast).__name__ == f"Fused{type(layer).__name__}"
    report = fast.fastopt_report
    assert report.count() == 1 and report.rewrites[0].pattern.startswith(f"pyg.{type(layer).__name__}[")
    assert list(fast.state_dict()) == list(original.state_dict())
    x, edge_index, edge_attr = _inputs(name, *_graph(dtype=dtype))
    xa, ea = _leaves(x, edge_attr)
    xb, eb = _leaves(x, edge_attr)
    heads_out = layer.heads * layer.out_channels if layer.concat else layer.out_channels
    rows = x[1].shape[0] if isinstance(x, tuple) else NODES
    grad = torch.randn(rows, heads_out, dtype=dtype, generator=torch.Generator().manual_seed(3))
    want, want_grads = _run(original, xa, edge_index, ea, grad)
    got, got_grads = _run(fast, xb, edge_index, eb, grad)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(got, want, **tol)
    for a, b in zip(got_grads, want_grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("name, make", [
    ("transformer", LAYERS["transformer"]),
    ("transformer-noedge", lambda: TransformerConv(IN, 5, heads=2, dropout=0.3)),
    ("gat", LAYERS["gat"]),
    ("gatv2-mean", lambda: GATv2Conv(IN, 4, heads=3, concat=False, dropout=0.4,
                                     edge_dim=EDGE_DIM)),
])
def test_training_dropout_draws_the_layers_masks(name, make, reference_backend):
    """In training, from one generator state, the fused layer drops the attention weights the
    original drops: the same outputs and gradients, so a trained copy follows the original."""
    torch.manual_seed(0)
    layer = make().train()
    original = copy.deepcopy(layer)
    fast = fastopt.optimize(layer)
    x, edge_index, edge_attr = _inputs(name, *_graph())
    heads_out = layer.heads * layer.out_channels if layer.concat else layer.out_channels
    grad = torch.randn(NODES, heads_out, generator=torch.Generator().manual_seed(3))
    runs = []
    for module in (original, fast):
        torch.manual_seed(7)
        runs.append(_run(module, *_leaves(x, edge_attr)[:1], edge_index, _leaves(x, edge_attr)[1],
                         grad))
    (want, want_grads), (got, got_grads) = runs
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.manual_seed(8)  # another draw, another mask: dropout is active
    assert not torch.equal(fast(x, edge_index, edge_attr) if edge_attr is not None
                           else fast(x, edge_index), got.detach())


def test_replacement_runs_the_fused_operator(monkeypatch, reference_backend):
    """The fused forward is what runs, not the layer's propagate (the generated kernels behind
    the operator are tested on the interpreter in tests/codegen/test_edge_attention.py)."""
    layer = LAYERS["transformer"]().eval()
    fast = fastopt.optimize(copy.deepcopy(layer))
    x, edge_index, edge_attr = _graph()
    want = layer(x, edge_index, edge_attr)
    monkeypatch.setattr(type(layer), "propagate", lambda *a, **kw: pytest.fail("propagate ran"))
    torch.testing.assert_close(fast(x, edge_index, edge_attr), want, rtol=1e-4, atol=1e-5)


def test_on_the_cpu_auto_runs_the_layers_own_code(monkeypatch):
    layer = LAYERS["gatv2"]().eval()
    fast = fastopt.optimize(copy.deepcopy(layer))
    x, edge_index, edge_attr = _graph()
    from fastopt.passes import pyg_conv

    monkeypatch.setattr(pyg_conv, "gatv2_conv", lambda *a: pytest.fail("the fused path ran"))
    with fconfig.patch(kernels__backend="auto"):
        torch.testing.assert_close(fast(x, edge_index, edge_attr), layer(x, edge_index, edge_attr))


def test_training_dropout_keeps_rows_stochastic_and_empty_rows_zero(reference_backend):
    torch.manual_seed(0)
    layer = GATConv(IN, 4, heads=2, dropout=0.5, add_self_loops=False, bias=False).train()
    fast = fastopt.optimize(layer)
    x, edge_index, _ = _graph()
    a, b = fast(x, edge_index), fast(x, edge_index)
    assert not torch.equal(a, b)
    assert a[-3:].abs().max() == 0 and b[-3:].abs().max() == 0


@pytest.mark.parametrize("make, why", [
    (lambda: TransformerConv(IN, 4, aggr="mean"), r"aggr='mean'"),
    (lambda: GATConv(IN, 4, flow="target_to_source"), r"flow='target_to_source'"),
    (lambda: GATv2Conv(IN, 4, aggr="max"), r"aggr='max'"),
])
def test_unsupported_options_are_left_alone_and_reported(make, why):
    layer = make()
    fast = fastopt.optimize(layer)
    assert fast is layer
    reasons = [a.reason for a in fast.fastopt_report.left_alone if a.pass_name.startswith("fuse_pyg")]
    assert len(reasons) == 1 and re.search(why, reasons[0]), reasons
    assert why.replace("\\", "").split("=")[0] in str(fast.fastopt_report)


def test_a_subclass_is_left_alone_and_reported():
    class MyConv(TransformerConv):
        pass

    layer = MyConv(IN, 4)
    report = fastopt.optimize(layer).fastopt_report
    assert report.count() == 0
    assert any("MyConv subclasses TransformerConv" in a.reason for a in report.left_alone)


def test_per_call_options_run_the_original_forward(reference_backend):
    torch.manual_seed(0)
    layer = LAYERS["gat"]().eval()
    fast = fastopt.optimize(copy.deepcopy(layer))
    x, edge_index, edge_attr = _graph()
    out, (ei, alpha) = fast(x, edge_index, edge_attr, return_attention_weights=True)
    want, (ei2, alpha2) = layer(x, edge_index, edge_attr, return_attention_weights=True)
    torch.testing.assert_close(out, want)
    assert torch.equal(ei, ei2)
    torch.testing.assert_close(alpha, alpha2)
    sizes = fast(x, edge_index, edge_attr, size=(NODES, NODES))
    torch.testing.assert_close(sizes, layer(x, edge_index, edge_attr, size=(NODES, NODES)))


def test_layers_inside_a_model_are_found_and_share_parameters(reference_backend):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = GATv2Conv(IN, 8, heads=2)
            self.conv2 = TransformerConv(16, 4, heads=2, edge_dim=EDGE_DIM)

        def forward(self, x, edge_index, edge_attr):
            return self.conv2(self.conv1(x, edge_index).relu(), edge_index, edge_attr)

    torch.manual_seed(0)
    net = Net().eval()
    fast = fastopt.optimize(net)
    report = fast.fastopt_report
    assert report.rewritten_modules() == ["conv1", "conv2"]
    assert "fastopt.codegen.edge_attention" in str(report)
    assert fast.conv1.lin_l.weight is net.conv1.lin_l.weight
    x, edge_index, edge_attr = _graph()
    torch.testing.assert_close(fast(x, edge_index, edge_attr), net(x, edge_index, edge_attr),
                               rtol=1e-4, atol=1e-5)


def test_without_pyg_the_rules_recognize_nothing(monkeypatch):
    from fastopt.passes import pyg_conv, pyg_memory

    layer = TransformerConv(IN, 4)
    for cached in (pyg_conv.pyg_conv_classes, pyg_memory.tgn_memory_class):
        cached.cache_clear()
    monkeypatch.setitem(sys.modules, "torch_geometric.nn", None)
    try:
        assert pyg_conv.FuseTransformerConv().classes() == ()
        assert pyg_memory.TensorizeTgnMemory().classes() == ()
        report = fastopt.optimize(layer).fastopt_report
        assert report.count() == 0 and not any("pyg" in a.pass_name for a in report.left_alone)
    finally:
        monkeypatch.undo()
        for cached in (pyg_conv.pyg_conv_classes, pyg_memory.tgn_memory_class):
            cached.cache_clear()


def test_verify_compares_the_first_calls_with_dropout_active(reference_backend):
    """verify=True: the first calls run the layer's own forward beside the fused one (both draw
    the same masks from one generator state) and the report counts them."""
    torch.manual_seed(0)
    layer = LAYERS["transformer"]().train()
    fast = fastopt.optimize(layer, verify=True)
    x, edge_index, edge_attr = _graph()
    for _ in range(3):
        fast(x.requires_grad_(), edge_index, edge_attr).sum().backward()
    (record,) = fast.fastopt_report.verifications
    assert record.calls == 2 and record.with_gradients == 2
    assert "2 call(s) compared" in str(fast.fastopt_report)


def test_verify_catches_a_wrong_fused_layer(reference_backend, monkeypatch):
    from fastopt.errors import TraceError
    from fastopt.passes import pyg_conv

    real = pyg_conv.gat_conv
    monkeypatch.setattr(pyg_conv, "gat_conv", lambda *a: real(*a) * 1.01)
    fast = fastopt.optimize(LAYERS["gat"]().eval(), verify=True)
    x, edge_index, edge_attr = _graph()
    with pytest.raises(TraceError, match="verify=True"):
        fast(x, edge_index, edge_attr)


def test_a_layer_with_propagate_hooks_runs_its_own_forward(reference_backend):
    layer = LAYERS["gatv2"]().eval()
    calls = []
    layer.register_propagate_forward_hook(lambda module, inputs, output: calls.append(1))
    fast = fastopt.optimize(layer)
    x, edge_index, edge_attr = _graph()
    fast(x, edge_index, edge_attr)
    assert calls == [1]


def test_transformer_conv_pads_to_shared_bucket_sizes(reference_backend):
    """The fused TransformerConv runs its per-call work on inputs padded to bucket sizes (what
    its CUDA graphs are keyed by) through a core that shares the layer's projections; the report
    lists that core's graph record, and a copy of the layer gets its own core."""
    from fastopt.runtime import bucket

    assert [bucket(n, 1) for n in (1, 7, 8, 9, 60, 1800, 5525)] == [1, 7, 8, 10, 64, 2048, 6144]
    layer = LAYERS["transformer"]().eval()
    fast = fastopt.optimize(copy.deepcopy(layer))
    seen = []
    core = fast.__dict__["_fastopt_core"]
    real = type(core).forward
    core.forward = lambda *args: seen.append(tuple(a.shape for a in args[:2])) or real(core, *args)
    x, edge_index, edge_attr = _graph()
    torch.testing.assert_close(fast(x, edge_index, edge_attr), layer(x, edge_index, edge_attr),
                               rtol=1e-4, atol=1e-5)
    assert seen == [((14, IN), (64,))]  # 14 nodes (a bucket size), 60 edges padded to 64
    assert core.lin_query is fast.lin_query and "_fastopt_core" not in dict(fast.named_modules())
    assert any(g.where.endswith("(padded core)") for g in fast.fastopt_report.graphs)
    twin = copy.deepcopy(fast)
    assert twin.__dict__["_fastopt_core"].lin_query is twin.lin_query is not fast.lin_query


def test_pad_rows_appends_constant_rows_from_a_kept_buffer():
    """``pad_rows`` gives ``F.pad``'s result (rows of a value appended, dtype and trailing shape
    kept), gradients included, and its constant buffer grows without changing what it holds."""
    from fastopt.runtime.padding import pad_rows

    x = torch.randn(5, 3, 2, requires_grad=True)
    got = pad_rows(x, 4)
    assert torch.equal(got, torch.nn.functional.pad(x, (0, 0, 0, 0, 0, 4)))
    got.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    assert pad_rows(x, 0) is x
    index = torch.arange(6)
    for extra in (3, 50, 2):  # the second grows the buffer of 7s
        assert pad_rows(index, extra, 7).tolist() == list(range(6)) + [7] * extra
    assert pad_rows(index, 2).tolist() == list(range(6)) + [0, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_transformer_conv_replays_one_captured_graph_for_calls_of_one_size(index_dtype):
    """Calls of one size replay one graph pair with PyG's outputs and gradients, for int64 and
    int32 edge indices (the padded call takes them as int64)."""
    torch.manual_seed(0)
    layer = TransformerConv(IN, 6, heads=2, edge_dim=EDGE_DIM).cuda().train()  # dropout 0
    original = copy.deepcopy(layer)
    fast = fastopt.optimize(layer)
    _, edge_index, edge_attr = _graph()
    edge_index, edge_attr = edge_index.cuda(), edge_attr.cuda()
    for i in range(4):  # a signature is captured on its second call, replayed on the later ones
        x = torch.randn(NODES, IN, generator=torch.Generator().manual_seed(i)).cuda()
        grad = torch.randn(NODES, 12, generator=torch.Generator().manual_seed(10 + i)).cuda()
        want, want_grads = _run(original, *_leaves(x, edge_attr)[:1], edge_index,
                                _leaves(x, edge_attr)[1], grad)
        got, got_grads = _run(fast, *_leaves(x, edge_attr)[:1], edge_index.to(index_dtype),
                              _leaves(x, edge_attr)[1], grad)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    record = fast.__dict__["_fastopt_core_runner"].record
    assert record.state == "captured" and record.captures == 1, record


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_transformer_conv_calls_of_changing_size_share_a_graph_and_stay_exact():
    """Calls of 13 or 14 nodes and 57 to 64 edges (largest in-degree 5) pad to one bucket and
    replay one graph pair:
    each call's rows and padding are written into the graph's inputs, so the rows a larger
    earlier call left there change nothing: outputs, input and parameter gradients as PyG's."""
    torch.manual_seed(0)
    layer = TransformerConv(IN, 6, heads=2, edge_dim=EDGE_DIM).cuda().train()  # dropout 0
    original = copy.deepcopy(layer)
    fast = fastopt.optimize(layer)
    with fconfig.patch(passes__cuda_graphs="on"):
        for i, (nodes, edges) in enumerate([(14, 64), (13, 57), (13, 60), (14, 64), (14, 58)]):
            g = torch.Generator().manual_seed(i)
            dst = torch.arange(edges)[torch.randperm(edges, generator=g)] % nodes
            edge_index = torch.stack([torch.randint(0, nodes, (edges,), generator=g), dst]).cuda()
            x = torch.randn(nodes, IN, generator=g).cuda()
            edge_attr = torch.randn(edges, EDGE_DIM, generator=g).cuda()
            grad = torch.randn(nodes, 12, generator=g).cuda()
            want, want_grads = _run(original, *_leaves(x, edge_attr)[:1], edge_index,
                                    _leaves(x, edge_attr)[1], grad)
            got, got_grads = _run(fast, *_leaves(x, edge_attr)[:1], edge_index,
                                  _leaves(x, edge_attr)[1], grad)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            for a, b in zip(got_grads, want_grads):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    runner = fast.__dict__["_fastopt_core_runner"]
    assert runner.record.captures == 1 and runner.held == 1, runner.record


@pytest.mark.parametrize("row,bad", [(0, NODES), (1, -1), (1, NODES + 40)])
def test_transformer_conv_out_of_range_edges_raise_off_the_gpu_at_once(reference_backend, row, bad):
    """The padded core checks its indices on the device (no host read in the call); off the GPU
    the check is read at once: a source or destination outside [0, N) raises, naming it."""
    layer = LAYERS["transformer"]().eval()
    fast = fastopt.optimize(copy.deepcopy(layer))
    x, edge_index, edge_attr = _graph()
    edge_index = edge_index.clone()
    edge_index[row, 7] = bad
    with pytest.raises(fastopt.FastOptError, match=rf"edge_index\[{row}\] held {bad}, outside "
                                                   rf"\[0, {NODES}\).*pass edges between"):
        fast(x, edge_index, edge_attr)
    x, edge_index, edge_attr = _graph()  # the layer goes on working
    torch.testing.assert_close(fast(x, edge_index, edge_attr), layer(x, edge_index, edge_attr),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_transformer_conv_out_of_range_edges_raise_at_the_next_call_on_the_gpu():
    """On a GPU the bad call returns (its check reaches the host after it; memory-safe), and the
    layer's next call raises naming the index, the value and the node count; the one after runs."""
    torch.manual_seed(0)
    fast = fastopt.optimize(TransformerConv(IN, 6, heads=2, edge_dim=EDGE_DIM).cuda().eval())
    x, edge_index, edge_attr = (t.cuda() for t in _graph())
    bad = edge_index.clone()
    bad[0, 3] = NODES + 100
    fast(x, bad, edge_attr)
    torch.cuda.synchronize()
    with pytest.raises(fastopt.FastOptError, match=rf"edge_index\[0\] held {NODES + 100}, outside "
                                                   rf"\[0, {NODES}\).*call before this one"):
        fast(x, edge_index, edge_attr)
    fast(x, edge_index, edge_attr)
    fast(x, edge_index, edge_attr)  # the good calls' checks pass
    fast(x, bad, edge_attr)  # an epoch's last call: the switch to evaluation reports it
    with pytest.raises(fastopt.FastOptError, match=rf"edge_index\[0\] held {NODES + 100}"):
        fast.eval()
    fast.train()


def test_transformer_conv_takes_int32_edges_and_a_first_call_in_inference_mode(reference_backend):
    """int32 edge indices give PyG's output (the padded call works on int64 indices, whose
    padding value int32 cannot hold); a first call under torch.inference_mode() leaves the
    index check's buffers usable by the training calls after it."""
    layer = LAYERS["transformer"]()
    fast = fastopt.optimize(copy.deepcopy(layer))
    x, edge_index, edge_attr = _graph()
    layer.eval(), fast.eval()
    with torch.inference_mode():
        torch.testing.assert_close(fast(x, edge_index.int(), edge_attr), layer(x, edge_index, edge_attr),
                                   rtol=1e-4, atol=1e-5)
    grad = torch.randn(NODES, 12, generator=torch.Generator().manual_seed(3))
    want, want_grads = _run(layer, *_leaves(x, edge_attr)[:1], edge_index, _leaves(x, edge_attr)[1], grad)
    got, got_grads = _run(fast, *_leaves(x, edge_attr)[:1], edge_index.int(), _leaves(x, edge_attr)[1], grad)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_pending_index_check_is_settled_by_a_mode_switch(reference_backend):
    """On a GPU a call's index check waits for the layer's next call; model.eval() / .train()
    settle it too, so a bad index in an epoch's last call is reported at the switch. (The CPU
    settles at once: here a pending bad check is set by hand, as a GPU call leaves it.)"""
    model = torch.nn.Sequential(LAYERS["transformer"]())
    fast = fastopt.optimize(model)
    x, edge_index, edge_attr = _graph()
    fast[0](x, edge_index, edge_attr)
    ranges = fast[0].__dict__["_fastopt_core"].ranges
    ranges.stats.copy_(torch.tensor([0, NODES + 5, 0, 3]))
    ranges.rows = NODES
    with pytest.raises(fastopt.FastOptError, match=rf"edge_index\[0\] held {NODES + 5}, outside"):
        fast.eval()
    fast.eval()  # settled once: nothing pending
    fast[0](x, edge_index, edge_attr)
