"""Shared fixtures: the real datasets beside the repository and small graphs for fast tests."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fastopt.data import TemporalGraph, load_dataset, save_npz

REPO = Path(__file__).resolve().parents[1]

# triton is optional for users (extra "gpu"); the test extra installs it so that CI runs the
# generated kernels on the Triton interpreter.
HAS_TRITON = importlib.util.find_spec("triton") is not None


def pytest_collection_modifyitems(config, items):
    """Without triton, tests of the generated kernels (marked ``interpreter`` or ``gpu``) are
    skipped, naming the package, instead of failing on its import."""
    if HAS_TRITON:
        return
    skip = pytest.mark.skip(reason='needs triton, which is not installed (pip install "fastopt[test]")')
    for item in items:
        if item.get_closest_marker("interpreter") or item.get_closest_marker("gpu"):
            item.add_marker(skip)


def shared_data_dir() -> Path:
    """``$FASTOPT_SHARED_DATA`` or ``../shared/data`` beside the checkout."""
    env = os.environ.get("FASTOPT_SHARED_DATA")
    return Path(env) if env else REPO.parent / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def installed_package_in_children():
    """Child processes import the installed fastopt, not the checkout's ``fastopt/`` folder that
    their working directory (the repository) would put first on ``sys.path``: that folder lacks
    the ``runtime`` and ``codegen`` subpackages, which the installation maps in from beside it."""
    saved = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = "1"
    yield
    if saved is None:
        del os.environ["PYTHONSAFEPATH"]
    else:
        os.environ["PYTHONSAFEPATH"] = saved


@pytest.fixture(scope="session", autouse=True)
def dataset_cache(tmp_path_factory) -> Path:
    """Parsed-dataset caches of the session go to a temporary folder (child processes too):
    the suite writes nothing beside the data, in the package or in the user's cache."""
    from fastopt.config import patch

    path = tmp_path_factory.mktemp("dataset-cache")
    saved = os.environ.get("FASTOPT_DATA_CACHE_DIR")
    os.environ["FASTOPT_DATA_CACHE_DIR"] = str(path)
    with patch(data__cache_dir=str(path)):
        yield path
    if saved is None:
        del os.environ["FASTOPT_DATA_CACHE_DIR"]
    else:
        os.environ["FASTOPT_DATA_CACHE_DIR"] = saved


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = shared_data_dir()
    if not path.is_dir():
        pytest.skip(f"real datasets not found at {path} (set FASTOPT_SHARED_DATA)")
    return path


@pytest.fixture
def one_thread():
    """Bitwise reproducibility holds for a fixed number of BLAS threads; pin it to one."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def learnable_graph() -> TemporalGraph:
    """4,000 events in which each of 40 users always meets its own one of 120 items, nodes with
    8-d random features: a link predictor that learns anything tells the partner from random
    items (TGN reaches test AP about 0.9 in 3 epochs at lr 1e-2; chance is 0.5)."""
    rng = np.random.default_rng(0)
    users, items, events = 40, 120, 4000
    src = rng.integers(0, users, events)
    dst = users + (src * 3) % items
    ts = np.sort(rng.uniform(0, 1e5, events))
    nodes = users + items
    return TemporalGraph(src, dst, ts, nodes,
                         node_feat=rng.standard_normal((nodes, 8)).astype(np.float32))


class _WrongBackward(torch.autograd.Function):
    """The identity forward with a backward 1 % too large: outputs right, gradients wrong."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.01


@pytest.fixture
def wrong_backward():
    """An autograd function to wrap a result in: a check that passes it does not compare gradients."""
    return _WrongBackward


@pytest.fixture(scope="session")
def wikipedia() -> TemporalGraph:
    return load_dataset("wikipedia")


def head(graph: TemporalGraph, n: int, **features) -> TemporalGraph:
    """The first ``n`` events of ``graph`` as a graph of their own (same node ids)."""
    return TemporalGraph(graph.src[:n], graph.dst[:n], graph.ts[:n], graph.num_nodes,
                         name=f"{graph.name}-head{n}", bipartite=graph.bipartite, **features)


@pytest.fixture(scope="session")
def small_graph(wikipedia) -> TemporalGraph:
    """3,000 wikipedia events with 8-d random edge and node features."""
    rng = np.random.default_rng(0)
    return head(wikipedia, 3000, edge_feat=rng.standard_normal((3000, 8), dtype=np.float32),
                node_feat=rng.standard_normal((wikipedia.num_nodes, 4), dtype=np.float32))


@pytest.fixture
def tiny_file(tmp_path, small_graph):
    """:func:`small_graph` saved as an ``.npz`` file (for commands that take a path)."""
    path = tmp_path / "tiny.npz"
    save_npz(small_graph, path)
    return path
