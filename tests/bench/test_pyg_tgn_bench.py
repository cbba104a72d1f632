"""bench/pyg_tgn.py and the check it rests on (``verify_modules``): pass on the optimized
modules, fail with status 1 on a wrong one."""

from __future__ import annotations

import importlib.util
import json

import pytest

import fastopt
import fastopt.config as fconfig
from bench_scripts import load
from fastopt.baselines.pyg_tgn import verify_modules
from fastopt.data import load_dataset

# Not imported here: importing torch_geometric imports triton, which must not happen before
# tests/codegen/conftest.py sets TRITON_INTERPRET (this folder is collected first).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch_geometric") is None,
                                reason='needs torch_geometric (pip install "fastopt[pyg]")')

EVENTS = 3000


@pytest.fixture(autouse=True)
def fused_on_the_cpu():
    """The fused paths' references on the CPU (``auto`` runs the layers' own code there)."""
    with fconfig.patch(kernels__backend="reference"):
        yield


@pytest.fixture(scope="module")
def small():
    from fastopt.data import TemporalGraph

    g = load_dataset("wikipedia", edge_dim=8)
    return TemporalGraph(g.src[:EVENTS], g.dst[:EVENTS], g.ts[:EVENTS], g.num_nodes,
                         edge_feat=g.edge_feat[:EVENTS], name="wikipedia-head")


def _wrong(module):
    """fastopt.optimize, then a memory whose GRU input is off by a little."""
    out = fastopt.optimize(module)
    if hasattr(out, "gru"):
        gru = out.gru
        original = gru.forward
        gru.forward = lambda x, h: original(x * 1.001, h)
    return out


def test_verify_modules_accepts_fastopt_and_rejects_a_wrong_memory(small):
    ok = verify_modules(small, fastopt.optimize, batch_size=200, steps=4, memory_dim=16,
                        time_dim=8, embedding_dim=16)
    assert ok["ok"] and ok["steps"] == 4, ok
    bad = verify_modules(small, _wrong, batch_size=200, steps=4, memory_dim=16, time_dim=8,
                         embedding_dim=16)
    assert not bad["ok"] and bad["first_mismatch"], bad


def test_verify_modules_compares_the_fused_layer_with_dropout_drawing_the_same_masks(small):
    import fastopt.config as fconfig

    with fconfig.patch(kernels__backend="reference"):  # the fused TransformerConv on the CPU
        ok = verify_modules(small, fastopt.optimize, batch_size=200, steps=3, memory_dim=16,
                            time_dim=8, embedding_dim=16)
    assert ok["ok"] and ok["largest"]["logits"] < 1e-4, ok


def _args(tmp_path):
    return ["--device", "cpu", "--events", str(EVENTS), "--edge-dim", "8", "--batch-size", "200",
            "--epochs", "1", "--iters", "1", "--warmup", "0", "--conv-batch", "3",
            "--verify-steps", "2", "--seeds", "0", "1", "--json", str(tmp_path / "out.json")]


def test_bench_passes_and_records(tmp_path):
    script = load("pyg_tgn")
    assert script.main(_args(tmp_path)) == 0
    record = json.loads((tmp_path / "out.json").read_text())
    assert record["model_check"]["ok"] and record["transformer_conv"]["ok"]
    assert record["transformer_conv"]["eager_ms"] > 0 and record["epoch_speedup"] > 0
    assert set(record["epochs"]) == {"pyg", "fastopt"} and record["seeds"] == [0, 1]
    assert all(len(runs) == 2 for runs in record["epochs"].values())
    assert len(record["test_ap"]["fastopt"]) == 2
    assert "git_commit" in record and record["gpu"] is None


def test_control_runs_the_example_perturbed_at_rounding_level(tmp_path, monkeypatch):
    """--control adds, per seed, PyG's example with its initial parameters scaled by 1 + 1e-7 N(0,1)
    (its own generator), and records its AP gap to the plain example."""
    import fastopt.baselines.pyg_tgn as baseline

    script, scaled = load("pyg_tgn"), []
    real = baseline.run_pyg_tgn

    def run(*args, perturb=0.0, **kwargs):
        scaled.append(perturb)
        return real(*args, perturb=perturb, **kwargs)

    monkeypatch.setattr(script, "run_pyg_tgn", run)
    assert script.main(_args(tmp_path) + ["--control"]) == 0
    record = json.loads((tmp_path / "out.json").read_text())
    assert set(record["epochs"]) == {"pyg", "fastopt", "pyg-control"}
    assert scaled == [0.0, 0.0, script.CONTROL_PERTURBATION] * 2  # per seed, PyG first
    ap = record["test_ap"]
    assert record["control_ap_points"] == pytest.approx(
        100 * (sum(ap["pyg-control"]) - sum(ap["pyg"])) / 2)


def test_ap_study_pairs_each_contender_with_pyg_by_seed(tmp_path, monkeypatch):
    """--ap-seeds trains the three contenders once per seed (no timing) and reports each gap to
    PyG per seed, with its mean and standard error; the runs take the modules and perturbation
    of their label."""
    script = load("pyg_tgn")
    seen = []

    def run(graph, *, seed, modules, perturb, **kwargs):
        seen.append((seed, modules is fastopt.optimize, perturb))
        ap = 0.8 + 0.01 * seed + (0.002 if modules else 0.0) + perturb * 1e4
        return {"test": {"ap": ap}, "val": {"ap": ap}, "loss": [0.5]}

    monkeypatch.setattr(script, "run_pyg_tgn", run)
    argv = _args(tmp_path)
    del argv[argv.index("--seeds"):argv.index("--seeds") + 3]
    assert script.main(argv + ["--skip-epochs", "--ap-seeds", "3", "5", "--jobs", "1"]) == 0
    study = json.loads((tmp_path / "out.json").read_text())["ap_study"]
    control = script.CONTROL_PERTURBATION
    assert sorted(seen) == sorted([(s, f, p) for s in (3, 5) for f, p in
                                   ((False, 0.0), (True, 0.0), (False, control))])
    gap = study["fastopt_minus_pyg"]
    assert gap["per_seed"] == pytest.approx([0.2, 0.2]) and gap["mean"] == pytest.approx(0.2)
    assert gap["standard_error"] == pytest.approx(0.0, abs=1e-9)
    assert study["control_minus_pyg"]["mean"] == pytest.approx(100 * control * 1e4)
    assert len(study["runs"]) == 6 and study["seeds"] == [3, 5]


def test_ap_studies_of_several_calls_merge(tmp_path, capsys):
    """--ap-merge alone combines earlier calls' runs, from their JSON or from the per-run lines
    of a log a time limit cut short, over the seeds every contender finished (a seed run again
    keeps its later run); the gaps are paired by seed as in one call."""
    script = load("pyg_tgn")
    runs = [{"label": label, "seed": seed, "test_ap": 0.8 + 0.01 * seed + bump}
            for seed in (0, 1) for label, bump in (("pyg", 0.0), ("fastopt", 0.003), ("pyg-control", 0.001))]
    (tmp_path / "a.json").write_text(json.dumps({"ap_study": {"runs": runs}}))
    log = ["  run pyg          seed   2: test AP 0.8200", "  run fastopt      seed   2: test AP 0.8250",
           "  run pyg-control  seed   2: test AP 0.8210", "  run pyg          seed   3: test AP 0.9000",
           "  run fastopt      seed   1: test AP 0.8140", "unrelated line"]
    (tmp_path / "b.log").write_text("\n".join(log))
    out = tmp_path / "merged.json"
    assert script.main(["--device", "cpu", "--ap-merge", str(tmp_path / "a.json"), str(tmp_path / "b.log"),
                        "--json", str(out)]) == 0
    study = json.loads(out.read_text())["ap_study"]
    assert study["seeds"] == [0, 1, 2]  # seed 3 has PyG's run alone
    assert study["fastopt_minus_pyg"]["per_seed"] == pytest.approx([0.3, 0.4, 0.5])
    assert study["control_minus_pyg"]["mean"] == pytest.approx(0.1)
    assert "3 seeds" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        script.main(["--device", "cpu", "--ap-merge", str(tmp_path / "nothing.log")])


def test_ap_labels_train_some_contenders_and_pair_them_with_merged_runs(tmp_path, monkeypatch):
    """--ap-labels fastopt trains only fastopt's runs; its gaps pair with PyG's runs of an
    earlier call (--ap-merge) by seed, and the control's gap comes from the merged runs alone,
    over the seeds it has."""
    script = load("pyg_tgn")
    seen = []

    def run(graph, *, seed, modules, perturb, **kwargs):
        seen.append((seed, modules is fastopt.optimize))
        return {"test": {"ap": 0.9 + 0.01 * seed}, "val": {"ap": 0.9}, "loss": [0.5]}

    monkeypatch.setattr(script, "run_pyg_tgn", run)
    earlier = [{"label": label, "seed": seed, "test_ap": 0.9 + 0.01 * seed - bump}
               for seed in (0, 1, 2) for label, bump in (("pyg", 0.002), ("pyg-control", 0.001))]
    earlier += [{"label": "fastopt", "seed": 0, "test_ap": 0.1}]  # replaced by this call's run
    (tmp_path / "a.json").write_text(json.dumps({"ap_study": {"runs": earlier}}))
    argv = _args(tmp_path)
    del argv[argv.index("--seeds"):argv.index("--seeds") + 3]
    assert script.main(argv + ["--skip-epochs", "--ap-seeds", "0", "1", "--ap-labels", "fastopt",
                               "--jobs", "1", "--ap-merge", str(tmp_path / "a.json")]) == 0
    assert sorted(seen) == [(0, True), (1, True)]
    study = json.loads((tmp_path / "out.json").read_text())["ap_study"]
    assert study["fastopt_minus_pyg"]["seeds"] == [0, 1]
    assert study["fastopt_minus_pyg"]["per_seed"] == pytest.approx([0.2, 0.2])
    assert study["control_minus_pyg"]["seeds"] == [0, 1, 2]
    assert study["control_minus_pyg"]["mean"] == pytest.approx(0.1)
    assert study["seeds"] == [0, 1]


def test_bench_fails_on_a_wrong_layer(tmp_path, monkeypatch):
    script = load("pyg_tgn")
    from fastopt.passes import pyg_conv

    real = pyg_conv.transformer_conv
    monkeypatch.setattr(pyg_conv, "transformer_conv", lambda *a: real(*a) * 1.001)
    assert script.main(_args(tmp_path)) == 1
    record = json.loads((tmp_path / "out.json").read_text())
    assert not record["model_check"]["ok"] or not record["transformer_conv"]["ok"]
    assert "epochs" not in record


@pytest.mark.parametrize("argv, message", [
    (["--device", "foo"], "--device 'foo' is not a torch device"),
    (["--epochs", "0"], "--epochs must be >= 1 (got 0)"),
])
def test_bad_arguments_exit_with_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        load("pyg_tgn").main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
