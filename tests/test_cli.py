import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from fastopt.cli import main
from fastopt.data import load_file, resolve_dataset, save_npz


def test_train_end_to_end(learnable_graph, one_thread, tmp_path, capsys):
    """fastopt train on a file of a graph where each user meets one item: it learns (test AP far
    above chance, 0.5; MRR against 3 negatives, chance about 0.52), prints its epochs, writes the log."""
    path, log = tmp_path / "learnable.npz", tmp_path / "log.jsonl"
    save_npz(learnable_graph, path)
    rc = main(["train", "--dataset", str(path), "--model", "tgn", "--epochs", "3", "--lr", "1e-2",
               "--memory-dim", "8", "--dim", "8", "--time-dim", "4", "--batch-size", "200",
               "--device", "cpu", "--mrr-negatives", "3", "--log", str(log), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["model"] == "tgn" and summary["test"]["ap"] > 0.8 and summary["test"]["mrr"] > 0.75
    assert "epoch   2" in out and log.exists()
    assert "\nfeatures: node 0.00 GB on cpu\n" in out  # its node features; no edge features


@pytest.mark.parametrize("argv,fragment", [
    (["train", "--dataset", "no-such-data"], "neither a built-in dataset"),
    (["train", "--model", "gat"], "unknown model"),
    (["train", "--batch-size", "0"], "batch_size must be >= 1"),
    (["data", "info", "/no/such/file"], "neither a built-in dataset"),
])
def test_user_errors_exit_2_with_message(argv, fragment, capsys):
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_data_info_and_synth(tmp_path, capsys):
    assert main(["data", "info", "wikipedia", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["events"] == 157_474 and info["nodes"] == 9_227
    out = tmp_path / "big.npz"
    assert main(["data", "synth", "--like", "wikipedia", "--events", "200000", "--out", str(out)]) == 0
    g = load_file(out)
    assert g.num_events == 200_000 and g.bipartite
    s = g.info()
    assert abs(s["repeat_rate"] - info["repeat_rate"]) < 0.05  # repeat-edge rate is preserved
    gaps, real_gaps = np.diff(g.ts), np.diff(load_file(resolve_dataset("wikipedia")).ts)
    assert gaps.min() >= 0  # inter-event times are drawn from the real ones
    assert 0.5 <= (np.mean(gaps) + 1e-9) / (np.mean(real_gaps) + 1e-9) <= 2.0


def test_bench_end_to_end_writes_json(tiny_file, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    rc = main(["bench", "--dataset", str(tiny_file), "--model", "tgn", "--epochs", "2",
               "--batch-size", "400", "--device", "cpu", "--contenders", "tgl,eager,fastopt,fastopt-host",
               "--json", str(out_json), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    record = json.loads(out_json.read_text())
    names = [r["contender"] for r in record["results"]]
    assert names == ["tgl", "eager", "fastopt", "fastopt-host"]
    for r in record["results"]:
        assert len(r["epoch_seconds"]) == 2 and r["steady_epoch_s"] > 0 and 0 <= r["test_ap"] <= 1
        assert r["verified"]
        assert r["peak_host_bytes"] > 50e6  # the process's peak RSS (torch alone is more)
        from fastopt.data import load_dataset

        events = len(load_dataset(str(tiny_file)).split_range("train"))
        assert r["train_events_per_second"] == pytest.approx(events / r["steady_epoch_s"])
    # one seed, one initialization, one data path: TGL's path and the device path train identically
    tgl, eager = record["results"][0], record["results"][1]
    assert tgl["test_ap"] == eager["test_ap"] and tgl["val_ap"] == eager["val_ap"]
    # fastopt with its features in host memory reads the same rows: the same training
    fast, host = record["results"][2], record["results"][3]
    assert host["test_ap"] == fast["test_ap"] and host["val_ap"] == fast["val_ap"]
    assert record["command"] and record["git_commit"] and record["model"] == "tgn"
    assert "contender" in out and "fastopt" in out


def test_bench_interleaved_trains_each_contender_as_a_run_of_its_own(tiny_file, tmp_path, capsys):
    """--interleave builds and verifies every contender, then their epochs take turns; each draws
    its dropout from a generator state of its own, so it trains exactly as it does alone."""
    records = {}
    for flag in ([], ["--interleave"]):
        out_json = tmp_path / f"bench{len(flag)}.json"
        assert main(["bench", "--dataset", str(tiny_file), "--model", "tgn", "--epochs", "2", "--dropout", "0.3",
                     "--batch-size", "400", "--device", "cpu", "--contenders", "eager,fastopt-host",
                     "--json", str(out_json), "--no-progress", *flag]) == 0
        records[bool(flag)] = json.loads(out_json.read_text())
        out = capsys.readouterr().out
    assert records[True]["interleave"] and not records[False]["interleave"]
    # interleaved: fastopt-host's steady epoch over eager's (no fastopt ran), in the table's wake
    ratio = records[True]["paired_ratios"]["fastopt-host"]
    assert ratio["reference"] == "eager" and ratio["pairs"] == 1 and ratio["min"] == ratio["median"] == ratio["max"]
    host, eager = (r["epoch_seconds"][1] for r in reversed(records[True]["results"]))
    assert ratio["median"] == pytest.approx(host / eager)
    assert "fastopt-host / eager, epoch by epoch: median" in out and records[False]["paired_ratios"] == {}
    # both verified and started before either trained an epoch: the steady lines come last
    lines = [line.strip() for line in out.splitlines() if line.startswith("  ")]
    assert [line.split(":")[0] for line in lines[-2:]] == ["eager", "fastopt-host"]
    assert all("s/epoch steady" in line for line in lines[-2:])
    assert all("s/epoch steady" not in line for line in lines[:-2])
    for alone, turns in zip(records[False]["results"], records[True]["results"], strict=True):
        assert len(turns["epoch_seconds"]) == 2 and turns["verified"]
        assert turns["captures_per_epoch"] == turns["val_captures_per_epoch"] == [0, 0]  # no graphs on the CPU
        assert (turns["val_ap"], turns["test_ap"]) == (alone["val_ap"], alone["test_ap"])


def test_bench_lets_each_contender_go_before_releasing_the_device_memory(small_graph, monkeypatch):
    """The cached device memory is returned to the driver once a contender's trainer is gone, so
    that the next one's free-memory checks (auto placement, SlimCache's budget) see all of it."""
    import weakref

    from fastopt import benchmark
    from fastopt.config import Config

    made, alive_at_release = [], []
    prepare = benchmark._prepare

    def prepared(*args, **kwargs):
        result, trainer = prepare(*args, **kwargs)
        made.append(weakref.ref(trainer))
        return result, trainer

    monkeypatch.setattr(benchmark, "_prepare", prepared)
    monkeypatch.setattr(benchmark, "_release", lambda device: alive_at_release.append([r() is not None for r in made]))
    base = Config()
    base.train.device, base.train.batch_size, base.train.mrr_negatives = "cpu", 600, 0
    base.model.memory_dim = base.model.dim = base.model.time_dim = 8
    for interleave in (False, True):
        made.clear()
        alive_at_release.clear()
        results = benchmark.run_bench(small_graph, "tgn", base, ["eager", "fastopt"], epochs=1,
                                      log=lambda line: None, interleave=interleave)
        assert [r.contender for r in results] == ["eager", "fastopt"]
        assert alive_at_release == ([[False], [False, False]] if not interleave else [[False, False]])


def test_paired_ratios_divide_each_steady_epoch_by_the_same_turns_reference():
    """Epoch by epoch against fastopt where it ran (the first epoch left out), else the first
    contender; a contender with no steady epoch has no ratio."""
    from fastopt.benchmark import BenchResult, format_ratios, paired_ratios

    tgl = BenchResult("tgl", epoch_seconds=[3.0, 2.0, 2.2, 1.8])
    fast = BenchResult("fastopt", epoch_seconds=[9.0, 0.5, 0.4, 0.6])
    host = BenchResult("fastopt-host", epoch_seconds=[1.0, 0.6, 0.6, 0.6])
    got = paired_ratios([tgl, fast, host])
    assert set(got) == {"tgl", "fastopt-host"} and got["tgl"]["reference"] == "fastopt"
    assert got["fastopt-host"]["median"] == pytest.approx(1.2) and got["fastopt-host"]["min"] == pytest.approx(1.0)
    assert got["fastopt-host"]["max"] == pytest.approx(1.5) and got["fastopt-host"]["pairs"] == 3
    assert paired_ratios([tgl, host])["fastopt-host"]["reference"] == "tgl"
    assert paired_ratios([fast]) == {} and paired_ratios([fast, BenchResult("eager", epoch_seconds=[1.0])]) == {}
    # PyG's TGN trains on its own, never in turns: neither a reference nor compared
    pyg = BenchResult("pyg", epoch_seconds=[5.0, 4.0, 4.0, 4.0])
    assert set(paired_ratios([pyg, tgl, host])) == {"fastopt-host"} and "pyg" not in paired_ratios([fast, pyg])
    assert format_ratios(got).splitlines()[1] == "fastopt-host / fastopt, epoch by epoch: median 1.20x (min 1.00, max 1.50, 3 pairs)"


def test_bench_rejects_unknown_contenders(capsys):
    assert main(["bench", "--contenders", "eager,tensorflow", "--device", "cpu"]) == 2
    assert "unknown contender" in capsys.readouterr().err


def test_no_command_and_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "choose a command: train, bench, tune, export, configs or data" in err and "cmd" not in err
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("fastopt 0.")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "one of tgn, tgat, jodie, apan" in capsys.readouterr().out


def run_module(*args, **popen):
    """``python -m fastopt ARGS`` in a fresh process."""
    return subprocess.Popen([sys.executable, "-m", "fastopt", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def test_python_dash_m_runs_the_command():
    proc = run_module("--version")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.startswith("fastopt ") and not err


def test_closed_pipe_ends_quietly(tiny_file):
    """``fastopt data info FILE | head -0``: the reader is gone before the first line."""
    proc = run_module("data", "info", str(tiny_file))
    proc.stdout.close()  # no reader left: the command's first write meets a broken pipe
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err and err == ""
    assert proc.returncode == 141


@pytest.fixture
def fresh_env_config(monkeypatch):
    """The process defaults read again from the environment on next use (restored after)."""
    from fastopt import config as fconfig

    monkeypatch.setattr(fconfig, "_DEFAULT", None)
    return monkeypatch


TRAIN = ["train", "--model", "jodie", "--epochs", "1", "--batch-size", "500", "--device", "cpu",
         "--mrr-negatives", "0", "--no-progress", "--memory-dim", "8", "--dim", "8", "--time-dim", "4"]


def test_config_file_missing_malformed_or_misspelled(tiny_file, tmp_path, capsys):
    base = TRAIN + ["--dataset", str(tiny_file)]
    missing = tmp_path / "nope.json"
    assert main(base + ["--config", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"fastopt: error: config file '{missing}' does not exist" in err and "Traceback" not in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"train": {"epochs": 2,}}')
    assert main(base + ["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "is not valid JSON" in err and "line 1, column 24" in err and str(bad) in err
    bad.write_text('{"train": {"epoch": 2}}')
    assert main(base + ["--config", str(bad)]) == 2
    assert "did you mean 'train.epochs'" in capsys.readouterr().err


def test_config_file_and_flags_set_model_hyperparameters(tiny_file, tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"model": {"memory_dim": 12, "dim": 6}, "train": {"seed": 3}}))
    log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
    argv = ["train", "--dataset", str(tiny_file), "--model", "jodie", "--epochs", "1", "--batch-size", "500",
            "--device", "cpu", "--mrr-negatives", "0", "--no-progress", "--config", str(cfg),
            "--dim", "10", "--log", str(log), "--checkpoint-dir", str(ckpt)]
    monkeypatch.setattr(sys, "argv", ["/venv/bin/fastopt"] + argv)  # as the console script runs it
    assert main(argv) == 0
    capsys.readouterr()
    run = json.loads(log.read_text().splitlines()[0])
    assert run["config"]["model"]["memory_dim"] == 12 and run["config"]["model"]["dim"] == 10  # the flag wins
    assert run["seed"] == 3 and run["command"].startswith("fastopt train --dataset") and run["start"]
    weights = torch.load(ckpt / "checkpoint.pt", weights_only=True)["model"]
    assert tuple(weights["out.weight"].shape) == (10, 12)


@pytest.mark.parametrize("flags,fragment", [
    (["--model", "tgat", "--heads", "3"], "does not divide into 3 heads"),
    (["--model", "jodie", "--heads", "4"], "model.heads=4 does not apply to jodie"),
    (["--model", "tgn", "--fanouts", "10,0"], "--fanouts 10,0: model.fanouts must be"),
    (["--model", "tgn", "--dropout", "1.5"], "model.dropout must be in [0, 1)"),
    (["--model", "tgn", "--patience", "-1"], "train.patience must be >= 0"),
    (["--model", "tgat", "--node-embedding", "-1"], "model.node_embedding must be >= 0"),
])
def test_bad_model_flags(tiny_file, flags, fragment, capsys):
    assert main(["train", "--dataset", str(tiny_file), "--device", "cpu", "--no-progress"] + flags) == 2
    assert fragment in capsys.readouterr().err


def test_node_embedding_flag_and_the_note_without_it(tmp_path, capsys):
    """On a featureless graph TGAT without --node-embedding gets a note naming the flag; with it
    the checkpoint holds a row of that width per node."""
    from fastopt.data import TemporalGraph

    rng = np.random.default_rng(0)
    src = rng.integers(0, 20, 600)
    path = tmp_path / "featureless.npz"
    save_npz(TemporalGraph(src, 20 + src, np.sort(rng.uniform(0, 1e4, 600)), 40), path)
    base = ["train", "--dataset", str(path), "--model", "tgat", "--epochs", "1", "--dim", "8",
            "--time-dim", "4", "--fanouts", "3,2", "--device", "cpu", "--mrr-negatives", "0",
            "--no-progress"]
    assert main(base) == 0
    assert "--node-embedding 100 --lr 1e-3 gives every node a learnable row" in capsys.readouterr().err
    assert main(base + ["--node-embedding", "6", "--checkpoint-dir", str(tmp_path / "ckpt")]) == 0
    assert "--node-embedding" not in capsys.readouterr().err
    weights = torch.load(tmp_path / "ckpt" / "checkpoint.pt", weights_only=True)["model"]
    assert tuple(weights["node_embedding.weight"].shape) == (40, 6)


def test_resume_with_another_model_is_refused(tiny_file, tmp_path, capsys):
    base = TRAIN + ["--dataset", str(tiny_file), "--checkpoint-dir", str(tmp_path)]
    assert main(base) == 0
    capsys.readouterr()
    other = ["train", "--dataset", str(tiny_file), "--model", "tgn", "--device", "cpu", "--no-progress",
             "--resume", str(tmp_path / "checkpoint.pt")]
    assert main(other) == 2
    err = capsys.readouterr().err
    assert "holds the weights of another model" in err and "missing gru." in err and "Traceback" not in err
    assert main(base[:-2] + ["--dim", "16", "--resume", str(tmp_path / "checkpoint.pt")]) == 2
    assert "shapes (saved vs this model) predictor.src_fc.weight (8, 8) vs (16, 16)" in capsys.readouterr().err


def test_bad_environment_value_names_the_variable(tiny_file, fresh_env_config, capsys):
    fresh_env_config.setenv("FASTOPT_TRAIN_EPOCHS", "many")
    assert main(["data", "info", str(tiny_file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastopt: error: environment variable FASTOPT_TRAIN_EPOCHS='many'")
    assert "train.epochs must be of type int" in err and "unset FASTOPT_TRAIN_EPOCHS" in err


def test_misspelled_environment_variable_is_reported(tiny_file, fresh_env_config, capsys):
    fresh_env_config.setenv("FASTOPT_SAMPLER_THREAD", "2")
    assert main(["data", "info", str(tiny_file)]) == 0
    err = capsys.readouterr().err
    assert "fastopt: warning: environment variable FASTOPT_SAMPLER_THREAD is not a fastopt setting" in err
    assert "did you mean FASTOPT_SAMPLER_THREADS?" in err


def test_data_info_formats_numbers_one_way(capsys):
    assert main(["data", "info", "wikipedia"]) == 0
    lines = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert lines["events"] == "157,474" and lines["time_span"] == "2,678,373"
    assert lines["degree_max"] == "1,937" and lines["degree_p99"] == "358.2"


def test_bench_contenders_differ_only_where_they_say():
    """fastopt-host is fastopt with the features in host memory; tgl is eager gathering on the
    host per slot; eager keeps its tables on the device."""
    from fastopt.benchmark import _contender_config
    from fastopt.config import Config

    base = Config()
    fast, host = _contender_config(base, "fastopt"), _contender_config(base, "fastopt-host")
    assert host.cache.placement == "host" and host.train.optimize == fast.train.optimize == "on"
    host.cache.placement = fast.cache.placement
    assert host.to_dict() == fast.to_dict()
    tgl = _contender_config(base, "tgl")
    assert (tgl.cache.placement, tgl.sampler.dedup, tgl.cache.budget_fraction, tgl.train.optimize) == \
        ("host", False, 0.0, "off")
    assert _contender_config(base, "eager").cache.placement == "device"
