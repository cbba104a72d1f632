"""``fuse_pyg_transformer_conv``, ``fuse_pyg_gat_conv``, ``fuse_pyg_gatv2_conv``: PyG's attention
layers -> edge softmax and aggregation fused over the destination-sorted edges.

PyG's ``MessagePassing`` layers cannot be traced with an ``edge_index``; these module-type rules
(:mod:`fastopt.passes.modules`) replace ``torch_geometric.nn.TransformerConv``, ``GATConv`` and
``GATv2Conv`` by the same module (parameters, buffers, ``state_dict`` keys) whose forward runs
the projections as the layer does and the per-edge work on fastopt's operators:

- ``TransformerConv``: scores ``q_i . (k_j + e_ij) / sqrt(C)``, values ``v_j + e_ij`` ->
  :func:`fastopt.codegen.edge_attention` (keys and values read by source node without edge
  features, per edge with them); heads, concat or mean, ``beta``, root weight, bias, dropout;
- ``GATConv`` / ``GATv2Conv``: the LeakyReLU logits per edge as the layer computes them (self
  loops removed and added as it does), then softmax and sum ->
  :func:`fastopt.codegen.edge_softmax_aggregate` (values read by source node); heads, concat or
  mean, edge features, residual, bias, shared weights (v2), dropout.

Left alone, with the reason in the report: an aggregation other than a sum, ``flow`` other
than ``"source_to_target"``, a subclass. Calls the replacement does not take run the layer's own
forward: ``return_attention_weights``, a ``SparseTensor`` or sparse ``edge_index``, a ``size``,
bipartite input without destination features, registered propagate/message hooks, explain mode,
decomposed layers, edge features a layer would ignore or reject. Attention dropout in training
draws as the layer does: torch's dropout of an ``[E, H]`` tensor, the shape and place of the
layer's draw, scales each edge's values (``sum_e (p_e m_e) v_e = sum_e p_e (m_e v_e)``), so a
trained copy takes the layer's masks and follows its trajectory up to rounding.
``TransformerConv`` (one node set) runs on nodes and edges padded to
:func:`fastopt.runtime.bucket` sizes through a :class:`_TransformerCore` whose
:class:`~fastopt.runtime.GraphRunner` replays one CUDA graph pair per padded size (the runner
writes each call's rows and padding into the graph's inputs and trims the output): at a PyG
example's sizes the layer's ~70 launches cost more host time than its kernels take. Nothing is
read back in such a call: the attention runs in the edges form (no slot count), and on a GPU
the index check reaches the host after the call and raises at the layer's next call
(:class:`_IndexRanges`). As the fx
rewrites do, on the CPU with ``kernels.backend="auto"`` the layer runs its own code (faster there
than the operators' references); ``"reference"`` runs the fused path's references there.

Without ``torch_geometric`` the rules recognize nothing.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastopt import codegen
from fastopt.config import default_config
from fastopt.errors import KernelError
from fastopt.passes.module_rewrite import ModuleReplacement, ModuleRewrite, shared_copy
from fastopt.runtime import GraphCapture, GraphRunner, RowPad, bucket, capturing, constant_rows

__all__ = ["FuseTransformerConv", "FuseGatConv", "FuseGatv2Conv", "pyg_conv_classes"]

CORE_GRAPHS = 4
"""Graph pairs a fused TransformerConv keeps, in units of ``config.passes.max_graphs``."""

PAD_EDGE = -(2**63)
"""The destination of a padding edge (int64; a call's indices are taken as int64): the range
check of the padded call (:class:`_IndexRanges`) tells padding from a bad destination by this
value, so a destination of exactly this value would pass as padding (left out, not reported)."""


@functools.lru_cache(maxsize=None)
def pyg_conv_classes() -> dict:
    """``{"TransformerConv": cls, "GATConv": cls, "GATv2Conv": cls}``, or ``{}`` without PyG."""
    try:
        from torch_geometric.nn import GATConv, GATv2Conv, TransformerConv
    except ImportError:
        return {}
    return {"TransformerConv": TransformerConv, "GATConv": GATConv, "GATv2Conv": GATv2Conv}


def _hook_dicts(module: nn.Module) -> Tuple[str, ...]:
    return tuple(k for k, v in vars(module).items()
                 if k.startswith("_") and k.endswith("_hooks") and "forward" in k
                 and isinstance(v, dict) and k not in ("_forward_hooks", "_forward_pre_hooks"))


def _plain_call(module: nn.Module, edge_index, x) -> bool:
    """Whether a call runs fused: where the generated kernels run (``kernels.backend="auto"`` on
    the CPU runs the layer's own code, faster there than the operators' references), with a dense
    ``[2, E]`` edge list, dense 2-d node features, no propagate/message hooks, no explain mode,
    no decomposed layers."""
    if not (isinstance(edge_index, Tensor) and edge_index.layout == torch.strided
            and edge_index.dim() == 2 and edge_index.shape[0] == 2
            and not edge_index.is_floating_point()):
        return False
    xs = x if isinstance(x, (tuple, list)) else (x,)
    if not (1 <= len(xs) <= 2 and all(isinstance(t, Tensor) and t.dim() == 2
                                      and t.layout == torch.strided for t in xs)):
        return False
    if getattr(module, "explain", False) or getattr(module, "decomposed_layers", 1) > 1:
        return False
    if default_config().kernels.backend == "auto" and codegen.select_backend(xs[0]) != "triton":
        return False
    return not any(getattr(module, name) for name in module._fastopt_hook_names)


def _dropout_mask(module: nn.Module, like: Tensor, edges: int) -> Optional[Tensor]:
    """The layer's dropout of its attention weights ``[E, H]`` as a multiplier of each edge's
    values ``[E, H, 1]`` (0, or ``1 / (1 - p)`` where kept), drawn as the layer draws it: torch's
    dropout of a tensor of that shape, dtype and device. None in eval mode or without dropout."""
    if not (module.training and module.dropout > 0):
        return None
    ones = constant_rows(edges, (module.heads,), 1, like)  # dropout reads it, writes a new tensor
    return F.dropout(ones, float(module.dropout), training=True).unsqueeze(-1)


def _heads_out(module: nn.Module, out: Tensor) -> Tensor:
    """``[N, H, C]`` -> concatenated ``[N, H * C]`` or averaged ``[N, C]`` heads."""
    return out.reshape(out.shape[0], -1) if module.concat else out.mean(dim=1)


def _gat_output(layer: nn.Module, logits: Tensor, values: Tensor, src: Tensor, dst: Tensor,
                num_dst: int, res: Optional[Tensor]) -> Tensor:
    """GAT's softmax over each destination's edges and weighted sum of the source rows
    ``values``, then heads, residual and bias."""
    mask = _dropout_mask(layer, values, src.numel())
    if mask is None:
        out = codegen.edge_softmax_aggregate(logits, values, dst, num_dst, v_index=src)
    else:
        per_edge = codegen.gather_rows(values, src) * mask
        out = codegen.edge_softmax_aggregate(logits, per_edge, dst, num_dst)
    out = _heads_out(layer, out)
    if res is not None:
        out = out + res
    if layer.bias is not None:
        out = out + layer.bias
    return out


def _self_loops(module: nn.Module, edge_index: Tensor, edge_attr: Optional[Tensor],
                num_nodes: int) -> Tuple[Tensor, Optional[Tensor]]:
    from torch_geometric.utils import add_self_loops, remove_self_loops

    edge_index, edge_attr = remove_self_loops(edge_index, edge_attr)
    return add_self_loops(edge_index, edge_attr, fill_value=module.fill_value, num_nodes=num_nodes)


class _PygConvRule(ModuleRewrite):
    """What the three layer rules share: class lookup and the module-level conditions."""

    layer = ""
    op = "edge_softmax_aggregate"

    def classes(self) -> Tuple[type, ...]:
        cls = pyg_conv_classes().get(self.layer)
        return (cls,) if cls is not None else ()

    def unsupported(self, module: nn.Module) -> Optional[str]:
        aggr = getattr(module, "aggr", None)
        if aggr not in ("add", "sum"):
            return f"aggr={aggr!r}: the fused layer sums messages (aggr='add' or 'sum' only)"
        if getattr(module, "flow", "source_to_target") != "source_to_target":
            return (f"flow={module.flow!r}: the fused layer reads edge_index as (source, "
                    f"destination) (flow='source_to_target' only)")
        if getattr(module, "node_dim", 0) not in (0, -2):
            return f"node_dim={module.node_dim}: the fused layer keeps nodes in dimension 0"
        return None

    def describe(self, module: nn.Module) -> str:
        parts = [f"heads={module.heads}", "concat" if module.concat else "mean"]
        if getattr(module, "lin_edge", None) is not None:
            parts.append("edge_attr")
        parts += self._options(module)
        return f"pyg.{self.layer}[{','.join(parts)}]"

    def _options(self, module: nn.Module) -> list:
        """Options shown in the report besides heads, concat and edge features (GAT's here)."""
        out = ["self_loops"] if module.add_self_loops else []
        if getattr(module, "share_weights", False):
            out.append("share_weights")
        if getattr(module, "res", None) is not None:
            out.append("residual")
        if module.dropout:
            out.append(f"dropout={module.dropout}")
        return out

    @property
    def replacement(self) -> type:
        return self.mixin

    def build(self, module: nn.Module) -> nn.Module:
        new = shared_copy(module, _fused_class(self.mixin, type(module)))
        new.__dict__["_fastopt_hook_names"] = _hook_dicts(module)  # PyG's propagate/message hooks
        return new


@functools.lru_cache(maxsize=None)
def _fused_class(mixin: type, cls: type) -> type:
    return type(f"Fused{cls.__name__}", (mixin, cls), {"__module__": __name__})


# ----------------------------------------------------------------------------------------------
# TransformerConv
# ----------------------------------------------------------------------------------------------


class _FusedTransformerConv(ModuleReplacement):
    """``TransformerConv.forward`` with the per-edge attention fused (see the module docstring)."""

    def _fastopt_forward(self, x, edge_index, edge_attr=None, return_attention_weights=None):
        if (return_attention_weights is not None or not _plain_call(self, edge_index, x)
                or (edge_attr is None) != (self.lin_edge is None)):
            return self._fastopt_original(x, edge_index, edge_attr, return_attention_weights)
        return transformer_conv(self, x, edge_index, edge_attr)

    def train(self, mode: bool = True):
        """As ``nn.Module.train``, after checking the last call's indices (:class:`_IndexRanges`):
        a bad index in a training epoch's last call raises at ``model.eval()``, not never."""
        core = self.__dict__.get("_fastopt_core")
        if core is not None:
            core.ranges.settle()
        return super().train(mode)


def _projections(lins, x: Tensor) -> Tuple[Optional[Tensor], list]:
    """``(whole, [lin(x) for lin in lins])``: one product of the stacked weights whose column
    blocks are the outputs (``whole``, split without copies); each Linear apart (``whole`` None)
    where one is not initialized yet or only some have a bias."""
    weights = [lin.weight for lin in lins]
    biases = [lin.bias for lin in lins]
    lazy = any(isinstance(w, nn.parameter.UninitializedParameter) for w in weights)
    if len(lins) == 1 or lazy or len({b is None for b in biases}) > 1:
        return None, [lin(x) for lin in lins]
    bias = None if biases[0] is None else torch.cat(biases)
    whole = F.linear(x, torch.cat(weights), bias)
    return whole, list(whole.split([w.shape[0] for w in weights], dim=-1))


def transformer_conv(layer: nn.Module, x, edge_index: Tensor, edge_attr: Optional[Tensor]) -> Tensor:
    """``TransformerConv`` ``layer`` on a dense edge list, attention by ``edge_attention``.

    The dropout mask is drawn first, as the layer draws it. Then, for one node set (not
    bipartite), the rest runs on inputs padded to :func:`fastopt.runtime.bucket` sizes (padding
    edges reach no destination) through the layer's :class:`_TransformerCore` and its CUDA-graph
    runner: calls of similar size replay one graph pair, and nothing is read back (the attention
    runs in the edges form, the index check is :class:`_IndexRanges`'). Bipartite calls run
    unpadded, reading their slot count and checking their indices at once."""
    src, dst = edge_index[0], edge_index[1]
    mask = _dropout_mask(layer, x if isinstance(x, Tensor) else x[1], src.numel())
    if isinstance(x, Tensor) and src.numel():
        return _padded_call(layer, x, src, dst, edge_attr, mask)
    x_src, x_dst = (x, x) if isinstance(x, Tensor) else x
    return transformer_edges(layer, x_src, x_dst, src, dst, edge_attr, mask)


def _padded_call(layer: nn.Module, x: Tensor, src: Tensor, dst: Tensor,
                 edge_attr: Optional[Tensor], mask: Optional[Tensor]) -> Tensor:
    """The layer's core on nodes and edges padded to bucket sizes; the real rows of its output.
    Padding nodes are zero rows; padding edges read node 0 and point at :data:`PAD_EDGE`, which
    the core sends past the last destination, out of every softmax: they change no value or
    gradient. The index check is the core's :class:`_IndexRanges`: the last call's is settled
    first."""
    rows, edges = x.shape[0], src.numel()
    if rows == 0:
        raise KernelError(f"edge_index has {edges} edges but x has no node (shape "
                          f"{tuple(x.shape)}); pass one row of x per node")
    # the loader's sizes: four per power of two, so that calls of similar size share graphs
    padded_rows, padded_edges = bucket(rows, 1), bucket(edges, 1)
    on_edges = RowPad(padded_edges)
    src, dst = src.long(), dst.long()  # PAD_EDGE is int64 (no copy for int64 indices)
    args = (x, src, dst, edge_attr, mask)
    pads = (RowPad(padded_rows), on_edges, RowPad(padded_edges, PAD_EDGE),
            None if edge_attr is None else on_edges, None if mask is None else on_edges)
    core, runner = layer.__dict__["_fastopt_core"], layer.__dict__["_fastopt_core_runner"]
    checked = not capturing()  # inside an enclosing graph's capture: no event, no read
    if checked:
        core.ranges.settle()
    core.ranges.prepare(src)
    # the runner writes the rows and the padding into the graph's inputs and trims the output
    out = runner(core, core.forward, args, {}, pads=pads, out_rows=rows)
    if checked:
        core.ranges.submit(rows)
    return out


class _IndexRanges:
    """The index check of a fused ``TransformerConv``'s padded calls, with no host read in the
    call: the core writes the smallest and largest source and destination of the real edges
    into :attr:`stats` on the device (part of its CUDA graph), which reach pinned host memory
    after the call. On a GPU they are checked when the layer is called next (:meth:`settle`,
    waiting only where the device has not finished that call), so an index outside ``[0, N)``
    raises :class:`~fastopt.errors.KernelError` one call late, naming the call it came from;
    elsewhere at once. The bad call itself stays memory-safe (its output is not to be used): the
    core clamps sources into the padded node rows and sends destinations outside them past the
    last row. The pending check is also settled by the layer's ``train()`` / ``eval()`` (a
    model's switch to evaluation checks its last training call). Not checked: the calls inside
    an enclosing CUDA graph's capture (a whole-step graph), and a last call that neither a call
    nor a mode switch follows."""

    def __init__(self) -> None:
        self.stats: Optional[Tensor] = None
        self.host: Optional[Tensor] = None
        self.event = None
        self.rows: Optional[int] = None  # the unpadded node count of the call awaiting its check

    def __deepcopy__(self, memo):  # a copy of the layer checks its own calls
        return _IndexRanges()

    def __reduce__(self):
        return (_IndexRanges, ())

    def prepare(self, like: Tensor) -> None:
        """The device buffer (made outside any capture, written by every replay); normal
        tensors even when the first call runs under ``torch.inference_mode()``."""
        if self.stats is None or self.stats.device != like.device:
            with torch.inference_mode(False):
                self.stats = torch.zeros(4, dtype=torch.int64, device=like.device)
                if like.is_cuda:
                    self.host = torch.zeros(4, dtype=torch.int64, pin_memory=True)
                    self.event = torch.cuda.Event()

    def record(self, src: Tensor, dst: Tensor, rows: int) -> Tuple[Tensor, Tensor]:
        """Inside the core: write the ranges of the real edges; returns ``(src, dst)`` made safe
        for ``rows`` (padded) node rows."""
        real = dst != PAD_EDGE
        low = torch.where(real, dst, torch.iinfo(torch.int64).max).min()
        high = torch.where(real, dst, -1).max()
        self.stats.copy_(torch.stack([src.min(), src.max(), low, high]))
        inside = (dst >= 0) & (dst < rows)
        return src.clamp(0, max(rows - 1, 0)), torch.where(inside, dst, rows)

    def submit(self, rows: int) -> None:
        """After a call: its ranges on their way to the host (checked now off the GPU)."""
        self.rows = rows
        if self.event is None:
            self.settle()
            return
        self.host.copy_(self.stats, non_blocking=True)
        # on the stream of the layer's device, which need not be the current device
        self.event.record(torch.cuda.current_stream(self.stats.device))

    def settle(self) -> None:
        """Check the ranges of the last call submitted, if not yet checked."""
        rows, self.rows = self.rows, None
        if rows is None:
            return
        if self.event is None:
            values = self.stats.tolist()
        else:
            if not self.event.query():
                self.event.synchronize()
            values = self.host.tolist()
        for name, low, high in (("edge_index[0]", *values[:2]), ("edge_index[1]", *values[2:])):
            if low < 0 or high >= rows:
                bad = low if low < 0 else high
                raise KernelError(
                    f"{name} held {bad}, outside [0, {rows}) (the node count), in the fused "
                    f"TransformerConv call before this one (its indices are checked on the "
                    f"device and reported at the next call; that call's output is not to be "
                    f"used); pass edges between the {rows} nodes of x")


class _TransformerCore(nn.Module):
    """A fused ``TransformerConv``'s per-call work on padded inputs, holding the layer's own
    projections (shared, not copies): the module its :class:`~fastopt.runtime.GraphRunner`
    captures, one graph pair per padded shape, grad mode and training flags; its
    :class:`_IndexRanges` checks the calls' indices. Kept out of the layer's registered
    submodules, so that the layer's ``state_dict`` is PyG's."""

    parts = ("lin_query", "lin_key", "lin_value", "lin_edge", "lin_skip", "lin_beta")

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        for name in self.parts:
            setattr(self, name, getattr(layer, name, None))
        self.heads, self.out_channels = layer.heads, layer.out_channels
        self.concat, self.root_weight = layer.concat, layer.root_weight
        self.ranges = _IndexRanges()

    def forward(self, x: Tensor, src: Tensor, dst: Tensor, edge_attr: Optional[Tensor],
                mask: Optional[Tensor]) -> Tensor:
        src, dst = self.ranges.record(src, dst, x.shape[0])
        return transformer_edges(self, x, x, src, dst, edge_attr, mask, "edges")


def transformer_edges(layer: nn.Module, x_src: Tensor, x_dst: Tensor, src: Tensor, dst: Tensor,
                      edge_attr: Optional[Tensor], mask: Optional[Tensor],
                      slots: Union[int, str, None] = None) -> Tensor:
    """The layer's projections and attention over the edges ``src -> dst``; ``mask`` the dropout
    multiplier of each edge's values; ``slots`` as :func:`fastopt.codegen.edge_attention` takes
    it (then nothing is read back).

    The query, key, value (and skip) projections of one input run as one product; with edge
    features or ``slots="edges"``, keys and values are gathered per edge as one block (and the
    edge projection added to both at once; the attention reads them in place, a row stride
    apart)."""
    heads, channels = layer.heads, layer.out_channels
    lins = [layer.lin_query] + ([layer.lin_skip] if layer.root_weight else [])
    if x_src is x_dst:
        whole, parts = _projections(lins + [layer.lin_key, layer.lin_value], x_dst)
        dst_side, (key, value) = parts[:-2], parts[-2:]
    else:
        dst_side = _projections(lins, x_dst)[1]
        whole, (key, value) = _projections([layer.lin_key, layer.lin_value], x_src)
    query = dst_side[0].reshape(-1, heads, channels)
    scale = 1.0 / math.sqrt(channels)
    if layer.lin_edge is not None or slots == "edges":
        width = heads * channels
        pair = torch.cat([key, value], dim=-1) if whole is None else \
            whole.narrow(-1, whole.shape[-1] - 2 * width, 2 * width)
        kv = codegen.gather_rows(pair, src).view(-1, 2, heads, channels)
        if layer.lin_edge is not None:
            kv = kv + layer.lin_edge(edge_attr).view(-1, 1, heads, channels)
        v = kv[:, 1] if mask is None else kv[:, 1] * mask
        out = codegen.edge_attention(query, kv[:, 0], v, dst, scale=scale, slots=slots)
    else:
        key = key.reshape(-1, heads, channels)
        value = value.reshape(-1, heads, channels)
        if mask is None:
            out = codegen.edge_attention(query, key, value, dst, k_index=src, v_index=src,
                                         scale=scale, slots=slots)
        else:
            per_edge = codegen.gather_rows(value, src) * mask
            out = codegen.edge_attention(query, key, per_edge, dst, k_index=src, scale=scale,
                                         slots=slots)
    out = _heads_out(layer, out)
    if layer.root_weight:
        skip = dst_side[1]
        if layer.lin_beta is not None:
            gate = layer.lin_beta(torch.cat([out, skip, out - skip], dim=-1)).sigmoid()
            out = gate * skip + (1 - gate) * out
        else:
            out = out + skip
    return out


class FuseTransformerConv(_PygConvRule):
    """``torch_geometric.nn.TransformerConv`` -> ``fastopt.codegen.edge_attention``, its per-call
    work a :class:`_TransformerCore` with a CUDA-graph runner (its record in the report)."""

    name = "fuse_pyg_transformer_conv"
    layer = "TransformerConv"
    op = "edge_attention"
    mixin = _FusedTransformerConv

    def build(self, module: nn.Module) -> nn.Module:
        new = super().build(module)
        # in __dict__, not registered: the layer's modules and state_dict stay PyG's
        new.__dict__["_fastopt_core"] = _TransformerCore(new)
        # one layer sees several padded sizes and slot counts, in training and in evaluation: up
        # to CORE_GRAPHS x passes.max_graphs graph pairs, so that an epoch's sizes stay captured
        limit = CORE_GRAPHS * default_config().passes.max_graphs
        new.__dict__["_fastopt_core_runner"] = GraphRunner(
            GraphCapture(type(module).__name__), {"passes__max_graphs": limit}, verifying=[new])
        return new

    def _options(self, module: nn.Module) -> list:
        out = []
        if module.root_weight:
            out.append("beta" if module.lin_beta is not None else "root_weight")
        if module.dropout:
            out.append(f"dropout={module.dropout}")
        return out


# ----------------------------------------------------------------------------------------------
# GATConv
# ----------------------------------------------------------------------------------------------


class _FusedGatConv(ModuleReplacement):
    """``GATConv.forward`` with the edge softmax and aggregation fused."""

    def _fastopt_forward(self, x, edge_index, edge_attr=None, size=None,
                         return_attention_weights=None):
        if (return_attention_weights is not None or size is not None
                or not _plain_call(self, edge_index, x)):
            return self._fastopt_original(x, edge_index, edge_attr, size, return_attention_weights)
        return gat_conv(self, x, edge_index, edge_attr)


def gat_conv(layer: nn.Module, x, edge_index: Tensor, edge_attr: Optional[Tensor]) -> Tensor:
    """``GATConv`` ``layer`` on a dense edge list, softmax and sum by ``edge_softmax_aggregate``."""
    heads, channels = layer.heads, layer.out_channels
    res_lin = getattr(layer, "res", None)
    x_src, x_dst = (x, x) if isinstance(x, Tensor) else x
    res = res_lin(x_dst) if res_lin is not None else None
    if layer.lin is not None:
        h_src = layer.lin(x_src).view(-1, heads, channels)
        h_dst = h_src if x_dst is x_src else layer.lin(x_dst).view(-1, heads, channels)
    else:
        h_src = layer.lin_src(x_src).view(-1, heads, channels)
        h_dst = layer.lin_dst(x_dst).view(-1, heads, channels)
    a_src = (h_src * layer.att_src).sum(dim=-1)
    a_dst = (h_dst * layer.att_dst).sum(dim=-1)
    if layer.add_self_loops:
        edge_index, edge_attr = _self_loops(layer, edge_index, edge_attr,
                                            min(h_src.size(0), h_dst.size(0)))
    src, dst = edge_index[0], edge_index[1]
    logits = codegen.gather_rows(a_src, src) + codegen.gather_rows(a_dst, dst)
    if edge_attr is not None and layer.lin_edge is not None:
        attr = edge_attr.view(-1, 1) if edge_attr.dim() == 1 else edge_attr
        edge = layer.lin_edge(attr).view(-1, heads, channels)
        logits = logits + (edge * layer.att_edge).sum(dim=-1)
    logits = F.leaky_relu(logits, layer.negative_slope)
    return _gat_output(layer, logits, h_src, src, dst, h_dst.size(0), res)


class FuseGatConv(_PygConvRule):
    """``torch_geometric.nn.GATConv`` -> ``fastopt.codegen.edge_softmax_aggregate``."""

    name = "fuse_pyg_gat_conv"
    layer = "GATConv"
    mixin = _FusedGatConv


# ----------------------------------------------------------------------------------------------
# GATv2Conv
# ----------------------------------------------------------------------------------------------


class _FusedGatv2Conv(ModuleReplacement):
    """``GATv2Conv.forward`` with the edge softmax and aggregation fused."""

    def _fastopt_forward(self, x, edge_index, edge_attr=None, return_attention_weights=None):
        if (return_attention_weights is not None or not _plain_call(self, edge_index, x)
                or (edge_attr is not None and self.lin_edge is None)):
            return self._fastopt_original(x, edge_index, edge_attr, return_attention_weights)
        return gatv2_conv(self, x, edge_index, edge_attr)


def gatv2_conv(layer: nn.Module, x, edge_index: Tensor, edge_attr: Optional[Tensor]) -> Tensor:
    """``GATv2Conv`` ``layer`` on a dense edge list, softmax and sum by ``edge_softmax_aggregate``."""
    heads, channels = layer.heads, layer.out_channels
    res_lin = getattr(layer, "res", None)
    if isinstance(x, Tensor):
        res = res_lin(x) if res_lin is not None else None
        h_l = layer.lin_l(x).view(-1, heads, channels)
        h_r = h_l if layer.share_weights else layer.lin_r(x).view(-1, heads, channels)
    else:
        res = res_lin(x[1]) if res_lin is not None else None
        h_l = layer.lin_l(x[0]).view(-1, heads, channels)
        h_r = layer.lin_r(x[1]).view(-1, heads, channels)
    if layer.add_self_loops:
        edge_index, edge_attr = _self_loops(layer, edge_index, edge_attr,
                                            min(h_l.size(0), h_r.size(0)))
    src, dst = edge_index[0], edge_index[1]
    pair = codegen.gather_rows(h_r, dst) + codegen.gather_rows(h_l, src)
    if edge_attr is not None:
        attr = edge_attr.view(-1, 1) if edge_attr.dim() == 1 else edge_attr
        pair = pair + layer.lin_edge(attr).view(-1, heads, channels)
    logits = (F.leaky_relu(pair, layer.negative_slope) * layer.att).sum(dim=-1)
    return _gat_output(layer, logits, h_l, src, dst, h_r.size(0), res)


class FuseGatv2Conv(_PygConvRule):
    """``torch_geometric.nn.GATv2Conv`` -> ``fastopt.codegen.edge_softmax_aggregate``."""

    name, layer, mixin = "fuse_pyg_gatv2_conv", "GATv2Conv", _FusedGatv2Conv
