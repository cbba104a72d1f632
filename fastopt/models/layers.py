"""Building blocks of the reference TGNNs, written in plain PyTorch the way TGNN code is written.

Nothing here is pre-fused: these layers are what :func:`fastopt.optimize` later rewrites. The
embedding layers take tensors only and have no data-dependent Python control flow, so
``torch.fx.symbolic_trace`` can trace each of them.
"""

from __future__ import annotations

from typing import Optional


import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fastopt.errors import ModelError

# How to fix widths that do not divide into the heads (the knobs of fastopt.Config.model).
_HEADS_FIX = ("set model.heads (--heads) to a divisor of that width, or model.dim, model.memory_dim "
              "and model.time_dim (--dim, --memory-dim, --time-dim) to multiples of the heads")

__all__ = [
    "TimeEncode",
    "TemporalAttention",
    "MultiheadTemporalAttention",
    "EdgePredictor",
    "MergeLayer",
]


class TimeEncode(nn.Module):
    """``cos(dt * w + b)`` with TGN's initialization ``w_i = 10^(-9 i / (dim - 1))``, ``b = 0``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.w = nn.Linear(1, dim)
        with torch.no_grad():
            self.w.weight.copy_(torch.from_numpy(1.0 / 10 ** np.linspace(0, 9, dim, dtype=np.float32)).reshape(dim, 1))
            self.w.bias.zero_()

    def forward(self, dt: torch.Tensor) -> torch.Tensor:
        return torch.cos(self.w(dt.unsqueeze(-1)))


class TemporalAttention(nn.Module):
    """Temporal graph attention over ``k`` sampled neighbors, written out explicitly (TGAT style).

    Query: the destination's representation and the encoding of Δt = 0; keys and values: each
    neighbor's representation, the edge's features and the encoding of Δt. Scores are scaled
    dot products (per head, ``1 / sqrt(head_dim)``), masked entries get a large negative score,
    softmax runs over the neighbor dimension and masked weights are zeroed, so a destination with no valid neighbor receives
    zeros. Output: ``LayerNorm(ReLU(W_o [attention, h_dst]))``.

    Shapes: ``h_dst [M, d_node]``, ``h_nbr [M, k, d_node]``, ``edge_feat [M, k, d_edge]``,
    ``dt [M, k]``, ``mask [M, k]`` (bool) -> ``[M, d_out]``. Neighbors may have their own width
    ``nbr_dim`` (default ``node_dim``). With ``edge_rows=True`` the layer takes ``edge_feat`` as a
    table of rows ``[E, d_edge]`` and a sixth argument ``edge_index [M, k]`` selecting each slot's
    row (the batch's unique edges, each projected once after :func:`fastopt.optimize`).
    """

    def __init__(self, node_dim: int, edge_dim: int, time_dim: int, out_dim: int,
                 num_heads: int = 2, dropout: float = 0.1, nbr_dim: Optional[int] = None,
                 edge_rows: bool = False) -> None:
        super().__init__()
        nbr_dim = node_dim if nbr_dim is None else nbr_dim
        self.edge_rows = edge_rows
        if out_dim % num_heads:
            raise ModelError(f"attention width {out_dim} does not divide into {num_heads} heads; "
                             f"{_HEADS_FIX}")
        self.num_heads = num_heads
        self.head_dim = out_dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.time_enc = TimeEncode(time_dim)
        self.w_q = nn.Linear(node_dim + time_dim, out_dim)
        self.w_k = nn.Linear(nbr_dim + edge_dim + time_dim, out_dim)
        self.w_v = nn.Linear(nbr_dim + edge_dim + time_dim, out_dim)
        self.w_out = nn.Linear(out_dim + node_dim, out_dim)
        self.dropout = nn.Dropout(dropout)
        self.att_dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(out_dim)

    def forward(self, h_dst, h_nbr, edge_feat, dt, mask, edge_index=None):
        if self.edge_rows:
            edge_feat = edge_feat[edge_index]
        m, k = dt.shape
        zero_t = self.time_enc(torch.zeros_like(dt[:, 0]))
        q = self.w_q(torch.cat([h_dst, zero_t], dim=-1)).view(m, 1, self.num_heads, self.head_dim)
        kv_in = torch.cat([h_nbr, edge_feat, self.time_enc(dt)], dim=-1)
        key = self.w_k(kv_in).view(m, k, self.num_heads, self.head_dim)
        value = self.w_v(kv_in).view(m, k, self.num_heads, self.head_dim)
        scores = (q * key).sum(dim=-1) * self.scale
        scores = scores.masked_fill(~mask.unsqueeze(-1), -1e9)
        att = torch.softmax(scores, dim=1).masked_fill(~mask.unsqueeze(-1), 0.0)
        att = self.att_dropout(att)
        out = (att.unsqueeze(-1) * value).sum(dim=1).reshape(m, -1)
        out = self.w_out(torch.cat([out, h_dst], dim=-1))
        return self.norm(F.relu(self.dropout(out)))


class MergeLayer(nn.Module):
    """``fc2(ReLU(fc1([x1, x2])))``."""

    def __init__(self, dim1: int, dim2: int, hidden: int, out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim1 + dim2, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x1, x2):
        return self.fc2(F.relu(self.fc1(torch.cat([x1, x2], dim=-1))))


class MultiheadTemporalAttention(nn.Module):
    """Temporal graph attention through ``nn.MultiheadAttention`` (the original TGN code's style).

    A query of length one attends over the neighbor sequence with ``key_padding_mask``. Rows with
    no valid neighbor unmask their first slot (so the softmax stays finite) and are zeroed after.
    Same shapes as :class:`TemporalAttention`.
    """

    def __init__(self, node_dim: int, edge_dim: int, time_dim: int, out_dim: int,
                 num_heads: int = 2, dropout: float = 0.1, nbr_dim: Optional[int] = None) -> None:
        super().__init__()
        nbr_dim = node_dim if nbr_dim is None else nbr_dim
        query_dim = node_dim + time_dim
        if query_dim % num_heads:
            raise ModelError(f"attention query width (node width {node_dim} + time width {time_dim} = "
                             f"{query_dim}) does not divide into {num_heads} heads; {_HEADS_FIX}")
        kv_dim = nbr_dim + edge_dim + time_dim
        self.time_enc = TimeEncode(time_dim)
        self.attn = nn.MultiheadAttention(query_dim, num_heads, dropout=dropout, kdim=kv_dim,
                                          vdim=kv_dim, batch_first=True)
        self.merge = MergeLayer(query_dim, node_dim, out_dim, out_dim)

    def forward(self, h_dst, h_nbr, edge_feat, dt, mask):
        zero_t = self.time_enc(torch.zeros_like(dt[:, 0]))
        query = torch.cat([h_dst, zero_t], dim=-1).unsqueeze(1)
        kv = torch.cat([h_nbr, edge_feat, self.time_enc(dt)], dim=-1)
        no_nbr = ~mask.any(dim=1, keepdim=True)
        first = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0) == 0
        padding = ~mask & ~(no_nbr & first)
        out, _ = self.attn(query, kv, kv, key_padding_mask=padding, need_weights=False)
        out = out.squeeze(1).masked_fill(no_nbr, 0.0)
        return self.merge(out, h_dst)


class EdgePredictor(nn.Module):
    """Link logit ``out(ReLU(W_s h_src + W_d h_dst))``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.src_fc = nn.Linear(dim, dim)
        self.dst_fc = nn.Linear(dim, dim)
        self.out_fc = nn.Linear(dim, 1)

    def forward(self, h_src, h_dst):
        return self.out_fc(F.relu(self.src_fc(h_src) + self.dst_fc(h_dst))).squeeze(-1)


