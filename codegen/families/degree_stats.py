"""The largest in-degree of an edge list and the ranges of its indices, in one launch.

The edge-attention operators specialize on a slot count (the largest in-degree, rounded up to a
power of two) that the host must know before the kernels run, and check their indices' ranges in
the same host read (:func:`fastopt.codegen.edge_slot_count`). Counted with torch, that is a
zeroed count vector, a clamp, an ``index_add``, a max, an ``aminmax`` per index and a stack:
seven launches and their host cost, which at a PyG example's sizes is a large part of a fused
layer's call. The generated kernel (``degree_stats.py.jinja``) does it in one pass over the
edges, after one zero fill. Not differentiable; the reference runs where the kernel does not.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fastopt.codegen import kernels
from fastopt.codegen.kernel_config import KernelConfig
from fastopt.codegen.library import select_backend

__all__ = ["degree_stats", "reference"]

BLOCK = 1024
"""Edges per program."""

_MAPPING = KernelConfig(block_m=BLOCK, num_warps=4, num_stages=1)


def reference(dst: Tensor, num_dst: int, index: Optional[Tensor] = None) -> Tensor:
    """``[5]`` int64: the largest count of an in-range destination (0 without one), ``max(0,
    max(dst))``, ``max(0, -min(dst))``, and the same two of ``index`` (zeros without it)."""
    d = dst.long()
    inside = (d >= 0) & (d < num_dst)
    counts = torch.zeros(num_dst + 1, dtype=torch.int64, device=dst.device)
    counts.index_add_(0, torch.where(inside, d, num_dst), torch.ones_like(d))
    zero = d.new_zeros(())
    stats = [counts[:num_dst].max() if num_dst else zero]
    for t in (d, None if index is None else index.long()):
        if t is None or t.numel() == 0:
            stats += [zero, zero]
        else:
            low, high = torch.aminmax(t)
            stats += [high.clamp(min=0), (-low).clamp(min=0)]
    return torch.stack(stats)


def degree_stats(dst: Tensor, num_dst: int, index: Optional[Tensor] = None) -> Tensor:
    """:func:`reference`'s ``[5]`` statistics of the edges ``dst [E]`` (int32/int64) into
    ``num_dst`` destinations and of ``index [E]`` (another index of the same edges), on the
    device of ``dst``, with no host synchronization. Validated by the caller: 1-d integer
    tensors of one length on one device (any strides). Edges whose destination is outside
    ``[0, num_dst)`` are not counted; the range statistics report them."""
    if select_backend(dst) != "triton" or dst.numel() == 0:
        return reference(dst, num_dst, index)
    buffer = torch.zeros(5 + num_dst, dtype=torch.int64, device=dst.device)
    stats, counts = buffer[:5], buffer[5:]
    kernel = kernels.fixed("degree_stats", dst.device, _MAPPING, block=BLOCK, has_index=index is not None)
    dst = dst.contiguous()  # the kernel reads both indices with unit stride
    index = dst if index is None else index.contiguous()
    kernel.launch((-(-dst.numel() // BLOCK), 1), dst, index, counts, stats, dst.numel(), num_dst)
    return stats
