"""What every benchmark records about its run: the commit of the code it measured."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """HEAD of the checkout, ``+dirty`` when tracked files differ from it.

    A tree copied without ``.git`` (as onto a GPU machine) reports ``$FASTOPT_GIT_COMMIT``, which
    the copying command sets, else ``"unknown"``.
    """
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("FASTOPT_GIT_COMMIT", "unknown")
