"""Fixtures of the fault tests: the tally of what was injected and fuzzed, a tiny dataset file.

Every test here injects a fault (a killed process, a damaged file, a planted pickle, a device
out-of-memory, processes racing for one cache) or runs fuzzed inputs, and counts it in
``fault_helpers.TALLY``. The counts are printed at the end of the session
(``pytest tests/faults -p no:xdist``; under xdist each worker keeps its own).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fault_helpers import KEYS, TALLY  # noqa: E402

from fastopt.data import TemporalGraph, save_npz  # noqa: E402


@pytest.fixture(scope="session")
def tally():
    return TALLY


def pytest_terminal_summary(terminalreporter):
    if any(TALLY.values()):
        terminalreporter.write_sep("-", "faults and fuzzing")
        terminalreporter.write_line(", ".join(f"{k}: {TALLY[k]}" for k in KEYS))


@pytest.fixture(scope="session")
def tiny_dataset(wikipedia, tmp_path_factory) -> Path:
    """The first 1,500 wikipedia events as an .npz: a few seconds of training per run."""
    n = 1500
    path = tmp_path_factory.mktemp("faults-data") / "tiny.npz"
    save_npz(TemporalGraph(wikipedia.src[:n], wikipedia.dst[:n], wikipedia.ts[:n], wikipedia.num_nodes,
                           name="tiny", bipartite=True), path)
    return path
