"""The one data path from an event stream to a model's inputs on the device.

plan -> sample -> stage -> :class:`~fastopt.runtime.GraphInputs`, ahead of the step::

    loader = Loader(graph, sampler, device, config)
    with loader.epoch("train", epoch=0) as batches:
        for batch in batches:            # EventBatch with .inputs on the device
            ...

* **Plan.** Chronological batches of ``config.train.batch_size`` events; each batch's negatives
  are a pure function of ``(seed, epoch, split, batch index)`` (:class:`NegativeSampler`), so
  they are the same whatever thread draws them and after a resume.
* **Sample.** The temporal sampler returns every layer's neighbors and the batch's unique node
  and edge ids (:class:`~fastopt.runtime.SampledBatch`). Graph structure never depends on
  training state, so background threads sample ``pipeline.prefetch_depth`` batches ahead
  (``pipeline.async_sampling``; ``pipeline.stage_threads`` threads stage batches in turn, the
  draws keyed by the batch so that any number of threads gives the same batches; see
  :class:`~fastopt.runtime.epoch.EpochStream`); the compiled
  sampler runs without the GIL. With ``sampler.hop_dedup`` a layer's repeated slots are one
  node of the next layer (``GraphInputs.nbr_index``).
* **Stage.** Ids, times and masks are packed into one pinned host buffer and copied at once on a
  dedicated CUDA stream; an event recorded after the copy lets the compute stream wait for that
  copy alone (never a host ``synchronize``). Static features come from the tables where
  ``cache.placement`` puts them: ``device`` (the whole table on the device, rows gathered there),
  ``host`` (rows gathered on the host into pinned buffers and copied; through SlimCache's
  budgeted device cache when ``cache.budget_fraction > 0``), or ``auto`` (device when the
  tables fit ``cache.device_budget_fraction`` of the free device memory, else host). With
  ``sampler.dedup`` only a batch's unique rows travel; without it every sampled slot's row does
  (the path of loaders that copy per slot). A memory-mapped host table is read into pinned RAM
  when it takes at most ``cache.pin_ram_fraction`` of the available memory (zero-copy reads then
  serve it), else read in place from its file.
* **Hand over.** The model receives per-slot tensors (expanded on the device) and the batch's
  unique nodes with their inverse index, the unique count padded on CUDA to the largest bucketed
  length seen so far for batches of that many roots (:class:`~fastopt.runtime.inputs.HighWater`), so that a captured step sees
  one shape once batches stop growing. With ``read_in_step`` a training batch's zero-copy reads are
  left to the consumer (``EventBatch.reads``), which runs them inside its captured step.

An exception in a background thread is raised in the consuming thread at the batch where it
happened; leaving the ``with`` block (normally, by an exception or Ctrl-C) stops the threads and
waits for them.

Layering: imports nothing of fastopt but :mod:`fastopt.config`, :mod:`fastopt.errors` and other
runtime modules. The graph is duck-typed (``src``, ``dst``, ``ts``, ``edge_feat``, ``node_feat``,
``num_nodes``, ``split_range``, ``destination_pool``).
"""

from __future__ import annotations

import inspect
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional

import numpy as np
import torch

from fastopt.config import Config
from fastopt.errors import CacheError
from fastopt.runtime.batch import SPLIT_IDS, EventBatch, NegativeSampler, RowReads
from fastopt.runtime.blocks import SampledBatch, Unique, node_set, set_inverse
from fastopt.runtime.epoch import EpochStream
from fastopt.runtime.flatten import flatten
from fastopt.runtime.inputs import GraphInputs, HighWater, per_slot
from fastopt.runtime.staging import pack_tensors, pin_if_room, unpack_tensors
from fastopt.runtime.streams import copy_stream
from fastopt.runtime.timing import StageTimer

__all__ = ["EventBatch", "Loader", "NegativeSampler", "RowReads", "StageTimer", "SPLIT_IDS"]


@dataclass
class _Staged:
    """A batch on its way to the device: tensors (device copies in flight) and the copy's event."""

    batch: EventBatch
    layers: int = 0  # sampled layers
    tensors: Dict[str, object] = field(default_factory=dict)
    event: Optional[torch.cuda.Event] = None
    pending: Optional[object] = None  # SlimCache.stage() of the edge features, finished on use
    owners: List[torch.Tensor] = field(default_factory=list)  # device allocations (CUDA): recorded on use
    event_rows: int = 0  # rows of the batch's events read after its edge rows (zero-copy reads)
    built: bool = False  # batch.inputs built when staged (CUDA, no staged SlimCache lookup)


class Loader:
    """Batches of a temporal graph, sampled and staged ahead of the training step.

    Args:
        graph: the event stream (a :class:`~fastopt.data.TemporalGraph` or anything shaped like it).
        sampler: a temporal sampler (``sample(roots, times) -> SampledBatch``, ``reset(epoch)``),
            or None for models without neighbors.
        device: where the model runs.
        config: the whole configuration (``train``, ``pipeline``, ``cache``, ``sampler`` groups).
        edge_rows: the model reads ``GraphInputs.edge_rows`` (``reads_edge_rows``).
        read_rows: SlimCache's zero-copy reader (``codegen.cached_rows``), None for none.
        read_in_step: training batches leave their zero-copy reads to the consumer, who runs
            them in its captured step (:class:`~fastopt.runtime.batch.RowReads`).
    """

    def __init__(self, graph, sampler, device: torch.device, config: Config, *,
                 edge_rows: bool = False, read_rows: Optional[Callable] = None, read_in_step: bool = False) -> None:
        self.graph, self.sampler, self.config = graph, sampler, config
        self._keyed = (None, False)  # (sampler, whether its sample() takes a batch key)
        self.edge_rows = bool(edge_rows)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.negatives = NegativeSampler(graph.destination_pool(), config.train.seed)
        self.dedup = bool(config.sampler.dedup)
        self.placement = self._placement()
        self._copy_stream = copy_stream(self.device) if self.cuda else None
        self.node_table = self._table(graph.node_feat)
        self.edge_table = self._table(graph.edge_feat)
        self.cache = None
        if self.placement == "host" and self.cuda and self.dedup and config.cache.budget_fraction > 0 \
                and graph.edge_feat is not None and graph.edge_feat.shape[1] > 0:
            from fastopt.runtime.slimcache import CacheTable, SlimCache, reads_zero_copy

            feat, c = graph.edge_feat, config.cache
            if isinstance(feat, np.memmap) and reads_zero_copy("edge", CacheTable(self.edge_table), self.device,
                                                               c, read_rows):
                why = (f"its dtype {feat.dtype} is not cache.transfer_dtype {c.transfer_dtype!r}"
                       if str(feat.dtype) != c.transfer_dtype else "")
                if not why:  # the cache shares the pinned table as it is
                    pinned, why = pin_if_room(feat, c.pin_ram_fraction)
                    self.edge_table = self.edge_table if pinned is None else pinned
                if why and c.host_reads == "zero_copy":
                    raise CacheError(f"cache.host_reads='zero_copy' needs the {feat.nbytes:,}-byte mapped edge "
                                     f"table in pinned RAM, but {why}; raise cache.pin_ram_fraction or free "
                                     f"memory, match the dtypes, or use host_reads 'auto' or 'staged'")
            # A mapped table left on disk is read in place: the cache gathers misses from the file.
            mapped = isinstance(feat, np.memmap) and not self.edge_table.is_pinned()
            self.cache = SlimCache({"edge": CacheTable(self.edge_table, mapped=mapped)}, self.device,
                                   config.cache, read_rows=read_rows)
        # the device reads the cache's misses from the pinned table itself (SlimCache.count/reader)
        self.zero_copy = self.cache is not None and self.cache.zero_copy("edge")
        self.read_in_step = self.zero_copy and bool(read_in_step)
        self.bytes_h2d = 0  # bytes copied host -> device since construction
        self._bytes_lock = threading.Lock()
        self.high_water = HighWater()  # padded unique lengths: only grow (_padded)

    def describe(self) -> str:
        """Where the static features are and how a batch gets them, in one line."""
        parts = []
        for name, feat, table in (("edge", self.graph.edge_feat, self.edge_table),
                                  ("node", self.graph.node_feat, self.node_table)):
            if table is not None:
                where = (f"on {self.device}" if self.placement == "device" else "in pinned host memory"
                         if table.is_pinned() else "read from its file" if isinstance(feat, np.memmap)
                         else "in host memory")
                parts.append(f"{name} {feat.nbytes / 1e9:.2f} GB {where}")
        line = ", ".join(parts) or "none"
        if self.cache is not None:
            c = self.config.cache
            line += (f"; a device cache of {c.budget_fraction:.0%} of the edge bytes, " +
                     ("the GPU reading the rest itself (a hot set per split)" if self.zero_copy
                      else f"the rest staged through pinned buffers ({c.policy} policy)"))
        return line

    @property
    def keyed(self) -> bool:
        """Whether the sampler's draws are fixed by a batch key (``sample(..., batch=)``): then
        several staging threads may call it in any order."""
        if self._keyed[0] is not self.sampler:
            self._keyed = (self.sampler, self.sampler is not None and _takes_batch_key(self.sampler))
        return self._keyed[1]

    def bytes_moved(self) -> int:
        """Bytes copied host -> device so far: staged batches and the cache's misses."""
        cached = self.cache.counters().bytes_h2d if self.cache is not None else 0
        return self.bytes_h2d + cached

    # ------------------------------------------------------------------------ tables
    def _placement(self) -> str:
        placement = self.config.cache.placement
        if placement != "auto":
            return placement
        if not self.cuda:
            return "device"
        need = sum(0 if t is None else t.nbytes for t in (self.graph.edge_feat, self.graph.node_feat))
        free, _ = torch.cuda.mem_get_info(self.device)
        return "device" if need <= self.config.cache.device_budget_fraction * free else "host"

    def _table(self, feat: Optional[np.ndarray]) -> Optional[torch.Tensor]:
        if feat is None or feat.shape[1] == 0:
            return None
        mapped = isinstance(feat, np.memmap)
        with warnings.catch_warnings():  # a read-only mapped file: tables are only ever read
            warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
            table = torch.from_numpy(np.ascontiguousarray(feat))
        if self.placement == "device":
            return table.to(self.device)
        # Pinning copies a table into page-locked RAM: a memory-mapped one stays on disk, and
        # _gather_host (or SlimCache) reads the rows a batch needs from it into pinned buffers,
        # unless zero-copy reads will serve it (read into pinned RAM in __init__: pin_if_room).
        return table.pin_memory() if self.cuda and not mapped else table

    # ------------------------------------------------------------------------ planning
    def plan(self, split: str, epoch: int, mrr_negatives: int = 0) -> Iterator[EventBatch]:
        """The batches of ``split`` in chronological order, with their negatives (not yet sampled)."""
        g, size = self.graph, self.config.train.batch_size
        r = g.split_range(split)
        for b, start in enumerate(range(r.start, r.stop, size)):
            stop = min(start + size, r.stop)
            n = stop - start
            extra = None
            if mrr_negatives:
                extra = self.negatives.draw(n * mrr_negatives, epoch, split, b + 1_000_000).reshape(n, mrr_negatives)
            yield EventBatch(b, start, stop, g.src[start:stop], g.dst[start:stop], g.ts[start:stop],
                             self.negatives.draw(n, epoch, split, b), extra, split)

    def num_batches(self, split: str) -> int:
        r = self.graph.split_range(split)
        return -(-(r.stop - r.start) // self.config.train.batch_size)

    # ------------------------------------------------------------------------ epochs
    def epoch(self, split: str, epoch: int, mrr_negatives: int = 0,
              timer: Optional[StageTimer] = None) -> "EpochStream":
        """The staged batches of one pass over ``split`` (a context manager and an iterator)."""
        return EpochStream(self, self.plan(split, epoch, mrr_negatives), timer or StageTimer(self.device), split)

    def begin_epoch(self, split: str) -> None:
        """Install ``split``'s hot set for zero-copy reads, before the copy stream's next reads;
        training batches the step reads go through ``cache.hot_set_phases`` hot sets in turn
        (:meth:`finish` installs each in the step's stream order)."""
        self.cache.begin_epoch(split, self._phases(split), self.num_batches(split))
        if self.cuda:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))

    def _phases(self, split: str) -> int:
        return self.config.cache.hot_set_phases if self.read_in_step and split == "train" else 1

    def presample(self, split: str, epoch: int, reserve: bool = True, foresee: bool = False) -> None:
        """Sample ``split``'s batches of ``epoch`` without training, as that epoch will (the
        sampler reset to it): ``reserve`` raises the padded lengths to the pass's
        (:meth:`reserve`); ``foresee`` counts the uses of the edge rows read zero-copy, from
        which the epoch's hot sets are then planned (``SlimCache.foresee``; a split's first
        epoch has no last epoch's uses)."""
        if self.sampler is not None:
            self.sampler.reset(epoch)
        foresee = foresee and self.zero_copy and self.sampler is not None
        # without reserve the pass leaves the lengths as they are: the sampler's own (pad_rows) too
        high_water = None if reserve else getattr(self.sampler, "high_water", None)
        kept = None if high_water is None else dict(high_water.lengths)

        def batches():
            for batch in self.plan(split, epoch):
                sampled = self.sample(batch)
                if reserve:
                    self.reserve(batch)
                if foresee and sampled is not None and sampled.blocks:
                    yield batch.index, sampled.unique_eids
        try:
            if foresee:
                self.cache.foresee("edge", split, batches(), self._phases(split), self.num_batches(split))
            else:
                for _ in batches():
                    pass
        finally:
            if kept is not None:
                high_water.lengths = kept

    def inputs_for(self, roots: np.ndarray, times: np.ndarray) -> GraphInputs:
        """The model's inputs for arbitrary ``roots`` at ``times``, built synchronously (rows
        read past SlimCache: a batch outside the epoch's plan neither uses nor changes it)."""
        roots = np.asarray(roots, dtype=np.int64)
        if self.cuda:  # read after the work queued before (a run's hot-set install, on the current stream)
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        batch = EventBatch(-1, 0, 0, roots, roots[:0], np.asarray(times, dtype=np.float64)[:0],
                           roots[:0])
        staged = self.stage(batch, roots=roots, times=np.asarray(times, dtype=np.float64))
        return self.finish(staged).inputs

    def reserve(self, batch: EventBatch) -> None:
        """Fix the padded lengths of the sampled ``batch`` (:meth:`_padded`) now: called on
        the batches of an epoch in their order, it makes each one's lengths those of a loader
        staging them one at a time, whichever thread stages them and when (the high water a
        batch pads to depends on the batches before it)."""
        if not self.cuda:
            return
        sampled = batch.sampled
        nodes = sampled.unique_nodes if sampled is not None else None
        if nodes is None:  # no sampler, or its dedup off: the roots alone, kept for stage
            nodes = batch.root_nodes = Unique.of(torch.from_numpy(np.ascontiguousarray(batch.roots, dtype=np.int64)))
        roots = sampled.roots.numel() if sampled is not None else len(batch.roots)
        batch.padded = {"nodes": self._length("nodes", roots, nodes.values.numel())}
        if self._pads_edges(batch):
            batch.padded["edges"] = self._length("edges", roots, sampled.unique_eids.values.numel())

    def _pads_edges(self, batch: EventBatch) -> bool:
        """Whether ``batch``'s unique edges are padded (:meth:`_unique_edge_ids`, or SlimCache's
        served rows in :meth:`_edge_table_and_index`): edge rows read on the device, or moved
        from the host, with the sampler's dedup on."""
        sampled = batch.sampled
        if self.edge_table is None or sampled is None or not sampled.blocks or sampled.unique_eids is None:
            return False
        if self.placement == "device":
            return self.edge_rows
        return self.dedup

    def _length(self, kind: str, roots: int, n: int, batch: Optional[EventBatch] = None) -> int:
        """The padded length of ``n`` unique ``kind`` ("nodes" or "edges") in a batch of ``roots``
        roots: the one :meth:`reserve` fixed for ``batch``, else the high water, raised by ``n``."""
        reserved = batch.padded.get(kind) if batch is not None and batch.padded else None
        return self.high_water(f"{kind}/{roots}", n) if reserved is None else reserved

    def _padded(self, ids: torch.Tensor, kind: str, roots: int, batch: Optional[EventBatch] = None) -> torch.Tensor:
        """``ids`` (a batch's unique node or edge ids, ``kind`` "nodes" or "edges") padded with
        zeros on CUDA to the high-water length (:class:`~fastopt.runtime.inputs.HighWater`) of
        batches of ``roots`` roots: an evaluation batch (more roots: MRR negatives) raises only
        the lengths of its own shape, not those the training step runs at. A length
        :meth:`reserve` fixed for ``batch`` is used as it is."""
        if not self.cuda:
            return ids
        length = self._length(kind, roots, ids.numel(), batch)
        if length == ids.numel():
            return ids
        padded = np.zeros(length, dtype=ids.numpy().dtype)
        padded[:ids.numel()] = ids.numpy()
        return torch.from_numpy(padded)

    def _unique_edge_ids(self, batch: EventBatch, small: Dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """The batch's unique edge ids (padded, ``-1`` as edge 0) and, in ``small``, the inverse over
        every layer's slots; None where the sampler computed none (``sampler.dedup`` off)."""
        u = batch.sampled.unique_eids
        if u is None:
            return None
        small["edge_inverse"] = u.inverse.reshape(-1)
        return self._padded(torch.from_numpy(np.maximum(u.values.numpy(), 0)), "edges",
                            batch.sampled.roots.numel(), batch)

    # ------------------------------------------------------------------------ staging
    def sample(self, batch: EventBatch, roots: Optional[np.ndarray] = None,
               times: Optional[np.ndarray] = None) -> Optional[SampledBatch]:
        """Sample ``batch``'s neighborhoods into ``batch.sampled`` (None without a sampler)."""
        roots = batch.roots if roots is None else roots
        times = batch.times if times is None else times
        sampled = None
        if self.sampler is not None:  # draws keyed by the batch, whichever thread stages it
            if self.keyed and batch.index >= 0:
                sampled = self.sampler.sample(roots, times, batch=SPLIT_IDS[batch.split] << 40 | batch.index)
            else:
                sampled = self.sampler.sample(roots, times)
        batch.sampled = sampled
        return sampled

    def cache_ids(self, batch: EventBatch) -> Optional[Dict[str, Unique]]:
        """The ids per cached table that staging the sampled ``batch`` looks up in SlimCache
        (None when it looks up none): what the future policy is told ahead."""
        sampled = batch.sampled
        if self.cache is None or sampled is None or not sampled.blocks:
            return None
        return {"edge": sampled.unique_eids}

    def stage(self, batch: EventBatch, roots: Optional[np.ndarray] = None,
              times: Optional[np.ndarray] = None) -> _Staged:
        """Sample ``batch`` (unless :meth:`sample` already did) and start moving everything it
        needs to the device (any thread)."""
        roots = batch.roots if roots is None else roots
        times = batch.times if times is None else times
        sampled = batch.sampled if batch.sampled is not None else self.sample(batch, roots, times)
        blocks = sampled.blocks if sampled is not None else []
        # ids, times and masks, of every dtype: one upload (_upload)
        small: Dict[str, torch.Tensor] = {"roots": torch.from_numpy(np.ascontiguousarray(roots, dtype=np.int64)),
                                         "times": torch.from_numpy(np.ascontiguousarray(times, dtype=np.float64))}
        for i, block in enumerate(blocks):
            small[f"set{i + 1}"], small[f"stime{i + 1}"] = node_set(blocks, i + 1)
            small[f"eid{i}"], small[f"dt{i}"], small[f"mask{i}"] = block.nbr_eids, block.dt, block.mask
            if block.nbr_rows is not None:
                small[f"rows{i}"] = block.nbr_rows
        unique = sampled.unique_nodes if sampled is not None else None
        if unique is None:
            unique = batch.root_nodes if batch.root_nodes is not None else Unique.of(small["roots"])
        small["unique_nodes"] = self._padded(unique.values, "nodes", small["roots"].numel(), batch)
        small["node_inverse"] = set_inverse(unique.inverse.reshape(-1), small["roots"].numel(), blocks)
        staged = _Staged(batch, len(blocks))
        if (self.placement == "device" or self.zero_copy) and self._pads_edges(batch):
            small["edge_unique"] = self._unique_edge_ids(batch, small)
        host_feats = self._host_features(batch, blocks, small, staged)
        if self.placement != "device" or self.edge_table is None or "edge_unique" in small:
            for i in range(len(blocks)):  # edge ids are read on the device by per-slot gathers only
                del small[f"eid{i}"]
        self._upload(staged, small, host_feats)
        return staged

    def _host_features(self, batch: EventBatch, blocks, small, staged: _Staged) -> Dict[str, torch.Tensor]:
        """Rows gathered on the host (host placement): per slot, unique rows, or through SlimCache."""
        rows: Dict[str, torch.Tensor] = {}
        if self.placement != "host":
            return rows
        if self.node_table is not None:
            ids = torch.cat([small["roots"]] + [small[f"set{i + 1}"] for i in range(len(blocks))])
            rows["node_rows"] = self._gather_host(self.node_table, ids)
        if self.edge_table is not None:
            if self.zero_copy and "edge_unique" in small and batch.size and \
                    self.cache.host("edge").dtype == self.edge_table.dtype:  # read after the edge rows, in one launch
                small["edge_unique"] = torch.from_numpy(np.concatenate(
                    [small["edge_unique"].numpy(), np.arange(batch.start, batch.stop, dtype=np.int64)]))
                staged.event_rows = batch.size
            else:
                rows["event_rows"] = self.edge_table[batch.start:batch.stop]
            if blocks and "edge_unique" not in small:  # (else read zero-copy in _upload)
                # an epoch's batches go through the cache; an ad-hoc batch (index -1: inputs_for)
                # reads its rows directly and leaves the cache's contents and plan as they are
                if self.cache is not None and batch.index >= 0:
                    staged.pending = self.cache.stage("edge", unique=batch.sampled.unique_eids,
                                                      announced=batch.announced)
                elif self.dedup and (ids := self._unique_edge_ids(batch, small)) is not None:
                    rows["edge_rows"] = self._gather_host(self.edge_table, ids)
                else:
                    eids = torch.cat([small[f"eid{i}"].reshape(-1) for i in range(len(blocks))])
                    rows["edge_rows"] = self._gather_host(self.edge_table, eids.clamp(min=0))
        return rows

    def _gather_host(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty((ids.numel(),) + tuple(table.shape[1:]), dtype=table.dtype,
                          pin_memory=self.cuda)
        torch.index_select(table, 0, ids, out=out)
        return out

    def _upload(self, staged: _Staged, small: Dict[str, torch.Tensor], rows: Dict[str, torch.Tensor]) -> None:
        """Copies on the copy stream: the ``small`` tensors (ids, times, masks: from NumPy) and
        any ``rows`` not gathered into pinned memory packed into one pinned buffer and copied at
        once (:func:`pack_tensors`); pinned rows copied as they are. ``staged.owners``: the
        device allocations its tensors view."""
        if not self.cuda:
            staged.tensors.update(small)
            staged.tensors.update(rows)
            return
        packed = dict(small)
        with torch.cuda.stream(self._copy_stream):
            for k, t in rows.items():
                if t.is_pinned():
                    staged.tensors[k] = t.to(self.device, non_blocking=True)
                else:
                    packed[k] = t
            host, layout = pack_tensors(list(packed.values()), pinned=True)
            staged.tensors.update(zip(packed, unpack_tensors(host.to(self.device, non_blocking=True), layout)))
            with self._bytes_lock:  # staging threads upload concurrently: no update lost
                self.bytes_h2d += sum(t.numel() * t.element_size() for t in (*small.values(), *rows.values()))
                if staged.event_rows:  # read zero-copy with the edge rows
                    self.bytes_h2d += staged.event_rows * self.edge_table[0].numel() * self.edge_table.element_size()
            self._read_rows(staged)
            if staged.pending is None:  # the inputs built here, off the training thread
                self._build(staged)
                staged.built = True
            staged.owners = self._owners(staged)
            staged.event = torch.cuda.Event()
            staged.event.record(self._copy_stream)

    def _owners(self, staged: _Staged) -> List[torch.Tensor]:
        """A tensor per device allocation ``staged``'s tensors and inputs are in, but the tables'."""
        tensors = [t for v in staged.tensors.values() for t in (v if isinstance(v, list) else [v])]
        if staged.built:
            tensors += flatten((staged.batch.inputs, staged.batch.event_feat))[0]
        owners = {t.untyped_storage().data_ptr(): t for t in tensors if t.numel()}
        for table in (self.node_table, self.edge_table):
            if table is not None:
                owners.pop(table.untyped_storage().data_ptr(), None)
        return list(owners.values())

    def _read_rows(self, staged: _Staged) -> None:
        """Rows the device reads itself (on the stream this is called on): from device tables, or
        through SlimCache's zero-copy reads, counted here (an ad-hoc batch, index -1, counts
        nothing) and read where :meth:`_build` leaves them (:class:`RowReads`)."""
        t = staged.tensors
        if self.placement == "device":
            self._gather_device(staged)
        elif "edge_unique" in t:
            batch = staged.batch
            if batch.index >= 0:
                self.cache.count("edge", batch.sampled.unique_eids, batch.index)
            index, shapes = (None, ()) if self.edge_rows else \
                (t["edge_inverse"], tuple(tuple(t[f"mask{i}"].shape) for i in range(staged.layers)))
            batch.reads = RowReads(t["edge_unique"], self.cache.reader("edge"), staged.event_rows, index, shapes)

    def _gather_device(self, staged: _Staged) -> None:
        """Per-slot feature rows from device tables (on the stream this is called on)."""
        t, batch = staged.tensors, staged.batch
        if self.node_table is not None:
            t["node_feat"] = [self.node_table[n.clamp(min=0)] for n in _sets(t, staged.layers)]
        if self.edge_table is not None:
            if "edge_unique" in t:
                t["edge_rows"] = self.edge_table[t["edge_unique"]]
            else:
                t["edge_feat"] = [self.edge_table[t[f"eid{i}"].clamp(min=0)] for i in range(staged.layers)]
            t["event_rows"] = self.edge_table[batch.start:batch.stop]  # a view of the table: kept

    def finish(self, staged: _Staged) -> EventBatch:
        """Make the current stream wait for ``staged``'s copies; the model's inputs (built when
        staged, on CUDA, but where SlimCache's staged lookups finish here, on this stream)."""
        if staged.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(staged.event)
            for tensor in staged.owners:  # the allocations the batch's tensors are views of
                tensor.record_stream(current)
        if not self.cuda:
            self._read_rows(staged)
        if staged.batch.reads is not None and staged.batch.index >= 0 and self.config.cache.hot_set_phases > 1:
            self.cache.enter("edge", staged.batch.index)  # read by the step, after this: its run's hot set
        if not staged.built:
            self._build(staged)
        return staged.batch

    def _build(self, staged: _Staged) -> None:
        """``staged.batch``'s inputs from its tensors (on the stream this is called on)."""
        t, batch = staged.tensors, staged.batch
        layers = staged.layers
        nodes = _sets(t, layers)
        times = [t["times"]] + [t[f"stime{i + 1}"] for i in range(layers)]
        nbr_index = [t[f"rows{i}"] for i in range(layers) if f"rows{i}" in t] or None
        dt = [t[f"dt{i}"] for i in range(layers)]
        mask = [t[f"mask{i}"] for i in range(layers)]
        node_feat = t.get("node_feat")
        if node_feat is None:
            node_feat = self._expand_nodes(t, nodes)
        edge_rows = edge_index = None
        if self.edge_rows:
            edge_feat = []
            edge_rows, edge_index = self._edge_rows(staged, layers)
        elif batch.reads is not None:
            edge_feat = []  # expanded per slot as the rows are read (RowReads)
        else:
            edge_feat = t.get("edge_feat")
            if edge_feat is None:
                edge_feat = self._expand_edges(staged, layers)
        batch.event_feat = t.get("event_rows")
        if batch.event_feat is None and not (batch.reads is not None and batch.reads.events):
            batch.event_feat = torch.zeros(batch.size, 0, device=self.device)
        batch.inputs = GraphInputs(nodes, times, node_feat, edge_feat, dt, mask,
                                   unique_nodes=t["unique_nodes"], node_inverse=t["node_inverse"],
                                   edge_rows=edge_rows, edge_index=edge_index, nbr_index=nbr_index)
        if not (self.read_in_step and batch.split == "train" and batch.index >= 0):
            batch.read()  # zero-copy reads, here (on this stream) unless the training step runs them

    def _expand_nodes(self, t, nodes: List[torch.Tensor]) -> List[torch.Tensor]:
        if "node_rows" not in t:
            return [torch.zeros(n.shape[0], 0, device=self.device) for n in nodes]
        return list(torch.split(t["node_rows"], [n.shape[0] for n in nodes]))

    def _expand_edges(self, staged: _Staged, layers: int) -> List[torch.Tensor]:
        """Every layer's edge features per slot, ``[M_i, k_i, d]``."""
        return per_slot(*self._edge_table_and_index(staged, layers),
                        [staged.tensors[f"mask{i}"].shape for i in range(layers)])

    def _edge_rows(self, staged: _Staged, layers: int):
        """The batch's edge feature rows and each layer's ``[M_i, k_i]`` index into them
        (``GraphInputs.edge_rows`` / ``edge_index``): the unique rows where the sampler
        deduplicated the edges, else one row per slot."""
        shapes = [staged.tensors[f"mask{i}"].shape for i in range(layers)]
        rows, index = self._edge_table_and_index(staged, layers)
        if index is None:
            index = torch.arange(rows.shape[0], device=rows.device)
        pieces = torch.split(index, [s.numel() for s in shapes])
        return rows, [piece.view(s) for piece, s in zip(pieces, shapes)]

    def _padded_rows(self, rows: torch.Tensor, batch: EventBatch) -> torch.Tensor:
        """A batch's unique edge rows on the device with zero rows after them up to its padded
        length (:meth:`_padded`'s, on CUDA), so that a captured step sees one shape."""
        if not self.cuda:
            return rows
        length = self._length("edges", batch.sampled.roots.numel(), rows.shape[0], batch)
        if length <= rows.shape[0]:
            return rows
        return torch.cat([rows, rows.new_zeros((length - rows.shape[0],) + tuple(rows.shape[1:]))])

    def _edge_table_and_index(self, staged: _Staged, layers: int):
        """``(rows, index)`` with ``rows[index]`` (or ``rows`` when index is None) the edge
        features of every layer's slots, flattened in layer order."""
        t = staged.tensors
        if staged.batch.reads is not None:  # read by the consumer (RowReads)
            return None, t["edge_inverse"]
        if staged.pending is not None:  # SlimCache's unique rows, padded like the device path's
            served = self.cache.finish(staged.pending)
            rows = self._padded_rows(served.rows.reshape(served.rows.shape[0], -1), staged.batch)
            return rows, served.index.reshape(-1)
        if "edge_rows" not in t:
            if "edge_feat" in t:
                return torch.cat([f.reshape(-1, f.shape[-1]) for f in t["edge_feat"]]), None
            count = sum(t[f"mask{i}"].numel() for i in range(layers))
            return torch.zeros(count, 0, device=self.device), None
        return t["edge_rows"], t.get("edge_inverse")


def _takes_batch_key(sampler) -> bool:
    """Whether ``sampler.sample`` takes ``batch=`` (a key fixing its draws whatever the call order)."""
    try:
        return "batch" in inspect.signature(sampler.sample).parameters
    except (TypeError, ValueError):  # no introspectable signature
        return False


def _sets(t: Dict[str, torch.Tensor], layers: int) -> List[torch.Tensor]:
    return [t["roots"]] + [t[f"set{i + 1}"] for i in range(layers)]
