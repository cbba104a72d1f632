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
