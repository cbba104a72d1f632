"""Attributes a package loads when they are first asked for (module ``__getattr__``, PEP 562).

The top package and the tuner bind their light names at import and name the rest here, so that
importing them loads no more than their ground floor.
"""

from __future__ import annotations

from importlib import import_module
from typing import Callable, Dict, List, Tuple


def lazy_attributes(package: str, lazy: Dict[str, str],
                    namespace: dict) -> Tuple[Callable[[str], object], Callable[[], List[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose names in ``lazy`` (name -> module) load on
    first use and are then bound in ``namespace`` (the package's ``globals()``)."""

    def __getattr__(name: str):
        if name not in lazy:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(lazy[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> List[str]:
        return sorted(set(namespace) | set(lazy))

    return __getattr__, __dir__
