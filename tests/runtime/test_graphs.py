"""CUDA graphs of optimized models (fastopt.runtime.graphs, capture, flatten): flattening,
signatures, the LRU, fallbacks, and on a GPU the captured forward/backward against eager."""

from __future__ import annotations

import contextlib
import copy
import gc
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import fastopt
from fastopt.config import patch
from fastopt.errors import ConfigError, KernelError, TraceError
from fastopt.models import TGAT, TGN, GraphInputs
from fastopt.models.layers import TemporalAttention
from fastopt.runtime import capture, graphs
from fastopt.runtime.capture import Uncapturable
from fastopt.runtime.flatten import flatten, unflatten
from fastopt.runtime.graphs import call_signature
from fastopt.runtime.padding import RowPad

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

Pair = namedtuple("Pair", "a b")


@dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    tag: str


def _graph_inputs(device="cpu", roots=6, fanouts=(3,), edge_dim=4, seed=0) -> GraphInputs:
    g = torch.Generator().manual_seed(seed)
    nodes, times = [torch.randint(0, 20, (roots,), generator=g)], [torch.rand(roots, generator=g)]
    edge_feat, dt, mask = [], [], []
    for k in fanouts:
        n = nodes[-1].numel()
        nodes.append(torch.randint(0, 20, (n * k,), generator=g))
        times.append(torch.rand(n * k, generator=g))
        edge_feat.append(torch.randn(n, k, edge_dim, generator=g))
        dt.append(torch.rand(n, k, generator=g) * 100)
        mask.append(torch.rand(n, k, generator=g) < 0.8)
    node_feat = [torch.zeros(x.numel(), 0) for x in nodes]
    to = lambda xs: [x.to(device) for x in xs]  # noqa: E731
    return GraphInputs(to(nodes), to(times), to(node_feat), to(edge_feat), to(dt), to(mask))


# ----------------------------------------------------------------------------------------------
# flattening and signatures (CPU)
# ----------------------------------------------------------------------------------------------


def test_flatten_round_trips_nested_arguments():
    t = [torch.randn(2) for _ in range(6)]
    obj = ((t[0], [t[1], {"k": t[2], "n": 3}], Pair(t[3], None)),
           {"inputs": Frozen(t[4], "x"), "scale": 0.5, "more": (t[5],)})
    tensors, spec = flatten(obj)
    assert len(tensors) == 6 and all(a is b for a, b in zip(tensors, t))
    hash(spec)
    back = unflatten(spec, tensors)
    assert back[0][1][1]["n"] == 3 and back[1]["scale"] == 0.5 and back[0][2].b is None
    assert isinstance(back[0][2], Pair) and isinstance(back[1]["inputs"], Frozen)
    assert back[1]["inputs"].x is t[4] and back[1]["inputs"].tag == "x"
    assert back[0][1][0] is t[1] and isinstance(back[0][1], list)
    with pytest.raises(TraceError, match="more tensors"):
        unflatten(spec, t + [torch.zeros(1)])
    with pytest.raises(TraceError, match="ran out"):
        unflatten(spec, t[:5])


def test_flatten_descends_into_graph_inputs():
    inputs = _graph_inputs()
    tensors, spec = flatten(((inputs,), {}))
    assert len(tensors) == 2 + 2 + 2 + 1 + 1 + 1
    rebuilt = unflatten(spec, [x + 0 for x in tensors])[0][0]
    assert isinstance(rebuilt, GraphInputs)
    assert torch.equal(rebuilt.edge_feat[0], inputs.edge_feat[0])
    assert rebuilt.edge_feat[0] is not inputs.edge_feat[0]


def test_signature_changes_with_everything_a_graph_depends_on():
    layer = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.1))
    x = torch.randn(4, 3)

    def key(args, module=layer):
        tensors, spec = flatten((args, {}))
        return call_signature(module, spec, tensors)

    base = key((x, 1))
    assert key((torch.randn(4, 3), 1)) == base  # values are not part of it
    assert key((torch.randn(5, 3), 1)) != base  # shape
    assert key((x.double(), 1)) != base  # dtype
    assert key((x.clone().requires_grad_(), 1)) != base  # requires_grad
    assert key((x, 2)) != base  # constants
    assert key(([x], 1)) != base  # structure
    layer[1].eval()  # one submodule's training flag
    assert key((x, 1)) != base
    layer[1].train()
    with torch.no_grad():
        assert key((x, 1)) != base
    with patch(passes__fuse_dropout=False):
        assert key((x, 1)) != base
    assert key((x, 1)) == base
    with pytest.raises(Uncapturable, match="not hashable"):
        key((x, [1, {3}]))  # a set is a constant, and sets are not hashable


def test_config_knobs_are_checked():
    with pytest.raises(ConfigError, match="passes.cuda_graphs"):
        fastopt.Config().set("passes.cuda_graphs", "always")
    with pytest.raises(ConfigError, match="passes.max_graphs"):
        fastopt.Config().set("passes.max_graphs", 0)
    cfg = fastopt.Config()
    cfg.set("passes.cuda_graphs", "off")
    assert '"cuda_graphs": "off"' in cfg.to_json()


# ----------------------------------------------------------------------------------------------
# the runner on the CPU: a no-op that says why; its logic with a fake capture
# ----------------------------------------------------------------------------------------------


def test_report_lists_graph_candidates_and_cpu_calls_pass_through():
    torch.manual_seed(0)
    model = TGAT(0, 4, dim=8, time_dim=6, fanouts=(3,), dropout=0.0)
    fast = fastopt.optimize(model)
    report = fast.fastopt_report
    assert [g.where for g in report.graphs] == ["<root>", "layers.0"]
    assert all(g.state == "waiting for a CUDA call" for g in report.graphs)
    assert sorted(fast.state_dict()) == sorted(model.state_dict())
    inputs = _graph_inputs()
    with patch(passes__cuda_graphs="on"):
        out = fast(inputs)
    assert report.graphs[0].state == "not captured" and "cpu" in report.graphs[0].reason
    assert "CUDA graphs capture CUDA work only" in report.graphs[0].reason
    # a CPU-only machine has nothing to capture: the report leaves the section out
    assert ("cuda graphs:" in str(report)) == torch.cuda.is_available()
    assert report.captured_modules() == []
    with patch(passes__cuda_graphs="off"):
        plain = fast(inputs)
    torch.testing.assert_close(out, plain)
    assert report.graphs[0].state == "off"
    clone = copy.deepcopy(fast)  # graphs are not copied; the copy starts without any
    torch.testing.assert_close(clone(inputs), out)


class _FakeGraphs:
    """Stands in for a captured pair: counts replays, runs the plain forward."""

    captured = []

    def __init__(self, module, plain, spec, tensors):
        self.plain, self.spec, self.replays, self.busy = plain, spec, 0, False
        _FakeGraphs.captured.append(tuple(t.shape for t in tensors))

    @classmethod
    def capture(cls, module, plain, spec, tensors):
        return cls(module, plain, spec, tensors)

    def pending(self):
        return self.busy

    def run(self, tensors, pads=None, out_rows=None):
        self.replays += 1
        if pads is not None:  # what the real pair's static inputs hold: rows, then padding
            tensors = [graphs._padded(t, p) for t, p in zip(tensors, pads)]
        args, kwargs = unflatten(self.spec, tensors)
        out = self.plain(*args, **kwargs)
        return out if out_rows is None else out[:out_rows]


@pytest.fixture
def fake_capture(monkeypatch):
    _FakeGraphs.captured = []
    monkeypatch.setattr(graphs, "_where_tensors_are", lambda tensors: None)
    monkeypatch.setattr(graphs, "GraphPair", _FakeGraphs)
    return _FakeGraphs


def _layer():
    torch.manual_seed(0)
    return fastopt.optimize(TemporalAttention(8, 4, 6, 8, dropout=0.0))


def _layer_args(m):
    return (torch.randn(m, 8), torch.randn(m, 3, 8), torch.randn(m, 3, 4), torch.rand(m, 3),
            torch.rand(m, 3) < 0.7)


def test_auto_captures_on_the_second_call_and_on_on_the_first(fake_capture):
    fast = _layer()
    runner = fast._fastopt_graph_runner
    fast(*_layer_args(4))
    assert fake_capture.captured == []  # auto: a signature seen once runs uncaptured
    fast(*_layer_args(4))
    fast(*_layer_args(4))
    assert len(fake_capture.captured) == 1 and runner.held == 1
    assert fast.fastopt_report.graphs[0].state == "captured"
    assert next(iter(runner._graphs.values())).replays == 2
    with patch(passes__cuda_graphs="on"):
        fast(*_layer_args(5))
    assert len(fake_capture.captured) == 2
    with patch(passes__cuda_graphs="off"):
        fast(*_layer_args(6))
    assert len(fake_capture.captured) == 2 and fast.fastopt_report.graphs[0].state == "off"


def test_graph_pairs_are_lru_bounded(fake_capture):
    fast = _layer()
    runner, record = fast._fastopt_graph_runner, fast.fastopt_report.graphs[0]
    with patch(passes__cuda_graphs="on", passes__max_graphs=2):
        for m in (2, 3, 2, 4):  # 2 is used again before 4 arrives: 3 is the one evicted
            fast(*_layer_args(m))
        assert runner.held == 2 and record.evictions == 1 and record.graphs == 2
        assert [k[1][0][0][0] for k in runner._graphs] == [2, 4]
        fast(*_layer_args(3))
    assert len(fake_capture.captured) == 4  # 3 was captured again


def test_moved_parameters_drop_every_graph(fake_capture):
    fast = _layer()
    runner = fast._fastopt_graph_runner
    with patch(passes__cuda_graphs="on"):
        fast(*_layer_args(2))
        assert runner.held == 1
        fast.w_q.weight.data = fast.w_q.weight.data.clone()  # what .to() does to every parameter
        fast(*_layer_args(2))
    assert runner.held == 1 and len(fake_capture.captured) == 2


def test_a_replay_waiting_for_its_backward_makes_the_next_call_run_uncaptured(fake_capture):
    fast = _layer()
    with patch(passes__cuda_graphs="on"):
        fast(*_layer_args(2))
        pair = next(iter(fast._fastopt_graph_runner._graphs.values()))
        pair.busy = True
        fast(*_layer_args(2))
    assert pair.replays == 1


def test_a_failed_capture_falls_back_and_is_reported(monkeypatch):
    monkeypatch.setattr(graphs, "_where_tensors_are", lambda tensors: None)

    def refuse(*args):
        raise RuntimeError("operation not permitted when stream is capturing\nmore text")

    monkeypatch.setattr(graphs.GraphPair, "capture", classmethod(lambda cls, *a: refuse()))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    fast = _layer()
    args = _layer_args(3)
    with patch(passes__cuda_graphs="on"):
        out = fast(*args)
        again = fast(*args)
    torch.testing.assert_close(out, again)
    record = fast.fastopt_report.graphs[0]
    assert record.state == "not captured"
    assert record.reason == "capture failed: RuntimeError: operation not permitted when stream is capturing"
    assert fast._fastopt_graph_runner._off is not None


def test_attribute_writes_are_detected():
    class Writer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.last = None

        def forward(self, x):
            self.last = x
            return self.lin(x)

    w = Writer()
    before = capture._snapshot(w)
    assert capture._attribute_writes(before) == []
    x = torch.randn(1, 2)
    w(x)
    assert capture._attribute_writes(before) == [(w, "last", x)]


def test_tensor_attribute_writes_are_redone_and_others_refuse_capture():
    class Keeper(nn.Module):
        def __init__(self):
            super().__init__()
            self.kept = None
            self.register_buffer("buf", torch.zeros(2))

    k = Keeper()
    cpu = torch.device("cpu")
    x = torch.randn(3)
    y = x * 2
    writes, refused = capture.replayable_writes([(k, "kept", (x, [y, None]))], cpu)
    assert refused is None
    ((module, key, value),) = writes
    assert module is k and key == "kept"
    a, (b, c) = value
    assert c is None and a.data_ptr() == x.data_ptr() and b.data_ptr() == y.data_ptr()
    loss = (torch.randn(3, requires_grad=True) ** 2).sum()  # an auxiliary loss kept on the module
    for change, name in [((k, "kept", 3), "Keeper.kept"),
                         ((k, "kept", (x, loss)), "Keeper.kept"),
                         ((k, "kept", {"a": x}), "Keeper.kept"),
                         ((k, "_buffers.buf", torch.ones(2)), "Keeper.buf"),
                         ((k, "kept", capture._Backward), "Keeper.kept")]:
        assert capture.replayable_writes([change], cpu) == ([], name)
    meta = torch.empty(2, device="meta")
    assert capture.replayable_writes([(k, "kept", meta)], cpu) == ([], "Keeper.kept")


def test_a_forward_reading_its_own_earlier_write_fails_during_capture():
    """The stand-in for a warm-up's write is no tensor: recurrent state read back fails the capture."""
    state = capture._WrittenByForward()
    with pytest.raises(TypeError):
        state + torch.ones(2)
    with pytest.raises(TypeError):
        torch.cat([state, torch.ones(2)])


def _row_sums(x, index):
    """A row-wise function of padded rows (padding rows give padding outputs)."""
    return x * 2 + index.unsqueeze(-1)


def test_padded_calls_share_one_graph_and_are_trimmed(fake_capture):
    """With ``pads`` a call is keyed and captured on its padded shapes, so calls of different
    row counts padded alike share one graph pair; outputs are trimmed to ``out_rows`` and equal
    the unpadded call; calls that run uncaptured pad and trim the same way."""
    runner = graphs.GraphRunner(graphs.GraphCapture("layer"))
    module = nn.Identity()
    pads = (RowPad(8), RowPad(8, 3))
    with patch(passes__cuda_graphs="on"):
        for rows in (5, 7, 6):
            x, index = torch.randn(rows, 4), torch.arange(rows)
            out = runner(module, _row_sums, (x, index), {}, pads=pads, out_rows=rows)
            torch.testing.assert_close(out, _row_sums(x, index))
    assert fake_capture.captured == [((8, 4), (8,))] and runner.held == 1
    assert next(iter(runner._graphs.values())).replays == 3
    x, index = torch.randn(3, 4), torch.arange(3)
    with patch(passes__cuda_graphs="off"):  # uncaptured: padded around the plain call, trimmed
        torch.testing.assert_close(runner(module, _row_sums, (x, index), {}, pads=pads, out_rows=3),
                                   _row_sums(x, index))
    with pytest.raises(ValueError, match="cannot be padded to 8 rows"):
        runner(module, _row_sums, (torch.randn(9, 4), torch.arange(9)), {}, pads=pads)
    with pytest.raises(KernelError, match="RowPad was given for a int argument.*None for argument 1"):
        runner(module, lambda a, n: a, (x, 3), {}, pads=(None, RowPad(8)))


def test_a_runner_joins_rows_still_being_read_before_it_keys_or_copies_them(fake_capture):
    """Inputs whose edge rows another stream still reads (``edges_pending``, ``cache.read_overlap``)
    are joined before the runner keys the call or copies its tensors in: a fresh join per call
    neither changes the key (one graph pair for all calls) nor is left for after the copy."""
    runner, log = graphs.GraphRunner(graphs.GraphCapture("model")), []

    def plain(inputs):
        log.append("read")
        return inputs.edge_feat[0].sum(1)

    with patch(passes__cuda_graphs="on"):
        for seed in range(3):
            inputs = _graph_inputs(seed=seed)
            inputs.edges_pending = lambda: log.append("joined")
            torch.testing.assert_close(runner(nn.Identity(), plain, (inputs,), {}), inputs.edge_feat[0].sum(1))
            assert inputs.edges_pending is None
    assert log == ["joined", "read"] * 3 and len(fake_capture.captured) == 1 and runner.held == 1


def test_padded_copies_write_rows_then_padding_in_one_list_per_kind():
    """A padded replay's input copy: each call's rows, then the pad value over the rows a larger
    earlier call left (stale rows overwritten; rows already holding the padding not written
    again), one copy list per dtype."""
    static = [torch.full((6, 2), 9.0), torch.full((6,), 9, dtype=torch.int64), torch.zeros(3)]
    groups, filled = capture._copy_groups(static), [6, 6, 3]
    pads = [RowPad(6), RowPad(6, 5), None]
    copies = []
    real = torch._foreach_copy_

    def counted(into, read):
        copies.append([tuple(t.shape) for t in into])
        real(into, read)

    fresh = [torch.ones(4, 2), torch.arange(2), torch.randn(3)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "_foreach_copy_", counted)
        capture._copy_padded(static, fresh, pads, groups, filled)
        assert torch.equal(static[0], torch.cat([torch.ones(4, 2), torch.zeros(2, 2)]))
        assert static[1].tolist() == [0, 1, 5, 5, 5, 5] and torch.equal(static[2], fresh[2])
        assert filled == [4, 2, 3]
        static[0][5] = 7.0  # a write the pair never makes: shows which rows a call rewrites
        capture._copy_padded(static, [2 * torch.ones(5, 2), torch.arange(1), fresh[2]], pads,
                             groups, filled)
    assert torch.equal(static[0][:5], 2 * torch.ones(5, 2)) and static[0][5].tolist() == [7.0, 7.0]
    assert static[1].tolist() == [0, 5, 5, 5, 5, 5] and filled == [5, 1, 3]
    # first call: rows and padding to the end; second: x's 5 rows alone, the index's row and
    # the one row it left
    assert copies == [[(4, 2), (2, 2), (3,)], [(2,), (4,)], [(5, 2), (3,)], [(1,), (1,)]]


def test_pads_go_by_position_and_key_the_pad_value(fake_capture):
    """A tensor passed twice is padded only where its pad is given, on replay as uncaptured; the
    pad value and whether a tensor is padded at all are part of the graph's key (a buffer's rows
    that hold padding are only rewritten when they stopped holding it, so one pair must never
    see two paddings); two 0-row calls in a row copy nothing and do not fail."""
    runner = graphs.GraphRunner(graphs.GraphCapture("layer"))
    module, x = nn.Identity(), torch.randn(5, 3)

    def plain(a, b):
        return a[:5] + b.mean(0)

    with patch(passes__cuda_graphs="on"):
        replayed = runner(module, plain, (x, x), {}, pads=(RowPad(8), None), out_rows=5)
    torch.testing.assert_close(replayed, x + x.mean(0))
    assert fake_capture.captured == [((8, 3), (5, 3))]
    tensors, spec = flatten(((x, 2, x), {}))
    key = lambda *pads: call_signature(module, spec, tensors, None, list(pads))  # noqa: E731
    assert key(RowPad(8), None, None) != key(RowPad(8, 1), None, None)
    assert key(RowPad(8), None, None) == key(RowPad(8), None, None)
    unpadded, same_spec = flatten(((torch.randn(8, 3), 2, x), {}))  # the padded shape, unpadded
    assert same_spec == spec and call_signature(module, spec, unpadded) != key(RowPad(8), None, None)
    static = [torch.zeros(8, 4)]
    groups, filled = capture._copy_groups(static), [8]
    for _ in range(2):
        capture._copy_padded(static, [torch.zeros(0, 4)], [RowPad(8)], groups, filled)
    assert filled == [0]


def test_runner_passes_through_while_verify_calls_are_pending(fake_capture):
    torch.manual_seed(0)
    fast = fastopt.optimize(TemporalAttention(8, 4, 6, 8, dropout=0.0), verify=True)
    with patch(passes__cuda_graphs="on"):
        fast(*_layer_args(2))
        fast(*_layer_args(2))
        assert fake_capture.captured == []
        fast(*_layer_args(2))
    assert len(fake_capture.captured) == 1


# ----------------------------------------------------------------------------------------------
# on a GPU: captured vs eager
# ----------------------------------------------------------------------------------------------


def _cuda_models(name, dropout=0.0):
    torch.manual_seed(0)
    if name == "tgat":
        model = TGAT(0, 12, dim=16, time_dim=8, fanouts=(4, 3), dropout=dropout)
    else:
        model = TGN(50, 0, 12, memory_dim=16, dim=16, time_dim=8, fanouts=(4,), dropout=dropout)
    model = model.cuda().train()
    mem = getattr(model, "memory", None)
    if mem is not None:
        g = torch.Generator().manual_seed(1)
        mem.memory.copy_(torch.randn(mem.memory.shape, generator=g))
        mem.mails.copy_(torch.randn(mem.mails.shape, generator=g))
        mem.mail_count.fill_(1)
        mem.pending.fill_(True)
    return model


def _grads(model, out, seed):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
    model.zero_grad(set_to_none=True)
    out.backward(g)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["tgat", "tgn"])
@pytest.mark.gpu
@needs_cuda
def test_captured_outputs_and_gradients_equal_eager(name):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _cuda_models(name)
    fast = fastopt.optimize(model, config={"passes": {"cuda_graphs": "on"}})
    fanouts = tuple(model.fanouts)
    for step in range(4):  # capture, then replays with new values
        inputs = _graph_inputs("cuda", roots=8, fanouts=fanouts, edge_dim=12, seed=step)
        expected = model(inputs)
        want = _grads(model, expected, step)
        got_out = fast(inputs)
        got = _grads(fast, got_out, step)
        torch.testing.assert_close(got_out, expected, rtol=1e-4, atol=1e-5)
        if name == "tgn":  # the updated memory kept for commit() holds this replay's values
            # (updated rows, their index): these inputs carry no unique nodes, so one row per root
            torch.testing.assert_close(fast._fresh[0], model._fresh[0], rtol=1e-4, atol=1e-5)
            assert fast._fresh[1] is None and model._fresh[1] is None
        assert want.keys() == got.keys()
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-5, msg=n)
    assert fast.fastopt_report.captured_modules() == ["<root>"]


@pytest.mark.gpu
@needs_cuda
def test_input_gradients_and_accumulation_match_eager():
    torch.manual_seed(0)
    layer = TemporalAttention(8, 4, 6, 8, dropout=0.0).cuda()
    fast = fastopt.optimize(layer, config={"passes": {"cuda_graphs": "on"}})
    args = [a.cuda() for a in _layer_args(5)]
    args[0].requires_grad_()
    for module in (layer, fast):
        module.zero_grad(set_to_none=True)
        outs = []
        for _ in range(2):  # two backward passes accumulate into .grad
            out = module(*args)
            out.sum().backward()
            outs.append(out)
        if module is layer:
            want = ({n: p.grad.clone() for n, p in layer.named_parameters()},
                    args[0].grad.clone())
        else:
            got = ({n: p.grad.clone() for n, p in fast.named_parameters()}, args[0].grad.clone())
        args[0].grad = None
    for n in want[0]:
        torch.testing.assert_close(got[0][n], want[0][n], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    assert fast.fastopt_report.captured_modules() == ["<root>"]


@pytest.mark.gpu
@needs_cuda
def test_padded_replays_of_changing_sizes_equal_eager():
    """One graph pair serves calls of 9 to 16 rows padded to 16: outputs, input gradients and
    parameter gradients (the bias sums over rows: a stale padding row would show) equal eager."""
    torch.manual_seed(0)
    layer = nn.Linear(5, 3).cuda()
    runner = graphs.GraphRunner(graphs.GraphCapture("linear"))
    with patch(passes__cuda_graphs="on"):
        for rows in (16, 9, 13, 16, 10):
            x = torch.randn(rows, 5, device="cuda", requires_grad=True)
            grad = torch.randn(rows, 3, device="cuda")
            layer.zero_grad(set_to_none=True)
            layer(x).backward(grad)
            want = [x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone()]
            x.grad = None
            layer.zero_grad(set_to_none=True)
            out = runner(layer, layer.forward, (x,), {}, pads=(RowPad(16),), out_rows=rows)
            assert out.shape == (rows, 3)
            torch.testing.assert_close(out, layer(x), rtol=1e-5, atol=1e-6)
            out.backward(grad)
            for a, b in zip([x.grad, layer.weight.grad, layer.bias.grad], want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert runner.held == 1 and runner.record.captures == 1


@pytest.mark.gpu
@needs_cuda
def test_captures_warm_up_on_one_stream_so_cublas_workspaces_do_not_pile_up():
    """cuBLAS keeps a workspace for every stream a matrix product ran on, in the device allocator,
    for the life of the process: warm-ups on a fresh stream per capture left 64 MiB allocated per
    capture. They run on the device's one warm-up stream."""
    from fastopt.runtime.streams import copy_stream, warmup_stream

    device = torch.device("cuda")
    assert warmup_stream(device) is warmup_stream(device) and warmup_stream(device) != copy_stream(device)
    torch.manual_seed(0)
    layer = nn.Linear(64, 64).cuda()

    def capture_once(rows):
        runner = graphs.GraphRunner(graphs.GraphCapture("linear"))
        x = torch.randn(rows, 64, device="cuda", requires_grad=True)
        with patch(passes__cuda_graphs="on"):
            out = runner(layer, layer.forward, (x,), {})
            torch.testing.assert_close(out, layer(x), rtol=1e-5, atol=1e-6)
            out.sum().backward()
        assert runner.record.captures == 1

    capture_once(8)  # the warm-up stream's workspaces, once
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for rows in (9, 10, 11, 12, 13):
        capture_once(rows)
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 8 << 20


@pytest.mark.gpu
@needs_cuda
def test_outputs_survive_later_calls_and_overlapping_calls_stay_correct():
    model = _cuda_models("tgat")
    fast = fastopt.optimize(model, config={"passes": {"cuda_graphs": "on"}})
    a = _graph_inputs("cuda", roots=8, fanouts=(4, 3), edge_dim=12, seed=0)
    b = _graph_inputs("cuda", roots=8, fanouts=(4, 3), edge_dim=12, seed=1)
    out_a = fast(a)
    out_b = fast(b)  # a's backward has not run: this call runs uncaptured
    torch.testing.assert_close(out_a, model(a), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out_b, model(b), rtol=1e-4, atol=1e-5)
    model.zero_grad(set_to_none=True)
    (model(a).sum() + 2 * model(b).sum()).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    fast.zero_grad(set_to_none=True)
    (out_a.sum() + 2 * out_b.sum()).backward()
    got = {n: p.grad for n, p in fast.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and want
    # b ran uncaptured (fused kernels): float-order noise, relative to the gradients' scale (a
    # parameter whose gradient cancels to near zero keeps the noise of its larger summands)
    scale = max(float(g.abs().max()) for g in want.values())
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-4 * scale)
    out_c = fast(b)  # a replay again
    torch.testing.assert_close(out_b, model(b), rtol=1e-4, atol=1e-5)  # b's output kept its values
    torch.testing.assert_close(out_c, out_b, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@needs_cuda
def test_a_failed_capture_leaves_dropout_working():
    class HostSync(nn.Module):
        """TGN behind a host round trip (``float`` of a device value): the root cannot be captured."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, inputs):
            out = self.inner(inputs)
            return out * (1.0 if float(out.abs().sum()) >= 0 else 0.0)

    model = HostSync(_cuda_models("tgn", dropout=0.3))
    fast = fastopt.optimize(model, config={"passes": {"cuda_graphs": "on"}})
    inputs = _graph_inputs("cuda", roots=8, fanouts=(4,), edge_dim=12, seed=0)
    for _ in range(3):
        fast(inputs).sum().backward()
    captured = fast.fastopt_report.captured_modules()
    assert "<root>" not in captured and any(c.endswith("layers.0") for c in captured)
    torch.randn(3, device="cuda")  # a failed capture leaves the CUDA generator usable
    assert torch.isfinite(model(inputs)).all()


@pytest.mark.gpu
@needs_cuda
def test_dropout_masks_differ_between_replays():
    model = _cuda_models("tgat", dropout=0.3)
    fast = fastopt.optimize(model, config={"passes": {"cuda_graphs": "on"}})
    inputs = _graph_inputs("cuda", roots=8, fanouts=(4, 3), edge_dim=12, seed=0)
    outs = []
    for _ in range(3):
        out = fast(inputs)
        out.sum().backward()
        outs.append(out.detach())
    assert fast.fastopt_report.captured_modules() == ["<root>"]
    assert not torch.equal(outs[1], outs[2])  # two replays, two masks
    assert all(torch.isfinite(o).all() for o in outs)
    fast.eval()  # eval mode: no dropout, a graph of its own, deterministic
    with torch.no_grad():
        first, second = fast(inputs), fast(inputs)
        torch.testing.assert_close(first, model.eval()(inputs), rtol=1e-4, atol=1e-5)
    assert torch.equal(first, second)


def test_capturing_covers_a_runners_warm_ups():
    """What a capture will launch must also run in its warm-ups (compiled and loaded outside
    the capture): code that switches on graphs.capturing() sees the warm-ups as captured."""
    assert not graphs.capturing()
    graphs._LOCAL.depth = getattr(graphs._LOCAL, "depth", 0) + 1
    try:
        assert graphs.capturing()
    finally:
        graphs._LOCAL.depth -= 1
    assert not graphs.capturing()


def test_tensors_grouped_by_kind_for_copies_and_gradient_buffers():
    """Input copies skip empty tensors and group by dtype (one fused copy each); the backward's
    flat gradient buffers keep every gradient, empty ones included, at its position."""
    a, b = torch.randn(2, 3), torch.zeros(4, dtype=torch.int64)
    empty, d = torch.randn(0, 5), torch.randn(5)
    assert [(len(m), p) for m, p in capture._copy_groups([a, b, empty, d])] == [(2, [0, 3]),
                                                                             (1, [1])]
    groups = capture._flat_groups([a, None, empty, d, b])
    assert [(g.positions, [tuple(t.shape) for t in g.templates], g.empty) for g in groups] == [
        ([0, 2, 3], [(2, 3), (0, 5), (5,)], (1,)), ([4], [(4,)], ())]
    assert torch.equal(groups[0].flat, torch.cat([a.reshape(-1), d]))
    pieces = groups[0].pieces()
    assert torch.equal(pieces[0], a) and pieces[1].shape == (0, 5) and torch.equal(pieces[2], d)
    # the pieces are a copy: the next replay may overwrite the static buffer
    groups[0].flat.zero_()
    assert torch.equal(pieces[0], a) and torch.equal(groups[1].pieces()[0], b)


def test_a_failed_generator_repair_warns_and_does_not_raise(monkeypatch):
    """end_generator_capture never raises (the capture's own error is what its caller reports),
    but says when the repair itself failed: random draws may fail from then on."""
    def no_device(device=None):
        raise RuntimeError("no CUDA device here")

    monkeypatch.setattr(torch.cuda, "synchronize", no_device)
    with pytest.warns(RuntimeWarning, match="could not leave the CUDA generator's capture mode .*"
                                            "RuntimeError: no CUDA device here.*restart the process"):
        capture.end_generator_capture(torch.device("cuda"))


def test_drop_graphs_clears_every_runner_of_a_module_and_its_submodules(fake_capture):
    """``drop_graphs`` empties each runner under a module (what a check's eval-mode calls captured)
    and counts what it dropped; the runner captures again on the next call of that signature."""
    fast = _layer()
    runner = fast._fastopt_graph_runner
    other = graphs.GraphRunner(graphs.GraphCapture("child"))  # a runner on a submodule, by another name
    child = nn.Linear(2, 2)
    fast.add_module("extra", child)
    child.__dict__["_fastopt_core_runner"] = other
    for _ in range(2):  # auto: the second call of a signature captures
        fast(*_layer_args(4))
    assert len(fake_capture.captured) == 1 and runner.held == 1
    other._graphs.update({("eval", 1): object(), ("eval", 2): object()})
    assert graphs.drop_graphs(fast) == 3
    assert runner.held == 0 and other.held == 0 and fast.fastopt_report.graphs[0].graphs == 0
    assert graphs.drop_graphs(fast) == 0
    fast(*_layer_args(4))  # the signature was seen: it captures again at once
    assert len(fake_capture.captured) == 2 and runner.held == 1


@pytest.mark.parametrize("enabled", [True, False])
def test_a_capture_pauses_the_cyclic_collector_and_restores_it(monkeypatch, enabled):
    """Inside ``capture_into`` no cyclic collection runs (a finalizer that synchronizes the device
    would break the capture); afterwards the collector is as it was, whether the capture raised
    or not."""
    seen = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, capture_error_mode="global"):
        seen.append((gc.isenabled(), pool, capture_error_mode))
        yield

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        with capture.capture_into("graph", "pool"):
            assert not gc.isenabled()
        with pytest.raises(RuntimeError, match="inside"):
            with capture.capture_into("graph"):
                raise RuntimeError("inside the capture")
        assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()
    assert seen == [(False, "pool", "thread_local"), (False, None, "thread_local")]
