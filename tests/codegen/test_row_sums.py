"""Per-row sums of gathered slots (``codegen.row_sums``, the gradient of ``table[index]``) and the
projection of unique rows whose weight gradient they form, against float64 and the slot product."""

from __future__ import annotations

import pytest
import torch

import fastopt.codegen as cg
import fastopt.config as fconfig
from codegen_inputs import rel_error
from fastopt.errors import KernelError

pytestmark = pytest.mark.usefixtures("triton_backend")


def _slots(rows: int, slots: int, seed: int, padded: int = 0) -> torch.Tensor:
    """Slot -> row ids with repeats and rows nobody reads; ``padded`` slots all on row 0 (the
    loader's padding row), spread through the slots."""
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(1, rows, (slots,), generator=g) if rows > 1 else torch.zeros(slots, dtype=torch.long)
    if padded:
        index[torch.randperm(slots, generator=g)[:padded]] = 0
    return index


@pytest.mark.parametrize("rows, slots, dim, padded, apart", [
    (1, 5, 3, 0, 0), (9, 40, 7, 0, 0), (300, 2000, 200, 900, 0), (300, 2000, 33, 0, 17),
    (40000, 3000, 8, 100, 0)])  # int32 sort keys past 32,767 rows
def test_row_sums_match_float64_and_repeat_bit_for_bit(rows, slots, dim, padded, apart, device):
    index = _slots(rows, slots, seed=rows + slots, padded=padded).to(device)
    values = torch.randn(slots, dim, generator=torch.Generator().manual_seed(dim)).to(device)
    got = cg.row_sums(values, index, rows, apart=apart)
    want = torch.zeros(rows, dim, dtype=torch.float64).index_add_(0, index.cpu(), values.double().cpu())
    assert got.shape == (rows, dim) and got.dtype == values.dtype
    assert rel_error(got.cpu(), want) < 1e-6
    read = torch.zeros(rows, dtype=torch.bool)
    read[index.cpu()] = True
    assert torch.equal(got.cpu()[~read], torch.zeros(int((~read).sum()), dim))  # written, not left as is
    assert torch.equal(cg.row_sums(values, index, rows, apart=apart), got), "the order of the sums must not vary"


def test_row_sums_names_bad_arguments():
    with pytest.raises(KernelError, match=r"values \[S, d\] and index \[S\]"):
        cg.row_sums(torch.zeros(4, 2), torch.zeros(3, dtype=torch.long), 5)
    with pytest.raises(KernelError, match=r"apart=5 is not a row of a table of 5 rows"):
        cg.row_sums(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long), 5, apart=5)


def test_projected_rows_weight_gradient_is_the_slot_product(device):
    """The rewritten projection of unique rows gathered per slot (``F.linear(rows[index], w, b)``
    as ``F.linear(rows, w, b)[index]``) sums its weight gradient per row on the kernel backend:
    the same gradient as the product over the slots, within float32 rounding."""
    from fastopt.passes.split_linear_lowering import _ProjectedRows

    g = torch.Generator().manual_seed(3)
    rows = torch.randn(120, 17, generator=g).to(device)
    index = _slots(120, 1500, seed=4, padded=500).to(device)
    w = torch.randn(24, 17, generator=g).to(device).requires_grad_()
    b = torch.randn(24, generator=g).to(device).requires_grad_()
    grad = torch.randn(1500, 24, generator=g).to(device)
    out = _ProjectedRows.apply(rows, index, w, b)
    gw, gb = torch.autograd.grad(out, [w, b], grad)
    want_w = grad.double().t() @ rows.double()[index]
    assert rel_error(out, torch.nn.functional.linear(rows[index], w, b)) < 1e-6
    assert rel_error(gw, want_w) < 1e-6 and rel_error(gb, grad.double().sum(0)) < 1e-6
    with fconfig.patch(kernels__backend="reference"):  # the slot product (the CPU's path)
        ref_w, _ = torch.autograd.grad(_ProjectedRows.apply(rows, index, w, b), [w, b], grad)
    assert rel_error(ref_w, want_w) < 1e-6


@pytest.mark.parametrize("mode", ["deterministic", "atomic"])
def test_gather_rows_gradient_follows_the_backward_mode(mode, device):
    """``gather_rows`` is ``index_select`` forward; its gradient into a 3-d table is the float64
    per-row sum either way: by ``row_sums`` (repeatable bit for bit) when deterministic, by
    ``index_select``'s own backward when atomic. Without a gradient to take it is a plain gather."""
    g = torch.Generator().manual_seed(5)
    table = torch.randn(50, 2, 3, generator=g).to(device).requires_grad_()
    index = _slots(50, 700, seed=6, padded=200).to(device)
    grad = torch.randn(700, 2, 3, generator=g).to(device)
    with fconfig.patch(kernels__backward_mode=mode):
        out = cg.gather_rows(table, index)
        (got,) = torch.autograd.grad(out, [table], grad)
        (again,) = torch.autograd.grad(cg.gather_rows(table, index), [table], grad)
        assert (out.grad_fn.name() == "IndexSelectBackward0") == (mode == "atomic")
        assert cg.gather_rows(table.detach(), index).grad_fn is None
    assert torch.equal(out, table.index_select(0, index))
    want = torch.zeros(50, 6, dtype=torch.float64).index_add_(0, index.cpu(), grad.double().reshape(700, 6).cpu())
    assert got.shape == table.shape and rel_error(got.cpu().reshape(50, 6), want) < 1e-6
    if mode == "deterministic":
        assert torch.equal(got, again)


@pytest.mark.parametrize("rows", [3, 1 << 15])  # int16 keys, and the row count whose one-past id needs a shift
def test_segments_leave_slots_outside_valid_out_of_every_row(rows):
    from fastopt.codegen.families.segment_reduce import Segments

    # flattened slots 0..5; slots 2, 4 and 5 are padding that names row 0 (or the last row)
    index = torch.tensor([[0, 2, 0], [1, 0, rows - 1]])
    valid = torch.tensor([[True, True, False], [True, False, False]])
    perm, segptr = Segments(valid=valid).of(index, rows)
    counts = (segptr[1:] - segptr[:-1]).tolist()
    assert counts[:3] == [1, 1, 1] and sum(counts) == 3  # the last row gets no padded slot
    assert perm[:3].tolist() == [0, 3, 1]  # rows 0, 1, 2 in order; padding sorted past them
    _, every = Segments().of(index, rows)
    assert int(every[-1]) == 6  # without valid, every slot is in a row
