"""Whole training steps replayed from CUDA graphs: forward, loss, backward, optimizer step and the
state write-back as one launch.

At training batch sizes a TGNN step is a few hundred small kernels; launched one by one from
Python the host, not the GPU, sets the pace. :class:`StepGraphs` captures the whole step of a
batch shape once and replays it for every later batch of that shape, the way PyTorch's
whole-network capture does:

* **Signature.** A step is keyed by the shapes and dtypes of its input tensors and a hashable
  constant (the batch size). The first ``warmup`` steps of a signature (default one) run eagerly
  (they are real training steps: kernels compile, the optimizer creates its state, libraries
  allocate their workspaces); the next one is captured into a graph and replayed at once for its own batch;
  later ones copy their inputs into the graph's static buffers and replay. At most
  ``max_graphs`` signatures are kept (least recently used evicted); the graphs share one memory
  pool.
* **What the step may do.** Anything without a host synchronization or a CPU tensor: the
  optimizer must be capturable (``torch.optim.Adam(capturable=True)``), gradients are set to
  None at the start of the step so that the backward allocates them inside the graph, and state
  updates write into existing tensors (buffers keep their addresses). Dropout stays random: the
  CUDA generator hands each replay fresh offsets.
* **Never breaks training.** A capture that fails (a sync, an allocation the graph cannot make)
  turns the graphs off with the reason in :attr:`StepGraphs.disabled`, and that batch and all
  later ones run eagerly.

The returned tensors belong to the graph: the next replay of the same graph overwrites them, so
use (or enqueue work on) them before the next step.

Layering: imports only :mod:`fastopt.runtime.capture`.
"""

from __future__ import annotations

import traceback
import warnings
from collections import OrderedDict
from typing import Callable, Hashable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fastopt.runtime.capture import capture_into, end_generator_capture

__all__ = ["StepGraphs"]


class _Entry:
    __slots__ = ("seen", "graph", "static", "out")

    def __init__(self) -> None:
        self.seen = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.static: List[Tensor] = []
        self.out = None


class StepGraphs:
    """Captured training steps, one CUDA graph per input signature.

    Args:
        step: ``step(tensors, constant) -> outputs``; runs one whole step on the current stream.
        warmup: eager steps of a signature before it is captured.
        max_graphs: signatures kept.
    """

    def __init__(self, step: Callable[[List[Tensor], Hashable], object], *, warmup: int = 1, max_graphs: int = 4) -> None:
        self.step = step
        self.warmup = int(warmup)
        self.max_graphs = int(max_graphs)
        self.disabled: Optional[str] = None
        self.disabled_trace = ""
        self.captures = 0
        self.replays = 0
        self._entries: "OrderedDict[Hashable, _Entry]" = OrderedDict()
        self._pool = None

    @property
    def signatures(self) -> int:
        """Input signatures kept (captured or still running eagerly)."""
        return len(self._entries)

    def graphs(self) -> List[torch.cuda.CUDAGraph]:
        """The captured graphs, least recently used first."""
        return [e.graph for e in self._entries.values() if e.graph is not None]

    def __call__(self, tensors: Sequence[Tensor], constant: Hashable = None):
        tensors = list(tensors)
        if self.disabled is not None or not all(t.is_cuda for t in tensors):
            return self.step(tensors, constant)
        key = (constant, tuple((tuple(t.shape), t.dtype, t.device) for t in tensors))
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
        self._entries.move_to_end(key)
        if entry.graph is not None:
            _copy_into(entry.static, tensors)
            entry.graph.replay()
            self.replays += 1
            return entry.out
        entry.seen += 1
        if entry.seen <= self.warmup:
            return self.step(tensors, constant)
        self._evict()
        return self._capture(entry, tensors, constant)

    def _evict(self) -> None:
        captured = [k for k, e in self._entries.items() if e.graph is not None]
        while len(captured) >= self.max_graphs:
            self._entries.pop(captured.pop(0))

    def _capture(self, entry: _Entry, tensors: List[Tensor], constant: Hashable):
        static = [t.clone() for t in tensors]
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            with capture_into(graph, self._pool):  # (the loader's threads keep staging meanwhile)
                out = self.step(static, constant)
        except Exception as exc:  # a step that cannot be captured runs eagerly from now on
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            self.disabled = (f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
                             f"(at {frame.filename}:{frame.lineno} in {frame.name})")
            self.disabled_trace = "".join(traceback.format_exception(exc))
            self._entries.clear()
            warnings.warn(f"fastopt: whole-step CUDA graphs are off for this run ({self.disabled}); "
                          f"steps run eagerly", RuntimeWarning, stacklevel=3)
            # else the generator stays in capture mode and every later random draw fails
            end_generator_capture(tensors[0].device if tensors else torch.device("cuda"))
            return self.step(tensors, constant)
        entry.graph, entry.static, entry.out = graph, static, out
        self.captures += 1
        graph.replay()  # the capture recorded the step; this runs it for the batch at hand
        self.replays += 1
        return out


def _copy_into(static: List[Tensor], tensors: List[Tensor]) -> None:
    """One multi-tensor copy per dtype."""
    groups: dict = {}
    for s, t in zip(static, tensors):
        dst, src = groups.setdefault(s.dtype, ([], []))
        dst.append(s)
        src.append(t)
    for dst, src in groups.values():
        torch._foreach_copy_(dst, src)
