"""`fastopt bench`'s check of a contender against eager: on a batch with real state, and able to fail."""

import copy

import pytest
import torch

from fastopt.benchmark import _warm_batch, verify_against_eager
from fastopt.config import Config
from fastopt.errors import FastOptError
from fastopt.models import build_model
from fastopt.trainer import Trainer


def _trainer(graph, name):
    cfg = Config()
    cfg.train.device, cfg.train.batch_size, cfg.train.mrr_negatives = "cpu", 100, 0
    torch.manual_seed(0)
    model = build_model(name, graph, memory_dim=16, dim=16, time_dim=8)
    return Trainer(model, graph, cfg, progress=False), copy.deepcopy(model)


@pytest.mark.parametrize("name", ["tgn", "apan"])
def test_the_checked_batch_sees_memory_and_mail_and_eager_shares_them(small_graph, name):
    trainer, eager = _trainer(small_graph, name)
    inputs = _warm_batch(trainer, eager, batches=5)
    mem = trainer.model.memory
    roots = inputs.nodes[0]
    assert mem.memory.abs().sum() > 0 and bool(mem.pending[roots].any())  # the updater runs
    for (name_a, a), (name_b, b) in zip(trainer.model.named_buffers(), eager.named_buffers()):
        assert name_a == name_b and torch.equal(a, b)
    before = {k: b.clone() for k, b in trainer.model.named_buffers()}
    assert verify_against_eager(trainer.model, eager, inputs) <= 8
    for k, b in trainer.model.named_buffers():  # the check leaves the state as it found it
        assert torch.equal(b, before[k]), k


def test_a_wrong_memory_updater_fails_the_check(small_graph):
    trainer, eager = _trainer(small_graph, "apan")
    inputs = _warm_batch(trainer, eager, batches=5)
    with torch.no_grad():
        trainer.model.updater.w_out.weight.mul_(1.01)  # what a wrong rewrite of the updater would do
    with pytest.raises(FastOptError, match="differs from the float64 reference"):
        verify_against_eager(trainer.model, eager, inputs)
