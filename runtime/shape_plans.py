"""Padded lengths remembered across processes, so that a run's first epoch captures few shapes.

A captured training step has one shape per padded length (:class:`~fastopt.runtime.inputs.HighWater`:
unique nodes and edges, merged rows per layer), and those lengths only grow, so the first epoch
of a run captures a new step every time one of them grows, while the later epochs replay one
shape per batch size. The lengths a run reached are saved under a key of what determines them
(the events, the sampler's fanouts, strategy and merging, the batch size) and the next run with
that key starts from them: it pads to its final lengths from its first batch and captures once
per batch size, as a steady epoch does. Padding changes no result, so a file from another run
with the same key (another seed, say) only costs its extra rows; an unreadable one is ignored.

Layering: imports nothing of fastopt.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Dict, Iterable, Optional

import numpy as np

__all__ = ["ShapePlan", "plan_key", "load_lengths", "save_lengths"]

_VERSION = 1
_SAMPLES = 4096  # events read into the key (evenly spread): a content digest that costs no pass over the data


def plan_key(src: np.ndarray, dst: np.ndarray, ts: np.ndarray, **settings) -> str:
    """A digest of the event stream (its size and an even sample of its events) and ``settings``
    (fanouts, strategy, merging, batch size, ...: anything that changes the padded lengths)."""
    h = hashlib.sha256()
    n = len(src)
    pick = np.linspace(0, n - 1, num=min(n, _SAMPLES), dtype=np.int64) if n else np.zeros(0, np.int64)
    h.update(json.dumps({"v": _VERSION, "events": n, **{k: _plain(v) for k, v in sorted(settings.items())}},
                        sort_keys=True).encode())
    for column in (src, dst, ts):
        h.update(np.ascontiguousarray(np.asarray(column)[pick]).tobytes())
    return h.hexdigest()[:24]


def _plain(value):
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    return value


def load_lengths(directory: Path, key: str) -> Dict[str, Dict[str, int]]:
    """The saved lengths of ``key`` (``{owner: {kind: length}}``), empty when none are readable."""
    try:
        data = json.loads((Path(directory) / f"{key}.json").read_text())
        return {owner: {str(k): int(v) for k, v in kinds.items()}
                for owner, kinds in data.get("lengths", {}).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def save_lengths(directory: Path, key: str, lengths: Dict[str, Dict[str, int]]) -> Optional[Path]:
    """Merge ``lengths`` into ``key``'s file (each length the larger of the two), written
    atomically; None when the folder cannot be written (the run goes on without it)."""
    directory = Path(directory)
    merged = load_lengths(directory, key)
    for owner, kinds in lengths.items():
        mine = merged.setdefault(owner, {})
        for kind, n in kinds.items():
            mine[kind] = max(mine.get(kind, 0), int(n))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key}.", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": _VERSION, "lengths": merged}, f, sort_keys=True)
        path = directory / f"{key}.json"
        os.replace(tmp, path)
        return path
    except OSError:
        return None


class ShapePlan:
    """The padded lengths of one run under ``key`` in ``directory``: ``high_waters`` (``{owner:
    HighWater}``) are seeded from the saved lengths at once, and :meth:`save` merges theirs back.

    Attributes:
        found: whether an earlier run's lengths were read (the steps pad to their final lengths
            from the first batch).
    """

    def __init__(self, directory: Path, key: str, high_waters: Dict[str, object]) -> None:
        self.directory, self.key, self.high_waters = Path(directory), key, high_waters
        saved = load_lengths(self.directory, key)
        self.found = any(saved.values())
        for owner, high_water in high_waters.items():
            high_water.seed(saved.get(owner, {}))

    def save(self) -> Optional[Path]:
        """Write the lengths reached so far (:func:`save_lengths`)."""
        return save_lengths(self.directory, self.key,
                            {owner: dict(hw.lengths) for owner, hw in self.high_waters.items()})
