"""``fastopt tune`` and ``fastopt export`` end to end on the CPU, and their user errors."""

from __future__ import annotations

import json

import pytest

from fastopt.cli import main
from fastopt.tuner import TuningRecord
from fastopt.tuner.records import SHIPPED_RECORDS

MODEL = ["--model", "tgn", "--memory-dim", "8", "--dim", "8", "--time-dim", "8", "--device", "cpu"]


def test_tune_then_export(tiny_file, tmp_path, capsys, one_thread):
    db = tmp_path / "tune.db"
    rc = main(["tune", "--dataset", str(tiny_file), *MODEL, "--trials", "2", "--warmup", "1", "--steps", "3",
               "--storage", str(db), "--study-name", "cli", "--batch-sizes", "200,300",
               "--out", str(tmp_path / "records")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "search space:" in out and "train.batch_size" in out
    assert out.count("\ntrial ") == 2 and "trial 1/2 (baseline)" in out and "| best " in out
    assert all(line.endswith(" s since the start") for line in out.splitlines() if line.startswith("trial "))
    (path,) = (tmp_path / "records").glob("*.json")
    assert f"wrote {path}" in out
    record = TuningRecord.load(path)
    assert record.device["kind"] == "cpu" and record.model["family"] == "TGN"
    assert record.dataset["events"] == 3000 and record.study["name"] == "cli"
    assert record.values["train.batch_size"] in (200, 300)

    rc = main(["export", "--storage", str(db), "--study-name", "cli", "--out", str(tmp_path / "exported")])
    assert rc == 0
    (again,) = (tmp_path / "exported").glob("*.json")
    assert again.name == path.name and json.loads(again.read_text())["values"] == record.values
    assert f"wrote {again}" in capsys.readouterr().out


def test_sigterm_stops_the_study_and_writes_the_finished_trials_record(tiny_file, tmp_path):
    """A scheduler's stop (SIGTERM) mid-study: the trials that finished give the record, and the
    exit status is 143, as for a command the signal ended (resuming is test_study's)."""
    import os
    import signal
    import subprocess
    import sys

    out_dir = tmp_path / "records"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastopt.cli", "tune", "--dataset", str(tiny_file), *MODEL, "--trials", "200",
         "--warmup", "1", "--steps", "3", "--storage", str(tmp_path / "t.db"), "--study-name", "term",
         "--out", str(out_dir), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in proc.stdout:  # the second trial's line: one trial at least has finished
        lines.append(line)
        if line.startswith("trial 2/200"):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    out = "".join(lines) + rest
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "fastopt tune: interrupted" in out
    (path,) = out_dir.glob("*.json")
    assert f"wrote {path}" in out
    record = TuningRecord.load(path)
    finished = record.study.get("complete", 0) + record.study.get("pruned", 0)
    assert record.study["name"] == "term" and 2 <= finished < 200


def test_train_says_which_record_it_used(tiny_file, tmp_path, capsys, one_thread, monkeypatch):
    monkeypatch.setenv("FASTOPT_TUNER_RECORDS_DIR", str(tmp_path / "nothing"))
    from fastopt import config as fconfig

    monkeypatch.setattr(fconfig, "_DEFAULT", None)
    rc = main(["train", "--dataset", str(tiny_file), "--model", "jodie", "--epochs", "1", "--batch-size", "500",
               "--device", "cpu", "--mrr-negatives", "0", "--no-progress", "--memory-dim", "8", "--dim", "8",
               "--time-dim", "4"])
    assert rc == 0
    assert "config: no tuned record matches; defaults" in capsys.readouterr().out


@pytest.mark.parametrize("argv,fragment", [
    (["tune", "--batch-sizes", "200,x"], "--batch-sizes '200,x' must be comma-separated batch sizes >= 1"),
    (["tune", "--max-device-memory", "0"], "--max-device-memory must be > 0 GB (got 0.0)"),
    (["tune", "--timeout", "-5"], "--timeout must be > 0 seconds (got -5.0)"),
    (["tune", "--trials", "0"], "--trials 0: tuner.trials must be >= 1 (got 0)"),
    (["tune", "--steps", "0"], "--steps 0: tuner.steps_per_trial must be >= 1 (got 0)"),
    (["tune", "--storage", "nosuchdriver://x", "--trials", "1"], "storage 'nosuchdriver://x' cannot be opened"),
])
def test_tune_user_errors_exit_2(tiny_file, argv, fragment, capsys):
    assert main(argv + ["--dataset", str(tiny_file), *MODEL]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastopt: error: ") and fragment in err


def test_export_of_a_missing_study_exits_2(tmp_path, capsys):
    assert main(["export", "--storage", str(tmp_path / "none.db"), "--study-name", "s"]) == 2
    assert "holds no study 's' (it holds none)" in capsys.readouterr().err


def _saved_record(folder, small_graph, **changes):
    import torch

    from fastopt.models import build_model
    from fastopt.trainer import tuning_fingerprint
    from fastopt.tuner import dataset_signature, device_identity

    torch.manual_seed(0)
    model = build_model("tgn", small_graph, memory_dim=8, dim=8, time_dim=8)
    fields = dict(device=device_identity("cpu"), model=tuning_fingerprint(model),
                  dataset=dataset_signature(small_graph), values={"sampler.threads": 2},
                  step_seconds=0.05, default_step_seconds=0.06, epoch_seconds=3.0, default_epoch_seconds=3.6,
                  versions={"torch": "2", "triton": None, "fastopt": "0.1.0"},
                  measurement={"timing": "wall", "warmup": 3, "timed": 20, "max_device_memory": None},
                  study={"name": "s", "model_name": "tgn", "trials": 10, "complete": 9, "pruned": 1,
                         "best_trial": 4}, created="2026-12-01T00:00:00Z")
    fields.update(changes)
    return TuningRecord(**fields).save(folder)


def test_configs_list_and_show(tmp_path, small_graph, capsys):
    path = _saved_record(tmp_path, small_graph)
    assert main(["configs", "list", "--records", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    shipped = len(list(SHIPPED_RECORDS.glob("*.json")))
    assert f"{tmp_path} (tuner.records_dir): 1 record(s)" in out and f"(shipped with fastopt): {shipped} record(s)" in out
    assert (f"  {path.name}: " in out and "| TGN (" in out and "3,000 events" in out
            and "features 8/4 (edge/node)" in out and "| 1.20x the defaults" in out)

    for name in (str(path), path.name, path.stem):
        assert main(["configs", "show", name, "--records", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert f"record: {path}" in out and "  sampler.threads = 2" in out
        assert "step: 50.00 ms best, 60.00 ms baseline (1.20x the defaults)" in out
        assert "measured: wall timing, 3 warm-up + 20 timed steps, device memory limit none" in out
        assert "study: s (tgn), 10 trial(s), 9 complete, 1 pruned, best trial 4" in out
    assert main(["configs", "show", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["values"] == {"sampler.threads": 2}


def test_configs_list_without_records_and_show_of_a_missing_one(tmp_path, capsys):
    assert main(["configs", "list", "--records", str(tmp_path / "none")]) == 0
    assert f"{tmp_path / 'none'} (tuner.records_dir): 0 record(s), no such folder" in capsys.readouterr().out
    assert main(["configs", "show", "nope", "--records", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastopt: error: tuning record 'nope' is neither a file nor a record in ")
    assert str(tmp_path) in err and "fastopt configs list names the records there" in err
    (tmp_path / "bad.json").write_text("{")
    assert main(["configs", "show", str(tmp_path / "bad.json")]) == 2
    assert "cannot be read as JSON" in capsys.readouterr().err
