"""Harmonic time encoding ``cos(dt[..., None] * w + b)`` (TGAT's functional encoding).

The smallest family, laid out as every other: the argument check, the plain-PyTorch reference
(the CPU path and the tests' oracle), the launchers of ``time_encode.py.jinja``, the operator
``fastopt::time_encode`` registered by :func:`~fastopt.codegen.library.fused_op`, and the public
function.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from fastopt.codegen import checks, kernels
from fastopt.codegen.kernel_config import TIME_ENCODE_SLOTS
from fastopt.codegen.layout import acc_dtype
from fastopt.codegen.library import fused_op
from fastopt.errors import KernelError

__all__ = ["time_encode", "reference", "reference_backward"]


def check(dt: Tensor, w: Tensor, b: Tensor) -> None:
    """Validate the arguments of :func:`time_encode`."""
    for name, t in (("dt", dt), ("w", w), ("b", b)):
        checks.is_tensor(name, t)
        checks.floating(name, t)
    checks.has_ndim("w", w, 1, "[T]")
    checks.has_shape("b", b, tuple(w.shape), "[T], like w")
    if b.dtype != w.dtype:
        raise KernelError(f"b has dtype {b.dtype} but w has {w.dtype}; cast both to one dtype")
    checks.same_device(dt, w=w, b=b)


def reference(dt: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Harmonic time encoding ``cos(dt[..., None] * w + b)``.

    Args:
        dt: Time differences of any shape ``[...]``.
        w: Frequencies ``[T]``.
        b: Phases ``[T]``.

    Returns:
        ``[..., T]`` in the dtype of ``w``.
    """
    cdt = acc_dtype(w.dtype)
    enc = torch.cos(dt.to(cdt)[..., None] * w.to(cdt) + b.to(cdt))
    return enc.to(w.dtype)


def reference_backward(grad_out: Tensor, dt: Tensor, w: Tensor,
                       b: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(ddt, dw, db)`` of :func:`reference`."""
    cdt = acc_dtype(w.dtype)
    dtc = dt.to(cdt)
    dphase = -torch.sin(dtc[..., None] * w.to(cdt) + b.to(cdt)) * grad_out.to(cdt)
    ddt = (dphase * w.to(cdt)).sum(-1)
    flat = dphase.reshape(-1, w.shape[0])
    dw = (flat * dtc.reshape(-1, 1)).sum(0)
    return ddt.to(dt.dtype), dw.to(w.dtype), flat.sum(0).to(b.dtype)


def _kernel(stage: str, dt: Tensor, w: Tensor) -> kernels.Specialized:
    width = w.shape[0]
    return kernels.specialize("time_encode", dt.device, (TIME_ENCODE_SLOTS, 1, width),
                              lambda cfg: {"block_n": cfg.block_k, "block_t": cfg.block_d},
                              row_tiles=False, stage=stage, T=width,
                              dtype=kernels.TL_DTYPES[w.dtype],
                              dt_dtype=kernels.TL_DTYPES[dt.dtype],
                              acc=kernels.TL_DTYPES[acc_dtype(w.dtype)])


def launch(dt: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Forward kernel of ``fastopt::time_encode``."""
    kernel = _kernel("forward", dt, w)
    out = kernels.empty((*dt.shape, w.shape[0]), w.dtype, dt.device)
    count = dt.numel()
    kernel.launch((-(-count // kernel.cfg.block_k), 1), dt, w, b, out, count)
    return out


def launch_backward(grad_out: Tensor, dt: Tensor, w: Tensor,
                    b: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward kernel of ``fastopt::time_encode``: ``(ddt, dw, db)``, deterministic."""
    kernel = _kernel("backward", dt, w)
    count = dt.numel()
    programs = -(-count // kernel.cfg.block_k)
    ddt = kernels.empty_like(dt)
    partial = torch.empty((max(programs, 1), 2, w.shape[0]), device=dt.device,
                          dtype=acc_dtype(w.dtype))
    if programs == 0:
        partial.zero_()
    kernel.launch((programs, 1), dt, w, b, grad_out, ddt, partial, count)
    return ddt, partial[:, 0].sum(0).to(w.dtype), partial[:, 1].sum(0).to(b.dtype)


@fused_op("time_encode", grad_inputs=("dt", "w", "b"), forward=(launch, reference),
          backward=(launch_backward, reference_backward))
def time_encode_op(dt: Tensor, w: Tensor, b: Tensor) -> Tensor:
    return w.new_empty((*dt.shape, w.shape[0]))


def time_encode(dt: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Harmonic time encoding ``cos(dt[..., None] * w + b)`` (TGAT's functional encoding).

    Args:
        dt: Time differences ``[...]``.
        w: Frequencies ``[T]``.
        b: Phases ``[T]``.

    Returns:
        ``[..., T]`` in the dtype of ``w``.

    Raises:
        KernelError: on dtypes, shapes or devices that do not fit.
    """
    check(dt, w, b)
    return time_encode_op(dt.contiguous(), w.contiguous(), b.contiguous())
