"""fastopt.codegen: fused temporal-attention / aggregation operators and their generated kernels.

Public surface (stable signatures; the fx passes rewrite onto these):

- :func:`temporal_attention` ``(q, k, v, mask=None, indptr=None, *, k_index=None, v_index=None,
  scale=None, dropout_p=0.0, seed=0)``; ``seed`` may be a device tensor (:func:`dropout_seed`)
- :func:`shared_attention` ``(q, k, v, sq, se, mask=None, indptr=None, *, k_index=None,
  v_index=None, scale=None, dropout_p=0.0, seed=0)`` -> ``(out, shared_out)``: keys and values
  carry a feature block ``se [M, K, S]`` shared by all heads (a factored time encoding)
- :func:`edge_attention` ``(q, k, v, dst, *, k_index=None, v_index=None, scale=None,
  dropout_p=0.0, seed=0, slots=None)`` and :func:`edge_softmax_aggregate` ``(scores, v, dst,
  num_dst, *, v_index=None, dropout_p=0.0, seed=0)``: attention over an edge list (PyG layers),
  run by the temporal-attention kernels over the destination-sorted edges;
  :func:`edge_slot_count` ``(dst, num_dst, ranged=())`` reads the slot count ahead, so that a call
  with ``slots`` reads nothing back (a CUDA graph can capture it); ``slots="edges"`` needs no
  count: each destination's loop runs over its sorted edges (keys and values per edge)
- :func:`masked_aggregate` ``(x, mask=None, indptr=None, *, index=None, reduce="mean")``
- :func:`time_encode` ``(dt, w, b)``
- :func:`linear` ``(x, w, bias=None, residual=None, *, bias_grad="torch")``: projections, by
  generated matmuls when ``config.kernels.matmul_precision`` asks for them; the bias gradient by
  :func:`column_sum` with ``bias_grad="column_sum"``
- :func:`column_sum` ``(x)``: ``x.sum(0)`` of a matrix, deterministic, by a generated kernel
- :func:`cached_rows` ``(ids, slot_map, slots, table, out=None)``: ``table[ids]`` through a device
  cache, the rows it lacks read straight from a pinned host table (SlimCache's zero-copy reads)
- :func:`row_sums` ``(values, index, table_rows, *, apart=0)``: the gradient of a gather
  ``table[index]`` (per-row sums of the slots' rows), deterministic, by the segmented kernel
- :func:`gather_rows` ``(table, index)``: ``table.index_select(0, index)`` whose gradient follows
  ``config.kernels.backward_mode`` (deterministic: :func:`row_sums`)
- :func:`attention_mapping` ``(slots, heads, dim)``: the attention kernels' thread mapping for
  that shape, in words (for reports)
- :func:`select_backend` ``(t)``: ``"triton"`` or ``"reference"`` for inputs where ``t`` is

Each of the first four is a ``torch.library`` custom op (``torch.ops.fastopt.*``) with autograd and
a fake implementation, registered by :func:`fastopt.codegen.library.fused_op`;
:mod:`fastopt.codegen.reference` holds the plain-PyTorch reference of each, which is the CPU path
and the test oracle.

Layout: ``families/`` (one place per kernel family: template, checks, reference, launchers,
operator), ``library.py`` (the registration helper, backend choice), ``kernels.py`` (rendering,
specialization, launch), ``checks.py`` and ``layout.py`` (what the families share),
``kernel_config.py`` (thread mapping), ``cache.py`` (content-addressed kernel cache),
``reference.py`` (the references in one namespace). ``README.md`` shows how to add a family.

Layering: imports nothing of fastopt but :mod:`fastopt.config` and :mod:`fastopt.errors`.
"""

from fastopt.codegen import reference
from fastopt.codegen.families.cached_rows import cached_rows
from fastopt.codegen.families.column_sum import column_sum
from fastopt.codegen.families.masked_aggregate import masked_aggregate
from fastopt.codegen.families.edge_attention import edge_attention, edge_softmax_aggregate
from fastopt.codegen.families.edge_attention import slot_count as edge_slot_count
from fastopt.codegen.families.matmul import linear
from fastopt.codegen.families.segment_reduce import gather_rows, row_sums
from fastopt.codegen.families.temporal_attention import (dropout_seed, shared_attention,
                                                         temporal_attention)
from fastopt.codegen.families.time_encode import time_encode
from fastopt.codegen.kernel_config import attention_mapping
from fastopt.codegen.library import select_backend

__all__ = [
    "temporal_attention",
    "dropout_seed",
    "shared_attention",
    "edge_attention",
    "edge_softmax_aggregate",
    "edge_slot_count",
    "masked_aggregate",
    "time_encode",
    "linear",
    "column_sum",
    "cached_rows",
    "row_sums",
    "gather_rows",
    "attention_mapping",
    "select_backend",
    "reference",
]
