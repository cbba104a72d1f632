"""StageTimer: host stages add wall time; garbage collections during its life are the ``gc`` stage."""

from __future__ import annotations

import gc
import time

import torch

from fastopt.runtime.timing import STAGES, StageTimer


def test_host_stages_and_collections_are_timed():
    before = list(gc.callbacks)
    timer = StageTimer(torch.device("cpu"))
    with timer("sample"):
        time.sleep(0.01)
    garbage = [[] for _ in range(100_000)]
    for a, b in zip(garbage, garbage[1:]):
        a.append(b)  # reference cycles: a collection has work to do
    del garbage, a, b
    gc.collect()
    totals = timer.totals()
    assert totals["sample"] >= 0.01 and totals["gc"] > 0
    assert gc.callbacks == before  # totals() stops the clock
    gc.collect()
    assert timer.totals()["gc"] == totals["gc"]
    assert "gc" in STAGES and STAGES[:6] == ("sample", "gather", "forward", "backward", "update", "step")


def test_a_timer_dropped_before_its_totals_leaves_no_callback():
    before = list(gc.callbacks)
    timer = StageTimer(torch.device("cpu"))
    assert len(gc.callbacks) == len(before) + 1
    del timer
    gc.collect()
    assert gc.callbacks == before


def test_no_collection_no_gc_stage():
    gc.disable()
    try:
        timer = StageTimer(torch.device("cpu"))
        with timer("gather"):
            pass
        assert "gc" not in timer.totals()
    finally:
        gc.enable()
