"""Loading the scripts under ``bench/`` as modules, so that tests can run their checks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str):
    """``bench/<name>.py`` as the module ``bench_<name>`` (loaded once per session)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # the scripts import their sibling _meta
    if f"bench_{name}" in sys.modules:
        return sys.modules[f"bench_{name}"]
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module
