"""Checkpoint files of a training run: writing one so that a killed process leaves the previous
whole, reading one without running code it may carry, and loading weights only into the model
and dataset they were trained for.

The :class:`~fastopt.trainer.Trainer` decides what a checkpoint holds (weights, optimizer, RNG
states, history, configuration) and when it is written; this module owns the file.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Union

import torch
from torch import nn

from fastopt.codegen.cache import atomic_file
from fastopt.errors import FastOptError

__all__ = ["BEST_FILE", "load_model_state", "plain", "read_checkpoint", "write_checkpoint"]

_CHECKPOINT_KEYS = ("epoch", "model", "optimizer", "torch_rng", "history")

# The best validation epoch's weights, beside checkpoint.pt (config.train.restore_best).
BEST_FILE = "best.pt"


def load_model_state(model: nn.Module, state: dict, where: str) -> None:
    """``model.load_state_dict(state)``, refusing weights of another model or dataset.

    Raises:
        FastOptError: naming the keys missing or unexpected and the first shapes that differ.
    """
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
              if k in state and hasattr(state[k], "shape") and state[k].shape != v.shape]
    if missing or unexpected or shapes:
        found = "; ".join(part for part in (
            f"missing {_some(missing)}" if missing else "",
            f"unexpected {_some(unexpected)}" if unexpected else "",
            f"shapes (saved vs this model) {_some(shapes)}" if shapes else "") if part)
        raise FastOptError(
            f"{where} holds the weights of another model, dataset or hyperparameters ({found}); "
            f"resume with the --model, --dataset, feature widths and model hyperparameters of the "
            f"run that wrote it, or start a new run without --resume")
    model.load_state_dict(state)


def _some(items: list, shown: int = 3) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def read_checkpoint(path: Union[str, os.PathLike], map_location=None) -> dict:
    """The state dict of a checkpoint file, read without running any code it may carry.

    ``torch.load(weights_only=True)`` rebuilds only tensors, numbers, strings, lists, tuples and
    dicts; a file that asks for anything else (a class, a ``__reduce__`` call) is refused.

    Raises:
        FastOptError: naming the file and why it cannot be loaded.
    """
    where = str(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise FastOptError(
            f"checkpoint {where!r} holds objects other than tensors, numbers, strings, lists and "
            f"dicts ({reason}); it was not loaded, because loading it could run code from the "
            f"file. Resume only from a checkpoint.pt written by fastopt (--checkpoint-dir); a "
            f"file you trust can be re-saved with plain types") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise FastOptError(
            f"checkpoint {where!r} cannot be read ({type(exc).__name__}: {exc}); it is truncated "
            f"or not a checkpoint. Resume from an intact checkpoint.pt or train from the start") from None
    missing = [k for k in _CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise FastOptError(f"checkpoint {where!r} lacks {missing}; it was not written by "
                           f"Trainer.save_checkpoint. Resume from a checkpoint.pt written by fastopt")
    return state


def plain(value):
    """``value`` rebuilt from Python's plain types (NumPy scalars become floats and ints), so
    that a checkpoint holding it loads with ``weights_only=True``."""
    return json.loads(json.dumps(value, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def write_checkpoint(path: Union[str, os.PathLike], state: dict) -> None:
    """``torch.save(state)`` to ``path`` (folders created): written to a temporary file in the same
    folder, flushed to disk, then renamed over ``path``, so that a process killed while writing
    leaves the previous file whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as f:
        torch.save(state, f)
