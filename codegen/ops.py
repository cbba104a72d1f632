"""The public fused operators, registered as ``torch.library`` custom ops (namespace ``fastopt``).

Each operator is one custom op with a fake (meta) implementation and an autograd formula whose
backward is itself a custom op, so ``torch.compile``, fx and ``gradcheck`` see a single node:

=====================================  ==========================================================
``fastopt::temporal_attention``        ``(out [M, H, d], lse [M, H])``
``fastopt::temporal_attention_backward``  ``(dq, dk, dv)``, dk/dv summed into table rows if indexed
``fastopt::shared_attention``          ``(out, shared_out, lse)``: a feature block shared by heads
``fastopt::masked_aggregate``          ``out [M, F...]`` and its backward
``fastopt::time_encode``               ``cos(dt w + b)`` and its backward
=====================================  ==========================================================

In eager mode, :func:`temporal_attention` on plain tensors with the Triton backend runs the same
kernels through an ``autograd.Function`` twin of the op's autograd, skipping the custom-op
dispatch layers (their host time exceeds the kernels' device time at training batch sizes);
``torch.compile``, fx/dispatch traces and tensor subclasses get the custom op.

Backend choice (:func:`select_backend`), read from ``config.kernels`` at call time: ``backend =
"auto"`` runs the generated Triton kernels on CUDA tensors and the references of
:mod:`fastopt.codegen.reference` on CPU tensors; ``"triton"`` runs the kernels everywhere (on the
CPU through the Triton interpreter, ``TRITON_INTERPRET=1``: how CI tests the kernels);
``"reference"`` (or ``enabled = False``) runs the references everywhere.
"""

from __future__ import annotations

import math
import os
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils import _python_dispatch

from fastopt.codegen import checks, reference
from fastopt.config import default_config
from fastopt.errors import KernelError

__all__ = [
    "temporal_attention",
    "dropout_seed",
    "shared_attention",
    "masked_aggregate",
    "time_encode",
    "linear",
    "column_sum",
    "select_backend",
]

Optional_ = Optional[Tensor]


def select_backend(t: Tensor) -> str:
    """``"triton"`` or ``"reference"`` for an operator whose inputs live where ``t`` lives."""
    cfg = default_config().kernels
    if not cfg.enabled or cfg.backend == "reference":
        return "reference"
    if cfg.backend == "auto":
        return "triton" if t.is_cuda else "reference"
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise KernelError(
            f"kernels.backend='triton' on a {t.device} tensor needs the Triton interpreter; set "
            f"TRITON_INTERPRET=1 before importing triton, or use backend 'auto'"
        )
    return "triton"


def _kernels():
    # Imported on first use: the reference path must work where triton is not installed.
    from fastopt.codegen import kernels

    return kernels


def _scale(q: Tensor, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


# ----------------------------------------------------------------------------------------------
# temporal attention
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("fastopt::temporal_attention", mutates_args=())
def _attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional_, indptr: Optional_,
               k_index: Optional_, v_index: Optional_, scale: float, dropout_p: float,
               seed: int) -> Tuple[Tensor, Tensor]:
    args = (q, k, v, mask, indptr)
    kwargs = dict(k_index=k_index, v_index=v_index, scale=scale, dropout_p=dropout_p, seed=seed)
    if select_backend(q) == "triton":
        return _kernels().attention_forward(*args, **kwargs)
    out, lse = reference.temporal_attention_forward(*args, **kwargs)
    return out, lse.float() if q.dtype != torch.float64 else lse


@_attention.register_fake
def _attention_fake(q, k, v, mask, indptr, k_index, v_index, scale, dropout_p, seed):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=lse_dtype)


@torch.library.custom_op("fastopt::temporal_attention_backward", mutates_args=())
def _attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                        lse: Tensor, mask: Optional_, indptr: Optional_, k_index: Optional_,
                        v_index: Optional_, scale: float, dropout_p: float,
                        seed: int) -> Tuple[Tensor, Tensor, Tensor]:
    args = (grad_out, q, k, v, out, lse, mask, indptr)
    kwargs = dict(k_index=k_index, v_index=v_index, scale=scale, dropout_p=dropout_p, seed=seed)
    if select_backend(q) == "triton":
        return _kernels().attention_backward(*args, **kwargs)
    return reference.temporal_attention_backward(*args, **kwargs)


@_attention_backward.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, lse, mask, indptr, k_index, v_index, scale,
                             dropout_p, seed):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_setup(ctx, inputs, output):
    q, k, v, mask, indptr, k_index, v_index, scale, dropout_p, seed = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask, indptr, k_index, v_index)
    ctx.hyper = (scale, dropout_p, seed)
    ctx.mark_non_differentiable(lse)


def _attention_grad(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, mask, indptr, k_index, v_index = ctx.saved_tensors
    dq, dk, dv = torch.ops.fastopt.temporal_attention_backward(
        grad_out.contiguous(), q, k, v, out, lse, mask, indptr, k_index, v_index, *ctx.hyper)
    return dq, dk, dv, None, None, None, None, None, None, None


_attention.register_autograd(_attention_grad, setup_context=_attention_setup)


class _EagerAttention(torch.autograd.Function):
    """The autograd of ``fastopt::temporal_attention`` without the custom-op dispatch layers.

    Same kernels, same saved tensors, same formula as the registered autograd; used only for
    plain tensors outside any trace (see :func:`_eager_kernels`), where the op's Python dispatch
    (autograd wrapper, redispatch, backend wrapper, for the forward and again for the backward)
    costs more host time than the kernels take on the device. Traces and compiled graphs keep
    seeing the one custom op.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, indptr, k_index, v_index, scale, dropout_p, seed):
        out, lse = _kernels().attention_forward(q, k, v, mask, indptr, k_index=k_index,
                                                v_index=v_index, scale=scale,
                                                dropout_p=dropout_p, seed=seed)
        ctx.save_for_backward(q, k, v, out, lse, mask, indptr, k_index, v_index)
        # the backward redraws this call's mask: keep the key, not the caller's tensor
        ctx.hyper = (scale, dropout_p, seed.clone() if isinstance(seed, Tensor) else seed)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, mask, indptr, k_index, v_index = ctx.saved_tensors
        scale, dropout_p, seed = ctx.hyper
        dq, dk, dv = _kernels().attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, mask, indptr, k_index=k_index,
            v_index=v_index, scale=scale, dropout_p=dropout_p, seed=seed, pack=True)
        return dq, dk, dv, None, None, None, None, None, None, None


_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def _eager_kernels(*tensors: Optional[Tensor]) -> bool:
    """Whether a call may run the kernels directly: eager mode, plain tensors, Triton backend."""
    if torch.compiler.is_compiling() or _python_dispatch._get_current_dispatch_mode() is not None:
        return False
    if torch._C._is_torch_function_mode_enabled():
        return False
    if any(t is not None and type(t) not in _PLAIN_TENSORS for t in tensors):
        return False
    return select_backend(tensors[0]) == "triton"


def dropout_seed(like: Tensor) -> Union[int, Tensor]:
    """A fresh dropout key for a :func:`temporal_attention` call on tensors like ``like``.

    Where the eager kernels run (see :func:`_eager_kernels`), a one-element int64 tensor drawn by
    the generator of ``like``'s device: no host round trip, and a CUDA graph that captured the
    draw draws a new key on every replay. Elsewhere an int drawn by torch's default CPU generator.
    """
    if _eager_kernels(like):
        return torch.randint(0, checks.MAX_SEED - 1, (1,), device=like.device)
    return int(torch.randint(0, checks.MAX_SEED - 1, (1,)).item())


def temporal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor] = None,
    indptr: Optional[Tensor] = None,
    *,
    k_index: Optional[Tensor] = None,
    v_index: Optional[Tensor] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    seed: Union[int, Tensor] = 0,
) -> Tensor:
    """Fused temporal attention: gather neighbors, score, edge softmax, weighted sum.

    Args:
        q: Queries ``[M, H, d]`` (float32 default; float16/bfloat16 accumulate in float32).
        k: Keys, dense ``[M, K, H, d]`` or a table ``[U, H, d]`` addressed by ``k_index``.
        v: Values, dense ``[M, K, H, d]`` or a table ``[U, H, d]`` addressed by ``v_index``.
        mask: Valid neighbor slots ``[M, K]`` (bool); exclusive with ``indptr``.
        indptr: CSR offsets ``[M + 1]``: row ``m`` has its first ``indptr[m+1]-indptr[m]`` slots
            valid (the sampler's padded layout).
        k_index: Table rows of the keys ``[M, K]`` (int32/int64); the expanded keys are never built.
        v_index: Table rows of the values ``[M, K]`` (int32/int64).
        scale: Score scale; default ``1 / sqrt(d)``.
        dropout_p: Probability of dropping an attention weight; kept weights scale by ``1/(1-p)``.
        seed: Philox key of the dropout draws, ``0 <= seed < 2**31``; one seed, one mask. Or a
            one-element int tensor on ``q``'s device holding the key: the eager kernels read it
            from memory (no host round trip; a captured CUDA graph sees each replay's new key),
            the custom op (compiled or traced calls) reads it back to the host. A key held in
            a tensor is taken modulo ``2**31`` on both paths (it is not range-checked: that
            would need a device sync).

    Returns:
        ``[M, H, d]`` in the dtype of ``q``; rows without a valid neighbor are zeros.

    Raises:
        KernelError: on shapes, dtypes, devices or index values that do not fit.
    """
    checks.check_attention(q, k, v, mask, indptr, k_index, v_index, scale, dropout_p, seed)
    eager = _eager_kernels(q, k, v, mask, indptr, k_index, v_index)
    if isinstance(seed, Tensor) and not eager:
        seed = int(seed.reshape(()).item()) % checks.MAX_SEED  # the custom op's schema takes an int
    args = (q.contiguous(), checks.key_rows(k, k_index is None), checks.key_rows(v, v_index is None),
            mask, indptr, k_index, v_index, _scale(q, scale), float(dropout_p),
            seed if isinstance(seed, Tensor) else int(seed))
    if eager:
        return _EagerAttention.apply(*args)
    out, _ = torch.ops.fastopt.temporal_attention(*args)
    return out


# ----------------------------------------------------------------------------------------------
# attention with a feature block shared by all heads
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("fastopt::shared_attention", mutates_args=())
def _shared(q: Tensor, k: Tensor, v: Tensor, sq: Tensor, se: Tensor, mask: Optional_,
            indptr: Optional_, k_index: Optional_, v_index: Optional_, scale: float,
            dropout_p: float, seed: int) -> Tuple[Tensor, Tensor, Tensor]:
    args = (q, k, v, sq, se, mask, indptr)
    kwargs = dict(k_index=k_index, v_index=v_index, scale=scale, dropout_p=dropout_p, seed=seed)
    if select_backend(q) == "triton":
        return _kernels().shared_attention_forward(*args, **kwargs)
    out, shared_out, lse = reference.shared_attention_forward(*args, **kwargs)
    return out, shared_out, lse.float() if q.dtype != torch.float64 else lse


@_shared.register_fake
def _shared_fake(q, k, v, sq, se, mask, indptr, k_index, v_index, scale, dropout_p, seed):
    out, lse = _attention_fake(q, k, v, mask, indptr, k_index, v_index, scale, dropout_p, seed)
    return out, torch.empty_like(sq), lse


@torch.library.custom_op("fastopt::shared_attention_backward", mutates_args=())
def _shared_backward(grad_out: Tensor, grad_shared_out: Tensor, q: Tensor, k: Tensor, v: Tensor,
                     sq: Tensor, se: Tensor, out: Tensor, shared_out: Tensor, lse: Tensor,
                     mask: Optional_, indptr: Optional_, k_index: Optional_, v_index: Optional_,
                     scale: float, dropout_p: float, seed: int) -> List[Tensor]:
    args = (grad_out, grad_shared_out, q, k, v, sq, se, out, shared_out, lse, mask, indptr)
    kwargs = dict(k_index=k_index, v_index=v_index, scale=scale, dropout_p=dropout_p, seed=seed)
    if select_backend(q) == "triton":
        return list(_kernels().shared_attention_backward(*args, **kwargs))
    return list(reference.shared_attention_backward(*args, **kwargs))


@_shared_backward.register_fake
def _shared_backward_fake(grad_out, grad_shared_out, q, k, v, sq, se, out, shared_out, lse, mask,
                          indptr, k_index, v_index, scale, dropout_p, seed):
    return [torch.empty_like(t) for t in (q, k, v, sq, se)]


def _shared_setup(ctx, inputs, output):
    q, k, v, sq, se, mask, indptr, k_index, v_index, scale, dropout_p, seed = inputs
    out, shared_out, lse = output
    ctx.save_for_backward(q, k, v, sq, se, out, shared_out, lse, mask, indptr, k_index, v_index)
    ctx.hyper = (scale, dropout_p, seed)
    ctx.mark_non_differentiable(lse)


def _shared_grads(grad_out, grad_shared_out, out, shared_out):
    """Incoming gradients, zeros for an output that got none (autograd passes None)."""
    return (torch.zeros_like(out) if grad_out is None else grad_out.contiguous(),
            torch.zeros_like(shared_out) if grad_shared_out is None
            else grad_shared_out.contiguous())


def _shared_grad(ctx, grad_out, grad_shared_out, _grad_lse):
    q, k, v, sq, se, out, shared_out, lse, mask, indptr, k_index, v_index = ctx.saved_tensors
    grads = torch.ops.fastopt.shared_attention_backward(
        *_shared_grads(grad_out, grad_shared_out, out, shared_out), q, k, v, sq, se, out,
        shared_out, lse, mask, indptr, k_index, v_index, *ctx.hyper)
    return (*grads, None, None, None, None, None, None, None)


_shared.register_autograd(_shared_grad, setup_context=_shared_setup)


class _EagerShared(torch.autograd.Function):
    """:class:`_EagerAttention` for ``fastopt::shared_attention``."""

    @staticmethod
    def forward(ctx, q, k, v, sq, se, mask, indptr, k_index, v_index, scale, dropout_p, seed):
        out, shared_out, lse = _kernels().shared_attention_forward(
            q, k, v, sq, se, mask, indptr, k_index=k_index, v_index=v_index, scale=scale,
            dropout_p=dropout_p, seed=seed)
        ctx.save_for_backward(q, k, v, sq, se, out, shared_out, lse, mask, indptr, k_index,
                              v_index)
        ctx.hyper = (scale, dropout_p, seed.clone() if isinstance(seed, Tensor) else seed)
        return out, shared_out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_shared_out):
        q, k, v, sq, se, out, shared_out, lse, mask, indptr, k_index, v_index = ctx.saved_tensors
        scale, dropout_p, seed = ctx.hyper
        grads = _kernels().shared_attention_backward(
            *_shared_grads(grad_out, grad_shared_out, out, shared_out), q, k, v, sq, se, out,
            shared_out, lse, mask, indptr, k_index=k_index, v_index=v_index, scale=scale,
            dropout_p=dropout_p, seed=seed, pack=True)
        return (*grads, None, None, None, None, None, None, None)


def shared_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sq: Tensor,
    se: Tensor,
    mask: Optional[Tensor] = None,
    indptr: Optional[Tensor] = None,
    *,
    k_index: Optional[Tensor] = None,
    v_index: Optional[Tensor] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    seed: Union[int, Tensor] = 0,
) -> Tuple[Tensor, Tensor]:
    """Temporal attention whose keys and values carry a feature block shared by all heads.

    Head ``h`` of row ``m`` attends with query ``[q[m, h] ; sq[m, h]]`` over keys
    ``[k_j[h] ; se[m, j]]`` and values ``[v_j[h] ; se[m, j]]``; one kernel, the concatenations
    never built. A projection ``[x_j ; e_j] W`` of keys and values whose input has a per-slot
    part ``e_j`` (TGAT's time encoding) factors into this form (``sq = q W_e^T``, and the
    output's ``e`` part is ``shared_out W_e``), so the ``[M, K, H, d]`` projection of ``e`` is
    never computed. See :func:`fastopt.codegen.reference.shared_attention`.

    Args:
        q, k, v, mask, indptr, k_index, v_index, dropout_p, seed: As in
            :func:`temporal_attention`.
        sq: Queries' shared part ``[M, H, S]``.
        se: The shared block of each slot ``[M, K, S]``.
        scale: Score scale; default ``1 / sqrt(d)`` (d of ``q``, not ``d + S``).

    Returns:
        ``(out [M, H, d], shared_out [M, H, S])``; rows without a valid neighbor are zeros.
    """
    layout = checks.check_attention(q, k, v, mask, indptr, k_index, v_index, scale, dropout_p,
                                    seed)
    checks.check_shared_block(q, sq, se, layout)
    eager = _eager_kernels(q, k, v, sq, se, mask, indptr, k_index, v_index)
    if isinstance(seed, Tensor) and not eager:
        seed = int(seed.reshape(()).item()) % checks.MAX_SEED
    args = (q.contiguous(), checks.key_rows(k, k_index is None), checks.key_rows(v, v_index is None),
            sq.contiguous(), se.contiguous(), mask, indptr, k_index, v_index, _scale(q, scale),
            float(dropout_p), seed if isinstance(seed, Tensor) else int(seed))
    if eager:
        return _EagerShared.apply(*args)
    out, shared_out, _ = torch.ops.fastopt.shared_attention(*args)
    return out, shared_out


# ----------------------------------------------------------------------------------------------
# masked aggregation
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("fastopt::masked_aggregate", mutates_args=())
def _aggregate(x: Tensor, mask: Optional_, indptr: Optional_, index: Optional_,
               reduce: str) -> Tensor:
    if select_backend(x) == "triton":
        return _kernels().aggregate_forward(x, mask, indptr, index=index, reduce=reduce)
    return reference.masked_aggregate(x, mask, indptr, index=index, reduce=reduce)


@_aggregate.register_fake
def _aggregate_fake(x, mask, indptr, index, reduce):
    rows = x.shape[0] if index is None else index.shape[0]
    features = x.shape[2:] if index is None else x.shape[1:]
    return x.new_empty((rows, *features))


@torch.library.custom_op("fastopt::masked_aggregate_backward", mutates_args=())
def _aggregate_backward(grad_out: Tensor, x: Tensor, mask: Optional_, indptr: Optional_,
                        index: Optional_, reduce: str) -> Tensor:
    if select_backend(x) == "triton":
        return _kernels().aggregate_backward(grad_out, x, mask, indptr, index=index, reduce=reduce)
    return reference.masked_aggregate_backward(grad_out, x, mask, indptr, index=index,
                                               reduce=reduce)


@_aggregate_backward.register_fake
def _aggregate_backward_fake(grad_out, x, mask, indptr, index, reduce):
    return torch.empty_like(x)


def _aggregate_setup(ctx, inputs, output):
    x, mask, indptr, index, reduce = inputs
    ctx.save_for_backward(x, mask, indptr, index)
    ctx.reduce = reduce


def _aggregate_grad(ctx, grad_out):
    x, mask, indptr, index = ctx.saved_tensors
    dx = torch.ops.fastopt.masked_aggregate_backward(grad_out.contiguous(), x, mask, indptr, index,
                                                     ctx.reduce)
    return dx, None, None, None, None


_aggregate.register_autograd(_aggregate_grad, setup_context=_aggregate_setup)


def masked_aggregate(
    x: Tensor,
    mask: Optional[Tensor] = None,
    indptr: Optional[Tensor] = None,
    *,
    index: Optional[Tensor] = None,
    reduce: str = "mean",
) -> Tensor:
    """Sum or mean of each destination's valid neighbor rows, gathered by index if given.

    Args:
        x: Neighbor features, dense ``[M, K, F...]`` or a table ``[U, F...]`` when ``index`` is
            given (the expanded ``[M, K, F...]`` is never built).
        mask: Valid neighbor slots ``[M, K]`` (bool); exclusive with ``indptr``.
        indptr: CSR offsets ``[M + 1]`` (first slots of each row valid).
        index: Table rows ``[M, K]`` (int32/int64).
        reduce: ``"mean"`` (over valid slots) or ``"sum"``.

    Returns:
        ``[M, F...]`` in the dtype of ``x``; rows without a valid neighbor are zeros.

    Raises:
        KernelError: on shapes, dtypes, devices or index values that do not fit.
    """
    checks.check_aggregate(x, mask, indptr, index, reduce)
    return torch.ops.fastopt.masked_aggregate(x.contiguous(), mask, indptr, index, reduce)


# ----------------------------------------------------------------------------------------------
# time encoding
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("fastopt::time_encode", mutates_args=())
def _time_encode(dt: Tensor, w: Tensor, b: Tensor) -> Tensor:
    if select_backend(dt) == "triton":
        return _kernels().time_encode_forward(dt, w, b)
    return reference.time_encode(dt, w, b)


@_time_encode.register_fake
def _time_encode_fake(dt, w, b):
    return w.new_empty((*dt.shape, w.shape[0]))


@torch.library.custom_op("fastopt::time_encode_backward", mutates_args=())
def _time_encode_backward(grad_out: Tensor, dt: Tensor, w: Tensor,
                          b: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    if select_backend(dt) == "triton":
        return _kernels().time_encode_backward(grad_out, dt, w, b)
    return reference.time_encode_backward(grad_out, dt, w, b)


@_time_encode_backward.register_fake
def _time_encode_backward_fake(grad_out, dt, w, b):
    return torch.empty_like(dt), torch.empty_like(w), torch.empty_like(b)


def _time_encode_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _time_encode_grad(ctx, grad_out):
    return torch.ops.fastopt.time_encode_backward(grad_out.contiguous(), *ctx.saved_tensors)


_time_encode.register_autograd(_time_encode_grad, setup_context=_time_encode_setup)


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
    checks.check_time_encode(dt, w, b)
    return torch.ops.fastopt.time_encode(dt.contiguous(), w.contiguous(), b.contiguous())


# ----------------------------------------------------------------------------------------------
# projections
# ----------------------------------------------------------------------------------------------


class _Linear(torch.autograd.Function):
    """``x @ w^T (+ bias) (+ residual)`` and its gradients by the generated matmul kernels."""

    @staticmethod
    def forward(ctx, x, w, bias, residual, precision):
        ctx.save_for_backward(x, w)
        ctx.precision = precision
        return _kernels().matmul(x, w.t(), bias=bias, residual=residual, precision=precision)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        matmul = _kernels().matmul
        need_x, need_w, need_bias, need_residual, _ = ctx.needs_input_grad
        dx = matmul(grad, w, precision=ctx.precision) if need_x else None
        dw = dbias = None
        if need_w and need_bias:  # the bias gradient from the weight gradient's reads of grad
            dw, dbias = matmul(grad.t(), x, precision=ctx.precision, row_sums=True)
        elif need_w:
            dw = matmul(grad.t(), x, precision=ctx.precision)
        elif need_bias:
            dbias = grad.sum(0)
        return dx, dw, dbias, grad if need_residual else None, None


class _ColumnSumBias(torch.autograd.Function):
    """``addmm`` whose backward sums the bias gradient with :func:`column_sum`."""

    @staticmethod
    def forward(ctx, x, w, bias, residual):
        ctx.save_for_backward(x, w)
        if residual is None:
            return torch.addmm(bias, x, w.t())
        return torch.addmm(residual, x, w.t()) + bias

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        need_x, need_w, need_bias, need_residual = ctx.needs_input_grad
        return (grad @ w if need_x else None, grad.t() @ x if need_w else None,
                column_sum(grad) if need_bias else None, grad if need_residual else None)


def column_sum(x: Tensor) -> Tensor:
    """``x.sum(0)`` of a matrix: by the generated column-sum kernels (deterministic; float32
    accumulation) where they run (Triton backend, unit column stride), else by torch.

    Raises:
        KernelError: ``x`` is not a matrix.
    """
    if x.dim() != 2:
        raise KernelError(f"column_sum needs a [M, N] matrix; got shape {tuple(x.shape)}. "
                          f"Flatten the leading dimensions (x.reshape(-1, x.shape[-1]))")
    if x.stride(1) == 1 and x.is_floating_point() and _eager_kernels(x):
        return _kernels().column_sum(x)
    return x.sum(0)


def linear(x: Tensor, w: Tensor, bias: Optional[Tensor] = None,
           residual: Optional[Tensor] = None, *, bias_grad: str = "torch") -> Tensor:
    """``x @ w.T (+ bias) (+ residual)`` for ``x [M, K]``, ``w [N, K]``: a projection.

    With ``config.kernels.matmul_precision`` ``"tf32x3"`` or ``"ieee"`` and the Triton backend,
    float32 operands of any strides, the product and its gradients run in the generated matmul
    kernels (``"tf32x3"``: tensor-core products of high and low TensorFloat-32 parts, about
    float32's accuracy; ``"ieee"``: float32 multiply-adds); weight gradients split the batch rows
    over programs and sum the partials in a fixed order. Otherwise (the default ``"off"``) one
    ``torch.addmm``, as ``F.linear`` runs it; with ``bias_grad="column_sum"`` (and a bias that
    needs a gradient) its backward sums the bias gradient by :func:`column_sum` rather than
    torch's reduction (cuBLAS products for the rest).

    Returns:
        ``[M, N]``.

    Raises:
        KernelError: ``x`` and ``w`` are not matrices of one inner width.
    """
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise KernelError(
            f"linear needs x [M, K] and w [N, K]; got x {tuple(x.shape)} and w {tuple(w.shape)}. "
            f"Flatten x's leading dimensions (x.reshape(-1, x.shape[-1])) and pass w as "
            f"nn.Linear stores it ([out_features, in_features])")
    precision = default_config().kernels.matmul_precision
    tensors = (x, w, bias, residual)
    if precision != "off" and (bias is None or bias.shape == (w.shape[0],)) and \
            (residual is None or residual.shape == (x.shape[0], w.shape[0])) and \
            all(t is None or t.dtype == torch.float32 for t in tensors) and \
            not torch.is_autocast_enabled(x.device.type) and _eager_kernels(*tensors):
        return _Linear.apply(x, w, None if bias is None else bias.contiguous(), residual,
                             precision)
    if bias_grad == "column_sum" and bias is not None and bias.requires_grad and \
            torch.is_grad_enabled() and _eager_kernels(*tensors):
        return _ColumnSumBias.apply(x, w, bias, residual)
    if residual is not None:
        out = torch.addmm(residual, x, w.t())
        return out if bias is None else out + bias
    return torch.mm(x, w.t()) if bias is None else torch.addmm(bias, x, w.t())
