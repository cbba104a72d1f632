"""APAN (Wang et al., SIGMOD'21): asynchronous mailbox of recent mails read by attention."""

from __future__ import annotations

import torch
from torch import nn

from fastopt.models.base import GraphInputs
from fastopt.models.embedding import append_node_embedding, node_embedding_table
from fastopt.models.layers import TemporalAttention
from fastopt.models.tgn import MemoryModel

__all__ = ["APAN"]


class APAN(MemoryModel):
    """Memory refreshed by attending over a mailbox of the node's ``mailbox_size`` latest mails.

    The memory is the query; each mail, with the encoding of its age relative to the newest mail,
    is a key/value. The embedding is the refreshed memory (plus projected node features, followed
    by the node's learnable row where ``node_embedding > 0``). Mails go to both endpoints of each
    event.
    """

    fanouts: list = []

    def __init__(self, num_nodes: int, node_dim: int, edge_dim: int, memory_dim: int = 100,
                 dim: int = 100, time_dim: int = 100, num_heads: int = 2, mailbox_size: int = 10,
                 dropout: float = 0.1, node_embedding: int = 0) -> None:
        super().__init__(num_nodes, edge_dim, memory_dim, dim, slots=mailbox_size)
        self.updater = TemporalAttention(memory_dim, 0, time_dim, memory_dim, num_heads, dropout,
                                         nbr_dim=self.memory.mail_dim)
        self.node_embedding = node_embedding_table(num_nodes, node_embedding, "APAN")
        node_dim += node_embedding
        self.node_proj = nn.Linear(node_dim, memory_dim) if node_dim else None
        self.out = nn.Linear(memory_dim, dim)

    def updated_memory(self, nodes):
        mem = self.memory
        mails = mem.mails[nodes]
        newest = mem.latest_mail(nodes)[1]
        age = (newest.unsqueeze(1) - mem.mail_ts[nodes]).to(mails.dtype)
        mask = mem.mail_mask(nodes)
        no_feat = mails.new_zeros(mails.shape[0], mails.shape[1], 0)
        new = self.updater(mem.memory[nodes], mails, no_feat, age, mask)
        return torch.where(mem.pending[nodes].unsqueeze(1), new, mem.memory[nodes])

    def embed(self, inputs: GraphInputs):
        h = self.root_memory(inputs.nodes[0], inputs.unique_nodes, inputs.node_inverse)
        if self.node_proj is not None:
            h = h + self.node_proj(append_node_embedding(self.node_embedding, [inputs.node_feat[0]], inputs)[0])
        return self.out(h)
