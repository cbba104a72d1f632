"""bench/accuracy.py's verdict: fastopt against eager is judged, the rounding-only variant is shown."""

from __future__ import annotations

import math

import pytest

from bench_scripts import load


def _runs(variant, aps, model="jodie"):
    return [{"model": model, "dataset": "wikipedia", "variant": variant, "seed": s, "command": "x",
             "test": {"ap": ap}} for s, ap in enumerate(aps)]


def test_gaps_carry_their_standard_error_and_only_fastopt_is_judged():
    acc = load("accuracy")
    runs = (_runs("eager", [0.89, 0.87, 0.88]) + _runs("fastopt", [0.89, 0.91, 0.90])
            + _runs("eager-foreach", [0.90, 0.91, 0.88]))
    rows, gaps, failed = acc.summarize(runs, max_gap=0.5)
    assert not failed and len(rows) == 3
    by = {g["variant"]: g for g in gaps}
    assert by["fastopt"]["gap_points"] == pytest.approx(2.0)
    assert by["fastopt"]["stderr_points"] == pytest.approx(100 * math.sqrt(1e-4 / 3 + 1e-4 / 3))
    assert by["fastopt"]["judged"] and not by["fastopt"]["within"]
    assert not by["eager-foreach"]["judged"]  # shown beside, never a failure
    one = acc.summarize(_runs("eager", [0.9]) + _runs("fastopt", [0.9]), max_gap=0.5)[1][0]
    assert one["within"] and math.isnan(one["stderr_points"])


def test_the_rounding_only_variant_trains_eager_with_another_adam():
    acc = load("accuracy")
    assert acc.VARIANTS["eager-foreach"] == ["--no-optimize", "--adam", "foreach"]
