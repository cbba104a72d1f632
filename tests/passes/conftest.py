"""Puts this directory on sys.path: --import-mode=importlib does not, and the tests import
:mod:`passes_helpers`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


import pytest  # noqa: E402


@pytest.fixture
def reference_backend():
    """The fused operators' reference implementation on the CPU (``kernels.backend="auto"`` runs
    the code a rewrite replaced there, which is faster): for tests of the operators themselves."""
    import fastopt.config as fconfig

    with fconfig.patch(kernels__backend="reference"):
        yield
