"""Every benchmark fails on a wrong result: each test injects one and shows the script's status."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bench_scripts import load


# ---------------------------------------------------------------------------- bench/optimize.py
def _wrong_attention_gradient(monkeypatch, wrong_backward):
    """The optimized models' fused attention with its gradient 1 % too large (outputs right)."""
    from fastopt.passes import attention

    real = attention.fused_attention
    monkeypatch.setattr(attention, "fused_attention",
                        lambda *a, **kw: wrong_backward.apply(real(*a, **kw)))


def _record(path, **fields):
    """bench/_meta.py's write_record without what it asks the GPU and git: the fields alone."""
    Path(path).write_text(json.dumps(fields))


def _on_cpu(monkeypatch, name: str, timer: str, untimed):
    """bench/<name>.py on the CPU: its own columns and checks, its CUDA timing function ``timer``
    replaced by ``untimed`` and its record by :func:`_record`."""
    script = load(name)
    monkeypatch.setattr(script, "cuda_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(script, timer, untimed)
    monkeypatch.setattr(script, "write_record", _record)
    return script


def _cpu_optimize_bench(monkeypatch):
    """bench/optimize.py with the CUDA-event timing replaced by one step per column."""
    def untimed(columns, inputs, warmup, iters, rounds=1, params=()):
        for fn, _ in columns.values():
            fn(inputs).sum().backward()
        return {name: 1.0 for name in columns}

    return _on_cpu(monkeypatch, "optimize", "_times", untimed)


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
    _wrong_attention_gradient(monkeypatch, wrong_backward)
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


@pytest.mark.parametrize("policy", ["lru", "zero_copy"])
def test_slimcache_bench_fails_when_a_served_row_is_wrong(monkeypatch, tmp_path, capsys, policy):
    """A staged lookup or a zero-copy read that serves one wrong row fails the run."""
    import fastopt.codegen as cg
    from fastopt.runtime import table_cache

    script = load("slimcache")
    args = _slimcache_args(tmp_path)
    args[args.index("lru")] = policy
    if policy == "zero_copy":
        real = cg.cached_rows

        def off_by_one(ids, slot_map, slots, table, out=None):
            rows = real(ids, slot_map, slots, table, out)
            rows[-1] += 1.0
            return rows

        monkeypatch.setattr(cg, "cached_rows", off_by_one)
    else:
        real = table_cache.TableCache.finish

        def finish(self, pending, transfer):
            served = real(self, pending, transfer)
            if self.name == "edge_feat":
                served.rows[-1] += 1.0
            return served

        monkeypatch.setattr(table_cache.TableCache, "finish", finish)
    assert script.main(args) == 1
    # one wrong row in each of the 5 batches (zero-copy: and in the hot set its install read)
    import re

    found = re.search(rf"policy {policy}: (\d+) served edge rows differ", capsys.readouterr().out)
    assert found and int(found.group(1)) >= 5


# ---------------------------------------------------------------------------- bench/projections.py
def _cpu_projections_bench(monkeypatch, matmul):
    """bench/projections.py on the CPU: its products and checks, ``matmul`` standing in for the
    generated kernels (which need a GPU or Triton's interpreter), each variant run once untimed."""
    script = load("projections")

    class Untimed:
        def __init__(self, *args):
            pass

        def __call__(self, fn, sets):
            for i in range(sets):
                fn(i)
            return 1.0

    monkeypatch.setattr(script, "cuda_device", lambda name: torch.device("cpu"))
    monkeypatch.setattr(script, "GraphTimer", Untimed)
    monkeypatch.setattr(script, "matmul", matmul)
    return script


def _off(out, factor: float = 1.001):
    """A product (and its row sums) with the product ``factor`` times too large."""
    return (out[0] * factor, out[1]) if isinstance(out, tuple) else out * factor


_PROJECTION_ARGS = ["--rows", "64", "--tiles", "64,64,32,4"]


def test_projections_bench_passes_on_right_products(monkeypatch, capsys):
    torch_mm = load("projections")._torch_mm
    script = _cpu_projections_bench(monkeypatch, lambda a, b, precision, **kw: torch_mm(a, b, **kw))
    # 1e-3 off, as TF32's one rounded pass is: the scale column is not held to --max-error
    monkeypatch.setattr(script, "_torch_tf32_mm", lambda *a, **kw: _off(torch_mm(*a, **kw)))
    assert script.main(_PROJECTION_ARGS) == 0
    assert "WRONG RESULT" not in capsys.readouterr().out


def test_projections_bench_fails_on_a_wrong_or_failing_variant(monkeypatch, capsys):
    torch_mm = load("projections")._torch_mm

    def kernels(a, b, precision, **kwargs):
        if precision == "ieee":
            raise RuntimeError("no kernel for this tile")
        return _off(torch_mm(a, b, **kwargs))

    script = _cpu_projections_bench(monkeypatch, kernels)
    assert script.main(_PROJECTION_ARGS) == 1
    wrong = [line for line in capsys.readouterr().out.splitlines() if "WRONG RESULT" in line]
    assert ("WRONG RESULT: fwd_free tf32x3 64,64,32,4: relative error 0.001 against float64 "
            "exceeds --max-error 0.0001") in wrong
    assert "WRONG RESULT: bwd_dx ieee 64,64,32,4: raised RuntimeError: no kernel for this tile" \
        in wrong
    assert len(wrong) == 2 * len(script.PRODUCTS)  # the torch columns are right
    rows = [{"product": "p", "torch tf32": {"ms": 1.0, "max_rel_error": float("nan")}}]
    assert script.accuracy_failures(rows, 1e-4) == ["p torch tf32: relative error against "
                                                    "float64 is nan"]  # NaN is no pass


# ---------------------------------------------------------------------------- bench/step_breakdown.py
def _cpu_step_breakdown(monkeypatch):
    """bench/step_breakdown.py with the CUDA-graph timing replaced by one step."""
    def untimed(fast, inputs, warmup, iters):
        fast(inputs).sum().backward()
        return {"step_ms": 1.0}

    return _on_cpu(monkeypatch, "step_breakdown", "breakdown", untimed)


def _step_breakdown_args(tmp_path):
    return ["--models", "tgat", "--roots", "12", "--num-nodes", "50", "--edge-dim", "6",
            "--json", str(tmp_path / "breakdown.json")]


def test_step_breakdown_times_a_model_that_agrees_with_eager(monkeypatch, tmp_path, capsys):
    script = _cpu_step_breakdown(monkeypatch)
    assert script.main(_step_breakdown_args(tmp_path)) == 0
    (row,) = json.loads((tmp_path / "breakdown.json").read_text())["results"]
    assert row["verified"].startswith("outputs+grads within") and row["step_ms"] == 1.0
    assert "WRONG RESULT" not in capsys.readouterr().out


def test_step_breakdown_fails_on_a_wrong_gradient(monkeypatch, tmp_path, capsys, wrong_backward):
    script = _cpu_step_breakdown(monkeypatch)
    _wrong_attention_gradient(monkeypatch, wrong_backward)
    assert script.main(_step_breakdown_args(tmp_path)) == 1
    assert "WRONG RESULT: tgat: call 0: grad " in capsys.readouterr().out
    (row,) = json.loads((tmp_path / "breakdown.json").read_text())["results"]
    assert row["verified"].startswith("FAILED") and "step_ms" not in row  # not timed


# ---------------------------------------------------------------------------- bench/epoch_profile.py
def _small_epoch_profile(monkeypatch, wikipedia):
    """bench/epoch_profile.py on the first 1,500 events of wikipedia, optimized on the CPU too."""
    from fastopt import trainer
    from fastopt.data import TemporalGraph

    script = load("epoch_profile")
    small = TemporalGraph(wikipedia.src[:1500], wikipedia.dst[:1500], wikipedia.ts[:1500],
                          wikipedia.num_nodes, name="wikipedia-head")
    monkeypatch.setattr(script, "load_dataset", lambda name, edge_dim: small.with_random_features(
        edge_dim=edge_dim))
    monkeypatch.setattr(trainer, "wants_optimize",
                        lambda config, device: config.train.optimize != "off")
    return script


_EPOCH_ARGS = ["--model", "tgat", "--batch-size", "300", "--edge-dim", "6", "--rows", "3"]


def test_epoch_profile_profiles_a_model_that_agrees_with_eager(monkeypatch, wikipedia, capsys):
    script = _small_epoch_profile(monkeypatch, wikipedia)
    assert script.main(_EPOCH_ARGS) == 0
    out = capsys.readouterr().out
    assert "profiled epoch" in out and "WRONG RESULT" not in out


def test_idle_report_counts_the_time_no_kernel_runs():
    """Overlapping kernels (two streams) are one busy stretch; the gaps between stretches are the
    idle time, the longest first, named by the kernels around them."""
    report = load("epoch_profile").idle_report
    kernels = [(0, 100, "a"), (50, 120, "b"), (200, 260, "c"), (230, 240, "d"), (1260, 1300, "e")]
    text = report(kernels, rows=2)
    assert text.splitlines()[0] == "device idle: 1.1 ms of 1.3 ms (83.1 %) in 2 gaps, 2 of them over 50 us; the longest:"
    assert text.splitlines()[1].split() == ["1.000", "ms", "at", "+0.3", "ms", "after", "c", "before", "e"]
    assert text.splitlines()[2].split() == ["0.080", "ms", "at", "+0.1", "ms", "after", "b", "before", "c"]
    assert report([], rows=3) == "device idle: no kernel was recorded"


def test_api_report_sums_each_threads_cuda_calls_training_thread_first():
    report = load("epoch_profile").api_report
    calls = [(7, "cudaMemcpyAsync", 40.0), (7, "cudaMemcpyAsync", 60.0), (3, "cudaGraphLaunch", 300.0),
             (7, "cuLaunchKernelEx", 500.0), (3, "cudaLaunchKernel", 10.0)]
    lines = report(calls, training=3, rows=1).splitlines()
    assert lines[0] == "CUDA API host time by thread:"
    assert lines[1].split() == ["training:", "0.3", "ms", "in", "2", "calls"]
    assert lines[2].split() == ["cudaGraphLaunch", "0.3", "ms", "1", "calls", "300.0", "us", "each"]
    assert lines[3].split() == ["thread", "7:", "0.6", "ms", "in", "3", "calls"]
    assert lines[4].split() == ["cuLaunchKernelEx", "0.5", "ms", "1", "calls", "500.0", "us", "each"]
    assert len(lines) == 5
    assert report([], training=3, rows=2) == "CUDA API: no call was recorded"
    api = load("epoch_profile")._CUDA_API
    assert api.match("cudaLaunchKernel") and api.match("cuLaunchKernelEx") and not api.match("cutlass::Kernel2")


def test_profiler_options_record_the_staging_threads_operators_under_their_own_ids():
    """Without them the profiler records only the collecting thread's operators: a staging
    thread's would be missing and its CUDA calls counted as the training thread's."""
    import threading

    import torch

    options = load("epoch_profile").profiler_options()
    assert options, "this torch should record every thread's operators"

    def stage():
        with torch.profiler.record_function("epoch_profile::stage"):
            torch.ones(3).sum()

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], **options) as prof:
        with torch.profiler.record_function("epoch_profile::training_thread"):
            pass
        worker = threading.Thread(target=stage)
        worker.start()
        worker.join()
    threads = {e.name: e.thread for e in prof.events()}
    assert "epoch_profile::stage" in threads and "aten::sum" in threads
    assert threads["epoch_profile::stage"] == threads["aten::sum"] != threads["epoch_profile::training_thread"]


def test_epoch_profile_fails_on_a_wrong_gradient(monkeypatch, wikipedia, capsys, wrong_backward):
    script = _small_epoch_profile(monkeypatch, wikipedia)
    _wrong_attention_gradient(monkeypatch, wrong_backward)
    assert script.main(_EPOCH_ARGS) == 1
    out = capsys.readouterr().out
    assert "WRONG RESULT: optimized tgat: call 0: grad " in out and "profiled epoch" not in out


def test_epoch_profile_fails_on_a_non_finite_loss(monkeypatch, wikipedia, capsys):
    script = _small_epoch_profile(monkeypatch, wikipedia)
    real = torch.nn.functional.binary_cross_entropy_with_logits
    monkeypatch.setattr(torch.nn.functional, "binary_cross_entropy_with_logits",
                        lambda *a, **kw: real(*a, **kw) * float("nan"))
    assert script.main(_EPOCH_ARGS + ["--no-optimize"]) == 1
    out = capsys.readouterr().out
    assert "WRONG RESULT: epoch 0's mean loss is nan" in out and "profiled epoch" not in out


def test_epoch_profile_pipeline_lines_and_its_checks(monkeypatch, wikipedia, capsys, wrong_backward):
    """``--pipeline N``: a line per epoch with the producer's seconds; a model that disagrees
    with eager after them, or a non-finite loss, fails it."""
    script = _small_epoch_profile(monkeypatch, wikipedia)
    assert script.main(_EPOCH_ARGS + ["--pipeline", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in lines] == ["epoch 0", "epoch 1"]
    for line in lines:
        sampling = float(line.split("sampling ")[1].split()[0])
        staging = float(line.split("staging ")[2].split()[0])  # the first is "staging threads"
        finishing = float(line.split("finishing ")[1].split()[0])
        seconds = float(line.split(": ")[1].split()[0])
        # finishing a few small batches can print as 0.000 s
        assert 0 < sampling < seconds and 0 <= staging < seconds and 0 <= finishing < seconds
        assert "minor faults" in line and "padded lengths" in line
    _wrong_attention_gradient(monkeypatch, wrong_backward)
    assert script.main(_EPOCH_ARGS + ["--pipeline", "1"]) == 1
    assert "WRONG RESULT: optimized tgat" in capsys.readouterr().out
    real = torch.nn.functional.binary_cross_entropy_with_logits
    monkeypatch.setattr(torch.nn.functional, "binary_cross_entropy_with_logits",
                        lambda *a, **kw: real(*a, **kw) * float("nan"))
    assert script.main(_EPOCH_ARGS + ["--no-optimize", "--pipeline", "1"]) == 1
    assert "WRONG RESULT: epoch 0's mean loss is nan" in capsys.readouterr().out


# ---------------------------------------------------------------------------- bench/slimcache_loader.py
@pytest.mark.parametrize("form", [[], ["--edge-rows"]])
def test_slimcache_loader_bench_passes_and_fails_on_wrong_rows(monkeypatch, tmp_path, capsys, form):
    """The loader-path cache bench checks every run's served rows against the loader without a
    cache (rows per slot, or unique rows and an index): equal rows pass; a cache that serves one
    row wrong fails with status 1."""
    from fastopt.runtime import table_cache

    script = load("slimcache_loader")
    monkeypatch.setattr(script, "write_record", _record)
    argv = ["--streams", "tgn", "--policies", "lru", "--json", str(tmp_path / "loader.json")] + form
    assert script.main(argv) == 0
    (truth, row) = json.loads((tmp_path / "loader.json").read_text())["rows"]
    assert row["crc"] == truth["crc"] and 0.0 < row["hit_rate"] < 1.0 and row["mb_h2d"] > 0
    capsys.readouterr()

    real = table_cache.TableCache.finish

    def wrong(self, pending, transfer):
        out = real(self, pending, transfer)
        out.rows[-1] += 1.0  # one served row off
        return out

    monkeypatch.setattr(table_cache.TableCache, "finish", wrong)
    assert script.main(argv) == 1
    assert "WRONG RESULT: tgn lru depth 2" in capsys.readouterr().out


# ---------------------------------------------------------------------------- bench/cache_directory.py
def test_cache_directory_bench_passes_and_fails_when_the_ranking_is_wrong(monkeypatch, tmp_path, capsys):
    """Both ways of finding eviction candidates agree on a small cache; a ranking that hands out
    the wrong residents (the smallest keys instead of the largest) fails the run."""
    from fastopt.runtime.cache_policy import RankedSlots

    script = load("cache_directory")
    args = ["--sizes", "3000:500", "--policies", "future", "lru", "--json", str(tmp_path / "d.json")]
    assert script.main(args) == 0
    record = json.loads((tmp_path / "d.json").read_text())
    assert len(record["results"]) == 4 and record["wrong"] == []
    real = RankedSlots.largest

    def smallest(self, n):
        slots, keys = real(self, self.key.size)
        order = np.argsort(keys, kind="stable")[:n]
        return slots[order], keys[order]

    monkeypatch.setattr(RankedSlots, "largest", smallest)
    assert script.main(args) == 1
    assert "WRONG RESULT: future 3000 slots" in capsys.readouterr().out


# ---------------------------------------------------------------------------- bench/read_cost.py
def test_read_cost_bench_passes_and_fails_on_wrong_rows(monkeypatch, wikipedia, tmp_path, capsys):
    """The read-cost bench times each path's reads of the same batches and checks every path's
    rows against the device table's: equal rows pass (a row per path, per slot for TGN); a
    zero-copy read that returns one row wrong fails with status 1."""
    import types

    from fastopt.data import TemporalGraph

    script = load("read_cost")
    small = TemporalGraph(wikipedia.src[:1500], wikipedia.dst[:1500], wikipedia.ts[:1500], wikipedia.num_nodes,
                          name="wikipedia-head")
    monkeypatch.setattr(script, "load_dataset", lambda name, edge_dim: small.with_random_features(edge_dim=edge_dim))
    monkeypatch.setattr(script, "write_record", _record)
    argv = ["--device", "cpu", "--batch-size", "200", "--edge-dim", "6", "--budgets", "0", "0.5",
            "--json", str(tmp_path / "read.json")]
    assert script.main(argv) == 0
    rows = json.loads((tmp_path / "read.json").read_text())["results"]
    assert [r["path"] for r in rows] == ["device", "device + per slot", "zero_copy@0", "zero_copy@0 + per slot",
                                         "zero_copy@0.5", "zero_copy@0.5 + per slot"]
    assert all(r["seconds"] > 0 for r in rows)
    capsys.readouterr()
    real = script.cached_rows

    def bind(slot_map, slots, table):
        read = real.bind(slot_map, slots, table)
        return lambda ids: read(ids) + (ids == ids.max()).unsqueeze(1)  # one row off by one
    monkeypatch.setattr(script, "cached_rows", types.SimpleNamespace(bind=bind))
    assert script.main(argv) == 1
    assert "WRONG RESULT: zero_copy@0's rows of batch" in capsys.readouterr().out
