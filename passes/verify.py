"""``verify=True``: run eager and optimized side by side on the first calls and compare.

The check runs each rewritten module's original ``forward`` and its rewritten graph on the same
inputs, from the same random state and module state (buffers are restored before each run and
after both), with fused dropout turned off, so that dropout, where active, draws the same masks
from the same generator in the same order. Where the call records gradients, each run is also
differentiated: a fixed random weighting of its floating-point outputs is summed and the
gradients of the module's parameters and of the inputs that require them are compared too (the
inputs are detached first, so nothing flows into the caller's graph). The call then proceeds
normally. A disagreement raises :class:`TraceError` with the largest difference; an agreement
returns it, for the report (:class:`~fastopt.passes.report.Verification`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

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


def compare(eager: Any, optimized: Any, where: str, scaled: bool = False,
            name: str = "output") -> float:
    """Raise :class:`TraceError` unless ``optimized`` matches ``eager`` within :func:`tolerance`;
    return the largest absolute difference of the floating-point outputs.

    With ``scaled``, the absolute part of the tolerance is relative to the tensor's largest
    element: for gradients, sums over many terms whose order the rewrite may change.
    """
    largest = 0.0
    for (path, a), (_, b) in zip(_leaves(eager, name), _leaves(optimized, name)):
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
        if scaled:
            atol *= max(1.0, float(a64.abs().nan_to_num(nan=0.0).max()))
        both_nan = a64.isnan() & b64.isnan()
        diff = (a64 - b64).abs().masked_fill(both_nan, 0.0).nan_to_num(nan=float("inf"))
        excess = diff - (atol + rtol * a64.abs().nan_to_num(nan=0.0))
        largest = max(largest, float(diff.max()))
        worst = int(excess.argmax())  # in row-major order, whatever the strides (gradients)
        at = lambda t: float(t.reshape(-1)[worst])  # noqa: E731
        if at(excess) > 0:
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape))
            raise TraceError(
                f"{where}: {path} differs from eager: largest difference {at(diff):.3g} at "
                f"{index} (eager {at(a64):.6g}, optimized {at(b64):.6g}; "
                f"allowed {atol:g} + {rtol:g} * |eager|). Use the model without fastopt.optimize "
                f"and report the model to the fastopt developers"
            )
    return largest


def _devices() -> List[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_available() else []


def _map_tensors(x: Any, fn: Callable[[str, Tensor], Tensor], path: str) -> Any:
    """``x`` with each tensor ``t`` in it (at ``path``) replaced by ``fn(path, t)``; lists,
    tuples (named ones too) and dicts are rebuilt, anything else is kept as it is."""
    if isinstance(x, Tensor):
        return fn(path, x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple
        return type(x)(*(_map_tensors(getattr(x, f), fn, f"{path}.{f}") for f in x._fields))
    if isinstance(x, (list, tuple)):
        return type(x)(_map_tensors(item, fn, f"{path}[{i}]") for i, item in enumerate(x))
    if isinstance(x, dict):
        return {k: _map_tensors(item, fn, f"{path}[{k!r}]") for k, item in x.items()}
    return x


def _detached(x: Any, path: str, inputs: Dict[str, Tensor]) -> Any:
    """``x`` with every tensor that requires a gradient replaced by a detached leaf copy (listed
    in ``inputs`` under its path), so that differentiating the check stays inside the module."""
    def leaf(where: str, t: Tensor) -> Tensor:
        if not t.requires_grad:
            return t
        inputs[f"gradient of {where}"] = copy = t.detach().requires_grad_()
        return copy

    return _map_tensors(x, leaf, path)


def _weights(t: Tensor, i: int) -> Tensor:
    """The fixed random weights of output ``i`` in the summed loss (the same for both runs)."""
    g = torch.Generator().manual_seed(i)
    return torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device, t.dtype)


def _run(module, forward, args, kwargs, state: Dict[str, Tensor], gradients: bool):
    """One run from ``state``: ``(outputs, gradients or None)``; the state is restored after."""
    with torch.no_grad():
        for name, b in module.named_buffers():
            b.copy_(state[name])
    inputs: Dict[str, Tensor] = {}
    if gradients:
        args, kwargs = _detached(args, "args", inputs), _detached(kwargs, "kwargs", inputs)
    with torch.random.fork_rng(devices=_devices()), torch.set_grad_enabled(gradients):
        out = forward(*args, **kwargs)
    grads = None
    wrt = {**{f"gradient of {name}": p for name, p in module.named_parameters()
              if p.requires_grad}, **inputs}
    outs = [t for _, t in _leaves(out)
            if isinstance(t, Tensor) and t.is_floating_point() and t.requires_grad]
    if gradients and wrt and outs:
        loss = sum((t * _weights(t, i)).sum() for i, t in enumerate(outs))
        found = torch.autograd.grad(loss, list(wrt.values()), allow_unused=True)
        # an input the output does not depend on has a zero gradient, whichever way it is computed
        grads = {name: torch.zeros_like(t) if g is None else g
                 for (name, t), g in zip(wrt.items(), found)}
    with torch.no_grad():
        for name, b in module.named_buffers():
            b.copy_(state[name])
    return _map_tensors(out, lambda _, t: t.detach(), "output"), grads


def verified_call(module, original_forward, optimized_forward, args, kwargs,
                  where: str) -> Tuple[float, bool]:
    """Compare ``original_forward`` and ``optimized_forward`` on one call: outputs, and where
    gradients are being recorded, parameter and input gradients. Returns the largest absolute
    difference and whether gradients were compared."""
    state = {name: b.detach().clone() for name, b in module.named_buffers()}
    gradients = torch.is_grad_enabled()
    eager, eager_grads = _run(module, original_forward, args, kwargs, state, gradients)
    with patch(passes__fuse_dropout=False):
        fused, fused_grads = _run(module, optimized_forward, args, kwargs, state, gradients)
    largest = compare(eager, fused, where)
    if eager_grads is None or fused_grads is None:
        return largest, False
    for name, grad in eager_grads.items():
        largest = max(largest, compare(grad, fused_grads[name], where, scaled=True, name=name))
    return largest, True
