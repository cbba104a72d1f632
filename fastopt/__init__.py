"""fastopt: make temporal graph neural network training fast without changing what it learns.

The public surface:

- :func:`optimize` — trace a plain PyTorch TGNN and rewrite it onto fused kernels;
- :class:`Trainer` — chronological link-prediction training and evaluation;
- :class:`Config`, :func:`default_config`, :func:`patch` — every knob, typed;
- :func:`load_dataset`, :class:`TemporalGraph` — event streams;
- :func:`build_model` — the reference TGNNs (TGN, TGAT, JODIE, APAN);
- :func:`verify_against_eager` — an optimized model's outputs and gradients against eager's;
- :class:`FastOptError` — the one error hierarchy.
"""

from fastopt._lazy import lazy_attributes

# The ground floor and the front door load at once; the rest when first asked for, so that
# ``import fastopt.runtime`` or ``fastopt.codegen`` loads no passes, models or trainer. ``optimize``
# is bound here: the submodule of the same name, once imported, would shadow a lazy attribute.
from fastopt.config import Config, default_config, patch
from fastopt.errors import FastOptError
from fastopt.optimize import optimize

_LAZY = {"TemporalGraph": "fastopt.data", "load_dataset": "fastopt.data",
         "build_model": "fastopt.models", "Trainer": "fastopt.trainer",
         "verify_against_eager": "fastopt.benchmark"}


__getattr__, __dir__ = lazy_attributes("fastopt", _LAZY, globals())


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
    "verify_against_eager",
    "__version__",
]
