"""``LastNeighborLoader``: each node's most recent interactions, PyG's interface on dense tensors.

A drop-in for ``torch_geometric.nn.models.tgn.LastNeighborLoader`` (same constructor, ``insert``,
``__call__``, ``reset_state``; same outputs in the same order, bit for bit on the same device),
without torch_geometric. Per node it keeps the ids of its last ``size`` events and their other
endpoints in ``[num_nodes, size]`` tables, newest first, ``-1`` for a free slot:

- ``insert(src, dst)`` merges a batch (both directions) into every node's row: the batch's
  events are placed in a ``[num_nodes, size]`` block by node (the slot of an event is its rank
  in the node-sorted batch modulo ``size``, as PyG places them) and each row keeps the ``size``
  largest event ids of old and new. It runs over all rows, so it needs no host read of how
  many nodes the batch touches (PyG's reads one per insert);
- ``__call__(n_id)`` returns the nodes' neighborhoods as PyG does: ``n_id`` extended by the
  neighbors (sorted, unique), the edges (neighbor, node) as positions in it, and the event ids;
  one host read for the valid slots and one for the unique nodes (PyG's takes four).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from fastopt.errors import SamplerError

__all__ = ["LastNeighborLoader"]


class LastNeighborLoader:
    """Most recent ``size`` neighbors of each of ``num_nodes`` nodes, on ``device``."""

    def __init__(self, num_nodes: int, size: int, device=None) -> None:
        for name, value in (("num_nodes", num_nodes), ("size", size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SamplerError(f"{name} must be a positive int (got {value!r}); pass e.g. "
                                   f"{name}=10")
        self.num_nodes, self.size = num_nodes, size
        self.neighbors = torch.empty((num_nodes, size), dtype=torch.long, device=device)
        self.e_id = torch.empty((num_nodes, size), dtype=torch.long, device=device)
        self._assoc = torch.empty(num_nodes, dtype=torch.long, device=device)
        self.reset_state()

    def reset_state(self) -> None:
        """Forget every event: all slots free, event ids counted from 0 again."""
        self.cur_e_id = 0
        self.e_id.fill_(-1)

    def __call__(self, n_id: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``(n_id, edge_index, e_id)``: the nodes with their neighbors (sorted, unique), edges
        ``[2, E]`` from neighbor to node as positions in that ``n_id``, and the edges' event ids."""
        size = self.size
        e_ids = self.e_id[n_id].view(-1)
        valid = torch.nonzero(e_ids >= 0).view(-1)
        neighbors = self.neighbors[n_id].view(-1)[valid]
        nodes = n_id.view(-1, 1).expand(-1, size).reshape(-1)[valid]
        e_id = e_ids[valid]
        n_id = torch.cat([n_id, neighbors]).unique()
        self._assoc[n_id] = torch.arange(n_id.size(0), device=n_id.device)
        return n_id, torch.stack([self._assoc[neighbors], self._assoc[nodes]]), e_id

    def insert(self, src: Tensor, dst: Tensor) -> None:
        """Record the events ``src[i] -> dst[i]`` (ids counted on from the last insert), as
        neighbors of both endpoints."""
        if src.shape != dst.shape or src.dim() != 1:
            raise SamplerError(f"src and dst must be 1-d of one length (got {tuple(src.shape)} and "
                               f"{tuple(dst.shape)}); pass one entry per event")
        size, count = self.size, src.numel()
        neighbors = torch.cat([src, dst], dim=0)
        nodes = torch.cat([dst, src], dim=0)
        e_id = torch.arange(self.cur_e_id, self.cur_e_id + count, device=src.device).repeat(2)
        self.cur_e_id += count
        nodes, perm = nodes.sort()
        neighbors, e_id = neighbors[perm], e_id[perm]
        slot = torch.arange(nodes.size(0), device=nodes.device) % size + nodes * size
        block_e_id = e_id.new_full((self.num_nodes * size,), -1)
        block_e_id[slot] = e_id
        block_neighbors = e_id.new_empty(self.num_nodes * size)
        block_neighbors[slot] = neighbors
        merged_e_id = torch.cat([self.e_id, block_e_id.view(-1, size)], dim=-1)
        merged = torch.cat([self.neighbors, block_neighbors.view(-1, size)], dim=-1)
        top, pick = merged_e_id.topk(size, dim=-1)
        self.e_id.copy_(top)
        self.neighbors.copy_(torch.gather(merged, 1, pick))
