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


def test_main_exits_non_zero_when_fastopt_is_beyond_the_gap(monkeypatch, tmp_path, capsys):
    """The script itself fails on a wrong result: a fastopt mean 2 points off eager exits 1, and
    the same runs within the gap exit 0 (the runs are injected; nothing trains)."""
    acc = load("accuracy")

    def fake(model, dataset, variant, seed, epochs, extra, shift):
        ap = 0.88 + 0.01 * seed + (shift if variant == "fastopt" else 0.0)
        return {"model": model, "dataset": dataset, "variant": variant, "seed": seed,
                "command": "x", "test": {"ap": ap}}

    argv = ["--models", "jodie", "--datasets", "wikipedia", "--variants", "eager", "fastopt",
            "--seeds", "0", "1", "2", "--json", str(tmp_path / "acc.json")]
    monkeypatch.setattr(acc, "run_one", lambda *a: fake(*a, shift=0.02))
    assert acc.main(argv) == 1
    assert "BEYOND 0.5" in capsys.readouterr().out
    monkeypatch.setattr(acc, "run_one", lambda *a: fake(*a, shift=0.001))
    assert acc.main(argv) == 0
    assert "within 0.5" in capsys.readouterr().out
