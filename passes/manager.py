"""The pass manager: runs the declarative pipeline over one traced graph.

Each pass is a callable object with a ``name`` taking a ``GraphModule`` and returning
``(graph_module, modified)``. A pass that raises is reported as a :class:`TraceError` naming the
pass and the passes that ran before it. With ``FASTOPT_DUMP_GRAPHS=dir`` set, the graph before and
after every pass is written to ``dir`` as readable text (``<module>.<mode>.<NN>.<pass>.before.txt``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, List, Sequence, Tuple

from torch import fx

from fastopt.errors import TraceError

__all__ = ["PassManager", "DUMP_ENV"]

DUMP_ENV = "FASTOPT_DUMP_GRAPHS"


def _dump(directory: str, stem: str, gm: fx.GraphModule) -> None:
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    text = f"{gm.graph}\n\n# generated code\n{gm.code}"
    (path / f"{stem}.txt").write_text(text)


class PassManager:
    """Runs ``passes`` in order on a graph module.

    Args:
        passes: Pass objects (each has ``name`` and ``__call__(gm) -> (gm, modified)``).
    """

    def __init__(self, passes: Sequence[Callable]) -> None:
        self.passes = list(passes)

    @property
    def names(self) -> List[str]:
        return [p.name for p in self.passes]

    def __call__(self, gm: fx.GraphModule, label: str = "module") -> Tuple[fx.GraphModule, bool]:
        dump = os.environ.get(DUMP_ENV, "")
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", label)
        modified = False
        ran: List[str] = []
        for i, p in enumerate(self.passes):
            stem = f"{safe}.{i:02d}.{p.name}"
            if dump:
                _dump(dump, f"{stem}.before", gm)
            try:
                gm, changed = p(gm)
            except Exception as exc:
                before = ", ".join(ran) or "none"
                raise TraceError(
                    f"pass {p.name} failed on {label} (passes run before it: {before}): "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            ran.append(p.name)
            modified = modified or changed
            if dump:
                _dump(dump, f"{stem}.after", gm)
        return gm, modified
