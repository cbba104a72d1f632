"""Two worker processes tune one study through a real PostgreSQL server: no trial is lost, none
runs twice, the baseline runs once, and the study holds the total asked for.

The server is the one ``$FASTOPT_TEST_POSTGRES_URL`` names (``.ci/run`` installs Debian's
``postgresql``, starts a cluster and sets it). Without the variable the test is skipped, except
under CI (``CI=true``), where a missing server is a failure: it must never pass by not running.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pytest

from fastopt.tuner import open_study
from fastopt.tuner.study import ROLE

URL_VARIABLE = "FASTOPT_TEST_POSTGRES_URL"
WORKER = Path(__file__).with_name("tune_worker.py")
TRIALS = 8


def _missing(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; under CI .ci/run installs and starts PostgreSQL and sets {URL_VARIABLE}")
    pytest.skip(f"{reason} (.ci/run sets it; locally: {URL_VARIABLE}=postgresql://user@/db?host=/socket/dir)")


@pytest.fixture
def postgres_url():
    """A fresh database on the server of ``$FASTOPT_TEST_POSTGRES_URL`` (dropped afterwards), so
    that the workers create Optuna's tables together; the database itself where the role may not
    create one."""
    url = os.environ.get(URL_VARIABLE)
    if not url:
        _missing(f"{URL_VARIABLE} is not set")
    try:
        import psycopg
    except ImportError:
        _missing('psycopg, the PostgreSQL driver, is not installed (pip install "fastopt[postgres]")')
    url = re.sub(r"^postgresql\+\w+://", "postgresql://", url)  # psycopg takes libpq's form
    base, _, query = url.partition("?")
    server, _, _db = base.rpartition("/")
    name = f"fastopt_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(url, autocommit=True) as conn:
        try:
            conn.execute(f'CREATE DATABASE "{name}"')
        except psycopg.errors.InsufficientPrivilege:
            yield url
            return
    try:
        yield f"{server}/{name}" + (f"?{query}" if query else "")
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_two_workers_share_one_study(postgres_url, tmp_path):
    study_name = f"two-workers-{uuid.uuid4().hex[:8]}"
    go = tmp_path / "go"
    workers = []
    for i in range(2):
        ready, out, log = (tmp_path / f"{what}{i}" for what in ("ready", "out", "log"))
        proc = subprocess.Popen([sys.executable, str(WORKER), postgres_url, study_name, str(TRIALS),
                                 str(ready), str(go), str(out)],
                                stdout=log.open("w"), stderr=subprocess.STDOUT)
        workers.append((proc, ready, out, log))
    deadline = time.monotonic() + 300
    while not all(ready.exists() for _, ready, _, _ in workers):
        failed = [log.read_text() for proc, _, _, log in workers if proc.poll() is not None]
        assert not failed and time.monotonic() < deadline, f"a worker did not start: {failed}"
        time.sleep(0.05)
    go.write_text("go")
    for proc, _, _, log in workers:
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    results = [json.loads(out.read_text()) for _, _, out, _ in workers]

    study = open_study(postgres_url, study_name, create=False)
    trials = study.trials
    states = [t.state for t in trials]
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    assert all(s in finished for s in states), states  # none left running, waiting or failed
    # the total asked for; two workers that finish at the same moment may each start one more
    assert TRIALS <= len(trials) <= TRIALS + 1
    assert sorted(t.number for t in trials) == list(range(len(trials)))
    # every trial ran in exactly one worker, once: each built one trainer per trial it ran
    ran_by = [t.user_attrs["worker"] for t in trials]
    names = [r["worker"] for r in results]
    assert set(ran_by) <= set(names) and len(set(names)) == 2
    assert [ran_by.count(name) for name in names] == [r["built"] for r in results]
    assert all(r["built"] >= 1 for r in results), results  # both workers took part
    baseline = [t for t in trials if t.user_attrs.get(ROLE) == "baseline"]
    assert len(baseline) == 1, [t.number for t in baseline]
    assert study.user_attrs["fastopt"]["model_name"] == "tgn"

