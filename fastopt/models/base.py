"""The interface between the trainer and a TGNN: what it must provide (what it receives,
:class:`~fastopt.runtime.GraphInputs`, is defined by the runtime)."""

from __future__ import annotations

from typing import List

import torch
from torch import nn

from fastopt.models.layers import EdgePredictor
from fastopt.runtime.inputs import GraphInputs  # the runtime<->model contract lives with the loader

__all__ = ["GraphInputs", "TGNNModel"]


class TGNNModel(nn.Module):
    """Base of the reference models.

    Subclasses set ``fanouts`` (neighbors per layer, ``[]`` for none) and ``strategy``
    (``"recent"`` or ``"uniform"``), and implement :meth:`embed`. Memory-based models also
    implement :meth:`reset_state` and :meth:`commit`.
    """

    fanouts: List[int] = []
    strategy: str = "recent"
    # Layers take each layer's edge features as (unique rows, [M, k] index) instead of per slot.
    reads_edge_rows: bool = False
    # Embeddings of a layer's neighbors are read through GraphInputs.nbr_index where the loader
    # merged repeated slots (:meth:`propagate` does; a subclass that reads nodes per slot sets False).
    reads_nbr_index: bool = True
    # Edge features (and the events' rows) are taken only after inputs.edges_ready(), which
    # :meth:`propagate` calls: the trainer may still be reading them on another stream before that
    # (cache.read_overlap). Set where embed reaches them through propagate only (TGN).
    waits_for_edges: bool = False

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.predictor = EdgePredictor(dim)

    def embed(self, inputs: GraphInputs) -> torch.Tensor:
        """Embeddings ``[num_roots, dim]`` of the roots at their times."""
        raise NotImplementedError

    def propagate(self, h: List[torch.Tensor], inputs: GraphInputs) -> torch.Tensor:
        """Run ``self.layers`` over node sets ``S_0..S_L``: ``h^j(S_i) = layer_j(h^{j-1}(S_i), h^{j-1}(S_{i+1}))``.

        ``h[i]`` holds the layer-0 representation of ``inputs.nodes[i]``; returns ``h^L(S_0)``.
        With :attr:`reads_edge_rows` each layer also gets ``(edge rows, index)`` in place of the
        per-slot edge features (:meth:`GraphInputs.layer_edges`); neighbors' rows are read
        through :meth:`GraphInputs.layer_neighbors` (merged repeats read one row many times).
        """
        num_layers = len(self.fanouts)
        inputs.edges_ready()
        edges = [inputs.layer_edges(i) if self.reads_edge_rows else (inputs.edge_feat[i],)
                 for i in range(num_layers)]
        for j, layer in enumerate(self.layers):
            h = [
                layer(h[i], inputs.layer_neighbors(i, h[i + 1]), edges[i][0],
                      inputs.dt[i], inputs.mask[i], *edges[i][1:])
                for i in range(num_layers - j)
            ]
        return h[0]

    def forward(self, inputs: GraphInputs) -> torch.Tensor:
        return self.embed(inputs)

    def score(self, h_src: torch.Tensor, h_dst: torch.Tensor) -> torch.Tensor:
        """Link logits for pairs of embeddings."""
        return self.predictor(h_src, h_dst)

    def reset_state(self) -> None:
        """Forget the dynamic state (start of an epoch). Stateless models do nothing."""

    def commit(self, src: torch.Tensor, dst: torch.Tensor, ts: torch.Tensor,
               edge_feat: torch.Tensor) -> None:
        """Write back the state after a batch of positive events has been trained on."""
