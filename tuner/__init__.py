"""Auto-tuning of fastopt's knobs per device, model and dataset, with Optuna.

The tuner's parts live apart (``ls`` shows the architecture):

- :mod:`~fastopt.tuner.space` — the knobs worth searching for a model, a graph and a device;
- :mod:`~fastopt.tuner.objective` — a timed window of the real training loop per trial;
- :mod:`~fastopt.tuner.storage` — Optuna storage (SQLite by default) so that a study resumes;
- :mod:`~fastopt.tuner.records` — :class:`TuningRecord` JSON files and their lookup for
  ``config="auto"``;
- :mod:`~fastopt.tuner.study` — one tuning run: the study, its baseline trial, progress, export.
"""

from fastopt._lazy import lazy_attributes

# The space and the records load at once (``config="auto"`` reads records in every Trainer);
# what needs Optuna loads when first asked for.
from fastopt.tuner.records import (RecordMatch, TuningRecord, apply_tuned, dataset_signature,
                                   device_identity, find_record, model_fingerprint, records_dirs)
from fastopt.tuner.space import Knob, SearchSpace, build_space

_LAZY = {"Measurement": "fastopt.tuner.objective", "StepObjective": "fastopt.tuner.objective",
         "Window": "fastopt.tuner.objective", "measure_window": "fastopt.tuner.objective",
         "open_study": "fastopt.tuner.storage", "storage_url": "fastopt.tuner.storage",
         "TuningRun": "fastopt.tuner.study", "export_record": "fastopt.tuner.study",
         "tune": "fastopt.tuner.study"}


__getattr__, __dir__ = lazy_attributes("fastopt.tuner", _LAZY, globals())


__all__ = [
    "Knob",
    "Measurement",
    "RecordMatch",
    "SearchSpace",
    "StepObjective",
    "TuningRecord",
    "TuningRun",
    "Window",
    "apply_tuned",
    "build_space",
    "dataset_signature",
    "device_identity",
    "export_record",
    "find_record",
    "measure_window",
    "model_fingerprint",
    "open_study",
    "records_dirs",
    "storage_url",
    "tune",
]
