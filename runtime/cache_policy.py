"""Which rows SlimCache keeps on the device: the slot directory and its replacement policies.

Everything here is host-side bookkeeping on int64/int32 CPU tensors; no row data moves. The
:class:`SlotDirectory` maps row ids to cache slots and decides, batch by batch, which rows hit,
which misses are admitted and which residents are evicted. A policy only supplies the order in
which rows are worth keeping:

* :class:`LruPolicy` keeps the most recently used rows;
* :class:`FuturePolicy` keeps the rows whose next use is soonest (Belady's rule). Training visits
  batches in a known order and the sampler is reproducible, so the next use of a row is known as
  soon as the batches ahead have been announced (:class:`NextUseIndex`);
* :class:`StaticPolicy` keeps a hot set that no lookup changes (FAST's): the rows most used in a
  pre-sampled part of the epoch, replaced between epochs by those the split's last epoch used
  most (:meth:`~fastopt.runtime.table_cache.TableCache.install`).

The granularity is a batch: all rows of a batch are needed at once, a miss is served by a
staging copy whether or not it is admitted (bypass), and the rows kept after a batch are chosen
among the residents and that batch's rows. :func:`belady_optimum` computes the fewest misses any
policy can reach on a stream under exactly these rules, independently of the directory's code.

Layering: imports nothing of fastopt but :mod:`fastopt.errors`.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from fastopt.errors import CacheError
from fastopt.runtime.counting import rank_hot

__all__ = ["AccessPlan", "SlotDirectory", "ReplacementPolicy", "LruPolicy", "FuturePolicy", "StaticPolicy",
           "NextUseIndex", "BeladyResult", "belady_optimum", "access_counts", "hot_set", "split_budget",
           "make_policy", "choose_policy", "POLICIES"]

POLICIES = ("static", "lru", "future", "auto")

# A row whose next use is unknown (beyond the announced batches) or that is never used again.
NEVER = 1 << 40
# Batches per epoch that the recency tie-break of FuturePolicy tells apart (keys stay < 2**62).
_STRIDE = 1 << 21

_EMPTY = torch.empty(0, dtype=torch.int64)
# Caches of up to this many slots rank every resident for eviction candidates; larger ones keep
# them ranked as they change (RankedSlots). Break-even near 500 k slots; at 5 M, 7-11 ms against
# 66-164 ms per lookup of 60 k random ids on one core (`python bench/cache_directory.py`).
_SCAN_SLOTS = 1 << 19
# Entries RankedSlots may hold beyond twice its slots before it rebuilds its buckets.
_STALE_SLACK = 4096


@dataclass
class AccessPlan:
    """What one batch's lookup does to the cache, in positions of the batch's unique ids.

    Rows are gathered for hits before any admission overwrites a slot, so a hit whose slot is
    reused by the same batch is still served correctly.
    """

    hit_pos: torch.Tensor  # [h] positions of hits among the looked-up ids
    hit_slots: torch.Tensor  # [h] their slots
    miss_pos: torch.Tensor  # [m] positions of misses among the looked-up ids
    admit_sel: torch.Tensor  # [a] positions among the misses that are admitted
    admit_slots: torch.Tensor  # [a] the slots they take
    evict_ids: torch.Tensor  # [e] ids that lose their slot (e <= a: free slots evict nothing)
    evict_slots: torch.Tensor  # [e] their former slots
    evict_dirty: torch.Tensor  # [e] bool: rows that must be written back first
    admit_ids: torch.Tensor = field(default_factory=lambda: _EMPTY)  # [a] ids of the admitted misses

    @classmethod
    def none(cls, n: int) -> "AccessPlan":
        """A plan for a cache without slots: every one of ``n`` ids misses and nothing moves."""
        return cls(_EMPTY, _EMPTY, torch.arange(n), _EMPTY, _EMPTY, _EMPTY, _EMPTY,
                   torch.empty(0, dtype=torch.bool))


class ReplacementPolicy(ABC):
    """Orders rows by how much they are worth keeping (a smaller key is kept first)."""

    name: str = ""
    #: whether misses may enter the cache (``False`` for a fixed, preloaded hot set)
    admits: bool = True

    @abstractmethod
    def keys(self, next_use: torch.Tensor, last_use: torch.Tensor) -> torch.Tensor:
        """Sort keys of rows with the given next-use and last-use batch numbers."""

    def next_use(self, values: torch.Tensor) -> torch.Tensor:
        """Next-use batch of each of this batch's ids (only :class:`FuturePolicy` knows it)."""
        return torch.full_like(values, NEVER)


class LruPolicy(ReplacementPolicy):
    """Keep the most recently used rows."""

    name = "lru"

    def keys(self, next_use: torch.Tensor, last_use: torch.Tensor) -> torch.Tensor:
        return -last_use


class StaticPolicy(ReplacementPolicy):
    """A hot set no lookup changes (installed between epochs); misses bypass the cache."""

    name = "static"
    admits = False

    def keys(self, next_use: torch.Tensor, last_use: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(last_use)


class FuturePolicy(ReplacementPolicy):
    """Belady's rule: keep the rows used again soonest; ties (and unknown futures) by recency.

    Args:
        index: the announced batches ahead, which give every id's next use.
    """

    name = "future"

    def __init__(self, index: "NextUseIndex") -> None:
        self.index = index

    def keys(self, next_use: torch.Tensor, last_use: torch.Tensor) -> torch.Tensor:
        recency = (_STRIDE - 1) - last_use.clamp(0, _STRIDE - 1)
        return next_use * _STRIDE + recency

    def next_use(self, values: torch.Tensor) -> torch.Tensor:
        return self.index.consume(values)


class NextUseIndex:
    """Next use of every announced access, built incrementally as batches are announced.

    Batches are numbered in announce order from the start of the epoch; lookups consume them in
    the same order. When batch ``j`` is announced, each of its ids' previous announced
    occurrence learns that its next use is ``j``. Ids whose previous occurrence was already
    consumed (or that have none this epoch) are returned, so a resident row's next use can be
    refreshed from "unknown" to ``j``.

    Args:
        num_rows: size of the id space.
    """

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.reset()

    def reset(self) -> None:
        """Forget every announced batch (a new epoch renumbers batches from 0)."""
        self._last_occ = torch.full((self.num_rows,), -1, dtype=torch.int64)
        self._next = torch.empty(1024, dtype=torch.int64)
        self._offsets: List[int] = [0]
        self._batches: List[Optional[torch.Tensor]] = []
        self.consumed = 0

    @property
    def announced(self) -> int:
        return len(self._batches)

    def announce(self, values: torch.Tensor) -> torch.Tensor:
        """Append a batch of sorted unique ids; returns the ids whose next use became this batch."""
        j, base, n = self.announced, self._offsets[-1], values.numel()
        if base + n > self._next.numel():
            grown = torch.empty(max(2 * self._next.numel(), base + n), dtype=torch.int64)
            grown[:base] = self._next[:base]
            self._next = grown
        self._next[base:base + n] = NEVER
        prev = self._last_occ.index_select(0, values)
        self._next.index_fill_(0, prev[prev >= 0], j)
        self._last_occ.index_copy_(0, values, torch.arange(base, base + n))
        self._offsets.append(base + n)
        self._batches.append(values)
        return values[prev < self._offsets[self.consumed]]

    def consume(self, values: torch.Tensor) -> torch.Tensor:
        """Next use of each id of the batch being looked up now (which must be the next announced)."""
        t = self.consumed
        if t >= self.announced:
            raise CacheError(
                f"the future policy needs each batch's ids announced before its lookup; batch {t} "
                f"is looked up but only {self.announced} batches were announced. Call "
                f"SlimCache.announce() (or plan()) with the upcoming batches' ids first")
        expected = self._batches[t]
        if expected.numel() != values.numel() or not torch.equal(expected, values):
            raise CacheError(
                f"batch {t} looks up {values.numel()} unique ids but {expected.numel()} different "
                f"ones were announced for it; announce and look up the same batches in the same "
                f"order")
        self._batches[t] = None  # consumed batches are not needed again
        self.consumed += 1
        return self._next[self._offsets[t]:self._offsets[t + 1]].clone()


class RankedSlots:
    """The residents' sort keys, kept so that the largest are found without ranking every slot.

    Each slot is filed under its key: a max-heap of the keys in use, each with the slots filed
    under it (one array per filing, stamped with the filing's number). A slot filed again goes
    stale in its older entry, which its stamp tells; a stale entry is dropped when its key's
    bucket is read, and when the entries outnumber twice the slots (plus ``_STALE_SLACK``) the
    buckets are rebuilt from the live slots. :meth:`largest` reads the top buckets only, so a
    lookup costs in proportion to the rows it changes, not to the cache's capacity
    (``bench/cache_directory.py``).
    """

    def __init__(self, capacity: int) -> None:
        self.key = np.zeros(capacity, dtype=np.int64)
        self.live = np.zeros(capacity, dtype=bool)
        self.stamp = np.zeros(capacity, dtype=np.int64)  # the filing that holds each slot's entry
        self._filings = 0
        self._rebuild_from(np.empty(0, dtype=np.int64))

    def _rebuild_from(self, slots: np.ndarray) -> None:
        self._buckets: Dict[int, List[Tuple[np.ndarray, int]]] = {}
        self._heap: List[int] = []  # negated keys that have a bucket
        self._entries = 0
        self._file(slots)

    def _file(self, slots: np.ndarray) -> None:
        if slots.size == 0:
            return
        self._filings += 1
        stamp = self._filings
        self.stamp[slots] = stamp
        keys = self.key[slots]
        order = np.argsort(keys, kind="stable")
        keys, slots = keys[order], slots[order]
        cuts = np.flatnonzero(keys[1:] != keys[:-1]) + 1
        for k, part in zip(keys[np.concatenate(([0], cuts))].tolist(), np.split(slots, cuts)):
            bucket = self._buckets.get(k)
            if bucket is None:
                self._buckets[k] = [(part, stamp)]
                heapq.heappush(self._heap, -k)
            else:
                bucket.append((part, stamp))
        self._entries += slots.size

    def set(self, slots: np.ndarray, keys: np.ndarray) -> None:
        """Make ``slots`` (distinct) resident with ``keys``."""
        self.key[slots] = keys
        self.live[slots] = True
        self._file(slots)
        if self._entries > 2 * self.key.size + _STALE_SLACK:
            self._rebuild_from(np.flatnonzero(self.live))

    def reset(self, keys: np.ndarray) -> None:
        """Every resident's key at once (``keys`` per slot; free slots ignored)."""
        self.key[:] = keys
        self._rebuild_from(np.flatnonzero(self.live))

    def drop(self, slots: np.ndarray) -> None:
        self.live[slots] = False

    def largest(self, n: int) -> Tuple[np.ndarray, np.ndarray]:
        """Up to ``n`` resident slots with the largest keys, and their keys (descending)."""
        out_slots: List[np.ndarray] = []
        out_keys: List[np.ndarray] = []
        seen: List[int] = []
        while n > 0 and self._heap:
            k = -heapq.heappop(self._heap)
            parts = self._buckets.pop(k)
            slots = np.concatenate([p[self.live[p] & (self.key[p] == k) & (self.stamp[p] == f)] for p, f in parts])
            self._entries -= sum(p.size for p, _ in parts) - slots.size
            if slots.size == 0:
                continue
            self._filings += 1  # the bucket, compacted, is one filing
            self.stamp[slots] = self._filings
            self._buckets[k] = [(slots, self._filings)]
            seen.append(k)
            take = slots[:n]
            out_slots.append(take)
            out_keys.append(np.full(take.size, k, dtype=np.int64))
            n -= take.size
        for k in seen:
            heapq.heappush(self._heap, -k)
        if not out_slots:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        return np.concatenate(out_slots), np.concatenate(out_keys)


class SlotDirectory:
    """Host-side map between row ids and cache slots, with each slot's replacement state.

    Args:
        num_rows: size of the id space (rows of the host table).
        capacity: slots in the cache.
        policy: the replacement order.
    """

    def __init__(self, num_rows: int, capacity: int, policy: ReplacementPolicy) -> None:
        self.num_rows, self.capacity, self.policy = num_rows, capacity, policy
        self.slot_of = torch.full((num_rows,), -1, dtype=torch.int32)  # id -> slot, -1 = absent
        self.id_of = torch.full((capacity,), -1, dtype=torch.int64)  # slot -> id, -1 = free
        self.next_use = torch.full((capacity,), NEVER, dtype=torch.int64)
        self.last_use = torch.full((capacity,), -1, dtype=torch.int64)
        self.dirty = torch.zeros(capacity, dtype=torch.bool)
        self.batch = 0  # batches looked up so far
        # slots fill in order and a freed one is refilled at once: [filled, capacity) are the free ones
        self.filled = 0
        # the residents' keys, ranked as they change (policies that admit and so evict)
        self.ranked = RankedSlots(capacity) if policy.admits and capacity > _SCAN_SLOTS else None

    def _rank(self, slots: torch.Tensor) -> None:
        """File ``slots`` (distinct, resident) under their current keys."""
        if self.ranked is not None and slots.numel():
            keys = self.policy.keys(self.next_use.index_select(0, slots), self.last_use.index_select(0, slots))
            self.ranked.set(slots.numpy(), keys.numpy())

    @property
    def resident(self) -> int:
        return int((self.id_of >= 0).sum())

    def preload(self, ids: torch.Tensor) -> torch.Tensor:
        """Place ``ids`` (at most ``capacity``, distinct, not resident) in free slots; returns the slots."""
        if ids.numel() > self.capacity - self.filled:
            raise CacheError(f"cannot preload {ids.numel()} rows into {self.capacity - self.filled} "
                             f"free slots; preload at most the cache's capacity ({self.capacity} rows)")
        return self.install(ids)[1]

    def install(self, hot: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Make ``hot`` (distinct ids, at most ``capacity``) resident: those not yet resident take
        the free slots, then the slots of residents outside ``hot``. Returns the incoming ids,
        their slots and the evicted ids; a caller with dirty rows writes them home first (the
        reused slots come back clean)."""
        incoming = hot[self.slot_of.index_select(0, hot) < 0]
        if incoming.numel() == 0:
            return incoming, incoming, incoming
        wanted = torch.zeros(self.num_rows, dtype=torch.bool)
        wanted[hot] = True
        occupied = torch.nonzero(self.id_of >= 0).flatten()
        leaving = occupied[~wanted.index_select(0, self.id_of.index_select(0, occupied))]
        free = torch.arange(self.filled, self.capacity)
        slots = torch.cat([free, leaving])[:incoming.numel()]
        self.filled += min(free.numel(), incoming.numel())
        old = self.id_of.index_select(0, slots)
        evicted = old[old >= 0]
        self.slot_of.index_fill_(0, evicted, -1)
        self.slot_of.index_copy_(0, incoming, slots.to(torch.int32))
        self.id_of.index_copy_(0, slots, incoming)
        self.dirty.index_fill_(0, slots, False)
        self.next_use.index_fill_(0, slots, NEVER)
        self.last_use.index_fill_(0, slots, -1)
        self._rank(slots)
        return incoming, slots, evicted

    def refresh(self, ids: torch.Tensor, next_use: int) -> None:
        """Set the next use of those of ``ids`` that are resident (a newly announced batch)."""
        slots = self.slot_of.index_select(0, ids).long()
        slots = slots[slots >= 0]
        self.next_use.index_fill_(0, slots, next_use)
        self._rank(slots)

    def forget_future(self) -> None:
        """Mark every resident's next use unknown (a new epoch's batches are not announced yet)."""
        self.next_use.fill_(NEVER)
        if self.ranked is not None:
            self.ranked.reset(self.policy.keys(self.next_use, self.last_use).numpy())

    def access(self, values: torch.Tensor, announced: bool = True) -> AccessPlan:
        """Look up one batch's sorted unique ids and decide admissions and evictions.

        ``announced=False``: a lookup outside the announced sequence (the future policy's
        numbering is left alone); hits keep their next use and admitted misses get none.
        """
        t, self.batch = self.batch, self.batch + 1
        next_use = self.policy.next_use(values) if announced else None
        if self.capacity == 0:
            return AccessPlan.none(values.numel())
        slots = self.slot_of.index_select(0, values).long()
        hit = slots >= 0
        hit_pos = torch.nonzero(hit).flatten()
        miss_pos = torch.nonzero(~hit).flatten()
        # Gathers by the positions just found rather than by the mask: a mask index searches it again.
        hit_slots = slots.index_select(0, hit_pos)
        if next_use is None:
            next_use = torch.full_like(values, NEVER)
        else:
            self.next_use.index_copy_(0, hit_slots, next_use.index_select(0, hit_pos))
        self.last_use.index_fill_(0, hit_slots, t)
        self._rank(hit_slots)
        plan = AccessPlan(hit_pos, hit_slots, miss_pos, _EMPTY, _EMPTY, _EMPTY, _EMPTY,
                          torch.empty(0, dtype=torch.bool))
        m = miss_pos.numel()
        if m == 0 or not self.policy.admits:
            return plan
        miss_next = next_use.index_select(0, miss_pos)
        if m <= self.capacity - self.filled:
            # Room for every miss: the ranking below would drop only free slots.
            admit_sel = torch.arange(m)
            freed = torch.arange(self.filled, self.filled + m)
            self.filled += m
            return self._admit(plan, values, t, admit_sel, freed, miss_next)
        # The free slots are taken first; then the r largest keys among residents and misses are
        # dropped, the residents' candidates being only their r largest. Doubling the keys and
        # adding 1 to the misses' makes residents win ties: an equal miss never displaces one.
        free = np.arange(self.filled, self.capacity)
        r = m - free.size
        res_slots, res_keys = self._largest(r)
        miss_keys = self.policy.keys(miss_next, torch.full_like(miss_next, t)).numpy()
        keys = np.concatenate([res_keys * 2, miss_keys * 2 + 1])
        drop = np.argpartition(-keys, r - 1)[:r] if r < keys.size else np.arange(keys.size)
        freed = np.sort(np.concatenate([free, res_slots[drop[drop < res_slots.size]]]))
        if freed.size == 0:
            return plan
        kept = np.ones(m, dtype=bool)
        kept[drop[drop >= res_slots.size] - res_slots.size] = False
        self.filled = self.capacity
        return self._admit(plan, values, t, torch.from_numpy(np.flatnonzero(kept)), torch.from_numpy(freed),
                           miss_next)

    def _largest(self, n: int) -> Tuple[np.ndarray, np.ndarray]:
        """Up to ``n`` resident slots with the largest keys, and their keys: from the ranking, or,
        in a cache of at most ``_SCAN_SLOTS`` slots, by ranking every resident (cheaper there)."""
        if self.ranked is not None:
            return self.ranked.largest(n)
        keys = self.policy.keys(self.next_use[:self.filled], self.last_use[:self.filled]).numpy()
        if n >= keys.size:
            return np.arange(keys.size), keys
        top = np.argpartition(-keys, n - 1)[:n]
        return top, keys[top]

    def _admit(self, plan: AccessPlan, values: torch.Tensor, t: int, admit_sel: torch.Tensor,
               freed: torch.Tensor, miss_next: torch.Tensor) -> AccessPlan:
        """Give ``freed`` slots to the misses at ``admit_sel``, evicting their residents."""
        # index_select/index_copy_, not advanced indexing (far slower when intra-op threads contend)
        old = self.id_of.index_select(0, freed)
        occupied = torch.nonzero(old >= 0).flatten()
        plan.evict_ids, plan.evict_slots = old.index_select(0, occupied), freed.index_select(0, occupied)
        plan.evict_dirty = self.dirty.index_select(0, plan.evict_slots)
        self.slot_of.index_fill_(0, plan.evict_ids, -1)
        admit_ids = values.index_select(0, plan.miss_pos.index_select(0, admit_sel))
        self.slot_of.index_copy_(0, admit_ids, freed.to(torch.int32))
        self.id_of.index_copy_(0, freed, admit_ids)
        self.next_use.index_copy_(0, freed, miss_next.index_select(0, admit_sel))
        self.last_use.index_fill_(0, freed, t)
        self.dirty.index_fill_(0, freed, False)
        self._rank(freed)
        plan.admit_sel, plan.admit_slots, plan.admit_ids = admit_sel, freed, admit_ids
        return plan


def access_counts(stream: Sequence[torch.Tensor], num_rows: int) -> torch.Tensor:
    """How many batches of ``stream`` (sorted unique ids per batch) use each row."""
    counts = torch.zeros(num_rows, dtype=torch.int64)
    for values in stream:
        counts.index_add_(0, values, torch.ones_like(values))
    return counts


def split_budget(budget: int, counts: Dict[str, torch.Tensor], row_bytes: Dict[str, int],
                 ) -> Dict[str, int]:
    """Split a byte budget between tables greedily by sampled hits per byte.

    Rows of every table compete in one ranking by ``count / row_bytes``; the budget goes to the
    best rows until it runs out. What is left once every sampled row fits is shared in
    proportion to the tables' sizes, for rows the sample did not see.

    Returns:
        Bytes per table.
    """
    names = list(counts)
    value, size, owner = [], [], []
    for i, name in enumerate(names):
        c = counts[name]
        c = c[c > 0].double()
        value.append(c / row_bytes[name])
        size.append(torch.full_like(c, row_bytes[name]))
        owner.append(torch.full(c.shape, i, dtype=torch.int64))
    value_t, size_t, owner_t = torch.cat(value), torch.cat(size), torch.cat(owner)
    order = torch.sort(value_t, descending=True, stable=True).indices
    taken = torch.cumsum(size_t[order], 0) <= budget
    share = {name: 0 for name in names}
    for i, name in enumerate(names):
        share[name] = int(size_t[order][taken & (owner_t[order] == i)].sum())
    left = budget - sum(share.values())
    total = sum(counts[n].numel() * row_bytes[n] for n in names)
    for name in names:
        if left > 0 and total > 0:
            share[name] += left * counts[name].numel() * row_bytes[name] // total
    return share


@dataclass
class BeladyResult:
    """The fewest misses any batch-granular policy reaches on a stream."""

    lookups: int  # unique ids over all batches
    misses: int

    @property
    def hits(self) -> int:
        return self.lookups - self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


def belady_optimum(stream: Sequence, capacity: int, num_rows: Optional[int] = None) -> BeladyResult:
    """Offline optimum of a cache of ``capacity`` rows over ``stream`` (unique ids per batch).

    After each batch the cache keeps, among its residents and that batch's ids, the ``capacity``
    rows whose next use comes soonest; an exchange argument shows no schedule misses less when
    misses may bypass the cache. Written with NumPy and independent of :class:`SlotDirectory`.

    Args:
        stream: per batch, the distinct ids used (any order).
        capacity: rows the cache holds.
        num_rows: size of the id space (default: largest id + 1).
    """
    batches = [np.unique(np.asarray(b, dtype=np.int64)) for b in stream]
    lookups = int(sum(b.size for b in batches))
    if not batches or lookups == 0:
        return BeladyResult(lookups, 0)
    ids = np.concatenate(batches)
    when = np.repeat(np.arange(len(batches), dtype=np.int64), [b.size for b in batches])
    order = np.lexsort((when, ids))
    nxt_sorted = np.full(ids.size, NEVER, dtype=np.int64)
    same = ids[order][1:] == ids[order][:-1]
    nxt_sorted[:-1][same] = when[order][1:][same]
    nxt = np.empty_like(nxt_sorted)
    nxt[order] = nxt_sorted
    if num_rows is None:
        num_rows = int(ids.max()) + 1
    resident = np.zeros(num_rows, dtype=bool)
    key = np.full(num_rows, NEVER, dtype=np.int64)
    count, misses, start = 0, 0, 0
    for b in batches:
        n_next = nxt[start:start + b.size]
        start += b.size
        missed = ~resident[b]
        misses += int(missed.sum())
        if capacity <= 0:
            continue
        key[b] = n_next
        resident[b[missed]] = True
        count += int(missed.sum())
        if count > capacity:
            members = np.flatnonzero(resident)
            worst = np.argpartition(key[members], capacity)[capacity:]
            resident[members[worst]] = False
            count = capacity
    return BeladyResult(lookups, misses)


def hot_set(counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """The ids of at most ``capacity`` rows with the largest positive ``counts`` (non-negative),
    most used first, lower ids first on ties: a static hot set, ranked in two passes over the
    counts (:func:`~fastopt.runtime.counting.rank_hot`; counts of 2**22 or more by their rank)."""
    c = np.ascontiguousarray(counts.numpy())
    top = int(c.max()) if c.size and capacity > 0 else 0
    if top >= 1 << 22:  # a histogram of the distinct counts instead: same order, fewer bins
        levels = np.unique(np.concatenate([np.zeros(1, c.dtype), c[c > 0]]))
        c, top = np.searchsorted(levels, c), levels.size - 1
    return torch.from_numpy(rank_hot(c, capacity, top) if top > 0 else np.zeros(0, dtype=np.int64))


def make_policy(name: str, num_rows: int) -> Tuple[ReplacementPolicy, Optional[NextUseIndex]]:
    """The policy object for a policy name (``auto`` is resolved by :func:`choose_policy` first)."""
    if name == "lru":
        return LruPolicy(), None
    if name == "static":
        return StaticPolicy(), None
    if name == "future":
        index = NextUseIndex(num_rows)
        return FuturePolicy(index), index
    raise CacheError(f"unknown cache policy {name!r}; use one of {', '.join(POLICIES)}")


def choose_policy(num_rows: int, capacity: int, sample: Optional[List[torch.Tensor]]) -> str:
    """``auto``: the policy moving the fewest rows on the sampled batches (``lru`` without one).

    Each candidate runs on a directory of its own over ``sample`` (the unique ids of the leading
    batches of an epoch); a static hot set counts as moved rows, since it is copied in too.
    """
    if sample is None or capacity == 0 or not sample:
        return "lru"
    best, best_rows = "lru", None
    for name in ("future", "lru", "static"):
        policy, index = make_policy(name, num_rows)
        directory = SlotDirectory(num_rows, capacity, policy)
        moved = 0
        if index is not None:
            for values in sample:
                directory.refresh(index.announce(values), index.announced - 1)
        if name == "static":
            hot = hot_set(access_counts(sample, num_rows), capacity)
            directory.preload(hot)
            moved += hot.numel()
        for values in sample:
            moved += directory.access(values).miss_pos.numel()
        if best_rows is None or moved < best_rows:
            best, best_rows = name, moved
    return best
