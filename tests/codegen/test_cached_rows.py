"""Rows through a device cache (``codegen.cached_rows``): the generated kernel against the table
itself, bit for bit, and a table in pinned host memory read by the GPU directly."""

from __future__ import annotations

import pytest
import torch

import fastopt.codegen as cg
from fastopt.errors import KernelError

pytestmark = pytest.mark.usefixtures("triton_backend")


def _cache(table: torch.Tensor, cached: torch.Tensor, device):
    """A slot map and slots holding ``cached`` rows of ``table`` in shuffled slots."""
    g = torch.Generator().manual_seed(1)
    slots_of = torch.randperm(cached.numel(), generator=g)
    slot_map = torch.full((table.shape[0],), -1, dtype=torch.int32)
    slot_map[cached] = slots_of.int()
    slots = torch.empty((cached.numel(),) + tuple(table.shape[1:]), dtype=table.dtype)
    slots[slots_of] = table[cached]
    return slot_map.to(device), slots.to(device)


@pytest.mark.parametrize("rows, width, dtype", [(50, 172, torch.float32), (40, 7, torch.float32),
                                                (30, 300, torch.bfloat16), (10, 1, torch.float32)])
def test_cached_rows_equal_the_table_bit_for_bit(rows, width, dtype, device):
    """Hits and misses mixed, repeated ids, every width class (one column block, a partial one,
    two blocks past 256, one column), signed zeros and NaNs kept as they are."""
    g = torch.Generator().manual_seed(rows + width)
    table = torch.randn(rows, width, generator=g).to(dtype)
    table[3, 0], table[4, 0] = -0.0, float("nan")
    cached = torch.randperm(rows, generator=g)[: rows // 3]
    slot_map, slots = _cache(table, cached, device)
    ids = torch.randint(0, rows, (257,), generator=g)
    ids[:3] = torch.tensor([3, 4, cached[0]])
    got = cg.cached_rows(ids.to(device), slot_map, slots, table.to(device))
    want = table[ids]
    assert got.dtype == dtype and got.shape == (257, width)
    assert torch.equal(got.cpu().view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_programs_that_loop_over_several_row_tiles_read_every_row(device, monkeypatch):
    """Fewer programs than row tiles (as on a GPU for a large batch): each takes every third
    tile, the last one partial, and every row is read once."""
    from fastopt.codegen.families import cached_rows as module

    monkeypatch.setattr(module, "MAX_PROGRAMS", 3)
    table = torch.randn(100, 172)
    slot_map, slots = _cache(table, torch.arange(0, 100, 3), device)
    ids = torch.randint(0, 100, (16 * 7 + 5,), generator=torch.Generator().manual_seed(0))  # 8 tiles of 16 rows
    assert torch.equal(cg.cached_rows(ids.to(device), slot_map, slots, table.to(device)).cpu(), table[ids])


def test_cached_rows_into_out_and_empty(device):
    table = torch.arange(12.0).reshape(6, 2)
    slot_map, slots = _cache(table, torch.tensor([1, 4]), device)
    out = torch.full((3, 2), -1.0, device=device)
    assert cg.cached_rows(torch.tensor([4, 0, 5], device=device), slot_map, slots, table.to(device), out) is out
    assert torch.equal(out.cpu(), table[[4, 0, 5]])
    assert cg.cached_rows(torch.zeros(0, dtype=torch.long, device=device), slot_map, slots,
                          table.to(device)).shape == (0, 2)


def test_a_bound_reader_reads_what_cached_rows_reads(device):
    """``cached_rows.bind`` checks the cache once; its reader gives the same rows (into ``out``
    too) and still names bad ids; slots written after binding are read."""
    table = torch.randn(40, 9)
    slot_map, slots = _cache(table, torch.tensor([2, 5, 30]), device)
    read = cg.cached_rows.bind(slot_map, slots, table.to(device))
    ids = torch.tensor([30, 0, 5, 5, 39, 2], device=device)
    assert torch.equal(read(ids).cpu(), cg.cached_rows(ids, slot_map, slots, table.to(device)).cpu())
    slots[int(slot_map[30])] = 7.0  # a slot the cache refilled
    out = torch.empty(6, 9, device=device)
    assert read(ids, out) is out and (out[0] == 7.0).all() and torch.equal(out[1:].cpu(), table[ids[1:].cpu()])
    with pytest.raises(KernelError, match="1-d int32/int64"):
        read(ids.reshape(2, 3))
    with pytest.raises(KernelError, match=r"out must be \(6, 9\)"):
        read(ids, torch.empty(8, 9, device=device)[:2])
    with pytest.raises(KernelError, match="do not match table rows"):
        cg.cached_rows.bind(slot_map, slots.double(), table.to(device))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cached_rows_read_a_pinned_host_table_from_the_gpu():
    table = torch.randn(1000, 172).pin_memory()
    slot_map, slots = _cache(table, torch.arange(0, 1000, 7), "cuda")
    ids = torch.randint(0, 1000, (5000,), device="cuda")
    assert torch.equal(cg.cached_rows(ids, slot_map, slots, table).cpu(), table[ids.cpu()])
    read = cg.cached_rows.bind(slot_map, slots, table)
    assert torch.equal(read(ids).cpu(), table[ids.cpu()])


def test_cached_rows_name_what_does_not_fit():
    table = torch.zeros(5, 3)
    slot_map, slots = _cache(table, torch.tensor([1]), "cpu")
    with pytest.raises(KernelError, match="1-d int32/int64"):
        cg.cached_rows(torch.zeros(2, 2, dtype=torch.long), slot_map, slots, table)
    with pytest.raises(KernelError, match="one entry per table row"):
        cg.cached_rows(torch.zeros(2, dtype=torch.long), slot_map[:3], slots, table)
    with pytest.raises(KernelError, match="do not match table rows"):
        cg.cached_rows(torch.zeros(2, dtype=torch.long), slot_map, slots.double(), table)
    wide = torch.zeros(5, 6)
    with pytest.raises(KernelError, match=r"table \(5, 3\) has strides \(6, 1\).*contiguous"):
        cg.cached_rows(torch.zeros(2, dtype=torch.long), slot_map, slots, wide[:, :3])
    with pytest.raises(KernelError, match="out .* has strides"):
        cg.cached_rows(torch.zeros(2, dtype=torch.long), slot_map, slots, table, torch.zeros(3, 2).t())
