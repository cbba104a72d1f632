"""What every benchmark records about its run: the commit of the code it measured."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """HEAD of the checkout, ``+dirty`` when tracked files differ from it.

    ``$FASTOPT_GIT_COMMIT``, where set, wins: a tree copied onto a GPU machine may carry no
    ``.git`` or a stale one, and the copying command names the commit it copied. Without either,
    ``"unknown"``.
    """
    if os.environ.get("FASTOPT_GIT_COMMIT"):
        return os.environ["FASTOPT_GIT_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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
