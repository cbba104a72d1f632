# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The fast temporal neighbor sampler: T-CSR, per-node time pointers, OpenMP threads.

Semantics are those of the NumPy oracle (:class:`fastopt.sampling.NumpySampler`): candidates of a
root ``(v, t)`` are the events touching ``v`` strictly before ``t``; ``"recent"`` takes the ``k``
latest, newest first, ties broken by the later edge id; ``"uniform"`` takes every candidate when
there are at most ``k``, else ``k`` draws with replacement; layer ``l + 1`` samples around layer
``l``'s neighbors, each at its own edge's time.

How it is fast:

* T-CSR: one array of ``(neighbor, edge id, time, twin)`` entries per node, in time order,
  built in one counting pass over the (time-sorted) events, so a node's candidates are a prefix
  of its row. ``twin`` is the index of the same event's entry in the neighbor's row.
* The root layer keeps a pointer per node that only moves forward: chronological batches find
  their prefix by stepping it a few entries; a root whose time went backwards (negatives, the
  destination half of a batch) binary-searches the part before the pointer. Threads race on a
  pointer only benignly: every value it can hold is correct.
* Deeper layers need no search: a neighbor reached through an event is sampled at that event's
  time, and its candidates end at the event's twin entry (less the few entries tied with it in
  time). Directed graphs have no twins and binary-search.
* ``prange`` over rows with the static schedule; each row writes its own slots of the padded
  outputs, so the only merge is the prefix sum of the row counts into ``indptr``.
* Uniform draws come from a counter-based generator (splitmix64) keyed by (seed, epoch, batch,
  layer, row, slot): 1 and 8 threads give bit-identical batches. A row's slots are drawn and
  prefetched before they are read, so their cache misses overlap.
* Within-batch dedup with a two-level bitmap and popcount ranks: sorted unique ids and inverse
  indices in O(entries + id range / 4096), no sort; the layers' dedups run in parallel, the
  batch's then mark only the layers' distinct ids and gather through their inverses.
* Outputs are torch tensors allocated once per call and filled in place (no copies), and all
  loops of a call run in one section without the GIL.
"""

import os
import threading
import warnings

import numpy as np
import torch

from cython.parallel cimport prange, threadid
from libc.stdint cimport int64_t, uint64_t, uint8_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

from fastopt import config as fconfig
from fastopt.config import default_config
from fastopt.errors import SamplerError
from fastopt.runtime.blocks import SampledBatch, TemporalBlock, Unique
from fastopt.runtime.inputs import HighWater
from fastopt.runtime.reorder import node_rows
from fastopt.runtime.topology import plan_placement, read_topology, static_chunks, usable_cpus
from fastopt.runtime.validate import (check_fanouts, check_graph_arrays, check_roots, check_sample_size,
                                      check_threads)

__all__ = ["TemporalSampler", "OPENMP"]

OPENMP = HAVE_OPENMP  # whether this build runs its loops on OpenMP threads


include "native.pxi"


cdef enum:
    PREFETCH = 8  # rows ahead whose first T-CSR access is prefetched
    MAX_PREFETCH = 64  # uniform slots of a row drawn and prefetched before they are read


cdef inline uint64_t _mix(uint64_t z) noexcept nogil:
    """splitmix64's finalizer: a bijective 64-bit hash."""
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EBULL
    return z ^ (z >> 31)


include "tcsr.pxi"


include "dedup.pxi"


cdef inline void* _ptr(tensor):
    return <void*><uintptr_t>tensor.data_ptr()


cdef _as_input(x, dtype, np_dtype):
    """``x`` as a contiguous CPU tensor of ``dtype`` without copying, or None where that needs work."""
    if isinstance(x, torch.Tensor):
        if x.dtype is dtype and x.is_cpu and x.is_contiguous():
            return x
    elif isinstance(x, np.ndarray):
        if x.dtype == np_dtype and x.flags.c_contiguous and x.flags.writeable:
            return torch.from_numpy(x)
    return None


def _startup_environ():
    """The OpenMP variables libgomp read when ``import torch`` loaded it: those fastopt set
    before importing torch (:data:`fastopt.config.OPENMP_WAIT_POLICY`), else the environment the
    process started with (a variable set later in ``os.environ`` no longer changes libgomp)."""
    if fconfig.OPENMP_WAIT_POLICY is not None:
        return {"OMP_WAIT_POLICY": fconfig.OPENMP_WAIT_POLICY}
    try:
        with open("/proc/self/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return dict(os.environ)
    return dict(e.decode(errors="replace").partition("=")[::2] for e in entries if e)


def _warn_if_spinning_on_busy_cores(int threads):
    """Warn when libgomp will spin-wait (its default) on cores other processes keep busy."""
    env = _startup_environ()
    if threads < 2 or not HAVE_OPENMP or "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return
    cpus = usable_cpus()
    load = os.getloadavg()[0]
    if load > cpus - threads + 0.5:
        warnings.warn(
            f"TemporalSampler(threads={threads}) on {cpus} CPUs with a load average of {load:.1f}: "
            f"libgomp's default spin-waiting can make a parallel loop wait for a descheduled "
            f"thread. Start Python with OMP_WAIT_POLICY=passive in its environment (torch reads "
            f"it at import), or use fewer threads",
            RuntimeWarning, stacklevel=1)


cdef class TemporalSampler:
    """Multi-layer temporal neighbor sampler over a :class:`~fastopt.data.TemporalGraph`.

    Args:
        graph: the event stream (``src``, ``dst``, time-sorted ``ts``, ``num_nodes``).
        fanouts: neighbors per layer, outermost first, e.g. ``[10, 10]``.
        strategy: ``"recent"`` (the ``k`` latest) or ``"uniform"`` (``k`` draws with replacement).
        threads: OpenMP threads; default ``sampler.threads`` of the config (0 = every usable CPU).
        seed: seed of uniform draws; with the epoch and batch counters it fixes every draw.
        undirected: an event is a neighbor of both endpoints (default: the config's).
        reorder: ``"none"``, ``"degree"`` or ``"rcm"`` row order (default: the config's); ids in
            the outputs are always the original ones.
        pin_threads: pin threads to CPUs sharing a cache, paired by root-chunk overlap (default:
            the config's); :attr:`placement` says what was done and why.
        dedup: fill the ``unique_nodes``/``unique_eids`` fields of every block and of the batch
            (default: the config's).
        limit: use only events ``[0, limit)`` (e.g. ``graph.train_end``); default all.
        hop_dedup: merge the repeats of a layer's slots into one destination of the next layer
            (:func:`~fastopt.runtime.blocks.merge_repeats`): for consumers that read
            ``nbr_rows``; the trainer turns it on for models that declare ``reads_nbr_index``
            when ``sampler.hop_dedup`` allows. With one layer there is nothing to merge.
        pad_rows: pad merged layers' destinations to their high-water bucketed length per
            number of roots (a captured CUDA step then sees few shapes; evaluation batches, with
            more roots, do not pad the training batches).

    Call :meth:`reset` at the start of every epoch: it rewinds the per-node time pointers and
    advances the epoch of the random draws. Not reentrant: concurrent calls are serialized.

    The threads are those of the libgomp that torch loads, which reads ``OMP_WAIT_POLICY`` when
    torch is imported. On cores shared with other busy processes start Python with
    ``OMP_WAIT_POLICY=passive``: libgomp's default spin-waiting between parallel loops then
    starves the very thread it waits for.
    """

    def __cinit__(self):
        self._edges = NULL
        self._indptr = NULL
        self._ptr = NULL
        self._rows = NULL
        self._fanout = NULL
        self._bitsets = NULL
        self._merge_bits = NULL
        self._cpus = NULL
        self._num_layers = 0

    def __dealloc__(self):
        cdef int i
        if self._bitsets != NULL:
            for i in range(self._num_tasks()):
                _bitset_free(&self._bitsets[i])
        free(self._bitsets)
        if self._merge_bits != NULL:
            _bitset_free(self._merge_bits)
            free(self._merge_bits)
        free(self._edges)
        free(self._indptr)
        free(self._ptr)
        free(self._rows)
        free(self._fanout)
        free(self._cpus)

    def __init__(self, graph, fanouts=(10, 10), strategy="recent", threads=None, seed=0,
                 undirected=None, reorder=None, pin_threads=None, dedup=None, limit=None,
                 hop_dedup=False, pad_rows=False):
        cfg = default_config().sampler
        self.fanouts = check_fanouts(fanouts, strategy)
        self.strategy = strategy
        if threads is None:
            threads = cfg.threads or usable_cpus()
        self.threads = check_threads(threads)
        _warn_if_spinning_on_busy_cores(self.threads)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise SamplerError(f"seed {seed!r} must be an integer; pass e.g. seed=0")
        self.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        self.undirected = bool(cfg.undirected if undirected is None else undirected)
        self.reorder = cfg.reorder if reorder is None else reorder
        self.pin_threads = bool(cfg.pin_threads if pin_threads is None else pin_threads)
        self.dedup = bool(cfg.dedup if dedup is None else dedup)
        self.hop_dedup = bool(hop_dedup)
        self._high_water = HighWater() if pad_rows else None
        self.placement = None
        self._lock = threading.Lock()
        self._uniform = strategy == "uniform"
        self._nthreads = self.threads
        self._num_layers = len(self.fanouts)
        self._key = _mix(self.seed ^ <uint64_t>0x5A3C0FFEE)
        self._epoch = 0
        self._batch = 0

        src, dst, ts = check_graph_arrays(graph, limit)
        self._num_nodes = int(graph.num_nodes)
        self._num_edges = src.shape[0]
        rows = node_rows(src, dst, self._num_nodes, self.reorder)
        self._row_map = rows
        if rows is not None:
            self._rows = <int64_t*>malloc(max(self._num_nodes, 1) * sizeof(int64_t))
            memcpy(self._rows, _ptr(torch.from_numpy(rows)), self._num_nodes * sizeof(int64_t))
        self._build(src, dst, ts)
        self._fanout = <int64_t*>malloc(self._num_layers * sizeof(int64_t))
        for i, k in enumerate(self.fanouts):
            self._fanout[i] = k
        if self.dedup:
            self._bitsets = <Bitset*>calloc(self._num_tasks(), sizeof(Bitset))
            for i in range(self._num_tasks()):
                _bitset_init(&self._bitsets[i], self._num_nodes if self._is_node_task(i)
                             else self._num_edges + 1)
        if self.hop_dedup:  # keys: a twin entry (undirected) or an edge id (directed)
            self._merge_bits = <Bitset*>calloc(1, sizeof(Bitset))
            _bitset_init(self._merge_bits, (2 * self._num_edges if self.undirected else self._num_edges) + 1)
        self.reset(0)

    # ------------------------------------------------------------------ construction
    def _build(self, const int64_t[::1] src, const int64_t[::1] dst, const double[::1] ts):
        """Counting-sort the events into T-CSR rows; event order keeps every row time-sorted."""
        cdef int64_t n = src.shape[0], nn = self._num_nodes, e, r, total
        cdef int64_t* rows = self._rows
        cdef int64_t* cursor
        cdef int64_t a, b
        cdef bint both = self.undirected
        total = n * 2 if both else n
        self._indptr = <int64_t*>calloc(nn + 1, sizeof(int64_t))
        self._ptr = <int64_t*>malloc(max(nn, 1) * sizeof(int64_t))
        self._edges = <Entry*>malloc(max(total, 1) * sizeof(Entry))
        cursor = <int64_t*>malloc((nn + 1) * sizeof(int64_t))
        if self._indptr == NULL or self._ptr == NULL or self._edges == NULL or cursor == NULL:
            free(cursor)
            raise MemoryError(f"T-CSR of {total} entries does not fit in memory")
        with nogil:
            for e in range(n):
                self._indptr[(src[e] if rows == NULL else rows[src[e]]) + 1] += 1
                if both:
                    self._indptr[(dst[e] if rows == NULL else rows[dst[e]]) + 1] += 1
            for r in range(nn):
                self._indptr[r + 1] += self._indptr[r]
            memcpy(cursor, self._indptr, (nn + 1) * sizeof(int64_t))
            for e in range(n):
                a = _append(self._edges, cursor, src[e] if rows == NULL else rows[src[e]], dst[e], e, ts[e])
                if both:
                    b = _append(self._edges, cursor, dst[e] if rows == NULL else rows[dst[e]], src[e], e, ts[e])
                    self._edges[b].twin = a
                    self._edges[a].twin = b
        free(cursor)

    cdef int _num_tasks(self):
        # per layer: nodes and edges; for the batch: nodes, and edges when there are 2+ layers
        return 2 * self._num_layers + 1 + (self._num_layers > 1)

    cdef bint _is_node_task(self, int i):
        return i < self._num_layers or i == 2 * self._num_layers

    # ------------------------------------------------------------------ public API
    @property
    def num_nodes(self):
        return int(self._num_nodes)

    @property
    def num_edges(self):
        """Events the sampler draws from (``limit`` or all)."""
        return int(self._num_edges)

    @property
    def epoch(self):
        return int(self._epoch)

    @property
    def high_water(self):
        """The padded lengths of merged layers (a :class:`~fastopt.runtime.inputs.HighWater`),
        None without ``pad_rows``."""
        return self._high_water

    def reset(self, epoch=None):
        """Start an epoch: rewind the per-node time pointers; ``epoch`` defaults to the next one."""
        with self._lock:
            self._epoch = self._epoch + 1 if epoch is None else int(epoch)
            self._batch = 0
            if self._num_nodes:
                memcpy(self._ptr, self._indptr, self._num_nodes * sizeof(int64_t))

    def sample(self, roots, times, batch=None):
        """Sample every layer for ``roots`` at ``times``.

        Args:
            roots: ``[R]`` node ids (int64 tensor or array; other integer types are converted).
            times: ``[R]`` query times (float64; other numeric types are converted).
            batch: a non-negative integer keying this call's uniform draws (with the seed and
                the epoch), so that they do not depend on the order of calls (several loader
                threads); default: the number of calls since :meth:`reset`.

        Returns:
            A :class:`SampledBatch`: one :class:`TemporalBlock` per layer (outermost first) and,
            with ``dedup``, unique node and edge ids with inverse indices per block and batch.

        Raises:
            SamplerError: a root out of range, a non-finite time, mismatched lengths or a dtype
                that cannot be converted without loss.
        """
        r = _as_input(roots, torch.int64, np.int64)
        t = _as_input(times, torch.float64, np.float64)
        if r is None or t is None or r.dim() != 1 or r.shape != t.shape:
            r, t = (torch.from_numpy(np.require(a, requirements=("C", "W")))
                    for a in check_roots(roots, times, self._num_nodes))
        check_sample_size(r.shape[0], self.fanouts)
        if batch is not None and (isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 0):
            raise SamplerError(f"batch {batch!r} must be a non-negative integer (or None: the call count)")
        with self._lock:
            if self.pin_threads:
                self._pin(r)
            elif fo_team_pinned:
                self._unpin(fo_team_pinned)
            counter = self._batch if batch is None else int(batch)
            self._batch += 1
            try:
                batch = self._sample(r, t, counter)
            finally:
                fo_unpin_self()  # the caller lends itself to the loops only: its later threads inherit its CPU
        if batch is None:
            check_roots(roots, times, self._num_nodes)  # raises with the offending value
            raise SamplerError("roots or times are invalid")
        return batch

    # ------------------------------------------------------------------ internals
    cdef _pin(self, roots):
        """Plan the placement on the first batch, then pin every thread (the caller until sample() returns)."""
        global fo_team_pinned
        cdef int i, fails = 0, nth = self._nthreads
        cdef int* cpus
        if self.placement is None:
            nodes = roots.numpy()
            chunks = [nodes[c] for c in static_chunks(nodes.shape[0], nth)]
            self.placement = plan_placement(read_topology(), nth, chunks)
            if self.placement.cpus is not None:
                self._cpus = <int*>malloc(nth * sizeof(int))
                for i in range(nth):
                    self._cpus[i] = self.placement.cpus[i]
        if self._cpus == NULL:
            return
        cpus = self._cpus
        for i in prange(nth, nogil=True, schedule="static", chunksize=1, num_threads=nth):
            fails += fo_pin_self(cpus[threadid()]) != 0
        fo_team_pinned = max(fo_team_pinned, nth)
        if fails:
            free(self._cpus)
            self._cpus = NULL
            self.placement.cpus = None
            self.placement.reason = "the OS refused to pin threads; left them unpinned"
            self._unpin(fo_team_pinned)

    cdef _unpin(self, int nth):
        """Give the calling thread's ``nth`` loop threads, which a pinned sampler left on one CPU
        each (OpenMP keeps a caller's team from loop to loop), every CPU again: once per team."""
        global fo_team_pinned
        cdef int i
        for i in prange(nth, nogil=True, schedule="static", chunksize=1, num_threads=nth):
            fo_unpin_self()
        fo_team_pinned = 0

    cdef _sample(self, roots, times, uint64_t counter):
        """Every layer, then every dedup of one batch. Each layer's rows are sampled in one
        section without the GIL; merged repeats (``hop_dedup``) are found between layers."""
        cdef int L = self._num_layers, l, nth = self._nthreads, nt = 0, ti
        cdef int64_t m = roots.shape[0], i, err = 0, k, total = 0
        cdef Layer layer
        cdef Layer* c = &layer
        cdef Task* tasks = NULL
        cdef Seg* segs = NULL
        cdef uint64_t key = _mix(self._key ^ _mix(self._epoch * <uint64_t>0x9E3779B97F4A7C15ULL
                                                  + counter))
        blocks = []
        dst, dst_t, valid, hint = roots, times, None, None
        try:
            for l in range(L):
                k = self._fanout[l]
                nbr = torch.empty((m, k), dtype=torch.int64)
                eid = torch.empty((m, k), dtype=torch.int64)
                nts = torch.empty((m, k), dtype=torch.float64)
                dt = torch.empty((m, k), dtype=torch.float32)
                mask = torch.empty((m, k), dtype=torch.bool)
                indptr = torch.empty(m + 1, dtype=torch.int64)
                # the twin entries the next layer starts from (undirected graphs)
                next_hint = torch.empty(m * k, dtype=torch.int64) if l + 1 < L and self.undirected else None
                c.edges = self._edges
                c.indptr = self._indptr
                c.ptr = self._ptr if l == 0 else NULL
                c.rows = self._rows
                c.dst = <int64_t*>_ptr(dst)
                c.dst_t = <double*>_ptr(dst_t)
                c.valid = NULL if valid is None else <uint8_t*>_ptr(valid)
                c.hint = NULL if hint is None else <int64_t*>_ptr(hint)
                c.next_hint = NULL if next_hint is None else <int64_t*>_ptr(next_hint)
                c.num_nodes = self._num_nodes
                c.m = m
                c.k = k
                c.uniform = self._uniform
                c.key = _mix(key + <uint64_t>(l + 1) * <uint64_t>0xC2B2AE3D27D4EB4FULL)
                c.nbr = <int64_t*>_ptr(nbr)
                c.eid = <int64_t*>_ptr(eid)
                c.nts = <double*>_ptr(nts)
                c.dt = <float*>_ptr(dt)
                c.mask = <uint8_t*>_ptr(mask)
                c.out_indptr = <int64_t*>_ptr(indptr)
                with nogil:
                    for i in prange(c.m, schedule="static", num_threads=nth, use_threads_if=c.m >= 256):
                        err += _sample_row(c, i)
                    if not err:
                        c.out_indptr[0] = 0
                        for i in range(c.m):
                            c.out_indptr[i + 1] += c.out_indptr[i]
                if err:
                    return None
                block = TemporalBlock(dst, dst_t, nbr, eid, nts, dt, mask, indptr)
                blocks.append(block)
                total += m * k
                if l + 1 == L:
                    break
                if self.hop_dedup:
                    dst, dst_t, valid, hint = self._merge(block, next_hint, f"hop{l}/{roots.shape[0]}")
                else:
                    dst, dst_t, valid, hint = nbr.view(-1), nts.view(-1), mask.view(-1), next_hint
                m = dst.shape[0]
            if self.dedup:
                nt = self._num_tasks()
                tasks = <Task*>calloc(nt, sizeof(Task))
                segs = <Seg*>calloc(4 * L + 1, sizeof(Seg))
                outputs = self._plan_dedup(roots, blocks, tasks, segs)
                with nogil:
                    for ti in prange(2 * L, schedule="dynamic", chunksize=1, num_threads=nth,
                                     use_threads_if=total >= 4096):
                        _dedup_task(&tasks[ti], segs)
                    for ti in prange(2 * L, nt, schedule="dynamic", chunksize=1, num_threads=nth,
                                     use_threads_if=total >= 4096 and nt - 2 * L > 1):
                        _dedup_task(&tasks[ti], segs)
            batch = SampledBatch(roots, times, blocks)
            if nt:
                self._attach_dedup(batch, tasks, outputs)
            return batch
        finally:
            free(tasks)
            free(segs)

    cdef tuple _merge(self, block, next_hint, str kind):
        """:func:`~fastopt.runtime.blocks.merge_repeats` without the GIL: a slot's key is its
        twin entry (the event's entry in the neighbor's row: one per (neighbor, event); an
        undirected self loop's two entries take the smaller) or, on a directed graph, its edge
        id; the keys' bitmap dedup sorts them, so rows follow the T-CSR (by neighbor row, then
        time). Returns the next layer's nodes, times, validity and twin hints (None: directed)."""
        cdef int64_t n = block.mask.numel(), s, r, t, count, shift, rows
        cdef Task task
        cdef Seg seg
        keys = torch.empty(n, dtype=torch.int64)
        inverse = torch.empty(n, dtype=torch.int64)
        values = torch.empty(n + 1, dtype=torch.int64)
        nbr_rows = torch.empty(block.mask.shape, dtype=torch.int64)
        cdef int64_t* key = <int64_t*>_ptr(keys)
        cdef int64_t* inv = <int64_t*>_ptr(inverse)
        cdef int64_t* out_rows = <int64_t*>_ptr(nbr_rows)
        cdef const int64_t* nbr = <int64_t*>_ptr(block.nbr_nodes)
        cdef const int64_t* eid = <int64_t*>_ptr(block.nbr_eids)
        cdef const double* nts = <double*>_ptr(block.nbr_times)
        cdef const uint8_t* mask = <uint8_t*>_ptr(block.mask)
        cdef const int64_t* hint = NULL if next_hint is None else <int64_t*>_ptr(next_hint)
        cdef const Entry* edges = self._edges
        task.first, task.nseg, task.offset, task.values, task.bits = 0, 1, 1, <int64_t*>_ptr(values), self._merge_bits
        seg.ids, seg.inv, seg.n, seg.source = key, inv, n, NULL
        with nogil:
            for s in range(n):
                if not mask[s]:
                    key[s] = -1
                elif hint != NULL:
                    t = hint[s]
                    if edges[t].nbr == nbr[s] and edges[t].twin < t:
                        t = edges[t].twin
                    key[s] = t
                else:
                    key[s] = eid[s]
            _dedup_task(&task, &seg)
        shift = 1 if task.count and values[0] < 0 else 0
        count = task.count - shift
        rows = max(count, 1) if self._high_water is None else max(self._high_water(kind, count), count, 1)
        row_slots = torch.full((rows,), -1, dtype=torch.int64)
        dst = torch.zeros(rows, dtype=torch.int64)
        dst_t = torch.zeros(rows, dtype=torch.float64)
        valid = torch.zeros(rows, dtype=torch.bool)
        valid[:count] = True
        row_hint = None if hint == NULL else torch.zeros(rows, dtype=torch.int64)
        cdef int64_t* slot_of = <int64_t*>_ptr(row_slots)
        cdef int64_t* dst_p = <int64_t*>_ptr(dst)
        cdef double* dst_tp = <double*>_ptr(dst_t)
        cdef int64_t* hint_p = NULL if row_hint is None else <int64_t*>_ptr(row_hint)
        with nogil:
            for s in range(n):  # in slot order: a row's slot is its first
                if not mask[s]:
                    out_rows[s] = s % (count if count > 0 else 1)  # spread; masked anyway
                    continue
                r = inv[s] - shift
                out_rows[s] = r
                if slot_of[r] < 0:
                    slot_of[r] = s
                    dst_p[r] = nbr[s]
                    dst_tp[r] = nts[s]
                    if hint_p != NULL:
                        hint_p[r] = hint[s]
            for r in range(count, rows):  # padding rows: copies of slot 0, never valid
                slot_of[r] = 0
                if n:
                    dst_p[r] = nbr[0]
                    dst_tp[r] = nts[0]
        block.nbr_rows, block.row_slots = nbr_rows, row_slots
        return dst, dst_t, valid, row_hint

    cdef tuple _plan_dedup(self, roots, list blocks, Task* tasks, Seg* segs):
        """Point the dedup tasks at their id arrays; allocate their inverses and value buffers.

        Tasks: layer l's nodes (l < L), layer l's edges (L + l), the batch's nodes (2L: the
        roots and every layer's distinct nodes) and edges (2L + 1, with 2+ layers; with one
        layer they are layer 0's). The batch tasks run after the layer tasks and mark only the
        layers' distinct ids, then gather their inverses through the layers' ones. A value
        buffer holds as many ids as the task could find distinct; the returned values are a
        view of its first ``count``.
        """
        cdef int L = self._num_layers, nt = self._num_tasks(), l, ti, s = 0, src
        cdef int64_t off, cap
        nbatch = roots.shape[0] + sum(b.nbr_nodes.numel() for b in blocks)
        inverses = [torch.empty_like(b.nbr_nodes) for b in blocks] + [torch.empty_like(b.nbr_eids) for b in blocks]
        inverses.append(torch.empty(nbatch, dtype=torch.int64))
        if L > 1:
            inverses.append(torch.empty(nbatch - roots.shape[0], dtype=torch.int64))
        values, remaps = [], []
        for ti in range(nt):
            node_task = self._is_node_task(ti)
            tasks[ti].bits = &self._bitsets[ti]
            tasks[ti].offset = 0 if node_task else 1
            tasks[ti].first = s
            cap = 0
            if ti < 2 * L:
                ids = blocks[ti % L].nbr_nodes if node_task else blocks[ti % L].nbr_eids
                segs[s].ids = <int64_t*>_ptr(ids)
                segs[s].inv = <int64_t*>_ptr(inverses[ti])
                segs[s].n = cap = ids.numel()
                s += 1
            else:
                off = 0
                if node_task:
                    segs[s].ids = <int64_t*>_ptr(roots)
                    segs[s].inv = <int64_t*>_ptr(inverses[ti])
                    segs[s].n = off = cap = roots.shape[0]
                    s += 1
                for l in range(L):
                    src = l if node_task else L + l
                    remap = torch.empty(values[src].shape[0], dtype=torch.int64)
                    remaps.append(remap)
                    segs[s].source = &tasks[src]
                    segs[s].source_inv = <int64_t*>_ptr(inverses[src])
                    segs[s].nsource = inverses[src].numel()
                    segs[s].inv = <int64_t*>_ptr(remap)
                    segs[s].out = <int64_t*>_ptr(inverses[ti]) + off
                    off += segs[s].nsource
                    cap += values[src].shape[0]
                    s += 1
            tasks[ti].nseg = s - tasks[ti].first
            values.append(torch.empty(min(cap, self._num_nodes if node_task else self._num_edges + 1),
                                      dtype=torch.int64))
            tasks[ti].values = <int64_t*>_ptr(values[ti])
        return inverses, values, remaps

    cdef _attach_dedup(self, batch, Task* tasks, tuple outputs):
        """Wrap the dedup results of :meth:`_plan_dedup`'s tasks as :class:`Unique` fields."""
        cdef int L = self._num_layers, l
        inverses, values, _ = outputs
        uniques = [Unique(values[ti][:tasks[ti].count], inverses[ti]) for ti in range(len(values))]
        for l in range(L):
            batch.blocks[l].unique_nodes = uniques[l]
            batch.blocks[l].unique_eids = uniques[L + l]
        batch.unique_nodes = uniques[2 * L]
        batch.unique_eids = uniques[2 * L + 1] if L > 1 else Unique(uniques[L].values, inverses[L].view(-1))
