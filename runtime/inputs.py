"""``GraphInputs``: what the runtime hands a model for one batch of roots (the runtime<->model contract).

The loader (:mod:`fastopt.runtime.loader`) builds it on the model's device. Node sets are
``S_0`` (the roots: the batch's sources, destinations, negatives and any evaluation negatives, in
that order) and ``S_{i+1}`` (the neighbors sampled in layer ``i``, flattened). Per layer there
are Δt, a mask and the edges' features; per set the nodes' features.

Besides the per-slot tensors every model can read, the inputs carry the batch's **unique nodes**:
``unique_nodes`` (sorted ids, padded at the end with node 0 up to a bucketed length so that a
captured CUDA graph sees few distinct shapes) and ``node_inverse`` (for every entry of
``torch.cat(nodes)``, its row in ``unique_nodes``). A model that computes something per node
(TGN's memory update) does it once per unique node and reads it back by index.

A model that declares ``reads_edge_rows = True`` receives the edges' features the same way:
``edge_rows`` (the batch's unique edges' rows, padded like the unique nodes) and per layer
``edge_index[i]`` (``[M_i, k_i]`` rows of ``edge_rows``), with ``edge_feat`` left empty; a
projection of edge features then runs once per unique edge (``fastopt.optimize`` projects before
it gathers), not once per sampled slot.

Layering: imports nothing of fastopt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

__all__ = ["GraphInputs", "bucket"]


@dataclass
class GraphInputs:
    """Sampled neighborhoods of a batch of roots, gathered and on the model's device.

    ``nodes[0]``/``times[0]`` are the roots; ``nodes[i + 1]`` are the neighbors sampled in layer
    ``i`` (flattened ``[len(nodes[i]) * k_i]``). Layer ``i`` also has ``dt[i]``, ``mask[i]`` and
    ``edge_feat[i]`` (``[len(nodes[i]), k_i, d_edge]``). ``node_feat[i]`` holds the features of
    ``nodes[i]`` (zero width when the graph has none). ``unique_nodes`` / ``node_inverse``
    (optional) compress ``torch.cat(nodes)``: ``cat(nodes) == unique_nodes[node_inverse]``.
    For models that read edge rows, ``edge_feat`` is empty and ``edge_rows[edge_index[i]]`` is
    layer ``i``'s ``[M_i, k_i, d_edge]`` features.
    """

    nodes: List[torch.Tensor]
    times: List[torch.Tensor]
    node_feat: List[torch.Tensor]
    edge_feat: List[torch.Tensor]
    dt: List[torch.Tensor]
    mask: List[torch.Tensor]
    unique_nodes: Optional[torch.Tensor] = None
    node_inverse: Optional[torch.Tensor] = None
    edge_rows: Optional[torch.Tensor] = None
    edge_index: Optional[List[torch.Tensor]] = None

    @property
    def num_roots(self) -> int:
        return int(self.nodes[0].shape[0])

    def layer_edges(self, i: int):
        """``(rows, index)`` with ``rows[index]`` layer ``i``'s ``[M_i, k_i, d_edge]`` edge
        features: ``edge_rows`` and ``edge_index[i]`` where the loader sent rows, else the
        per-slot features as rows (the index then counts them in order)."""
        if self.edge_rows is not None:
            return self.edge_rows, self.edge_index[i]
        feat = self.edge_feat[i]
        index = torch.arange(feat.shape[0] * feat.shape[1], device=feat.device).view(feat.shape[:2])
        return feat.reshape(-1, feat.shape[-1]), index


def bucket(n: int, minimum: int = 256) -> int:
    """``n`` rounded up to the next of ``{4, 5, 6, 7} * 2^j`` (at least ``minimum``).

    Data-dependent lengths (a batch's unique nodes) padded to these sizes take a handful of
    distinct values per epoch, each at most 25 % above the length it holds.
    """
    n = max(int(n), int(minimum))
    step = 1 << max(0, n.bit_length() - 3)  # a quarter of the power of two below n, at least 1
    return -(-n // step) * step
