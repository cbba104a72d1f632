"""The problem shape each rewrite site ran with first, for the report's kernel lines.

A rewrite gives the call it inserts a ``site`` key (:meth:`~fastopt.passes.pattern.RewritePass.new_site`);
the lowering function it calls records the sizes of its first fused call under that key
(:func:`record`), and the optimizer hands :func:`site_shapes` to the report, which shows the
kernel configuration chosen for that shape. An empty record means the first call declined and ran
the code it replaced (the factored time encoding, whose conditions are checked per call).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

__all__ = ["record", "site_shapes"]

_SHAPES: Dict[str, Tuple[int, ...]] = {}


def site_shapes(site: str) -> Optional[Tuple[int, ...]]:
    """The sizes the rewrite ``site`` ran with first (``(K, H, d)`` for attention), or None
    before its first call."""
    return _SHAPES.get(site)


def record(site: str, shape: Tuple[int, ...]) -> None:
    """Keep ``shape`` for ``site`` unless the site has a record already."""
    if site and site not in _SHAPES:
        _SHAPES[site] = shape
