"""Tracing a user's module with torch.fx, without side effects on it.

``FastOptTracer`` keeps ``torch.nn`` built-ins (``Linear``, ``MultiheadAttention``, ``Dropout``,
``LayerNorm``, RNN cells, ...) as leaf calls, so patterns see ``nn.MultiheadAttention`` as one node
and parameters stay owned by their modules; user-defined modules are traced through.

Tracing runs ``forward`` on proxies: code that stores results on ``self`` (memory updates, caches
of the last batch) would leave proxies in the user's model. :func:`trace` snapshots every
submodule's attributes and restores them afterwards, whatever happens.

A forward that assigns module attributes is treated as untraceable: fx would drop the write.
In-place writes to buffers (``self.count.add_(1)``) are recorded in the graph and kept.

PyG's ``torch_geometric.utils.softmax`` and ``scatter`` (data-dependent inside) are recorded as
single calls where a traced module's globals name them and torch_geometric is already imported
(:func:`leaf_functions`), so that hand-written PyG-style message passing traces and
``fuse_edge_softmax_aggregation`` can match it; torch_geometric is never imported here.

``self.training`` is read as a Python bool while tracing, so code such as
``F.dropout(x, p, training=self.training)`` is traced once per mode; the optimized module runs the
graph of its current mode.

:func:`graph_structure` describes what tracing finds without the names a user chose (variables,
attributes, submodules): the key a tuning record is filed under (:mod:`fastopt.tuner.records`).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch import fx, nn

from fastopt.errors import TraceError

__all__ = ["FastOptTracer", "graph_structure", "trace", "is_builtin_leaf", "leaf_functions"]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def is_builtin_leaf(module: nn.Module) -> bool:
    """Whether ``module`` is a ``torch.nn`` built-in (not a container): kept as one call when traced."""
    return type(module).__module__.startswith("torch.nn") and not isinstance(module, _CONTAINERS)


def leaf_functions() -> tuple:
    """PyG's ``softmax`` and ``scatter`` where torch_geometric is imported already, else ``()``."""
    utils = sys.modules.get("torch_geometric.utils")
    if utils is None:
        return ()
    return tuple(f for f in (getattr(utils, "softmax", None), getattr(utils, "scatter", None))
                 if callable(f))


class FastOptTracer(fx.Tracer):
    """``torch.fx`` tracer whose leaves are the ``torch.nn`` built-ins (and the functions of
    :func:`leaf_functions`)."""

    def __init__(self) -> None:
        super().__init__(autowrap_functions=leaf_functions())

    # Buffers are traced as graph inputs (get_attr proxies), not read as tensors: fx's default
    # ran an in-place write such as ``self.count.add_(1)`` on the user's buffer while tracing
    # and left it out of the graph.
    proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return is_builtin_leaf(m)


@contextlib.contextmanager
def _preserved(module: nn.Module) -> Iterator[List[str]]:
    """Restore every submodule's attribute dict (and its training flag) on exit.

    Yields a list that, once the body ran, names the attributes the body assigned: state writes
    a graph cannot express (``self._last = x`` is not recorded by fx).
    """
    saved: Dict[nn.Module, dict] = {m: dict(m.__dict__) for m in module.modules()}
    inner = {m: (dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in saved}
    writes: List[str] = []
    try:
        yield writes
    finally:
        for m, attrs in saved.items():
            for key, value in m.__dict__.items():
                if key != "training" and (key not in attrs or attrs[key] is not value):
                    writes.append(f"{type(m).__name__}.{key}")
        for m, attrs in saved.items():
            m.__dict__.clear()
            m.__dict__.update(attrs)
            params, buffers, modules = inner[m]
            for store, old in ((m._parameters, params), (m._buffers, buffers), (m._modules, modules)):
                store.clear()
                store.update(old)


def trace(module: nn.Module, training: bool) -> fx.GraphModule:
    """Trace ``module`` as it runs in training (``True``) or eval mode.

    Returns:
        A ``GraphModule`` whose attributes are ``module``'s own submodules and parameters.

    Raises:
        TraceError: naming the module's class and the tracer's complaint.
    """
    with _preserved(module) as writes:
        module.train(training)
        try:
            graph = FastOptTracer().trace(module)
        except Exception as exc:  # fx raises anything the traced code raises on proxies
            # the first sentence says what failed; fx's advice after it is about fx, not the model
            first = str(exc).strip().splitlines()[0].split(". ")[0].rstrip(".") if str(exc).strip() else ""
            raise TraceError(
                f"{type(module).__name__} cannot be traced by torch.fx ({type(exc).__name__}: {first})"
            ) from exc
        gm = fx.GraphModule(module, graph, class_name=type(module).__name__)
    if writes:
        raise TraceError(
            f"{type(module).__name__} cannot be traced by torch.fx: its forward assigns "
            f"{', '.join(sorted(set(writes)))}, a state write a graph does not record"
        )
    return gm


def graph_structure(module: nn.Module) -> Optional[List[list]]:
    """What ``module`` computes, names left out: a JSON-able list, or None when no part traces.

    Parts are found as :func:`fastopt.optimize` finds them: the module traced in training mode,
    else each child in turn (a module that does not trace lists its class and its own parameters'
    shapes, then its children). A traced graph lists its nodes in order, each with its kind (the
    function's qualified name, the method's name, the leaf module's class and parameter shapes,
    a parameter's or buffer's shape) and its arguments as positions of earlier nodes and
    constants. Renaming an attribute, a submodule or a ``forward`` argument leaves it unchanged;
    another width or another op changes it.
    """
    parts: List[list] = []
    _describe(module, parts)
    return parts if any(part[0] == "graph" for part in parts) else None


def _describe(module: nn.Module, parts: List[list]) -> None:
    if not is_builtin_leaf(module):
        try:
            gm = trace(module, True)
        except TraceError:
            pass
        else:
            parts.append(["graph", _nodes(gm)])
            return
    own = [list(p.shape) for p in module.parameters(recurse=False)]
    parts.append(["untraced", type(module).__name__, own])
    if not is_builtin_leaf(module):
        for child in module.children():
            _describe(child, parts)


def _nodes(gm: fx.GraphModule) -> List[list]:
    position = {node: i for i, node in enumerate(gm.graph.nodes)}

    def arg(value: Any) -> Any:
        if isinstance(value, fx.Node):
            return ["%", position[value]]
        if isinstance(value, (list, tuple)):
            return [arg(v) for v in value]
        if isinstance(value, dict):
            return {str(k): arg(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (torch.dtype, torch.device, torch.Size)):
            return str(value)
        return type(value).__name__

    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function":
            target = node.target
            kind = f"{getattr(target, '__module__', None) or ''}.{getattr(target, '__qualname__', None) or target}"
        elif node.op == "call_method":
            kind = node.target
        elif node.op == "call_module":
            leaf = gm.get_submodule(node.target)
            kind = [type(leaf).__name__, [list(p.shape) for p in leaf.parameters()]]
        elif node.op == "get_attr":
            value = _attribute(gm, node.target)
            kind = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        else:  # placeholder, output: their names are the user's
            kind = None
        out.append([node.op, kind, arg(node.args), arg(node.kwargs)])
    return out


def _attribute(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for name in target.split("."):
        value = getattr(value, name)
    return value
