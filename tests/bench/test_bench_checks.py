"""Every benchmark fails on a wrong result: each test injects one and shows the script's status."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench_scripts import load


# ---------------------------------------------------------------------------- bench/optimize.py
def _cpu_optimize_bench(monkeypatch):
    """bench/optimize.py on the CPU: its own columns and checks, the CUDA-event timing replaced."""
    script = load("optimize")

    def untimed(columns, inputs, warmup, iters, rounds=1, params=()):
        for fn, _ in columns.values():
            fn(inputs).sum().backward()
        return {name: 1.0 for name in columns}

    def record(path, **fields):  # the real one asks the GPU its name
        Path(path).write_text(json.dumps(fields))

    monkeypatch.setattr(script, "cuda_device", lambda name: torch.device("cpu"))
    monkeypatch.setattr(script, "_times", untimed)
    monkeypatch.setattr(script, "write_record", record)
    return script


def _optimize_args(tmp_path):
    return ["--models", "tgat", "--roots", "12", "--num-nodes", "50", "--edge-dim", "6",
            "--no-compile", "--json", str(tmp_path / "optimize.json")]


def test_optimize_bench_passes_on_the_real_kernels(monkeypatch, tmp_path, capsys):
    script = _cpu_optimize_bench(monkeypatch)
    assert script.main(_optimize_args(tmp_path)) == 0
    (row,) = json.loads((tmp_path / "optimize.json").read_text())["results"]
    timed = [k for k in row if k.endswith("_ms") and k != "eager_ms"]
    assert sorted(row["verified"]) == sorted(timed)  # every column it times is checked
    assert all(not v.startswith("FAILED") for v in row["verified"].values())
    assert "WRONG RESULT" not in capsys.readouterr().out


def test_optimize_bench_fails_on_a_wrong_gradient(monkeypatch, tmp_path, capsys, wrong_backward):
    script = _cpu_optimize_bench(monkeypatch)
    from fastopt.passes import attention

    real = attention.fused_attention
    monkeypatch.setattr(attention, "fused_attention",
                        lambda *a, **kw: wrong_backward.apply(real(*a, **kw)))
    assert script.main(_optimize_args(tmp_path)) == 1
    out = capsys.readouterr().out
    assert "WRONG RESULT: tgat fastopt_ms" in out and "grad " in out
    (row,) = json.loads((tmp_path / "optimize.json").read_text())["results"]
    assert row["fastopt_ms"] is None and "speedup_vs_eager" not in row


# ---------------------------------------------------------------------------- bench/kernels.py
def _kernel_errors(script):
    q, k, v, index, mask, _ = script.make_inputs(40, 10, 2, 12, device="cpu")
    result = {"M": 40, "d": 12}
    result.update(script.accuracy(q, k, v, index, mask, 12 ** -0.5, torch.randn_like(q)))
    return result


def test_kernel_bench_accepts_the_fused_op():
    script = load("kernels")
    result = _kernel_errors(script)
    assert set(result["grad_rel_error"]) == {"deterministic", "atomic"}
    assert script.accuracy_failures(result, 1e-4) == []


def test_kernel_bench_fails_a_wrong_forward_or_gradient(monkeypatch, wrong_backward):
    script = load("kernels")
    real = script.fused
    monkeypatch.setattr(script, "fused", lambda *a: real(*a) * 1.001)
    failures = script.accuracy_failures(_kernel_errors(script), 1e-4)
    assert any("forward relative error" in f for f in failures)
    assert any("deterministic backward" in f for f in failures)
    monkeypatch.setattr(script, "fused", lambda *a: wrong_backward.apply(real(*a)))
    failures = script.accuracy_failures(_kernel_errors(script), 1e-4)
    assert failures and not any("forward" in f for f in failures)
    nan = dict(_kernel_errors(script), fwd_rel_error=float("nan"))
    assert any("forward" in f for f in script.accuracy_failures(nan, 1e-4))  # NaN is no pass


def test_kernel_bench_exits_non_zero_on_a_recorded_failure(monkeypatch, capsys):
    script = load("kernels")
    wrong = dict(M=40, d=12, fwd_rel_error=2e-3, grad_rel_error={"deterministic": 0.0})
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(script, "Timer", lambda *a, **kw: None)
    monkeypatch.setattr(script, "copy_bandwidth", lambda timer: 1e12)
    monkeypatch.setattr(script, "run_shape", lambda *a, **kw: wrong)
    monkeypatch.setattr(script, "print_table", lambda *a: None)
    monkeypatch.setattr(script, "record_run", lambda *a, **kw: {})
    assert script.main(["--rows", "40", "--dims", "12", "--no-graph"]) == 1
    assert "WRONG RESULT: M=40 d=12: forward relative error 0.002" in capsys.readouterr().out


# ---------------------------------------------------------------------------- bench/sampler.py
class _LeakySampler:
    """The real sampler whose first-layer neighbor times are one unit late (a leak the oracle sees)."""

    def __init__(self, *args, **kwargs):
        from fastopt.runtime import TemporalSampler

        self.inner = TemporalSampler(*args, **kwargs)
        self.placement = self.inner.placement

    def reset(self):
        self.inner.reset()

    def sample(self, roots, times):
        batch = self.inner.sample(roots, times)
        block = batch.blocks[0]
        block.nbr_times[block.mask] += 1.0
        return batch


def _sampler_args(tmp_path):
    return ["--datasets", "wikipedia", "--max-events", "3000", "--batch", "200", "--threads", "1",
            "--repeats", "1", "--oracle-batches", "2", "--check-batches", "4",
            "--json", str(tmp_path / "sampler.json")]


def test_sampler_bench_agrees_with_the_oracle(tmp_path):
    script = load("sampler")
    assert script.main(_sampler_args(tmp_path)) == 0
    report = json.loads((tmp_path / "sampler.json").read_text())
    assert report["oracle_mismatches"] == [] and len(report["results"]) == 2 * 3  # 2 settings


def test_sampler_bench_fails_on_a_wrong_sample(monkeypatch, tmp_path, capsys):
    script = load("sampler")
    monkeypatch.setattr(script, "TemporalSampler", _LeakySampler)
    assert script.main(_sampler_args(tmp_path)) == 1
    out = capsys.readouterr().out
    assert "WRONG RESULT: wikipedia tgn" in out and "layer 0 nbr_times differs" in out
    assert "WRONG RESULT: wikipedia tgat" in out and "a wrong neighbor time" in out


def test_sampler_check_sees_wrong_uniform_counts(wikipedia):
    from fastopt.runtime import TemporalSampler

    script = load("sampler")
    batches = script.epoch_batches(wikipedia, 200, 0, max_events=2000)[::3]
    sampler = TemporalSampler(wikipedia, [10, 10], "uniform", threads=1)
    assert script.oracle_mismatches(wikipedia, sampler, [10, 10], "uniform", batches, 0) == []

    class DropsOne(_LeakySampler):
        def sample(self, roots, times):  # the last valid neighbor of each full row lost
            batch = self.inner.sample(roots, times)
            batch.blocks[1].mask[:, -1] = False
            return batch

    wrong = script.oracle_mismatches(wikipedia, DropsOne(wikipedia, [10, 10], "uniform", threads=1),
                                     [10, 10], "uniform", batches, 0)
    assert wrong and all("layer 1: neighbor counts differ" in w for w in wrong)


# ---------------------------------------------------------------------------- bench/slimcache.py
def _slimcache_args(tmp_path):
    return ["--datasets", "wikipedia", "--streams", "tgn", "--max-events", "3000", "--budgets", "0.05",
            "--policies", "lru", "--threads", "1", "--json", str(tmp_path / "slimcache.json")]


def test_slimcache_bench_passes_when_every_dirty_row_is_written_back(tmp_path):
    script = load("slimcache")
    assert script.main(_slimcache_args(tmp_path)) == 0
    report = json.loads((tmp_path / "slimcache.json").read_text())
    (memory,) = [r for r in report["results"] if r["table"] == "memory"]
    assert memory["memory_equal"] and report["write_back_mismatches"] == []


def test_slimcache_bench_fails_when_the_flush_loses_rows(monkeypatch, tmp_path, capsys):
    script = load("slimcache")
    monkeypatch.setattr(script.SlimCache, "flush", lambda self: None)  # dirty rows stay on the device
    assert script.main(_slimcache_args(tmp_path)) == 1
    assert "WRONG RESULT: wikipedia tgn budget 0.05 policy lru: host memory" in capsys.readouterr().out
