"""Fused temporal attention: gather neighbors, score, edge softmax, weighted sum.

Two operators share the template ``temporal_attention.py.jinja``:

- ``fastopt::temporal_attention`` ``(out [M, H, d], lse [M, H])``; its backward gives
  ``(dq, dk, dv)``, dk/dv summed into table rows if indexed;
- ``fastopt::shared_attention`` ``(out, shared_out, lse)``: keys and values carry a feature
  block shared by all heads (a factored time encoding); its backward gives
  ``(dq, dk, dv, dsq, dse)``.

The family is a package for its size: :mod:`.checks` (arguments, key/value row layout),
:mod:`.reference` (the plain-PyTorch oracle, Philox dropout), :mod:`.launch` (the launchers);
this module registers the operators with a direct eager path (the attention runs once per layer
and batch, where the custom-op dispatch costs more host time than the kernels take) and holds the
public functions.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from fastopt.codegen import checks as checks_
from fastopt.codegen.families.temporal_attention import launch, reference
from fastopt.codegen.families.temporal_attention.checks import (MAX_SEED, check_attention,
                                                                 check_shared_block, key_rows)
from fastopt.codegen.library import FusedOp, eager_kernels, fused_op
from fastopt.errors import KernelError

__all__ = ["temporal_attention", "shared_attention", "sorted_edge_attention", "dropout_seed"]

Optional_ = Optional[Tensor]


@fused_op("temporal_attention", grad_inputs=("q", "k", "v"), outputs=("out", "lse"),
          nondifferentiable=("lse",), save_outputs=True,
          forward=(launch.attention_forward, reference.temporal_attention_forward),
          backward=(launch.attention_backward, reference.temporal_attention_backward),
          eager_backward=functools.partial(launch.attention_backward, pack=True))
def attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional_, indptr: Optional_,
                 k_index: Optional_, v_index: Optional_, scale: float, dropout_p: float,
                 seed: int) -> Tuple[Tensor, Tensor]:
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=lse_dtype)


@fused_op("shared_attention", grad_inputs=("q", "k", "v", "sq", "se"),
          outputs=("out", "shared_out", "lse"), nondifferentiable=("lse",), save_outputs=True,
          forward=(launch.shared_attention_forward, reference.shared_attention_forward),
          backward=(launch.shared_attention_backward, reference.shared_attention_backward),
          eager_backward=functools.partial(launch.shared_attention_backward, pack=True))
def shared_op(q: Tensor, k: Tensor, v: Tensor, sq: Tensor, se: Tensor, mask: Optional_,
              indptr: Optional_, k_index: Optional_, v_index: Optional_, scale: float,
              dropout_p: float, seed: int) -> Tuple[Tensor, Tensor, Tensor]:
    out, lse = attention_op.fake(q, k, v, mask, indptr, k_index, v_index, scale, dropout_p, seed)
    return out, torch.empty_like(sq), lse


def dropout_seed(like: Tensor) -> Union[int, Tensor]:
    """A fresh dropout key for a :func:`temporal_attention` call on tensors like ``like``.

    Where the eager kernels run (see :func:`~fastopt.codegen.library.eager_kernels`), a
    one-element int64 tensor drawn by the generator of ``like``'s device: no host round trip,
    and a CUDA graph that captured the draw draws a new key on every replay. Elsewhere an int
    drawn by torch's default CPU generator.
    """
    if eager_kernels(like):
        return torch.randint(0, MAX_SEED - 1, (1,), device=like.device)
    return int(torch.randint(0, MAX_SEED - 1, (1,)).item())


def _call(op: FusedOp, q: Tensor, k: Tensor, v: Tensor, shared: Tuple[Tensor, ...], mask,
          indptr, k_index, v_index, scale, dropout_p, seed):
    """Run ``op`` on checked arguments: directly where the eager kernels run, else through the
    custom op (which takes the seed as an int)."""
    eager = eager_kernels(q, k, v, *shared, mask, indptr, k_index, v_index)
    if isinstance(seed, Tensor) and not eager:
        seed = int(seed.reshape(()).item()) % MAX_SEED
    args = (q.contiguous(), key_rows(k, k_index is None), key_rows(v, v_index is None),
            *(t.contiguous() for t in shared), mask, indptr, k_index, v_index,
            1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale), float(dropout_p),
            seed if isinstance(seed, Tensor) else int(seed))
    return op(*args, eager=eager)


def temporal_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional_ = None,
                       indptr: Optional_ = None, *, k_index: Optional_ = None,
                       v_index: Optional_ = None, scale: Optional[float] = None,
                       dropout_p: float = 0.0, seed: Union[int, Tensor] = 0) -> Tensor:
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
    check_attention(q, k, v, mask, indptr, k_index, v_index, scale, dropout_p, seed)
    return _call(attention_op, q, k, v, (), mask, indptr, k_index, v_index, scale, dropout_p,
                 seed)


def shared_attention(q: Tensor, k: Tensor, v: Tensor, sq: Tensor, se: Tensor,
                     mask: Optional_ = None, indptr: Optional_ = None, *,
                     k_index: Optional_ = None, v_index: Optional_ = None,
                     scale: Optional[float] = None, dropout_p: float = 0.0,
                     seed: Union[int, Tensor] = 0) -> Tuple[Tensor, Tensor]:
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
    layout = check_attention(q, k, v, mask, indptr, k_index, v_index, scale, dropout_p, seed)
    check_shared_block(q, sq, se, layout)
    return _call(shared_op, q, k, v, (sq, se), mask, indptr, k_index, v_index, scale, dropout_p,
                 seed)


def sorted_edge_attention(q: Tensor, k: Tensor, v: Tensor, indptr: Tensor, perm: Tensor, *,
                          scale: Optional[float] = None) -> Tensor:
    """The edges form of :func:`temporal_attention`: row ``m`` attends over the edges
    ``perm[indptr[m]] .. perm[indptr[m + 1] - 1]``, keys and values one per edge.

    No slot layout is built and nothing is read back: the kernels loop over each tile's longest
    row, so a CUDA graph captures the call whatever the degrees. ``perm`` must be a permutation
    of the ``E`` edges (the backward stores each edge's key and value gradient, zero for the
    edges past ``indptr[M]``, which no row reaches), ``indptr`` non-decreasing within
    ``[0, E]``; the caller builds both (:func:`fastopt.codegen.edge_attention` with
    ``slots="edges"``), so their values are not checked here, only shapes and dtypes. No
    dropout.

    Args:
        q: Queries ``[M, H, d]``.
        k, v: Keys and values ``[E, H, d]``, one row per edge (rows evenly spaced: the two
            column blocks of one product are read in place).
        indptr: ``[M + 1]`` offsets into ``perm``.
        perm: ``[E]`` edge ids sorted by row.
        scale: Score scale; default ``1 / sqrt(d)``.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("indptr", indptr), ("perm", perm)):
        checks_.is_tensor(name, t)
    checks_.has_ndim("q", q, 3, "[M, H, d]")
    checks_.has_shape("indptr", indptr, (q.shape[0] + 1,), "[M + 1], the rows' offsets into perm")
    checks_.has_ndim("perm", perm, 1, "[E], edge ids sorted by row")
    for name, t in (("k", k), ("v", v)):
        checks_.has_shape(name, t, (perm.numel(),) + tuple(q.shape[1:]), "[E, H, d], one row per edge")
    checks_.same_device(q, k=k, v=v, indptr=indptr, perm=perm)
    checks_.floating("q", q)
    checks_.floating("k", k, q.dtype)
    checks_.floating("v", v, q.dtype)
    for name, t in (("indptr", indptr), ("perm", perm)):
        if t.dtype not in checks_.INDEX_DTYPES:
            raise KernelError(f"{name} has dtype {t.dtype}; supported: int32, int64. Use {name}.long()")
    return _call(attention_op, q, k, v, (), None, indptr, perm, perm, scale, 0.0, 0)
