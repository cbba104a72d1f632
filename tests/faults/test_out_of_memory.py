"""A device out-of-memory in the training step, evaluation or SlimCache ends with an error naming
the knobs that lower memory, not the raw CUDA message. On the CPU the fault is injected: a step
or the cache raises ``torch.OutOfMemoryError`` as CUDA's allocator would."""

from __future__ import annotations

import pytest
import torch

from fault_helpers import TALLY, make_trainer, tiny_graph
from fastopt.cli import main
from fastopt.config import CacheConfig
from fastopt.errors import DeviceMemoryError, FastOptError
from fastopt.runtime import SlimCache
from fastopt.runtime.table_cache import TableCache
from fastopt.trainer import Trainer

CUDA_MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                "139.8 GiB of which 1.06 GiB is free.\nIncluding non-PyTorch memory, this process ...")


def out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError(CUDA_MESSAGE)


@pytest.mark.parametrize("where", ["training step", "evaluation"])
def test_out_of_memory_in_a_step_names_batch_size_and_cache_knobs(monkeypatch, where):
    trainer = make_trainer(tiny_graph(), batch_size=64)
    monkeypatch.setattr(trainer.model, "score", out_of_memory)
    TALLY["faults"] += 1
    with pytest.raises(DeviceMemoryError) as info:
        if where == "training step":
            trainer.fit(1)
        else:
            trainer.evaluate("val")
    text = str(info.value)
    assert isinstance(info.value, FastOptError) and isinstance(info.value, MemoryError)
    for knob in ("a smaller train.batch_size than 64 (--batch-size)", "a smaller cache.budget_fraction than 0.1",
                 "cache.placement='host' instead of 'auto'"):
        assert knob in text, knob
    assert "Tried to allocate 2.00 GiB" in text and "non-PyTorch" not in text
    assert f"ran out of memory in {'the training step' if where == 'training step' else 'evaluation'}" in text
    TALLY["clean_errors"] += 1


def test_out_of_memory_ends_fastopt_train_with_exit_2(monkeypatch, tiny_dataset, capsys):
    monkeypatch.setattr(Trainer, "_scores", out_of_memory)
    TALLY["faults"] += 1
    rc = main(["train", "--dataset", str(tiny_dataset), "--model", "jodie", "--epochs", "1",
               "--batch-size", "300", "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "ran out of memory in the training step" in err and "--batch-size" in err
    assert "Traceback" not in err
    TALLY["clean_errors"] += 1


def test_out_of_memory_in_slimcache_names_the_cache_knobs(monkeypatch):
    cache = SlimCache({"edge": torch.randn(50, 4)}, config=CacheConfig(budget_fraction=0.5, policy="lru"))
    monkeypatch.setattr(TableCache, "allocate", out_of_memory)
    TALLY["faults"] += 1
    with pytest.raises(DeviceMemoryError, match="feature cache.*cache.budget_fraction.*placement='host'"):
        cache.lookup("edge", torch.tensor([1, 2, 3]))
    TALLY["clean_errors"] += 1
