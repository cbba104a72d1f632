"""Attention over an edge list (``edge_attention``, ``edge_softmax_aggregate``): the generated
kernels over destination-sorted edges against the segment reference, on graphs with nodes
without incoming edges, multi-edges and self-loops."""

from __future__ import annotations

import pytest
import torch

import fastopt.codegen as cg
from fastopt.codegen.families import edge_attention as family
from fastopt.errors import KernelError


def _graph(nodes=9, edges=40, seed=0):
    """Edges into nodes 0 .. nodes-3 only (the last two have none), with repeats and self-loops."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, nodes, (edges,), generator=g)
    dst = torch.randint(0, nodes - 2, (edges,), generator=g)
    src[:3], dst[:3] = 4, 4          # self-loops
    src[3:6], dst[3:6] = 1, 2        # a repeated edge
    return src, dst, g


def _leaf(t, device):
    return t.to(device).requires_grad_()


def test_edge_slots_sort_edges_by_destination_keeping_their_order():
    dst = torch.tensor([2, 0, 2, 2, 0])
    indptr, slots = family.edge_slots(dst, 4)
    assert indptr.tolist() == [0, 2, 2, 5, 5]
    assert slots.tolist() == [[1, 4, 0], [0, 0, 0], [0, 2, 3], [0, 0, 0]]


@pytest.mark.parametrize("indexed", [True, False], ids=["table", "per-edge"])
@pytest.mark.parametrize("heads,dim", [(1, 4), (2, 7)])
def test_edge_attention_matches_the_segment_reference(device, triton_backend, indexed, heads, dim):
    src, dst, g = _graph()
    nodes, edges = 9, src.numel()
    q = _leaf(torch.randn(nodes, heads, dim, generator=g, dtype=torch.float64), device)
    rows = nodes if indexed else edges
    k = _leaf(torch.randn(rows, heads, dim, generator=g, dtype=torch.float64), device)
    v = _leaf(torch.randn(rows, heads, dim, generator=g, dtype=torch.float64), device)
    index = dict(k_index=src.to(device), v_index=src.to(device)) if indexed else {}
    out = cg.edge_attention(q, k, v, dst.to(device), **index)
    ref = cg.reference.edge_attention(q, k, v, dst.to(device), **index)
    torch.testing.assert_close(out, ref)
    assert out[-2:].abs().max() == 0  # no incoming edge: zeros
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64).to(device)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b)


def test_edge_softmax_aggregate_matches_the_segment_softmax(device, triton_backend):
    src, dst, g = _graph(seed=1)
    nodes, heads, dim = 9, 3, 5
    scores = _leaf(torch.randn(src.numel(), heads, generator=g, dtype=torch.float64), device)
    v = _leaf(torch.randn(nodes, heads, dim, generator=g, dtype=torch.float64), device)
    out = cg.edge_softmax_aggregate(scores, v, dst.to(device), nodes, v_index=src.to(device))
    index = dst.to(device)
    p = torch.exp(scores - scores.max())
    total = p.new_zeros(nodes, heads).index_add(0, index, p)
    ref = torch.zeros(nodes, heads, dim, dtype=torch.float64, device=device).index_add(
        0, index, (p / total[index])[..., None] * v[src.to(device)])
    torch.testing.assert_close(out, ref)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64).to(device)
    for a, b in zip(torch.autograd.grad(out, (scores, v), grad),
                    torch.autograd.grad(ref, (scores, v), grad)):
        torch.testing.assert_close(a, b)


def test_a_hub_runs_the_segment_path_with_the_same_result(monkeypatch, reference_backend_cpu):
    """One node with all edges would pad every other row to its degree: the segment path runs."""
    nodes, heads, dim = 50, 2, 4
    dst = torch.zeros(200, dtype=torch.long)
    src = torch.randint(0, nodes, (200,))
    q, k, v = (torch.randn(nodes, heads, dim, dtype=torch.float64) for _ in range(3))
    called = []
    real = family.reference_edge_attention
    monkeypatch.setattr(family, "reference_edge_attention",
                        lambda *a, **kw: called.append(1) or real(*a, **kw))
    out = cg.edge_attention(q, k, v, dst, k_index=src, v_index=src)
    assert called
    monkeypatch.setattr(family, "PADDING_LIMIT", 10**6)
    padded = cg.edge_attention(q, k, v, dst, k_index=src, v_index=src)
    assert len(called) == 1
    torch.testing.assert_close(out, padded)


@pytest.fixture
def reference_backend_cpu():
    import fastopt.config as fconfig

    with fconfig.patch(kernels__backend="reference"):
        yield


@pytest.mark.parametrize("bad, match", [
    (dict(dst=torch.tensor([0, 9])), r"dst holds 9, outside \[0, 3\); q needs one row per"),
    (dict(k_index=torch.tensor([0, 3])), r"k_index holds 3, outside \[0, 3\); the table has 3 rows"),
    (dict(dst=torch.tensor([0.0, 1.0])), r"dst has dtype torch.float32"),
    (dict(k=torch.randn(3, 1, 2)), r"k has 3 rows but there are 2 edges"),
    (dict(k_index=torch.tensor([0])), r"k_index has 1 entries but there are 2 edges"),
])
def test_bad_arguments_name_the_value_and_the_fix(bad, match, reference_backend_cpu):
    args = dict(q=torch.randn(3, 1, 2), k=torch.randn(2, 1, 2), v=torch.randn(2, 1, 2),
                dst=torch.tensor([0, 1]))
    index = {"k_index": bad.pop("k_index")} if "k_index" in bad else {}
    if index:
        args["k"] = torch.randn(3, 1, 2)
    args.update(bad)
    with pytest.raises(KernelError, match=match):
        cg.edge_attention(args["q"], args["k"], args["v"], args["dst"], **index)


def test_edges_without_destinations_are_refused():
    with pytest.raises(KernelError, match=r"there are 2 edges but no destination"):
        cg.edge_attention(torch.randn(0, 1, 2), torch.randn(2, 1, 2), torch.randn(2, 1, 2),
                          torch.tensor([0, 0]))


def test_values_known_skips_the_value_checks_inside_only():
    from fastopt.codegen import checks

    assert checks.values_checked()
    with checks.values_known():
        assert not checks.values_checked()
    assert checks.values_checked()


def test_edge_softmax_aggregate_checks_its_arguments():
    with pytest.raises(KernelError, match=r"num_dst must be an int >= 0 \(got -1\)"):
        cg.edge_softmax_aggregate(torch.randn(2, 1), torch.randn(2, 1, 3), torch.tensor([0, 0]), -1)
    with pytest.raises(KernelError, match=r"scores have 1 heads"):
        cg.edge_softmax_aggregate(torch.randn(2, 1), torch.randn(2, 2, 3), torch.tensor([0, 0]), 1)


@pytest.mark.parametrize("layer", ["transformer-edge-beta", "transformer", "gat-edge", "gatv2"])
def test_pyg_layers_run_on_the_kernels(device, triton_backend, layer):
    """The PyG layer rewrites through the generated kernels (keys and values read a row stride
    apart from one gathered block): outputs and gradients as the layer's own code."""
    nn = pytest.importorskip("torch_geometric.nn")
    import copy

    import fastopt

    torch.manual_seed(0)
    make = {"transformer-edge-beta": lambda: nn.TransformerConv(16, 6, heads=2, edge_dim=8,
                                                                beta=True),
            "transformer": lambda: nn.TransformerConv(16, 5, heads=3),
            "gat-edge": lambda: nn.GATConv(16, 6, heads=2, edge_dim=8),
            "gatv2": lambda: nn.GATv2Conv(16, 4, heads=2, concat=False)}[layer]
    conv = make().to(device).eval()
    fast = fastopt.optimize(copy.deepcopy(conv))
    src, dst, g = _graph(nodes=12, edges=40)
    edge_index = torch.stack([src, dst]).to(device)
    x = torch.randn(12, 16, generator=g).to(device)
    has_edges = getattr(conv, "lin_edge", None) is not None
    extra = (torch.randn(40, 8, generator=g).to(device),) if has_edges else ()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = conv(xa, edge_index, *extra)
    got = fast(xb, edge_index, *extra)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(torch.autograd.grad(got.sum(), [xb, *fast.parameters()]),
                    torch.autograd.grad(want.sum(), [xa, *conv.parameters()])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_slots_are_the_largest_degree_rounded_to_a_power_of_two(monkeypatch):
    """Kernels specialize per slot count: degrees 5 and 7 share the 8-slot kernel."""
    seen = []
    real = family.temporal_attention
    monkeypatch.setattr(family, "temporal_attention",
                        lambda q, k, v, **kw: seen.append(kw["k_index"].shape[1]) or real(q, k, v, **kw))
    for degree in (5, 7, 1):
        dst = torch.zeros(degree, dtype=torch.long)
        q, k, v = torch.randn(3, 1, 2), torch.randn(degree, 1, 2), torch.randn(degree, 1, 2)
        cg.edge_attention(q, k, v, dst)
    assert seen == [8, 8, 1]


def test_slot_count_and_slots_are_checked():
    dst = torch.tensor([2, 0, 2, 2, 0])
    assert cg.edge_slot_count(dst, 4) == 4  # largest in-degree 3, rounded up to a power of two
    with pytest.raises(KernelError, match=r"num_dst must be an int >= 0 \(got -1\)"):
        cg.edge_slot_count(dst, -1)
    with pytest.raises(KernelError, match=r"dst holds 2, outside \[0, 2\)"):
        cg.edge_slot_count(dst, 2)
    q, k = torch.randn(4, 1, 3), torch.randn(5, 1, 3)
    with pytest.raises(KernelError, match=r"slots must be a power of two >= 1 \(got 3\)"):
        cg.edge_attention(q, k, k, dst, slots=3)


@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("nodes, edges, dtype", [(9, 40, torch.int64), (300, 5000, torch.int32),
                                                 (1, 3, torch.int64)])
def test_degree_stats_kernel_equals_its_reference(nodes, edges, dtype, device):
    """One pass over the edges (atomics across several programs): the largest in-degree and both
    indices' ranges as the torch reference counts them, with and without a second index."""
    from fastopt.codegen.families.degree_stats import degree_stats, reference

    src, dst, _ = _graph(max(nodes, 3), edges, seed=nodes)
    dst = dst.clamp(max=nodes - 1).to(dtype)
    src = (src - 2).to(dtype)  # some negative
    wild = dst.clone()
    wild[::7], wild[1::9] = nodes + 3, -5  # out of range both ways: not counted, but reported
    want = reference(wild, nodes)
    assert want.tolist()[1:3] == [nodes + 3, 5]
    assert degree_stats(wild.to(device), nodes).tolist() == want.tolist()
    for index in (None, src):
        want = reference(dst, nodes, index)
        got = degree_stats(dst.to(device), nodes, None if index is None else index.to(device))
        assert got.tolist() == want.tolist()
    counts = torch.bincount(dst.long(), minlength=nodes)
    assert want.tolist()[:3] == [int(counts.max()), int(dst.max()), 0]
    assert want.tolist()[3:] == [max(0, int(src.max())), max(0, -int(src.min()))]


@pytest.mark.usefixtures("triton_backend")
def test_slot_count_reads_degrees_and_ranges_in_one_pass(device):
    """The slot count and the range errors of ``edge_slot_count`` from the one-pass kernel: the
    bad value named (a negative source, a destination past the rows)."""
    dst = torch.tensor([2, 0, 2, 2, 0], device=device)
    src = torch.tensor([1, 3, 0, 0, 2], device=device)
    assert cg.edge_slot_count(dst, 4, [("edge_index[0]", src, 4)]) == 4
    with pytest.raises(KernelError, match=r"edge_index\[0\] holds -4, outside \[0, 4\)"):
        cg.edge_slot_count(dst, 4, [("edge_index[0]", src - 4, 4)])
    with pytest.raises(KernelError, match=r"dst holds 2, outside \[0, 2\)"):
        cg.edge_slot_count(dst, 2, [("edge_index[0]", src, 4)])
    # edge lists of other strides (a transposed [E, 2] stack): the kernel reads them packed
    strided = torch.stack([src, dst], dim=1).t()
    assert strided[1].stride() == (2,)
    assert cg.edge_slot_count(strided[1], 4, [("edge_index[0]", strided[0], 4)]) == 4
    with pytest.raises(KernelError, match=r"edge_index\[0\] holds 9, outside \[0, 4\)"):
        bad = torch.stack([src.clone().index_fill_(0, torch.tensor([3], device=device), 9), dst], 1).t()
        cg.edge_slot_count(bad[1], 4, [("edge_index[0]", bad[0], 4)])
    # a second index (and one of another length) joins the same read
    with pytest.raises(KernelError, match=r"b holds 11, outside \[0, 4\)"):
        cg.edge_slot_count(dst, 4, [("a", src, 4), ("b", src[:2] + 8, 4)])
    assert cg.edge_slot_count(dst, 4, [("a", src, 4), ("b", src[:2], 4)]) == 4
    with pytest.raises(KernelError, match=r"a must be a 1-d int32/int64 index"):
        cg.edge_slot_count(dst, 4, [("a", src.float(), 4)])
    many = torch.zeros(3000, dtype=torch.long, device=device)  # one destination, many programs
    assert cg.edge_slot_count(many, 1) == 4096  # in-degree 3000 counted across three programs


@pytest.mark.parametrize("heads,dim", [(1, 4), (2, 7)])
def test_edges_form_matches_the_segment_reference(device, triton_backend, heads, dim):
    """``slots="edges"``: each destination loops over its sorted edges (no slot count read);
    keys and values per edge, read in place as the two column blocks of one tensor; edges into
    destination N (one past the last) are padding, left out with zero gradients; a skewed
    row (a hub of 30 edges beside rows of 1) and rows without an edge."""
    src, dst, g = _graph()
    nodes = 9
    dst = torch.cat([dst, torch.full((30,), 3), torch.full((5,), nodes)])  # a hub, then padding
    edges = dst.numel()
    q = _leaf(torch.randn(nodes, heads, dim, generator=g, dtype=torch.float64), device)
    kv = _leaf(torch.randn(edges, 2, heads, dim, generator=g, dtype=torch.float64), device)
    out = cg.edge_attention(q, kv[:, 0], kv[:, 1], dst.to(device), slots="edges")
    real = dst < nodes
    ref = cg.reference.edge_attention(q, kv[:, 0][real.to(device)], kv[:, 1][real.to(device)],
                                      dst[real].to(device))
    torch.testing.assert_close(out, ref)
    assert out[-2:].abs().max() == 0
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64).to(device)
    got, want = torch.autograd.grad(out, (q, kv), grad), torch.autograd.grad(ref, (q, kv), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert got[1][~real.to(device)].abs().max() == 0  # padding edges: zero gradients


def test_edges_form_refuses_table_indices_and_dropout():
    q, kv = torch.randn(3, 1, 4), torch.randn(5, 1, 4)
    dst = torch.tensor([0, 1, 1, 2, 0])
    with pytest.raises(KernelError, match="slots='edges' takes keys and values one per edge"):
        cg.edge_attention(q, kv, kv, dst, k_index=dst, slots="edges")
    with pytest.raises(KernelError, match="dropout_p=0.5"):
        cg.edge_attention(q, kv, kv, dst, dropout_p=0.5, slots="edges")


def test_edges_form_checks_dtypes():
    from fastopt.codegen.families.temporal_attention import sorted_edge_attention

    q, kv = torch.randn(3, 1, 4), torch.randn(5, 1, 4)
    indptr, perm = torch.tensor([0, 2, 4, 5]), torch.arange(5)
    with pytest.raises(KernelError, match="k has dtype torch.float16"):
        sorted_edge_attention(q, kv.half(), kv, indptr, perm)
    with pytest.raises(KernelError, match="perm has dtype torch.float32"):
        sorted_edge_attention(q, kv, kv, indptr, perm.float())
