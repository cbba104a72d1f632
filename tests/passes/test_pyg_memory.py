"""PyG's ``TGNMemory`` under ``fastopt.optimize``: the message store on tensors gives PyG's
memory, last-update times and stored messages bit for bit over a stream of batches."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torch_geometric")
from torch_geometric.nn import TGNMemory  # noqa: E402
from torch_geometric.nn.models.tgn import (IdentityMessage, LastAggregator,  # noqa: E402
                                           MeanAggregator)

import fastopt  # noqa: E402
from fastopt.errors import DataError  # noqa: E402
from fastopt.passes import pyg_memory  # noqa: E402

NODES, RAW, MEM, TIME = 40, 5, 8, 6


def _memory(aggregator):
    torch.manual_seed(0)
    return TGNMemory(NODES, RAW, MEM, TIME, IdentityMessage(RAW, MEM, TIME), aggregator())


def _batches(count, size=9, seed=0):
    """Batches over a few hot nodes (repeats within a batch), times with ties."""
    g = torch.Generator().manual_seed(seed)
    start = 1
    for _ in range(count):
        src = torch.randint(0, NODES, (size,), generator=g)
        dst = torch.randint(0, NODES // 4, (size,), generator=g)
        t = (torch.arange(start, start + size) // 3).long()
        start += size
        yield src, dst, t, torch.randn(size, RAW, generator=g)


def _same_store(fast, ref):
    for side, store in (("s", ref.msg_s_store), ("d", ref.msg_d_store)):
        theirs = {node: entry for node, entry in store.items() if entry[0].numel()}
        mine = fast.stored_messages(side)
        assert mine.keys() == theirs.keys()
        for node in mine:
            for a, b in zip(mine[node], theirs[node]):
                assert torch.equal(a, b), (side, node)


def _step(fast, ref, batch, train):
    src, dst, t, raw = batch
    n_id = torch.cat([src, dst]).unique()
    if train:  # the embedding's read: memory updated by the stored messages, with gradients
        got, want = fast(n_id), ref(n_id)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        grads = [torch.autograd.grad(out[0].sum(), list(m.gru.parameters()))
                 for out, m in ((got, fast), (want, ref))]
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    fast.update_state(src, dst, t, raw)
    ref.update_state(src, dst, t, raw)
    assert torch.equal(fast.memory, ref.memory)
    assert torch.equal(fast.last_update, ref.last_update)
    _same_store(fast, ref)
    fast.detach()
    ref.detach()


@pytest.mark.parametrize("aggregator", [LastAggregator, MeanAggregator])
def test_stream_matches_pyg_bit_for_bit(aggregator):
    memory = _memory(aggregator)
    ref = copy.deepcopy(memory)
    fast = fastopt.optimize(memory)
    assert type(fast).__name__ == "TensorTGNMemory"
    report = fast.fastopt_report
    assert [r.pattern for r in report.rewrites] == [f"pyg.TGNMemory[{aggregator.__name__}]"]
    assert "fastopt.passes.pyg_memory.tensor_message_store" in str(report)
    assert list(fast.state_dict()) == list(ref.state_dict())
    assert fast.memory is memory.memory and fast.gru is memory.gru  # shared, not copied
    batches = list(_batches(14))
    for i, batch in enumerate(batches[:10]):
        _step(fast, ref, batch, train=True)
    fast.eval()
    ref.eval()  # flushes every stored message into the memory, then empties the stores
    assert torch.equal(fast.memory, ref.memory) and torch.equal(fast.last_update, ref.last_update)
    for batch in batches[10:]:
        _step(fast, ref, batch, train=False)
    fast.train()
    ref.train()
    fast.reset_state()
    ref.reset_state()
    for batch in batches[:3]:
        _step(fast, ref, batch, train=True)


def test_a_full_log_is_compacted_without_losing_messages(monkeypatch):
    monkeypatch.setattr(pyg_memory, "MIN_LOG", 16)
    memory = _memory(LastAggregator)
    ref = copy.deepcopy(memory)
    fast = fastopt.optimize(memory)
    for batch in _batches(30, size=12, seed=1):
        _step(fast, ref, batch, train=True)
    assert fast._fo_get("s", "t").shape[0] < 30 * 12  # compacted, not grown with the stream


def test_messages_stored_before_optimize_are_kept():
    memory = _memory(MeanAggregator)
    batches = list(_batches(8, seed=2))
    for src, dst, t, raw in batches[:4]:
        memory.update_state(src, dst, t, raw)
        memory.detach()
    ref = copy.deepcopy(memory)
    fast = fastopt.optimize(memory)
    _same_store(fast, ref)
    for batch in batches[4:]:
        _step(fast, ref, batch, train=True)


def test_state_dict_loads_both_ways():
    a, b = _memory(LastAggregator), _memory(LastAggregator)
    for src, dst, t, raw in _batches(3):
        a.update_state(src, dst, t, raw)
        a.detach()
    fast = fastopt.optimize(b)
    fast.load_state_dict(a.state_dict())
    assert torch.equal(fast.memory, a.memory) and torch.equal(fast.last_update, a.last_update)
    fresh = _memory(LastAggregator)
    fresh.load_state_dict(fast.state_dict())
    assert torch.equal(fresh.memory, a.memory)


def test_a_subclass_is_left_alone_and_reported():
    class MyMemory(TGNMemory):
        pass

    torch.manual_seed(0)
    memory = MyMemory(NODES, RAW, MEM, TIME, IdentityMessage(RAW, MEM, TIME), LastAggregator())
    report = fastopt.optimize(memory).fastopt_report
    assert report.count() == 0
    assert any(a.pass_name == "tensorize_tgn_memory" and "MyMemory subclasses TGNMemory" in a.reason
               for a in report.left_alone)


@pytest.mark.parametrize("call, match", [
    (lambda m: m.update_state(torch.tensor([0, NODES]), torch.tensor([1, 2]), torch.tensor([1, 2]),
                              torch.zeros(2, RAW)), rf"node id {NODES} is outside \[0, {NODES}\)"),
    (lambda m: m.update_state(torch.tensor([0, 1]), torch.tensor([1]), torch.tensor([1, 2]),
                              torch.zeros(2, RAW)), r"src, dst and t must have one length"),
    (lambda m: m.update_state(torch.tensor([0, 1]), torch.tensor([1, 2]), torch.tensor([1, 2]),
                              torch.zeros(2, RAW + 1)), rf"raw_msg has shape \(2, {RAW + 1}\), expected \(2, {RAW}\)"),
    (lambda m: m(torch.tensor([-1, 3])), rf"node id -1 is outside \[0, {NODES}\)"),
    (lambda m: m(torch.tensor([[1]])), r"n_id must be a 1-d tensor \(got \(1, 1\)\)"),
])
def test_bad_input_names_the_value_and_the_fix(call, match):
    fast = fastopt.optimize(_memory(LastAggregator))
    with pytest.raises(DataError, match=match):
        call(fast)


def test_optimizing_twice_keeps_the_replacement():
    fast = fastopt.optimize(_memory(LastAggregator))
    again = fastopt.optimize(fast)
    assert again is fast
    assert any("already optimized" in a.reason for a in again.fastopt_report.left_alone)


def test_bad_ids_in_eval_mode_are_refused_before_any_write():
    fast = fastopt.optimize(_memory(LastAggregator)).eval()
    with pytest.raises(DataError, match=rf"node id {NODES + 3} is outside"):
        fast.update_state(torch.tensor([0, NODES + 3]), torch.tensor([1, 2]), torch.tensor([1, 2]),
                          torch.zeros(2, RAW))
    assert fast.stored_messages("s") == {}
    with pytest.raises(DataError, match=r"node id -2 is outside"):
        fast(torch.tensor([-2]))
