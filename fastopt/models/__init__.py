"""Reference TGNNs in plain PyTorch (what :func:`fastopt.optimize` rewrites) and the model registry."""

from __future__ import annotations

import inspect
from typing import Optional

from fastopt.config import Config, ModelConfig
from fastopt.errors import ModelError
from fastopt.models.apan import APAN
from fastopt.models.base import GraphInputs, TGNNModel
from fastopt.models.jodie import JODIE
from fastopt.models.tgat import TGAT
from fastopt.models.tgn import TGN

__all__ = ["APAN", "GraphInputs", "JODIE", "MODELS", "TGAT", "TGN", "TGNNModel", "build_model",
           "model_options"]

MODELS = {"tgn": TGN, "tgat": TGAT, "jodie": JODIE, "apan": APAN}

# config.model field -> constructor argument of the reference models
_ARGUMENTS = {"fanouts": "fanouts", "memory_dim": "memory_dim", "dim": "dim", "time_dim": "time_dim",
              "heads": "num_heads", "dropout": "dropout", "mailbox_size": "mailbox_size",
              "node_embedding": "node_embedding"}


def _model_class(name: str) -> type:
    key = str(name).lower()
    if key not in MODELS:
        raise ModelError(f"unknown model {name!r}; choose one of {', '.join(sorted(MODELS))}")
    return MODELS[key]


def model_options(name: str, config: Config) -> dict:
    """Constructor arguments of model ``name`` from ``config.model``.

    A knob the model does not have (heads of JODIE, fanouts of APAN) must keep its default;
    any other value is an error, so that no setting is silently ignored.
    """
    cls = _model_class(name)
    accepted = inspect.signature(cls.__init__).parameters
    default = ModelConfig()
    options = {}
    for knob, argument in _ARGUMENTS.items():
        value = config.model_fanouts() if knob == "fanouts" else getattr(config.model, knob)
        if argument in accepted:
            if value is not None:
                options[argument] = value
        elif value != getattr(default, knob) and value is not None:
            takers = [m for m, c in MODELS.items() if argument in inspect.signature(c.__init__).parameters]
            raise ModelError(f"model.{knob}={value!r} does not apply to {name} (it has no such "
                             f"hyperparameter); leave it at {getattr(default, knob)!r}, or pick a "
                             f"model that has it: {', '.join(takers)}")
    return options


def build_model(name: str, graph, config: Optional[Config] = None, **kwargs) -> TGNNModel:
    """Build a reference model sized for ``graph`` (its node count and feature widths).

    Hyperparameters default to the TGN/TGL ones (memory, time and embedding width 100, 2 heads,
    dropout 0.1, the model's own neighbors per layer); ``config.model`` (see
    :class:`fastopt.config.ModelConfig`) sets them, and ``kwargs`` (constructor arguments:
    ``memory_dim``, ``dim``, ``time_dim``, ``num_heads``, ``fanouts``, ``dropout``,
    ``mailbox_size``, ``node_embedding``) override single ones. ``node_embedding=W`` gives every
    node a learnable row of width ``W`` beside its features (:mod:`fastopt.models.embedding`);
    on a graph without node features it is what TGAT learns to tell neighbors apart by.
    """
    cls = _model_class(name)
    options = model_options(name, config) if config is not None else {}
    options.update(kwargs)
    if cls is TGAT:
        return TGAT(graph.node_dim, graph.edge_dim, num_nodes=graph.num_nodes, **options)
    return cls(graph.num_nodes, graph.node_dim, graph.edge_dim, **options)
