"""Run-time side of ``split_linear_inputs`` (``split_linear.py``): Linears over the parts of a
concatenation, sibling Linears as one stacked product, and how a rewritten projection sums its
bias gradient.

:func:`linear_over_parts` and :func:`linears_over_parts` are the functions the pass's rewritten
graphs call. :func:`projection`, :func:`column_blocks`, :func:`can_stack` and
:func:`stacked_product` also serve the lowerings of ``attention_mha.py`` (its in/out projections,
keys and values as column blocks of one product) and ``time_encoding.py`` (the factored keys and
values). Like every lowering, each function checks on the actual tensors what the graph could not
show and otherwise runs the original computation, op for op.
"""

from __future__ import annotations

import itertools
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from fastopt import codegen
from fastopt.config import default_config
from fastopt.passes.sites import record
from fastopt.runtime import capturing

__all__ = [
    "linear_over_parts",
    "linears_over_parts",
    "stacked_product",
    "can_stack",
    "column_blocks",
    "adjacent_blocks",
    "projection",
]


def _split_groups(linear: torch.nn.Module, parts: Sequence[Tensor]
                  ) -> Optional[Tuple[List[int], List[int]]]:
    """The parts :func:`linear_over_parts` multiplies apart: ``(no gradient, gradient)`` indices.

    None (run the original) when: the knob is off; no gradient is recorded (nothing to save);
    autocast would round the first product before the sum; the module is not a plain
    ``nn.Linear`` call (a subclass forward, forward hooks or pre-hooks such as old-style weight
    norm, global module hooks); the parts are not all same-dtype tensors of one leading shape
    whose widths sum to the weight's; a zero-width part needs a gradient (it would get none); or
    all parts fall in one group. The exception: no part needs a gradient and one gathered part
    is all the input has beside zero-width ones (TGAT's first layer, its keys and values with
    the time encoding factored out): ``([that part], [])``, projected before its gather.
    """
    if not _plain_linear(linear):
        return None
    return _weight_groups(linear.weight, parts)


def _weight_groups(weight: Tensor, parts: Sequence[Part]
                   ) -> Optional[Tuple[List[int], List[int]]]:
    """:func:`_split_groups` of a projection by ``weight`` (any module checks done)."""
    if not default_config().passes.split_linear_inputs or not torch.is_grad_enabled():
        return None
    if any(torch.is_autocast_enabled(t) for t in ("cpu", "cuda")):
        return None
    if any(_tensor(p) is None or len(_shape(p)) == 0 for p in parts):
        return None
    lead = _shape(parts[0])[:-1]
    free, grad, width = [], [], 0
    for i, p in enumerate(parts):
        shape, t = _shape(p), _tensor(p)
        if shape[:-1] != lead or t.dtype != weight.dtype:
            return None
        width += shape[-1]
        if shape[-1] == 0:
            if t.requires_grad:
                return None
            continue
        (grad if t.requires_grad else free).append(i)
    if width != weight.shape[1] or not free:
        return None
    if not grad and not (len(free) == 1 and _is_rows(parts[free[0]])):
        return None  # one group: nothing to split
    return free, grad


# A part of a concatenation: a tensor, or ``(rows, index)`` standing for ``rows[index]`` (a
# gather the pass handed over unevaluated, so that a projection can run on the rows).
Part = Union[Tensor, Tuple[Tensor, Tensor]]


def _is_rows(p: Part) -> bool:
    return isinstance(p, tuple)


def _tensor(p: Part) -> Optional[Tensor]:
    """The tensor holding a part's values (the rows of a gathered part), or None if not one."""
    t = p[0] if _is_rows(p) else p
    return t if isinstance(t, Tensor) else None


def _shape(p: Part) -> tuple:
    """The shape of the part's value (``(*index.shape, width)`` for a gathered part)."""
    return (*p[1].shape, *p[0].shape[1:]) if _is_rows(p) else tuple(p.shape)


def _gathered(parts: Sequence[Part], keep: Sequence[int] = ()) -> Tuple[Part, ...]:
    """``parts`` with each ``(rows, index)`` evaluated to ``rows[index]``, except those at ``keep``
    whose rows are fewer than the slots they fill (projecting the rows first is then cheaper)."""
    return tuple(p if i in keep and _is_rows(p) and p[0].shape[0] < p[1].numel()
                 else (p[0][p[1]] if _is_rows(p) else p) for i, p in enumerate(parts))


def linear_over_parts(linear: torch.nn.Linear, *parts: Tensor, site: str = "") -> Tensor:
    """``linear(torch.cat(parts, -1))``, the parts that need no gradient multiplied apart.

    ``y = x_free W_free^T + bias + x_grad W_grad^T`` where ``x_free`` / ``x_grad`` concatenate the
    parts that do not / do require gradients and ``W_*`` are their column blocks of the weight:
    the backward computes no input gradient for the free parts and the full concatenation is never
    written. Runs the original when there is nothing to split or ``config.passes.split_linear_inputs``
    is off.
    """
    groups = _split_groups(linear, parts)
    if groups is None:
        x = torch.cat(_gathered(parts), dim=-1)
        if _plain_linear(linear) and _bias_grad(linear.bias) == "column_sum":
            return projection(x, linear.weight, linear.bias)
        return linear(x)
    return _product_over_parts(linear.weight, linear.bias, _gathered(parts, _rows_kept(groups)),
                               groups, site)


def _rows_kept(groups: Tuple[List[int], List[int]]) -> Tuple[int, ...]:
    """The gathered part projected before its gather: the free group's, when it is alone there."""
    free, _ = groups
    return tuple(free) if len(free) == 1 else ()


def linears_over_parts(linears: Sequence[torch.nn.Linear], *parts: Tensor,
                       site: str = "") -> Tuple[Tensor, ...]:
    """``tuple(linear(torch.cat(parts, -1)) for linear in linears)`` as one product.

    Sibling projections of one input (TGAT's keys and values) multiply the input once by their
    weights stacked (``torch.cat`` of the weights, so each Linear's gradient flows to its own
    parameters): one read of the input and one wider, better-occupied product in the forward; in
    the backward one weight-gradient product, one bias reduction and one input gradient instead
    of one per sibling plus their sum. The parts are split as in :func:`linear_over_parts`. The
    results are column blocks of the product (views with the product's row stride; the pass
    merges only siblings whose users accept such views). Each Linear runs on its own when
    ``config.passes.merge_sibling_linears`` is off or they cannot be stacked (another class or
    hooks, other input widths, dtypes or devices, biases on some only).
    """
    if not default_config().passes.merge_sibling_linears or not can_stack(linears, parts):
        return tuple(linear_over_parts(linear, *parts, site=site) for linear in linears)
    return stacked_product([linear.weight for linear in linears], linears, parts, site)


def stacked_product(weights: Sequence[Tensor], linears: Sequence[torch.nn.Linear],
                    parts: Sequence[Tensor], site: str) -> Tuple[Tensor, ...]:
    """The column blocks of ``F.linear(cat(parts), cat(weights), cat(biases))``: sibling
    projections (or column slices ``weights`` of their weights) as one product, split over the
    parts as :func:`linear_over_parts` splits them."""
    weight = torch.cat(list(weights))
    bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
    groups = _weight_groups(weight, parts)
    if groups is None:
        y = projection(torch.cat(_gathered(parts), dim=-1), weight, bias)
    else:
        y = _product_over_parts(weight, bias, _gathered(parts, _rows_kept(groups)), groups, site)
    return column_blocks(y, [linear.out_features for linear in linears])


def column_blocks(y: Tensor, widths: Sequence[int]) -> Tuple[Tensor, ...]:
    """``torch.split(y, widths, -1)``, whose backward takes the blocks' gradients as they lie when
    they are the blocks of one tensor laid out as ``y`` (the fused attention writes the key and
    value gradients so): no concatenation. Only where gradients are recorded; the blocks may not
    be written in place (as ``split``'s)."""
    if not torch.is_grad_enabled() or not y.requires_grad:
        return torch.split(y, list(widths), dim=-1)
    return _ColumnBlocks.apply(y, tuple(widths))


def adjacent_blocks(grads: Sequence[Optional[Tensor]], shape: Sequence[int],
                    stride: Sequence[int], dtype: torch.dtype,
                    widths: Sequence[int]) -> Optional[Tensor]:
    """The tensor of ``shape`` and ``stride`` whose column blocks of ``widths`` are ``grads``, if
    they already are exactly that (one storage, adjacent offsets, the same strides wherever a
    dimension has more than one element, no lazy conjugation or negation); else None."""
    if any(g is None for g in grads) or stride[-1] != 1:
        return None
    first = grads[0]
    offset, storage = first.storage_offset(), first.untyped_storage().data_ptr()
    for g, start in zip(grads, itertools.accumulate([0, *widths[:-1]])):
        if (g.untyped_storage().data_ptr() != storage or g.dtype != dtype or g.is_conj()
                or g.is_neg() or g.storage_offset() != offset + start
                or any(n > 1 and s != t for n, s, t in zip(g.shape, g.stride(), stride))):
            return None
    return first.as_strided(shape, stride, offset)


class _ColumnBlocks(torch.autograd.Function):
    """See :func:`column_blocks`."""

    @staticmethod
    def forward(ctx, y, widths):
        ctx.widths = widths
        ctx.layout = (tuple(y.shape), tuple(y.stride()), y.dtype, y.device)
        return tuple(y.split(list(widths), dim=-1))

    @staticmethod
    def backward(ctx, *grads):
        shape, stride, dtype, device = ctx.layout
        whole = None
        if not torch.is_grad_enabled():  # the shortcut is not differentiable (create_graph=True)
            whole = adjacent_blocks(grads, shape, stride, dtype, ctx.widths)
        if whole is None:
            whole = torch.cat([g if g is not None else
                               torch.zeros(*shape[:-1], w, dtype=dtype, device=device)
                               for g, w in zip(grads, ctx.widths)], dim=-1)
        return whole, None


def can_stack(linears: Sequence[torch.nn.Module], parts: Sequence[Tensor]) -> bool:
    """Whether ``linears`` (two or more) can multiply ``parts`` as one stacked product: plain
    Linears of one input width, dtype and device, all with or all without bias."""
    if len(linears) < 2:
        return False
    first = linears[0]
    for linear in linears:
        if not _plain_linear(linear):
            return False
        if (linear.in_features != first.in_features or linear.weight.dtype != first.weight.dtype
                or linear.weight.device != first.weight.device
                or (linear.bias is None) != (first.bias is None)):
            return False
    return all(_tensor(p) is not None and _tensor(p).device == first.weight.device for p in parts)


def _plain_linear(linear: torch.nn.Module) -> bool:
    """A plain ``nn.Linear`` call: its own forward, no module hooks, no global module hooks."""
    from torch.nn.modules import module as module_hooks

    return (isinstance(linear, torch.nn.Linear) and type(linear).forward is torch.nn.Linear.forward
            and not linear._forward_hooks and not linear._forward_pre_hooks
            and not module_hooks._global_forward_hooks
            and not module_hooks._global_forward_pre_hooks)


def _product_over_parts(weight: Tensor, bias: Optional[Tensor], parts: Sequence[Tensor],
                        groups: Tuple[List[int], List[int]], site: str) -> Tensor:
    """``F.linear(torch.cat(parts, -1), weight, bias)`` as ``x_free W_free^T + b + x_grad W_grad^T``
    (``groups``: the part indices without and with gradient)."""
    free, grad = groups
    starts = [0]
    for p in parts:
        starts.append(starts[-1] + _shape(p)[-1])

    def group(members: List[int]) -> Tuple[Tensor, Tensor]:
        x = parts[members[0]] if len(members) == 1 else torch.cat([parts[i] for i in members], -1)
        blocks = [weight[:, starts[i]:starts[i + 1]] for i in members]
        w = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        return (x if _is_rows(x) else x.reshape(-1, x.shape[-1])), w

    x_free, w_free = group(free)
    grad_width = sum(_shape(parts[i])[-1] for i in grad)
    # addmm, or generated (config.kernels.matmul_precision)
    if _is_rows(x_free):  # gathered rows (the batch's unique edges): project each row once
        rows, index = x_free
        y = _ProjectedRows.apply(rows, index.reshape(-1), w_free, bias)
        record(site, (rows.shape[1], grad_width, rows.shape[0], index.numel()))
    else:
        y = codegen.linear(x_free, w_free, bias, bias_grad=_bias_grad(bias))
        record(site, (x_free.shape[1], grad_width))
    if grad:
        x_grad, w_grad = group(grad)
        y = codegen.linear(x_grad, w_grad, residual=y)
    return y.view(*_shape(parts[0])[:-1], weight.shape[0])


class _ProjectedRows(torch.autograd.Function):
    """``F.linear(rows[index], weight, bias)`` computed as ``F.linear(rows, weight, bias)[index]``
    for rows that need no gradient. The weight gradient is ``(per-row sums of grad)^T rows``: the
    slots' gradients summed per row by the deterministic segmented kernel
    (:func:`~fastopt.codegen.families.segment_reduce.row_sums`, the padding row apart) and one
    product over the unique rows, not the slots (TGAT: 143,360 slots, 49,152 rows). Where the
    generated kernels do not run (the CPU by default), ``grad^T rows[index]``, the product the
    unsplit projection computes: a scatter-add would serialize on the padding row, which every
    padded slot reads."""

    @staticmethod
    def forward(ctx, rows: Tensor, index: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        ctx.save_for_backward(rows, index)
        ctx.has_bias = bias is not None
        return F.linear(rows, weight, bias)[index]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        rows, index = ctx.saved_tensors
        want_w, want_b = ctx.needs_input_grad[2], ctx.has_bias and ctx.needs_input_grad[3]
        grad_w = grad_b = None
        if want_w and codegen.select_backend(grad) == "triton":
            sums = codegen.row_sums(grad, index, rows.shape[0], apart=0)
            grad_w = sums.t() @ rows
            grad_b = sums.sum(0) if want_b else None  # the rows' sums: a third of the slots' bytes
        elif want_w:
            grad_w = grad.t() @ rows[index]
        if want_b and grad_b is None:
            grad_b = grad.sum(0)
        return None, None, grad_w, grad_b


def _bias_grad(bias: Optional[Tensor]) -> str:
    """How a rewritten projection sums its bias gradient (``config.passes.bias_grad_kernel``):
    ``"column_sum"`` (the generated kernel) always, or only while a CUDA graph is being captured
    (where its autograd node costs no host time); else ``"torch"``."""
    if bias is None:
        return "torch"
    mode = default_config().passes.bias_grad_kernel
    if mode == "always" or (mode == "graphs" and bias.is_cuda and capturing()):
        return "column_sum"
    return "torch"


def projection(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``F.linear(x, weight, bias)``, the bias gradient as :func:`_bias_grad` says."""
    mode = _bias_grad(bias)
    if mode == "torch":
        return F.linear(x, weight, bias)
    y = codegen.linear(x.reshape(-1, x.shape[-1]), weight, bias, bias_grad=mode)
    return y.view(*x.shape[:-1], weight.shape[0])
