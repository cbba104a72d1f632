"""Per-stage timing of a training epoch without synchronizing the device on the hot path.

Layering: imports nothing of fastopt.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Dict, List

import torch

__all__ = ["StageTimer"]


class StageTimer:
    """Time per stage without synchronizing the device on the hot path.

    ``with timer("forward"):`` records a CUDA event pair on the current stream (device time,
    resolved once in :meth:`totals`); on the CPU, and for host-side waits (``host=True``), wall
    time is added directly.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._host: Dict[str, float] = defaultdict(float)
        self._events: Dict[str, List[tuple]] = defaultdict(list)

    def __call__(self, stage: str, host: bool = False) -> "_Stage":
        return _Stage(self, stage, host or not self.cuda)

    def add(self, stage: str, seconds: float) -> None:
        self._host[stage] += seconds

    def totals(self) -> Dict[str, float]:
        """Seconds per stage (waits for the recorded events: call at the end of an epoch)."""
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
