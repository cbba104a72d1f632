"""Tuned configurations as data: :class:`TuningRecord` JSON files and their lookup.

A record says which knob values made training fastest for one device, model and dataset, and
how fast: the mean step of the best trial and of the baseline (default) config, both measured
in the same tuning run. It is keyed by

- the device: the GPU's name and compute capability, or ``"cpu"`` and the CPU model;
- the model's fingerprint: its class, its fanouts and its traced graphs' ops and shapes (its
  parameters' shapes in order where no part traces): the structure, not the variables' names;
- the dataset's signature: nodes, events, feature widths and degree percentiles;

and carries the torch, triton and fastopt versions it was measured with. ``config="auto"``
(:func:`apply_tuned`) takes the exact match, else the nearest record of the same device and
model family (closest dataset signature), else none: the defaults stay, and nothing raises.
:func:`fastopt.optimize`, which sees no dataset, takes a record of the same device and model.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

import fastopt
from fastopt.codegen.cache import atomic_file, package_version
from fastopt.codegen.cache import device_identity as kernel_device_identity
from fastopt.config import Config
from fastopt.errors import ConfigError, FastOptError
from fastopt.tuner.space import knob_fields

__all__ = ["RecordError", "RecordMatch", "TuningRecord", "apply_tuned", "dataset_signature",
           "device_identity", "find_record", "model_fingerprint", "read_records", "records_dirs",
           "SHIPPED_RECORDS"]

FORMAT = 1
# the records shipped inside the package: fastopt/tuned/ beside fastopt's __init__.py, in a
# checkout and in an installation alike (this file is not beside it in a checkout)
SHIPPED_RECORDS = Path(fastopt.__file__).resolve().parent / "tuned"
# dataset signature entries compared by the nearest-record distance (log ratios)
_SIZE_KEYS = ("nodes", "events", "edge_dim", "node_dim", "degree_p50", "degree_p90", "degree_p99",
              "degree_max")
# knobs a record never sets through config="auto": the batch size changes what the model learns
_NOT_APPLIED = ("train.batch_size",)


class RecordError(FastOptError, ValueError):
    """A tuning record file is missing, not JSON, or not a record of this format."""


def device_identity(device) -> Dict[str, str]:
    """``{"kind", "name", "capability"}`` of a torch device: the GPU's name and compute capability
    (``"9.0"``), or ``"cpu"`` and the CPU model (both looked up once a process)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        name, capability = kernel_device_identity(device)  # the kernel cache's, cached per GPU
        return {"kind": "cuda", "name": name, "capability": capability}
    return {"kind": "cpu", "name": _cpu_model(), "capability": "cpu"}


@functools.lru_cache(maxsize=None)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def model_fingerprint(model, structure: Optional[List[Any]] = None) -> Dict[str, Any]:
    """The model's structure: class name, fanouts, parameter count, and a key hashing them with
    ``structure`` (the traced graphs' ops and shapes, :func:`fastopt.passes.graph_structure`,
    handed over by the caller: the tuner does not import the passes) where given, else with the
    shapes of its parameters in order. Renaming an attribute leaves the key unchanged; changing a
    width changes it. ``traced`` says which of the two the key hashes."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    shapes = [list(p.shape) for p in model.parameters()]
    fanouts = [int(k) for k in getattr(model, "fanouts", []) or []]
    family = type(model).__name__
    content = {"family": family, "fanouts": fanouts}
    content.update({"shapes": shapes} if structure is None else {"structure": structure})
    text = json.dumps(content, sort_keys=True)
    return {"family": family, "fanouts": fanouts, "parameters": int(sum(math.prod(s) for s in shapes)),
            "traced": structure is not None, "key": hashlib.sha256(text.encode()).hexdigest()[:16]}


def dataset_signature(graph) -> Dict[str, Any]:
    """Nodes, events, feature widths and degree percentiles (50, 90, 99, max) of ``graph``."""
    deg = np.bincount(graph.src, minlength=graph.num_nodes) + np.bincount(graph.dst, minlength=graph.num_nodes)
    p50, p90, p99, top = (float(v) for v in np.percentile(deg, [50, 90, 99, 100]))
    return {"name": graph.name, "nodes": int(graph.num_nodes), "events": int(graph.num_events),
            "edge_dim": int(graph.edge_dim), "node_dim": int(graph.node_dim),
            "degree_p50": p50, "degree_p90": p90, "degree_p99": p99, "degree_max": top}


def library_versions() -> Dict[str, Optional[str]]:
    """torch, triton (None when not installed) and fastopt versions of this process."""
    import torch

    from fastopt import __version__

    triton = package_version("triton")  # the kernel cache's lookup, cached
    return {"torch": torch.__version__, "triton": None if triton == "not installed" else triton,
            "fastopt": __version__}


@dataclass
class TuningRecord:
    """The result of one tuning run, as saved in a JSON file.

    Attributes:
        device: :func:`device_identity` of the device tuned on.
        model: :func:`model_fingerprint` of the model tuned.
        dataset: :func:`dataset_signature` of the graph tuned on.
        values: the best trial's knob values, ``{"group.field": value}``.
        step_seconds: the best trial's mean training step.
        default_step_seconds: the baseline config's mean step in the same run (None when the
            baseline trial did not complete).
        epoch_seconds: the best trial's mean step times the training batches of an epoch (the
            value the study minimized: comparable across batch sizes).
        default_epoch_seconds: the same for the baseline config.
        versions: torch, triton and fastopt versions of the run.
        measurement: how steps were timed (``timing``: ``"wall"`` or ``"cuda_events"``,
            ``warmup`` and ``timed`` steps, ``max_device_memory`` in bytes or None).
        study: the study's name, trials finished, completed and pruned, the best trial's number.
        created: UTC time the record was written.
    """

    device: Dict[str, str]
    model: Dict[str, Any]
    dataset: Dict[str, Any]
    values: Dict[str, Any]
    step_seconds: float
    default_step_seconds: Optional[float] = None
    epoch_seconds: Optional[float] = None
    default_epoch_seconds: Optional[float] = None
    versions: Dict[str, Optional[str]] = field(default_factory=dict)
    measurement: Dict[str, Any] = field(default_factory=dict)
    study: Dict[str, Any] = field(default_factory=dict)
    created: str = ""
    format: int = FORMAT

    @property
    def speedup(self) -> Optional[float]:
        """Baseline step time over the best one (None without a baseline)."""
        if not self.default_step_seconds or not self.step_seconds:
            return None
        return self.default_step_seconds / self.step_seconds

    def file_name(self) -> str:
        """``<device>-<model family>-<dataset>-<model key>.json``, lower case, safe characters."""
        parts = (self.device.get("name", "device"), self.model.get("family", "model"),
                 str(self.dataset.get("name", "dataset")), self.model.get("key", "")[:8])
        return "-".join(_slug(p) for p in parts) + ".json"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    def save(self, where: Union[str, os.PathLike]) -> Path:
        """Write the record to ``where`` (a ``.json`` path, or a folder that gets
        :meth:`file_name`); written to a temporary file and renamed, so a reader never sees half
        a record. Returns the path."""
        path = Path(where)
        if path.suffix != ".json":
            path = path / self.file_name()
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as f:  # readable by the other users of a shared records folder
            f.write((self.to_json() + "\n").encode("utf-8"))
        return path

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "TuningRecord":
        """Read a record written by :meth:`save`.

        Raises:
            RecordError: the file is missing, unreadable, not JSON or not a record of this format.
        """
        where = f"tuning record {str(path)!r}"
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise RecordError(f"{where} does not exist; pass a file written by fastopt tune or "
                              f"fastopt export") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RecordError(f"{where} cannot be read as JSON ({exc}); write it again with "
                              f"fastopt export") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise RecordError(f"{where} is not a tuning record of format {FORMAT} (format {got!r}); "
                              f"export it again with this fastopt version")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(n for n in ("device", "model", "dataset", "values", "step_seconds") if n not in data)
        if missing:
            raise RecordError(f"{where} lacks {', '.join(missing)}; export it again with fastopt export")
        return cls(**{k: v for k, v in data.items() if k in names})


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", str(text).lower()).strip("_") or "x"


@dataclass
class RecordMatch:
    """The record ``config="auto"`` picked, how it matched, and what it changed.

    Attributes:
        record: the record.
        path: its file.
        how: ``"exact"`` (same device, model fingerprint and dataset signature), ``"nearest"``
            (same device and model family, the closest dataset signature) or ``"model"`` (same
            device and model fingerprint, no dataset to compare).
        distance: the dataset signatures' distance (0 for an exact match).
        applied: the values set on the config.
        kept: values of the record left out, each with the reason.
    """

    record: TuningRecord
    path: Path
    how: str
    distance: float = 0.0
    applied: Dict[str, Any] = field(default_factory=dict)
    kept: Dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for logs: the file, the match and the values applied."""
        values = ", ".join(f"{k}={v}" for k, v in self.applied.items()) or "no values"
        return f"tuned record {self.path.name} ({self.how} match; applied {values})"

    def summary(self) -> Dict[str, Any]:
        """What a run log keeps about the match."""
        return {"path": str(self.path), "how": self.how, "distance": self.distance,
                "applied": dict(self.applied), "kept": dict(self.kept)}


def records_dirs(config: Config) -> List[Path]:
    """Where records are looked up: ``config.tuner.records_dir`` when set, then the records shipped
    in the package."""
    dirs = [Path(config.tuner.records_dir).expanduser()] if config.tuner.records_dir else []
    return dirs + [SHIPPED_RECORDS]


def read_records(dirs: Sequence[Path]) -> List[Tuple[Path, TuningRecord]]:
    """Every readable record in ``dirs`` (what :func:`find_record` chooses from, and ``fastopt
    configs list`` shows), by folder then file name; a broken file is skipped with a warning
    naming it."""
    found = []
    for folder in dirs:
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.json")):
            try:
                found.append((path, TuningRecord.load(path)))
            except RecordError as exc:
                warnings.warn(f"{exc}; skipped", stacklevel=3)
    return found


def _same_device(a: Dict[str, str], b: Dict[str, str]) -> bool:
    return a.get("name") == b.get("name") and a.get("capability") == b.get("capability")


def signature_distance(a: Dict[str, Any], b: Dict[str, Any]) -> float:
    """Sum of ``|log((x + 1) / (y + 1))|`` over sizes, widths and degree percentiles."""
    return float(sum(abs(math.log((float(a.get(k, 0)) + 1.0) / (float(b.get(k, 0)) + 1.0)))
                     for k in _SIZE_KEYS))


# a value, or a function of no arguments giving it (computed only where it is needed)
Lazy = Union[Dict[str, Any], Callable[[], Dict[str, Any]]]


def _value(lazy: Optional[Lazy]) -> Optional[Dict[str, Any]]:
    return lazy() if callable(lazy) else lazy


def find_record(device: Dict[str, str], model: Lazy, dataset: Optional[Lazy],
                dirs: Sequence[Union[str, os.PathLike]]) -> Optional[RecordMatch]:
    """The record for ``device``, ``model`` and ``dataset`` (from :func:`device_identity`,
    :func:`model_fingerprint`, :func:`dataset_signature`) in ``dirs``, or None. ``model`` and
    ``dataset`` may be functions giving them, called only where a record of the device exists
    (the model's fingerprint traces it).

    Exact: same device, model key and dataset signature (sizes, widths, degree percentiles; the
    name aside). Else nearest: same device and model family, the smallest
    :func:`signature_distance`. Without a dataset (:func:`fastopt.optimize` sees a model, not its
    graph): same device and model key, whatever the graph (``how="model"``); a record of another
    width would carry kernel settings chosen for other shapes, so the family alone does not match.
    Among several equally good records, the one of this fastopt version, then the newest.
    """
    from fastopt import __version__

    def best(found: List[Tuple[Path, TuningRecord]], how: str) -> RecordMatch:
        path, record = max(found, key=lambda pr: (pr[1].versions.get("fastopt") == __version__, pr[1].created))
        return RecordMatch(record, path, how)

    candidates = [(p, r) for p, r in read_records([Path(d) for d in dirs]) if _same_device(r.device, device)]
    if not candidates:
        return None
    model, dataset = _value(model), _value(dataset)
    same_model = [(p, r) for p, r in candidates if r.model.get("key") == model.get("key")]
    if dataset is None:
        return best(same_model, "model") if same_model else None
    exact = [(p, r) for p, r in same_model if signature_distance(r.dataset, dataset) == 0.0]
    if exact:
        return best(exact, "exact")
    family = [(signature_distance(r.dataset, dataset), p, r) for p, r in candidates
              if r.model.get("family") == model.get("family")]
    if not family:
        return None
    distance, path, record = min(family, key=lambda dpr: (dpr[0], str(dpr[1])))
    return RecordMatch(record, path, "nearest", distance)


def apply_tuned(config: Config, fingerprint: Lazy, graph, device,
                dirs: Optional[Sequence[Union[str, os.PathLike]]] = None, *,
                groups: Optional[Sequence[str]] = None) -> Tuple[Config, Optional[RecordMatch]]:
    """``config`` with the values of the record matching this run (:func:`find_record`), and the
    match; ``(config, None)`` when no record matches. Never raises for a record: an unusable one
    is skipped with a warning.

    A record sets only knobs the tuner searches, never the batch size (it changes what the model
    learns), and only knobs still at their built-in default: a value set through ``FASTOPT_*``
    or by the caller wins.

    Args:
        fingerprint: the model's key, :func:`fastopt.trainer.tuning_fingerprint` (from its traced
            graphs), the one :func:`fastopt.tuner.tune` files records under; or a function giving
            it (``lambda: tuning_fingerprint(model)``), called only where a record of the device
            exists, so that a run without records never traces the model for it.
        graph: the event stream, or None where the caller has none (:func:`fastopt.optimize`):
            then only a record of the same model fingerprint matches.
        groups: config groups the caller uses (``("kernels", "passes")`` for
            :func:`fastopt.optimize`); the record's other values are kept out, with the reason.
            None: every group.
    """
    try:
        match = find_record(device_identity(device), fingerprint,
                            None if graph is None else functools.partial(dataset_signature, graph),
                            dirs if dirs is not None else records_dirs(config))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        warnings.warn(f"tuning records could not be searched ({exc}); the defaults apply", stacklevel=2)
        return config, None
    if match is None:
        return config, None
    out, given, default = config.copy(), config.to_dict(), Config().to_dict()
    tunable = set(knob_fields())
    for name, value in match.record.values.items():
        group, _, knob = name.partition(".")
        if name not in tunable or name in _NOT_APPLIED:
            match.kept[name] = "not a knob config='auto' sets"
        elif groups is not None and group not in groups:
            match.kept[name] = f"not used here (only {', '.join(groups)} knobs are)"
        elif given.get(group, {}).get(knob) != default.get(group, {}).get(knob):
            match.kept[name] = "set explicitly"
        else:
            try:
                out.set(name, value)
                match.applied[name] = value
            except ConfigError as exc:
                match.kept[name] = str(exc)
    return out, match


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
