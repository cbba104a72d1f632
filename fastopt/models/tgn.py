"""TGN (Rossi et al., 2020): GRU node memory, last-message mailbox, temporal graph attention."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from fastopt.models.base import GraphInputs, TGNNModel
from fastopt.models.embedding import append_node_embedding, node_embedding_table
from fastopt.models.layers import MultiheadTemporalAttention, TimeEncode
from fastopt.models.memory import NodeMemory

__all__ = ["MemoryModel", "TGN"]


class MemoryModel(TGNNModel):
    """Shared memory plumbing: a mail is ``[memory of self, memory of other, edge features]``.

    Subclasses provide ``self.updater(nodes, memory_module) -> updated memory`` semantics through
    :meth:`updated_memory`, and use it in :meth:`embed`.
    """

    def __init__(self, num_nodes: int, edge_dim: int, memory_dim: int, dim: int, slots: int = 1) -> None:
        super().__init__(dim)
        self.memory = NodeMemory(num_nodes, memory_dim, 2 * memory_dim + edge_dim, slots)
        self._fresh = None  # (updated memory rows, index of each root's row or None) of the last embed()

    def reset_state(self) -> None:
        self.memory.reset()
        self._fresh = None

    def updated_memory(self, nodes: torch.Tensor) -> torch.Tensor:
        """Memory of ``nodes`` as if their pending mail were absorbed (with gradients)."""
        raise NotImplementedError

    def recurrent_update(self, nodes: torch.Tensor, cell: nn.Module, mail_time: nn.Module) -> torch.Tensor:
        """``cell([mail, enc(t_mail - t_last)], memory)`` where a mail is pending, else the memory."""
        mem = self.memory
        mail, mail_ts = mem.latest_mail(nodes)
        delta = (mail_ts - mem.last_update[nodes]).to(mem.memory.dtype)
        new = cell(torch.cat([mail, mail_time(delta)], dim=1), mem.memory[nodes])
        return torch.where(mem.pending[nodes].unsqueeze(1), new, mem.memory[nodes])

    def root_memory(self, roots: torch.Tensor, unique: Optional[torch.Tensor] = None,
                    inverse: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Updated memory of each root; remembers the values for :meth:`commit`.

        With ``unique`` (the batch's unique nodes) and ``inverse`` (``roots == unique[inverse]``)
        each node is updated once and read back by index; otherwise every root row is updated,
        repeated ids included (each copy computes the same values). Either way no size is read
        back to the host, so the embedding can run inside a CUDA graph. The roots must begin with
        the batch's sources and then its destinations (the loader's order): :meth:`commit` reads
        their rows by position.
        """
        if unique is None:
            fresh = self.updated_memory(roots)
            self._fresh = (fresh.detach(), None)  # commit() writes values, it needs no gradient
            return fresh
        table = self.updated_memory(unique)
        inverse = inverse[: roots.shape[0]]  # the roots lead the nodes the inverse covers
        self._fresh = (table.detach(), inverse)
        return table.index_select(0, inverse)  # backward: index_add_, not a sort per call

    @torch.no_grad()
    def commit(self, src, dst, ts, edge_feat) -> None:
        table, inverse = self._fresh
        pos = torch.cat([src, dst])
        fresh = table[inverse[: pos.numel()]] if inverse is not None else table[: pos.numel()]
        mem = self.memory
        # repeated ids write identical rows (one node, one updated memory)
        mem.write(pos, fresh, torch.where(mem.pending[pos], mem.latest_mail(pos)[1], mem.last_update[pos]))
        m_src, m_dst = mem.memory[src], mem.memory[dst]
        mails = torch.cat([torch.cat([m_src, m_dst, edge_feat], 1), torch.cat([m_dst, m_src, edge_feat], 1)])
        mem.deliver(pos, mails, torch.cat([ts, ts]).to(mem.mail_ts.dtype))
        self._fresh = None


class TGN(MemoryModel):
    """TGN with one attention layer over the 10 most recent neighbors (TGL's defaults).

    A node's layer-0 representation is its memory plus a projection of its features: the raw
    ones followed by its learnable row where ``node_embedding > 0``.
    """

    strategy = "recent"
    waits_for_edges = True  # its edge features are reached through propagate alone

    def __init__(self, num_nodes: int, node_dim: int, edge_dim: int, memory_dim: int = 100,
                 dim: int = 100, time_dim: int = 100, num_heads: int = 2, fanouts=(10,),
                 dropout: float = 0.1, node_embedding: int = 0) -> None:
        super().__init__(num_nodes, edge_dim, memory_dim, dim)
        self.fanouts = list(fanouts)
        self.mail_time = TimeEncode(time_dim)
        self.gru = nn.GRUCell(self.memory.mail_dim + time_dim, memory_dim)
        self.node_embedding = node_embedding_table(num_nodes, node_embedding, "TGN")
        node_dim += node_embedding
        self.node_proj = nn.Linear(node_dim, memory_dim) if node_dim else None
        self.layers = nn.ModuleList(
            MultiheadTemporalAttention(memory_dim if j == 0 else dim, edge_dim, time_dim, dim, num_heads, dropout)
            for j in range(len(self.fanouts))
        )

    def updated_memory(self, nodes):
        return self.recurrent_update(nodes, self.gru, self.mail_time)

    def node_repr(self, node_feat, memory):
        return memory if self.node_proj is None else memory + self.node_proj(node_feat)

    def embed(self, inputs: GraphInputs):
        sets = inputs.nodes[: len(self.fanouts) + 1]
        memory = self.root_memory(torch.cat(sets), inputs.unique_nodes, inputs.node_inverse)
        memory = memory.split([int(n.shape[0]) for n in sets])
        feats = append_node_embedding(self.node_embedding, list(inputs.node_feat[: len(sets)]), inputs)
        return self.propagate([self.node_repr(f, m) for f, m in zip(feats, memory)], inputs)
