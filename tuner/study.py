"""One tuning run: a study over a space, its baseline trial, its progress and the record.

:func:`tune` opens (or resumes) a study, stores what the study is about in the study's user
attribute ``fastopt`` (model fingerprint, dataset signature, device, versions, the window), runs
the baseline config as the study's first trial (so that the record compares the best config with
the defaults measured in the same run), then the trials left to reach the total asked for, then
:func:`confirm`: the baseline and the best trials measured again in interleaved rounds, whose
medians the record compares (each worker that ran trials confirms when it stops; the last one's
rounds are kept).
Several workers (processes, machines) may run :func:`tune` on one study in an RDB storage at once:
the worker that creates the study enqueues the baseline and the baseline's one-knob variations
(:meth:`~fastopt.tuner.space.SearchSpace.neighbors`, ``tuner.neighbor_share`` of the trials;
under a device-memory limit those of the feature tables' placement first) ahead of the
sampler's own suggestions, Optuna hands each trial to one worker,
and each worker stops once the study's finished and running trials reach the total.
:func:`export_record` turns a study, finished or not, into a :class:`TuningRecord`.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import optuna
import torch

from fastopt.config import Config
from fastopt.tuner.objective import (ROLE, StepObjective, Window, check_against_eager, failure_reason,
                                     release, values_line)
from fastopt.tuner.records import TuningRecord, dataset_signature, device_identity, library_versions, now
from fastopt.tuner.space import SearchSpace, build_space
from fastopt.tuner.storage import StudyError, open_study

__all__ = ["TuningRun", "confirm", "export_record", "record_from_study", "tune"]

# study user attribute holding what the study tunes
CONTEXT = "fastopt"
# trial user attribute of a variation: the knob it changes, "name=value"
CHANGED = "changed"
# fields of the context that must agree for a study to be resumed
_SAME_PROBLEM = (("model", "key"), ("dataset", None), ("device", None), ("space", None))
# study user attribute: each confirmed trial's epoch seconds per round, {"<number>": [...]}
CONFIRMED = "confirmed"
# knobs whose variations the study tries first under a device-memory limit
MEMORY_KNOBS = ("cache.placement",)
# trials that count toward a study's total: a trial that failed (its process interrupted or
# killed) is run again when the study resumes
FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)


@dataclass
class TuningRun:
    """What :func:`tune` did: the study, its space, and the record of its best trial (None when
    no trial completed)."""

    study: optuna.Study
    space: SearchSpace
    record: Optional[TuningRecord]
    interrupted: bool = False


def default_trainer(model_name: str, graph) -> Callable[[Config], Any]:
    """A factory of trainers for ``model_name`` on ``graph``: a fresh model per config, seeded,
    silent, with no tuning record applied (the trial's values are the ones measured)."""
    def make(config: Config):
        from fastopt.models import build_model
        from fastopt.trainer import Trainer

        torch.manual_seed(config.train.seed)
        model = build_model(model_name, graph, config)
        return Trainer(model, graph, config, progress=False, records=False)

    return make


def tune(graph, model_name: str, config: Config, *, trials: int, timeout: Optional[float] = None,
         storage: str = "", study_name: Optional[str] = None,
         batch_sizes: Optional[Sequence[int]] = None, max_device_memory: Optional[int] = None,
         window: Optional[Window] = None, say: Callable[[str], None] = print,
         make_trainer: Optional[Callable[[Config], Any]] = None, progress: bool = False) -> TuningRun:
    """Tune the knobs of training ``model_name`` on ``graph`` (see :mod:`fastopt.tuner`).

    Args:
        graph: the event stream.
        model_name: a model of :data:`fastopt.models.MODELS`.
        config: the baseline configuration (its device, seed and model hyperparameters hold for
            every trial).
        trials: the study's total of finished trials; a resumed study runs only those left.
        timeout: wall seconds this call may take: no trial starts after them, nor one that
            would end after them at the pace of the last trials (the longest of the last three
            completed), so that the study ends near them rather than a trial later.
        storage: a SQLite file or RDB URL (:func:`~fastopt.tuner.storage.storage_url`).
        study_name: default ``<model>-<dataset>-<device>``.
        batch_sizes: batch sizes to search; default the config's alone.
        max_device_memory: bytes a trial may hold on a CUDA device.
        window: steps per trial and its time limit; default ``Window.of(config)``
            (``config.tuner.warmup_steps``, ``steps_per_trial`` and ``trial_seconds``).
        say: receives the search space, and one progress line per trial where no bar is drawn.
        make_trainer: builds a trainer for a config (default :func:`default_trainer`).
        progress: a progress bar of the trials with the best so far, in place of the per-trial
            lines, where one can be drawn (a terminal or a notebook: the trainer's
            :func:`~fastopt.progress.progress_bar`); a log file or pipe keeps the lines.

    Raises:
        StudyError: the storage cannot be opened, or the study of that name tunes another model,
            dataset, device or space.
    """
    started = time.monotonic()  # --timeout counts from here: building the space is part of it
    from fastopt.models import build_model
    from fastopt.trainer import progress_bar, resolve_device, tuning_fingerprint

    device = resolve_device(config.train.device)
    torch.manual_seed(config.train.seed)
    model = build_model(model_name, graph, config)
    space = build_space(model, graph, config, device, batch_sizes=batch_sizes)
    window = window or Window.of(config)
    say("search space:\n  " + space.describe().replace("\n", "\n  "))
    identity = device_identity(device)
    context = {"model": tuning_fingerprint(model), "model_name": model_name, "dataset": dataset_signature(graph),
               "device": identity, "versions": library_versions(),
               "space": {k.name: list(k.choices) for k in space.knobs},
               "fixed": space.fixed, "window": {"warmup": window.warmup, "timed": window.timed},
               "max_device_memory": max_device_memory, "baseline": config.to_dict()}
    name = study_name or f"{model_name}-{graph.name}-{identity['name']}".replace(" ", "_")
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def first_open(study: optuna.Study) -> None:
        # only the worker that made the study gets here: the baseline is enqueued once
        _claim(study, context)
        base = space.baseline()
        study.enqueue_trial(base, user_attrs={ROLE: "baseline"})
        # under a device-memory limit the tables' placement is varied first: the defaults may not fit
        first = MEMORY_KNOBS if max_device_memory is not None else ()
        for params in space.neighbors(round(config.tuner.neighbor_share * (trials - 1)), first):
            changed = " ".join(f"{k}={v}" for k, v in params.items() if k in base and base[k] != v)
            study.enqueue_trial(params, user_attrs={ROLE: "neighbor", CHANGED: changed})

    study = open_study(storage, name, seed=config.train.seed, on_create=first_open,
                       pruner=optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=0))
    _claim(study, context)
    done = sum(t.state in FINISHED for t in study.trials)
    if done:
        say(f"fastopt tune: resuming study {name!r}: {done} trial(s) finished")
    # a trial whose optimized model disagrees with eager is pruned before it is timed
    check = check_against_eager(lambda cfg: build_model(model_name, graph, cfg))
    interrupted, tu = False, config.tuner
    cutoff = None
    if timeout is not None:  # no trial runs into the time kept for the confirmation
        end = time.perf_counter() + started + timeout - time.monotonic()
        cutoff = lambda: end - confirmation_seconds(study, tu.confirm_rounds, tu.confirm_top)  # noqa: E731
    objective = StepObjective(space, config, make_trainer or default_trainer(model_name, graph), window,
                              max_device_memory, check, cutoff)
    del model  # the space and the context hold what the study needs of it
    # a study whose trials are all done but not confirmed (stopped in its confirmation, or run
    # with confirm_rounds 0) is confirmed by the next call
    if trials > done or (tu.confirm_rounds and CONFIRMED not in study.user_attrs):
        bar = progress_bar(None, "fastopt tune", progress and trials > done, total=max(trials - done, 0),
                           leave=True)
        confirming = False
        try:
            with _frozen() as freeze:
                if trials > done:  # one collection per trial, once Optuna has dropped the trial
                    study.optimize(objective, n_trials=trials - done, timeout=timeout, gc_after_trial=False,
                                   callbacks=[_release(objective, freeze), _progress(trials, say, bar, started),
                                              _stop_at(trials), _stop_before(timeout, say, started, reserve=lambda s:
                                              confirmation_seconds(s, tu.confirm_rounds, tu.confirm_top))])
                bar.close()
                confirming = True
                confirm(study, objective, tu.confirm_rounds, tu.confirm_top, say,
                        None if timeout is None else started + timeout)
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM through fastopt tune: keep what finished
            interrupted = True
            release()
            say("fastopt tune: interrupted in the confirmation; the record compares the trials' own windows"
                if confirming else "fastopt tune: interrupted; the trial that was running is marked failed "
                "and does not count toward --trials (running the command again resumes the study)")
        finally:
            bar.close()
    completed = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    return TuningRun(study, space, record_from_study(study) if completed else None, interrupted)


def confirm(study: optuna.Study, objective: StepObjective, rounds: int, top: int,
            say: Callable[[str], None] = print, deadline: Optional[float] = None,
            clock: Callable[[], float] = time.monotonic) -> Dict[int, List[float]]:
    """Measure the baseline trial and the ``top`` best other completed trials again, ``rounds``
    times in turns (each round starts one further along, so that none is always first), and store
    the epoch seconds in the study's user attribute :data:`CONFIRMED`; the record then compares
    their medians (:func:`record_from_study`). A single window per trial drifts with the host
    (20 % within one study on the H200) and the best of many noisy windows is flattered; the
    medians of interleaved rounds are neither. Only whole rounds count: a round that would end
    after ``deadline`` (a ``clock`` reading, at the pace of the round before it; the first at the
    trials' pace, :func:`confirmation_seconds`) is not started. A candidate that fails when
    measured again (out of memory, the memory limit) is dropped with its reason. Returns the
    stored seconds by trial number (empty: nothing to compare, or no round fitted).
    """
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    baseline = [t for t in complete if t.user_attrs.get(ROLE) == "baseline"][:1]
    others = sorted((t for t in complete if t not in baseline), key=lambda t: t.value)[:top]
    candidates = baseline + others
    if rounds < 1 or len(candidates) < 2:
        return {}
    say(f"fastopt tune: confirming {', '.join(_trial_name(t) for t in candidates)}: {rounds} "
        f"round(s) in turns")
    seconds: Dict[int, List[float]] = {t.number: [] for t in candidates}
    last = confirmation_seconds(study, 1, top)  # the last round's seconds (first: the trials' pace)
    for r in range(rounds):
        if deadline is not None and clock() + last > deadline:
            say(f"fastopt tune: confirmation stopped after {r} round(s): --timeout")
            break
        shift, began = r % len(candidates), clock()
        for trial in candidates[shift:] + candidates[:shift]:
            if trial.number not in seconds:
                continue
            try:
                seconds[trial.number].append(objective.remeasure(trial.user_attrs["values"]))
            except Exception as exc:  # noqa: BLE001  (a candidate that fails now is dropped)
                say(f"fastopt tune: {_trial_name(trial)} dropped from the confirmation: {failure_reason(exc)}")
                del seconds[trial.number]
            finally:
                release()
        last = clock() - began
    rounds_done = min((len(v) for v in seconds.values()), default=0)
    confirmed = {n: v[:rounds_done] for n, v in seconds.items()} if rounds_done and len(seconds) > 1 else {}
    if confirmed:
        study.set_user_attr(CONFIRMED, {str(n): v for n, v in confirmed.items()})
        say("fastopt tune: confirmed (median of " + f"{rounds_done} round(s)): " + ", ".join(
            f"{_trial_name(t)} {statistics.median(confirmed[t.number]):.3f} s/epoch"
            for t in candidates if t.number in confirmed))
    return confirmed


def confirmation_seconds(study: optuna.Study, rounds: int, top: int) -> float:
    """About how long :func:`confirm` will take: ``rounds`` times the baseline and ``top`` others,
    each measurement as long as a completed trial less its check against eager (the median: the
    trials that compiled kernels, which a remeasurement finds cached, are few; the trainer's build,
    graph captures, warm-up, window and teardown are repeated). The phases alone (build, warm-up,
    window) leave the teardown and the setup between them out: on the H200 they kept 5 s where
    one of three rounds fitted. A completed trial of unknown duration counts as none."""
    runs = [t.duration.total_seconds() - t.user_attrs.get("phases", {}).get("check", 0.0)
            for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE and t.duration is not None]
    if rounds < 1 or len(runs) < 2:
        return 0.0
    return rounds * min(top + 1, len(runs)) * statistics.median(runs)


def _trial_name(trial: optuna.trial.FrozenTrial) -> str:
    return "the baseline" if trial.user_attrs.get(ROLE) == "baseline" else f"trial {trial.number + 1}"


def _release(objective: StepObjective, freeze: bool):
    """A study callback freeing what the trial left (:func:`~fastopt.tuner.objective.release`);
    with ``freeze``, what survives the collection (modules the trial imported, caches) is then
    kept out of later collections (:func:`gc.freeze`), unless the trial's trainer survived it."""
    def after(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        release()
        if freeze and not objective.trainer_alive():
            gc.freeze()

    return after


@contextlib.contextmanager
def _frozen() -> Iterator[bool]:
    """Collect once, then keep what exists (modules, the graph, the study) out of the collections
    inside the block (:func:`gc.freeze`), so that a trial's collection walks what the trial made,
    not the whole process (a quarter of a second per collection once torch._dynamo is imported);
    thawed at the end. Yields whether it froze: not where something else had frozen objects."""
    if gc.get_freeze_count():
        yield False
        return
    gc.collect()
    gc.freeze()
    try:
        yield True
    finally:
        gc.unfreeze()


def _claim(study: optuna.Study, context: Dict[str, Any]) -> None:
    """Store ``context`` on a new study; refuse a study made for another problem."""
    before = study.user_attrs.get(CONTEXT)
    if before is None:
        study.set_user_attr(CONTEXT, context)
        return
    for key, sub in _SAME_PROBLEM:
        old, new = before.get(key), context.get(key)
        if sub is not None:
            old, new = (old or {}).get(sub), (new or {}).get(sub)
        if old != new and key == "space":  # Optuna refuses a knob's choices changed under it
            if isinstance(old, dict):
                changed = sorted(n for n in set(old) | set(new) if old.get(n) != new.get(n))
                what = (f"knobs added, dropped or with other choices: {', '.join(changed[:4])}"
                        f"{' ...' if len(changed) > 4 else ''}")
            else:
                what = "made by an earlier fastopt, which kept only its knobs' names"
            raise StudyError(f"study {study.study_name!r} searched another space ({what}); pass a new "
                             f"--study-name (this fastopt's space differs from the one the study was made with)")
        if old != new:
            raise StudyError(f"study {study.study_name!r} tunes another {key} ({old!r}, this run "
                             f"{new!r}); pass a new --study-name, or the same model, dataset and "
                             f"device as the study")


def _stop_before(timeout: Optional[float], say: Callable[[str], None], start: float,
                 clock: Callable[[], float] = time.monotonic,
                 reserve: Callable[[optuna.Study], float] = lambda study: 0.0):
    """A study callback that stops this worker when the next trial, as long as the longest of the
    last three completed ones (of any trial while none completed: a trial pruned early is short
    and says little of the next), would end more than ``timeout`` seconds after ``start`` (a
    ``clock`` reading; None: never), less the seconds ``reserve`` keeps for what follows the
    trials (the confirmation)."""
    deadline = None if timeout is None else start + timeout
    recent: list = []  # durations of the last completed trials
    other: list = []  # of the others, while none completed

    def stop(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if deadline is None or trial.duration is None:
            return
        seconds = trial.duration.total_seconds()
        if trial.state == optuna.trial.TrialState.COMPLETE:
            recent[:] = (recent + [seconds])[-3:]
        else:
            other[:] = (other + [seconds])[-3:]
        pace = recent or other
        left, kept = deadline - clock(), reserve(study)
        if 0 < left and left - kept < max(pace):
            after = f" (and {kept:.0f} s kept for the confirmation)" if kept else ""
            say(f"fastopt tune: stopping: {left:.0f} s of --timeout left{after}, trials take up to "
                f"{max(pace):.0f} s")
            study.stop()

    return stop


def _stop_at(total: int):
    """A study callback that stops this worker once the study's finished trials and those other
    workers are running reach ``total``: workers tuning one study together run about ``total``
    trials between them, not ``total`` each (two that finish at once may both start one more)."""
    def stop(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        busy = study.get_trials(deepcopy=False, states=FINISHED + (optuna.trial.TrialState.RUNNING,))
        if len(busy) >= total:
            study.stop()

    return stop


def phases_line(phases: Optional[Dict[str, float]]) -> str:
    """`` | build 9.1 s, check 1.2 s, ...``: where a trial's wall time went ('' when unknown)."""
    if not phases:
        return ""
    # warm-up: host time until its last step was issued (on CUDA, its unfinished device work is
    # in the window's time)
    return " | " + ", ".join(f"{name.replace('warmup', 'warm-up')} {sec:.1f} s" for name, sec in phases.items())


def _progress(total: int, say: Callable[[str], None], bar, start: Optional[float] = None,
              clock: Callable[[], float] = time.monotonic):
    """A study callback reporting each finished trial with the best so far: a line to ``say``
    (ending with the seconds since ``start``, a ``clock`` reading, where given), or, where ``bar``
    draws (:func:`~fastopt.progress.progress_bar`), a step of the bar whose postfix holds the best
    so far and the last trial's outcome."""
    def report(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        head = f"trial {trial.number + 1}/{total}"
        role = trial.user_attrs.get(ROLE)
        if role == "baseline":
            head += " (baseline)"
        elif role:
            head += f" (the baseline but {trial.user_attrs.get(CHANGED, 'one knob')})"
        if trial.state == optuna.trial.TrialState.COMPLETE:
            what = (f"{trial.value:.3f} s/epoch (step {trial.user_attrs['step_seconds'] * 1e3:.2f} ms) "
                    f"{values_line(trial.user_attrs.get('values', {}))}")
            last = f"{trial.value:.3f} s/epoch"
        else:
            reason = trial.user_attrs.get("failure") or trial.user_attrs.get("pruned") or trial.state.name
            what, last = f"pruned: {reason}", "pruned"
        try:
            best = study.best_trial
            tail = f"best {best.value:.3f} s/epoch (trial {best.number + 1})"
        except ValueError:
            tail = "no trial completed yet"
        if bar.disable:
            since = "" if start is None else f" | {clock() - start:.0f} s since the start"
            say(f"{head}: {what} | {tail}{phases_line(trial.user_attrs.get('phases'))}{since}")
        else:
            bar.update(1)
            bar.set_postfix_str(f"{tail}; trial {trial.number + 1}: {last}")

    return report


def record_from_study(study: optuna.Study) -> TuningRecord:
    """The :class:`TuningRecord` of ``study``'s best trial, beside its baseline trial.

    Raises:
        StudyError: the study was not made by :func:`tune`, or no trial completed (the message
            gives the first pruned trials' reasons).
    """
    context = study.user_attrs.get(CONTEXT)
    if context is None:
        raise StudyError(f"study {study.study_name!r} was not made by fastopt tune (it has no "
                         f"{CONTEXT!r} attribute); export a study that fastopt tune ran")
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not complete:
        reasons = [t.user_attrs.get("failure") or t.user_attrs.get("pruned") or t.state.name
                   for t in study.trials][:3]
        raise StudyError(f"study {study.study_name!r} has no completed trial ({len(study.trials)} "
                         f"finished or running; first reasons: {'; '.join(reasons) or 'none ran'}); "
                         f"run fastopt tune with more --trials or a longer --timeout")
    baseline = next((t for t in complete if t.user_attrs.get(ROLE) == "baseline"), None)
    # a confirmed study (:func:`confirm`): the medians of its rounds, else each trial's window
    confirmed = {int(n): statistics.median(v) for n, v in study.user_attrs.get(CONFIRMED, {}).items()}
    epoch = {t.number: confirmed.get(t.number, t.value) for t in complete}
    best = min((t for t in complete if not confirmed or t.number in confirmed), key=lambda t: epoch[t.number])
    # a step is the epoch over the same number of batches as the trial's own window
    step = {t.number: t.user_attrs["step_seconds"] * (epoch[t.number] / t.value if t.value else 1.0)
            for t in complete}
    counts = {s.name.lower(): sum(t.state == s for t in study.trials) for s in optuna.trial.TrialState}
    return TuningRecord(
        device=context["device"], model=context["model"], dataset=context["dataset"],
        values=dict(best.user_attrs.get("values", best.params)),
        step_seconds=step[best.number],
        default_step_seconds=step[baseline.number] if baseline else None,
        epoch_seconds=epoch[best.number], default_epoch_seconds=epoch[baseline.number] if baseline else None,
        versions=context["versions"],
        measurement={"timing": best.user_attrs.get("timing"), **context["window"],
                     "max_device_memory": context.get("max_device_memory"),
                     "confirm_rounds": len(next(iter(study.user_attrs.get(CONFIRMED, {}).values()), []))},
        study={"name": study.study_name, "model_name": context.get("model_name"),
               "best_trial": best.number, "trials": len(study.trials),
               **{k: v for k, v in counts.items() if v}},
        created=now())


def export_record(storage: str, study_name: str, out) -> "tuple[TuningRecord, Any]":
    """Write the record of study ``study_name`` in ``storage`` into folder ``out``; returns the
    record and its path.

    Raises:
        StudyError: no such study, or it has no completed trial.
    """
    study = open_study(storage, study_name, create=False)
    record = record_from_study(study)
    return record, record.save(out)

