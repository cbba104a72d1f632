"""JODIE (Kumar et al., KDD'19): RNN node memory with a time-projection embedding."""

from __future__ import annotations

import torch
from torch import nn

from fastopt.models.base import GraphInputs
from fastopt.models.embedding import append_node_embedding, node_embedding_table
from fastopt.models.layers import TimeEncode
from fastopt.models.tgn import MemoryModel

__all__ = ["JODIE"]


class JODIE(MemoryModel):
    """Memory updated by an ``RNNCell``; embedding ``W (m ⊙ (1 + w Δt))`` with Δt since the update,
    plus projected node features (followed by the node's learnable row where ``node_embedding > 0``)."""

    fanouts: list = []

    def __init__(self, num_nodes: int, node_dim: int, edge_dim: int, memory_dim: int = 100,
                 dim: int = 100, time_dim: int = 100, node_embedding: int = 0) -> None:
        super().__init__(num_nodes, edge_dim, memory_dim, dim)
        self.mail_time = TimeEncode(time_dim)
        self.rnn = nn.RNNCell(self.memory.mail_dim + time_dim, memory_dim)
        self.time_proj = nn.Linear(1, memory_dim)
        nn.init.normal_(self.time_proj.weight, 0.0, 0.1)
        nn.init.zeros_(self.time_proj.bias)
        self.node_embedding = node_embedding_table(num_nodes, node_embedding, "JODIE")
        node_dim += node_embedding
        self.node_proj = nn.Linear(node_dim, memory_dim) if node_dim else None
        self.out = nn.Linear(memory_dim, dim)

    def updated_memory(self, nodes):
        return self.recurrent_update(nodes, self.rnn, self.mail_time)

    def embed(self, inputs: GraphInputs):
        roots, times = inputs.nodes[0], inputs.times[0]
        memory = self.root_memory(roots, inputs.unique_nodes, inputs.node_inverse)
        mem = self.memory
        since = torch.where(mem.pending[roots], mem.latest_mail(roots)[1], mem.last_update[roots])
        # Δt is scaled to days-like units so the projection starts near identity.
        dt = ((times.to(since.dtype) - since) / 86400.0).to(memory.dtype).unsqueeze(1)
        h = memory * (1 + self.time_proj(dt))
        if self.node_proj is not None:
            h = h + self.node_proj(append_node_embedding(self.node_embedding, [inputs.node_feat[0]], inputs)[0])
        return self.out(h)
