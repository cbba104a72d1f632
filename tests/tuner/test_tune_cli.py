"""``fastopt tune`` and ``fastopt export`` end to end on the CPU, and their user errors."""

from __future__ import annotations

import json

import pytest

from fastopt.cli import main
from fastopt.tuner import TuningRecord

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
