"""``verify=True``: run eager and optimized side by side on the first calls and compare.

The check runs each rewritten module's original ``forward`` and its rewritten graph on the same
inputs, from the same random state and with fused dropout turned off (so dropout draws, where
active, come from the same generator in the same order), without gradients; the call then
proceeds normally. A disagreement raises :class:`TraceError` with the largest difference; an
agreement returns it, for the report (:class:`~fastopt.passes.report.Verification`).
"""

from __future__ import annotations

from typing import Any, List, Tuple

import torch
from torch import Tensor

from fastopt.config import patch
from fastopt.errors import TraceError

__all__ = ["compare", "verified_call", "tolerance"]


def tolerance(dtype: torch.dtype) -> Tuple[float, float]:
    """``(rtol, atol)`` for outputs of ``dtype``: fp32 keeps relative error below 1e-4."""
    if dtype in (torch.float16, torch.bfloat16):
        return 1e-2, 1e-3
    if dtype == torch.float64:
        return 1e-7, 1e-9
    return 1e-4, 1e-5


def _leaves(x: Any, path: str = "output") -> List[Tuple[str, Any]]:
    if isinstance(x, (list, tuple)):
        return [leaf for i, item in enumerate(x) for leaf in _leaves(item, f"{path}[{i}]")]
    if isinstance(x, dict):
        return [leaf for k, item in x.items() for leaf in _leaves(item, f"{path}[{k!r}]")]
    return [(path, x)]


def compare(eager: Any, optimized: Any, where: str) -> float:
    """Raise :class:`TraceError` unless ``optimized`` matches ``eager`` within :func:`tolerance`;
    return the largest absolute difference of the floating-point outputs."""
    largest = 0.0
    for (path, a), (_, b) in zip(_leaves(eager), _leaves(optimized)):
        if not isinstance(a, Tensor):
            if a != b and not (a is None and b is None):
                raise TraceError(f"{where}: {path} is {b!r} optimized but {a!r} eager")
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            raise TraceError(
                f"{where}: {path} has shape {tuple(b.shape)}/{b.dtype} optimized but "
                f"{tuple(a.shape)}/{a.dtype} eager; report this model to the fastopt developers"
            )
        if not a.is_floating_point() or a.numel() == 0:
            if not torch.equal(a, b):
                raise TraceError(f"{where}: {path} differs from eager")
            continue
        rtol, atol = tolerance(a.dtype)
        a64, b64 = a.double(), b.double()
        both_nan = a64.isnan() & b64.isnan()
        diff = (a64 - b64).abs().masked_fill(both_nan, 0.0).nan_to_num(nan=float("inf"))
        excess = diff - (atol + rtol * a64.abs().nan_to_num(nan=0.0))
        largest = max(largest, float(diff.max()))
        worst = int(excess.argmax())
        if float(excess.view(-1)[worst]) > 0:
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape))
            raise TraceError(
                f"{where}: {path} differs from eager: largest difference "
                f"{float(diff.view(-1)[worst]):.3g} at {index} (eager "
                f"{float(a64.view(-1)[worst]):.6g}, optimized {float(b64.view(-1)[worst]):.6g}; "
                f"allowed {atol:g} + {rtol:g} * |eager|). Use the model without fastopt.optimize "
                f"and report the model to the fastopt developers"
            )
    return largest


def _devices() -> List[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_available() else []


def verified_call(module, original_forward, optimized_forward, args, kwargs, where: str) -> float:
    """Compare ``original_forward`` and ``optimized_forward`` on one call (no gradients); the
    largest absolute difference of their outputs."""
    with torch.no_grad():
        with torch.random.fork_rng(devices=_devices()):
            eager = original_forward(*args, **kwargs)
        with torch.random.fork_rng(devices=_devices()), patch(passes__fuse_dropout=False):
            fused = optimized_forward(*args, **kwargs)
    return compare(eager, fused, where)
