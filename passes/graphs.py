"""CUDA graphs of an optimized model's forward and backward (``config.passes.cuda_graphs``).

At training batch sizes a fused TGNN step is bound by host time (Python, dispatch and one launch
per kernel), not by the GPU. A CUDA graph replays a whole captured forward, or backward, as one
launch. :func:`attach_graph_runners` gives the optimized root and every rewritten (fx-traced)
submodule a :class:`GraphRunner`; on a call whose tensors are all on CUDA it works like
``torch.cuda.make_graphed_callables``, for any forward signature:

* **Signature.** The call's arguments are flattened (tensors, lists, tuples, dicts, namedtuples
  and dataclasses such as :class:`~fastopt.models.GraphInputs`; other values are constants). One
  forward/backward graph pair is kept per signature: the structure and constants, each tensor's
  shape, dtype, device and ``requires_grad``, the training flag of every submodule, grad mode,
  autocast and the kernels/passes configuration. At most ``config.passes.max_graphs`` pairs per
  module, least recently used evicted; ``"auto"`` captures a signature on its second call (a
  one-off shape such as an epoch's last batch never costs a capture), ``"on"`` on its first.
* **Capture.** Inputs are copied into static buffers; two warm-up calls (forward and
  ``autograd.grad``) run on a side stream with the module's buffers restored afterwards; the
  forward is captured, then the backward of every differentiable output with respect to the
  inputs that require grad and the module's trainable parameters, into one memory pool.
* **Replay.** Inputs are copied in, the forward graph replays and the outputs are returned as
  fresh tensors (callers may keep them across calls). An ``autograd.Function`` connects them to
  the graph: its backward copies the incoming gradients into static buffers, replays the
  backward graph and returns the gradients of inputs and parameters from one fresh flat buffer
  per dtype (captured in the graph), so ``.grad`` accumulates exactly as in eager mode and never
  aliases graph memory. A call arriving while the previous replay of its graph still waits for
  its backward runs uncaptured (the replay would overwrite what that backward reads).
* **Attribute writes.** A forward that stores tensors on its module (TGN keeps the batch's
  updated memory for ``commit``) is captured when those tensors live on the graph's device: each
  replay re-assigns the attribute to the same tensors, detached, which then hold that replay's
  values (:func:`replayable_writes`).
* **Never breaks a model.** A capture that fails (a host sync such as ``.item()``, ``nonzero``
  or ``torch.unique``, a CPU tensor, a forward that assigns other module attributes or writes
  into its inputs: a replay would skip or misdirect those) turns the runner off and is recorded in
  ``model.fastopt_report``; the calls run uncaptured. A runner stays out of the way while an
  enclosing runner warms up or captures, so when the whole model cannot be captured its
  rewritten attention layers are captured instead. On CPU, under ``torch.compile`` or with ``verify=True`` pending, calls pass through.

Dropout inside a graph stays random: the fused kernels read their Philox key from a device
tensor drawn by the CUDA generator (:func:`fastopt.codegen.dropout_seed`), which a graph replays
as a fresh draw; eager ``nn.Dropout`` is replay-safe in PyTorch itself.

Runs after the rewrites (it wraps their result) and imports nothing of the passes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import threading
import weakref
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from fastopt.config import default_config
from fastopt.errors import TraceError
from fastopt.passes.report import GraphCapture

__all__ = [
    "capturing",
    "GraphRunner",
    "GraphedForward",
    "attach_graph_runners",
    "flatten",
    "unflatten",
    "call_signature",
    "Uncapturable",
    "WARMUP_CALLS",
]

# Forward+backward calls on a side stream before a capture (lazy initialization, Triton
# compilation and cuBLAS workspaces happen there, never inside the capture).
WARMUP_CALLS = 2

_PLAIN = (Tensor, nn.Parameter)
_LOCAL = threading.local()  # .depth: warm-ups/captures in progress on this thread


def capturing() -> bool:
    """Whether this thread's work is being captured into a CUDA graph: by a graph runner (its
    warm-ups included, so that what the capture launches is compiled and loaded before it) or
    by any capture on the current stream."""
    if getattr(_LOCAL, "depth", 0) > 0:
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Uncapturable(Exception):
    """A call or a module that cannot be captured; the message says why."""


# ----------------------------------------------------------------------------------------------
# flattening and signatures
# ----------------------------------------------------------------------------------------------

_TENSOR = "T"


def flatten(obj: Any) -> Tuple[List[Tensor], tuple]:
    """``(tensors, spec)``: every tensor in ``obj`` in order, and a hashable description of the rest.

    Lists, tuples, namedtuples, dicts and dataclass instances are descended into; tensors become
    leaves; any other value is a constant of the spec (compared by value, so it must be
    hashable for the spec to be). :func:`unflatten` rebuilds ``obj`` from a spec and tensors.
    """
    leaves: List[Tensor] = []
    return leaves, _flatten(obj, leaves)


def _flatten(obj: Any, leaves: List[Tensor]):
    if isinstance(obj, Tensor):
        leaves.append(obj)
        return _TENSOR
    kind = type(obj)
    if kind is list or kind is tuple:
        return (kind.__name__, tuple(_flatten(x, leaves) for x in obj))
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return ("namedtuple", kind, tuple(_flatten(x, leaves) for x in obj))
    if kind is dict:
        keys = tuple(obj)
        return ("dict", keys, tuple(_flatten(obj[k], leaves) for k in keys))
    names = _FIELD_NAMES.get(kind, False)
    if names is False:
        names = _FIELD_NAMES[kind] = (tuple(f.name for f in dataclasses.fields(kind))
                                      if dataclasses.is_dataclass(kind) else None)
    if names is not None:
        return ("dataclass", kind, names, tuple(_flatten(getattr(obj, n), leaves) for n in names))
    return ("const", kind, obj)


# field names per argument type, None where it is no dataclass (dataclasses.fields() costs
# microseconds a call)
_FIELD_NAMES: Dict[type, Optional[tuple]] = {}


def unflatten(spec: tuple, tensors: Sequence[Tensor]) -> Any:
    """The object :func:`flatten` described by ``spec``, with ``tensors`` as its leaves."""
    it = iter(tensors)
    out = _unflatten(spec, it)
    if next(it, None) is not None:
        raise TraceError(f"unflatten got more tensors than the spec holds ({len(tensors)}); "
                         f"pass the tensors flatten returned with this spec")
    return out


def _unflatten(spec, it: Iterator[Tensor]):
    if spec is _TENSOR or spec == _TENSOR:
        try:
            return next(it)
        except StopIteration:
            raise TraceError("unflatten ran out of tensors; pass the tensors flatten returned "
                             "with this spec") from None
    tag = spec[0]
    if tag == "list":
        return [_unflatten(s, it) for s in spec[1]]
    if tag == "tuple":
        return tuple(_unflatten(s, it) for s in spec[1])
    if tag == "namedtuple":
        return spec[1](*(_unflatten(s, it) for s in spec[2]))
    if tag == "dict":
        return {k: _unflatten(s, it) for k, s in zip(spec[1], spec[2])}
    if tag == "dataclass":
        fields = {n: _unflatten(s, it) for n, s in zip(spec[2], spec[3])}
        init = {f.name for f in dataclasses.fields(spec[1]) if f.init}
        obj = spec[1](**{n: v for n, v in fields.items() if n in init})
        for n, v in fields.items():
            if n not in init:
                object.__setattr__(obj, n, v)
        return obj
    return spec[2]


def _tensor_meta(t: Tensor) -> tuple:
    return (t.shape, t.dtype, t.device, t.requires_grad)  # torch.Size: a hashable tuple


def _config_key() -> tuple:
    cfg = default_config()
    return tuple(vars(cfg.kernels).values()) + tuple(vars(cfg.passes).values())


def call_signature(module: nn.Module, spec: tuple, tensors: Sequence[Tensor],
                   modules: Optional[Sequence[nn.Module]] = None) -> tuple:
    """The key of the graph pair that serves a call of ``module`` (see the module docstring).

    ``modules`` is ``list(module.modules())`` where the caller holds it already.

    Raises:
        Uncapturable: A constant argument is not hashable.
    """
    modules = module.modules() if modules is None else modules
    key = (spec, tuple(_tensor_meta(t) for t in tensors),
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


# ----------------------------------------------------------------------------------------------
# one captured signature
# ----------------------------------------------------------------------------------------------


class _Backward:
    """Marks a replay whose backward has not run yet (dies with the replay's autograd node)."""

    __slots__ = ("done", "__weakref__")

    def __init__(self) -> None:
        self.done = False


_REGISTRIES = ("_parameters", "_buffers", "_modules")


def _attributes(m: nn.Module) -> dict:
    """Every attribute of ``m`` by name; registered ones as ``"_buffers.name"`` and so on."""
    attrs = {k: v for k, v in m.__dict__.items() if k not in _REGISTRIES}
    for reg in _REGISTRIES:
        attrs.update({f"{reg}.{k}": v for k, v in m.__dict__.get(reg, {}).items()})
    return attrs


def _snapshot(module: nn.Module) -> list:
    """References to every attribute of every submodule, to detect writes by the forward."""
    return [(m, _attributes(m)) for m in module.modules()]


def _attribute_writes(before: list) -> List[Tuple[nn.Module, str, Any]]:
    """Every attribute (re)assigned since ``before``: ``(module, key, new value)``.

    Keys of registered parameters, buffers and submodules read ``"_buffers.name"`` and so on;
    a deleted attribute's value is ``_Backward`` (a sentinel no forward can assign).
    """
    changes = []
    for m, attrs in before:
        now = _attributes(m)
        for name in sorted(set(attrs) | set(now)):
            if attrs.get(name, _Backward) is not now.get(name, _Backward):
                changes.append((m, name, now.get(name, _Backward)))
    return changes


_NOT_REPLAYABLE = object()


class _WrittenByForward:
    """Stands in, during a capture, for an attribute the warm-up calls wrote.

    A forward that reads its own earlier write would bake the address of the warm-up's tensor into
    the graph, and replays would keep reading that stale tensor; with this in its place the read
    fails (it is no tensor), the capture fails and the module runs uncaptured.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "<attribute written by the forward; unreadable during CUDA-graph capture>"


def _detached(value: Any, device: torch.device) -> Any:
    """``value`` with its tensors detached, if it holds only tensors on ``device`` that need no
    gradient (in tuples or lists) or None; else :data:`_NOT_REPLAYABLE`."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        # a tensor with a gradient path (an auxiliary loss, say) would lose it on replay
        ok = value.device == device and not value.requires_grad
        return value.detach() if ok else _NOT_REPLAYABLE
    if type(value) in (tuple, list):
        items = [_detached(v, device) for v in value]
        if any(v is _NOT_REPLAYABLE for v in items):
            return _NOT_REPLAYABLE
        return type(value)(items)
    return _NOT_REPLAYABLE


def replayable_writes(changes: Sequence[Tuple[nn.Module, str, Any]], device: torch.device
                      ) -> Tuple[List[Tuple[nn.Module, str, Any]], Optional[str]]:
    """The attribute writes a replay can redo, or the name of the first one it cannot.

    A plain attribute that the captured forward set to tensors on the graph's device that need no
    gradient (alone, in tuples or lists, or None) is re-assigned after every replay to the same
    tensors: they live in the graph's memory (or are its static inputs), so after a replay they
    hold that replay's values, until the next replay of the same graph overwrites them. TGN keeps
    the updated memory of a batch's roots this way for ``commit`` (under ``no_grad``). Anything
    else (a tensor with a gradient path, another Python value, a CPU tensor, a registered
    parameter, buffer or submodule, a deleted attribute) would be lost or skipped by a replay,
    so the call signature is not captured. A forward that also *reads* such an attribute (its
    own earlier write, as recurrent state would) is refused at capture too: see
    :class:`_WrittenByForward`.
    """
    writes = []
    for module, key, value in changes:
        name = f"{type(module).__name__}.{key.split('.')[-1]}"
        if "." in key or value is _Backward:
            return [], name
        value = _detached(value, device)
        if value is _NOT_REPLAYABLE:
            return [], name
        writes.append((module, key, value))
    return writes, None


@contextlib.contextmanager
def _aliased_parameters(module: nn.Module, params: Sequence[Tensor]):
    """Swap every trainable parameter for a fresh leaf sharing its storage, while capturing.

    A parameter's ``AccumulateGrad`` node lives as long as any autograd graph that used it, and
    remembers the stream it was made on: one made by an eager call (default stream) would make
    the captured backward wait on the default stream, which a capture cannot do. Fresh leaves
    get fresh nodes on the capture stream; sharing storage, the graph still reads the parameters'
    current values (in-place optimizer steps included). Yields the leaves in ``params`` order.
    """
    alias: Dict[int, Tensor] = {}
    swaps = []
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.requires_grad:
                if id(p) not in alias:
                    alias[id(p)] = p.detach().requires_grad_()
                swaps.append((m, name, p))
                m._parameters[name] = alias[id(p)]
    try:
        yield [alias[id(p)] for p in params]
    finally:
        for m, name, p in swaps:
            m._parameters[name] = p


def _end_generator_capture(device: torch.device) -> None:
    """Leave the CUDA generator out of capture mode after a failed capture.

    A capture that fails never reaches the generator's capture epilogue, and every later random
    draw would fail ("Offset increment outside graph capture"); an empty successful capture runs
    the prologue and epilogue once more.
    """
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.zeros(1, device=device).add_(1)
    del graph


class _Graphs:
    """The forward/backward graph pair of one call signature, with its static buffers."""

    def __init__(self, static_inputs: List[Tensor], params: List[Tensor], fwd, out_spec: tuple,
                 static_outputs: List[Tensor], differentiable: List[bool], bwd,
                 static_grad_outputs: List[Tensor], grad_groups: list, surface_size: int) -> None:
        self.static_inputs = static_inputs
        self.input_groups = _copy_groups(static_inputs)
        self.grad_output_groups = _copy_groups(static_grad_outputs)
        self.params = params
        self.fwd, self.bwd = fwd, bwd
        self.out_spec = out_spec
        self.static_outputs = static_outputs
        self.differentiable = differentiable
        self.static_grad_outputs = static_grad_outputs
        self.grad_groups = grad_groups  # (flat static buffer, [(surface position, offset, shape)])
        self.surface_size = surface_size
        self.generation = 0
        self._pending: Optional[weakref.ref] = None
        self.writes: List[Tuple[nn.Module, str, Any]] = []

    @classmethod
    def capture(cls, module: nn.Module, plain, spec: tuple, tensors: Sequence[Tensor]) -> "_Graphs":
        device = tensors[0].device
        static = []
        with torch.no_grad():
            for t in tensors:
                s = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                s.copy_(t)
                static.append(s.requires_grad_(t.requires_grad))
        grad = torch.is_grad_enabled()
        params = [p for p in module.parameters() if p.requires_grad] if grad else []
        surface = [s for s in static if s.requires_grad] + params
        args, kwargs = unflatten(spec, static)
        before = _snapshot(module)
        versions = [s._version for s in static]

        def backward_of(out) -> Tuple[list, list]:
            outs = [o for o in flatten(out)[0] if o.requires_grad]
            return outs, surface

        saved = [(b, b.detach().clone()) for b in module.buffers()]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                out = plain(*args, **kwargs)
                outs, _ = backward_of(out)
                if outs and surface:
                    torch.autograd.grad(outs, surface, [torch.ones_like(o) for o in outs],
                                        allow_unused=True)
                del out, outs
        torch.cuda.current_stream(device).wait_stream(side)
        with torch.no_grad():
            for b, copy in saved:
                b.copy_(copy)
        del saved
        if [s._version for s in static] != versions:
            raise Uncapturable("the forward writes into its input tensors in place; a replay "
                               "would write into the graph's copies, not the caller's tensors")
        versions = [s._version for s in static]

        hidden = [(m, key, value) for m, key, value in _attribute_writes(before) if "." not in key
                  and value is not _Backward]
        for m, key, _ in hidden:
            m.__dict__[key] = _WrittenByForward()
        try:
            return cls._capture_graphs(module, plain, args, kwargs, static, params, grad, before,
                                       versions, device)
        except BaseException:
            for m, key, value in hidden:  # the uncaptured calls that follow see the warm-up's values
                m.__dict__[key] = value
            raise

    @classmethod
    def _capture_graphs(cls, module, plain, args, kwargs, static, params, grad, before, versions,
                        device) -> "_Graphs":
        pool = torch.cuda.graph_pool_handle()
        fwd = torch.cuda.CUDAGraph()
        bwd, static_go, groups = None, [], []
        with _aliased_parameters(module, params) as leaves:
            with torch.cuda.graph(fwd, pool=pool, capture_error_mode="thread_local"):
                out = plain(*args, **kwargs)
            out_tensors, out_spec = flatten(out)
            differentiable = [o.requires_grad for o in out_tensors]
            diff_outs = [o for o in out_tensors if o.requires_grad]
            surface = [s for s in static if s.requires_grad] + leaves
            if grad and diff_outs and surface:
                static_go = [torch.empty_like(o) for o in diff_outs]
                bwd = torch.cuda.CUDAGraph()
                with torch.cuda.graph(bwd, pool=pool, capture_error_mode="thread_local"):
                    grads = torch.autograd.grad(diff_outs, surface, static_go, allow_unused=True)
                    groups = _flat_groups(grads)
        writes, refused = replayable_writes(_attribute_writes(before), device)
        if refused is not None:
            raise Uncapturable(f"the forward assigns {refused}; a replay would skip that write")
        if [s._version for s in static] != versions:
            raise Uncapturable("the forward writes into its input tensors in place; a replay "
                               "would write into the graph's copies, not the caller's tensors")
        graphs = cls(static, params, fwd, out_spec, [o.detach() for o in out_tensors],
                     differentiable, bwd, static_go, groups, len(surface))
        graphs.writes = writes
        graphs.redo_writes()
        return graphs

    def redo_writes(self) -> None:
        """Re-assign the attributes the captured forward wrote (see :func:`replayable_writes`)."""
        for module, key, value in self.writes:
            module.__dict__[key] = value

    def pending(self) -> bool:
        """Whether the last replay's backward may still run (its node is alive and has not run)."""
        token = self._pending() if self._pending is not None else None
        return token is not None and not token.done

    def run(self, tensors: Sequence[Tensor]) -> Any:
        with torch.no_grad():
            _copy_grouped(self.static_inputs, tensors, self.input_groups)
        # launched first: the device runs the forward while the host builds the autograd node
        self.fwd.replay()
        self.redo_writes()
        self.generation += 1
        if self.bwd is None:
            return unflatten(self.out_spec, [o.clone() for o in self.static_outputs])
        grad_inputs = [t for t, s in zip(tensors, self.static_inputs) if s.requires_grad]
        outs = _Replay.apply(self, *grad_inputs, *self.params)
        return unflatten(self.out_spec, list(outs))


def _by_kind(tensors: Sequence[Optional[Tensor]]) -> List[Tuple[List[Tensor], List[int]]]:
    """``tensors`` (None skipped) split by dtype and device: ``(members, positions)`` per kind.

    ``torch._foreach_copy_`` runs one fused copy kernel per call only when every tensor of both
    lists has one dtype; a mixed list falls back to one copy (and one launch) per tensor.
    """
    by_kind: Dict[tuple, Tuple[List[Tensor], List[int]]] = {}
    for i, t in enumerate(tensors):
        if t is not None:
            members, positions = by_kind.setdefault((t.dtype, t.device), ([], []))
            members.append(t)
            positions.append(i)
    return list(by_kind.values())


def _copy_groups(tensors: Sequence[Tensor]) -> List[Tuple[List[Tensor], List[int]]]:
    """:func:`_by_kind` of the tensors with elements (an empty one has nothing to copy)."""
    return _by_kind([t if t.numel() else None for t in tensors])


def _copy_grouped(static: Sequence[Tensor], fresh: Sequence[Tensor], groups) -> None:
    """``static[i].copy_(fresh[i])`` for all i, one ``_foreach_copy_`` per group of one kind."""
    for members, positions in groups:
        torch._foreach_copy_(members, [fresh[i] for i in positions])


def _flat_groups(grads: Sequence[Optional[Tensor]]) -> list:
    """Inside the backward capture: the gradients concatenated into one buffer per dtype/device."""
    groups = []
    for members, positions in _by_kind(grads):
        flat = torch.cat([g.reshape(-1) for g in members])
        layout, offset = [], 0
        for i, g in zip(positions, members):
            layout.append((i, offset, tuple(g.shape)))
            offset += g.numel()
        groups.append((flat, layout))
    return groups


class _Replay(torch.autograd.Function):
    """Forward: the outputs of the forward graph :meth:`_Graphs.run` has just replayed.
    Backward: replay the backward graph."""

    @staticmethod
    def forward(ctx, graphs: _Graphs, *surface: Tensor):
        token = _Backward()
        graphs._pending = weakref.ref(token)
        ctx.graphs, ctx.generation, ctx.token = graphs, graphs.generation, token
        outs = tuple(o.clone() for o in graphs.static_outputs)
        ctx.mark_non_differentiable(*(o for o, d in zip(outs, graphs.differentiable) if not d))
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs: Tensor):
        graphs: _Graphs = ctx.graphs
        if ctx.generation != graphs.generation:
            raise TraceError(
                "backward through a CUDA-graphed call after its graph was replayed again "
                f"(replay {ctx.generation}, now {graphs.generation}): the graph's saved tensors "
                "are overwritten. Run backward before calling the module again with "
                "retain_graph, or set config.passes.cuda_graphs='off'")
        diff = [g for g, d in zip(grad_outputs, graphs.differentiable) if d]
        with torch.no_grad():
            _copy_grouped(graphs.static_grad_outputs, diff, graphs.grad_output_groups)
        graphs.bwd.replay()
        ctx.token.done = True
        grads: List[Optional[Tensor]] = [None] * graphs.surface_size
        for flat, layout in graphs.grad_groups:
            fresh = flat.clone()
            for i, offset, shape in layout:
                n = 1
                for d in shape:
                    n *= d
                grads[i] = fresh[offset:offset + n].view(shape)
        return (None, *grads)


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
        self._graphs: "OrderedDict[tuple, _Graphs]" = OrderedDict()
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

    def _give_up(self, reason: str) -> None:
        self._off = reason
        self._graphs.clear()
        self.record.state, self.record.reason, self.record.graphs = "not captured", reason, 0

    def __call__(self, module: nn.Module, plain, args: tuple, kwargs: dict):
        mode = self._option("cuda_graphs")
        if mode == "off":
            self.record.state, self.record.reason = "off", "config.passes.cuda_graphs = 'off'"
            return plain(*args, **kwargs)
        # inside any capture (a runner's warm-ups or an enclosing whole-step graph) run the plain code
        if self._off is not None or capturing() or torch.compiler.is_compiling():
            return plain(*args, **kwargs)
        if self._verifying:
            if any(m.__dict__.get("_fastopt_verify", 0) > 0 for m in self._verifying):
                return plain(*args, **kwargs)
            self._verifying = []
        tensors, spec = flatten((args, kwargs))
        where = _where_tensors_are(tensors)
        if where is not None:
            if self.record.state != "captured":
                self.record.state, self.record.reason = "not captured", where
            return plain(*args, **kwargs)
        state = self._module_state.key(module)
        try:
            key = call_signature(module, spec, tensors, self._module_state.modules)
        except Uncapturable as exc:
            self.record.reason = str(exc)
            return plain(*args, **kwargs)
        if state != self._state:
            self._graphs.clear()
            self._state = state
        graphs = self._graphs.get(key)
        if graphs is None:
            if mode == "auto" and key not in self._seen:
                self._seen[key] = None
                while len(self._seen) > 4 * self._option("max_graphs"):
                    self._seen.popitem(last=False)
                return plain(*args, **kwargs)
            graphs = self._capture(module, plain, spec, tensors)
            if graphs is None:
                return plain(*args, **kwargs)
            self._graphs[key] = graphs
            while len(self._graphs) > self._option("max_graphs"):
                self._graphs.popitem(last=False)
                self.record.evictions += 1
            self.record.graphs = len(self._graphs)
        else:
            self._graphs.move_to_end(key)
        if graphs.pending():
            return plain(*args, **kwargs)
        return graphs.run(tensors)

    def _capture(self, module: nn.Module, plain, spec: tuple,
                 tensors: Sequence[Tensor]) -> Optional[_Graphs]:
        _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
        try:
            graphs = _Graphs.capture(module, plain, spec, tensors)
        except Exception as exc:  # noqa: BLE001 - any failure means "run uncaptured"
            reason = str(exc) if isinstance(exc, Uncapturable) else \
                f"capture failed: {type(exc).__name__}: {_first_line(exc)}"
            self._give_up(reason)
            try:
                torch.cuda.synchronize(tensors[0].device)
                _end_generator_capture(tensors[0].device)
            except Exception:  # noqa: BLE001 - the capture's own error was recorded above
                pass
            return None
        finally:
            _LOCAL.depth -= 1
        self.record.state, self.record.reason = "captured", ""
        self.record.captures += 1
        return graphs


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""


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
