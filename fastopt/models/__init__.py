"""Reference TGNNs in plain PyTorch (what :func:`fastopt.optimize` rewrites) and the model registry."""

from __future__ import annotations

from fastopt.errors import ModelError
from fastopt.models.apan import APAN
from fastopt.models.base import GraphInputs, TGNNModel
from fastopt.models.jodie import JODIE
from fastopt.models.tgat import TGAT
from fastopt.models.tgn import TGN

__all__ = ["APAN", "GraphInputs", "JODIE", "MODELS", "TGAT", "TGN", "TGNNModel", "build_model"]

MODELS = {"tgn": TGN, "tgat": TGAT, "jodie": JODIE, "apan": APAN}


def build_model(name: str, graph, **kwargs) -> TGNNModel:
    """Build a reference model sized for ``graph`` (its node count and feature widths).

    Hyperparameters default to the TGN/TGL ones (memory, time and embedding width 100, 2 heads,
    dropout 0.1); ``kwargs`` override them.
    """
    key = str(name).lower()
    if key not in MODELS:
        raise ModelError(f"unknown model {name!r}; choose one of {', '.join(sorted(MODELS))}")
    cls = MODELS[key]
    if cls is TGAT:
        return TGAT(graph.node_dim, graph.edge_dim, **kwargs)
    return cls(graph.num_nodes, graph.node_dim, graph.edge_dim, **kwargs)
