"""Progress bars that draw only where a bar can be seen: a terminal or a notebook.

Layering: imports nothing of fastopt.
"""

from __future__ import annotations

import sys
from typing import Optional, Union

__all__ = ["progress_bar"]


def progress_bar(iterable, desc: str, enabled: Union[bool, str], total: Optional[int] = None,
                 leave: bool = False):
    """A tqdm bar over ``iterable`` (None: advanced by ``update()``) where one can be drawn: with
    ``enabled is True`` on a terminal or in a notebook. Elsewhere an object with the same methods
    that draws nothing and whose ``disable`` is True, so that the caller prints its lines instead
    (a log file or pipe gets lines, not bar redraws)."""
    if enabled is not True or not (_isatty(sys.stderr) or _in_notebook()):
        return _Quiet(iterable)
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=leave, dynamic_ncols=True)


def _isatty(stream) -> bool:
    return bool(getattr(stream, "isatty", None) and stream.isatty())


def _in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (whose output streams are no terminals)."""
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)()
    return type(shell).__name__ == "ZMQInteractiveShell"


class _Quiet:
    disable = True

    def __init__(self, iterable) -> None:
        self._it = iterable

    def __iter__(self):
        return iter(self._it)

    def _nothing(self, *args, **kwargs) -> None:
        pass

    set_postfix = set_postfix_str = update = close = _nothing
