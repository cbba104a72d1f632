"""Rows appended to a call's tensors so that calls of similar size share one CUDA graph.

A graph replays on fixed shapes; a layer whose node and edge counts change every call pads them
to :func:`fastopt.runtime.bucket` sizes. :class:`RowPad` tells a
:class:`~fastopt.runtime.GraphRunner` how far a tensor argument is padded and with what value:
the runner then writes the real rows and the padding straight into the graph's static input
(no padded copy is built, no ``cat`` in the autograd graph) and trims the outputs, so a call
costs what an unpadded replay costs. :func:`constant_rows` serves the padding values from
buffers kept per device, dtype and value; :func:`pad_rows` builds a padded tensor where one is
needed (a capture, or a call the runner does not replay).

Layering: imports nothing of fastopt but :mod:`fastopt.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import torch
from torch import Tensor

from fastopt.errors import KernelError

__all__ = ["RowPad", "constant_rows", "pad_rows"]


@dataclass(frozen=True)
class RowPad:
    """A tensor argument padded along its first dimension to ``rows`` rows of ``value``."""

    rows: int
    value: int = 0

    def check(self, t: Tensor) -> None:
        """Raises :class:`~fastopt.errors.KernelError` where ``t`` has no rows to pad or more
        than :attr:`rows`."""
        if t.dim() == 0 or t.shape[0] > self.rows:
            raise KernelError(f"a tensor of shape {tuple(t.shape)} cannot be padded to {self.rows} "
                              f"rows; pad each argument to at least its own row count")

    def shape(self, t: Tensor) -> torch.Size:
        """``t``'s shape once padded."""
        return torch.Size((self.rows,) + tuple(t.shape[1:]))


_FILLS: Dict[tuple, Tensor] = {}
_RETIRED: list = []  # buffers a growth replaced: work queued on another stream may still read them


def constant_rows(rows: int, shape: Tuple[int, ...], value: int, like: Tensor) -> Tensor:
    """``[rows, *shape]`` filled with ``value`` in ``like``'s dtype and device, never to be
    written: a view of a buffer kept per device, dtype and value (grown when a call needs more),
    so that a call pays no fill launch for its constants.

    Buffers live for the process (a growth doubles, so a value's buffers total at most twice its
    largest); a value per padded destination count (four per power of two). Not to be called
    while a CUDA graph is being captured: a growth synchronizes the stream."""
    width = 1
    for s in shape:
        width *= s
    key = (like.device, like.dtype, value)
    fill = _FILLS.get(key)
    if fill is None or fill.numel() < rows * width:
        if fill is not None:
            _RETIRED.append(fill)
        fill = torch.full((2 * rows * width,), value, dtype=like.dtype, device=like.device)
        if fill.is_cuda:  # later calls may read it from another stream
            torch.cuda.current_stream(fill.device).synchronize()
        _FILLS[key] = fill
    return fill[:rows * width].view(rows, *shape)


def pad_rows(t: Tensor, extra: int, value: int = 0) -> Tensor:
    """``t`` with ``extra`` rows of ``value`` appended: one ``cat`` with :func:`constant_rows`,
    where ``F.pad`` allocates, fills and copies (two launches, at the host cost of three
    operations)."""
    if extra == 0:
        return t
    return torch.cat([t, constant_rows(extra, tuple(t.shape[1:]), value, t)])
