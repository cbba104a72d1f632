"""pytest plugin for device runs: each failing test's report is appended to ``$OUT/failures.txt``
as it happens, so that a run cut by its time limit still tells which tests failed and why
(pytest prints its summary only at the end). ``python3 -m pytest -p pytest_failures`` with
``bench/`` on ``PYTHONPATH`` (bench/h200.sh does)."""

import os


def pytest_runtest_logreport(report):
    if report.failed:
        path = os.path.join(os.environ.get("OUT", "."), "failures.txt")
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n\n")
