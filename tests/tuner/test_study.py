"""A real study on a tiny graph: trials run, a failing config is pruned with its reason, a stopped
study resumes from its SQLite file, and the record is exported. Timings are never asserted."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import weakref

import optuna
import pytest
import torch

from fastopt.config import Config
from fastopt.errors import ConfigError, KernelError
from fastopt.tuner import Window, export_record, open_study, tune
from fastopt.tuner import objective
from fastopt.tuner import study as study_module
from fastopt.tuner.objective import TrialTimeout, measure_window
from fastopt.tuner.storage import StudyError, storage_url
from fastopt.tuner.study import default_trainer

WINDOW = Window(warmup=1, timed=3)


@pytest.fixture
def config() -> Config:
    cfg = Config()
    for name, value in {"train.device": "cpu", "model.memory_dim": 8, "model.dim": 8, "model.time_dim": 8,
                        "sampler.threads": 1}.items():
        cfg.set(name, value)
    return cfg


def failing_on(call: int, exc: BaseException, graph):
    """A trainer factory whose ``call``-th trainer (1-based) raises ``exc``."""
    make, calls = default_trainer("tgn", graph), []

    def factory(cfg):
        calls.append(cfg)
        if len(calls) == call:
            raise exc
        return make(cfg)

    return factory


def test_window_times_steps_after_the_warmup(small_graph, config, one_thread):
    trainer = default_trainer("tgn", small_graph)(config)
    seen = []
    result = measure_window(trainer, Window(2, 4), checkpoint=lambda step, value: seen.append((step, value)))
    assert len(result.steps) == 4 and result.timing == "wall" and result.peak_device_bytes is None
    batches = trainer.loader.num_batches("train")
    assert result.step_seconds > 0 and result.epoch_seconds == pytest.approx(result.step_seconds * batches)
    # the halfway report is in the study's unit (per epoch): the mean of the first two steps
    assert [step for step, _ in seen] == [2]
    assert seen[0][1] == pytest.approx((result.steps[0] + result.steps[1]) / 2 * batches)


def test_a_window_longer_than_the_epoch_leaves_its_smaller_last_batch_out(small_graph, config, one_thread):
    """The smaller last batch is captured and specialized once per run: it is never timed."""
    split = small_graph.split_range("train")
    n = split.stop - split.start
    config.set("train.batch_size", next(b for b in range(max(2, n // 6), n) if n % b))
    trainer = default_trainer("tgn", small_graph)(config)
    batches = trainer.loader.num_batches("train")
    assert batches * config.train.batch_size > n  # the last batch is the smaller one
    result = measure_window(trainer, Window(1, 10_000))
    assert len(result.steps) == batches - 2  # the warm-up step and the last batch left out
    assert result.epoch_seconds == pytest.approx(statistics.fmean(result.steps) * batches)


def test_a_step_after_the_deadline_stops_the_window(small_graph, config, one_thread):
    trainer = default_trainer("tgn", small_graph)(config)
    with pytest.raises(TrialTimeout, match=r"more than 5 s \(in its warm-up, step 1\); raise "
                                           r"tuner.trial_seconds"):
        measure_window(trainer, Window(2, 4, seconds=5), deadline=time.perf_counter() - 1)


def test_a_trial_past_its_time_limit_is_pruned_and_the_study_goes_on(small_graph, config, tmp_path,
                                                                     one_thread, monkeypatch):
    """The second trial's build takes (on a clock moved forward) longer than tuner.trial_seconds:
    it is pruned with the reason at its first step, and the third trial runs to the end."""

    skew, make, calls = [0.0], default_trainer("tgn", small_graph), []
    clock = time.perf_counter

    class SkewedTime:
        @staticmethod
        def perf_counter():
            return clock() + skew[0]

    def factory(cfg):
        calls.append(cfg)
        if len(calls) == 2:
            skew[0] += 1000.0  # the build "took" 1000 s
        return make(cfg)

    monkeypatch.setattr(objective, "time", SkewedTime)
    config.set("tuner.trial_seconds", 600)
    lines = []
    run = tune(small_graph, "tgn", config, trials=3, storage=str(tmp_path / "slow.db"), study_name="slow",
               say=lines.append, make_trainer=factory)
    trials = run.study.trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED,
                                         optuna.trial.TrialState.COMPLETE]
    assert trials[1].user_attrs["failure"].startswith("TrialTimeout: the trial took more than 600 s")
    assert any("pruned: TrialTimeout" in line for line in lines)
    with pytest.raises(ConfigError, match="tuner.trial_seconds"):
        config.set("tuner.trial_seconds", -1)


def _blocking(pid_file) -> None:
    """Wait a minute for a child process (its pid written to ``pid_file``), as a kernel's compile
    waits for ptxas."""
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    subprocess.run([sys.executable, "-c", code], check=True)


def _gone(pid_file) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
    except ProcessLookupError:
        return True
    return False


def test_a_trial_is_cut_inside_a_blocking_call_but_the_baseline_is_not(small_graph, config, tmp_path,
                                                                       one_thread):
    """tuner.trial_seconds ends a trial wherever it is, a compiler's process included (killed
    with it); the baseline, which the record compares with, may take longer."""
    config.set("tuner.confirm_rounds", 0)
    make, calls = default_trainer("tgn", small_graph), []

    def factory(cfg):
        calls.append(cfg)
        if len(calls) == 1:
            time.sleep(2.5)  # the baseline: past the limit, not cut
        else:
            _blocking(tmp_path / "child.pid")
        return make(cfg)

    run = tune(small_graph, "tgn", config, trials=2, storage=str(tmp_path / "cut.db"), study_name="cut",
               window=Window(1, 3, seconds=2), say=lambda line: None, make_trainer=factory)
    first, second = run.study.trials
    assert first.state == optuna.trial.TrialState.COMPLETE
    assert second.state == optuna.trial.TrialState.PRUNED
    assert second.user_attrs["failure"].startswith("TrialTimeout: the trial took more than 2 s (building it)")
    assert _gone(tmp_path / "child.pid")
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL)[0] == 0


def test_the_studys_cutoff_ends_a_trial_in_its_middle(small_graph, config, tmp_path, one_thread):
    """A trial that would run into the time --timeout keeps for the confirmation is cut there."""
    from fastopt.models import build_model
    from fastopt.tuner.space import build_space

    space = build_space(build_model("tgn", small_graph, config), small_graph, config, torch.device("cpu"))
    study = optuna.create_study()
    cut = objective.StepObjective(space, config, lambda cfg: _blocking(tmp_path / "child.pid"), WINDOW,
                                  cutoff=lambda: time.perf_counter() + 1.0)
    study.optimize(cut, n_trials=1)
    (trial,) = study.trials
    assert trial.state == optuna.trial.TrialState.PRUNED and _gone(tmp_path / "child.pid")
    assert trial.user_attrs["failure"].startswith("TrialTimeout: the study's --timeout, less the time kept "
                                                  "for the confirmation, ran out (building it)")


def test_an_alarm_in_a_storage_write_is_raised_when_the_write_ends(small_graph, config, one_thread,
                                                                  monkeypatch):
    """A trial's alarm that rings while the trial writes to the study's storage (its report at
    the window's halfway mark) waits for the write to end: the value is stored, then the trial
    is cut."""
    from fastopt.models import build_model
    from fastopt.tuner.space import build_space

    space = build_space(build_model("tgn", small_graph, config), small_graph, config, torch.device("cpu"))
    trainer = default_trainer("tgn", small_graph)(config)
    report = optuna.trial.Trial.report

    def ringing(self, value, step):  # the alarm rings in the write
        os.kill(os.getpid(), signal.SIGALRM)
        time.sleep(0.2)
        report(self, value, step)

    monkeypatch.setattr(optuna.trial.Trial, "report", ringing)
    study = optuna.create_study()
    study.optimize(objective.StepObjective(space, config, lambda cfg: trainer, Window(1, 4, seconds=60)),
                   n_trials=1)
    (trial,) = study.trials
    assert trial.state == optuna.trial.TrialState.PRUNED
    assert trial.user_attrs["failure"].startswith("TrialTimeout: the trial took more than 60 s (in its warm-up")
    assert list(trial.intermediate_values) == [2]  # the write ended before the alarm was raised
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL and objective._Held.rang is None

    class Always(optuna.pruners.BasePruner):
        def prune(self, study, trial):
            return True

    # pruned in the same write the alarm rang in: the pruning, decided first, is the reason
    study = optuna.create_study(pruner=Always())
    study.optimize(objective.StepObjective(space, config, lambda cfg: trainer, Window(1, 4, seconds=60)),
                   n_trials=1)
    (trial,) = study.trials
    assert trial.state == optuna.trial.TrialState.PRUNED and "failure" not in trial.user_attrs
    assert trial.user_attrs["pruned"].startswith("slower than earlier trials after 2 steps")
    assert objective._Held.depth == 0 and objective._Held.rang is None


def test_three_trials_with_a_failing_config_pruned(small_graph, config, tmp_path, one_thread):
    config.set("tuner.confirm_rounds", 0)  # the record compares the trials' own windows
    lines = []
    run = tune(small_graph, "tgn", config, trials=3, storage=str(tmp_path / "t.db"), study_name="s",
               window=WINDOW, say=lines.append,
               make_trainer=failing_on(2, KernelError("the kernel did not compile"), small_graph))
    trials = run.study.trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED,
                                         optuna.trial.TrialState.COMPLETE]
    assert trials[0].user_attrs["role"] == "baseline" and trials[0].params == run.space.baseline()
    assert trials[1].user_attrs["failure"] == "KernelError: the kernel did not compile"
    assert any("pruned: KernelError: the kernel did not compile" in line for line in lines)
    assert sum(line.startswith("trial ") for line in lines) == 3 and "best" in lines[-1]
    record = run.record
    assert record.default_step_seconds == trials[0].user_attrs["step_seconds"]
    assert record.values == min((t for t in trials if t.value is not None), key=lambda t: t.value).user_attrs["values"]
    assert record.study["pruned"] == 1 and record.study["complete"] == 2
    assert record.measurement == {"timing": "wall", "warmup": 1, "timed": 3, "max_device_memory": None,
                                  "confirm_rounds": 0}
    assert study_module.CONFIRMED not in run.study.user_attrs


def test_the_baseline_and_the_best_trials_are_measured_again_in_turns(small_graph, config, tmp_path,
                                                                     one_thread, monkeypatch):
    """After the trials the baseline and the ``confirm_top`` best others are measured again in
    ``confirm_rounds`` rounds, each round starting one further along; the record compares the
    medians, so a trial whose one window flattered it is not chosen, and a candidate that fails
    when measured again is dropped."""
    config.set("tuner.confirm_rounds", 3)
    config.set("tuner.confirm_top", 2)
    scripts = [[1.0, 1.0, 1.0], [3.0, 3.0, 0.1], [0.5, 0.6, 9.0]]  # by first appearance
    seen, order = {}, []

    def remeasure(self, values):
        key = json.dumps(values, sort_keys=True)
        if key not in seen:
            seen[key] = scripts[len(seen)]
        order.append(key)
        return seen[key][sum(k == key for k in order) - 1]

    monkeypatch.setattr(objective.StepObjective, "remeasure", remeasure)
    lines = []
    run = tune(small_graph, "tgn", config, trials=4, storage=str(tmp_path / "c.db"), study_name="c",
               window=WINDOW, say=lines.append)
    complete = [t for t in run.study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    base = next(t for t in complete if t.user_attrs["role"] == "baseline")
    x, y = sorted((t for t in complete if t is not base), key=lambda t: t.value)[:2]
    b, kx, ky = (json.dumps(t.user_attrs["values"], sort_keys=True) for t in (base, x, y))
    assert order == [b, kx, ky, kx, ky, b, ky, b, kx]  # in turns, each round one further along
    assert run.study.user_attrs[study_module.CONFIRMED] == {
        str(base.number): [1.0, 1.0, 1.0], str(x.number): [3.0, 3.0, 0.1], str(y.number): [0.5, 0.6, 9.0]}
    record = run.record  # the medians: y (0.6 s) against the baseline (1.0 s)
    assert record.values == y.user_attrs["values"] and record.study["best_trial"] == y.number
    assert (record.epoch_seconds, record.default_epoch_seconds) == (0.6, 1.0)
    assert record.step_seconds == pytest.approx(y.user_attrs["step_seconds"] * 0.6 / y.value)
    assert record.measurement["confirm_rounds"] == 3
    assert any(line.startswith("fastopt tune: confirmed (median of 3 round(s)): the baseline 1.000 s/epoch")
               for line in lines)

    def failing(self, values):  # x fails when measured again: dropped, with its reason
        if json.dumps(values, sort_keys=True) == kx:
            raise torch.cuda.OutOfMemoryError("out of memory")
        return 1.0

    monkeypatch.setattr(objective.StepObjective, "remeasure", failing)
    said = []
    confirmed = study_module.confirm(run.study, run_objective(run, small_graph, config), 2, 2, said.append)
    assert set(confirmed) == {base.number, y.number} and all(v == [1.0, 1.0] for v in confirmed.values())
    assert any(f"trial {x.number + 1} dropped from the confirmation: OutOfMemoryError" in s for s in said)
    # no round fits before the deadline: nothing stored, nothing returned
    assert study_module.confirm(run.study, None, 2, 2, said.append, deadline=0.0, clock=lambda: 1.0) == {}
    assert said[-1] == "fastopt tune: confirmation stopped after 0 round(s): --timeout"
    # nor one that the trials' pace would end after it: the first round is not started blind
    assert study_module.confirm(run.study, None, 2, 2, said.append, deadline=1e-6, clock=lambda: 0.0) == {}
    # a round starts when one as long as the last fits: 6 s rounds (the baseline 4 s, the others
    # 1 s), so two fit in 14 s (a pace of the longest measurement per candidate, 12 s, fitted one)
    now = [0.0]

    class Paced:
        def remeasure(self, values):
            now[0] += 4.0 if json.dumps(values, sort_keys=True) == b else 1.0
            return 1.0

    confirmed = study_module.confirm(run.study, Paced(), 3, 2, said.append, deadline=14.0, clock=lambda: now[0])
    assert [len(v) for v in confirmed.values()] == [2, 2, 2] and now[0] == 12.0
    assert said[-2] == "fastopt tune: confirmation stopped after 2 round(s): --timeout"
    for name, bad, limit in (("tuner.confirm_rounds", -1, ">= 0"), ("tuner.confirm_top", 0, ">= 1")):
        with pytest.raises(ConfigError, match=f"{name} must be {limit} \\(got {bad}\\)"):
            config.set(name, bad)


def run_objective(run, graph, config):
    return objective.StepObjective(run.space, config, default_trainer("tgn", graph), WINDOW)


def test_a_stopped_study_resumes_from_sqlite(small_graph, config, tmp_path, one_thread):
    db = str(tmp_path / "resume.db")
    said = []  # the run is stopped (Ctrl-C) in its second trial: the first one's record is kept
    first = tune(small_graph, "tgn", config, trials=3, storage=db, study_name="r", window=WINDOW,
                 say=said.append, make_trainer=failing_on(2, KeyboardInterrupt(), small_graph))
    assert first.interrupted and first.record is not None and first.record.study["complete"] == 1
    assert "fastopt tune: interrupted" in said[-1]
    stopped = open_study(db, "r", create=False)
    assert [t.state for t in stopped.trials] == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL]
    lines = []
    run = tune(small_graph, "tgn", config, trials=3, storage=db, study_name="r", window=WINDOW,
               say=lines.append)
    states = [t.state for t in run.study.trials]
    assert not run.interrupted
    assert states.count(optuna.trial.TrialState.COMPLETE) == 3  # the failed trial is run again
    assert sum(t.user_attrs.get("role") == "baseline" for t in run.study.trials) == 1
    assert "resuming study 'r': 1 trial(s) finished" in lines[1]
    assert study_module.CONFIRMED in run.study.user_attrs
    again = tune(small_graph, "tgn", config, trials=3, storage=db, study_name="r", window=WINDOW,
                 say=lambda line: None)
    assert len(again.study.trials) == len(run.study.trials)  # nothing left to run


def test_a_study_with_its_trials_done_but_not_confirmed_is_confirmed_by_the_next_call(
        small_graph, config, tmp_path, one_thread):
    db = str(tmp_path / "late.db")
    config.set("tuner.confirm_rounds", 0)
    first = tune(small_graph, "tgn", config, trials=2, storage=db, study_name="late", window=WINDOW,
                 say=lambda line: None)
    assert study_module.CONFIRMED not in first.study.user_attrs
    config.set("tuner.confirm_rounds", 1)
    lines = []
    again = tune(small_graph, "tgn", config, trials=2, storage=db, study_name="late", window=WINDOW,
                 say=lines.append)
    assert len(again.study.trials) == 2  # no trial run, the two measured again
    assert set(again.study.user_attrs[study_module.CONFIRMED]) == {"0", "1"}
    assert any(line.startswith("fastopt tune: confirming the baseline, trial 2") for line in lines)
    assert again.record.measurement["confirm_rounds"] == 1


def test_a_study_of_another_problem_is_refused(small_graph, config, tmp_path, one_thread):
    db = str(tmp_path / "other.db")
    tune(small_graph, "tgn", config, trials=1, storage=db, study_name="x", window=WINDOW, say=lambda line: None)
    with pytest.raises(StudyError, match="study 'x' tunes another model"):
        tune(small_graph, "jodie", config, trials=1, storage=db, study_name="x", window=WINDOW,
             say=lambda line: None)
    # a knob whose choices changed (Optuna would refuse its next suggestion), or a study that
    # stored its knobs' names alone: refused by name, not a crash in the next trial
    study = optuna.load_study(study_name="x", storage=storage_url(db))
    context = study.user_attrs[study_module.CONTEXT]
    knob = next(iter(context["space"]))
    for stale, why in (({**context["space"], knob: context["space"][knob][:1]}, re.escape(knob)),
                       (list(context["space"]), "made by an earlier fastopt")):
        study.set_user_attr(study_module.CONTEXT, {**context, "space": stale})
        with pytest.raises(StudyError, match=f"study 'x' searched another space \\(.*{why}"):
            tune(small_graph, "tgn", config, trials=2, storage=db, study_name="x", window=WINDOW,
                 say=lambda line: None)


def test_export_and_its_errors(small_graph, config, tmp_path, one_thread):
    db = str(tmp_path / "e.db")
    run = tune(small_graph, "tgn", config, trials=1, storage=db, study_name="e", window=WINDOW,
               say=lambda line: None)
    record, path = export_record(db, "e", tmp_path / "out")
    assert path.parent == tmp_path / "out" and record.values == run.record.values
    with pytest.raises(StudyError, match="holds no study 'nope' \\(it holds 'e'\\)"):
        export_record(db, "nope", tmp_path)
    optuna.create_study(storage=storage_url(db), study_name="plain")
    with pytest.raises(StudyError, match="was not made by fastopt tune"):
        export_record(db, "plain", tmp_path)
    dead = tune(small_graph, "tgn", config, trials=1, storage=db, study_name="dead", window=WINDOW,
                say=lambda line: None, make_trainer=failing_on(1, RuntimeError("out of memory"), small_graph))
    assert dead.record is None
    with pytest.raises(StudyError, match="no completed trial.*RuntimeError: out of memory"):
        export_record(db, "dead", tmp_path)
    with pytest.raises(StudyError, match="cannot be opened"):
        open_study("nosuchdriver://x", "s")


def test_one_collection_per_trial_and_each_trainer_freed_before_the_next(small_graph, config, tmp_path,
                                                                       one_thread, monkeypatch):
    import fastopt.tuner.objective as objective

    make, trainers, collections = default_trainer("tgn", small_graph), [], []

    def factory(cfg):
        assert all(ref() is None for ref in trainers)  # the last trial's trainer is gone
        trainer = make(cfg)
        trainers.append(weakref.ref(trainer))
        return trainer

    real_measure = objective.measure_window

    def measure(trainer, window, checkpoint=None, deadline=None, late=None):
        if len(trainers) == 2:  # a failure whose traceback holds the trainer until Optuna drops it
            raise RuntimeError("the window failed")
        return real_measure(trainer, window, checkpoint, deadline, late)

    monkeypatch.setattr(objective, "measure_window", measure)
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args) or real_collect(*args))
    frozen = gc.get_freeze_count()
    run = tune(small_graph, "tgn", config, trials=3, storage=str(tmp_path / "gc.db"), study_name="gc",
               window=WINDOW, say=lambda line: None, make_trainer=factory)
    assert [t.state for t in run.study.trials] == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED,
                                                   optuna.trial.TrialState.COMPLETE]
    # then the confirmation: the baseline and the other completed trial, 3 rounds
    assert len(trainers) == 3 + 2 * 3 and all(ref() is None for ref in trainers)
    assert len(collections) == 1 + 3 + 2 * 3  # one before the trials, then one per trial and measurement
    assert gc.get_freeze_count() == frozen  # what the study froze is thawed


def test_storage_urls():
    # a URL naming no driver takes psycopg, the postgres extra's, whatever SQLAlchemy's default
    psycopg = importlib.util.find_spec("psycopg") is not None
    assert storage_url("postgresql://u@h/db") == ("postgresql+psycopg://u@h/db" if psycopg else "postgresql://u@h/db")
    assert storage_url("postgresql+psycopg2://u@h/db") == "postgresql+psycopg2://u@h/db"
    assert storage_url("a.db").startswith("sqlite:///") and storage_url("a.db").endswith("/a.db")
    assert storage_url("").endswith("/fastopt-tune.db")


def test_progress_bar_on_a_terminal_lines_elsewhere(small_graph, config, tmp_path, one_thread, monkeypatch,
                                                    capsys):
    import fastopt.progress

    lines = []
    tune(small_graph, "tgn", config, trials=2, storage=str(tmp_path / "p.db"), study_name="lines",
         window=WINDOW, say=lines.append, progress=True)  # stderr is no terminal here
    assert sum(line.startswith("trial ") for line in lines) == 2
    assert "fastopt tune" not in capsys.readouterr().err

    monkeypatch.setattr(fastopt.progress, "_isatty", lambda stream: True)
    lines.clear()
    tune(small_graph, "tgn", config, trials=2, storage=str(tmp_path / "p.db"), study_name="bar",
         window=WINDOW, say=lines.append, progress=True)
    assert lines and not any(line.startswith("trial ") for line in lines)  # the space, no trial lines
    err = capsys.readouterr().err
    assert "fastopt tune" in err and "2/2" in err and "best " in err and "trial 2: " in err


def test_the_timeout_stops_before_a_trial_that_would_end_after_it():
    """--timeout bounds the call's wall time: after each trial, the worker stops when the longest
    of the last three completed trials no longer fits in the time left (Optuna's own timeout only
    keeps new trials from starting once it has passed); trials pruned early, being short, set the
    pace only while none has completed."""
    import datetime

    from optuna.trial import TrialState

    from fastopt.tuner.study import _stop_before

    class Study:
        stopped = False

        def stop(self):
            self.stopped = True

    class Trial:
        def __init__(self, seconds, state=TrialState.COMPLETE):
            self.duration, self.state = datetime.timedelta(seconds=seconds), state

    now, lines = [10.0], []
    stop, study = _stop_before(100.0, lines.append, start=0.0, clock=lambda: now[0]), Study()
    stop(study, Trial(20, TrialState.PRUNED))  # 80 s left, none completed: 20 s is the pace
    assert not study.stopped
    for end, took in [(40, 30), (50, 10), (60, 10)]:  # at 60: 40 s left, the 30 s trial fits
        now[0] = end
        stop(study, Trial(took))
        assert not study.stopped, end
    for end in (62, 64, 66):  # pruned early: they do not shorten the pace of completed trials
        now[0] = end
        stop(study, Trial(4, TrialState.PRUNED))
        assert not study.stopped, end
    now[0] = 75  # 25 s left; the last three completed took 30, 10, 10 s
    stop(study, Trial(2, TrialState.PRUNED))
    assert study.stopped and lines == ["fastopt tune: stopping: 25 s of --timeout left, trials take up to 30 s"]
    never = Study()
    _stop_before(None, lines.append, start=0.0, clock=lambda: 1e9)(never, Trial(1e6))
    assert not never.stopped
    # the confirmation's time is kept: 45 s left, 20 s of them kept, a 30 s trial does not fit
    now[0], kept = 55, Study()
    _stop_before(100.0, lines.append, start=0.0, clock=lambda: now[0], reserve=lambda s: 20.0)(kept, Trial(30))
    assert kept.stopped and lines[-1] == ("fastopt tune: stopping: 45 s of --timeout left (and 20 s kept "
                                          "for the confirmation), trials take up to 30 s")


def test_the_confirmations_time_is_rounds_times_candidates_times_a_median_measurement():
    from optuna.trial import TrialState

    from fastopt.tuner.study import confirmation_seconds

    import datetime

    class Trial:  # phases that leave part of the trial's time out (setup, teardown, storage)
        def __init__(self, state, seconds, **phases):
            self.state, self.user_attrs = state, {"phases": phases}
            self.duration = datetime.timedelta(seconds=seconds)

    class Study:
        trials = [Trial(TrialState.COMPLETE, 72.0, build=1.0, check=50.0, warmup=15.0, window=1.0),  # compiles
                  Trial(TrialState.COMPLETE, 1.1, build=0.3, check=0.1, warmup=0.2, window=0.3),
                  Trial(TrialState.COMPLETE, 2.1, build=0.5, check=0.1, warmup=0.5, window=0.5),
                  Trial(TrialState.PRUNED, 90.1, build=0.1, unfinished=90.0),
                  Trial(TrialState.COMPLETE, 1.0, build=0.1)]
    Study.trials[-1].duration = None  # completed, its duration unknown: not counted

    # each less its check: the median of 22.0, 1.0 and 2.0 s; the baseline and two others (three completed)
    assert confirmation_seconds(Study(), rounds=3, top=3) == 3 * 3 * 2.0
    assert confirmation_seconds(Study(), rounds=0, top=3) == 0.0
    Study.trials = Study.trials[:1]
    assert confirmation_seconds(Study(), rounds=3, top=3) == 0.0  # nothing to compare
