"""Reference models: shapes, gradients, memory semantics, traceability of the embedding layers."""

import numpy as np
import pytest
import torch

from fastopt.errors import ModelError
from fastopt.models import MODELS, build_model
from fastopt.models.layers import MultiheadTemporalAttention, TemporalAttention
from fastopt.models.memory import NodeMemory

SMALL = {"tgn": dict(memory_dim=16, dim=16, time_dim=8), "tgat": dict(dim=16, time_dim=8, fanouts=(4, 3)),
         "jodie": dict(memory_dim=16, dim=16, time_dim=8), "apan": dict(memory_dim=16, dim=16, time_dim=8)}


@pytest.mark.parametrize("layer_cls", [TemporalAttention, MultiheadTemporalAttention])
def test_attention_layers_trace_and_zero_rows_without_neighbors(layer_cls):
    torch.manual_seed(0)
    layer = layer_cls(node_dim=6, edge_dim=3, time_dim=4, out_dim=10, num_heads=2).eval()
    m, k = 5, 4
    h_dst, h_nbr = torch.randn(m, 6), torch.randn(m, k, 6)
    ef, dt = torch.randn(m, k, 3), torch.rand(m, k) * 100
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    out = layer(h_dst, h_nbr, ef, dt, mask)
    assert out.shape == (m, 10) and torch.isfinite(out).all()
    # padded neighbors do not influence the output
    h_nbr2 = torch.where(mask.unsqueeze(-1), h_nbr, torch.randn_like(h_nbr))
    torch.testing.assert_close(layer(h_dst, h_nbr2, ef, dt, mask), out)
    gm = torch.fx.symbolic_trace(layer)
    torch.testing.assert_close(gm(h_dst, h_nbr, ef, dt, mask), out)
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


def test_memory_mailbox_ring_buffer_keeps_latest_mails_in_order():
    mem = NodeMemory(num_nodes=4, dim=2, mail_dim=1, slots=3)
    nodes = torch.tensor([1, 2, 1, 1, 1])
    mails = torch.arange(5.0).unsqueeze(1)
    mem.deliver(nodes, mails, torch.arange(5.0))
    # node 1 received mails 0, 2, 3, 4: the last three survive; node 2 received mail 1
    assert sorted(mem.mails[1, :, 0].tolist()) == [2.0, 3.0, 4.0]
    assert mem.mail_count[1] == 4 and mem.pending[1] and not mem.pending[0]
    latest, ts = mem.latest_mail(torch.tensor([1, 2]))
    assert latest[:, 0].tolist() == [4.0, 1.0] and ts.tolist() == [4.0, 1.0]
    assert mem.mail_mask(torch.tensor([0, 2, 1])).sum(1).tolist() == [0, 1, 3]
    one = NodeMemory(num_nodes=3, dim=2, mail_dim=1, slots=1)
    one.deliver(torch.tensor([0, 0]), torch.tensor([[5.0], [6.0]]), torch.tensor([1.0, 2.0]))
    assert one.latest_mail(torch.tensor([0]))[0].item() == 6.0


def test_unknown_model_name(small_graph):
    with pytest.raises(ModelError, match="unknown model 'gat'"):
        build_model("gat", small_graph)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_train_and_state_does_not_leak_within_a_batch(name, small_graph):
    """A batch's own events never change its embeddings: state is written after the step."""
    from fastopt.config import Config
    from fastopt.trainer import Trainer

    torch.manual_seed(0)
    model = build_model(name, small_graph, **SMALL[name])
    cfg = Config()
    cfg.train.device, cfg.train.batch_size = "cpu", 100
    trainer = Trainer(model, small_graph, cfg, progress=False)
    model.eval()
    src, dst, ts = small_graph.src[1000:1100], small_graph.dst[1000:1100], small_graph.ts[1000:1100]
    roots = np.concatenate([src, dst])
    times = np.concatenate([ts, ts])
    with torch.no_grad():
        if trainer.sampler is not None:
            trainer.sampler.reset(0)
        h1 = model.embed(trainer.build_inputs(roots, times))
        model.commit(torch.from_numpy(src), torch.from_numpy(dst), torch.from_numpy(ts),
                     torch.from_numpy(small_graph.edge_feat[1000:1100]))
        if trainer.sampler is not None:
            trainer.sampler.reset(0)  # the same uniform draws as before
        h2 = model.embed(trainer.build_inputs(roots, times))
    assert h1.shape == (200, 16) and torch.isfinite(h1).all()
    if name == "tgat":
        torch.testing.assert_close(h1, h2)  # stateless
    else:
        assert not torch.allclose(h1, h2)  # memory moved on after the commit


class _Taken(list):
    """Edge features that log when a model takes one."""

    def __init__(self, items, log):
        super().__init__(items)
        self.log = log

    def __getitem__(self, i):
        self.log.append("taken")
        return super().__getitem__(i)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_model_that_waits_for_edges_takes_them_after_edges_ready(name, small_graph):
    """``waits_for_edges`` lets the trainer read a batch's edge features on a side stream that
    the model joins (``inputs.edges_ready()``); such a model must join before it takes one, and
    its embeddings are unchanged. A model without it is handed ready rows."""
    from fastopt.config import Config
    from fastopt.trainer import Trainer

    torch.manual_seed(0)
    model = build_model(name, small_graph, **SMALL[name]).eval()
    cfg = Config()
    cfg.train.device, cfg.train.batch_size = "cpu", 100
    trainer = Trainer(model, small_graph, cfg, progress=False)
    roots = np.concatenate([small_graph.src[1000:1100], small_graph.dst[1000:1100]])
    times = np.concatenate([small_graph.ts[1000:1100]] * 2)
    embedded = []
    for pending in (None, lambda: log.append("ready")):
        log = []  # the second run's: the join and when each feature was taken
        if trainer.sampler is not None:
            trainer.sampler.reset(0)
        inputs = trainer.build_inputs(roots, times)
        inputs.edge_feat, inputs.edges_pending = _Taken(inputs.edge_feat, log), pending
        with torch.no_grad():
            embedded.append(model.embed(inputs))
    torch.testing.assert_close(embedded[0], embedded[1], rtol=0, atol=0)
    assert model.waits_for_edges == (name == "tgn")
    if model.waits_for_edges:
        assert "taken" in log and log.count("ready") == 1
    if name in ("tgn", "tgat"):  # propagate joins before it takes any (TGAT: layer_edges too)
        assert "ready" in log and ("taken" not in log or log.index("ready") < log.index("taken"))
