"""Checkpoints under attack and under kill -9: a planted pickle never runs, a killed run resumes
to the same metrics, a write cut short leaves the previous checkpoint loadable."""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import time

import numpy as np
import pytest
import torch

from fault_helpers import TALLY, finish, make_trainer, spawn, tiny_graph, wait_for
from fastopt.cli import main
from fastopt.errors import FastOptError
from fastopt.trainer import read_checkpoint


class Planted:
    """Unpickling this object calls ``open(marker, "w")``: the file appears only if it ran."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(path, marker, how: str) -> None:
    """A checkpoint with every expected key whose model entry runs code when unpickled."""
    trainer = make_trainer(tiny_graph())
    state = {"epoch": 1, "model": {"w": Planted(marker)}, "optimizer": trainer.optimizer.state_dict(),
             "torch_rng": torch.get_rng_state(), "history": []}
    if how == "torch.save":
        torch.save(state, path)
    else:  # the legacy format: a bare pickle stream
        with open(path, "wb") as f:
            pickle.dump(state, f, protocol=2)


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_a_planted_pickle_is_refused_by_load_checkpoint(tmp_path, how):
    evil, marker = tmp_path / "checkpoint.pt", tmp_path / "pwned"
    plant(evil, marker, how)
    TALLY["faults"] += 1
    with pytest.raises(FastOptError, match="holds objects other than tensors") as info:
        make_trainer(tiny_graph()).load_checkpoint(evil)
    assert str(evil) in str(info.value) and "--checkpoint-dir" in str(info.value)
    assert not marker.exists(), "the planted pickle ran"
    TALLY["clean_errors"] += 1


def test_a_planted_pickle_handed_to_resume_does_not_run(tmp_path, tiny_dataset, capsys):
    evil, marker = tmp_path / "checkpoint.pt", tmp_path / "pwned"
    plant(evil, marker, "torch.save")
    TALLY["faults"] += 1
    rc = main(["train", "--dataset", str(tiny_dataset), "--model", "jodie", "--epochs", "1",
               "--batch-size", "300", "--device", "cpu", "--no-progress", "--resume", str(evil)])
    err = capsys.readouterr().err
    assert rc == 2 and "holds objects other than tensors" in err and str(evil) in err
    assert not marker.exists(), "the planted pickle ran"
    TALLY["clean_errors"] += 1


@pytest.mark.parametrize("damage", ["truncated", "empty", "not a dict", "keys missing"])
def test_a_damaged_checkpoint_is_refused_by_name(tmp_path, damage):
    trainer = make_trainer(tiny_graph(), checkpoint_dir=tmp_path)
    trainer.fit(1)
    path = tmp_path / "checkpoint.pt"
    raw = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "not a dict":
        torch.save([1, 2, 3], path)
    else:
        torch.save({"epoch": 1}, path)
    TALLY["faults"] += 1
    with pytest.raises(FastOptError, match=str(path)):
        make_trainer(tiny_graph()).load_checkpoint(path)
    TALLY["clean_errors"] += 1


def test_history_with_numpy_numbers_round_trips_through_weights_only(tmp_path):
    trainer = make_trainer(tiny_graph(), checkpoint_dir=tmp_path)
    trainer.fit(1)
    trainer.history.append({"epoch": np.int64(7), "val": {"ap": np.float64(0.5), "auc": np.float32(0.25)}})
    trainer.save_checkpoint(tmp_path / "checkpoint.pt")
    state = read_checkpoint(tmp_path / "checkpoint.pt")
    assert state["history"][-1] == {"epoch": 7, "val": {"ap": 0.5, "auc": 0.25}}
    assert all(type(v) in (int, float) for v in state["history"][-1]["val"].values())


# ------------------------------------------------------------------------- kill -9 mid-epoch
TRAIN = "import sys; from fastopt.cli import main; sys.exit(main(sys.argv[1:]))"


def train_args(dataset, run_dir, epochs: int, *extra) -> list:
    return ["-c", TRAIN, "train", "--dataset", str(dataset), "--model", "tgn", "--epochs", str(epochs),
            "--batch-size", "100", "--edge-dim", "8", "--device", "cpu", "--no-progress",
            "--checkpoint-dir", str(run_dir), "--log", str(run_dir / "log.jsonl"), *extra]


def logged(run_dir, field: str) -> list:
    """The records of the run's log that hold ``field``, in order."""
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return [r for r in records if field in r]


@pytest.mark.parametrize("seed", [0, 1])
def test_kill_9_at_a_random_batch_then_resume_reaches_the_same_metrics(tmp_path, tiny_dataset, seed):
    """``fastopt train`` is killed with SIGKILL at a random moment after its first checkpoint
    (mid-batch, mid-evaluation or mid-write); ``--resume`` from what it left ends with the test
    metrics and validation history of a run that was never interrupted."""
    epochs = 4
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    finish(spawn(train_args(tiny_dataset, straight, epochs)))
    per_epoch = logged(straight, "seconds")[0]["seconds"]

    proc = spawn(train_args(tiny_dataset, killed, epochs))
    checkpoint = killed / "checkpoint.pt"
    wait_for(checkpoint.exists, proc, what="the first checkpoint")
    # a random point of the epochs left (their training takes per_epoch seconds each)
    time.sleep(np.random.default_rng(seed).uniform(0.0, 2.0) * per_epoch)
    assert proc.poll() is None, "the run ended before it could be killed; give it more epochs"
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    TALLY["faults"] += 1
    done = read_checkpoint(checkpoint)["epoch"]
    assert 1 <= done < epochs

    finish(spawn(train_args(tiny_dataset, killed, epochs, "--resume", str(checkpoint))))
    assert logged(killed, "test")[-1]["test"] == logged(straight, "test")[-1]["test"]
    learned = [[(h["loss"], h["val"]) for h in read_checkpoint(run / "checkpoint.pt")["history"]]
               for run in (killed, straight)]
    assert learned[0] == learned[1] and len(learned[0]) == epochs  # timings aside, every epoch
    TALLY["oracle_equal"] += 1


# ------------------------------------------------------------------------- kill -9 mid-write
STALLED_WRITE = r"""
import io, os, sys, time
import torch
from fastopt.config import Config
from fastopt.data import load_file
from fastopt.models import build_model
from fastopt.trainer import Trainer

graph, run_dir = load_file(sys.argv[1]), sys.argv[2]
cfg = Config()
cfg.train.device, cfg.train.batch_size = "cpu", 300
torch.manual_seed(0)
trainer = Trainer(build_model("jodie", graph, memory_dim=8, dim=8, time_dim=4), graph, cfg,
                  checkpoint_dir=run_dir, progress=False)
save = torch.save

def stalled(obj, f, *args, **kwargs):
    # the second checkpoint: half its bytes reach the disk, then the process waits to be killed
    if trainer.epoch < 2:
        return save(obj, f, *args, **kwargs)
    buffer = io.BytesIO()
    save(obj, buffer)
    data = buffer.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    os.fsync(f.fileno())
    open(os.path.join(run_dir, "writing"), "w").close()
    time.sleep(600)

torch.save = stalled
trainer.fit(3)
"""


def test_kill_9_during_a_checkpoint_write_leaves_the_previous_one_loadable(tmp_path, tiny_dataset):
    run_dir = tmp_path / "run"
    proc = spawn(["-c", STALLED_WRITE, str(tiny_dataset), str(run_dir)])
    wait_for((run_dir / "writing").exists, proc, what="the second checkpoint write")
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    TALLY["faults"] += 1
    (partial,) = run_dir.glob(".checkpoint.pt.*.tmp")  # the cut-short write, beside the old file
    with pytest.raises(FastOptError, match="cannot be read"):
        read_checkpoint(partial)
    graph = __import__("fastopt.data", fromlist=["load_file"]).load_file(tiny_dataset)
    trainer = make_trainer(graph, "jodie", batch_size=300)
    trainer.load_checkpoint(run_dir / "checkpoint.pt")
    assert trainer.epoch == 1 and len(trainer.history) == 1
    trainer.fit(2)
    assert len(trainer.history) == 2 and trainer.test_metrics
