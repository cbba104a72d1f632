"""SlimCache: within-batch compression and a budgeted cross-batch device cache of table rows.

A training step reads rows of several tables by id: static node and edge features, and TGN's
read-write state (node memory, its timestamps, the mailbox). SlimCache serves them in two steps:

1. **Within-batch compression.** The ids of a batch are deduplicated (the sampler's
   :class:`~fastopt.runtime.Unique`, or ``torch.unique``); only unique rows move, and the model
   receives a device table of unique rows plus the index that expands it
   (:class:`UniqueRows`), never an expanded ``[M, k, d]`` tensor built on the host.
2. **Cross-batch cache.** Each table has a slot array on the device, sized from one byte
   budget split between tables, and an id->slot map (int32, -1 = absent) on the device. Hits are
   gathered from slots on the device; misses are gathered on the host by several threads into
   pinned staging buffers and copied on a dedicated stream (:mod:`fastopt.runtime.staging`). A
   policy decides what stays (:mod:`fastopt.runtime.cache_policy`): ``static`` (preloaded hot
   set), ``lru``, ``future`` (Belady's rule over the announced batches) or ``auto``.

Read-write tables are never lost: a write to a resident row marks its slot dirty, a dirty row is
copied back before its slot is reused and at :meth:`SlimCache.flush`; a write to a row that is not
resident goes straight to the host. After a flush the host copy equals an all-on-device run bit
for bit. Static tables may travel and be cached in bfloat16/float16 (``transfer_dtype``).

Typical loop::

    cache = SlimCache({"edge_feat": CacheTable(efeat), "memory": CacheTable(mem, writable=True)},
                      device="cuda", config=cfg.cache)
    cache.plan(epoch_stream)                 # ids of the epoch's batches, from the sampler
    for batch in batches:
        pending = cache.stage("edge_feat", unique=batch.unique_eids)   # may run a batch ahead
        mem = cache.lookup("memory", unique=batch.unique_nodes)
        feats = cache.finish(pending)
        ...
        cache.write("memory", updated_ids, updated_rows)
    cache.flush()

Layering: imports nothing of fastopt but :mod:`fastopt.config`, :mod:`fastopt.errors` and other
runtime modules.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, fields
from typing import Deque, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import torch

from fastopt.config import CacheConfig, Config
from fastopt.errors import CacheError, ConfigError, device_memory_guard
from fastopt.runtime.blocks import Unique
from fastopt.runtime.cache_policy import (
    AccessPlan,
    BeladyResult,
    SlotDirectory,
    access_counts,
    belady_optimum,
    make_policy,
    split_budget,
)
from fastopt.runtime.staging import HostGatherer, StagingBuffers, TransferStream

__all__ = ["SlimCache", "CacheTable", "UniqueRows", "PendingRows", "CacheCounters"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Lookups of one table that may be staged ahead of the one being consumed (double buffering).
_MAX_PENDING = 2
# Device allocations and copies of the cache end, when the device is full, in an error naming the
# knobs that lower memory.
_memory_guard = device_memory_guard("the feature cache (SlimCache)")

Ids = Union[torch.Tensor, Unique, Sequence[int]]


@dataclass
class CacheTable:
    """A host table served through the cache.

    Args:
        data: ``[rows]`` or ``[rows, width]`` tensor on the host.
        writable: read-write state (TGN memory, mailbox): dirty rows are written back. Static
            tables are read-only and may travel in a reduced precision.
        width: expected row width; a table of another width is rejected (catches a model
            configured for 172-d features being handed 100-d ones).
        dtype: expected dtype, checked the same way.
    """

    data: torch.Tensor
    writable: bool = False
    width: Optional[int] = None
    dtype: Optional[torch.dtype] = None


@dataclass
class UniqueRows:
    """One batch's rows of one table, compressed: ``rows[index]`` is the full batch.

    ``ids`` are sorted; an id of ``-1`` (padding) comes first and its row is zeros.
    """

    ids: torch.Tensor  # [U] int64 on the host
    rows: torch.Tensor  # [U, *row] on the device
    index: torch.Tensor  # int64 on the device, shaped like the looked-up ids

    def expand(self) -> torch.Tensor:
        """The uncompressed rows, ``[*ids.shape, *row]`` (for references and tests)."""
        return self.rows[self.index]


@dataclass
class CacheCounters:
    """What one table's cache did; all counts are rows unless named bytes or seconds."""

    row_bytes: int  # bytes of one row on the wire (0 in a sum over tables)
    batches: int = 0
    requested: int = 0  # valid ids before dedup: what the naive path copies
    lookups: int = 0  # unique valid ids looked up
    naive_bytes: int = 0  # bytes of the naive path: every requested row, duplicates included
    dedup_bytes: int = 0  # bytes of within-batch compression alone: every unique row, no cache
    hits: int = 0
    misses: int = 0
    preloaded: int = 0  # rows copied in ahead of use (static hot set)
    rows_h2d: int = 0  # misses + preloaded
    bytes_h2d: int = 0
    evictions: int = 0  # residents that lost their slot
    writebacks: int = 0  # dirty rows copied back to the host (on eviction or flush)
    writethroughs: int = 0  # written rows that were not resident, stored to the host directly
    bytes_d2h: int = 0
    staging_seconds: float = 0.0  # host time gathering misses into staging buffers

    @property
    def hit_rate(self) -> float:
        """Hits over unique rows looked up."""
        return self.hits / self.lookups if self.lookups else 0.0

    def __add__(self, other: "CacheCounters") -> "CacheCounters":
        out = CacheCounters(row_bytes=0)
        for f in fields(self):
            setattr(out, f.name, getattr(self, f.name) + getattr(other, f.name))
        return out

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["hit_rate"] = self.hit_rate
        return out


@dataclass
class PendingRows:
    """A staged lookup: misses are gathered and their copy is in flight; :meth:`SlimCache.finish` it."""

    table: str
    seq: int
    ids: torch.Tensor
    pad: int  # 1 when ids[0] is the padding id -1
    plan: AccessPlan
    device_index: List[torch.Tensor]  # packed index tensors, on the device
    staged: torch.Tensor  # [misses, *row] on the device (on the CPU: the staging buffer)
    event: Optional[torch.cuda.Event] = None


class _TableCache:
    """One table's host copy, device slots, directory, staging and counters."""

    def __init__(self, name: str, spec: CacheTable, device: torch.device, transfer: torch.dtype,
                 threads: int) -> None:
        data = spec.data
        self.name, self.writable, self.device = name, spec.writable, device
        self.is_1d = data.dim() == 1
        host = data.reshape(-1, 1) if self.is_1d else data
        if spec.writable or not host.is_floating_point():
            self.dtype = host.dtype
        else:
            self.dtype = transfer
        # The cache owns its host copy: writes land there, and a GPU needs it pinned.
        if spec.writable or host.dtype != self.dtype or device.type == "cuda":
            host = host.to(self.dtype, copy=True)
        if device.type == "cuda":
            host = host.pin_memory()
        self.host = host.contiguous()
        self.num_rows = self.host.shape[0]
        self.row_shape = tuple(self.host.shape[1:])
        self.row_bytes = int(math.prod(self.row_shape)) * self.host.element_size()
        self.counters = CacheCounters(row_bytes=self.row_bytes)
        self.staging = StagingBuffers(self.row_shape, self.dtype, pinned=device.type == "cuda")
        self.gatherer = HostGatherer(threads)
        self.policy_name = ""
        self.directory: Optional[SlotDirectory] = None
        self.index = None
        self.slots = torch.empty((0,) + self.row_shape, dtype=self.dtype, device=device)
        self.slot_map = torch.empty(0, dtype=torch.int32, device=device)
        self.pending: Deque[PendingRows] = deque()
        self.seq = 0
        self.recorded: Optional[List[torch.Tensor]] = None

    @property
    def table_bytes(self) -> int:
        return self.num_rows * self.row_bytes

    def allocate(self, capacity: int, policy: str) -> None:
        capacity = max(0, min(int(capacity), self.num_rows))
        self.policy_name = policy
        pol, self.index = make_policy(policy, self.num_rows)
        self.directory = SlotDirectory(self.num_rows, capacity, pol)
        self.slots = torch.empty((capacity,) + self.row_shape, dtype=self.dtype, device=self.device)
        self.slot_map = torch.full((self.num_rows,), -1, dtype=torch.int32, device=self.device)

    def unique_of(self, ids: Ids) -> tuple:
        """(sorted unique ids, inverse, pad) of ``ids``, checked against the table's range."""
        if isinstance(ids, Unique):
            values, inverse = ids.values, ids.inverse
        else:
            ids = torch.as_tensor(ids)
            if ids.is_floating_point() or ids.dtype == torch.bool:
                raise CacheError(f"ids of table {self.name!r} must be integers (got dtype "
                                 f"{ids.dtype}); pass int64 row ids")
            values, inverse = torch.unique(ids.cpu().long(), sorted=True, return_inverse=True)
        values, inverse = values.cpu().long(), inverse.cpu()
        if values.numel():
            lo, hi = int(values[0]), int(values[-1])
            if lo < -1 or hi >= self.num_rows:
                bad = lo if lo < -1 else hi
                raise CacheError(f"row id {bad} of table {self.name!r} is outside [-1, "
                                 f"{self.num_rows}) (-1 = padding); pass ids of this table's rows")
        pad = int(values.numel() > 0 and int(values[0]) == -1)
        return values, inverse, pad

    def requested(self, inverse: torch.Tensor, pad: int) -> int:
        """Valid (non-padding) entries of the batch before dedup."""
        if not pad:
            return inverse.numel()
        return int((inverse != 0).sum())


class SlimCache:
    """Within-batch compression and a budgeted cross-batch device cache of several tables.

    Args:
        tables: name -> :class:`CacheTable` (or a bare tensor: a static table).
        device: where rows are served (``"cuda"``, ``"cuda:1"`` or ``"cpu"``; on the CPU the same
            logic and counters run without copies).
        config: cache knobs (budget fraction, policy, transfer dtype, gather threads, sample
            fraction, budget split); default: the process-wide config.
        budget_bytes: the device budget in bytes, overriding ``config.budget_fraction``; an int is
            split between tables by ``config.split``, a mapping gives each table its own.
        record: keep every table's access stream for :meth:`optimum`.

    Raises:
        CacheError: a negative budget, a budget above the device's free memory, an unknown
            policy, a table whose dtype or width does not match its declaration.
    """

    def __init__(self, tables: Mapping[str, Union[CacheTable, torch.Tensor]],
                 device: Union[str, torch.device] = "cpu", config: Optional[CacheConfig] = None,
                 budget_bytes: Union[None, int, Mapping[str, int]] = None,
                 record: bool = False) -> None:
        if config is None:
            from fastopt.config import default_config
            config = default_config().cache
        self.config = config
        _validate_config(config)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise CacheError(f"device {device!r} was asked for but CUDA is not available; pass "
                             f"device='cpu'")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if not tables:
            raise CacheError("SlimCache needs at least one table; pass {'name': tensor, ...}")
        transfer = _DTYPES[config.transfer_dtype]
        self._tables: Dict[str, _TableCache] = {}
        for name, spec in tables.items():
            spec = spec if isinstance(spec, CacheTable) else CacheTable(spec)
            _check_table(name, spec)
            self._tables[name] = _TableCache(name, spec, self.device, transfer, config.gather_threads)
            if record:
                self._tables[name].recorded = []
        self._budget = self._resolve_budget(budget_bytes)
        self._transfer = TransferStream(self.device)
        self._lock = threading.RLock()
        self._sealed = False

    # ---------------------------------------------------------------- budget and planning

    def _resolve_budget(self, budget_bytes) -> Union[int, Dict[str, int]]:
        total = sum(t.table_bytes for t in self._tables.values())
        if budget_bytes is None:
            budget: Union[int, Dict[str, int]] = int(self.config.budget_fraction * total)
            wanted = budget
        elif isinstance(budget_bytes, Mapping):
            unknown = set(budget_bytes) - set(self._tables)
            if unknown:
                raise CacheError(f"budget given for unknown table(s) {sorted(unknown)}; tables are "
                                 f"{sorted(self._tables)}")
            budget = {name: int(budget_bytes.get(name, 0)) for name in self._tables}
            for name, b in budget.items():
                _check_budget(b, f"budget of table {name!r}")
            wanted = sum(min(b, self._tables[n].table_bytes) for n, b in budget.items())
        else:
            budget = int(budget_bytes)
            _check_budget(budget, "budget_bytes")
            wanted = min(budget, total)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            maps = sum(4 * t.num_rows for t in self._tables.values())
            if wanted + maps > free:
                raise CacheError(
                    f"cache budget of {wanted} bytes (plus {maps} bytes of id->slot maps) is above "
                    f"the {free} bytes free on {self.device}; lower cache.budget_fraction or "
                    f"budget_bytes")
        return budget

    @_memory_guard
    def _seal(self, sample: Optional[Dict[str, List[torch.Tensor]]]) -> None:
        """Fix each table's capacity and policy (once, at the first plan or lookup)."""
        if self._sealed:
            return
        self._sealed = True
        if isinstance(self._budget, dict):
            shares = dict(self._budget)
        elif self.config.split == "greedy" and sample is not None:
            counts = {n: access_counts(sample[n], t.num_rows) for n, t in self._tables.items()}
            shares = split_budget(self._budget, counts, {n: t.row_bytes for n, t in self._tables.items()})
        else:
            total = sum(t.table_bytes for t in self._tables.values()) or 1
            shares = {n: self._budget * t.table_bytes // total for n, t in self._tables.items()}
        for name, table in self._tables.items():
            capacity = shares[name] // table.row_bytes if table.row_bytes else 0
            policy = self.config.policy
            if policy == "auto":
                policy = _choose_policy(table, min(capacity, table.num_rows),
                                        sample[name] if sample is not None else None)
            elif policy == "static" and sample is None:
                raise CacheError(
                    f"the static policy picks its hot set from a pre-sampled part of the epoch, "
                    f"but table {name!r} was used before any plan; call "
                    f"SlimCache.plan(stream) first or use policy 'lru'")
            table.allocate(capacity, policy)
            if policy == "static" and sample is not None:
                self._preload(table, access_counts(sample[name], table.num_rows))

    def plan(self, stream: Iterable[Mapping[str, Ids]]) -> None:
        """Tell the cache this epoch's batches ahead of time (ids per table, in batch order).

        The first plan fixes the budget split and the policies: the leading
        ``config.sample_fraction`` of the batches is counted to pick the static hot set, the
        greedy split and ``auto``'s choice. Every plan starts a new epoch of the ``future``
        policy and announces all its batches; more can follow with :meth:`announce`.
        """
        with self._lock:
            batches = [self._unique_batch(b) for b in stream]
            if not self._sealed:
                n = max(1, math.ceil(self.config.sample_fraction * len(batches))) if batches else 0
                sample = {name: [b[name] for b in batches[:n] if name in b] for name in self._tables}
                self._seal(sample)
            self.begin_epoch()
            for batch in batches:
                self._announce_unique(batch)

    def begin_epoch(self) -> None:
        """Restart the ``future`` policy's batch numbering; announce the new epoch's batches next."""
        with self._lock:
            self._seal(None)
            for table in self._tables.values():
                if table.index is not None:
                    if table.pending:
                        raise CacheError(f"table {table.name!r} has {len(table.pending)} staged "
                                         f"lookups; finish them before starting an epoch")
                    table.index.reset()
                    table.directory.forget_future()

    def announce(self, batch: Mapping[str, Ids]) -> None:
        """Announce one upcoming batch's ids per table (the sampler's lookahead)."""
        with self._lock:
            self._seal(None)
            self._announce_unique(self._unique_batch(batch))

    def _unique_batch(self, batch: Mapping[str, Ids]) -> Dict[str, torch.Tensor]:
        out = {}
        for name, ids in batch.items():
            table = self._table(name)
            values, _, pad = table.unique_of(ids)
            out[name] = values[pad:]
        return out

    def _announce_unique(self, batch: Dict[str, torch.Tensor]) -> None:
        for name, values in batch.items():
            table = self._tables[name]
            if table.index is not None:
                j = table.index.announced
                table.directory.refresh(table.index.announce(values), j)

    # ---------------------------------------------------------------- lookups

    def lookup(self, table: str, ids: Optional[Ids] = None, *, unique: Optional[Unique] = None,
               ) -> UniqueRows:
        """Rows of ``ids`` (any shape; -1 = padding) as a unique-row table and an index."""
        with self._lock:
            return self._finish(self._stage(table, ids, unique))

    def stage(self, table: str, ids: Optional[Ids] = None, *, unique: Optional[Unique] = None,
              ) -> PendingRows:
        """Start a lookup of a static table: gather misses and start their copy; finish it later.

        At most two lookups of a table may be staged ahead; they finish in the order staged.
        Read-write tables cannot be staged, since the previous step may still write them.
        """
        with self._lock:
            if self._table(table).writable:
                raise CacheError(f"table {table!r} is read-write, so it cannot be staged ahead of "
                                 f"the step that writes it; use lookup()")
            return self._stage(table, ids, unique)

    def finish(self, pending: PendingRows) -> UniqueRows:
        """Complete a staged lookup on the current stream (waits only for its own copy)."""
        with self._lock:
            return self._finish(pending)

    @_memory_guard
    def _stage(self, name: str, ids: Optional[Ids], unique: Optional[Unique]) -> PendingRows:
        table = self._table(name)
        if (ids is None) == (unique is None):
            raise CacheError("pass exactly one of ids= or unique= to a lookup")
        if len(table.pending) >= _MAX_PENDING:
            raise CacheError(f"table {name!r} already has {len(table.pending)} staged lookups "
                             f"(the limit is {_MAX_PENDING}); finish the oldest first")
        self._seal(None)
        values, inverse, pad = table.unique_of(unique if unique is not None else ids)
        real = values[pad:]
        plan = table.directory.access(real)
        if table.recorded is not None:
            table.recorded.append(real)
        c = table.counters
        c.batches += 1
        requested = table.requested(inverse, pad)
        c.requested += requested
        c.naive_bytes += requested * table.row_bytes
        c.lookups += real.numel()
        c.dedup_bytes += real.numel() * table.row_bytes
        m = plan.miss_pos.numel()
        c.hits += plan.hit_pos.numel()
        c.misses += m
        c.rows_h2d += m
        c.bytes_h2d += m * table.row_bytes
        c.evictions += plan.evict_ids.numel()
        turn, buf = table.staging.acquire(m)
        c.staging_seconds += table.gatherer.gather(table.host, real.index_select(0, plan.miss_pos), buf)
        admit_ids = real.index_select(0, plan.miss_pos.index_select(0, plan.admit_sel))
        dirty_slots = plan.evict_slots[plan.evict_dirty]
        parts = [inverse.reshape(-1).long(), plan.hit_pos + pad, plan.hit_slots, plan.miss_pos + pad,
                 plan.admit_sel, plan.admit_slots, plan.evict_ids, admit_ids, dirty_slots]
        packed = torch.cat(parts)
        if self._transfer.is_cuda:
            packed = packed.pin_memory()
        (dev_packed, staged), event = self._transfer.upload([packed, buf])
        table.staging.release_after(turn, event)
        device_index = list(torch.split(dev_packed, [p.numel() for p in parts]))
        device_index[0] = device_index[0].reshape(inverse.shape)
        pending = PendingRows(name, table.seq, values, pad, plan, device_index, staged, event)
        table.seq += 1
        table.pending.append(pending)
        return pending

    @_memory_guard
    def _finish(self, pending: PendingRows) -> UniqueRows:
        table = self._table(pending.table)
        if not table.pending or table.pending[0] is not pending:
            raise CacheError(f"staged lookups of table {pending.table!r} must finish in the order "
                             f"staged; lookup {pending.seq} is not the oldest outstanding one")
        table.pending.popleft()
        index, hit_pos, hit_slots, miss_pos, admit_sel, admit_slots, evict_ids, admit_ids, dirty_slots = (
            pending.device_index)
        staged = pending.staged
        self._transfer.consume([staged, index], pending.event)
        rows = torch.empty((pending.ids.numel(),) + table.row_shape, dtype=table.dtype,
                           device=self.device)
        if pending.pad:
            rows[0].zero_()
        if hit_pos.numel():
            rows.index_copy_(0, hit_pos, table.slots.index_select(0, hit_slots))
        if miss_pos.numel():
            rows.index_copy_(0, miss_pos, staged)
        plan = pending.plan
        if dirty_slots.numel():
            # A dirty row goes home before an admission reuses its slot.
            self._write_host(table, plan.evict_ids[plan.evict_dirty],
                             table.slots.index_select(0, dirty_slots))
            table.counters.writebacks += dirty_slots.numel()
        if admit_slots.numel():
            table.slots.index_copy_(0, admit_slots, staged.index_select(0, admit_sel))
        if evict_ids.numel():
            table.slot_map.index_fill_(0, evict_ids, -1)
        if admit_ids.numel():
            table.slot_map.index_copy_(0, admit_ids, admit_slots.to(torch.int32))
        if table.is_1d:
            rows = rows.reshape(-1)
        return UniqueRows(pending.ids, rows, index)

    def _preload(self, table: _TableCache, counts: torch.Tensor) -> None:
        """Copy the most used rows of the sample into the slots (the static hot set)."""
        capacity = table.directory.capacity
        hot = torch.nonzero(counts > 0).flatten()
        if hot.numel() > capacity:
            hot = hot[torch.sort(counts[hot], descending=True, stable=True).indices[:capacity]]
        hot, _ = torch.sort(hot)
        if hot.numel() == 0:
            return
        slots = table.directory.preload(hot)
        turn, buf = table.staging.acquire(hot.numel())
        c = table.counters
        c.staging_seconds += table.gatherer.gather(table.host, hot, buf)
        (staged,), event = self._transfer.upload([buf])
        table.staging.release_after(turn, event)
        self._transfer.consume([staged], event)
        dev_slots = slots.to(self.device)
        table.slots.index_copy_(0, dev_slots, staged)
        table.slot_map.index_copy_(0, hot.to(self.device), dev_slots.to(torch.int32))
        c.preloaded += hot.numel()
        c.rows_h2d += hot.numel()
        c.bytes_h2d += hot.numel() * table.row_bytes

    # ---------------------------------------------------------------- writes

    @_memory_guard
    def write(self, table: str, ids: Ids, values: torch.Tensor) -> None:
        """Store new rows of a read-write table (``ids`` distinct, ``values`` ``[n, *row]``).

        Resident rows are updated in their slots and marked dirty; the others go to the host.
        """
        with self._lock:
            t = self._table(table)
            if not t.writable:
                raise CacheError(f"table {table!r} is static; declare it CacheTable(..., "
                                 f"writable=True) to write it")
            if t.pending:
                raise CacheError(f"table {table!r} has a staged lookup outstanding; finish it "
                                 f"before writing")
            self._seal(None)
            ids = torch.as_tensor(ids).cpu().long().reshape(-1)
            values = values.reshape((-1,) + t.row_shape) if t.is_1d else values
            if values.dtype != t.dtype or tuple(values.shape) != (ids.numel(),) + t.row_shape:
                raise CacheError(
                    f"rows written to table {table!r} are {tuple(values.shape)} {values.dtype}, "
                    f"expected {(ids.numel(),) + t.row_shape} {t.dtype}; pass one row of the "
                    f"table's width and dtype per id")
            if ids.numel() == 0:
                return
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= t.num_rows:
                bad = lo if lo < 0 else hi
                raise CacheError(f"written row id {bad} of table {table!r} is outside [0, "
                                 f"{t.num_rows}); pass ids of this table's rows")
            distinct = torch.unique(ids).numel()
            if distinct != ids.numel():
                raise CacheError(f"ids written to table {table!r} repeat ({ids.numel()} ids, "
                                 f"{distinct} distinct); write each row once per step")
            values = values.to(self.device)
            slots = t.directory.slot_of.index_select(0, ids).long()
            resident = slots >= 0
            res_pos = torch.nonzero(resident).flatten()
            away_pos = torch.nonzero(~resident).flatten()
            res_slots = slots.index_select(0, res_pos)
            # One upload of the three index vectors: each pageable copy would stall the host
            # until the device has drained its queue.
            dev_pos, dev_slots, dev_away = self._to_device([res_pos, res_slots, away_pos])
            if res_pos.numel():
                t.slots.index_copy_(0, dev_slots, values.index_select(0, dev_pos))
                t.directory.dirty.index_fill_(0, res_slots, True)
            if away_pos.numel():
                self._write_host(t, ids.index_select(0, away_pos), values.index_select(0, dev_away))
                t.counters.writethroughs += away_pos.numel()

    def _to_device(self, parts: List[torch.Tensor]) -> List[torch.Tensor]:
        """Host int64 vectors on the device, in one copy ordered on the current stream."""
        if self.device.type != "cuda":
            return parts
        packed = torch.cat(parts).pin_memory()
        # Pinned source: the copy is asynchronous, and the host allocator keeps the buffer until
        # the copy has run.
        dev = packed.to(self.device, non_blocking=True)
        return list(torch.split(dev, [p.numel() for p in parts]))

    def _write_host(self, table: _TableCache, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Store device rows in the host copy; returns once they are there.

        The copy is ordered after the current stream's writes of ``rows`` and waited for before
        the host copy is touched, since the next gather of a miss reads it.
        """
        if rows.device.type == "cuda":
            out = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            out.copy_(rows, non_blocking=True)
            torch.cuda.current_stream(rows.device).synchronize()
            rows = out
        table.host.index_copy_(0, ids, rows)
        table.counters.bytes_d2h += rows.shape[0] * table.row_bytes

    @_memory_guard
    def flush(self) -> None:
        """Write every dirty row back to the host (call at the end of an epoch)."""
        with self._lock:
            for table in self._tables.values():
                if table.directory is None or not table.writable:
                    continue
                dirty = torch.nonzero(table.directory.dirty).flatten()
                if dirty.numel() == 0:
                    continue
                (dev_dirty,) = self._to_device([dirty])
                rows = table.slots.index_select(0, dev_dirty)
                self._write_host(table, table.directory.id_of.index_select(0, dirty), rows)
                table.directory.dirty.index_fill_(0, dirty, False)
                table.counters.writebacks += dirty.numel()

    # ---------------------------------------------------------------- introspection

    def _table(self, name: str) -> _TableCache:
        try:
            return self._tables[name]
        except KeyError:
            raise CacheError(f"unknown cache table {name!r}; tables are {sorted(self._tables)}") from None

    @property
    def tables(self) -> List[str]:
        return list(self._tables)

    def host(self, table: str) -> torch.Tensor:
        """The host copy of a table (current for read-write tables after :meth:`flush`)."""
        t = self._table(table)
        return t.host.reshape(-1) if t.is_1d else t.host

    def slots(self, table: str) -> torch.Tensor:
        """The device slot array of a table, ``[capacity, *row]``."""
        return self._table(table).slots

    def slot_map(self, table: str) -> torch.Tensor:
        """The device id->slot map of a table (int32, -1 = absent), for kernels reading the cache."""
        return self._table(table).slot_map

    def capacity(self, table: str) -> int:
        """Slots of a table (0 before the first plan or lookup)."""
        t = self._table(table)
        return t.directory.capacity if t.directory is not None else 0

    def policy(self, table: str) -> str:
        """The policy a table runs (``auto`` resolved), or ``""`` before the first plan or lookup."""
        return self._table(table).policy_name

    def counters(self, table: Optional[str] = None) -> CacheCounters:
        """One table's counters, or the sum over tables."""
        if table is not None:
            return self._table(table).counters
        total = CacheCounters(row_bytes=0)
        for t in self._tables.values():
            total = total + t.counters
        return total

    def optimum(self, table: str) -> BeladyResult:
        """The offline Belady optimum for the access stream this table has seen (``record=True``)."""
        t = self._table(table)
        if t.recorded is None:
            raise CacheError(f"table {table!r} did not record its accesses; build the cache with "
                             f"record=True")
        return belady_optimum(t.recorded, self.capacity(table), t.num_rows)

    def close(self) -> None:
        """Stop the gather threads."""
        for t in self._tables.values():
            t.gatherer.close()


def _choose_policy(table: _TableCache, capacity: int, sample: Optional[List[torch.Tensor]]) -> str:
    """``auto``: the policy moving the fewest rows on the sampled batches (``lru`` without one)."""
    if sample is None or capacity == 0 or not sample:
        return "lru"
    best, best_rows = "lru", None
    for name in ("future", "lru", "static"):
        policy, index = make_policy(name, table.num_rows)
        directory = SlotDirectory(table.num_rows, capacity, policy)
        moved = 0
        if index is not None:
            for values in sample:
                directory.refresh(index.announce(values), index.announced - 1)
        if name == "static":
            counts = access_counts(sample, table.num_rows)
            hot = torch.nonzero(counts > 0).flatten()
            order = torch.sort(counts[hot], descending=True, stable=True).indices[:capacity]
            directory.preload(hot[order])
            moved += min(hot.numel(), capacity)
        for values in sample:
            moved += directory.access(values).miss_pos.numel()
        if best_rows is None or moved < best_rows:
            best, best_rows = name, moved
    return best


def _check_budget(value: int, what: str) -> None:
    if value < 0:
        raise CacheError(f"{what} must be >= 0 bytes (got {value}); pass 0 for dedup only")


def _validate_config(config: CacheConfig) -> None:
    cfg = Config(cache=config)
    try:
        cfg.validate()
    except ConfigError as err:
        raise CacheError(str(err)) from None


def _check_table(name: str, spec: CacheTable) -> None:
    data = spec.data
    if not isinstance(data, torch.Tensor):
        raise CacheError(f"table {name!r} must be a torch.Tensor (got {type(data).__name__})")
    if data.dim() not in (1, 2):
        raise CacheError(f"table {name!r} must be [rows] or [rows, width] (got shape "
                         f"{tuple(data.shape)}); reshape it to two dimensions")
    if data.device.type != "cpu":
        raise CacheError(f"table {name!r} lives on {data.device}; SlimCache serves host tables, "
                         f"pass data.cpu()")
    width = 1 if data.dim() == 1 else data.shape[1]
    if spec.width is not None and width != spec.width:
        raise CacheError(f"table {name!r} has rows of width {width} but width {spec.width} was "
                         f"declared; pass a table of width {spec.width} or fix the declaration")
    if spec.dtype is not None and data.dtype != spec.dtype:
        raise CacheError(f"table {name!r} has dtype {data.dtype} but {spec.dtype} was declared; "
                         f"convert it with .to({spec.dtype})")
