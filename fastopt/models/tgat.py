"""TGAT (Xu et al., ICLR'20): stacked temporal graph attention over uniformly sampled neighbors."""

from __future__ import annotations

from torch import nn

from fastopt.models.base import GraphInputs, TGNNModel
from fastopt.models.layers import TemporalAttention

__all__ = ["TGAT"]


class TGAT(TGNNModel):
    """``len(fanouts)`` attention layers; layer 0 reads raw node features (zero width if none).

    Embedding recursion: ``h^j(S_i) = attn_j(h^{j-1}(S_i), h^{j-1}(S_{i+1}))`` for node sets
    ``S_0`` (roots), ``S_1``, ... sampled outward, ending with ``h^L(S_0)``.
    """

    strategy = "uniform"
    reads_edge_rows = True  # layer i projects the batch's unique edges, not every sampled slot

    def __init__(self, node_dim: int, edge_dim: int, dim: int = 100, time_dim: int = 100,
                 num_heads: int = 2, fanouts=(10, 10), dropout: float = 0.1) -> None:
        super().__init__(dim)
        self.fanouts = list(fanouts)
        self.layers = nn.ModuleList(
            TemporalAttention(node_dim if j == 0 else dim, edge_dim, time_dim, dim, num_heads, dropout,
                              edge_rows=True)
            for j in range(len(self.fanouts))
        )

    def embed(self, inputs: GraphInputs):
        return self.propagate(list(inputs.node_feat[: len(self.fanouts) + 1]), inputs)
