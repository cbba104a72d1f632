"""The base of module-type rewrites (see :mod:`fastopt.passes.modules` for how they run)."""

from __future__ import annotations

import copy
from typing import Optional, Tuple

from torch import nn

from fastopt.passes.report import Verification
from fastopt.passes.verify import verified_call

__all__ = ["ModuleRewrite", "ModuleReplacement", "shared_copy"]


class ModuleReplacement:
    """Mixin of replacement classes: ``forward`` runs ``_fastopt_forward``; with
    ``optimize(verify=True)`` the first calls also run the layer's own forward and compare
    (:func:`fastopt.passes.verify.verified_call`), counting in the report's ``Verification``.
    Place it first: ``type(name, (Mixin, ModuleReplacement..., cls))`` reaches ``cls.forward``
    as the original."""

    _fastopt_verify = 0
    _fastopt_verification: Optional[Verification] = None
    _fastopt_path = "<root>"

    def _fastopt_forward(self, *args, **kwargs):
        raise NotImplementedError

    def _fastopt_original(self, *args, **kwargs):
        """The replaced class's own forward."""
        return super().forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        if self._fastopt_verify > 0:
            self.__dict__["_fastopt_verify"] = self._fastopt_verify - 1
            self._fastopt_verification.add(*verified_call(
                self, self._fastopt_original, self._fastopt_forward, args, kwargs,
                f"fastopt.optimize(verify=True): {self._fastopt_path}"))
        return self._fastopt_forward(*args, **kwargs)

    def fastopt_verify(self, calls: int, record: Verification, path: str) -> None:
        """Compare the next ``calls`` calls against the original forward into ``record``."""
        self.__dict__.update(_fastopt_verify=calls, _fastopt_verification=record,
                             _fastopt_path=path)


class ModuleRewrite:
    """A rule replacing modules of some classes.

    Subclasses set ``name`` (a verb phrase, shown in the report), ``op`` (the operator the
    replacement runs) and implement :meth:`classes`, :meth:`unsupported` and :meth:`build`.
    ``matches`` counts the modules replaced.
    """

    name = "rewrite_module"
    op = ""
    replacement: type = type(None)  # the mixin of the modules it builds (recognized as done)

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
