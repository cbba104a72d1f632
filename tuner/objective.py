"""The objective: a short, real window of the training loop under one trial's config.

A trial builds a :class:`~fastopt.trainer.Trainer` with its config and runs the first batches of
an epoch through :meth:`~fastopt.trainer.Trainer.train_steps`: the warm-up steps (kernel
compiles, CUDA-graph captures, the loader filling up) are left out, and the mean of the timed
steps is the trial's step time. By default the timed steps are the rest of the epoch
(``tuner.steps_per_trial``, at most 1,000): the epoch's first batches are its cheapest to sample
and stage (the history is short), and a deeper prefetch hides a slow stage for a few dozen steps,
so that a window of its first 50 steps ranked a config that falls behind later in the epoch first
(TGN on wikipedia at d1f0fe3: one staging thread and a prefetch depth of 4 timed 1.50 against
1.60 ms a step, and trained its epochs at 0.448 against 0.427 s). The mean, not the median, for
the same reason: steps that wait for the loader in part of the epoch are part of its time. The
epoch's last batch is left out where it is smaller than the others: its shape is captured (and
its kernels specialized) once per run, a cost no later epoch pays (the first trial of a study
timed 24 ms a step with it, against 1.5 ms). Before them the trainer plans its padded lengths
(:meth:`~fastopt.trainer.Trainer.plan_shapes`: one sampling pass, no training), so that the
window's steps run at a steady epoch's shapes; else the first epoch's lengths grow as the history
fills and the window times a capture every few steps. Where a trial reads edge rows zero-copy
from host memory, a pass over the next epoch's draws counts their uses, so that its window reads
through hot sets planned as a steady epoch's are (from another epoch's uses): a first epoch has
no last epoch's to plan them from, and read every row over the bus (the cache's budget and
``cache.hot_set_phases`` changed nothing a trial timed). A step is timed from the end of one step to the end of the next,
so a step that waits for the loader counts the wait: the pipeline knobs matter. On CUDA the marks
are CUDA events recorded on the stream (one synchronize at the end of the window, none per
step); on the CPU, wall time. The value minimized is that mean times the training batches of an
epoch, so that trials of different batch sizes compare.

Before its window, a trial whose model runs optimized (fused ops: on CUDA, the kernels under the
trial's mapping) is checked against the eager model with the same weights on the epoch's first
batch, outputs and parameter gradients against the float64 eager model
(:func:`fastopt.verify_against_eager`, :func:`check_against_eager`): a trial whose
values give other results is pruned with the disagreement as its reason, so that it can never be
the study's best.

A trial that fails (a device out-of-memory, a kernel that does not compile, a combination the
configuration refuses, results that disagree with eager) is pruned, never ends the study: the
reason is kept in the trial's user attribute ``failure``. Halfway through the window, a trial slower than the pruner allows (Optuna's
median rule over earlier trials) is pruned too, with the reason in ``pruned``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import statistics
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

import optuna
import torch

from fastopt.config import Config
from fastopt.errors import ConfigError, FastOptError
from fastopt.tuner.space import SearchSpace

__all__ = ["Measurement", "ROLE", "StepObjective", "TrialTimeout", "Window", "check_against_eager",
           "measure_window", "device_memory_limit", "release"]

# trial user attribute marking the baseline trial ("baseline") and its one-knob variations
ROLE = "role"


@dataclass(frozen=True)
class Window:
    """How much of the training loop a trial runs: ``warmup`` untimed steps, then ``timed`` (or
    the rest of the epoch where it is shorter); ``seconds`` the wall time a whole trial may take
    (0: no limit)."""

    warmup: int = 5
    timed: int = 1000
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.timed < 1:
            raise ConfigError(f"a trial's window needs warmup >= 0 and timed >= 1 steps (got "
                              f"warmup={self.warmup}, timed={self.timed}); set tuner.warmup_steps "
                              f"and tuner.steps_per_trial")
        if not self.seconds >= 0:
            raise ConfigError(f"a trial's time limit must be >= 0 seconds (got {self.seconds}); set "
                              f"tuner.trial_seconds (0 = no limit)")

    @classmethod
    def of(cls, config: Config) -> "Window":
        """The window ``config.tuner`` describes."""
        tu = config.tuner
        return cls(tu.warmup_steps, tu.steps_per_trial, tu.trial_seconds)


class TrialTimeout(FastOptError):
    """A trial ran past its time limit (:attr:`Window.seconds`)."""


def _past(deadline: Optional[float]) -> bool:
    return deadline is not None and time.perf_counter() > deadline


def _timeout(window: Window, where: str) -> TrialTimeout:
    return TrialTimeout(f"the trial took more than {window.seconds:g} s ({where}); raise "
                        f"tuner.trial_seconds to let such configs finish")


def _cut(where: str) -> TrialTimeout:
    return TrialTimeout(f"the study's --timeout, less the time kept for the confirmation, ran out "
                        f"({where}); pass a longer --timeout to let such configs finish")


class _Held:
    """An alarm that rang inside :func:`_held` (raised when the outermost one ends)."""
    depth = 0
    rang: Optional[TrialTimeout] = None


@contextlib.contextmanager
def _held(raise_alarm: bool = True) -> Iterator[None]:
    """A write to the study's storage (or a setting such as the memory limit) inside a trial's
    :func:`_alarm`: an alarm that rings in it is raised once the write has ended, never in its
    middle (a session cut mid-commit could leave the storage unusable for the rest of the study,
    a limit cut between set and reset would hold the next trial's check). ``raise_alarm=False``:
    dropped instead (a write made while another error is on its way out, which stays the trial's
    reason)."""
    _Held.depth += 1
    try:
        yield
    finally:
        _Held.depth -= 1
    if not _Held.depth and _Held.rang is not None:
        rang, _Held.rang = _Held.rang, None
        if raise_alarm:
            raise rang


@contextlib.contextmanager
def _alarm(deadline: Optional[float], late: Callable[[], TrialTimeout]) -> Iterator[None]:
    """Raise ``late()`` in the block once ``time.perf_counter()`` passes ``deadline``, wherever
    the main thread is: inside a kernel's compile too (its ``ptxas`` ran for over 100 s on the
    H200, past every check between a trial's parts, until the study's process was killed);
    ``subprocess.run`` kills the compiler it waits for. One SIGALRM, disarmed when the block
    ends; nothing where signals cannot be caught (another thread, no ``setitimer``, SIGALRM
    handled by someone else): the checks between steps remain."""
    try:
        usable = (deadline is not None and hasattr(signal, "setitimer")
                  and threading.current_thread() is threading.main_thread()
                  and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None))
    except ValueError:
        usable = False
    if not usable:
        yield
        return
    armed = [True]

    def ring(signum, frame):
        if armed[0]:  # never after the block: Optuna would see the error, not the trial
            armed[0] = False
            if _Held.depth:  # in a storage write: raised when it ends
                _Held.rang = late()
                return
            raise late()

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, max(deadline - time.perf_counter(), 1e-3))
    try:
        yield
    finally:
        armed[0], _Held.rang, _Held.depth = False, None, 0  # nothing held outlives the trial
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Measurement:
    """What a window measured.

    Attributes:
        step_seconds: the mean timed step.
        epoch_seconds: ``step_seconds`` times the training batches of an epoch.
        steps: every timed step, in order.
        timing: ``"cuda_events"`` or ``"wall"``.
        warmup: untimed steps before them.
        peak_device_bytes: the most device memory the CUDA allocator held in the window (None
            on the CPU): its reserved bytes, captured graphs' private pools and cached free
            blocks included, which is what ``--max-device-memory`` bounds (PyTorch's
            per-process fraction); the allocated bytes alone run 20-40 MiB under it for TGN.
        warmup_seconds: wall seconds from the call until the warm-up's last step was issued
            (the shape plan's sampling pass, kernel compiles and graph captures happen there).
    """

    step_seconds: float
    epoch_seconds: float
    steps: List[float] = field(default_factory=list)
    timing: str = "wall"
    warmup: int = 0
    peak_device_bytes: Optional[int] = None
    warmup_seconds: float = 0.0


class _Marks:
    """Points in time after each step: CUDA events on the current stream, or wall time."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.points: List[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points.append(event)
        else:
            self.points.append(time.perf_counter())

    def intervals(self) -> List[float]:
        """Seconds between consecutive marks (waits for the device once, on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1000.0 for a, b in zip(self.points, self.points[1:])]
        return [b - a for a, b in zip(self.points, self.points[1:])]


def measure_window(trainer, window: Window,
                   checkpoint: Optional[Callable[[int, float], None]] = None,
                   deadline: Optional[float] = None,
                   late: Optional[Callable[[str], TrialTimeout]] = None) -> Measurement:
    """Run ``window.warmup`` then ``window.timed`` training steps of ``trainer``'s first epoch and
    time them (fewer timed steps when the epoch is shorter; never its last batch where that is
    smaller than the others).

    Args:
        trainer: a :class:`~fastopt.trainer.Trainer`.
        window: the steps to run.
        checkpoint: called once halfway with ``(timed steps so far, their mean in seconds times
            the epoch's batches)``: the quantity the study minimizes, so that trials of other
            batch sizes are compared by epoch, not by step;
            it may raise (:class:`optuna.TrialPruned`) to stop the window. On CUDA the step after
            it is left out: it holds the synchronize that reading the events needed.
        deadline: ``time.perf_counter()`` value after which the next step raises.
        late: the error a step past ``deadline`` raises, given where the window was (default:
            the trial's time limit, ``window.seconds``).

    Raises:
        ConfigError: the training split has no batch left to time after the warm-up.
        TrialTimeout: a step ended after ``deadline``.
    """
    batches = trainer.loader.num_batches("train")
    split = trainer.graph.split_range("train")
    partial = (split.stop - split.start) % trainer.config.train.batch_size != 0
    timed = min(window.timed, batches - int(partial) - window.warmup)  # never the smaller last batch
    if timed < 1:
        raise ConfigError(f"the training split has {batches} batches at batch size "
                          f"{trainer.config.train.batch_size}, none left to time after "
                          f"{window.warmup} warm-up steps; lower tuner.warmup_steps or the batch size")
    device = trainer.device
    start, warm = time.perf_counter(), None
    plan = getattr(trainer, "plan_shapes", None)
    if plan is not None:  # a steady epoch's lengths (one capture per batch size, not one per growth)
        plan(hot_sets=True)  # and hot sets (zero-copy reads): the first epoch has no last one's
    marks, half, skip = _Marks(device), (timed // 2 if checkpoint else 0), None
    if marks.cuda:
        torch.cuda.reset_peak_memory_stats(device)
    if window.warmup == 0:
        marks.mark()  # the first step is timed from here
    with contextlib.closing(trainer.train_steps(epoch=0)) as losses:
        for i, _loss in enumerate(losses):
            if _past(deadline):
                where = (f"in its warm-up, step {i + 1}" if i + 1 < window.warmup
                         else f"after {i + 1 - window.warmup} timed steps")
                raise late(where) if late is not None else _timeout(window, where)
            if i + 1 < window.warmup:
                continue
            marks.mark()  # the last warm-up step's mark starts the timing
            warm = time.perf_counter() - start if warm is None else warm
            done = i + 1 - window.warmup
            if half and done == half:
                checkpoint(done, statistics.fmean(marks.intervals()) * batches)
                skip = done  # the next step's interval holds the synchronize
            if done >= timed:
                break
    intervals = marks.intervals()
    if skip is not None and marks.cuda and len(intervals) > skip:
        del intervals[skip]
    step = statistics.fmean(intervals)
    peak = torch.cuda.max_memory_reserved(device) if marks.cuda else None
    return Measurement(step, step * batches, intervals, "cuda_events" if marks.cuda else "wall",
                       window.warmup, peak, 0.0 if window.warmup == 0 else (warm or 0.0))


@contextlib.contextmanager
def device_memory_limit(device: torch.device, limit_bytes: Optional[int]) -> Iterator[None]:
    """Hold a CUDA device's allocations under ``limit_bytes`` (PyTorch's per-process memory
    fraction) inside the block; a no-op on the CPU or without a limit."""
    if limit_bytes is None or device.type != "cuda":
        yield
        return
    # the fraction is set per device index: a bare "cuda" (a trainer's default) is the current one
    index = torch.cuda.current_device() if device.index is None else device.index
    total = torch.cuda.get_device_properties(index).total_memory
    _LIMITED.add(index)  # given back by release() too, should an alarm cut the block below short
    try:  # a trial's alarm waits for each setting (_held): the limit is never left on after it
        with _held():
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit_bytes / total), index)
        yield
    except BaseException:
        # the block's own error is the trial's reason: an alarm that rings while the limit is
        # given back is dropped, not raised in its place
        with _held(raise_alarm=False):
            _give_back(index)
        raise
    with _held():
        _give_back(index)


# device indices whose memory fraction device_memory_limit set and has not given back yet
_LIMITED: set = set()


def _give_back(index: int) -> None:
    """Lift device ``index``'s memory limit (inside :func:`_held`)."""
    torch.cuda.set_per_process_memory_fraction(1.0, index)
    _LIMITED.discard(index)


def check_against_eager(make_eager: Callable[[Config], Any]) -> Callable[[Any], Optional[float]]:
    """A trial's check: its trainer's model, where it runs optimized, against an eager model
    that ``make_eager`` builds for the trial's config and that gets the same weights and state.

    The check runs :func:`fastopt.verify_against_eager` on the first training batch:
    outputs and parameter gradients against the eager model in float64, each within 1e-4
    relative or 8x the float32 eager model's own error. It returns the largest error ratio to
    eager's, None for a model that runs eager (nothing to compare), and raises
    :class:`~fastopt.errors.FastOptError` naming the quantity that disagrees.
    """
    def check(trainer) -> Optional[float]:
        from fastopt import verify_against_eager

        report = getattr(trainer.model, "fastopt_report", None)
        if report is None or not report.changed:
            return None
        from fastopt.runtime import drop_graphs

        eager = make_eager(trainer.config).to(trainer.device)
        eager.load_state_dict(trainer.model.state_dict())
        batch = next(iter(trainer.plan("train", 0)))
        inputs = trainer.build_inputs(batch.roots, batch.times)
        try:
            return verify_against_eager(trainer.model, eager, inputs)
        except FastOptError as exc:
            if type(exc) is not FastOptError:  # a timeout, a kernel that fails, memory: not a wrong result
                raise
            raise FastOptError(f"the trial's outputs or gradients disagree with eager ({exc}); its "
                               f"values are never chosen") from None
        finally:  # the eval-mode graphs it captured: training never replays them
            drop_graphs(trainer.model)

    return check


def failure_reason(exc: BaseException) -> str:
    """The first line of an exception, with its type: what a pruned trial records."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else "no message"
    return f"{type(exc).__name__}: {text}"


class StepObjective:
    """An Optuna objective: one trial trains a window under the space's suggested values.

    Args:
        space: the search space.
        config: the baseline configuration the values are set on.
        make_trainer: builds a fresh :class:`~fastopt.trainer.Trainer` (model included) for a
            config; called once per trial.
        window: the steps each trial runs.
        max_device_memory: bytes the CUDA allocator may hold for a trial while it trains
            (reserved: its model and tables, captured graphs' pools and cached blocks, in the
            warm-up and window; not the check against eager, which holds an eager copy of the
            model beside it); a trial above it is pruned. Ignored on the CPU.
        check: called with each trial's trainer before its window (:func:`check_against_eager`);
            a trial whose check raises is pruned with the reason. None: no check.
        cutoff: returns the ``time.perf_counter()`` value no trial may run past (the study's
            ``--timeout`` less the confirmation's time); None: none.

    A trial runs at most ``window.seconds`` (the baseline, which the record compares with,
    excepted) and never past the cutoff: past either it is pruned with :class:`TrialTimeout`,
    even in the middle of a kernel's compile (:func:`_alarm`).

    The trial's user attributes: ``worker`` (``host:pid`` of the process that ran it),
    ``values`` (every value set, fixed ones included), ``verified`` (what the check returned),
    ``step_seconds``, ``steps``, ``timing``, ``peak_device_bytes``, ``phases`` (wall seconds of
    ``build``, ``check``, ``warmup`` and ``window``; ``unfinished``: the part a pruned trial was
    in), and ``failure`` or ``pruned`` with the reason when pruned.

    A trial leaves its trainer to be collected: call :func:`release` between trials
    (:func:`~fastopt.tuner.study.tune` does, once Optuna has dropped the trial).
    """

    def __init__(self, space: SearchSpace, config: Config, make_trainer: Callable[[Config], Any],
                 window: Window = Window(), max_device_memory: Optional[int] = None,
                 check: Optional[Callable[[Any], Optional[float]]] = None,
                 cutoff: Optional[Callable[[], float]] = None) -> None:
        self.space, self.config, self.make_trainer = space, config, make_trainer
        self.window, self.max_device_memory, self.check = window, max_device_memory, check
        self.cutoff = cutoff
        self._trainer: Callable[[], Any] = lambda: None  # the last trial's, by weak reference

    def trainer_alive(self) -> bool:
        """Whether the last trial's trainer is still alive (or cannot be referred to weakly)."""
        return self._trainer() is not None

    def __call__(self, trial: optuna.Trial) -> float:
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        values = self.space.suggest(trial)
        trial.set_user_attr("values", values)
        trainer, self._trainer = None, lambda: None
        phases: Dict[str, float] = {}  # wall seconds per part of the trial: where its time goes
        clock = time.perf_counter()
        deadline, late = self._deadline(trial, clock)
        part = ["building it"]  # where the trial is, for a timeout's message
        try:
            with _alarm(deadline, lambda: late(part[0])):
                config = self.space.apply(self.config, values)
                trainer = self.make_trainer(config)
                phases["build"], clock, part[0] = time.perf_counter() - clock, time.perf_counter(), "checking it"
                try:
                    self._trainer = weakref.ref(trainer)
                except TypeError:  # not weakly referable: counted as alive
                    self._trainer = lambda: True
                # the check holds a second, eager copy of the model, which training does not: it
                # runs outside the memory limit, which bounds what training with the config holds
                if self.check is not None:
                    verified = self.check(trainer)
                    with _held():
                        trial.set_user_attr("verified", verified)
                    phases["check"], clock = time.perf_counter() - clock, time.perf_counter()
                    if _past(deadline):
                        raise late("building and checking it")
                part[0] = "in its warm-up or window"
                result = self._window(trainer, lambda step, value: _prune_if_slow(trial, step, value), deadline, late)
            phases["warmup"] = result.warmup_seconds
            phases["window"] = time.perf_counter() - clock - result.warmup_seconds
            with _held():
                trial.set_user_attr("peak_device_bytes", result.peak_device_bytes)
            self._check_memory(result)
        except optuna.TrialPruned:
            raise
        except Exception as exc:  # noqa: BLE001  (a failing config is a result, never the study's end)
            reason = failure_reason(exc)
            trial.set_user_attr("failure", reason)
            raise optuna.TrialPruned(reason) from None
        finally:
            del trainer  # freed by release() once the trial is over (study.tune calls it)
            if "window" not in phases:  # failed or pruned: the time of the part it was in
                phases["unfinished"] = time.perf_counter() - clock
            trial.set_user_attr("phases", phases)
        trial.set_user_attr("step_seconds", result.step_seconds)
        trial.set_user_attr("steps", result.steps)
        trial.set_user_attr("timing", result.timing)
        return result.epoch_seconds

    def _deadline(self, trial: optuna.Trial, now: float):
        """``(deadline, late)``: the ``time.perf_counter()`` value the trial must end by (None:
        none), the earlier of its own limit and the cutoff, and the error for a trial past it."""
        own = (now + self.window.seconds if self.window.seconds and trial.user_attrs.get(ROLE) != "baseline"
               else None)
        cut = self.cutoff() if self.cutoff is not None else None
        if cut is not None and (own is None or cut < own):
            return cut, _cut
        return own, lambda where: _timeout(self.window, where)

    def remeasure(self, values: Dict[str, Any]) -> float:
        """The epoch seconds of a finished trial's ``values`` measured again: a fresh trainer and
        window under the memory limit, no check against eager (the trial made it) and no pruning.

        Raises:
            Exception: whatever building or training raises (out of memory, the memory limit).
        """
        trainer = self.make_trainer(self.space.apply(self.config, values))
        try:
            result = self._window(trainer)
            self._check_memory(result)
            return result.epoch_seconds
        finally:
            del trainer

    def _window(self, trainer, *args) -> Measurement:
        """``trainer``'s window (:func:`measure_window`, ``args`` after the window) under the
        memory limit, the allocator's cached blocks given back first (a check's eager copy, the
        build's temporaries): the limit and the peak count what training holds."""
        release(collect=False)
        with device_memory_limit(trainer.device, self.max_device_memory):
            return measure_window(trainer, self.window, *args)

    def _check_memory(self, result: Measurement) -> None:
        """A ConfigError where the window's peak went above the limit without failing (the
        fraction PyTorch enforces is rounded to a float of the device's memory)."""
        limit, peak = self.max_device_memory, result.peak_device_bytes
        if limit is not None and peak is not None and peak > limit:
            raise ConfigError(f"the trial's peak device memory {peak / 2**30:.2f} GiB is above the "
                              f"limit {limit / 2**30:.2f} GiB (--max-device-memory)")


def _prune_if_slow(trial: optuna.Trial, step: int, epoch_seconds: float) -> None:
    reason = None
    try:
        with _held():
            trial.report(epoch_seconds, step)
            if not trial.should_prune():
                return
            reason = (f"slower than earlier trials after {step} steps (mean step times the epoch's "
                      f"batches: {epoch_seconds:.3f} s)")
            trial.set_user_attr("pruned", reason)
    except TrialTimeout:
        if reason is None:  # the alarm rang before the pruning was decided
            raise
    raise optuna.TrialPruned(reason)


def release(collect: bool = True) -> None:
    """Free what a trial left behind (its trainer, captured graphs, cached blocks): one garbage
    collection, then the CUDA allocator's cached blocks. :func:`~fastopt.tuner.study.tune` calls
    it after each trial, once Optuna has dropped the trial's frames (a pruned trial's traceback
    holds its trainer until then), and gives back a memory limit an alarm left set.
    ``collect=False``: no collection, before a window (what the build's temporaries and a
    check's eager model left in the allocator)."""
    if collect:
        gc.collect()
    with _held():  # a limit an alarm cut off before device_memory_limit could give it back
        for index in sorted(_LIMITED):
            _give_back(index)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def values_line(values: Dict[str, Any]) -> str:
    """``group.field=value`` pairs on one line."""
    return " ".join(f"{k}={v}" for k, v in values.items())
