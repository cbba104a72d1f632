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
   policy decides what stays (:mod:`fastopt.runtime.cache_policy`): ``static`` (a hot set per
   split: the sample's at first, then, at each epoch, the rows that split's last epoch used
   most; :meth:`SlimCache.plan`'s ``split``), ``lru``, ``future`` (Belady's rule over the
   announced batches) or ``auto``.
3. **Zero-copy reads** (``config.host_reads``; a static table in pinned host memory on a GPU,
   given the ``read_rows`` kernel): :meth:`SlimCache.serve` reads a batch's rows in one launch,
   cached ones from the slots and the rest from the host table by the GPU itself, with no host
   gather, staging or per-batch bookkeeping beyond the counters. The slots hold a static hot set:
   a plan's sample when the caller plans (the loader does not: a split's first epoch starts with
   the slots empty, unless its uses were counted ahead: :meth:`SlimCache.foresee`), then each
   split's last epoch's rows (:meth:`SlimCache.begin_epoch`).

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

This module holds what spans tables: the budget and its split, the policy choice, planning, the
lock that serialises calls and the shared copy stream. What one table holds and does (its slots,
staging a lookup, applying it on the device, writes and write-back, counters) is in
:mod:`fastopt.runtime.table_cache`, which also defines the data classes exported here.

Layering: imports nothing of fastopt but :mod:`fastopt.config`, :mod:`fastopt.errors` and other
runtime modules.
"""

from __future__ import annotations

import math
import threading
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Union

import torch

from fastopt.config import MAX_HOT_SET_PHASES, CacheConfig, Config
from fastopt.errors import CacheError, ConfigError, device_memory_guard
from fastopt.runtime.blocks import Unique
from fastopt.runtime.cache_policy import (
    BeladyResult,
    access_counts,
    belady_optimum,
    choose_policy,
    split_budget,
)
from fastopt.runtime.run_plans import uses_per_run
from fastopt.runtime.staging import TransferStream
from fastopt.runtime.table_cache import (
    CacheCounters,
    CacheTable,
    Ids,
    PendingRows,
    TableCache,
    UniqueRows,
    check_table,
)

__all__ = ["SlimCache", "CacheTable", "UniqueRows", "PendingRows", "CacheCounters", "reads_zero_copy"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Lookups of one table that may be staged ahead of the one being consumed (double buffering).
_MAX_PENDING = 2
# Device allocations and copies of the cache end, when the device is full, in an error naming the
# knobs that lower memory.
_memory_guard = device_memory_guard("the feature cache (SlimCache)")


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
        read_rows: ``codegen.cached_rows``, for zero-copy reads (``config.host_reads``): a static
            table held in pinned host memory is then served by :meth:`serve`, the device reading
            the rows its slots lack from the host table itself (no host gather, no staging).

    Raises:
        CacheError: a negative budget, a budget above the device's free memory, an unknown
            policy, a table whose dtype or width does not match its declaration.
    """

    def __init__(self, tables: Mapping[str, Union[CacheTable, torch.Tensor]],
                 device: Union[str, torch.device] = "cpu", config: Optional[CacheConfig] = None,
                 budget_bytes: Union[None, int, Mapping[str, int]] = None,
                 record: bool = False, read_rows: Optional[Callable] = None) -> None:
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
        self._tables: Dict[str, TableCache] = {}
        for name, spec in tables.items():
            spec = spec if isinstance(spec, CacheTable) else CacheTable(spec)
            check_table(name, spec)
            zero_copy = reads_zero_copy(name, spec, self.device, config, read_rows)
            self._tables[name] = TableCache(name, spec, self.device, transfer, config.gather_threads,
                                            read_rows if zero_copy else None)
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
            if table.read_rows is not None:
                policy = "static"  # its hot set: the sample's, if any, then each epoch's (begin_split)
            elif policy == "auto":
                policy = choose_policy(table.num_rows, min(capacity, table.num_rows),
                                       sample[name] if sample is not None else None)
            elif policy == "static" and sample is None:
                raise CacheError(
                    f"the static policy picks its hot set from a pre-sampled part of the epoch, "
                    f"but table {name!r} was used before any plan; call "
                    f"SlimCache.plan(stream) first or use policy 'lru'")
            table.allocate(capacity, policy)
            if policy == "static" and sample is not None:
                table.install(access_counts(sample[name], table.num_rows), self._transfer)

    def plan(self, stream: Iterable[Mapping[str, Ids]], split: str = "") -> None:
        """Tell the cache this epoch's batches ahead of time (ids per table, in batch order).

        The first plan fixes the budget split and the policies: the leading
        ``config.sample_fraction`` of the batches is counted to pick the static hot set, the
        greedy split and ``auto``'s choice. Every plan starts a new epoch of the ``future``
        policy and announces all its batches; more can follow with :meth:`announce`. ``split``
        names the epoch's data (zero-copy tables keep a hot set per split).
        """
        with self._lock:
            batches = [self._unique_batch(b) for b in stream]
            if not self._sealed:
                n = max(1, math.ceil(self.config.sample_fraction * len(batches))) if batches else 0
                sample = {name: [b[name] for b in batches[:n] if name in b] for name in self._tables}
                self._seal(sample)
            self.begin_epoch(split)
            for batch in batches:
                self._announce_unique(batch)

    def begin_epoch(self, split: str = "", phases: int = 1, batches: int = 0) -> None:
        """Restart the ``future`` policy's batch numbering; announce the new epoch's batches next.
        A zero-copy table installs the hot set ``split``'s last epoch used; ``phases`` > 1: one
        for each of that many runs of the epoch's ``batches`` (:meth:`enter` installs the next
        ones; ``cache.hot_set_phases``)."""
        if not 1 <= phases <= MAX_HOT_SET_PHASES:
            raise CacheError(f"phases must be in [1, {MAX_HOT_SET_PHASES}] (got {phases}): one bit per run and "
                             f"row counts the hits; pass cache.hot_set_phases between 1 and {MAX_HOT_SET_PHASES}")
        with self._lock:
            self._seal(None)
            for table in self._tables.values():  # refused before anything changes
                if table.pending and (table.policy_name == "static" or table.index is not None):
                    raise CacheError(f"table {table.name!r} has {len(table.pending)} staged lookups, whose "
                                     f"slots a new epoch would reuse; finish them (or drain()) before "
                                     f"starting an epoch")
            for table in self._tables.values():
                if table.policy_name == "static":
                    table.begin_split(split, self._transfer, phases if table.read_rows is not None else 1, batches)
                if table.index is not None:
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
               announced: bool = True) -> UniqueRows:
        """Rows of ``ids`` (any shape; -1 = padding) as a unique-row table and an index.

        ``announced=False`` marks a lookup outside the announced batches (an ad-hoc one between
        or during epochs): the ``future`` policy does not count it as the next announced batch,
        its hits keep their known next use and its admitted misses get none.
        """
        with self._lock:
            return self._finish(self._stage(table, ids, unique, announced))

    def stage(self, table: str, ids: Optional[Ids] = None, *, unique: Optional[Unique] = None,
              announced: bool = True) -> PendingRows:
        """Start a lookup of a static table: gather misses and start their copy; finish it later.

        At most two lookups of a table may be staged ahead; they finish in the order staged.
        Read-write tables cannot be staged, since the previous step may still write them.
        ``announced`` as in :meth:`lookup`.
        """
        with self._lock:
            if self._table(table).writable:
                raise CacheError(f"table {table!r} is read-write, so it cannot be staged ahead of "
                                 f"the step that writes it; use lookup()")
            return self._stage(table, ids, unique, announced)

    def serve(self, table: str, ids: torch.Tensor, *, unique: Unique, counted: bool = True,
              index: int = 0) -> torch.Tensor:
        """Rows of a zero-copy table for ``ids`` (device ids, padding given as a valid row) on
        the current stream, in one launch; ``unique``: the batch's unique ids on the host (with
        -1 for padding), which the counters and the next hot set count (``counted=False``: a
        lookup outside the epoch, which counts nothing); ``index``: the batch's place in the
        epoch (:meth:`enter`, :meth:`count`)."""
        if counted:
            self.count(table, unique, index)
        with self._lock:
            t = self._zero_copy_table(table)
            if counted:
                t.enter(index, self._transfer)
            read = t.read
        return read(ids)

    def count(self, table: str, unique: Unique, index: int = 0) -> None:
        """Count a zero-copy read of ``unique`` (the unique ids of the epoch's batch ``index``
        on the host, -1 for padding) that :meth:`reader`'s function runs, on whichever stream and
        thread: the counters and the next hot set, as :meth:`serve` counts."""
        self._table(table).await_run(index)
        with self._lock:
            t = self._zero_copy_table(table)
            t.served(*t.unique_of(unique), index)

    def enter(self, table: str, index: int) -> None:
        """Before a zero-copy read of the epoch's batch ``index``, in batch order, on the stream
        that reads it: where the epoch runs several hot sets (``begin_epoch``'s ``phases``), make
        its run's resident."""
        with self._lock:
            self._zero_copy_table(table).enter(index, self._transfer)

    def foresee(self, table: str, split: str, lookups: Iterable[tuple], phases: int = 1,
                batches: int = 0) -> bool:
        """Count the uses of ``split``'s next epoch ahead of it, from ``lookups``: ``(index,
        unique)`` per batch (its place in the epoch, its unique ids on the host, -1 for padding),
        sampled as the epoch will sample them; the epoch's hot sets (:meth:`begin_epoch`, with the
        same ``phases`` and ``batches``) are then planned from them, not from an epoch before it
        (a split's first epoch has none); called between epochs, they replace what the split's
        current epoch counted. Returns whether a row was used (else the split's uses stay as they
        were)."""
        with self._lock:
            t = self._zero_copy_table(table)
        phases = phases if 1 < phases <= batches else 1
        used = uses_per_run(((i, *t.unique_of(u)) for i, u in lookups), phases, batches, t.num_rows)
        if not bool(used.any()):
            return False
        with self._lock:
            t.used[split] = used
            if t.split == split:  # newer than what the split's current epoch counted: begin_epoch keeps them
                t.seen = None
        return True

    def reader(self, table: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """``read(ids)``: rows of zero-copy ``table`` for device ``ids`` in one launch on the
        current stream, counting nothing (:meth:`count`). The same function for the cache's
        life: its tensors keep their addresses, so a CUDA graph may capture a read."""
        with self._lock:
            return self._zero_copy_table(table).read

    def _zero_copy_table(self, table: str) -> TableCache:
        t = self._table(table)
        if t.read_rows is None:
            raise CacheError(f"table {table!r} is not read zero-copy (cache.host_reads, a pinned "
                             f"static table on a GPU); use stage()/finish() or lookup()")
        self._seal(None)
        return t

    def zero_copy(self, table: str) -> bool:
        """Whether ``table`` is served by :meth:`serve` (zero-copy reads)."""
        return self._table(table).read_rows is not None

    def finish(self, pending: PendingRows) -> UniqueRows:
        """Complete a staged lookup on the current stream (waits only for its own copy)."""
        with self._lock:
            return self._finish(pending)

    def drain(self) -> None:
        """Finish every staged lookup still outstanding, oldest first, and drop its rows.

        A staged lookup has already changed the cache's bookkeeping; finishing it applies the
        same change to the device slots. A consumer that abandons staged lookups (an epoch left
        early) calls this before the cache is used again.
        """
        with self._lock:
            for table in self._tables.values():
                while table.pending:
                    self._finish(table.pending[0])

    @_memory_guard
    def _stage(self, name: str, ids: Optional[Ids], unique: Optional[Unique],
               announced: bool = True) -> PendingRows:
        table = self._table(name)
        if (ids is None) == (unique is None):
            raise CacheError("pass exactly one of ids= or unique= to a lookup")
        if len(table.pending) >= _MAX_PENDING:
            raise CacheError(f"table {name!r} already has {len(table.pending)} staged lookups "
                             f"(the limit is {_MAX_PENDING}); finish the oldest first")
        self._seal(None)
        values, inverse, pad = table.unique_of(unique if unique is not None else ids)
        return table.stage(values, inverse, pad, self._transfer, announced)

    @_memory_guard
    def _finish(self, pending: PendingRows) -> UniqueRows:
        return self._table(pending.table).finish(pending, self._transfer)

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
            t.write(ids, values)

    @_memory_guard
    def flush(self) -> None:
        """Write every dirty row back to the host (call at the end of an epoch)."""
        with self._lock:
            for table in self._tables.values():
                table.flush()

    # ---------------------------------------------------------------- introspection

    def _table(self, name: str) -> TableCache:
        try:
            return self._tables[name]
        except KeyError:
            raise CacheError(f"unknown cache table {name!r}; tables are {sorted(self._tables)}") from None

    @property
    def tables(self) -> List[str]:
        return list(self._tables)

    def host(self, table: str) -> torch.Tensor:
        """The host copy of a table (current for read-write tables after :meth:`flush`); for a
        table declared ``mapped``, the caller's table itself, in its own dtype."""
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


def reads_zero_copy(name: str, spec: CacheTable, device: torch.device, config: CacheConfig,
                    read_rows: Optional[Callable]) -> bool:
    """Whether table ``name`` is read zero-copy (``config.host_reads``); CacheError when asked for
    and impossible. ``auto``: on a GPU, given the kernel, for a static table in RAM under the
    static or auto policy."""
    if config.host_reads == "staged":
        return False
    why = ("no row-reading kernel was given (read_rows=codegen.cached_rows; triton needed)" if read_rows is None
           else "it is read-write (rows are written back)" if spec.writable
           else "it is memory-mapped (pinning would read the whole file into RAM)" if spec.mapped
           else f"policy {config.policy!r} admits rows per batch (zero-copy keeps a static hot set)"
           if config.policy not in ("auto", "static") else "")
    if config.host_reads == "zero_copy" and why:
        raise CacheError(f"cache.host_reads='zero_copy' cannot serve table {name!r}: {why}; use "
                         f"host_reads 'auto' or 'staged'")
    return not why and (device.type == "cuda" or config.host_reads == "zero_copy")


def _check_budget(value: int, what: str) -> None:
    if value < 0:
        raise CacheError(f"{what} must be >= 0 bytes (got {value}); pass 0 for dedup only")


def _validate_config(config: CacheConfig) -> None:
    cfg = Config(cache=config)
    try:
        cfg.validate()
    except ConfigError as err:
        raise CacheError(str(err)) from None
