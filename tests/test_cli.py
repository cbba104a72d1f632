import json

import numpy as np
import pytest

from fastopt.cli import main
from fastopt.data import load_file, resolve_dataset, save_npz


@pytest.fixture
def tiny_file(tmp_path, small_graph):
    path = tmp_path / "tiny.npz"
    save_npz(small_graph, path)
    return path


def test_train_end_to_end(tiny_file, tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    rc = main(["train", "--dataset", str(tiny_file), "--model", "jodie", "--epochs", "1",
               "--batch-size", "300", "--device", "cpu", "--mrr-negatives", "2", "--log", str(log),
               "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["model"] == "jodie" and 0 <= summary["test"]["ap"] <= 1 and "mrr" in summary["test"]
    assert "epoch   0" in out and log.exists()


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
               "--batch-size", "400", "--device", "cpu", "--contenders", "tgl,eager,fastopt",
               "--json", str(out_json), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    record = json.loads(out_json.read_text())
    names = [r["contender"] for r in record["results"]]
    assert names == ["tgl", "eager", "fastopt"]
    for r in record["results"]:
        assert len(r["epoch_seconds"]) == 2 and r["steady_epoch_s"] > 0 and 0 <= r["test_ap"] <= 1
        assert r["verified"]
    # one seed, one initialization, one data path: TGL's path and the device path train identically
    tgl, eager = record["results"][0], record["results"][1]
    assert tgl["test_ap"] == eager["test_ap"] and tgl["val_ap"] == eager["val_ap"]
    assert record["command"] and record["git_commit"] and record["model"] == "tgn"
    assert "contender" in out and "fastopt" in out


def test_bench_rejects_unknown_contenders(capsys):
    assert main(["bench", "--contenders", "eager,tensorflow", "--device", "cpu"]) == 2
    assert "unknown contender" in capsys.readouterr().err
