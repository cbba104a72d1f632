"""What the fault tests share: the tally of injected faults and fuzzed cases, and child processes.

Imported as ``fault_helpers`` (the conftest puts this folder on ``sys.path``).
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fastopt.data import TemporalGraph

REPO = Path(__file__).resolve().parents[2]

# fuzzed: generated cases run; faults: faults injected; oracle_equal: results equal to the NumPy
# oracle (or the direct computation a cache must reproduce); clean_errors: cases refused with a
# FastOptError; crashes: subprocesses that died of a signal nobody sent.
TALLY: collections.Counter = collections.Counter()
KEYS = ("fuzzed", "faults", "oracle_equal", "clean_errors", "crashes")


def child_env(**extra) -> dict:
    """The environment of a child process: one BLAS and sampler thread, so that numbers are
    reproducible from one process to the next."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", FASTOPT_SAMPLER_THREADS="1",
               OMP_WAIT_POLICY="passive")
    env.update(extra)
    return env


def spawn(args, **env) -> subprocess.Popen:
    """Start ``python args...`` with :func:`child_env`."""
    return subprocess.Popen([sys.executable, *args], env=child_env(**env), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    """Wait for ``proc``; its stdout, after checking that it exited 0 (a signal is a crash)."""
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode < 0:
        TALLY["crashes"] += 1
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-2000:]}\n{err[-4000:]}"
    return out


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 120, what: str = "") -> None:
    """Poll ``predicate`` until it holds; fail if ``proc`` ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the process ended (exit {proc.returncode}) before {what}\n{out[-2000:]}\n{err[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def tiny_graph(events: int = 300, nodes: int = 40, seed: int = 0, **features) -> TemporalGraph:
    """A random event stream small enough to train on in a fraction of a second."""
    rng = np.random.default_rng(seed)
    return TemporalGraph(rng.integers(0, nodes, events), rng.integers(0, nodes, events),
                         np.sort(rng.uniform(0, 100, events)), nodes, **features)


def make_trainer(graph, model: str = "tgn", checkpoint_dir=None, **train):
    """A CPU Trainer of a narrow model (8-wide memory and embeddings), silent."""
    import torch

    from fastopt.config import Config
    from fastopt.models import build_model
    from fastopt.trainer import Trainer

    cfg = Config()
    cfg.train.device, cfg.train.batch_size = "cpu", 100
    for key, value in train.items():
        cfg.set(f"train.{key}", value)
    torch.manual_seed(0)
    net = build_model(model, graph, memory_dim=8, dim=8, time_dim=4)
    return Trainer(net, graph, cfg, checkpoint_dir=checkpoint_dir, progress=False)
