"""Rows of a table by id through a device cache: ``table[ids]`` with each row read from the
cache's slots where it has one and from the table itself where it has none.

The table may live in pinned host memory: the generated kernel (``cached_rows.py.jinja``) reads
the rows the cache lacks straight from it over the bus, so serving a batch of ids is one launch
with no host work and no host synchronization (SlimCache's zero-copy reads). Not differentiable
and not a custom op: feature tables are inputs, not parameters. The reference runs where the
kernel does not (CPU tensors with the ``auto`` backend, ``backend = "reference"``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fastopt.codegen import kernels
from fastopt.codegen.kernel_config import KernelConfig, next_power_of_2
from fastopt.codegen.library import select_backend
from fastopt.errors import KernelError

__all__ = ["cached_rows", "reference"]

# Elements of one program's [block_r, block_d] tile: enough rows in flight per program to hide the
# latency of reads that cross the bus.
ROWS_TILE = 4096
# Widest column block; wider rows take several in turn.
MAX_BLOCK_D = 256


def reference(ids: Tensor, slot_map: Tensor, slots: Tensor, table: Tensor) -> Tensor:
    """``table[ids]`` read as the kernel reads it (slots where cached); all on one device."""
    slot = slot_map[ids].long()
    hit = (slot >= 0).reshape((-1,) + (1,) * (table.dim() - 1))
    return torch.where(hit, slots[slot.clamp(min=0)], table[ids])


def _check(ids: Tensor, slot_map: Tensor, slots: Tensor, table: Tensor, out: Optional[Tensor]) -> None:
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise KernelError(f"cached_rows needs a 1-d int32/int64 id vector; got {tuple(ids.shape)} "
                          f"{ids.dtype}. Flatten the ids (ids.reshape(-1))")
    if slot_map.dtype != torch.int32 or slot_map.numel() != table.shape[0]:
        raise KernelError(f"the slot map must be int32 with one entry per table row ({table.shape[0]}); "
                          f"got {slot_map.numel()} entries of {slot_map.dtype}")
    if slots.dtype != table.dtype or tuple(slots.shape[1:]) != tuple(table.shape[1:]):
        raise KernelError(f"cache slots {tuple(slots.shape)} {slots.dtype} do not match table rows "
                          f"{tuple(table.shape[1:])} {table.dtype}; allocate slots like the table's rows")
    for name, t in (("table", table), ("slots", slots), ("out", out)):
        if t is not None and not t.is_contiguous():
            raise KernelError(f"cached_rows reads and writes whole rows in row-major order, but {name} "
                              f"{tuple(t.shape)} has strides {t.stride()}; pass {name}.contiguous()")
    for name, t in (("slot_map", slot_map), ("slots", slots)):
        if t.device != ids.device:
            raise KernelError(f"{name} is on {t.device} but the ids are on {ids.device}; the cache's "
                              f"slot map and slots live where the ids are read")
    if out is not None and (out.dtype != table.dtype or tuple(out.shape) != (ids.numel(),) + tuple(table.shape[1:])):
        raise KernelError(f"out must be {(ids.numel(),) + tuple(table.shape[1:])} {table.dtype}; got "
                          f"{tuple(out.shape)} {out.dtype}")


def cached_rows(ids: Tensor, slot_map: Tensor, slots: Tensor, table: Tensor,
                out: Optional[Tensor] = None) -> Tensor:
    """``table[ids]`` (``[n, *row]``), each row from ``slots[slot_map[id]]`` where that is
    ``>= 0`` and from ``table`` otherwise, on the current stream.

    ``ids``, ``slot_map`` (int32, one entry per table row, -1 = not cached) and ``slots`` live on
    the device that runs the read; ``table`` there too, or in pinned host memory when that device
    is a GPU and the generated kernel runs (it reads the host rows directly). Ids must be valid
    rows (no padding value): the kernel does not check them.

    Raises:
        KernelError: shapes or dtypes that do not fit together, or a host table with no kernel to
            read it (triton missing, or ``kernels.backend = "reference"``).
    """
    _check(ids, slot_map, slots, table, out)
    if select_backend(ids) != "triton":
        if table.device != ids.device:
            raise KernelError(f"a table on {table.device} read by ids on {ids.device} needs the "
                              f"generated kernel (kernels.backend 'auto' or 'triton' with triton "
                              f"installed); move the table to {ids.device} instead")
        rows = reference(ids, slot_map, slots, table)
        return rows if out is None else out.copy_(rows)
    if table.device != ids.device and not (ids.is_cuda and table.is_pinned()):
        raise KernelError(f"the table is on {table.device} and not pinned, so {ids.device} cannot "
                          f"read it; pin it (table.pin_memory()) or move it to {ids.device}")
    row_shape = tuple(table.shape[1:])
    width = 1
    for s in row_shape:
        width *= s
    n = ids.numel()
    if out is None:
        out = kernels.empty((n,) + row_shape, table.dtype, ids.device)
    if n == 0 or width == 0:
        return out
    block_d = min(next_power_of_2(width), MAX_BLOCK_D)
    block_r = max(1, ROWS_TILE // block_d)
    cfg = KernelConfig(block_m=block_r, block_d=block_d, num_warps=4, num_stages=1)
    kernel = kernels.fixed("cached_rows", ids.device, cfg, D=width, block_r=block_r, block_d=block_d)
    kernel.launch((-(-n // block_r), 1), ids, slot_map, slots, table, out, n)
    return out
