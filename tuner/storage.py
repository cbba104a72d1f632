"""Where studies live: Optuna's RDB storage, a SQLite file by default.

A study in a file survives the process: a tuning run that was killed resumes where it stopped
(:func:`open_study` loads a study of the same name), and optuna-dashboard can open the file. Any
RDB URL Optuna accepts works too (``postgresql://user@host/db``), so that several workers, one per
GPU or machine, can tune one study together. Trials of a killed worker are failed by Optuna's
heartbeat once it has been silent for a grace period, so that they are not left running forever.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import optuna

from fastopt.errors import FastOptError

__all__ = ["DEFAULT_FILE", "StudyError", "open_study", "storage_url"]

# the SQLite file of a run given no storage
DEFAULT_FILE = "fastopt-tune.db"
# seconds between a running trial's heartbeats, and the silence after which it counts as dead
HEARTBEAT_SECONDS = 30
GRACE_SECONDS = 120


class StudyError(FastOptError, ValueError):
    """A study that cannot be opened, does not exist, or belongs to another tuning problem."""


def storage_url(spec: str = "") -> str:
    """The RDB URL for ``spec``: ``""`` is :data:`DEFAULT_FILE` in the working directory, a path
    (no ``://``) is a SQLite file, anything else is taken as a URL."""
    if not spec:
        spec = DEFAULT_FILE
    if "://" in spec:
        return spec
    return f"sqlite:///{Path(spec).expanduser().resolve()}"


def open_study(storage: str, study_name: str, *, seed: int = 0, create: bool = True,
               pruner: Optional[optuna.pruners.BasePruner] = None) -> optuna.Study:
    """Open study ``study_name`` in ``storage`` (see :func:`storage_url`), minimizing, with a TPE
    sampler seeded by ``seed``; with ``create`` it is made when missing.

    Raises:
        StudyError: the storage cannot be opened, or (without ``create``) holds no such study;
            the message names the URL and the studies it holds.
    """
    url = storage_url(storage)
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            rdb = optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT_SECONDS,
                                             grace_period=GRACE_SECONDS)
    except Exception as exc:  # noqa: BLE001  (SQLAlchemy and driver errors have no common base)
        raise StudyError(f"storage {url!r} cannot be opened ({type(exc).__name__}: {exc}); pass a "
                         f"SQLite file (tune.db, sqlite:///tune.db) or an RDB URL such as "
                         f"postgresql://user@host/db") from None
    sampler = optuna.samplers.TPESampler(seed=seed)
    if create:
        return optuna.create_study(storage=rdb, study_name=study_name, sampler=sampler, pruner=pruner,
                                   direction="minimize", load_if_exists=True)
    try:
        return optuna.load_study(study_name=study_name, storage=rdb, sampler=sampler, pruner=pruner)
    except KeyError:
        names = optuna.get_all_study_names(rdb)
        raise StudyError(f"storage {url!r} holds no study {study_name!r} (it holds "
                         f"{', '.join(map(repr, names)) or 'none'}); pass one of those to "
                         f"--study-name") from None
