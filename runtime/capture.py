"""One call signature's CUDA graphs: the captured forward/backward pair, its static buffers and
its replay (used by :class:`~fastopt.runtime.graphs.GraphRunner`).

* **Capture.** Inputs are copied into static buffers; :data:`WARMUP_CALLS` warm-up calls
  (forward and ``autograd.grad``) run on a side stream with the module's buffers restored
  afterwards; the forward is captured, then the backward of every differentiable output with
  respect to the inputs that require grad and the module's trainable parameters, into one memory
  pool.
* **Replay.** Inputs are copied in, the forward graph replays and the outputs are returned as
  fresh tensors (callers may keep them across calls). An ``autograd.Function`` connects them to
  the graph: its backward copies the incoming gradients into static buffers, replays the
  backward graph and returns the gradients of inputs and parameters from one fresh flat buffer
  per dtype (captured in the graph), so ``.grad`` accumulates exactly as in eager mode and never
  aliases graph memory. Inputs padded along their rows (:class:`~fastopt.runtime.RowPad`) are
  written as their rows plus the padding (rows still holding it are not written again) and
  outputs may be trimmed to their first rows; gradients follow (zeros for the trimmed rows, the
  inputs' own rows out).
* **Attribute writes.** A forward that stores tensors on its module (TGN keeps the batch's
  updated memory for ``commit``) is captured when those tensors live on the graph's device: each
  replay re-assigns the attribute to the same tensors, detached, which then hold that replay's
  values (:func:`replayable_writes`). Any other write, and a forward that writes into its
  inputs, makes the capture fail with :class:`Uncapturable`.

Layering: imports nothing of fastopt but :mod:`fastopt.errors` (and the runtime's flatten and
padding helpers).
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch._utils import _unflatten_dense_tensors
from torch.autograd.function import once_differentiable

from fastopt.errors import TraceError
from fastopt.runtime.flatten import flatten, unflatten
from fastopt.runtime.padding import RowPad, constant_rows
from fastopt.runtime.streams import warmup_stream

__all__ = ["GraphPair", "Uncapturable", "WARMUP_CALLS", "capture_into", "replayable_writes", "end_generator_capture"]

# Forward+backward calls on a side stream before a capture (lazy initialization, Triton
# compilation and cuBLAS workspaces happen there, never inside the capture).
WARMUP_CALLS = 2


class Uncapturable(Exception):
    """A call or a module that cannot be captured; the message says why."""



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


@contextlib.contextmanager
def capture_into(graph: "torch.cuda.CUDAGraph", pool=None):
    """Capture the work of the block into ``graph`` (``pool``: a memory pool it shares), as every
    capture of fastopt's runs: ``thread_local``, so that the loader's threads keep staging
    meanwhile, and with Python's cyclic garbage collector paused. A collection inside the capture
    would run the finalizers of whatever garbage it found there, and a finalizer may synchronize
    the device (a pinned table's unregistration, when a dropped trainer's loader is collected),
    which a capture forbids: the capture would fail and its steps run eagerly. Torch's graph
    context no longer collects before a capture; garbage is collected after it. (An object freed
    by its last reference still finalizes at once. The collector's switch is the process's: one
    capture at a time, as the trainer and the graph runners capture.)"""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        if was_enabled:
            gc.enable()


def end_generator_capture(device: torch.device) -> None:
    """Leave the CUDA generator out of capture mode after a failed capture.

    A capture that fails never reaches the generator's capture epilogue, and every later random
    draw would fail ("Offset increment outside graph capture"); an empty successful capture runs
    the prologue and epilogue once more. Waits for the device first; never raises (the failed
    capture's own error is what the caller reports), but warns when the repair itself fails, since
    random draws on that device may fail from then on.
    """
    try:
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with capture_into(graph):
            torch.zeros(1, device=device).add_(1)
        del graph
    except Exception as exc:  # noqa: BLE001 - see above
        warnings.warn(f"fastopt: could not leave the CUDA generator's capture mode after a failed "
                      f"capture ({type(exc).__name__}: {exc}); random draws on {device} may fail "
                      f"from here on: restart the process if they do", RuntimeWarning, stacklevel=2)


class GraphPair:
    """The forward/backward graph pair of one call signature, with its static buffers."""

    def __init__(self, static_inputs: List[Tensor], params: List[Tensor], fwd, out_spec: tuple,
                 static_outputs: List[Tensor], differentiable: List[bool], bwd,
                 static_grad_outputs: List[Tensor], grad_groups: list, surface_size: int) -> None:
        self.static_inputs = static_inputs
        self.input_groups = _copy_groups(static_inputs)
        # per static input: rows past which it holds its padding (see _copy_padded); unknown yet
        self.filled = _row_counts(static_inputs)
        self.padded = False  # whether a replay wrote padding (then filled is in use)
        self.grad_output_groups = _copy_groups(static_grad_outputs)
        # as filled, for the gradients of trimmed outputs (their padding rows hold zeros)
        self.grad_filled = _row_counts(static_grad_outputs)
        self.params = params
        self.fwd, self.bwd = fwd, bwd
        self.out_spec = out_spec
        self.static_outputs = static_outputs
        self.differentiable = differentiable
        self.static_grad_outputs = static_grad_outputs
        self.grad_groups = grad_groups  # _GradGroup per dtype/device
        self.surface_size = surface_size
        self.generation = 0
        self._pending: Optional[weakref.ref] = None
        self.writes: List[Tuple[nn.Module, str, Any]] = []

    @classmethod
    def capture(cls, module: nn.Module, plain, spec: tuple, tensors: Sequence[Tensor]) -> "GraphPair":
        device = tensors[0].device
        static = []
        with torch.no_grad():
            for t in tensors:
                s = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                s.copy_(t)
                static.append(s.requires_grad_(t.requires_grad))
        grad = torch.is_grad_enabled()
        params = [p for p in module.parameters() if p.requires_grad] if grad else []
        args, kwargs = unflatten(spec, static)
        before = _snapshot(module)
        versions = [s._version for s in static]

        saved = [(b, b.detach().clone()) for b in module.buffers()]
        side = warmup_stream(device)  # one per device: a fresh one would hold cuBLAS workspaces
        side.wait_stream(torch.cuda.current_stream(device))
        # on aliased leaves, as the capture: the parameters' own AccumulateGrad nodes, which an
        # earlier eager backward may still hold, never see the side stream
        with torch.cuda.stream(side), _aliased_parameters(module, params) as leaves:
            inputs = [s for s in static if s.requires_grad] + leaves
            for _ in range(WARMUP_CALLS):
                out = plain(*args, **kwargs)
                outs = [o for o in flatten(out)[0] if o.requires_grad]
                if outs and inputs:
                    torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs],
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
                        device) -> "GraphPair":
        pool = torch.cuda.graph_pool_handle()
        fwd = torch.cuda.CUDAGraph()
        bwd, static_go, groups = None, [], []
        with _aliased_parameters(module, params) as leaves:
            with capture_into(fwd, pool):
                out = plain(*args, **kwargs)
            out_tensors, out_spec = flatten(out)
            differentiable = [o.requires_grad for o in out_tensors]
            diff_outs = [o for o in out_tensors if o.requires_grad]
            surface = [s for s in static if s.requires_grad] + leaves
            if grad and diff_outs and surface:
                static_go = [torch.empty_like(o) for o in diff_outs]
                bwd = torch.cuda.CUDAGraph()
                with capture_into(bwd, pool):
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

    def run(self, tensors: Sequence[Tensor], pads: Optional[Sequence[Optional[RowPad]]] = None,
            out_rows: Optional[int] = None) -> Any:
        """Replay on ``tensors``; with ``pads`` (one per tensor, None where unpadded) each padded
        tensor's rows and its padding are written into the static input (one copy list per
        kind), and with ``out_rows`` every output is trimmed to its first ``out_rows`` rows
        (the backward pads their gradients with zeros and trims the inputs' gradients)."""
        with torch.no_grad():
            if pads is None:
                _copy_grouped(self.static_inputs, tensors, self.input_groups)
                if self.padded:  # never, as graphs are keyed; kept right if one ever is
                    self.filled, self.padded = _row_counts(self.static_inputs), False
            else:
                _copy_padded(self.static_inputs, tensors, pads, self.input_groups, self.filled)
                self.padded = True
        # launched first: the device runs the forward while the host builds the autograd node
        self.fwd.replay()
        self.redo_writes()
        self.generation += 1
        if self.bwd is None:
            return unflatten(self.out_spec, [_first_rows(o, out_rows).clone()
                                             for o in self.static_outputs])
        grad_inputs = [t for t, s in zip(tensors, self.static_inputs) if s.requires_grad]
        rows = [None] * self.surface_size
        if pads is not None:
            padded = [p is not None for p, s in zip(pads, self.static_inputs) if s.requires_grad]
            rows[:len(grad_inputs)] = [t.shape[0] if p else None for t, p in zip(grad_inputs, padded)]
        outs = _Replay.apply(self, (rows, out_rows), *grad_inputs, *self.params)
        return unflatten(self.out_spec, list(outs))


_ZEROS = RowPad(0)  # padding with zeros (_copy_padded reads the value alone)


def _row_counts(tensors: Sequence[Tensor]) -> List[int]:
    return [t.shape[0] if t.dim() else 0 for t in tensors]


def _first_rows(t: Tensor, rows: Optional[int]) -> Tensor:
    return t if rows is None else t.narrow(0, 0, rows)


def _copy_padded(static: Sequence[Tensor], fresh: Sequence[Tensor],
                 pads: Sequence[Optional[RowPad]], groups, filled: List[int]) -> None:
    """:func:`_copy_grouped` where ``fresh[i]`` fills the first rows of ``static[i]`` and the
    rest hold ``pads[i].value`` (read from :func:`constant_rows`), one copy list per kind.

    ``filled[i]``: the rows of ``static[i]`` past which it holds the padding already (its
    length where unknown), updated here. Only replays write into a pair's static inputs (the
    capture refuses a forward that writes into its inputs), so a call with at least as many
    rows as the last writes its rows alone, and one with fewer pads only the rows in between."""
    for members, positions in groups:
        into, read = [], []
        for s, i in zip(members, positions):
            t, pad = fresh[i], pads[i]
            if pad is None:
                into.append(s)
                read.append(t)
                filled[i] = _row_counts([s])[0]
                continue
            n = t.shape[0]
            _pad_into(s, t, pad.value, into, read, end=max(n, filled[i]))
            filled[i] = n
        if len(into) == 1:  # one copy: the plain op dispatches faster than a list of one
            into[0].copy_(read[0])
        elif into:  # a 0-row call into rows already padded copies nothing
            torch._foreach_copy_(into, read)


def _pad_into(s: Tensor, t: Tensor, value: int, into: list, read: list, end: int) -> None:
    """Append to the copy lists: ``t`` into the first rows of ``s``, ``value`` into the rows
    after them up to ``end``."""
    n = t.shape[0]
    if n:
        into.append(s.narrow(0, 0, n))
        read.append(t)
    if n < end:
        into.append(s.narrow(0, n, end - n))
        read.append(constant_rows(end - n, tuple(s.shape[1:]), value, s))


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


class _GradGroup(NamedTuple):
    """One dtype/device's gradients of a backward graph, concatenated into ``flat`` (a static
    buffer): ``positions`` in the surface, ``templates`` (meta tensors of their shapes) and the
    members without elements (``empty``, which the one-call split gives as ``[0]``)."""

    flat: Tensor
    positions: List[int]
    templates: List[Tensor]
    empty: Tuple[int, ...]

    def pieces(self) -> List[Tensor]:
        """A copy of ``flat`` split into the gradients (views of the copy, one host call)."""
        out = _unflatten_dense_tensors(self.flat.clone(), self.templates)
        if not self.empty:
            return list(out)
        return [self.flat.new_empty(t.shape) if i in self.empty else piece
                for i, (piece, t) in enumerate(zip(out, self.templates))]


def _flat_groups(grads: Sequence[Optional[Tensor]]) -> List[_GradGroup]:
    """Inside the backward capture: the gradients concatenated into one buffer per dtype/device
    (:class:`_GradGroup`)."""
    return [_GradGroup(torch.cat([g.reshape(-1) for g in members]), positions,
                       [torch.empty(g.shape, dtype=g.dtype, device="meta") for g in members],
                       tuple(i for i, g in enumerate(members) if g.numel() == 0))
            for members, positions in _by_kind(grads)]


class _Replay(torch.autograd.Function):
    """Forward: the outputs of the forward graph :meth:`GraphPair.run` has just replayed (their
    first ``out_rows`` rows where it trims). Backward: replay the backward graph."""

    @staticmethod
    def forward(ctx, graphs: GraphPair, trim: tuple, *surface: Tensor):
        token = _Backward()
        graphs._pending = weakref.ref(token)
        ctx.graphs, ctx.generation, ctx.token = graphs, graphs.generation, token
        ctx.rows, ctx.out_rows = trim
        outs = tuple(_first_rows(o, ctx.out_rows).clone() for o in graphs.static_outputs)
        fixed = [o for o, d in zip(outs, graphs.differentiable) if not d]
        if fixed:
            ctx.mark_non_differentiable(*fixed)
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs: Tensor):
        graphs: GraphPair = ctx.graphs
        if ctx.generation != graphs.generation:
            raise TraceError(
                "backward through a CUDA-graphed call after its graph was replayed again "
                f"(replay {ctx.generation}, now {graphs.generation}): the graph's saved tensors "
                "are overwritten. Run backward before calling the module again with "
                "retain_graph, or set config.passes.cuda_graphs='off'")
        diff = [g for g, d in zip(grad_outputs, graphs.differentiable) if d]
        with torch.no_grad():
            if ctx.out_rows is None:
                _copy_grouped(graphs.static_grad_outputs, diff, graphs.grad_output_groups)
            else:  # the trimmed rows' gradients are zero (only the backward copy writes them)
                _copy_padded(graphs.static_grad_outputs, diff, [_ZEROS] * len(diff),
                             graphs.grad_output_groups, graphs.grad_filled)
        graphs.bwd.replay()
        ctx.token.done = True
        grads: List[Optional[Tensor]] = [None] * graphs.surface_size
        for group in graphs.grad_groups:
            for i, piece in zip(group.positions, group.pieces()):
                grads[i] = piece if ctx.rows[i] is None else piece.narrow(0, 0, ctx.rows[i])
        return (None, None, *grads)
