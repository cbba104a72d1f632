"""A trial whose kernel values give results that disagree with eager is pruned, its reason kept,
and never chosen: a wrong result is injected into the fused attention under one value of a
per-op knob, on the CPU (the optimized model runs the reference operators there)."""

from __future__ import annotations

import optuna
import pytest
import torch

import fastopt.codegen
import fastopt.tuner.study as study_module
from fastopt.codegen.kernel_config import op_override
from fastopt.config import Config
from fastopt.tuner import Knob, SearchSpace, Window, tune
from fastopt.tuner.space import space_context

WINDOW = Window(warmup=1, timed=2)
BAD = "kernels.op_overrides[temporal_attention@10x2x8].num_warps"  # TGN's attention at these widths


@pytest.fixture
def config() -> Config:
    cfg = Config()
    for name, value in {"train.device": "cpu", "train.optimize": "on", "model.memory_dim": 8, "model.dim": 8,
                        "model.time_dim": 8, "sampler.threads": 1}.items():
        cfg.set(name, value)
    return cfg


@pytest.fixture
def one_knob(monkeypatch):
    """tune's space: the attention's warps alone, 0 (the heuristic) for the baseline, 2 wrong."""
    def build(model, graph, config, device, *, batch_sizes=None):
        context = space_context(model, graph, config, device, batch_sizes)
        return SearchSpace((Knob(BAD, (0, 2)),), {}, context, config.kernels.op_overrides)

    monkeypatch.setattr(study_module, "build_space", build)


def inject(monkeypatch, wrong):
    """``fastopt.codegen.temporal_attention`` giving ``wrong(out)`` where the trial's mapping
    of the attention sets num_warps=2: a kernel that is wrong under one thread mapping."""
    real = fastopt.codegen.temporal_attention
    calls = []

    def attention(q, k, v, *args, **kwargs):
        out = real(q, k, v, *args, **kwargs)
        slots = (kwargs.get("k_index") if kwargs.get("k_index") is not None else k).shape[1]
        warps = op_override("temporal_attention", (slots, q.shape[1], q.shape[2])).get("num_warps")
        calls.append(warps)
        return wrong(out) if warps == 2 else out

    monkeypatch.setattr(fastopt.codegen, "temporal_attention", attention)
    return calls


@pytest.mark.parametrize("what", ["outputs", "gradients"])
def test_a_trial_that_disagrees_with_eager_is_pruned_and_never_chosen(
        small_graph, config, tmp_path, one_thread, monkeypatch, one_knob, wrong_backward, what):
    wrong = (lambda out: out * 1.01) if what == "outputs" else wrong_backward.apply
    calls = inject(monkeypatch, wrong)
    lines = []
    run = tune(small_graph, "tgn", config, trials=5, storage=str(tmp_path / "v.db"), study_name="v",
               window=WINDOW, say=lines.append)
    trials = run.study.trials
    assert 2 in calls and None in calls  # both values ran through the fused attention
    bad = [t for t in trials if t.params[BAD] == 2]
    good = [t for t in trials if t.params[BAD] == 0]
    assert bad and good and len(bad) + len(good) == len(trials) == 5
    for t in bad:
        assert t.state == optuna.trial.TrialState.PRUNED
        reason = t.user_attrs["failure"]
        assert reason.startswith("FastOptError: the trial's outputs or gradients disagree with eager")
        assert ("output differs" if what == "outputs" else "grad ") in reason
        assert "step_seconds" not in t.user_attrs  # stopped before its window
        assert list(t.user_attrs["phases"]) == ["build", "unfinished"]  # pruned in its check
    for t in good:  # checked, agreed (the largest error ratio to eager's), timed
        assert t.state == optuna.trial.TrialState.COMPLETE and "failure" not in t.user_attrs
        assert isinstance(t.user_attrs["verified"], float) and t.user_attrs["step_seconds"] > 0
        phases = t.user_attrs["phases"]  # where the trial's wall time went
        assert list(phases) == ["build", "check", "warmup", "window"] and min(phases.values()) > 0
        assert phases["window"] >= sum(t.user_attrs["steps"])  # the timed steps ran in the window
    assert any(line.endswith(" s since the start") and "| build " in line and ", warm-up " in line for line in lines)
    assert any("disagree with eager" in line for line in lines)
    assert run.record.values["kernels.op_overrides"] == ""  # the record holds a value that agreed
    assert run.study.best_trial.params[BAD] == 0


def test_a_model_that_runs_eager_is_not_checked(small_graph, config, tmp_path, one_thread, monkeypatch, one_knob):
    config.set("train.optimize", "off")
    calls = inject(monkeypatch, lambda out: out * 1.01)
    run = tune(small_graph, "tgn", config, trials=2, storage=str(tmp_path / "e.db"), study_name="e",
               window=WINDOW, say=lambda line: None)
    assert not calls  # nothing fused: the knob changes nothing, and nothing is compared
    assert all(t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs["verified"] is None
               for t in run.study.trials)


def test_a_trial_cut_while_checking_is_slow_not_wrong(small_graph, config, one_thread, monkeypatch):
    """A check against eager that outlasts the trial's limit (its kernels' compiles, on the H200)
    is reported as a timeout, not as a disagreement with eager."""
    import time

    import fastopt
    from fastopt.models import build_model
    from fastopt.tuner.objective import StepObjective, check_against_eager
    from fastopt.tuner.space import build_space
    from fastopt.tuner.study import default_trainer

    monkeypatch.setattr(fastopt, "verify_against_eager", lambda *args: time.sleep(30))
    space = build_space(build_model("tgn", small_graph, config), small_graph, config, torch.device("cpu"))
    check = check_against_eager(lambda cfg: build_model("tgn", small_graph, cfg))
    trainer = default_trainer("tgn", small_graph)(config)  # built ahead: the limit falls in the check
    slow = StepObjective(space, config, lambda cfg: trainer, Window(1, 2, seconds=3), check=check)
    study = optuna.create_study()
    study.optimize(slow, n_trials=1)
    (trial,) = study.trials
    assert trial.state == optuna.trial.TrialState.PRUNED
    assert trial.user_attrs["failure"].startswith("TrialTimeout: the trial took more than 3 s (checking it)")
    assert "disagree" not in trial.user_attrs["failure"]
    # nor is a kernel that fails while checking (only the comparison's own verdict is one)
    from fastopt.errors import KernelError

    def failing(*args):
        raise KernelError("no kernel for this mapping")

    monkeypatch.setattr(fastopt, "verify_against_eager", failing)
    study.optimize(slow, n_trials=1)
    assert study.trials[-1].user_attrs["failure"] == "KernelError: no kernel for this mapping"


class _Props:
    """``torch.cuda.get_device_properties`` of a 100 GiB device."""
    total_memory = 100 * 2**30


def test_a_memory_limit_on_a_device_without_an_index_is_set_on_the_current_one(monkeypatch):
    """``cuda`` without an index (a trainer's default device) limits the current device: PyTorch's
    per-process fraction takes an index only."""
    from torch._utils import _get_device_index

    from fastopt.tuner.objective import device_memory_limit

    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: calls.append(("props", d)) or _Props())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",  # the real one's argument check
                        lambda f, d=None: calls.append((f, _get_device_index(d, optional=False))))
    for device, index in ((torch.device("cuda"), 3), (torch.device("cuda", 1), 1)):
        calls.clear()
        with device_memory_limit(device, 25 * 2**30):
            assert calls == [("props", index), (0.25, index)]
        assert calls[-1] == (1.0, index)  # given back on leaving
    before = list(calls)
    with device_memory_limit(torch.device("cpu"), 2**30):
        assert calls == before  # nothing on the CPU


def test_a_trial_alarm_while_the_limit_is_set_is_raised_after_it_is_given_back(monkeypatch):
    """An alarm that rings while the fraction is being set is raised once it is set, inside the
    block that gives it back: the limit never outlives the trial (the next trial's check runs
    without one)."""
    import fastopt.tuner.objective as objective
    from fastopt.tuner.objective import TrialTimeout, device_memory_limit

    calls = []

    def set_fraction(fraction, device=None):
        calls.append(fraction)
        if fraction < 1.0:  # the trial's alarm rings here; held, it is kept for the end of the setting
            assert objective._Held.depth > 0
            objective._Held.rang = TrialTimeout("the trial took more than 60 s")

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: _Props())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    entered = []
    with pytest.raises(TrialTimeout, match="more than 60 s"):
        with device_memory_limit(torch.device("cuda"), 25 * 2**30):
            entered.append(True)
    assert calls == [0.25, 1.0] and not entered  # given back, and the block never ran
    assert objective._Held.depth == 0 and objective._Held.rang is None


def test_a_failing_window_keeps_its_own_error_when_an_alarm_rings_as_the_limit_is_given_back(monkeypatch):
    """Out of memory in the window, then the trial's alarm ringing while the limit is given back:
    the trial fails for running out of memory (its reason), the limit is given back all the same,
    and nothing of the alarm is left for the next trial."""
    import fastopt.tuner.objective as objective
    from fastopt.tuner.objective import TrialTimeout, device_memory_limit

    monkeypatch.setattr(objective, "_LIMITED", set())  # none of another test's
    calls = []

    def set_fraction(fraction, device=None):
        calls.append(fraction)
        if fraction == 1.0:
            objective._Held.rang = TrialTimeout("the trial took more than 60 s")

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: _Props())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="Tried to allocate"):
        with device_memory_limit(torch.device("cuda"), 25 * 2**30):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert calls == [0.25, 1.0] and objective._Held.depth == 0 and objective._Held.rang is None
    assert not objective._LIMITED


def test_release_gives_back_a_limit_a_trial_left_set(monkeypatch):
    """A trial cut between its window and giving the limit back (an alarm in the few steps no
    setting guards) leaves the fraction set: the release after the trial gives it back, so the
    next trial's check runs without it."""
    import fastopt.tuner.objective as objective
    from fastopt.tuner.objective import device_memory_limit, release

    monkeypatch.setattr(objective, "_LIMITED", set())  # none of another test's
    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: _Props())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: calls.append((f, d)))
    left = device_memory_limit(torch.device("cuda"), 50 * 2**30)
    left.__enter__()  # never left: what a cut trial leaves behind
    assert calls == [(0.5, 2)] and objective._LIMITED == {2}
    release(collect=False)
    assert calls == [(0.5, 2), (1.0, 2)] and not objective._LIMITED
    release(collect=False)
    assert len(calls) == 2  # nothing left to give back
    left.gen.close()  # the abandoned block, closed while the fake is in place


def test_the_check_against_eager_drops_the_graphs_it_captured(small_graph, config, one_thread, monkeypatch):
    """The check runs the optimized model in eval mode, whose CUDA graphs training never replays:
    it drops them (whether the check passes or not), so that the window's memory does not hold them."""
    import fastopt
    import fastopt.runtime
    from fastopt.errors import FastOptError
    from fastopt.models import build_model
    from fastopt.tuner.objective import check_against_eager
    from fastopt.tuner.study import default_trainer

    dropped = []
    monkeypatch.setattr(fastopt.runtime, "drop_graphs", lambda module: dropped.append(module) or 0)
    trainer = default_trainer("tgn", small_graph)(config)
    check = check_against_eager(lambda cfg: build_model("tgn", small_graph, cfg))
    monkeypatch.setattr(fastopt, "verify_against_eager", lambda *args: 1.0)
    assert check(trainer) == 1.0 and dropped == [trainer.model]

    def wrong(*args):
        raise FastOptError("outputs differ")

    monkeypatch.setattr(fastopt, "verify_against_eager", wrong)
    with pytest.raises(FastOptError, match="disagree with eager"):
        check(trainer)
    assert dropped == [trainer.model, trainer.model]


def test_the_memory_limit_bounds_the_window_and_not_the_check_against_eager(small_graph, config, one_thread,
                                                                           monkeypatch):
    """``--max-device-memory`` bounds what training with a config holds: the window runs under it,
    while the check against eager, which holds a second (eager) copy of the model, runs before it
    (on the H200 a limit 64 MiB under TGN's footprint failed every trial in its check), and
    the eager copy's blocks are given back before the window."""
    import contextlib

    import fastopt.tuner.objective as objective
    from fastopt.models import build_model
    from fastopt.tuner.space import build_space
    from fastopt.tuner.study import default_trainer

    limited, seen = [], []

    @contextlib.contextmanager
    def limit(device, limit_bytes):
        limited.append(limit_bytes)
        try:
            yield
        finally:
            limited.pop()

    real_window = objective.measure_window

    def window(*args, **kwargs):
        seen.append(("window", list(limited)))
        return real_window(*args, **kwargs)

    monkeypatch.setattr(objective, "device_memory_limit", limit)
    monkeypatch.setattr(objective, "measure_window", window)
    monkeypatch.setattr(objective, "release", lambda collect=True: seen.append(("release", collect, list(limited))))
    space = build_space(build_model("tgn", small_graph, config), small_graph, config, torch.device("cpu"))
    check = lambda trainer: seen.append(("check", list(limited))) or 1.0  # noqa: E731
    run = objective.StepObjective(space, config, default_trainer("tgn", small_graph), WINDOW,
                                  max_device_memory=2**30, check=check)
    study = optuna.create_study()
    study.optimize(run, n_trials=1)
    assert study.trials[0].state == optuna.trial.TrialState.COMPLETE
    # the eager copy's blocks are released before the window: neither the limit nor the peak counts them
    assert seen == [("check", []), ("release", False, []), ("window", [2**30])]
    assert limited == []  # given back


def test_a_windows_peak_is_the_memory_the_allocator_held_which_the_limit_bounds(small_graph, config, one_thread,
                                                                              monkeypatch):
    """The peak a trial records is PyTorch's reserved bytes (graph pools and cached blocks
    included), which the per-process fraction limits, not the allocated bytes: on the H200 a
    config whose allocated peak was 25 MiB under the limit ran out of memory under it."""
    import fastopt.tuner.objective as objective
    from fastopt.tuner.study import default_trainer

    fake_cuda_memory(monkeypatch, reserved=550 * 2**20, allocated=510 * 2**20)
    result = objective.measure_window(default_trainer("tgn", small_graph)(config), WINDOW)
    assert result.peak_device_bytes == 550 * 2**20 and result.timing == "cuda_events"


def test_a_trial_whose_peak_is_above_the_limit_is_pruned_and_fails_its_remeasure(small_graph, config, one_thread,
                                                                         monkeypatch):
    """A window that stayed under PyTorch's fraction but whose peak is above ``--max-device-memory``
    (the fraction is a float of the device's memory) is pruned with both figures, in a trial and in
    the confirmation's measurement; one under it completes."""
    import fastopt.tuner.objective as objective
    from fastopt.errors import ConfigError
    from fastopt.models import build_model
    from fastopt.tuner.space import build_space
    from fastopt.tuner.study import default_trainer

    fake_cuda_memory(monkeypatch, reserved=3 * 2**30, allocated=2**30)
    space = build_space(build_model("tgn", small_graph, config), small_graph, config, torch.device("cpu"))
    for limit, state in ((2 * 2**30, optuna.trial.TrialState.PRUNED), (4 * 2**30, optuna.trial.TrialState.COMPLETE)):
        run = objective.StepObjective(space, config, default_trainer("tgn", small_graph), WINDOW,
                                      max_device_memory=limit)
        study = optuna.create_study()
        study.optimize(run, n_trials=1)
        assert study.trials[0].state == state
    assert study.trials[0].user_attrs["peak_device_bytes"] == 3 * 2**30
    low = objective.StepObjective(space, config, default_trainer("tgn", small_graph), WINDOW, max_device_memory=2 * 2**30)
    pruned = optuna.create_study()
    pruned.optimize(low, n_trials=1)
    assert pruned.trials[0].user_attrs["failure"] == ("ConfigError: the trial's peak device memory 3.00 GiB is above "
                                                       "the limit 2.00 GiB (--max-device-memory)")
    # the window ran: its peak and phases are kept beside the reason
    assert pruned.trials[0].user_attrs["peak_device_bytes"] == 3 * 2**30
    assert set(pruned.trials[0].user_attrs["phases"]) == {"build", "warmup", "window"}
    with pytest.raises(ConfigError, match="above the limit 2.00 GiB"):
        low.remeasure(space.baseline())


def fake_cuda_memory(monkeypatch, *, reserved: int, allocated: int) -> None:
    """A window timed as on CUDA (one interval per mark) whose allocator's peaks are given."""
    import fastopt.tuner.objective as objective

    class Marks:
        cuda = True

        def __init__(self, device):
            self.times = []

        def mark(self):
            self.times.append(0.0)

        def intervals(self):
            return [1e-3] * (len(self.times) - 1)

    monkeypatch.setattr(objective, "_Marks", Marks)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: reserved)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: allocated)


def test_a_window_starts_at_a_steady_epochs_shapes_and_hot_sets(small_graph, config, one_thread, monkeypatch):
    """Before its window a trial plans the epoch's padded lengths and, where it reads rows
    zero-copy, the hot sets its first epoch would otherwise lack (``plan_shapes(hot_sets=True)``),
    then times the epoch it planned."""
    import fastopt.tuner.objective as objective
    from fastopt.tuner.study import default_trainer

    trainer, events = default_trainer("tgn", small_graph)(config), []
    plan, steps = trainer.plan_shapes, trainer.train_steps
    monkeypatch.setattr(trainer, "plan_shapes", lambda **kw: events.append(("plan", kw)) or plan(**kw))
    monkeypatch.setattr(trainer, "train_steps", lambda epoch: events.append(("train", epoch)) or steps(epoch))
    objective.measure_window(trainer, WINDOW)
    assert events == [("plan", {"hot_sets": True}), ("train", 0)]
