"""CUDA graphs of a module's forward and backward (``config.passes.cuda_graphs``).

At training batch sizes a fused TGNN step is bound by host time (Python, dispatch and one launch
per kernel), not by the GPU. A CUDA graph replays a whole captured forward, or backward, as one
launch. :func:`attach_graph_runners` gives a module and chosen submodules (``fastopt.optimize``
hands it the optimized root and every rewritten, fx-traced, submodule) a :class:`GraphRunner`; on
a call whose tensors are all on CUDA it works like ``torch.cuda.make_graphed_callables``, for any
forward signature:

* **Signature.** The call's arguments are flattened (:mod:`fastopt.runtime.flatten`: tensors,
  lists, tuples, dicts, namedtuples and dataclasses such as :class:`~fastopt.runtime.GraphInputs`;
  other values are constants). One forward/backward graph pair is kept per signature: the
  structure and constants, each tensor's shape, dtype, device and ``requires_grad``, the training
  flag of every submodule, grad mode, autocast and the kernels/passes configuration (a tensor the
  caller pads, :class:`~fastopt.runtime.RowPad`, by its padded shape and pad value). At most
  ``config.passes.max_graphs`` pairs per module, least recently used evicted; ``"auto"`` captures
  a signature on its second call (a one-off shape such as an epoch's last batch never costs a
  capture), ``"on"`` on its first.
* **Capture and replay** of one signature's pair: :mod:`fastopt.runtime.capture`. A call arriving
  while the previous replay of its graph still waits for its backward runs uncaptured (the replay
  would overwrite what that backward reads).
* **Never breaks a model.** A capture that fails (a host sync such as ``.item()``, ``nonzero``
  or ``torch.unique``, a CPU tensor, a forward that assigns other module attributes or writes
  into its inputs: a replay would skip or misdirect those) turns the runner off and is recorded in
  its :class:`GraphCapture` (which ``model.fastopt_report`` lists); the calls run uncaptured. A
  runner stays out of the way while an enclosing runner warms up or captures, so when the whole
  model cannot be captured its rewritten attention layers are captured instead. On CPU, under
  ``torch.compile`` or with ``verify=True`` pending, calls pass through.

Dropout inside a graph stays random: the fused kernels read their Philox key from a device
tensor drawn by the CUDA generator (:func:`fastopt.codegen.dropout_seed`), which a graph replays
as a fresh draw; eager ``nn.Dropout`` is replay-safe in PyTorch itself.

Layering: imports nothing of fastopt but :mod:`fastopt.config` and :mod:`fastopt.errors`; the
passes wrap their result with it, and the report shows the :class:`GraphCapture` records it keeps
up to date.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from fastopt.config import default_config
from fastopt.errors import KernelError
from fastopt.runtime.capture import GraphPair, Uncapturable, end_generator_capture
from fastopt.runtime.flatten import flatten, unflatten
from fastopt.runtime.inputs import GraphInputs
from fastopt.runtime.padding import RowPad, pad_rows

__all__ = [
    "capturing",
    "GraphCapture",
    "GraphRunner",
    "GraphedForward",
    "attach_graph_runners",
    "call_signature",
]

_PLAIN = (Tensor, nn.Parameter)
_LOCAL = threading.local()  # .depth: warm-ups/captures in progress on this thread


def capturing() -> bool:
    """Whether this thread's work is being captured into a CUDA graph: by a graph runner (its
    warm-ups included, so that what the capture launches is compiled and loaded before it) or
    by any capture on the current stream."""
    if getattr(_LOCAL, "depth", 0) > 0:
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# ----------------------------------------------------------------------------------------------
# signatures
# ----------------------------------------------------------------------------------------------

def _tensor_meta(t: Tensor) -> tuple:
    return (t.shape, t.dtype, t.device, t.requires_grad)  # torch.Size: a hashable tuple


def _config_key() -> tuple:
    cfg = default_config()
    return tuple(vars(cfg.kernels).values()) + tuple(vars(cfg.passes).values())


def call_signature(module: nn.Module, spec: tuple, tensors: Sequence[Tensor],
                   modules: Optional[Sequence[nn.Module]] = None,
                   pads: Optional[Sequence[Optional[RowPad]]] = None) -> tuple:
    """The key of the graph pair that serves a call of ``module`` (see the module docstring).

    ``modules`` is ``list(module.modules())`` where the caller holds it already; ``pads`` (one
    per tensor) keys padded tensors by their padded shape and pad value.

    Raises:
        Uncapturable: A constant argument is not hashable.
    """
    modules = module.modules() if modules is None else modules
    # a padded tensor by its padded shape and pad value: calls that pad alike share a graph pair
    metas = tuple(map(_tensor_meta, tensors)) if pads is None else tuple(
        _tensor_meta(t) if p is None else (p.shape(t),) + _tensor_meta(t)[1:] + (p.value,)
        for t, p in zip(tensors, pads))
    key = (spec, metas,
           tuple(m.training for m in modules), torch.is_grad_enabled(),
           torch.is_inference_mode_enabled(), torch.is_autocast_enabled(), _config_key())
    try:
        hash(key)
    except TypeError as exc:
        raise Uncapturable(f"an argument is not hashable ({exc}); CUDA graphs key calls by their "
                           f"non-tensor arguments, so such calls run uncaptured") from None
    return key


class _ModuleState:
    """Where a module's parameters and buffers live: a change (``.to()``, a new Parameter or
    submodule) makes every captured graph stale.

    Walking ``module.modules()`` costs tens of microseconds per call, as much as a small graph's
    device time; the submodule list is kept and walked again only when a kept module's children
    change.
    """

    def __init__(self) -> None:
        self.modules: List[nn.Module] = []
        self._children: tuple = ()

    def key(self, module: nn.Module) -> tuple:
        children = tuple(id(c) for m in self.modules for c in m._modules.values())
        if not self.modules or self.modules[0] is not module or children != self._children:
            self.modules = list(module.modules())
            children = tuple(id(c) for m in self.modules for c in m._modules.values())
            self._children = children
        params = [p for m in self.modules for p in m._parameters.values() if p is not None]
        buffers = [b for m in self.modules for b in m._buffers.values() if b is not None]
        return (children, tuple(map(_data_ptr, params)), tuple(map(_requires_grad, params)),
                tuple(map(_data_ptr, buffers)))


_data_ptr = Tensor.data_ptr
_requires_grad = operator.attrgetter("requires_grad")


def _where_tensors_are(tensors: Sequence[Tensor]) -> Optional[str]:
    """Why these call tensors cannot be captured, or None."""
    if not tensors:
        return "the call has no tensor arguments"
    for t in tensors:
        if type(t) not in _PLAIN:
            return f"an argument is a {type(t).__name__}, not a plain tensor"
        if not t.is_cuda:
            return (f"an argument tensor is on {t.device}; CUDA graphs capture CUDA work only, so "
                    f"the call runs uncaptured")
    return None


@dataclass
class GraphCapture:
    """CUDA-graph state of one module (updated as it runs; the rewrite report lists these).

    Attributes:
        where: Module path (``<root>`` for the model).
        state: ``"waiting for a CUDA call"``, ``"captured"``, ``"not captured"`` or ``"off"``.
        reason: Why it is not captured (a failed capture turns the module's graphs off).
        graphs: Forward/backward graph pairs held now (one per call signature).
        captures: Captures made so far.
        evictions: Graph pairs dropped to stay within ``config.passes.max_graphs``.
    """

    where: str
    state: str = "waiting for a CUDA call"
    reason: str = ""
    graphs: int = 0
    captures: int = 0
    evictions: int = 0

    def __str__(self) -> str:
        if self.state == "captured":
            return (f"{self.where}  captured: {self.graphs} graph pair(s) held, "
                    f"{self.captures} capture(s), {self.evictions} evicted")
        return f"{self.where}  {self.state}" + (f": {self.reason}" if self.reason else "")


# ----------------------------------------------------------------------------------------------
# the per-module runner
# ----------------------------------------------------------------------------------------------


class GraphRunner:
    """Captures and replays the calls of one module (see the module docstring).

    Args:
        record: The report entry this runner keeps up to date.
        changes: The ``fastopt.config.patch`` keywords of ``optimize(config=...)``.
        verifying: Modules whose ``verify`` calls must finish before anything is captured.
    """

    def __init__(self, record: GraphCapture, changes: Optional[dict] = None,
                 verifying: Sequence[nn.Module] = ()) -> None:
        self.record = record
        self.changes = dict(changes or {})
        self._verifying = list(verifying)
        self._graphs: "OrderedDict[tuple, GraphPair]" = OrderedDict()
        self._seen: "OrderedDict[tuple, None]" = OrderedDict()
        self._state: Optional[tuple] = None
        self._module_state = _ModuleState()
        self._off: Optional[str] = None

    # copies of an optimized model start without graphs
    def __deepcopy__(self, memo):
        return GraphRunner(dataclasses.replace(self.record, graphs=0), self.changes)

    def __reduce__(self):
        return (GraphRunner, (dataclasses.replace(self.record, graphs=0), self.changes))

    def _option(self, name: str):
        return self.changes.get(f"passes__{name}", getattr(default_config().passes, name))

    @property
    def held(self) -> int:
        """Graph pairs held now."""
        return len(self._graphs)

    def clear(self) -> int:
        """Drop every graph pair held (their memory pools go with them once nothing else holds
        them); calls capture again as they come. Returns the pairs dropped."""
        dropped = len(self._graphs)
        self._graphs.clear()
        self.record.graphs = 0
        return dropped

    def _give_up(self, reason: str) -> None:
        self._off = reason
        self._graphs.clear()
        self.record.state, self.record.reason, self.record.graphs = "not captured", reason, 0

    def __call__(self, module: nn.Module, plain, args: tuple, kwargs: dict,
                 pads: Sequence[Optional[RowPad]] = (), out_rows: Optional[int] = None):
        """``plain(*args, **kwargs)``, replayed from the graph pair of its signature where one is
        held (captured as the module docstring says).

        ``pads`` (one per positional argument, None for those left as they are) pads tensor
        arguments along their first dimension (:class:`~fastopt.runtime.padding.RowPad`): the
        graph is keyed and captured on the padded shapes, and a replay writes each call's rows and
        the padding straight into its static inputs. ``out_rows`` trims every output (each must
        have a first dimension) to its first rows. Calls that do not replay pad and trim the same
        way around ``plain``."""
        if pads or out_rows is not None:
            fallback = functools.partial(_padded_call, plain, pads, out_rows)
        else:
            fallback = plain
        mode = self._option("cuda_graphs")
        if mode == "off":
            self.record.state, self.record.reason = "off", "config.passes.cuda_graphs = 'off'"
            return fallback(*args, **kwargs)
        # inside any capture (a runner's warm-ups or an enclosing whole-step graph) run the plain code
        if self._off is not None or capturing() or torch.compiler.is_compiling():
            return fallback(*args, **kwargs)
        if self._verifying:
            if any(m.__dict__.get("_fastopt_verify", 0) > 0 for m in self._verifying):
                return fallback(*args, **kwargs)
            self._verifying = []
        for a in args:  # rows another stream still reads join here: before they are keyed or copied in
            if isinstance(a, GraphInputs):
                a.edges_ready()
        tensors, spec = flatten((args, kwargs))
        row_pads = _row_pads(args, pads, tensors) if pads else None
        where = _where_tensors_are(tensors)
        if where is not None:
            if self.record.state != "captured":
                self.record.state, self.record.reason = "not captured", where
            return fallback(*args, **kwargs)
        state = self._module_state.key(module)
        try:
            key = call_signature(module, spec, tensors, self._module_state.modules, row_pads)
        except Uncapturable as exc:
            self.record.reason = str(exc)
            return fallback(*args, **kwargs)
        if state != self._state:
            self._graphs.clear()
            self._state = state
        graphs = self._graphs.get(key)
        if graphs is None:
            if mode == "auto" and key not in self._seen:
                self._seen[key] = None
                while len(self._seen) > 4 * self._option("max_graphs"):
                    self._seen.popitem(last=False)
                return fallback(*args, **kwargs)
            graphs = self._capture(module, plain, spec, tensors if row_pads is None else
                                   [_padded(t, p) for t, p in zip(tensors, row_pads)])
            if graphs is None:
                return fallback(*args, **kwargs)
            self._graphs[key] = graphs
            while len(self._graphs) > self._option("max_graphs"):
                self._graphs.popitem(last=False)
                self.record.evictions += 1
            self.record.graphs = len(self._graphs)
        else:
            self._graphs.move_to_end(key)
        if graphs.pending():
            return fallback(*args, **kwargs)
        return graphs.run(tensors, row_pads, out_rows)

    def _capture(self, module: nn.Module, plain, spec: tuple,
                 tensors: Sequence[Tensor]) -> Optional[GraphPair]:
        _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
        try:
            graphs = GraphPair.capture(module, plain, spec, tensors)
        except Exception as exc:  # noqa: BLE001 - any failure means "run uncaptured"
            reason = str(exc) if isinstance(exc, Uncapturable) else \
                f"capture failed: {type(exc).__name__}: {_first_line(exc)}"
            self._give_up(reason)
            end_generator_capture(tensors[0].device)
            return None
        finally:
            _LOCAL.depth -= 1
        self.record.state, self.record.reason = "captured", ""
        self.record.captures += 1
        return graphs


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""


def _padded(t: Tensor, pad: Optional[RowPad]) -> Tensor:
    if pad is None:
        return t
    pad.check(t)
    return pad_rows(t, pad.rows - t.shape[0], pad.value)


def _row_pads(args: tuple, pads: Sequence[Optional[RowPad]], tensors: Sequence[Tensor]) -> list:
    """The :class:`RowPad` of each flattened tensor (None where unpadded), checked: by position,
    so that a tensor passed twice is padded where its pad says and left alone elsewhere, as
    :func:`_padded_call` does. ``flatten((args, kwargs))`` lists the positional arguments'
    tensors first, in order."""
    out: list = []
    for i, a in enumerate(args):
        pad = pads[i] if i < len(pads) else None
        if isinstance(a, Tensor):
            if pad is not None:
                pad.check(a)
            out.append(pad)
        elif pad is not None:
            raise KernelError(f"a RowPad was given for a {type(a).__name__} argument; pad tensor "
                              f"arguments only (pass None for argument {i})")
        else:
            out += [None] * len(flatten(a)[0])
    return out + [None] * (len(tensors) - len(out))


def _padded_call(plain, pads: Sequence[Optional[RowPad]], out_rows: Optional[int], *args, **kwargs):
    """``plain`` on padded arguments, its outputs trimmed: a call the runner does not replay."""
    padded = [_padded(a, pad) for a, pad in itertools.zip_longest(args, pads[:len(args)])]
    out = plain(*padded, **kwargs)
    if out_rows is None:
        return out
    tensors, spec = flatten(out)
    return unflatten(spec, [t[:out_rows] for t in tensors])


# ----------------------------------------------------------------------------------------------
# wiring into the optimized model
# ----------------------------------------------------------------------------------------------


class GraphedForward:
    """Mixin: ``forward`` goes through the instance's :class:`GraphRunner`."""

    def forward(self, *args, **kwargs):
        runner = self.__dict__.get("_fastopt_graph_runner")
        if runner is None:
            return super().forward(*args, **kwargs)
        return runner(self, super().forward, args, kwargs)


_CLASSES: Dict[type, type] = {}


def _graphed_class(cls: type) -> type:
    if issubclass(cls, GraphedForward):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (GraphedForward, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


def drop_graphs(module: nn.Module) -> int:
    """:meth:`GraphRunner.clear` for every runner of ``module`` and its submodules: what a check
    that ran the model in eval mode (``fastopt.verify_against_eager``) captured and training never
    replays. Returns the pairs dropped."""
    return sum(value.clear() for m in module.modules() for value in list(m.__dict__.values())
               if isinstance(value, GraphRunner))


def attach_graph_runners(optimized: nn.Module, owned: Sequence[Tuple[str, nn.Module]],
                         changes: Optional[dict], verifying: Sequence[nn.Module]) -> List[GraphCapture]:
    """Give ``optimized`` and each module of ``owned`` a :class:`GraphRunner`.

    Args:
        optimized: The optimized root (a new object, never the user's model).
        owned: ``(path, module)`` of the rewritten submodules: objects the optimizer created.
        changes: ``optimize(config=...)`` patch keywords.
        verifying: Modules with pending ``verify`` calls.

    Returns:
        The report entries, root first.
    """
    records = []
    for path, module in [("<root>", optimized), *owned]:
        if "_fastopt_graph_runner" in module.__dict__:
            continue
        record = GraphCapture(path)
        module.__class__ = _graphed_class(type(module))
        module.__dict__["_fastopt_graph_runner"] = GraphRunner(record, changes, verifying)
        records.append(record)
    return records
