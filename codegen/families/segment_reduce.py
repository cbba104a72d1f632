"""Deterministic scatter of per-slot gradients into table rows, as a segmented reduction.

The backward of the neighbor families (``temporal_attention``, ``masked_aggregate``) with
indexed inputs sums each slot's gradient into its table row. With
``config.kernels.backward_mode = "deterministic"`` they write per-slot coefficients and call
:func:`segment_reduce`, which sums every table row's slots in sorted order within one program
(``segment_reduce.py.jinja``); no operator of its own, so no reference: the callers' references
are the oracle.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from fastopt.codegen import kernels
from fastopt.codegen.layout import valid_slots
from fastopt.codegen.library import eager_kernels
from fastopt.config import default_config
from fastopt.errors import KernelError

__all__ = ["Segments", "gather_rows", "row_sums", "segment_reduce", "slot_segments"]


class Segments:
    """Slots grouped by table row (sorted permutation + CSR offsets), shared by k and v.

    One stable sort of the flattened index and a ``searchsorted`` of the row ids into the sorted
    keys give the inverse index as CSR, all on the device and without a host synchronization
    (``bincount`` on CUDA would read its maximum back to size the result). Keys are as narrow as
    the table allows, since the radix sort makes one pass per key byte: int16 up to 65,536 rows
    (shifted by -32,768 above 32,768, which keeps the order), int32 below 2**31, int64 beyond.

    Slots outside ``valid`` (``[M, K]`` bool, the index's shape: the padded slots of a neighbor
    layout, whose coefficients are zero) sort past the last row, outside every segment. So do,
    with ``apart``, that row's slots (its segment is empty; the caller sums it apart). A row
    thousands of slots share (the padding row or the first edge that every padded slot names)
    would otherwise hold its program, and the tile of rows beside it, for its whole length.
    """

    def __init__(self, apart: Optional[int] = None, valid: Optional[Tensor] = None):
        self._cache = {}
        self.apart = apart
        self.valid = valid

    def of(self, index: Tensor, table_rows: int) -> Tuple[Tensor, Tensor]:
        key = (index.data_ptr(), tuple(index.shape), table_rows)
        if key not in self._cache:
            key_dtype, shift = _sort_keys(table_rows + 1)  # row ids and the one past them
            flat = index.reshape(-1)
            if self.apart is not None:
                flat = torch.where(flat == self.apart, table_rows, flat)
            if self.valid is not None:
                flat = torch.where(self.valid.reshape(-1), flat, table_rows)
            keys = (flat - shift if shift else flat).to(key_dtype)
            sorted_keys, perm = torch.sort(keys, stable=True)
            segptr = torch.empty(table_rows + 1, dtype=torch.int64, device=index.device)
            segptr[:1].zero_()
            # segptr[u + 1] = number of slots whose row is <= u
            torch.searchsorted(sorted_keys, _row_ids(table_rows, index.device, key_dtype, shift),
                               right=True, out=segptr[1:])
            self._cache[key] = (perm, segptr)
        return self._cache[key]


def slot_segments(mask: Optional[Tensor], indptr: Optional[Tensor], rows: int, slots: int,
                  device: torch.device) -> Segments:
    """:class:`Segments` of a neighbor layout's slots that leave its padded slots (zero
    coefficients, all naming one row) out of every sum."""
    return Segments(valid=None if mask is None and indptr is None else
                    valid_slots(mask, indptr, rows, slots, device))


def _sort_keys(table_rows: int) -> Tuple[torch.dtype, int]:
    """Narrowest sort-key dtype for row ids ``0 .. table_rows - 1`` and the shift that fits them."""
    if table_rows <= 1 << 15:
        return torch.int16, 0
    if table_rows <= 1 << 16:
        return torch.int16, 1 << 15
    return (torch.int32, 0) if table_rows < 2**31 else (torch.int64, 0)


# row ids - shift, per (device, dtype, shift), grown on demand: one arange launch saved per backward.
# Every size ever handed out stays alive: a captured CUDA graph keeps reading the one it was given.
_ROW_IDS: Dict[tuple, List[Tensor]] = {}


def _row_ids(count: int, device: torch.device, dtype: torch.dtype, shift: int = 0) -> Tensor:
    sizes = _ROW_IDS.setdefault((device, dtype, shift), [])
    if not sizes or sizes[-1].numel() < count:
        limit = torch.iinfo(dtype).max + shift + 1
        size = min(limit, max(count, 2 * sizes[-1].numel())) if sizes else count
        sizes.append((torch.arange(size, device=device, dtype=torch.int64) - shift).to(dtype))
    return sizes[-1][:count]


def segment_reduce(terms: Sequence[Tuple[Tensor, Tensor]], index: Tensor, table_rows: int,
                   dtype: torch.dtype, segments: Optional[Segments] = None, *,
                   op: str = "") -> Tuple[Tensor, ...]:
    """``out[u] = sum over slots (m, j) with index[m, j] == u of coef[m, :, j] * x[m]``.

    Deterministic: each table row sums its slots in sorted order within one program. One or two
    ``(coef, x)`` terms share the index, its sort and one launch.

    Args:
        terms: ``(coef [M, H, K], x [M, H, d])`` pairs: per-slot, per-head coefficients and the
            row vectors they scale.
        index: Table rows ``[M, K]``.
        table_rows: U.
        dtype: Result dtype.
        segments: Sorted slots to reuse across calls with the same index.
        op: The fused operator whose backward this is: its ``config.kernels.op_overrides``
            entries at ``(K, H, d)`` set the mapping (``""``: none).

    Returns:
        One ``[U, H, d]`` table per term.
    """
    if len(terms) not in (1, 2):
        raise KernelError(f"segment_reduce takes 1 or 2 (coef, x) terms (got {len(terms)}); "
                          f"call it once per pair of terms")
    rows, heads, dim = terms[0][1].shape
    slots = index.shape[1]
    perm, segptr = (segments or Segments()).of(index, table_rows)
    kernel = kernels.specialize("segment_reduce", index.device, (slots, heads, dim), row_tiles=True,
                                op=op, K=slots, H=heads, D=dim, dtype=kernels.TL_DTYPES[dtype],
                                acc=kernels.TL_DTYPES[terms[0][0].dtype], pair=len(terms) == 2)
    outs = tuple(kernels.empty((table_rows, heads, dim), dtype, index.device) for _ in terms)
    args = [a for (coef, x), out in zip(terms, outs) for a in (coef, x, out)]
    kernel.launch(kernel.cfg.tile_grid(table_rows, heads), *args, perm, segptr, table_rows)
    return outs


def row_sums(values: Tensor, index: Tensor, table_rows: int, *, apart: int = 0) -> Tensor:
    """``out[u] = values[index == u].sum(0)`` for ``values [S, d]`` and ``index [S]`` of rows
    ``0 .. table_rows - 1``: the gradient of a gather ``table[index]``, deterministic (each row
    sums its slots in sorted order, no atomics).

    Row ``apart`` is summed by a matrix-vector product over all slots instead of in the segmented
    kernel (see :class:`Segments`): the loader puts the padding row, which every padded slot reads,
    first. Any row may be given; the result is the same.

    Returns:
        ``[table_rows, d]`` in ``values``' dtype.
    """
    if values.dim() != 2 or index.dim() != 1 or index.shape[0] != values.shape[0]:
        raise KernelError(f"row_sums needs values [S, d] and index [S]; got values "
                          f"{tuple(values.shape)} and index {tuple(index.shape)}")
    if not 0 <= apart < table_rows:
        raise KernelError(f"row_sums: apart={apart} is not a row of a table of {table_rows} rows; "
                          f"pass a row id in [0, {table_rows})")
    slots, dim = values.shape
    if not eager_kernels(values, index):  # the reference: the same sums, in torch's order
        return values.new_zeros(table_rows, dim).index_add_(0, index, values)
    values = values.contiguous()
    ones = torch.ones(slots, 1, 1, dtype=values.dtype, device=values.device)
    (out,) = segment_reduce(((ones, values.view(slots, 1, dim)),), index.view(slots, 1), table_rows,
                            values.dtype, Segments(apart=apart))
    out = out.view(table_rows, dim)
    torch.mv(values.t(), (index == apart).to(values.dtype), out=out[apart])
    return out


class _GatherRows(torch.autograd.Function):
    """``table.index_select(0, index)``; the gradient into ``table`` by :func:`row_sums`."""

    @staticmethod
    def forward(ctx, table: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.table_shape = table.shape
        return table.index_select(0, index)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        shape = ctx.table_shape
        sums = row_sums(grad.reshape(index.numel(), -1), index, shape[0], apart=0)
        return sums.view(shape), None


def gather_rows(table: Tensor, index: Tensor) -> Tensor:
    """``table.index_select(0, index)`` (rows of ``table [N, ...]`` by ``index [S]``) whose
    gradient into ``table`` follows ``config.kernels.backward_mode``: ``"deterministic"`` sums
    each row's slots in sorted order (:func:`row_sums`: the segmented kernel where the generated
    kernels run, row 0, where padding slots point, by one product), ``"atomic"`` is
    ``index_select``'s own backward (an ``index_add`` by atomics on CUDA, whose sums' order
    changes from run to run). ``table[index]``'s backward is deterministic too, but sorts the
    whole rows: several times slower on a PyG layer's gathers."""
    if (default_config().kernels.backward_mode == "atomic" or not table.requires_grad
            or not torch.is_grad_enabled() or table.shape[0] == 0 or index.numel() == 0):
        return table.index_select(0, index)
    return _GatherRows.apply(table, index)
