"""Puts this directory on sys.path: --import-mode=importlib does not, and the tests import
:mod:`bench_scripts`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
