"""Module-type rewrites: layers torch.fx cannot trace, replaced by class.

Some widely used layers cannot be traced (PyG's ``MessagePassing`` layers take an ``edge_index``
whose size decides the computation; ``TGNMemory`` keeps Python-side state). The optimizer asks
:func:`rewrite_module` about every module before it tries to trace it: a module whose class a
rule of :data:`MODULE_REWRITES` recognizes, with options the rule supports, is replaced by a
module built by the rule, which shares its parameters, buffers and submodules (same
``state_dict`` keys) and runs on fastopt's operators; a module with options the rule does not
handle is left as it is, with the reason in the report. Calls a replacement cannot take (an
option given per call, such as ``return_attention_weights``) run the original forward.

A rule whose package is not installed recognizes nothing (the PyG rules need ``torch_geometric``,
the extra ``fastopt[pyg]``). Order: before tracing; a replaced module is not traced or descended
into.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from fastopt.passes.module_rewrite import ModuleRewrite
from fastopt.passes.pyg_conv import FuseGatConv, FuseGatv2Conv, FuseTransformerConv
from fastopt.passes.pyg_memory import TensorizeTgnMemory
from fastopt.passes.report import LeftAlone, Rewrite, RewriteReport

__all__ = ["MODULE_REWRITES", "rewrite_module"]


MODULE_REWRITES = (FuseTransformerConv, FuseGatConv, FuseGatv2Conv, TensorizeTgnMemory)
"""The rules, in the order they are asked."""


def rewrite_module(module: nn.Module, path: str, report: RewriteReport,
                   rules: Sequence[ModuleRewrite]) -> Optional[nn.Module]:
    """The replacement of ``module`` if one of ``rules`` recognizes its class, else None.

    A recognized module with unsupported options comes back unchanged (and is not traced), with
    a :class:`LeftAlone` entry; a subclass of a recognized class is not recognized (it may
    override what the replacement reimplements) and is reported when nothing else handles it.
    """
    where = path or "<root>"
    for rule in rules:
        classes = rule.classes()
        if isinstance(module, rule.replacement):
            report.left_alone.append(LeftAlone(rule.name, where, "already optimized (a module "
                                                                 "this rule built); kept as it is"))
            return module
        if type(module) in classes:
            reason = rule.unsupported(module)
            if reason is not None:
                report.left_alone.append(LeftAlone(rule.name, where, reason))
                return module
            rule.matches += 1
            report.rewrites.append(Rewrite(rule.describe(module), where, rule.op))
            return rule.build(module)
        if classes and isinstance(module, classes):
            base = next(c for c in classes if isinstance(module, c))
            report.left_alone.append(LeftAlone(
                rule.name, where, f"{type(module).__name__} subclasses {base.__name__}, whose "
                f"replacement would bypass what the subclass overrides; kept as it was"))
    return None
