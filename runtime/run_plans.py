"""Hot sets per run of an epoch (``cache.hot_set_phases``), planned from the last epoch's uses.

A zero-copy table whose epoch goes through ``P`` runs of batches gives each run the rows the same
run of the last epoch used most, filled up to the capacity with the rows the whole epoch used
most. Ranking a table's rows takes about 0.2 s per 50 M rows on 2 cores, once per run, and it
happens at the split's epoch start on the training thread: so only the first run's hot set is
planned there, and the others on a thread of their own while the first run trains. Whoever needs
run ``p``'s set (a staging thread counting one of its batches against it, or its install) waits
for it (:meth:`RunPlans.get`, :meth:`RunPlans.ready`).

An epoch with no last one (the first) may count its own uses ahead instead, from its batches
sampled as it will sample them (:func:`uses_per_run`, ``SlimCache.foresee``).
"""

from __future__ import annotations

import threading
from typing import Iterable, List, Optional, Tuple

import numpy as np
import torch

from fastopt.errors import CacheError
from fastopt.runtime.cache_policy import hot_set
from fastopt.runtime.counting import count_uses

__all__ = ["RunPlans", "run_of", "uses_per_run"]


def run_of(index: int, phases: int, batches: int) -> int:
    """The run that batch ``index`` of an epoch of ``batches`` in ``phases`` equal runs is in."""
    return min(phases - 1, max(0, index) * phases // batches) if phases > 1 else 0


def uses_per_run(lookups: Iterable[Tuple[int, torch.Tensor, torch.Tensor, int]], phases: int, batches: int,
                 rows: int) -> torch.Tensor:
    """Uses per run and row (``[phases, rows]`` int32) of an epoch's lookups, each ``(index,
    values, inverse, pad)``: batch ``index``'s sorted unique ids (``-1`` first where ``pad``)
    and its entries' places in them; each valid id is one use in the run of its batch, as the
    staging threads count an epoch's reads."""
    seen = np.zeros((phases, rows), dtype=np.int32)
    for index, values, inverse, pad in lookups:
        count_uses(values.numpy(), inverse.reshape(-1).numpy(), bool(pad), seen[run_of(index, phases, batches)])
    return torch.from_numpy(seen)


class RunPlans:
    """The hot sets of an epoch in ``phases`` runs from the last epoch's uses ``used``
    (``[P', rows]``: uses per run of that epoch and row). Run ``p`` ranks the uses of the last
    epoch's runs that start in it (else the one it falls in), then takes the whole epoch's most
    used rows it lacks, up to ``capacity``. One hot set of the whole epoch (:attr:`count` 1)
    where runs are not asked for or the last epoch used fewer rows than ``capacity``.

    :attr:`bits`: one bit per run and row (bit ``p`` set for the rows of run ``p``'s set), None
    with one hot set; bit ``p`` is final once :meth:`ready` returns for ``p``."""

    def __init__(self, used: torch.Tensor, phases: int, capacity: int) -> None:
        self._used = used if used.dim() > 1 else used[None]
        self._phases, self._capacity = phases, capacity
        self._total: Optional[torch.Tensor] = None
        self._plans: List[torch.Tensor] = []
        self._error: Optional[BaseException] = None
        self.bits: Optional[np.ndarray] = None
        first = None
        if phases > 1 and capacity > 0:
            first = hot_set(self._run_uses(0), capacity)
            if first.numel() < capacity and self._total_set().numel() < capacity:
                first = None  # every row the last epoch used fits: one hot set
        if first is None:
            self.count = 1
            self._plans.append(self._total_set())
            self._ready = [threading.Event()]
            self._ready[0].set()
            return
        self.count = phases
        self.bits = np.zeros(self._used.shape[1], dtype=np.uint8)
        self._ready = [threading.Event() for _ in range(phases)]
        self._add(0, first)
        self._thread = threading.Thread(target=self._plan_rest, name="fastopt-hot-sets", daemon=True)
        self._thread.start()

    def get(self, p: int) -> torch.Tensor:
        """Run ``p``'s hot set (waits for it)."""
        self.ready(p)
        return self._plans[p]

    def ready(self, p: int) -> None:
        """Wait until run ``p``'s hot set (and its bit in :attr:`bits`) is planned."""
        self._ready[p].wait()
        if p >= len(self._plans):  # the thread failed before it: one error each, with its cause
            raise CacheError(f"planning the hot set of run {p} of {self.count} failed: "
                             f"{type(self._error).__name__}: {self._error}") from self._error

    def join(self) -> None:
        """Wait for every run's hot set (the planning thread done, or failed)."""
        for event in self._ready:
            event.wait()

    def all(self) -> List[torch.Tensor]:
        """Every run's hot set, in run order (waits for them)."""
        return [self.get(p) for p in range(self.count)]

    def _run_uses(self, p: int) -> torch.Tensor:
        used, last = self._used, self._used.shape[0]
        # the last epoch's runs that start in run p of this one (consecutive), else the one it falls in
        lo, hi = -(-p * last // self._phases), -(-(p + 1) * last // self._phases)
        return _summed(used, lo, hi) if hi > lo else used[p * last // self._phases]

    def _total_set(self) -> torch.Tensor:
        if self._total is None:
            self._total = hot_set(_summed(self._used, 0, self._used.shape[0]), self._capacity)
        return self._total

    def _add(self, p: int, hot: torch.Tensor) -> None:
        if hot.numel() < self._capacity:  # filled with the epoch's most used rows it lacks
            mine = np.zeros(self._used.shape[1], dtype=bool)
            mine[hot.numpy()] = True
            total = self._total_set()
            hot = torch.cat([hot, total[~torch.from_numpy(mine[total.numpy()])]])[:self._capacity]
        self.bits[hot.numpy()] |= np.uint8(1 << p)  # one writer; readers of other bits see them unchanged
        self._plans.append(hot)
        self._ready[p].set()

    def _plan_rest(self) -> None:
        try:
            for p in range(1, self._phases):
                self._add(p, hot_set(self._run_uses(p), self._capacity))
        except BaseException as exc:  # raised where a run's set is waited for
            self._error = exc
        finally:
            for event in self._ready:
                event.set()


def _summed(used: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Uses of the runs ``lo..hi-1`` of ``used``, per row."""
    # NumPy's reduction: torch's, widened to int64, took 13 s for 8 x 50 M rows on 2 cores
    return used[lo] if hi == lo + 1 else torch.from_numpy(used[lo:hi].numpy().sum(0, dtype=np.int64))
