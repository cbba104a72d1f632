"""Where studies live: Optuna's RDB storage, a SQLite file by default.

A study in a file survives the process: a tuning run that was killed resumes where it stopped
(:func:`open_study` loads a study of the same name), and optuna-dashboard can open the file. Any
RDB URL Optuna accepts works too (``postgresql://user@host/db``), so that several workers, one per
GPU or machine, can tune one study together. Trials of a killed worker are failed by Optuna's
heartbeat once it has been silent for a grace period, so that they are not left running forever.

Workers that start together race twice, and both races are settled here: on a fresh database
each creates Optuna's tables, and all but one fail on the tables the first made (opening is
retried, :data:`OPEN_ATTEMPTS` times); and each would create the study, so only the one whose
creation succeeded runs ``on_create`` (:func:`tune` enqueues its baseline trial there, once). A
``postgresql://`` URL that names no driver uses psycopg where it is installed (the ``postgres``
extra), whatever SQLAlchemy's default driver is.
"""

from __future__ import annotations

import importlib.util
import random
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import optuna

from fastopt.errors import FastOptError

__all__ = ["DEFAULT_FILE", "StudyError", "open_study", "storage_url"]

# the SQLite file of a run given no storage
DEFAULT_FILE = "fastopt-tune.db"
# seconds between a running trial's heartbeats, and the silence after which it counts as dead
HEARTBEAT_SECONDS = 30
GRACE_SECONDS = 120
# tries at opening an RDB storage whose tables another worker may be creating at the same time
OPEN_ATTEMPTS = 5


class StudyError(FastOptError, ValueError):
    """A study that cannot be opened, does not exist, or belongs to another tuning problem."""


def storage_url(spec: str = "") -> str:
    """The RDB URL for ``spec``: ``""`` is :data:`DEFAULT_FILE` in the working directory, a path
    (no ``://``) is a SQLite file, anything else is taken as a URL (``postgresql://`` through
    psycopg where it is installed)."""
    if not spec:
        spec = DEFAULT_FILE
    if "://" in spec:
        if spec.startswith("postgresql://") and importlib.util.find_spec("psycopg") is not None:
            return "postgresql+psycopg://" + spec[len("postgresql://"):]
        return spec
    return f"sqlite:///{Path(spec).expanduser().resolve()}"


def open_study(storage: str, study_name: str, *, seed: int = 0, create: bool = True,
               pruner: Optional[optuna.pruners.BasePruner] = None,
               on_create: Optional[Callable[[optuna.Study], None]] = None) -> optuna.Study:
    """Open study ``study_name`` in ``storage`` (see :func:`storage_url`), minimizing, with a TPE
    sampler seeded by ``seed``; with ``create`` it is made when missing, and ``on_create`` is
    called with it by the one caller, among workers opening it together, that made it.

    Raises:
        StudyError: the storage cannot be opened, or (without ``create``) holds no such study;
            the message names the URL and the studies it holds.
    """
    url = storage_url(storage)
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    rdb = _rdb_storage(url)
    sampler = optuna.samplers.TPESampler(seed=seed)
    if create:
        try:
            study = optuna.create_study(storage=rdb, study_name=study_name, sampler=sampler,
                                        pruner=pruner, direction="minimize")
        except optuna.exceptions.DuplicatedStudyError:
            return optuna.load_study(study_name=study_name, storage=rdb, sampler=sampler, pruner=pruner)
        if on_create is not None:
            on_create(study)
        return study
    try:
        return optuna.load_study(study_name=study_name, storage=rdb, sampler=sampler, pruner=pruner)
    except KeyError:
        names = optuna.get_all_study_names(rdb)
        raise StudyError(f"storage {url!r} holds no study {study_name!r} (it holds "
                         f"{', '.join(map(repr, names)) or 'none'}); pass one of those to "
                         f"--study-name") from None


def _rdb_storage(url: str) -> optuna.storages.RDBStorage:
    """Optuna's storage at ``url``; opening is tried again while another worker may be creating
    the tables (their names taken: an integrity or programming error of the database)."""
    from sqlalchemy.exc import IntegrityError, ProgrammingError

    attempt = 1
    while True:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT_SECONDS,
                                                  grace_period=GRACE_SECONDS)
        except (IntegrityError, ProgrammingError) as exc:
            if attempt == OPEN_ATTEMPTS:
                raise _unopenable(url, exc) from None
            time.sleep(0.2 + random.random() * 0.3 * attempt)
            attempt += 1
        except Exception as exc:  # noqa: BLE001  (SQLAlchemy and driver errors have no common base)
            raise _unopenable(url, exc) from None


def _unopenable(url: str, exc: BaseException) -> StudyError:
    return StudyError(f"storage {url!r} cannot be opened ({type(exc).__name__}: {exc}); pass a "
                      f"SQLite file (tune.db, sqlite:///tune.db) or an RDB URL such as "
                      f"postgresql://user@host/db (pip install \"fastopt[postgres]\" for its driver)")
