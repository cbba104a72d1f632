"""The one error hierarchy of fastopt.

Every message names the offending value, the limit it broke and a fix, e.g.::

    FastOptError: batch_size must be >= 1 (got 0). Pass --batch-size 200 or any positive integer.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping, Optional

__all__ = [
    "FastOptError",
    "DataError",
    "ConfigError",
    "check_setting",
    "SamplerError",
    "CacheError",
    "KernelError",
    "TraceError",
    "ModelError",
    "DeviceMemoryError",
    "device_memory_guard",
]


class FastOptError(Exception):
    """Base class of every error fastopt raises for a user mistake or an unsupported input."""


class DataError(FastOptError, ValueError):
    """A dataset, file or tensor of events is malformed (format, ids, timestamps, shapes)."""


class ConfigError(FastOptError, ValueError):
    """A configuration value is out of range or of the wrong type."""


def check_setting(ok: bool, name: str, value, limit: str) -> None:
    """Raise :class:`ConfigError` naming setting ``name``, its ``value`` and the ``limit`` it breaks."""
    if not ok:
        raise ConfigError(f"{name} must be {limit} (got {value!r}); set a value in that range")


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


class DeviceMemoryError(FastOptError, MemoryError):
    """The device ran out of memory; the message names the knobs that lower what a run needs."""


# What lowers the device memory of a run, in the order worth trying: (knob, advice, how the
# present value is shown).
MEMORY_KNOBS = (
    ("train.batch_size", "a smaller train.batch_size{now} (--batch-size)", " than {!r}"),
    ("cache.budget_fraction", "a smaller cache.budget_fraction{now} (the device cache's share of the "
                              "tables)", " than {!r}"),
    ("cache.placement", "cache.placement='host'{now} (static features stay on the host)", " instead of {!r}"),
)


@contextlib.contextmanager
def device_memory_guard(where: str, current: Optional[Mapping[str, object]] = None) -> Iterator[None]:
    """Turn a device out-of-memory error raised inside the block into a :class:`DeviceMemoryError`
    that names the knobs lowering memory, instead of the raw CUDA message. Also a decorator.

    Args:
        where: what ran out of memory, e.g. ``"the training step"``.
        current: the knobs' present values by name (``{"train.batch_size": 200}``), shown beside them.
    """
    import torch  # the ground floor stays importable without torch

    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else "no details"
        current = current or {}
        knobs = ", ".join(advice.format(now=shown.format(current[name]) if name in current else "")
                          for name, advice, shown in MEMORY_KNOBS)
        raise DeviceMemoryError(
            f"the device ran out of memory in {where} ({detail}). Lower what the run keeps on the "
            f"device: {knobs}; every knob has a FASTOPT_<GROUP>_<FIELD> environment "
            f"override") from None
