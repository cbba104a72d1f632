"""The one error hierarchy of fastopt.

Every message names the offending value, the limit it broke and a fix, e.g.::

    FastOptError: batch_size must be >= 1 (got 0). Pass --batch-size 200 or any positive integer.
"""

from __future__ import annotations

__all__ = [
    "FastOptError",
    "DataError",
    "ConfigError",
    "SamplerError",
    "CacheError",
    "KernelError",
    "TraceError",
    "ModelError",
]


class FastOptError(Exception):
    """Base class of every error fastopt raises for a user mistake or an unsupported input."""


class DataError(FastOptError, ValueError):
    """A dataset, file or tensor of events is malformed (format, ids, timestamps, shapes)."""


class ConfigError(FastOptError, ValueError):
    """A configuration value is out of range or of the wrong type."""


class SamplerError(FastOptError, ValueError):
    """Bad input to a temporal neighbor sampler (roots, times, fanouts, threads)."""


class CacheError(FastOptError, ValueError):
    """Bad input to SlimCache (budget, policy, table shapes or dtypes)."""


class KernelError(FastOptError, ValueError):
    """Bad input to a fused operator, or a kernel configuration the device cannot run."""


class TraceError(FastOptError, RuntimeError):
    """A model could not be traced or a rewrite pass failed."""


class ModelError(FastOptError, ValueError):
    """Unknown model name or inconsistent model hyperparameters."""
