"""What every benchmark records about its run: the commit of the code it measured."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The measured checkout's commit (see :func:`fastopt.benchmark.git_commit`)."""
    from fastopt.benchmark import git_commit as commit_of

    return commit_of(str(REPO))


def write_record(path: str, **fields) -> None:
    """Write a benchmark's JSON record: date, GPU (``None`` without CUDA, the CPU's name then in
    ``cpu``), versions (triton ``None`` where it is not installed), commit, command, then
    ``fields``."""
    import datetime
    import json
    import platform
    import sys

    import importlib.util

    import torch

    import fastopt

    cuda = torch.cuda.is_available()
    triton = importlib.util.find_spec("triton") is not None and __import__("triton")
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "capability": list(torch.cuda.get_device_capability()) if cuda else None,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "triton": triton.__version__ if triton else None,
        "python": platform.python_version(), "fastopt": fastopt.__version__,
        "git_commit": git_commit(), "command": " ".join([sys.executable, *sys.argv]), **fields,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2))
