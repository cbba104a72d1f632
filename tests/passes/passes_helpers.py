"""Helpers of the passes tests: graph comparison and random neighbor batches."""

from __future__ import annotations

import numpy as np
import torch
from torch import fx

from fastopt.data import TemporalGraph


def graph_signature(gm: fx.GraphModule):
    """Node ops, targets and arguments of a graph (placeholder names and ``site`` keys ignored)."""
    names = {}
    sig = []
    for i, node in enumerate(gm.graph.nodes):
        names[node] = f"%{i}"

        def norm(a):
            if isinstance(a, fx.Node):
                return names[a]
            if isinstance(a, (list, tuple)):
                return type(a)(norm(x) for x in a)
            if isinstance(a, dict):
                return {k: norm(v) for k, v in a.items() if k != "site"}
            return a

        target = node.target if node.op != "placeholder" else "input"
        sig.append((node.op, target, norm(node.args), norm(node.kwargs)))
    return sig


def small_graph(seed: int = 0, nodes: int = 40, events: int = 300, node_dim: int = 3,
                edge_dim: int = 4) -> TemporalGraph:
    rng = np.random.default_rng(seed)
    return TemporalGraph(
        src=rng.integers(0, nodes // 2, events), dst=rng.integers(nodes // 2, nodes, events),
        ts=np.sort(rng.uniform(0, 1e5, events)), num_nodes=nodes,
        node_feat=rng.standard_normal((nodes, node_dim)).astype(np.float32) if node_dim else None,
        edge_feat=rng.standard_normal((events, edge_dim)).astype(np.float32) if edge_dim else None,
        name="small")


def neighbor_mask(m: int, k: int, p: float = 0.6, empty_rows: int = 1) -> torch.Tensor:
    """Random valid-slot mask ``[m, k]`` whose first ``empty_rows`` rows have no neighbor."""
    mask = torch.rand(m, k) < p
    mask[:empty_rows] = False
    return mask
