"""One table of SlimCache: its declaration, host copy, device slots, staged misses and counters.

:class:`~fastopt.runtime.SlimCache` splits one budget between several tables and serialises the
calls; everything that concerns a single table lives here, in :class:`TableCache`:

* the host copy the cache owns (pinned on a GPU, in the transfer dtype for static tables), or,
  for a table declared ``mapped``, the caller's table itself, read in place; the slot array and
  the id->slot map on the device, and the host-side :class:`SlotDirectory` that decides hits,
  admissions and evictions;
* staging a lookup: the batch's misses are gathered on the host into a staging buffer and copied
  with the packed index vectors in one upload (:class:`PendingRows`); everything the device needs
  is worked out here, from the ids and the plan, on the thread that stages;
* finishing it on the device in a few launches and no wait for the host: hits read from their
  slots, misses from the staged rows, dirty evicted rows written home before admissions reuse
  their slots, admissions copied from one slice of the staged rows, and the id->slot map updated
  with one copy;
* writes of a read-write table: to the slot of a resident row (marked dirty), straight to the
  host for the others, and the write-back of dirty rows at a flush;
* :class:`CacheCounters`, what the table's cache did.

The caller holds SlimCache's lock and has checked the arguments; a :class:`TableCache` checks
only what depends on its own state (ids within its rows, lookups finished in order).

Layering: imports nothing of fastopt but :mod:`fastopt.errors` and other runtime modules.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from dataclasses import dataclass, fields
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from fastopt.errors import CacheError
from fastopt.runtime.blocks import Unique
from fastopt.runtime.cache_policy import AccessPlan, SlotDirectory, hot_set, make_policy
from fastopt.runtime.counting import count_uses
from fastopt.runtime.run_plans import RunPlans, run_of
from fastopt.runtime.staging import HostGatherer, StagingBuffers, TransferStream, pack_tensors, unpack_tensors

# Rows a hot-set install loads per staging buffer (a cache of millions of slots is filled in parts).
_INSTALL_ROWS = 1 << 16

__all__ = ["CacheTable", "UniqueRows", "PendingRows", "CacheCounters", "TableCache", "Ids",
           "check_table", "admitted_first"]

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
        mapped: ``data`` is a memory-mapped file (or any table too large to copy): the cache
            keeps no host copy of it and gathers each batch's misses straight from it into the
            (pinned) staging buffers, converting to the transfer dtype per gather. A pinned copy
            would read the whole file into page-locked RAM, which is what mapping avoids. Only
            for static tables: a read-write table needs a host copy its rows are written to.
    """

    data: torch.Tensor
    writable: bool = False
    width: Optional[int] = None
    dtype: Optional[torch.dtype] = None
    mapped: bool = False


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
    # on the device, views of one upload: the batch's inverse; the slot each row is read from
    # (empty without hits); where each staged row goes; the admitted misses' slots; the ids whose
    # id->slot map entry changes and the new entries (int32); the dirty slots written home
    device_index: List[torch.Tensor]
    # [pad + misses, *row] on the device (on the CPU: the staging buffer): the padding row (zeros),
    # the admitted misses, then the others
    staged: torch.Tensor
    event: Optional[torch.cuda.Event] = None
    dirty_ids: Optional[torch.Tensor] = None  # ids of the dirty slots, on the host


class TableCache:
    """One table's host copy, device slots, directory, staging and counters.

    Args:
        name: the table's name in the cache (for messages).
        spec: the table's declaration, already checked by :func:`check_table`.
        device: where its rows are served.
        transfer: dtype a static floating-point table travels and is cached in.
        threads: host threads gathering its misses.
    """

    def __init__(self, name: str, spec: CacheTable, device: torch.device, transfer: torch.dtype,
                 threads: int, read_rows: Optional[Callable] = None) -> None:
        data = spec.data
        self.name, self.writable, self.device = name, spec.writable, device
        self.is_1d = data.dim() == 1
        host = data.reshape(-1, 1) if self.is_1d else data
        if spec.writable or not host.is_floating_point():
            self.dtype = host.dtype
        else:
            self.dtype = transfer
        if spec.mapped:
            # Read in place: misses are gathered from the mapping into the pinned staging
            # buffers, so only the rows a batch misses are read from the file.
            self.host = host
        else:
            # The cache owns its host copy: writes land there, and a GPU needs it pinned.
            # (a pinned table of the right dtype is only ever read: it is shared, not copied)
            if spec.writable or host.dtype != self.dtype or (
                    device.type == "cuda" and not (host.is_pinned() and host.is_contiguous())):
                host = host.to(self.dtype, copy=True)
            if device.type == "cuda":
                host = host.pin_memory()
            self.host = host.contiguous()
        self.num_rows = self.host.shape[0]
        self.row_shape = tuple(self.host.shape[1:])
        # bytes on the wire and in the slots: the transfer dtype's, whatever the host table's
        self.row_bytes = int(math.prod(self.row_shape)) * self.dtype.itemsize
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
        # zero-copy reads (read_rows: codegen.cached_rows): the device reads misses from the host
        # table itself; a static hot set per split, refreshed from the rows its last epoch used
        self.read_rows = read_rows
        self.seen: Optional[torch.Tensor] = None  # uses per run and row in the current epoch
        self.split = ""
        self.used: Dict[str, torch.Tensor] = {}  # split -> uses per run and row in its last epoch
        # hot sets per run of the epoch's batches (begin_split's phases): their plans (with one
        # bit per run and row, what the counts take as hits), the run installed
        self.phases, self.batches, self.phase = 1, 0, 0
        self.counted = 0  # batches the current epoch counted uses of
        self.runs: Optional[RunPlans] = None

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
        # what zero-copy reads pass as slots: the kernel takes none that are empty; a reader
        # that checks the cache's tensors once (read_rows.bind), where the kernel offers one
        self._read_slots = self.slots if capacity else torch.zeros((1,) + self.row_shape, dtype=self.dtype,
                                                                   device=self.device)
        if self.read_rows is not None:
            bind = getattr(self.read_rows, "bind", None)
            self._reader = (bind(self.slot_map, self._read_slots, self.host) if bind is not None else
                            lambda ids: self.read_rows(ids, self.slot_map, self._read_slots, self.host))

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
            return values, inverse, int(lo == -1)
        return values, inverse, 0

    def uses(self, values: torch.Tensor, inverse: torch.Tensor, pad: int, announced: bool = True,
             slot_of: Optional[torch.Tensor] = None, index: int = 0) -> Tuple[int, int]:
        """``(requested, hits)`` of :meth:`unique_of`'s result for the epoch's batch ``index``:
        the batch's valid (non-padding) entries before dedup, and its valid ids with a slot in
        ``slot_of`` (0 without it), where the epoch has runs, in its run's hot set (the slots
        then hold it: :meth:`enter`); announced, each valid id is one more use for the next
        epoch's hot set of its run."""
        phase = self.phase_of(index)
        seen = self.seen[phase].numpy() if announced and self.seen is not None else None
        self.counted += seen is not None
        hot = None
        if slot_of is not None and self.runs is not None and self.runs.bits is not None:
            self.runs.ready(phase)
            slot_of, hot = None, self.runs.bits
        return count_uses(values.numpy(), inverse.reshape(-1).numpy(), bool(pad), seen,
                          None if slot_of is None else slot_of.numpy(), hot, phase)

    # ---------------------------------------------------------------- lookups

    def stage(self, values: torch.Tensor, inverse: torch.Tensor, pad: int,
              transfer: TransferStream, announced: bool = True) -> PendingRows:
        """Plan a lookup of ``unique_of``'s result, gather its misses and start their copy.

        Everything :meth:`finish` needs is derived here on the host, so that it only launches
        copies: the staged rows lead with a zero row for the padding and the admitted misses (the
        slot array takes one slice of them), and the index vectors (the batch's inverse, the slot
        each row is read from, the staged rows' positions, the admissions' slots, the id->slot
        map's new entries, the dirty slots) travel packed in one upload with the staged rows.
        ``announced=False``: a lookup the future policy was not told of
        (:meth:`~fastopt.runtime.cache_policy.SlotDirectory.access`).
        """
        real = values[pad:]
        plan = self.directory.access(real, announced)
        h, m = plan.hit_pos.numel(), plan.miss_pos.numel()
        self._count(real, self.uses(values, inverse, pad, announced)[0], h)
        c = self.counters
        c.evictions += plan.evict_ids.numel()
        miss_pos = plan.miss_pos.numpy()[admitted_first(plan.admit_sel.numpy(), m)]
        turn, buf = self.staging.acquire(pad + m)
        if pad:
            buf[0].zero_()
        c.staging_seconds += self.gatherer.gather(
            self.host, torch.from_numpy(real.numpy()[miss_pos]), buf[pad:])
        # Rows are read from slots whole (a miss from the first hit's slot, then overwritten): one
        # gather instead of an allocation, a fill and two scatters.
        src = np.empty(values.numel() if h else 0, dtype=np.int64)
        if h:
            hit_slots = plan.hit_slots.numpy()
            src.fill(hit_slots[0])
            src[plan.hit_pos.numpy() + pad] = hit_slots
        dst = np.concatenate([np.zeros(pad, dtype=np.int64), miss_pos + pad])
        map_ids = np.concatenate([plan.evict_ids.numpy(), plan.admit_ids.numpy()])
        map_slots = np.concatenate([np.full(plan.evict_ids.numel(), -1, dtype=np.int32),
                                    plan.admit_slots.numpy().astype(np.int32)])
        dirty_ids = None
        dirty_slots = np.empty(0, dtype=np.int64)
        if self.writable and plan.evict_ids.numel():  # a static table has no dirty rows
            dirty = plan.evict_dirty.numpy()
            dirty_slots = plan.evict_slots.numpy()[dirty]
            dirty_ids = torch.from_numpy(plan.evict_ids.numpy()[dirty])
        parts = [inverse.numpy(), src, dst, plan.admit_slots.numpy(), map_ids, dirty_slots]
        parts = [torch.from_numpy(np.ascontiguousarray(p, dtype=np.int64)) for p in parts]
        packed, layout = pack_tensors(parts + [torch.from_numpy(map_slots)], pinned=transfer.is_cuda)
        (dev_packed, staged), event = transfer.upload([packed, buf])
        self.staging.release_after(turn, event)
        device_index = unpack_tensors(dev_packed, layout)
        pending = PendingRows(self.name, self.seq, values, pad, plan, device_index, staged, event,
                              dirty_ids)
        self.seq += 1
        self.pending.append(pending)
        return pending

    def finish(self, pending: PendingRows, transfer: TransferStream) -> UniqueRows:
        """Serve the oldest staged lookup on the current stream and apply its plan to the slots.

        On the device: a gather and a scatter for the rows, one copy for the admissions and one
        for the id->slot map; only the write-back of dirty rows (read-write tables) waits for it.
        """
        if not self.pending or self.pending[0] is not pending:
            raise CacheError(f"staged lookups of table {pending.table!r} must finish in the order "
                             f"staged; lookup {pending.seq} is not the oldest outstanding one")
        self.pending.popleft()
        index, src, dst, admit_slots, map_ids, dirty_slots, map_slots = pending.device_index
        staged = pending.staged
        # index is a view of the whole upload: recording it keeps every index vector alive
        transfer.consume([staged, index], pending.event)
        if src.numel():
            # Hits are read before any admission overwrites a slot.
            rows = self.slots.index_select(0, src)
        else:
            rows = torch.empty((pending.ids.numel(),) + self.row_shape, dtype=self.dtype,
                               device=self.device)
        if dst.numel():
            rows.index_copy_(0, dst, staged)
        if dirty_slots.numel():
            # A dirty row goes home before an admission reuses its slot.
            self.write_host(pending.dirty_ids, self.slots.index_select(0, dirty_slots))
            self.counters.writebacks += dirty_slots.numel()
        a = admit_slots.numel()
        if a:
            self.slots.index_copy_(0, admit_slots, staged[pending.pad:pending.pad + a])
        if map_ids.numel():
            # Evicted ids (-1) and admitted ones (their slots) are disjoint: one copy sets both.
            self.slot_map.index_copy_(0, map_ids, map_slots)
        if self.is_1d:
            rows = rows.reshape(-1)
        return UniqueRows(pending.ids, rows, index)

    # ---------------------------------------------------------------- zero-copy reads

    def served(self, values: torch.Tensor, inverse: torch.Tensor, pad: int, index: int = 0) -> None:
        """Count the zero-copy read of the epoch's batch ``index`` (:meth:`unique_of`'s result,
        on the host) in the counters and the next hot set."""
        requested, hits = self.uses(values, inverse, pad, slot_of=self.directory.slot_of, index=index)
        self._count(values[pad:], requested, hits)

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` (on the device, any valid rows) read on the current stream by one
        launch: hits from the slots, the rest from the host table by the device itself. The
        slots, slot map and table keep their addresses: a captured read stays valid."""
        rows = self._reader(ids)
        return rows.reshape(-1) if self.is_1d else rows

    def _count(self, values: torch.Tensor, requested: int, hits: int) -> None:
        """One lookup of ``values`` (its unique valid ids, on the host) in the counters and the
        recorded stream (:meth:`uses` counts the uses that pick the next static hot set)."""
        c, n = self.counters, values.numel()
        c.batches += 1
        c.requested += requested
        c.naive_bytes += requested * self.row_bytes
        c.lookups += n
        c.dedup_bytes += n * self.row_bytes
        c.hits += hits
        c.misses += n - hits
        c.rows_h2d += n - hits
        c.bytes_h2d += (n - hits) * self.row_bytes
        if self.recorded is not None:
            self.recorded.append(values)

    def begin_split(self, split: str, transfer: TransferStream, phases: int = 1, batches: int = 0) -> None:
        """Start an epoch of ``split`` (a static hot set): keep the uses counted in the epoch
        before (not where it was left before counting its ``batches`` and its split has a whole
        epoch's), and make the hot set the rows ``split``'s last epoch used most (kept where it has
        none yet). ``phases`` > 1: the epoch's ``batches`` in that many runs of equal length, each
        with the hot set of the same run of the last epoch (:meth:`enter` installs them in turn),
        filled up to the capacity with the epoch's most used rows so that the slots hold exactly
        it; one hot set where the last epoch used fewer rows than the capacity. The first run's
        set is planned here, the others on a thread while it trains (:class:`RunPlans`)."""
        if self.runs is not None:
            self.runs.join()  # one planning thread per table at a time
        # an epoch left early (a window of it) keeps the uses of the split's last whole epoch
        whole = self.counted >= self.batches or self.split not in self.used
        if self.seen is not None and whole and int(self.seen.count_nonzero()):
            self.used[self.split] = self.seen
        phases = phases if 1 < phases <= batches else 1
        used = self.used.get(split)
        runs = None if used is None else RunPlans(used, phases, self.directory.capacity)
        self.runs, self.phases, self.split, self.batches, self.phase = runs, phases, split, batches, 0
        self.counted = 0
        # zeroed lazily by the OS (calloc): torch.zeros wrote all of [8, 50 M] here, 0.4-3 s
        self.seen = torch.from_numpy(np.zeros((self.phases, self.num_rows), dtype=np.int32))
        if self.runs is not None:
            self.make_resident(self.runs.get(0), transfer)

    def await_run(self, index: int) -> None:
        """Wait until the hot set of the run that the epoch's batch ``index`` is in is planned
        (:class:`RunPlans`; its counts take hits from it): called before the cache's lock is
        taken, so that a wait for a later run does not hold up batches of the current one."""
        runs = self.runs
        if runs is not None and runs.bits is not None:
            runs.ready(self.phase_of(index))

    def phase_of(self, index: int) -> int:
        """The run of the epoch that its batch ``index`` is in (:meth:`begin_split`)."""
        return run_of(index, self.phases, self.batches)

    def enter(self, index: int, transfer: TransferStream) -> None:
        """Before the epoch's batch ``index`` is read (in batch order, on the stream that reads
        it): install its run's hot set where the batch before was in another run."""
        phase = self.phase_of(index)
        if phase != self.phase and self.runs is not None and self.runs.count > 1:
            self.make_resident(self.runs.get(phase), transfer, on_current=True)
        self.phase = phase

    def install(self, uses: torch.Tensor, transfer: TransferStream) -> None:
        """Give the ``capacity`` most used rows slots (a static hot set: :meth:`make_resident`)."""
        self.make_resident(hot_set(uses, self.directory.capacity), transfer)

    def make_resident(self, hot: torch.Tensor, transfer: TransferStream, on_current: bool = False) -> None:
        """Give the rows ``hot`` (at most ``capacity``) slots: the free ones, then those of
        residents outside ``hot``; their rows are loaded on the transfer stream, ordered after
        the current stream's work and before its later work. ``on_current``: on the current
        stream itself, the ids uploaded from pinned memory (a run's hot set installed between
        the steps that read the slots: neither the copy stream nor the host waits for them)."""
        if self.writable:
            self.flush()  # a dirty row goes home before its slot is given to another
        incoming, slots, evicted = self.directory.install(hot)
        if incoming.numel() == 0:
            return
        stream = None if on_current else transfer.stream
        current = torch.cuda.current_stream(self.device) if stream is not None else None
        pinned = on_current and self.device.type == "cuda"
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            # the ids go up first: a pageable copy waits for its stream, which then waits for the
            # reads queued on the current stream (the host would wait for them too)
            dev_out, dev_in, dev_at = (t.pin_memory().to(self.device, non_blocking=True) if pinned
                                       else t.to(self.device) for t in (evicted, incoming, slots))
            if stream is not None:  # after the reads queued on the current stream, before those after
                stream.wait_stream(current)
            self.slot_map.index_fill_(0, dev_out, -1)
            for lo in range(0, incoming.numel(), _INSTALL_ROWS):
                ids, dev_ids, dev_slots = (t[lo:lo + _INSTALL_ROWS] for t in (incoming, dev_in, dev_at))
                self.slots.index_copy_(0, dev_slots, self._host_rows(ids, dev_ids, transfer))
                self.slot_map.index_copy_(0, dev_ids, dev_slots.to(torch.int32))
        if stream is not None:
            current.wait_stream(stream)
        c = self.counters
        c.preloaded += incoming.numel()
        c.rows_h2d += incoming.numel()
        c.bytes_h2d += incoming.numel() * self.row_bytes
        c.evictions += evicted.numel()

    def _host_rows(self, ids: torch.Tensor, dev_ids: torch.Tensor, transfer: TransferStream) -> torch.Tensor:
        """Rows ``ids`` (none of them cached) on the device, on the current stream: read by the
        device itself (zero-copy), or gathered into a staging buffer and copied."""
        if self.read_rows is not None:
            return self.read_rows(dev_ids, self.slot_map, self.slots, self.host)
        turn, buf = self.staging.acquire(ids.numel())
        self.counters.staging_seconds += self.gatherer.gather(self.host, ids, buf)
        (staged,), event = transfer.upload([buf])
        self.staging.release_after(turn, event)
        transfer.consume([staged], event)
        return staged

    # ---------------------------------------------------------------- writes

    def write(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Store checked rows (``ids`` distinct, in range, on the host; ``values`` ``[n, *row]``).

        Resident rows are updated in their slots and marked dirty; the others go to the host.
        """
        values = values.to(self.device)
        slots = self.directory.slot_of.index_select(0, ids).long()
        resident = slots >= 0
        res_pos = torch.nonzero(resident).flatten()
        away_pos = torch.nonzero(~resident).flatten()
        res_slots = slots.index_select(0, res_pos)
        # One upload of the three index vectors: each pageable copy would stall the host
        # until the device has drained its queue.
        dev_pos, dev_slots, dev_away = self._to_device([res_pos, res_slots, away_pos])
        if res_pos.numel():
            self.slots.index_copy_(0, dev_slots, values.index_select(0, dev_pos))
            self.directory.dirty.index_fill_(0, res_slots, True)
        if away_pos.numel():
            self.write_host(ids.index_select(0, away_pos), values.index_select(0, dev_away))
            self.counters.writethroughs += away_pos.numel()

    def flush(self) -> None:
        """Write every dirty row back to the host (nothing for a static or unallocated table)."""
        if self.directory is None or not self.writable:
            return
        dirty = torch.nonzero(self.directory.dirty).flatten()
        if dirty.numel() == 0:
            return
        (dev_dirty,) = self._to_device([dirty])
        rows = self.slots.index_select(0, dev_dirty)
        self.write_host(self.directory.id_of.index_select(0, dirty), rows)
        self.directory.dirty.index_fill_(0, dirty, False)
        self.counters.writebacks += dirty.numel()

    def _to_device(self, parts: List[torch.Tensor]) -> List[torch.Tensor]:
        """Host int64 vectors on the device, in one copy ordered on the current stream."""
        if self.device.type != "cuda":
            return parts
        packed = torch.cat(parts).pin_memory()
        # Pinned source: the copy is asynchronous, and the host allocator keeps the buffer until
        # the copy has run.
        dev = packed.to(self.device, non_blocking=True)
        return list(torch.split(dev, [p.numel() for p in parts]))

    def write_host(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Store device rows in the host copy; returns once they are there.

        The copy is ordered after the current stream's writes of ``rows`` and waited for before
        the host copy is touched, since the next gather of a miss reads it.
        """
        if rows.device.type == "cuda":
            out = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            out.copy_(rows, non_blocking=True)
            torch.cuda.current_stream(rows.device).synchronize()
            rows = out
        self.host.index_copy_(0, ids, rows)
        self.counters.bytes_d2h += rows.shape[0] * self.row_bytes


def check_table(name: str, spec: CacheTable) -> None:
    """Refuse a declaration SlimCache cannot serve: not a host tensor of one or two dimensions,
    a width or dtype other than the declared one, or a mapped table declared writable or not
    contiguous."""
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
    if spec.mapped and spec.writable:
        raise CacheError(f"table {name!r} is declared mapped=True and writable=True; a mapped "
                         f"table is read in place and never written, so pass mapped=False for "
                         f"read-write state (the cache then keeps a host copy to write to)")
    if spec.mapped and not data.is_contiguous():
        raise CacheError(f"table {name!r} is declared mapped=True but is not contiguous (strides "
                         f"{tuple(data.stride())}); pass the mapping itself, not a strided view")


def admitted_first(admit_sel: np.ndarray, m: int) -> np.ndarray:
    """The order of ``m`` misses that puts the admitted ones (``admit_sel``, ascending) first and
    keeps the order within each group."""
    if admit_sel.size in (0, m):  # all admitted positions are 0..m-1 in order, or none is
        return np.arange(m)
    bypass = np.ones(m, dtype=bool)
    bypass[admit_sel] = False
    return np.concatenate([admit_sel, np.flatnonzero(bypass)])
