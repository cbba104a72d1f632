"""Fixtures of the codegen tests: the device the kernels run on, a private kernel cache, inputs.

Without CUDA the Triton interpreter runs the generated kernels on the CPU: ``TRITON_INTERPRET``
is set here, before any kernel is defined (kernels are imported from the cache on first use). The
``device`` fixture gives the same test body a CPU/interpreter variant (marked ``interpreter``)
and a CUDA variant (marked ``gpu``); ``pytest -m gpu tests/codegen`` runs the latter on a GPU.
The interpreter is process-wide, so a process runs only one of the two kinds.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import fastopt.config as fconfig  # noqa: E402

# Test modules import the shared input builders as ``codegen_inputs`` (pytest runs with
# --import-mode=importlib, which does not put test directories on sys.path).
sys.path.insert(0, str(Path(__file__).parent))

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(
    params=[
        pytest.param("cpu", marks=pytest.mark.interpreter, id="interpreter"),
        pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
    ]
)
def device(request) -> torch.device:
    """Where the generated kernels run: the CPU interpreter, or a CUDA GPU."""
    if request.param == "cuda" and not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    if request.param == "cuda" and INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set: CUDA kernels would be interpreted")
    if request.param == "cpu" and not INTERPRETED:
        pytest.skip("CPU kernels need TRITON_INTERPRET=1 (set it to run the interpreter tests)")
    return torch.device(request.param)


@pytest.fixture(autouse=True, scope="session")
def kernel_cache_dir(tmp_path_factory):
    """A private kernel cache for the session, so tests never reuse a user's cache."""
    root = tmp_path_factory.mktemp("fastopt-kernels")
    with fconfig.patch(kernels__cache_dir=str(root)):
        yield root


@pytest.fixture
def triton_backend():
    """Run the generated kernels (also on the CPU) and poison their outputs with NaN."""
    with fconfig.patch(kernels__backend="triton", kernels__poison_outputs=True) as cfg:
        yield cfg
