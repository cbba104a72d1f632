"""Per-stage timing of a training epoch without synchronizing the device on the hot path.

Layering: imports nothing of fastopt.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections import defaultdict
from typing import Dict, List

import torch

__all__ = ["STAGES", "StageTimer"]

# the stages of a training epoch, in the order reports list them (``gc``: see StageTimer)
STAGES = ("sample", "gather", "forward", "backward", "update", "step", "gc")


class StageTimer:
    """Time per stage without synchronizing the device on the hot path.

    ``with timer("forward"):`` records a CUDA event pair on the current stream (device time,
    resolved once in :meth:`totals`); on the CPU, and for host-side waits (``host=True``), wall
    time is added directly. From its creation until :meth:`totals`, the time the interpreter
    spends in garbage collections (any thread's: a collection stops them all) is the stage
    ``gc``, present only when one ran.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._host: Dict[str, float] = defaultdict(float)
        self._events: Dict[str, List[tuple]] = defaultdict(list)
        self._gc_hook = _collection_clock(weakref.ref(self))
        gc.callbacks.append(self._gc_hook)
        weakref.finalize(self, _forget, self._gc_hook)  # a timer dropped before totals()

    def __call__(self, stage: str, host: bool = False) -> "_Stage":
        return _Stage(self, stage, host or not self.cuda)

    def add(self, stage: str, seconds: float) -> None:
        self._host[stage] += seconds

    def totals(self) -> Dict[str, float]:
        """Seconds per stage (waits for the recorded events: call at the end of an epoch)."""
        _forget(self._gc_hook)
        for stage, pairs in self._events.items():
            for start, end in pairs:
                end.synchronize()
                self._host[stage] += start.elapsed_time(end) / 1e3
        self._events.clear()
        return dict(self._host)


class _Stage:
    def __init__(self, timer: StageTimer, stage: str, host: bool) -> None:
        self.timer, self.stage, self.host = timer, stage, host

    def __enter__(self):
        if self.host:
            self.t0 = time.perf_counter()
        else:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()

    def __exit__(self, *exc):
        if self.host:
            self.timer._host[self.stage] += time.perf_counter() - self.t0
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.timer._events[self.stage].append((self.start, end))
        return False


def _collection_clock(timer_ref):
    """A ``gc.callbacks`` entry adding each collection's wall time to the timer's ``gc`` stage."""
    started = [0.0]

    def hook(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        timer = timer_ref()
        if timer is not None:
            timer._host["gc"] += time.perf_counter() - started[0]

    return hook


def _forget(hook) -> None:
    try:
        gc.callbacks.remove(hook)
    except ValueError:  # removed already
        pass
