"""Learnable node embeddings: something to learn from on graphs without node features.

On a featureless graph an attention layer's keys carry only the time encoding of each neighbor,
so a model without node memory (TGAT) cannot tell one neighbor from another. A table with a
learnable row per node (``model.node_embedding``, ``--node-embedding``) gives each node an
identity; the row is appended to the node's raw features wherever a model reads them (TGAT's
layer 0, the node-feature projection of TGN, JODIE and APAN).

The rows are gathered through the batch's unique nodes (:class:`~fastopt.runtime.GraphInputs`'s
``unique_nodes`` / ``node_inverse``) where the loader sent them: each node's row is read once
and handed to its slots by index. The lookup reads no size back to the host and has static
shapes, so it runs inside a captured CUDA graph.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from fastopt.errors import ModelError

__all__ = ["append_node_embedding", "node_embedding_table"]


def node_embedding_table(num_nodes: Optional[int], width: int, model: str) -> Optional[nn.Embedding]:
    """A ``[num_nodes, width]`` table of learnable rows, or None for ``width == 0``.

    Rows start as ``N(0, 1)`` draws (``nn.Embedding``'s initialization): distinct codes from the
    first step, on the scale of the time encoding they sit beside. A node that no training event
    touches keeps its initial row, as a fixed random feature would.

    Raises:
        ModelError: ``width`` is negative, or ``num_nodes`` is missing or below 1 where a table
            is asked for.
    """
    width = int(width)
    if width < 0:
        raise ModelError(f"{model}: node_embedding={width} is negative; use 0 for no node "
                         f"embedding or a width >= 1 (model.node_embedding, --node-embedding)")
    if width == 0:
        return None
    if num_nodes is None or int(num_nodes) < 1:
        raise ModelError(f"{model}: node_embedding={width} needs num_nodes >= 1 (got {num_nodes!r}) "
                         f"to size its table; pass num_nodes=graph.num_nodes, or build the model "
                         f"with fastopt.models.build_model({model.lower()!r}, graph, ...)")
    return nn.Embedding(int(num_nodes), width)


def append_node_embedding(table: Optional[nn.Embedding], node_feat: List[torch.Tensor],
                          inputs) -> List[torch.Tensor]:
    """``node_feat[i]`` (the raw features of ``inputs.nodes[i]``) with each node's row of
    ``table`` appended: ``[M_i, d_node + width]``; ``node_feat`` itself where ``table`` is None.

    Where ``inputs.node_inverse`` covers these sets (the loader's order: they lead
    ``torch.cat(inputs.nodes)``), the rows of the unique nodes are looked up once and spread by
    index; otherwise each slot looks up its own row. Both lookups are ``index_select``, whose
    backward (``index_add_``) runs inside a captured CUDA graph, as TGN's memory rows do.
    """
    if table is None:
        return node_feat
    nodes = inputs.nodes[: len(node_feat)]
    sizes = [int(n.shape[0]) for n in nodes]
    total = sum(sizes)
    unique, inverse = inputs.unique_nodes, inputs.node_inverse
    if unique is not None and inverse is not None and inverse.shape[0] >= total:
        rows = table.weight.index_select(0, unique).index_select(0, inverse[:total])
    else:
        rows = table.weight.index_select(0, torch.cat(nodes))
    return [row if feat.shape[-1] == 0 else torch.cat([feat, row], dim=-1)
            for feat, row in zip(node_feat, rows.split(sizes))]
