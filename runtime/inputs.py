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

A model of two or more layers that declares ``reads_nbr_index = True`` may receive merged node
sets (``sampler.hop_dedup``, :func:`~fastopt.runtime.blocks.merge_repeats`): ``nbr_index[i]``
(``[M_i, k_i]``) selects each slot of layer ``i`` among the rows of ``nodes[i + 1]``, which then
holds each distinct ``(neighbor, edge)`` of layer ``i`` once (padded on CUDA) instead of one row
per slot; ``nbr_index`` has one entry per merged layer (all but the last) and is None otherwise.

Layering: imports nothing of fastopt but :mod:`fastopt.errors`.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from fastopt.errors import CacheError

__all__ = ["GraphInputs", "HighWater", "bucket", "per_slot"]


@dataclass
class GraphInputs:
    """Sampled neighborhoods of a batch of roots, gathered and on the model's device.

    ``nodes[0]``/``times[0]`` are the roots; ``nodes[i + 1]`` are the neighbors sampled in layer
    ``i`` (flattened ``[len(nodes[i]) * k_i]``, or their distinct rows read through
    ``nbr_index[i]`` where the layer's repeats were merged). Layer ``i`` also has ``dt[i]``, ``mask[i]`` and
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
    nbr_index: Optional[List[torch.Tensor]] = None
    # edge features still being read on another stream: makes the current stream wait (edges_ready)
    edges_pending: Optional[Callable[[], None]] = field(default=None, repr=False, compare=False)

    def edges_ready(self) -> None:
        """Make the current stream wait for edge features (and the events' rows) still being read
        on another stream (:meth:`~fastopt.runtime.batch.RowReads.apply` with ``side``); a model that
        sets ``waits_for_edges`` calls it before it first takes them. A no-op otherwise."""
        pending, self.edges_pending = self.edges_pending, None
        if pending is not None:
            pending()

    def layer_neighbors(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """``[M_i, k_i, d]`` rows of ``h`` (one per row of ``nodes[i + 1]``) for layer ``i``'s slots."""
        if self.nbr_index is not None and i < len(self.nbr_index):
            # index_select, not h[index]: its backward adds into the rows (index_add_), where
            # advanced indexing's sorts the slots first (1.6 ms a TGAT batch on an H200)
            index = self.nbr_index[i]
            return h.index_select(0, index.reshape(-1)).view(*index.shape, h.shape[-1])
        return h.view(self.dt[i].shape[0], self.dt[i].shape[1], -1)

    @property
    def num_roots(self) -> int:
        return int(self.nodes[0].shape[0])

    def layer_edges(self, i: int):
        """``(rows, index)`` with ``rows[index]`` layer ``i``'s ``[M_i, k_i, d_edge]`` edge
        features: ``edge_rows`` and ``edge_index[i]`` where the loader sent rows, else the
        per-slot features as rows (the index then counts them in order)."""
        self.edges_ready()
        if self.edge_rows is not None:
            return self.edge_rows, self.edge_index[i]
        if self.edge_index is not None:  # rows indexed, but none there
            raise CacheError(f"layer {i}'s edge features are not read yet: the batch's zero-copy reads "
                             f"were left to the training step (cache.read_in_step); call batch.read() "
                             f"before using batch.inputs outside Trainer's step")
        feat = self.edge_feat[i]
        index = torch.arange(feat.shape[0] * feat.shape[1], device=feat.device).view(feat.shape[:2])
        return feat.reshape(-1, feat.shape[-1]), index


def per_slot(rows: torch.Tensor, index: Optional[torch.Tensor], shapes) -> List[torch.Tensor]:
    """Every layer's edge features per slot (``GraphInputs.edge_feat``, ``[M_i, k_i, d]`` for
    ``shapes[i] == (M_i, k_i)``) from ``rows`` read through ``index`` (every layer's slots, in
    layer order), or from ``rows`` themselves (one per slot) where ``index`` is None."""
    flat = rows if index is None else rows.index_select(0, index)
    sizes = [math.prod(s) for s in shapes]
    return [piece.view(*s, -1) for piece, s in zip(torch.split(flat, sizes), shapes)]


def bucket(n: int, minimum: int = 256) -> int:
    """``n`` rounded up to the next of ``{4, 5, 6, 7} * 2^j`` (at least ``minimum``).

    Data-dependent lengths (a batch's unique nodes) padded to these sizes take a handful of
    distinct values per epoch, each at most 25 % above the length it holds.
    """
    n = max(int(n), int(minimum))
    step = 1 << max(0, n.bit_length() - 3)  # a quarter of the power of two below n, at least 1
    return -(-n // step) * step


class HighWater:
    """Data-dependent lengths padded to the largest :func:`bucket` seen so far, per kind.

    A monotone length gives a captured step one shape for the rest of the run once the batches
    stop growing (a batch's unique count rises as the history fills and varies from batch to
    batch; per-batch buckets made a dozen shapes per epoch, more than the graphs kept, and the
    captures evicted each other every epoch). Padded rows cost the per-row work of at most the
    largest batch seen.
    """

    def __init__(self) -> None:
        self.lengths: Dict[str, int] = {}
        self._lock = threading.Lock()  # staging threads raise lengths concurrently

    def seed(self, lengths: Dict[str, int]) -> None:
        """Start from ``lengths`` (an earlier run's :attr:`lengths`,
        :mod:`~fastopt.runtime.shape_plans`): each kind pads to at least that from its first batch."""
        with self._lock:
            for kind, n in lengths.items():
                self.lengths[kind] = max(self.lengths.get(kind, 0), int(n))

    def __call__(self, kind: str, n: int) -> int:
        with self._lock:
            self.lengths[kind] = length = max(self.lengths.get(kind, 0), bucket(n))
        return length
