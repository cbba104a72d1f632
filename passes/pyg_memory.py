"""``tensorize_tgn_memory``: PyG's ``TGNMemory`` with its message store on tensors.

PyG's ``TGNMemory`` keeps, per node and per direction (as source, as destination), the events of
the last batch the node took part in, as a Python dict of per-node tensors: every
``update_state`` loops over the batch's nodes to store them and every memory update loops over
the nodes asked for to collect them (a host round trip per node). The replacement keeps the same
messages in two logs on the device:

- a log of stored events per direction (other endpoint, time, raw message), appended batch by
  batch in the order PyG stores them (the batch sorted by node with the same ``sort`` call);
- per node, where its events start in the log and how many there are (``ptr``, ``cnt``).

Storing a batch is a handful of scatters with no host synchronization (besides the
``unique`` of the batch's nodes PyG's ``update_state`` takes); collecting the messages of
``n_id`` reads back their total count, once per memory update (to size the gather), and with
``config.kernels.check_inputs`` the ids' range in the same read (bad ids raise
:class:`~fastopt.errors.DataError`, not a device-side assert; in eval mode, where nothing is
collected, the range is read on its own). When the
log is full it is compacted to the events still referenced (one read of their count). The
messages, the aggregation (the module's own ``aggr_module``: ``LastAggregator``,
``MeanAggregator`` or any other), the message modules, the time encoder and the GRU run on the
same tensors in the same order as PyG's, so memory, last-update times and messages match PyG's
bit for bit on the same device.

The replacement shares the module's parameters and buffers (``memory``, ``last_update``,
``_assoc``; same ``state_dict`` keys) and starts from the messages its dict store holds; the
user's module keeps its dict store and should not be used alongside.
:meth:`TensorTgnMemory.stored_messages` gives the store in PyG's per-node form.

Without ``torch_geometric`` the rule recognizes nothing.
"""

from __future__ import annotations

import functools
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from fastopt.config import default_config
from fastopt.errors import DataError
from fastopt.passes.module_rewrite import ModuleRewrite, shared_copy

__all__ = ["TensorizeTgnMemory", "TensorTgnMemory", "tgn_memory_class"]

MIN_LOG = 4096
"""Smallest log capacity (events per direction)."""
_SIDES = ("s", "d")
_FIELDS = ("ptr", "cnt", "other", "t", "msg")


@functools.lru_cache(maxsize=None)
def tgn_memory_class() -> Optional[type]:
    """PyG's ``TGNMemory`` class, or None without PyG."""
    try:
        from torch_geometric.nn import TGNMemory
    except ImportError:
        return None
    return TGNMemory


def _scatter_max(t: Tensor, index: Tensor, size: int) -> Tensor:
    from torch_geometric.utils import scatter

    return scatter(t, index, 0, size, reduce="max")


class TensorTgnMemory:
    """Mixin over ``TGNMemory``: the message store on tensors (see the module docstring).

    Buffers ``_fo_<side>_<field>`` (non-persistent: not in the ``state_dict``) hold each
    direction's store; ``_fo_heads`` the number of log entries written per direction.
    """

    # ------------------------------------------------------------------ the store
    def _fo_get(self, side: str, field: str) -> Tensor:
        return self._buffers[f"_fo_{side}_{field}"]

    def _fo_set(self, side: str, **fields: Tensor) -> None:
        for field, value in fields.items():
            name = f"_fo_{side}_{field}"
            if name in self._buffers:
                self._buffers[name] = value
            else:
                self.register_buffer(name, value, persistent=False)

    def _reset_message_store(self) -> None:
        dev, nodes = self.memory.device, self.num_nodes
        for side in _SIDES:
            self._fo_set(side, ptr=torch.zeros(nodes, dtype=torch.long, device=dev),
                         cnt=torch.zeros(nodes, dtype=torch.long, device=dev),
                         other=torch.empty(0, dtype=torch.long, device=dev),
                         t=torch.empty(0, dtype=torch.long, device=dev),
                         msg=self.memory.new_empty((0, self.raw_msg_dim)))
        self.__dict__["_fo_heads"] = {side: 0 for side in _SIDES}

    def _fo_reserve(self, side: str, extra: int, t: Tensor, msg: Tensor) -> None:
        """Room for ``extra`` more log entries: the log compacted to its live entries, and grown."""
        head, log_t = self._fo_heads[side], self._fo_get(side, "t")
        if head + extra <= log_t.shape[0] and log_t.dtype == t.dtype \
                and self._fo_get(side, "msg").dtype == msg.dtype:
            return
        ptr, cnt = self._fo_get(side, "ptr"), self._fo_get(side, "cnt")
        live = int(cnt.sum()) if head else 0
        capacity = max(MIN_LOG, 2 * (live + extra))
        other = torch.empty(capacity, dtype=torch.long, device=ptr.device)
        times = torch.empty(capacity, dtype=t.dtype, device=ptr.device)
        msgs = msg.new_empty((capacity, msg.shape[1]))
        if live:
            pos, rows = _positions(ptr, cnt, live)
            other[:live] = self._fo_get(side, "other")[pos]
            times[:live] = log_t[pos].to(t.dtype)
            msgs[:live] = self._fo_get(side, "msg")[pos].to(msg.dtype)
            ptr = torch.cumsum(cnt, 0) - cnt
        self._fo_set(side, ptr=ptr, other=other, t=times, msg=msgs)
        self._fo_heads[side] = live

    def _fo_store(self, side: str, nodes: Tensor, others: Tensor, t: Tensor, raw: Tensor) -> None:
        """Replace the stored events of every node of ``nodes`` by its events of this batch."""
        count = nodes.numel()
        if count == 0:
            return
        self._fo_reserve(side, count, t, raw)
        head = self._fo_heads[side]
        keys, perm = nodes.sort()  # PyG's order of the stored events
        at = slice(head, head + count)
        self._fo_get(side, "other")[at] = others[perm]
        self._fo_get(side, "t")[at] = t[perm]
        self._fo_get(side, "msg")[at] = raw[perm]
        pos = torch.arange(head, head + count, device=keys.device)
        self._fo_get(side, "ptr").scatter_reduce_(0, keys, pos, "amin", include_self=False)
        self._fo_get(side, "cnt").scatter_reduce_(0, keys, torch.ones_like(pos), "sum",
                                                  include_self=False)
        self._fo_heads[side] = head + count

    def _fo_collect(self, n_id: Tensor) -> Dict[str, Tuple[Tensor, Tensor, Tensor, Tensor]]:
        """Per direction ``(src, dst, t, raw_msg)`` of the events stored for ``n_id``, in
        PyG's order (node by node as in ``n_id``, each node's events as stored)."""
        checking = default_config().kernels.check_inputs and n_id.numel() > 0
        # ids clamped until their range is read, so that a bad one raises DataError here rather
        # than a device-side assert in the gathers
        at = n_id.clamp(0, self.num_nodes - 1) if checking else n_id
        counts = {side: self._fo_get(side, "cnt")[at] for side in _SIDES}
        parts = [counts[s].sum() for s in _SIDES] + (list(torch.aminmax(n_id)) if checking else [])
        read = torch.stack(parts).tolist()  # the one host read
        if checking:
            self._fo_in_range(*read[2:])
        totals = read[:2]
        out = {}
        for side, total in zip(_SIDES, totals):
            ptr = self._fo_get(side, "ptr")[n_id]
            pos, rows = _positions(ptr, counts[side], int(total))
            out[side] = (n_id[rows], self._fo_get(side, "other")[pos],
                         self._fo_get(side, "t")[pos], self._fo_get(side, "msg")[pos])
        return out

    def stored_messages(self, side: str) -> Dict[int, Tuple[Tensor, Tensor, Tensor, Tensor]]:
        """The store of direction ``side`` (``"s"``: as source, ``"d"``: as destination) in PyG's
        form: node -> ``(src, dst, t, raw_msg)``, for the nodes with stored events."""
        nodes = torch.nonzero(self._fo_get(side, "cnt")).view(-1)
        src, dst, t, raw = self._fo_collect(nodes)[side]
        counts = self._fo_get(side, "cnt")[nodes].tolist()
        parts = [x.split(counts) for x in (src, dst, t, raw)]
        return {int(n): tuple(p[i] for p in parts) for i, n in enumerate(nodes.tolist())}

    # ------------------------------------------------------------------ TGNMemory's interface
    def reset_state(self) -> None:
        self.memory.zero_()
        self.last_update.zero_()
        self._reset_message_store()

    def forward(self, n_id: Tensor) -> Tuple[Tensor, Tensor]:
        self._fo_check(n_id=n_id)
        if self.training:
            return self._fo_updated_memory(n_id)
        self._fo_check_range(n_id)
        return self.memory[n_id], self.last_update[n_id]

    def _fo_check(self, raw_msg: Optional[Tensor] = None, **ids: Tensor) -> None:
        """Shapes (the ids' range is read with the message counts, :meth:`_fo_collect`)."""
        lengths = {name: t.numel() for name, t in ids.items()}
        for name, t in ids.items():
            if not isinstance(t, Tensor) or t.dim() != 1:
                raise DataError(f"{name} must be a 1-d tensor (got "
                                f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}); "
                                f"pass one entry per event")
        if "t" in lengths and len(set(lengths.values())) > 1:
            raise DataError(f"src, dst and t must have one length (got {lengths}); pass one entry "
                            f"per event")
        if raw_msg is not None and (raw_msg.dim() != 2 or raw_msg.shape[0] != lengths["t"]
                                    or raw_msg.shape[1] != self.raw_msg_dim):
            raise DataError(f"raw_msg has shape {tuple(raw_msg.shape)}, expected "
                            f"({lengths['t']}, {self.raw_msg_dim}) (one raw message of raw_msg_dim "
                            f"per event)")

    def _fo_in_range(self, low: int, high: int) -> None:
        if low < 0 or high >= self.num_nodes:
            bad = low if low < 0 else high
            raise DataError(f"node id {bad} is outside [0, {self.num_nodes}), the memory's "
                            f"num_nodes; build TGNMemory with more nodes or remap the ids")

    def _fo_check_range(self, n_id: Tensor) -> None:
        """Node ids in range, with ``config.kernels.check_inputs`` (one host read)."""
        if n_id.numel() and default_config().kernels.check_inputs:
            self._fo_in_range(*torch.stack(list(torch.aminmax(n_id))).tolist())

    def update_state(self, src: Tensor, dst: Tensor, t: Tensor, raw_msg: Tensor) -> None:
        self._fo_check(raw_msg, src=src, dst=dst, t=t)
        n_id = torch.cat([src, dst]).unique()
        if self.training:
            self._fo_update_memory(n_id)  # reads the ids' range before any write
        else:
            self._fo_check_range(n_id)  # the stores below write by id
        self._fo_store("s", src, dst, t, raw_msg)
        self._fo_store("d", dst, src, t, raw_msg)
        if not self.training:
            self._fo_update_memory(n_id)

    def train(self, mode: bool = True):
        if self.training and not mode:
            self._fo_update_memory(torch.arange(self.num_nodes, device=self.memory.device))
            self._reset_message_store()
        return nn.Module.train(self, mode)

    def _fo_update_memory(self, n_id: Tensor) -> None:
        memory, last_update = self._fo_updated_memory(n_id)
        self.memory[n_id] = memory
        self.last_update[n_id] = last_update

    def _fo_messages(self, stored, msg_module) -> Tensor:
        src, dst, t, raw = stored
        t_enc = self.time_enc((t - self.last_update[src]).to(raw.dtype))
        return msg_module(self.memory[src], self.memory[dst], raw, t_enc)

    def _fo_updated_memory(self, n_id: Tensor) -> Tuple[Tensor, Tensor]:
        stored = self._fo_collect(n_id)  # first: it checks the ids
        self._assoc[n_id] = torch.arange(n_id.size(0), device=n_id.device)
        msg_s = self._fo_messages(stored["s"], self.msg_s_module)
        msg_d = self._fo_messages(stored["d"], self.msg_d_module)
        idx = torch.cat([stored["s"][0], stored["d"][0]], dim=0)
        msg = torch.cat([msg_s, msg_d], dim=0)
        t = torch.cat([stored["s"][2], stored["d"][2]], dim=0)
        aggr = self.aggr_module(msg, self._assoc[idx], t, n_id.size(0))
        memory = self.gru(aggr, self.memory[n_id])
        last_update = _scatter_max(t, idx, self.last_update.size(0))[n_id]
        return memory, last_update


def _positions(ptr: Tensor, cnt: Tensor, total: int) -> Tuple[Tensor, Tensor]:
    """``(log positions, owning rows)`` of the ``total`` entries of rows with ``ptr``/``cnt``."""
    rows = torch.repeat_interleave(torch.arange(cnt.numel(), device=cnt.device), cnt,
                                   output_size=total)
    start = torch.cumsum(cnt, 0) - cnt
    pos = ptr[rows] + torch.arange(total, device=cnt.device) - start[rows]
    return pos, rows


def _import_store(memory: nn.Module, side: str, store: dict) -> None:
    """Load PyG's per-node dict store of direction ``side`` into the tensor store."""
    entries = [(node, entry) for node, entry in sorted(store.items()) if entry[0].numel()]
    if not entries:
        return
    src = torch.cat([e[0] for _, e in entries]).to(memory.memory.device)
    other = torch.cat([e[1] for _, e in entries]).to(memory.memory.device)
    t = torch.cat([e[2] for _, e in entries]).to(memory.memory.device)
    raw = torch.cat([e[3] for _, e in entries]).to(memory.memory.device)
    memory._fo_reserve(side, src.numel(), t, raw)
    counts = torch.tensor([e[0].numel() for _, e in entries], device=src.device)
    nodes = torch.tensor([n for n, _ in entries], device=src.device)
    starts = torch.cumsum(counts, 0) - counts
    memory._fo_get(side, "other")[:src.numel()] = other
    memory._fo_get(side, "t")[:src.numel()] = t
    memory._fo_get(side, "msg")[:src.numel()] = raw
    memory._fo_get(side, "ptr")[nodes] = starts
    memory._fo_get(side, "cnt")[nodes] = counts
    memory._fo_heads[side] = src.numel()


@functools.lru_cache(maxsize=None)
def _tensor_class(cls: type) -> type:
    return type(f"Tensor{cls.__name__}", (TensorTgnMemory, cls), {"__module__": __name__})


class TensorizeTgnMemory(ModuleRewrite):
    """``torch_geometric.nn.TGNMemory`` -> the same memory with its message store on tensors."""

    name = "tensorize_tgn_memory"
    op = "tensor_message_store"
    replacement = TensorTgnMemory

    def classes(self) -> Tuple[type, ...]:
        cls = tgn_memory_class()
        return (cls,) if cls is not None else ()

    def unsupported(self, module: nn.Module) -> Optional[str]:
        for attr in ("memory", "last_update", "_assoc", "msg_s_module", "msg_d_module",
                     "aggr_module", "time_enc", "gru", "msg_s_store", "msg_d_store"):
            if not hasattr(module, attr):
                return (f"this TGNMemory has no {attr!r} (another torch_geometric release?); "
                        f"the tensor store reimplements the one with it")
        return None

    def describe(self, module: nn.Module) -> str:
        return f"pyg.TGNMemory[{type(module.aggr_module).__name__}]"

    def build(self, module: nn.Module) -> nn.Module:
        new = shared_copy(module, _tensor_class(type(module)))
        stores = {"s": new.__dict__.pop("msg_s_store"), "d": new.__dict__.pop("msg_d_store")}
        new._reset_message_store()
        for side, store in stores.items():
            _import_store(new, side, store)
        return new
