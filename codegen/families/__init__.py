"""The kernel families of :mod:`fastopt.codegen`, one place each.

A family is its template ``<family>.py.jinja`` and, beside it, the module ``<family>.py`` (a
package ``<family>/`` once it outgrows one file) that holds everything else about it: argument
checks, the plain-PyTorch reference, the launchers, and the operator registered by
:func:`fastopt.codegen.library.fused_op` with its public function. ``time_encode`` is the
smallest complete example (``codegen/README.md`` walks through adding one).

- ``temporal_attention``: gather, score, edge softmax and weighted sum, with an optional feature
  block shared by all heads (``shared_attention``);
- ``masked_aggregate``: sum or mean of each destination's valid neighbor rows;
- ``time_encode``: ``cos(dt w + b)``;
- ``segment_reduce``: the deterministic scatter of per-slot gradients into table rows (the
  backward of the two neighbor families; no operator of its own), and ``row_sums``, the gradient
  of a gather ``table[index]`` (the weight gradient of projected unique rows);
- ``matmul``: the projections' products (:func:`~fastopt.codegen.families.matmul.linear`);
- ``column_sum``: deterministic column sums (bias gradients);
- ``cached_rows``: rows of a table by id through a device cache, the uncached ones read from
  pinned host memory by the GPU (SlimCache's zero-copy reads; no operator, not differentiable).
- ``degree_stats``: the largest in-degree of an edge list and its indices' ranges in one pass
  (the slot count that ``edge_slot_count`` reads back; no operator, not differentiable).

Nothing is re-exported here: ``fastopt.codegen`` is the public surface.
"""
