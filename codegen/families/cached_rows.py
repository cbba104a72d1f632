"""Rows of a table by id through a device cache: ``table[ids]`` with each row read from the
cache's slots where it has one and from the table itself where it has none.

The table may live in pinned host memory: the generated kernel (``cached_rows.py.jinja``) reads
the rows the cache lacks straight from it over the bus, so serving a batch of ids is one launch
with no host work and no host synchronization (SlimCache's zero-copy reads). Not differentiable
and not a custom op: feature tables are inputs, not parameters. The reference runs where the
kernel does not (CPU tensors with the ``auto`` backend, ``backend = "reference"``).
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from fastopt.codegen import kernels
from fastopt.codegen.kernel_config import KernelConfig, next_power_of_2
from fastopt.codegen.library import select_backend
from fastopt.errors import KernelError

__all__ = ["cached_rows", "bind", "reference"]

# Elements of one program's [block_r, block_d] tile: enough rows in flight per program to hide the
# latency of reads that cross the bus.
ROWS_TILE = 4096
# Widest column block; wider rows take several in turn.
MAX_BLOCK_D = 256
# Most programs a read launches, each looping over row tiles: reads that wait on the bus for
# microseconds then occupy at most this many of the GPU's multiprocessors (132 on an H200)
# beside the training step's kernels, and still keep enough rows in flight to fill the bus
# (64 x 16 rows x 172 floats: 700 KB, against about 130 KB that PCIe 5 needs at 2 us).
MAX_PROGRAMS = 64


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

    ``cached_rows.bind(slot_map, slots, table)`` (:func:`bind`) returns ``read(ids, out=None)``
    for one cache, its tensors checked once.

    Raises:
        KernelError: shapes or dtypes that do not fit together, or a host table with no kernel to
            read it (triton missing, or ``kernels.backend = "reference"``).
    """
    _check(ids, slot_map, slots, table, out)
    return _read(ids, slot_map, slots, table, out, pinned=None)


def bind(slot_map: Tensor, slots: Tensor, table: Tensor):
    """:func:`cached_rows` over one cache, checked once: ``read(ids, out=None)`` then checks only
    the ids (SlimCache's zero-copy reads call it for every batch, on a staging thread)."""
    ids0 = torch.zeros(0, dtype=torch.int64, device=slot_map.device)
    _check(ids0, slot_map, slots, table, None)
    pinned = table.is_pinned() if table.device != slot_map.device else False  # asked once (a driver call)

    def read(ids: Tensor, out: Optional[Tensor] = None) -> Tensor:
        if out is not None or ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or \
                ids.device != slot_map.device:
            _check(ids, slot_map, slots, table, out)  # raises, naming what is wrong
        return _read(ids, slot_map, slots, table, out, pinned)

    return read


cached_rows.bind = bind


def _read(ids: Tensor, slot_map: Tensor, slots: Tensor, table: Tensor, out: Optional[Tensor],
          pinned: Optional[bool]) -> Tensor:
    """:func:`cached_rows` once checked (``pinned``: whether the table is, None to ask)."""
    if select_backend(ids) != "triton":
        if table.device != ids.device:
            raise KernelError(f"a table on {table.device} read by ids on {ids.device} needs the "
                              f"generated kernel (kernels.backend 'auto' or 'triton' with triton "
                              f"installed); move the table to {ids.device} instead")
        rows = reference(ids, slot_map, slots, table)
        return rows if out is None else out.copy_(rows)
    if table.device != ids.device and not (ids.is_cuda and (table.is_pinned() if pinned is None else pinned)):
        raise KernelError(f"the table is on {table.device} and not pinned, so {ids.device} cannot "
                          f"read it; pin it (table.pin_memory()) or move it to {ids.device}")
    row_shape = tuple(table.shape[1:])
    n = ids.numel()
    if out is None:
        out = kernels.empty((n,) + row_shape, table.dtype, ids.device)
    width = math.prod(row_shape)
    if n == 0 or width == 0:
        return out
    cfg, block_r, block_d = _mapping(width)
    kernel = kernels.fixed("cached_rows", ids.device, cfg, D=width, block_r=block_r, block_d=block_d)
    kernel.launch((min(-(-n // block_r), MAX_PROGRAMS), 1), ids, slot_map, slots, table, out, n)
    return out


@functools.lru_cache(maxsize=None)
def _mapping(width: int) -> Tuple[KernelConfig, int, int]:
    """The thread mapping for rows of ``width`` elements: (config, rows a tile, columns a block)."""
    block_d = min(next_power_of_2(width), MAX_BLOCK_D)
    block_r = max(1, ROWS_TILE // block_d)
    return KernelConfig(block_m=block_r, block_d=block_d, num_warps=4, num_stages=1), block_r, block_d
