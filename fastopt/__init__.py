"""fastopt: make temporal graph neural network training fast without changing what it learns.

The public surface:

- :func:`optimize` — trace a plain PyTorch TGNN and rewrite it onto fused kernels;
- :class:`Trainer` — chronological link-prediction training and evaluation;
- :class:`Config`, :func:`default_config`, :func:`patch` — every knob, typed;
- :func:`load_dataset`, :class:`TemporalGraph` — event streams;
- :func:`build_model` — the reference TGNNs (TGN, TGAT, JODIE, APAN);
- :class:`FastOptError` — the one error hierarchy.
"""

from fastopt.config import Config, default_config, patch
from fastopt.data import TemporalGraph, load_dataset
from fastopt.errors import FastOptError
from fastopt.models import build_model
from fastopt.optimize import optimize
from fastopt.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "Config",
    "FastOptError",
    "TemporalGraph",
    "Trainer",
    "build_model",
    "default_config",
    "load_dataset",
    "optimize",
    "patch",
    "__version__",
]
