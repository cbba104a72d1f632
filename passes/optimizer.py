"""Driving the pipeline over a whole model: trace, descend where tracing fails, rebuild.

``optimize_module(model)`` returns a module that shares every parameter, buffer and submodule
object of ``model`` (same ``state_dict`` keys; an optimizer built on either updates both) with the
rewritten parts swapped in:

* if ``model`` traces, its graphs (one per train/eval mode) go through the pipeline and the result
  is an instance of a subclass of ``model``'s class whose ``forward`` runs the rewritten graph;
  every other method and attribute is the user's;
* a module of a class that a module-type rule recognizes (:mod:`fastopt.passes.modules`: PyG's
  attention layers and ``TGNMemory``) is replaced by the rule's module, sharing its parameters
  and buffers, before any tracing;
* otherwise each child is optimized the same way, and ``model`` is shallow-copied with the
  changed children swapped in (the memory updater of a TGN stays eager while its attention
  layers are fused). ``model`` itself is never modified.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from torch import fx, nn

from fastopt.config import patch
from fastopt.errors import TraceError
from fastopt.passes.manager import PassManager
from fastopt.passes.module_rewrite import ModuleReplacement, shared_copy
from fastopt.passes.modules import MODULE_REWRITES, rewrite_module
from fastopt.passes.pipeline import default_pipeline
from fastopt.passes.report import LeftAlone, RewriteReport, Verification
from fastopt.passes.sites import site_shapes
from fastopt.passes.tracing import is_builtin_leaf, trace
from fastopt.passes.verify import verified_call
from fastopt.runtime import attach_graph_runners

__all__ = ["optimize_module", "OptimizedForward"]


class OptimizedForward:
    """Mixin of the optimized classes: ``forward`` runs the rewritten graph of the current mode.

    With ``verify`` on, the first :data:`VERIFY_CALLS` calls also run the user's ``forward`` and
    compare (see :mod:`fastopt.passes.verify`).
    """

    _fastopt_graphs: Dict[bool, fx.GraphModule]
    _fastopt_verify: int = 0
    _fastopt_path: str = "<root>"

    _fastopt_changes: Dict[str, object] = {}
    _fastopt_verification: Optional[Verification] = None  # this module's line of the report

    def _fastopt_run(self, *args, **kwargs):
        gm = self._fastopt_graphs[self.training]
        if self._fastopt_changes:
            with patch(**self._fastopt_changes):
                return type(gm).forward(self, *args, **kwargs)
        return type(gm).forward(self, *args, **kwargs)

    def forward(self, *args, **kwargs):
        if self._fastopt_verify > 0:
            self.__dict__["_fastopt_verify"] = self._fastopt_verify - 1
            original = super().forward  # the user's forward, on the same objects
            self._fastopt_verification.add(*verified_call(
                self, original, self._fastopt_run, args, kwargs,
                f"fastopt.optimize(verify=True): {self._fastopt_path}"))
        return self._fastopt_run(*args, **kwargs)


# Calls compared against eager per rewritten module when verify=True.
VERIFY_CALLS = 2


_CLASSES: Dict[type, type] = {}


def _optimized_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Optimized{cls.__name__}", (OptimizedForward, cls),
                             {"__module__": cls.__module__})
    return _CLASSES[cls]


def _rewritten(module: nn.Module, graphs: Dict[bool, fx.GraphModule], path: str,
               options: dict) -> nn.Module:
    new = shared_copy(module, _optimized_class(type(module)))
    new.__dict__["_fastopt_changes"] = dict(options["changes"])
    new.__dict__["_fastopt_path"] = path or "<root>"
    new.__dict__["_fastopt_verify"] = VERIFY_CALLS if options["verify"] else 0
    if options["verify"]:
        record = Verification(path or "<root>")
        options["report"].verifications.append(record)
        new.__dict__["_fastopt_verification"] = record
    for gm in graphs.values():
        for node in gm.graph.nodes:
            # Tensor constants the tracer lifted (not parameters/buffers of the user's module).
            if node.op == "get_attr" and "." not in node.target and not hasattr(new, node.target):
                object.__setattr__(new, node.target, getattr(gm, node.target))
    new.__dict__["_fastopt_graphs"] = graphs
    return new


def _optimize_traced(module: nn.Module, path: str, report: RewriteReport,
                     make_pipeline, options: dict) -> Optional[nn.Module]:
    """Rewrite a traceable module; None if it does not trace."""
    try:
        traced = {mode: trace(module, mode) for mode in (True, False)}
    except TraceError as exc:
        report.left_alone.append(LeftAlone("trace", path or "<root>", str(exc)))
        return None
    report.traced.append(path or "<root>")
    modes = (True,) if traced[True].code == traced[False].code else (True, False)
    graphs: Dict[bool, fx.GraphModule] = {}
    changed = False
    for mode in modes:
        manager: PassManager = make_pipeline()
        for p in manager.passes:
            p.module_path = path
        label = f"{path or type(module).__name__}.{'train' if mode else 'eval'}"
        graphs[mode], modified = manager(traced[mode], label)
        changed = changed or modified
        for p in manager.passes:
            # A graph traced per mode repeats most findings; list each once.
            report.rewrites.extend(r for r in p.rewrites if r not in report.rewrites)
            report.left_alone.extend(a for a in p.left_alone if a not in report.left_alone)
    graphs.setdefault(False, graphs[True])
    if not changed:
        report.left_alone.append(LeftAlone("optimize", path or "<root>",
                                           "traced, but no pattern matched; kept as it was"))
        return module
    return _rewritten(module, graphs, path, options)


def _optimize(module: nn.Module, path: str, report: RewriteReport, make_pipeline,
              options: dict) -> nn.Module:
    if is_builtin_leaf(module):
        return module
    replaced = rewrite_module(module, path, report, options["module_rules"])
    if replaced is not None:
        if options["verify"] and isinstance(replaced, ModuleReplacement):
            record = Verification(path or "<root>")
            report.verifications.append(record)
            replaced.fastopt_verify(VERIFY_CALLS, record, path or "<root>")
        return replaced
    result = _optimize_traced(module, path, report, make_pipeline, options)
    if result is not None:
        return result
    children = {}
    for name, child in module.named_children():
        sub = f"{path}.{name}" if path else name
        new = _optimize(child, sub, report, make_pipeline, options)
        if new is not child:
            children[name] = new
    if not children:
        return module
    copy_ = shared_copy(module, type(module))
    copy_._modules.update(children)
    return copy_


def optimize_module(model: nn.Module, make_pipeline=default_pipeline,
                    verify: bool = False,
                    changes: Optional[dict] = None) -> Tuple[nn.Module, RewriteReport]:
    """Trace and rewrite ``model`` (see the module docstring).

    Args:
        model: Any ``nn.Module``.
        make_pipeline: Builds a fresh :class:`PassManager` per traced graph.
        verify: Compare each rewritten module against its eager forward on its first calls.
        changes: ``fastopt.config.patch`` keywords the rewritten modules run under.

    Returns:
        ``(optimized, report)``; ``optimized is model`` when nothing was rewritten.
    """
    report = RewriteReport(model=type(model).__name__, site_shapes=site_shapes)
    options = {"verify": verify, "changes": changes or {}, "report": report,
               "module_rules": tuple(rule() for rule in MODULE_REWRITES)}
    optimized = _optimize(model, "", report, make_pipeline, options)
    if not report.passes:
        report.passes = make_pipeline().names
    if not report.rewrites:
        report.left_alone.append(LeftAlone(
            "optimize", "<root>",
            "no fusable attention, aggregation or time encoding found in any traceable part; "
            "the model is returned unchanged"))
        return model, report
    rewritten = [(path, m) for path, m in optimized.named_modules()
                 if path and isinstance(m, OptimizedForward)]
    # module-type rewrites that read their sizes back run their padded per-call work through a
    # runner of their own (e.g. the fused TransformerConv's core)
    inner = []
    for path, m in optimized.named_modules():
        runner = m.__dict__.get("_fastopt_core_runner")
        if runner is not None:
            runner.record.where = f"{path or '<root>'} (padded core)"
            inner.append(runner.record)
    if not rewritten and not isinstance(optimized, OptimizedForward):
        report.graphs = inner
        return optimized, report
    verifying = [m for m in optimized.modules() if isinstance(m, OptimizedForward)] if verify else []
    report.graphs = attach_graph_runners(optimized, rewritten, options["changes"], verifying) + inner
    return optimized, report
