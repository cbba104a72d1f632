"""TGAT (Xu et al., ICLR'20): stacked temporal graph attention over uniformly sampled neighbors."""

from __future__ import annotations

from typing import Optional

from torch import nn

from fastopt.models.base import GraphInputs, TGNNModel
from fastopt.models.embedding import append_node_embedding, node_embedding_table
from fastopt.models.layers import TemporalAttention

__all__ = ["TGAT"]


class TGAT(TGNNModel):
    """``len(fanouts)`` attention layers; layer 0 reads raw node features (zero width if none).

    Embedding recursion: ``h^j(S_i) = attn_j(h^{j-1}(S_i), h^{j-1}(S_{i+1}))`` for node sets
    ``S_0`` (roots), ``S_1``, ... sampled outward, ending with ``h^L(S_0)``.

    With ``node_embedding > 0`` layer 0 reads, after each node's raw features, its row of a
    learnable ``[num_nodes, node_embedding]`` table (:mod:`fastopt.models.embedding`): without
    features TGAT cannot tell neighbors apart, with the rows it learns who they are.
    """

    strategy = "uniform"
    reads_edge_rows = True  # layer i projects the batch's unique edges, not every sampled slot

    def __init__(self, node_dim: int, edge_dim: int, dim: int = 100, time_dim: int = 100,
                 num_heads: int = 2, fanouts=(10, 10), dropout: float = 0.1, *,
                 node_embedding: int = 0, num_nodes: Optional[int] = None) -> None:
        super().__init__(dim)
        self.fanouts = list(fanouts)
        self.node_embedding = node_embedding_table(num_nodes, node_embedding, "TGAT")
        in_dim = node_dim + node_embedding
        self.layers = nn.ModuleList(
            TemporalAttention(in_dim if j == 0 else dim, edge_dim, time_dim, dim, num_heads, dropout,
                              edge_rows=True)
            for j in range(len(self.fanouts))
        )

    def embed(self, inputs: GraphInputs):
        feats = list(inputs.node_feat[: len(self.fanouts) + 1])
        return self.propagate(append_node_embedding(self.node_embedding, feats, inputs), inputs)
