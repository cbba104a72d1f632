"""What every benchmark records about its run: the commit of the code it measured."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The measured checkout's commit (see :func:`fastopt.benchmark.git_commit`)."""
    from fastopt.benchmark import git_commit as commit_of

    return commit_of(str(REPO))


def write_record(path: str, **fields) -> None:
    """Write a GPU benchmark's JSON record: date, GPU, versions, commit, command, then ``fields``."""
    import datetime
    import json
    import platform
    import sys

    import torch
    import triton

    import fastopt

    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "fastopt": fastopt.__version__,
        "git_commit": git_commit(), "command": " ".join([sys.executable, *sys.argv]), **fields,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2))
