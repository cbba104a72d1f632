"""The base of module-type rewrites (see :mod:`fastopt.passes.modules` for how they run)."""

from __future__ import annotations

import copy
from typing import Optional, Tuple

from torch import nn

__all__ = ["ModuleRewrite", "shared_copy"]


class ModuleRewrite:
    """A rule replacing modules of some classes.

    Subclasses set ``name`` (a verb phrase, shown in the report), ``op`` (the operator the
    replacement runs) and implement :meth:`classes`, :meth:`unsupported` and :meth:`build`.
    ``matches`` counts the modules replaced.
    """

    name = "rewrite_module"
    op = ""

    def __init__(self) -> None:
        self.matches = 0

    def classes(self) -> Tuple[type, ...]:
        """The exact classes recognized (empty when their package is not installed)."""
        raise NotImplementedError

    def unsupported(self, module: nn.Module) -> Optional[str]:
        """Why ``module`` cannot be replaced, or None."""
        raise NotImplementedError

    def describe(self, module: nn.Module) -> str:
        """The report's pattern name of ``module``'s options."""
        return type(module).__name__

    def build(self, module: nn.Module) -> nn.Module:
        """The replacement of ``module`` (sharing its parameters, buffers and submodules)."""
        raise NotImplementedError


def shared_copy(module: nn.Module, cls: type) -> nn.Module:
    """A new ``cls`` object sharing ``module``'s parameters, buffers, submodules and attributes.

    The registries (parameters, buffers, submodules, hooks, the set of non-persistent buffers)
    are copied, so that changing the copy's structure does not change the user's module; the
    tensors and modules in them are the same objects.
    """
    new = object.__new__(cls)
    new.__dict__.update({k: copy.copy(v) if isinstance(v, (dict, set)) else v
                         for k, v in module.__dict__.items()})
    return new
