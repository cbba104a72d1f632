"""The loader: same batches and features on every path, unique nodes, clean stops, dense user models."""

import mmap
import random
from pathlib import Path
import threading
import time
from typing import Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastopt.config import Config
from fastopt.errors import CacheError, FastOptError
from fastopt.data import load_dataset
from fastopt.data.npydir import write_npy_dir
from fastopt.models import build_model
from fastopt.models.base import TGNNModel
from fastopt.runtime import GraphInputs, Loader
from fastopt.runtime.inputs import bucket
from fastopt.sampling import NumpySampler
from fastopt.trainer import Trainer

TINY = {"tgn": dict(memory_dim=8, dim=8, time_dim=4), "tgat": dict(dim=8, time_dim=4, fanouts=(3, 2)),
        "jodie": dict(memory_dim=8, dim=8, time_dim=4), "apan": dict(memory_dim=8, dim=8, time_dim=4)}


pytestmark = pytest.mark.usefixtures("one_thread")


def config(**sets) -> Config:
    cfg = Config()
    cfg.train.device, cfg.train.batch_size, cfg.train.mrr_negatives = "cpu", 200, 3
    for key, value in sets.items():
        cfg.set(key.replace("__", "."), value)
    return cfg


def reference_inputs(graph, sampler, roots, times) -> GraphInputs:
    """What a model must receive, built the obvious way: per slot, from the whole tables."""
    batch = sampler.sample(roots, times)
    node_t = torch.from_numpy(graph.node_feat)
    edge_t = torch.from_numpy(graph.edge_feat)
    nodes = [torch.from_numpy(roots)] + [b.nbr_nodes.reshape(-1) for b in batch.blocks]
    times_ = [torch.from_numpy(times)] + [b.nbr_times.reshape(-1) for b in batch.blocks]
    return GraphInputs(nodes, times_, [node_t[n.clamp(min=0)] for n in nodes],
                       [edge_t[b.nbr_eids.clamp(min=0)] for b in batch.blocks],
                       [b.dt for b in batch.blocks], [b.mask for b in batch.blocks])


@pytest.mark.parametrize("placement,dedup", [("device", True), ("host", True), ("host", False)])
def test_every_path_gives_the_reference_inputs_bitwise(small_graph, placement, dedup):
    cfg = config(cache__placement=placement, sampler__dedup=dedup)
    fanouts = [3, 2]
    loader = Loader(small_graph, NumpySampler(small_graph, fanouts, "uniform", seed=5), torch.device("cpu"), cfg)
    oracle = NumpySampler(small_graph, fanouts, "uniform", seed=5)
    with loader.epoch("train", 0) as batches:
        for batch in batches:
            got, want = batch.inputs, reference_inputs(small_graph, oracle, batch.roots, batch.times)
            for name in ("nodes", "times", "node_feat", "edge_feat", "dt", "mask"):
                for x, y in zip(getattr(got, name), getattr(want, name), strict=True):
                    assert x.shape == y.shape and torch.equal(x, y), (name, batch.index)
            everything = torch.cat(got.nodes)
            assert torch.equal(got.unique_nodes[got.node_inverse], everything)
            assert torch.equal(got.unique_nodes, torch.unique(everything))  # no padding on the CPU
            np.testing.assert_array_equal(batch.event_feat.numpy(), small_graph.edge_feat[batch.start:batch.stop])


@pytest.mark.parametrize("placement,dedup", [("device", True), ("host", True), ("host", False)])
def test_edge_rows_select_the_reference_features_bitwise(small_graph, placement, dedup):
    """A model that reads edge rows gets the batch's unique edges once (with dedup) and an index
    that rebuilds every slot's features exactly."""
    cfg = config(cache__placement=placement, sampler__dedup=dedup)
    fanouts = [3, 2]
    loader = Loader(small_graph, NumpySampler(small_graph, fanouts, "uniform", seed=5), torch.device("cpu"),
                    cfg, edge_rows=True)
    oracle = NumpySampler(small_graph, fanouts, "uniform", seed=5)
    with loader.epoch("train", 0) as batches:
        for batch in batches:
            got, want = batch.inputs, reference_inputs(small_graph, oracle, batch.roots, batch.times)
            assert got.edge_feat == [] and len(got.edge_index) == len(fanouts)
            for i, feat in enumerate(want.edge_feat):
                rows, index = got.layer_edges(i)
                assert index.shape == feat.shape[:2] and torch.equal(rows[index], feat), (i, batch.index)
            slots = sum(f.shape[0] * f.shape[1] for f in want.edge_feat)
            if dedup:  # one row per distinct edge, plus edge 0's for the padded slots
                assert got.edge_rows.shape[0] < slots
                assert torch.unique(got.edge_rows, dim=0).shape[0] >= got.edge_rows.shape[0] - 1
            else:
                assert got.edge_rows.shape[0] == slots


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("host_reads,edge_rows", [("zero_copy", True), ("zero_copy", False), ("staged", True)])
def test_host_placement_on_cuda_gives_the_device_paths_inputs_bitwise(small_graph, host_reads, edge_rows):
    """Features in pinned host memory through a 20 % cache (read by the GPU itself, or gathered
    and copied) reach the model as the device tables' do, for two epochs of each split: the
    second epoch of a split runs on the hot set its first one used."""
    from fastopt.codegen import cached_rows

    streams = {}
    for placement in ("device", "host"):
        cfg = config(cache__placement=placement, cache__host_reads=host_reads, cache__budget_fraction=0.2,
                     train__device="cuda")
        loader = Loader(small_graph, NumpySampler(small_graph, [3, 2], "uniform", seed=5), torch.device("cuda"),
                        cfg, edge_rows=edge_rows, read_rows=cached_rows)
        assert loader.zero_copy == (placement == "host" and host_reads == "zero_copy")
        got = []
        for epoch, split in enumerate(["train", "val", "train", "val"]):
            loader.sampler.reset(epoch)
            with loader.epoch(split, epoch) as batches:
                for b in batches:
                    x = b.inputs
                    feats = ([x.layer_edges(i)[0][x.layer_edges(i)[1]] for i in range(2)] if edge_rows
                             else x.edge_feat)
                    # valid slots (a padded one reads edge 0's row on one path, zeros on another)
                    got.append([f[m].cpu() for f, m in zip(feats, x.mask, strict=True)] + [b.event_feat.cpu()])
        streams[placement] = got
        if loader.zero_copy:
            c = loader.cache.counters("edge")
            assert 0 < c.hits < c.lookups and c.preloaded > 0
    assert len(streams["host"]) == len(streams["device"])
    for h, d in zip(streams["host"], streams["device"]):
        assert all(torch.equal(x, y) for x, y in zip(h, d, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("placement,host_reads,edge_rows", [("device", "auto", True), ("device", "auto", False),
                                                            ("host", "zero_copy", True), ("host", "zero_copy", False),
                                                            ("host", "staged", True)])
def test_inputs_read_late_by_the_step_are_those_staged(small_graph, placement, host_reads, edge_rows):
    """The consumer records on its stream only the allocations a staged batch's tensors live in
    (built by the staging threads, ahead): a step that reads its inputs late, while the staging
    threads allocate and copy the next batches on the copy stream, must still read what was
    staged. Each batch's inputs are copied after a half-millisecond sleep on the compute stream,
    the batch then dropped; the copies must equal those of a run that waits for the device at
    every batch. Zero-copy reads left to the step (``read_in_step``, read after the sleep) read
    the rows the staging threads read, also on a side stream that sleeps first and is joined only
    at ``inputs.edges_ready()`` (``cache.read_overlap``)."""
    from fastopt.codegen import cached_rows
    from fastopt.runtime.flatten import flatten

    def run(late: bool, in_step: bool = False, side: Optional[torch.cuda.Stream] = None):
        cfg = config(cache__placement=placement, cache__host_reads=host_reads, cache__budget_fraction=0.2,
                     train__device="cuda")
        loader = Loader(small_graph, NumpySampler(small_graph, [3, 2], "uniform", seed=5), torch.device("cuda"),
                        cfg, edge_rows=edge_rows, read_rows=cached_rows, read_in_step=in_step)
        assert loader.read_in_step == (in_step and host_reads == "zero_copy")
        finish, built = loader.finish, []
        loader.finish = lambda staged: built.append(staged.built) or finish(staged)
        copies = []
        with loader.epoch("train", 0) as batches:
            for b in batches:
                if late:
                    torch.cuda._sleep(1_000_000)  # cycles: the step has not read its inputs yet
                else:
                    torch.cuda.synchronize()
                assert (b.reads is not None) == loader.read_in_step
                if side is not None:  # the read comes late on its own stream; the join waits for it
                    with torch.cuda.stream(side):
                        torch.cuda._sleep(2_000_000)
                    b.inputs, b.event_feat = b.reads.apply(b.inputs, b.event_feat, side)
                    b.reads = None
                    assert b.inputs.edges_pending is not None
                    b.inputs.edges_ready()
                    assert b.inputs.edges_pending is None
                copies.append([t.clone() for t in flatten((b.read().inputs, b.event_feat))[0]])
                if host_reads == "zero_copy" and edge_rows:  # the events' rows came with the edge rows
                    assert b.event_feat.untyped_storage().data_ptr() == b.inputs.edge_rows.untyped_storage().data_ptr()
                del b
        # built by the staging threads, but where a SlimCache lookup finishes on the training thread
        assert built and all(x == (host_reads != "staged") for x in built)
        return copies

    settled = run(False)
    in_step = (lambda: run(True, in_step=True), lambda: run(True, in_step=True, side=torch.cuda.Stream()))
    for late in [run(True)] + ([r() for r in in_step] if host_reads == "zero_copy" else []):
        assert len(late) == len(settled)
        for a, b in zip(late, settled):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _staged_as_on_cuda(monkeypatch, g, placement: str, edge_rows: bool, as_on_cuda: bool = True) -> Loader:
    """A CPU loader that stages as on a GPU (:func:`test_the_cuda_staging_path_builds_the_cpu_paths_inputs`):
    the copies no-ops, no padding, nothing pinned; ``placement`` "device", "host", "zero_copy"
    (SlimCache's zero-copy reads through the kernel's reference) or "in_step" (those reads left to
    the step: ``read_in_step``)."""
    from fastopt.codegen import cached_rows
    from fastopt.runtime import CacheTable, SlimCache

    import fastopt.runtime.loader as loader_module

    pack = loader_module.pack_tensors
    monkeypatch.setattr(loader_module, "pack_tensors", lambda tensors, pinned: pack(tensors, pinned=False))
    monkeypatch.setattr(torch.cuda, "Event", lambda: type("Event", (), {"record": lambda self, stream: None})())
    cfg = config(cache__placement="device" if placement == "device" else "host", cache__host_reads="zero_copy",
                 cache__budget_fraction=0.2)
    made = Loader(g, NumpySampler(g, [3, 2], "uniform", seed=5), torch.device("cpu"), cfg, edge_rows=edge_rows)
    if as_on_cuda:
        made.cuda, made._copy_stream = True, None
        made._padded = lambda ids, kind, roots, batch=None: ids
        made._gather_host = lambda table, ids: table.index_select(0, ids)
        if placement in ("zero_copy", "in_step") and made.edge_table is not None:
            made.cache = SlimCache({"edge": CacheTable(made.edge_table)}, "cpu", cfg.cache, read_rows=cached_rows)
            made.zero_copy = made.cache.zero_copy("edge")
            made.read_in_step = made.zero_copy and placement == "in_step"
    return made


@pytest.mark.parametrize("placement", ["device", "host", "zero_copy", "in_step"])
@pytest.mark.parametrize("features,edge_rows", [(True, True), (True, False), (False, True)])
def test_the_cuda_staging_path_builds_the_cpu_paths_inputs(small_graph, monkeypatch, features, edge_rows, placement):
    """The staging steps a GPU runs (one packed upload, the inputs built by the staging thread,
    the allocations to record), run here with their copies as no-ops: the inputs equal those the
    CPU path builds in ``finish``, every tensor lives in a recorded allocation or a kept table,
    and a graph without features stages too. ``zero_copy``: host features served by SlimCache's
    zero-copy reads (the kernel's reference on the CPU), the batch's event rows read with its
    edge rows; ``in_step``: those reads left to the step, which gets them through its flattened
    arguments (as a captured step does) and reads them there."""
    from fastopt.data import TemporalGraph
    from fastopt.runtime.flatten import flatten, unflatten

    g = small_graph if features else TemporalGraph(small_graph.src, small_graph.dst, small_graph.ts,
                                                   small_graph.num_nodes, name="bare", bipartite=small_graph.bipartite)
    plain = _staged_as_on_cuda(monkeypatch, g, placement, edge_rows, as_on_cuda=False)
    staged_ahead = _staged_as_on_cuda(monkeypatch, g, placement, edge_rows)
    assert staged_ahead.zero_copy == (placement in ("zero_copy", "in_step") and features)
    in_step = staged_ahead.read_in_step
    assert in_step == (placement == "in_step" and features)
    kept = {t.untyped_storage().data_ptr() for t in (staged_ahead.edge_table, staged_ahead.node_table) if t is not None}
    step_specs: dict = {}
    for want_batch, batch in zip(plain.plan("train", 0), staged_ahead.plan("train", 0), strict=True):
        want, spec = flatten((plain.finish(plain.stage(want_batch)).inputs, want_batch.event_feat))
        staged = staged_ahead.stage(batch)
        assert staged.built and staged.event is not None
        assert (batch.reads is not None) == in_step
        owned = {t.untyped_storage().data_ptr() for t in staged.owners}
        if in_step:  # nothing read yet; the step reads the ids it was handed
            assert batch.inputs.edge_rows is None and batch.inputs.edge_feat == [] and batch.event_feat is None
            if edge_rows:
                with pytest.raises(CacheError, match=r"not read yet.*batch\.read\(\)"):
                    batch.inputs.layer_edges(0)
            assert batch.reads.ids.untyped_storage().data_ptr() in owned
            tensors, step_spec = flatten((batch.inputs, batch.event_feat, batch.reads))
            inputs, event_feat, reads = unflatten(step_spec, [t.clone() for t in tensors])
            got, got_spec = flatten(reads.apply(inputs, event_feat))
            assert got_spec == spec and all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
            # what keys the step's graph: the same for every batch of a size (the cache's reader included)
            specs = step_specs.setdefault(batch.size, set())
            specs.add(step_spec)
            assert len(specs) == 1 and hash(step_spec) == hash(next(iter(specs)))
            got, got_spec = flatten((batch.read().inputs, batch.event_feat))  # read where it is
            assert batch.reads is None
        else:
            got, got_spec = flatten((batch.inputs, batch.event_feat))
        if staged_ahead.zero_copy and edge_rows:
            assert staged.event_rows == batch.size and batch.event_feat.untyped_storage().data_ptr() == \
                batch.inputs.edge_rows.untyped_storage().data_ptr()
        assert got_spec == spec and all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
        assert owned.isdisjoint(kept) and len(owned) == len(staged.owners)
        assert in_step or all(t.numel() == 0 or t.untyped_storage().data_ptr() in owned | kept for t in got)


@pytest.mark.parametrize("edge_rows", [True, False])
def test_reads_left_to_the_step_count_as_read_rows(small_graph, monkeypatch, edge_rows):
    """A training batch whose zero-copy reads the step runs counts in SlimCache as one served at
    staging (the counters, and the uses that pick the next epoch's hot set); an evaluation batch
    is served at staging either way."""
    served, in_step = (_staged_as_on_cuda(monkeypatch, small_graph, p, edge_rows) for p in ("zero_copy", "in_step"))
    for split in ("train", "val"):
        for loader in (served, in_step):
            loader.cache.begin_epoch(split)  # (Loader.begin_epoch's stream ordering aside)
            for batch in loader.plan(split, 0):
                loader.stage(batch)
                assert (batch.reads is not None) == (loader is in_step and split == "train")
    a, b = served.cache.counters("edge"), in_step.cache.counters("edge")
    assert a.batches > 0 and a == b
    ta, tb = served.cache._table("edge"), in_step.cache._table("edge")
    assert ta.used.keys() == tb.used.keys() and torch.equal(ta.seen, tb.seen)
    assert all(torch.equal(ta.used[k], tb.used[k]) for k in ta.used)


def test_training_reads_left_to_the_step_go_through_a_hot_set_per_run(small_graph, monkeypatch):
    """``cache.hot_set_phases`` with the reads left to the step: ``Loader.begin_epoch`` plans the
    runs for training batches only, ``finish`` installs each run's hot set before its batches
    are read; the rows read are the table's, the hits counted at staging are the rows the slots
    hold when the step reads, and later epochs hit more than through one hot set."""
    import types

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    rates = {}
    for phases in (1, 4):
        loader = _staged_as_on_cuda(monkeypatch, small_graph, "in_step", edge_rows=True)
        loader.config.cache.hot_set_phases = phases
        loader._copy_stream = types.SimpleNamespace(wait_stream=lambda stream: None)
        table = loader.cache._table("edge")
        for epoch in range(3):
            for split in ("train", "val"):
                loader.begin_epoch(split)
                assert table.phases == (phases if split == "train" else 1)
                before, hits, lookups = loader.cache.counters("edge").hits, 0, 0
                for batch in loader.plan(split, epoch):
                    staged = loader.stage(batch)
                    staged.event = None  # (no stream to wait on)
                    batch = loader.finish(staged)
                    ids = batch.sampled.unique_eids.values  # sorted; -1 (padding, read as row 0) first
                    valid = ids[ids >= 0]
                    if split == "train":  # read by the step, after finish
                        assert batch.reads is not None
                        hits += int((loader.cache.slot_map("edge")[valid] >= 0).sum())
                        lookups += valid.numel()
                    rows = batch.read().inputs.edge_rows
                    assert torch.equal(rows[:ids.numel()], loader.edge_table[ids.clamp(min=0)])
                if split == "train":
                    assert loader.cache.counters("edge").hits - before == hits
                    rates[phases] = hits / lookups  # the last epoch's
    assert rates[4] > rates[1], rates


@pytest.mark.parametrize("phases", [1, 4])
def test_uses_counted_ahead_are_those_the_epoch_counts_and_give_its_first_epoch_hot_sets(small_graph, monkeypatch,
                                                                                         phases):
    """``Loader.presample(foresee=True)`` samples an epoch's batches without staging them and
    counts their zero-copy uses per run: the counts equal those the epoch itself then counts
    while it trains, bit for bit, and the first epoch reads through hot sets planned from them
    (hits, where a first epoch otherwise starts with empty slots). Without zero-copy reads it
    counts nothing."""
    import types

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    hits = {}
    for foresee in (False, True):
        loader = _staged_as_on_cuda(monkeypatch, small_graph, "in_step", edge_rows=True)
        loader.config.cache.hot_set_phases = phases
        loader._copy_stream = types.SimpleNamespace(wait_stream=lambda stream: None)
        table = loader.cache._table("edge")
        loader.presample("train", 0, reserve=False, foresee=foresee)
        assert ("train" in table.used) == foresee
        ahead = table.used.get("train")
        loader.sampler.reset(0)  # as the trainer starts an epoch
        loader.begin_epoch("train")
        for batch in loader.plan("train", 0):
            staged = loader.stage(batch)
            staged.event = None
            loader.finish(staged).read()
        hits[foresee] = loader.cache.counters("edge").hits
        if foresee:
            assert ahead.shape == (phases, small_graph.num_events) and torch.equal(ahead, table.seen)
            # counted between epochs, they replace what the epoch just ended counted
            loader.presample("train", 1, reserve=False, foresee=True)
            again = table.used["train"].clone()
            loader.begin_epoch("train")
            assert not torch.equal(again, ahead) and torch.equal(table.used["train"], again)
    assert hits[False] == 0 < hits[True], hits
    # a pass that reserves nothing leaves the sampler's own padded lengths (pad_rows) as they were
    from fastopt.runtime.inputs import HighWater

    sampler, sample = loader.sampler, loader.sampler.sample
    sampler.high_water = HighWater()
    sampler.high_water.seed({"nodes": 4})
    monkeypatch.setattr(sampler, "sample", lambda *a, **kw: sampler.high_water("nodes", 10_000) and sample(*a, **kw))
    loader.presample("train", 2, reserve=False, foresee=True)
    assert sampler.high_water.lengths == {"nodes": 4}
    plain = _staged_as_on_cuda(monkeypatch, small_graph, "host", edge_rows=True)  # no cache here
    assert not plain.zero_copy and plain.cache is None
    plain.presample("train", 0, reserve=False, foresee=True)  # no hot sets to plan, nothing asked of a cache


@pytest.fixture
def mapped_graph(tmp_path, small_graph):
    """:func:`small_graph` written as a graph folder and read back memory-mapped."""
    g = small_graph
    write_npy_dir(tmp_path / "g", [(g.src, g.dst, g.ts, g.edge_feat)], num_events=g.num_events,
                  num_nodes=g.num_nodes, edge_dim=g.edge_dim, name="mapped", node_feat=g.node_feat)
    return load_dataset(tmp_path / "g")


@pytest.mark.parametrize("dedup", [True, False])
def test_host_and_device_placement_read_a_mapped_graph_alike_bitwise(small_graph, mapped_graph, dedup):
    """Rows gathered on the host from a memory-mapped table are the device path's, bit for bit,
    and those of the graph in RAM; neither placement copies the mapped tables."""
    assert isinstance(mapped_graph.edge_feat, np.memmap) and isinstance(mapped_graph.node_feat, np.memmap)
    fanouts = [3, 2]
    streams = {}
    for placement in ("host", "device"):
        loader = Loader(mapped_graph, NumpySampler(mapped_graph, fanouts, "uniform", seed=5), torch.device("cpu"),
                        config(cache__placement=placement, sampler__dedup=dedup))
        assert loader.edge_table.data_ptr() == mapped_graph.edge_feat.ctypes.data  # the mapping itself
        assert loader.node_table.data_ptr() == mapped_graph.node_feat.ctypes.data
        with loader.epoch("train", 0) as batches:
            streams[placement] = [(b.inputs, b.event_feat) for b in batches]
    oracle = NumpySampler(small_graph, fanouts, "uniform", seed=5)
    for b, batch in enumerate(Loader(small_graph, None, torch.device("cpu"), config()).plan("train", 0)):
        want = reference_inputs(small_graph, oracle, batch.roots, batch.times)
        for placement, stream in streams.items():
            got, event_feat = stream[b]
            for name in ("nodes", "times", "node_feat", "edge_feat", "dt", "mask"):
                for x, y in zip(getattr(got, name), getattr(want, name), strict=True):
                    assert torch.equal(x, y), (placement, name, b)
            assert torch.equal(event_feat, torch.from_numpy(small_graph.edge_feat[batch.start:batch.stop]))
    assert len(streams["host"]) == len(streams["device"]) == b + 1


class FakeCudart:
    """Stands in for ``torch.cuda.cudart()`` on the CPU: records host registrations."""

    def __init__(self):
        self.registered, self.unregistered = [], []

    def cudaHostRegister(self, ptr, size, flags):
        self.registered.append((ptr, size))
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("sets,why", [({"cache__pin_ram_fraction": 0.0}, "more than cache.pin_ram_fraction"),
                                      ({"cache__transfer_dtype": "bfloat16"}, "is not cache.transfer_dtype")])
def test_zero_copy_reads_asked_of_a_mapped_table_that_cannot_be_pinned_say_why(mapped_graph, sets, why):
    from fastopt.codegen import cached_rows

    cfg = config(cache__placement="host", cache__host_reads="zero_copy", cache__budget_fraction=0.2,
                 train__device="cuda", **sets)
    with pytest.raises(FastOptError, match=f"needs the 96,000-byte mapped edge table in pinned RAM, but .*{why}"):
        Loader(mapped_graph, None, torch.device("cuda"), cfg, read_rows=cached_rows)


def test_pinned_copy_reads_a_mapped_table_into_ram_registered_at_its_exact_size(mapped_graph, monkeypatch):
    """A mapped table is copied whole (by several threads, in parts) into memory of its own, which
    is registered with the driver at exactly its size and unregistered once freed."""
    import gc

    from fastopt.runtime import staging

    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(staging, "_COPY_ROWS", 512)  # 3,000 rows: six parts
    feat = mapped_graph.edge_feat
    table = staging.pinned_copy(feat, threads=3)
    assert torch.equal(table, torch.from_numpy(np.asarray(feat)))
    assert table.data_ptr() != feat.ctypes.data and table.is_contiguous()
    ptr = table.data_ptr()
    assert ptr % mmap.PAGESIZE == 0  # pages of its own: no registration overlaps another's
    assert cudart.registered == [(ptr, feat.nbytes)] and cudart.unregistered == []
    del table
    gc.collect()
    assert cudart.unregistered == [ptr]


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set from /proc")
def test_pinned_copy_of_a_mapped_file_holds_it_once_in_the_resident_set(tmp_path, monkeypatch):
    """Copying a 64 MiB mapped table into RAM leaves about one table resident, not two: each part
    of the mapping is dropped from the process once copied (the file stays in the page cache),
    and the copy equals the file."""
    from fastopt.runtime import staging

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    rows = np.random.default_rng(0).standard_normal((1 << 16, 256), dtype=np.float32)
    np.save(tmp_path / "t.npy", rows)
    feat = np.load(tmp_path / "t.npy", mmap_mode="r")
    assert isinstance(feat, np.memmap) and feat.nbytes == 64 << 20
    before = resident_bytes()
    table = staging.pinned_copy(feat, threads=2)
    grown = resident_bytes() - before
    assert torch.equal(table, torch.from_numpy(rows))
    assert feat.nbytes * 0.9 < grown < feat.nbytes * 1.3, grown  # the copy, without the mapping
    del table


def test_a_table_the_driver_will_not_pin_stays_mapped_with_a_warning(mapped_graph, monkeypatch):
    """A refused registration is a MemoryError from pinned_copy naming the size and the fix, and
    the loader then reads the mapped table in place, saying so, instead of failing the run."""
    from fastopt.runtime import staging

    cudart = FakeCudart()
    cudart.cudaHostRegister = lambda ptr, size, flags: 2  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    with pytest.raises(MemoryError, match=r"would not pin a 96,000-byte table \(CUDA error 2\).*pin_ram_fraction to 0"):
        staging.pinned_copy(mapped_graph.edge_feat)
    with pytest.warns(RuntimeWarning, match="stays on disk"):
        table, why = staging.pin_if_room(mapped_graph.edge_feat, 0.5)
    assert table is None and cudart.registered == [] and "would not pin" in why


@pytest.mark.parametrize("fraction,ram,pinned", [(0.5, 10_000_000, True), (0.5, 200_000, True),
                                                  (0.5, 100_000, False), (0.0, 10_000_000, False)])
def test_a_mapped_table_is_pinned_when_the_ram_has_room(mapped_graph, monkeypatch, fraction, ram, pinned):
    """A mapped table (96,000 bytes here) is read into pinned RAM when it takes at most
    ``cache.pin_ram_fraction`` of the available memory; otherwise nothing is copied, and why
    names the fraction and the memory."""
    from fastopt.runtime import staging

    calls = []
    monkeypatch.setattr(staging, "available_ram", lambda: ram)
    monkeypatch.setattr(staging, "pinned_copy",
                        lambda feat, threads: calls.append(feat) or torch.from_numpy(np.array(feat)))
    table, why = staging.pin_if_room(mapped_graph.edge_feat, fraction)
    assert (len(calls) == 1) == pinned and (why == "") == pinned
    if pinned:
        assert torch.equal(table, torch.from_numpy(np.asarray(mapped_graph.edge_feat)))
    else:
        assert table is None and f"more than cache.pin_ram_fraction ({fraction}) of the {ram:,} bytes" in why


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("sets,pinned", [({}, True), ({"cache__host_reads": "staged"}, False),
                                         ({"cache__policy": "future"}, False),
                                         ({"cache__transfer_dtype": "bfloat16"}, False)])
def test_a_mapped_edge_table_is_pinned_only_for_zero_copy_reads(mapped_graph, sets, pinned):
    """On a GPU the mapped edge table is pinned only when zero-copy reads will serve it as it is:
    not for staged reads, a per-batch policy or another transfer dtype (the cache would keep a
    converted copy beside it); the node table, read per batch, stays mapped."""
    from fastopt.codegen import cached_rows

    cfg = config(cache__placement="host", cache__budget_fraction=0.2, train__device="cuda", **sets)
    loader = Loader(mapped_graph, NumpySampler(mapped_graph, [3, 2], "uniform", seed=5), torch.device("cuda"),
                    cfg, read_rows=cached_rows)
    assert loader.edge_table.is_pinned() == pinned == loader.zero_copy
    assert loader.node_table.data_ptr() == mapped_graph.node_feat.ctypes.data


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_mapped_table_read_into_pinned_ram_is_served_zero_copy_on_cuda(mapped_graph):
    """On a GPU a mapped table that fits the RAM is pinned and read zero-copy: the model gets the
    device tables' features, bit for bit."""
    from fastopt.codegen import cached_rows

    streams = {}
    for placement in ("device", "host"):
        cfg = config(cache__placement=placement, cache__budget_fraction=0.2, train__device="cuda")
        loader = Loader(mapped_graph, NumpySampler(mapped_graph, [3, 2], "uniform", seed=5), torch.device("cuda"),
                        cfg, read_rows=cached_rows)
        if placement == "host":
            assert loader.edge_table.is_pinned() and loader.zero_copy
        with loader.epoch("train", 0) as batches:
            streams[placement] = [[f[m].cpu() for f, m in zip(b.inputs.edge_feat, b.inputs.mask, strict=True)]
                                  + [b.event_feat.cpu()] for b in batches]
    assert len(streams["host"]) == len(streams["device"])
    for h, d in zip(streams["host"], streams["device"]):
        assert all(torch.equal(x, y) for x, y in zip(h, d, strict=True))


def test_an_epoch_shortens_the_gil_switch_interval_while_it_runs_and_restores_it(small_graph):
    """pipeline.gil_switch_us holds while the staging threads run (the training thread takes
    the GIL back sooner) and the interpreter's own interval returns when the epoch ends, by
    an exception too; 0 leaves it alone."""
    import sys

    before = sys.getswitchinterval()
    for us, want in ((500, 0.0005), (0, before)):
        loader = Loader(small_graph, NumpySampler(small_graph, [3, 2], "uniform", seed=5), torch.device("cpu"),
                        config(pipeline__gil_switch_us=us))
        seen = []
        with pytest.raises(RuntimeError, match="stop"):
            with loader.epoch("train", 0) as batches:
                for _ in batches:
                    seen.append(sys.getswitchinterval())
                    if len(seen) == 3:
                        raise RuntimeError("stop")
        assert seen == [pytest.approx(want)] * 3 and sys.getswitchinterval() == before
    # epochs that overlap hold the shortest interval asked for and end in any order
    loaders = [Loader(small_graph, NumpySampler(small_graph, [3, 2], "uniform", seed=5), torch.device("cpu"),
                      config(pipeline__gil_switch_us=us)) for us in (250, 1000)]
    a = loaders[0].epoch("train", 0).__enter__()
    b = loaders[1].epoch("train", 0).__enter__()
    assert sys.getswitchinterval() == pytest.approx(0.00025)
    a.close()
    assert sys.getswitchinterval() == pytest.approx(0.001)
    b.close()
    assert sys.getswitchinterval() == before
    # an epoch that fails to start (an unknown split) leaves nothing changed
    with pytest.raises(FastOptError, match="vald"):
        with loaders[0].epoch("vald", 0):
            pass
    assert sys.getswitchinterval() == before


def test_the_loader_says_where_the_features_are_and_how_batches_get_them(small_graph, mapped_graph):
    """describe(): each table's size and place (device, pinned or plain host memory, the mapped
    file), then the cache and how it reads what it lacks."""
    from fastopt.runtime import CacheTable, SlimCache

    assert Loader(small_graph, None, torch.device("cpu"), config()).describe() == \
        "edge 0.00 GB on cpu, node 0.00 GB on cpu"
    assert Loader(mapped_graph, None, torch.device("cpu"), config(cache__placement="host")).describe() == \
        "edge 0.00 GB read from its file, node 0.00 GB read from its file"
    for zero_copy, tail in ((True, "the GPU reading the rest itself (a hot set per split)"),
                            (False, "the rest staged through pinned buffers (auto policy)")):
        loader = Loader(small_graph, None, torch.device("cpu"), config(cache__placement="host"))
        loader.cache = SlimCache({"edge": CacheTable(loader.edge_table)}, "cpu", loader.config.cache)
        loader.zero_copy = zero_copy
        assert loader.describe() == ("edge 0.00 GB in host memory, node 0.00 GB in host memory; "
                                     f"a device cache of 10% of the edge bytes, {tail}")


def test_dense_inputs_give_a_model_that_reads_edge_rows_the_same_output(small_graph):
    """GraphInputs built per slot (no edge rows) run an edge-row model through its per-slot rows."""
    cfg = config()
    torch.manual_seed(0)
    model = build_model("tgat", small_graph, **TINY["tgat"]).eval()
    sampler = NumpySampler(small_graph, model.fanouts, "uniform", seed=5)
    loader = Loader(small_graph, sampler, torch.device("cpu"), cfg, edge_rows=True)
    batch = next(iter(loader.plan("train", 0)))
    rows_inputs = loader.inputs_for(batch.roots, batch.times)
    dense = reference_inputs(small_graph, NumpySampler(small_graph, model.fanouts, "uniform", seed=5),
                             batch.roots, batch.times)
    torch.testing.assert_close(model(rows_inputs), model(dense), rtol=0, atol=0)


@pytest.mark.parametrize("name,placement", [("tgat", "device"), ("tgat", "host"), ("tgn", "device")])
def test_merged_repeats_give_the_per_slot_outputs(small_graph, name, placement):
    """With ``hop_dedup`` a repeated neighbor is one row read by every slot that reached it: the
    inputs are consistent (unique nodes rebuild every set) and, where the draws are deterministic
    ("recent"), the model's output and gradients are those of the per-slot inputs."""
    cfg = config(cache__placement=placement)
    torch.manual_seed(0)
    model = build_model(name, small_graph, **{**TINY[name], "fanouts": (3, 2)}).eval()
    loaders = [Loader(small_graph, NumpySampler(small_graph, [3, 2], "recent", hop_dedup=merge),
                      torch.device("cpu"), cfg, edge_rows=model.reads_edge_rows) for merge in (True, False)]
    for batch in list(loaders[0].plan("train", 0))[3:5]:
        merged, plain = (loader.inputs_for(batch.roots, batch.times) for loader in loaders)
        assert len(merged.nbr_index) == 1 and plain.nbr_index is None
        assert merged.nodes[1].numel() < plain.nodes[1].numel()
        assert torch.equal(merged.unique_nodes[merged.node_inverse], torch.cat(merged.nodes))
        outs = []
        for inputs in (merged, plain):
            model.zero_grad()
            model.reset_state()
            out = model(inputs)
            out.square().sum().backward()
            outs.append((out, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-6)
        for a, b in zip(outs[0][1], outs[1][1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("make", ["compiled", "numpy"])
def test_staging_threads_give_the_same_batches_in_order(small_graph, make):
    """Two threads staging batches in turn hand over exactly what one thread does (uniform draws
    keyed by the batch, not by the order of calls)."""
    from fastopt.runtime import TemporalSampler

    def stream(threads):
        cfg = config(pipeline__stage_threads=threads)
        sampler = (TemporalSampler(small_graph, [3, 2], "uniform", threads=1, seed=5) if make == "compiled"
                   else NumpySampler(small_graph, [3, 2], "uniform", seed=5))
        loader = Loader(small_graph, sampler, torch.device("cpu"), cfg)
        with loader.epoch("train", 0) as batches:
            assert batches.workers == min(threads, cfg.pipeline.prefetch_depth)
            return [(b.index, b.inputs) for b in batches]

    one, two = stream(1), stream(2)
    assert [i for i, _ in two] == list(range(len(one)))
    for (_, a), (_, b) in zip(one, two, strict=True):
        for name in ("nodes", "times", "dt", "mask", "edge_feat"):
            for x, y in zip(getattr(a, name), getattr(b, name), strict=True):
                assert torch.equal(x, y), name


def test_staging_threads_pad_merged_layers_as_one_thread_does_whatever_the_timing(small_graph):
    """The merged layers' padded lengths grow with the batches before (the sampler's high
    water): threads whose calls finish in any order still sample in the batches' order, so every
    batch has the shapes one thread gives it."""
    from fastopt.runtime import TemporalSampler

    class Jittery:  # the compiled sampler, each call delayed by a random few milliseconds
        def __init__(self):
            self.inner = TemporalSampler(small_graph, [4, 3], "uniform", threads=1, seed=5,
                                         hop_dedup=True, pad_rows=True)
            self.rng = random.Random(0)

        def sample(self, roots, times, batch=None):
            time.sleep(self.rng.uniform(0, 0.004))
            return self.inner.sample(roots, times, batch=batch)

        def reset(self, epoch=None):
            self.inner.reset(epoch)

    def shapes(threads):
        sampler = Jittery()
        loader = Loader(small_graph, sampler, torch.device("cpu"),
                        config(pipeline__stage_threads=threads, pipeline__prefetch_depth=4,
                               train__batch_size=50))
        with loader.epoch("train", 0) as batches:
            return [[tuple(n.shape) for n in b.inputs.nodes] + [tuple(i.shape) for i in b.inputs.nbr_index]
                    for b in batches]

    one = shapes(1)
    assert len({s[2] for s in one}) > 1  # the padded layer grows over the epoch
    for _ in range(3):
        assert shapes(4) == one


def test_reserved_lengths_are_the_high_water_in_batch_order(small_graph):
    """:meth:`Loader.reserve` on batches in order gives each the high water of the batches up to
    it, which staging then pads to, whenever it runs (lengths pad on CUDA only: the loader is
    told it runs there)."""
    from fastopt.runtime import TemporalSampler

    sampler = TemporalSampler(small_graph, [4], "recent", threads=1)
    loader = Loader(small_graph, sampler, torch.device("cpu"), config(train__batch_size=50))
    batches = list(loader.plan("train", 0))[:12]
    loader.cuda = True
    for b in batches:
        loader.sample(b)
        loader.reserve(b)
    counts = [b.sampled.unique_nodes.values.numel() for b in batches]
    assert [b.padded["nodes"] for b in batches] == [max(bucket(c) for c in counts[:i + 1]) for i in range(len(counts))]
    last = batches[-1]
    loader.high_water.seed({f"nodes/{last.sampled.roots.numel()}": 10 * last.padded["nodes"]})  # later growth
    padded = loader._padded(last.sampled.unique_nodes.values, "nodes", last.sampled.roots.numel(), last)
    assert padded.numel() == last.padded["nodes"]  # the reserved length, not the grown one


@pytest.mark.parametrize("fanouts,dedup", [([4, 3], True), ([4, 3], False), ([], True)])
def test_staging_threads_pad_unique_ids_as_one_thread_does_whatever_the_timing(small_graph, fanouts, dedup):
    """The loader's padded unique nodes and edges (on CUDA: here the loader is told it runs
    there and copies as on the CPU) are those one thread gives, however the threads' staging
    interleaves: with the sampler's dedup, without it, and without a sampler."""
    from fastopt.runtime import TemporalSampler

    def shapes(threads):
        cfg = config(pipeline__stage_threads=threads, pipeline__prefetch_depth=4, train__batch_size=300)
        sampler = (TemporalSampler(small_graph, fanouts, "uniform", threads=1, seed=5, dedup=dedup)
                   if fanouts else None)
        loader = Loader(small_graph, sampler, torch.device("cpu"), cfg)
        loader.cuda = True  # pad as on CUDA
        rng, stage = random.Random(threads), loader.stage

        def jittered(batch, *args, **kwargs):  # staging threads finish in any order
            time.sleep(rng.uniform(0, 0.003))
            return stage(batch, *args, **kwargs)

        def upload(staged, small, rows):  # the CPU's copies: none
            staged.tensors.update(small)
            staged.tensors.update(rows)
            loader._gather_device(staged)

        loader.stage, loader._upload = jittered, upload
        with loader.epoch("train", 0) as batches:
            return [(b.inputs.unique_nodes.numel(), None if b.inputs.edge_rows is None else b.inputs.edge_rows.shape[0])
                    for b in batches]

    one = shapes(1)
    assert len({n for n, _ in one}) > 1  # the padded length grows over the epoch
    for threads in (2, 3, 4):
        assert shapes(threads) == one


@pytest.mark.parametrize("threads", [1, 2])
def test_a_consumed_batch_is_freed_before_the_epoch_ends(small_graph, threads):
    """Nothing of the stream keeps a batch the consumer is done with: its inputs live on the
    device and an epoch's worth of them must not pile up until the epoch ends."""
    import gc
    import weakref

    loader = Loader(small_graph, NumpySampler(small_graph, [3, 2], "uniform", seed=5), torch.device("cpu"),
                    config(pipeline__stage_threads=threads))
    refs = []
    with loader.epoch("train", 0) as batches:
        for batch in batches:
            refs.append(weakref.ref(batch.inputs.dt[0]))
            del batch
            gc.collect()
            alive = sum(r() is not None for r in refs)
            assert alive <= 1, f"{alive} consumed batches still alive"
    assert len(refs) == loader.num_batches("train")


def test_trainer_merges_repeats_for_models_that_read_the_index(small_graph):
    t = Trainer(build_model("tgat", small_graph, **TINY["tgat"]), small_graph, config(), progress=False)
    assert t.sampler.hop_dedup and t.build_inputs(small_graph.src[:50], small_graph.ts[:50] + 1).nbr_index
    off = Trainer(build_model("tgat", small_graph, **TINY["tgat"]), small_graph, config(sampler__hop_dedup=False),
                  progress=False)
    assert not off.sampler.hop_dedup and off.build_inputs(small_graph.src[:50], small_graph.ts[:50] + 1).nbr_index is None


def test_unique_ids_are_padded_to_the_largest_bucket_seen_per_kind(small_graph):
    """On CUDA the padded length only grows (one captured shape once batches stop growing);
    nodes and edges keep their own lengths, and so do batches of another number of roots (an
    evaluation batch with MRR negatives leaves the training lengths alone); the padding is
    zeros after the ids."""
    loader = Loader(small_graph, None, torch.device("cpu"), config())
    assert torch.equal(loader._padded(torch.arange(5), "nodes", 1800), torch.arange(5))  # CPU: as is
    loader.cuda = True  # the padding rule alone (no copies are made here)
    lengths = [loader._padded(torch.arange(n) + 1, "nodes", 1800).numel() for n in (300, 900, 400, 1100, 10)]
    assert lengths == [320, 1024, 1024, 1280, 1280]
    assert loader._padded(torch.arange(5000), "nodes", 6000).numel() == 5120  # an evaluation batch
    assert loader._padded(torch.arange(10), "nodes", 1800).numel() == 1280  # training: unchanged
    padded = loader._padded(torch.arange(3) + 1, "edges", 1800)
    assert padded.numel() == 256 and torch.equal(padded[:3], torch.arange(3) + 1) and not padded[3:].any()


@pytest.mark.parametrize("placement,edge_rows,travel", [("device", False, True), ("device", True, False),
                                                         ("host", False, False)])
def test_edge_ids_travel_only_to_per_slot_device_gathers(small_graph, placement, edge_rows, travel):
    loader = Loader(small_graph, NumpySampler(small_graph, [3, 2], "uniform", seed=5), torch.device("cpu"),
                    config(cache__placement=placement), edge_rows=edge_rows)
    staged = loader.stage(next(iter(loader.plan("train", 0))))
    assert ("eid0" in staged.tensors) is travel and ("eid1" in staged.tensors) is travel


def test_bucket_sizes():
    assert [bucket(n) for n in (1, 256, 257, 4096, 4097, 5121)] == [256, 256, 320, 4096, 5120, 6144]
    for n in range(1, 20000, 37):
        assert n <= bucket(n) <= max(256, int(n * 1.25) + 1)


@pytest.mark.parametrize("name", ["tgn", "jodie", "apan"])
def test_memory_through_unique_nodes_equals_the_per_root_update(small_graph, name):
    """Updating each unique node once (and committing without host syncs) leaves the same memory
    and mailbox as updating every root row."""
    states = []
    for unique in (True, False):
        torch.manual_seed(0)
        t = Trainer(build_model(name, small_graph, **TINY[name]), small_graph, config(), progress=False)
        if not unique:
            finish = t.loader.finish

            def dense(staged, finish=finish):
                batch = finish(staged)
                batch.inputs.unique_nodes = batch.inputs.node_inverse = None
                return batch

            t.loader.finish = dense
        t.model.eval()  # dropout off: the two runs must see the same numbers
        t.model.reset_state()
        with torch.no_grad(), t.loader.epoch("train", 0) as batches:
            for batch in batches:
                t.model(batch.inputs)
                roots = batch.inputs.nodes[0]
                t.model.commit(roots[:batch.size], roots[batch.size:2 * batch.size],
                               batch.inputs.times[0][:batch.size], batch.event_feat)
        states.append({k: v.clone() for k, v in t.model.memory.state_dict().items()})
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], rtol=1e-6, atol=1e-6, msg=key)
    assert states[0]["pending"].any() and states[0]["memory"].abs().sum() > 0


def test_deliver_keeps_the_last_mails_of_each_node():
    from fastopt.models.memory import NodeMemory

    for slots in (1, 3):
        mem = NodeMemory(num_nodes=6, dim=2, mail_dim=1, slots=slots)
        rng = np.random.default_rng(slots)
        expected = {n: [] for n in range(6)}
        for _ in range(4):
            nodes = torch.from_numpy(rng.integers(0, 6, size=9))
            mails = torch.arange(nodes.numel(), dtype=torch.float32).unsqueeze(1) + 100 * _
            mem.deliver(nodes, mails, mails.squeeze(1).clone())
            for n, m in zip(nodes.tolist(), mails.squeeze(1).tolist()):
                expected[n].append(m)
        for n, got in expected.items():
            assert int(mem.mail_count[n]) == len(got)
            if got:
                latest, ts = mem.latest_mail(torch.tensor([n]))
                assert float(latest) == got[-1] and float(ts) == got[-1]
                kept = sorted(float(x) for x in mem.mails[n, : min(len(got), slots), 0])
                assert kept == sorted(got[-slots:])


class DenseModel(TGNNModel):
    """A user's model that reads the per-slot tensors only (no unique nodes, no memory)."""

    fanouts = [4]
    strategy = "recent"

    def __init__(self, edge_dim: int, dim: int = 8) -> None:
        super().__init__(dim)
        self.edge = torch.nn.Linear(edge_dim + 1, dim)
        self.degree = torch.nn.Linear(1, dim)

    def embed(self, inputs: GraphInputs) -> torch.Tensor:
        x = torch.cat([inputs.edge_feat[0], inputs.dt[0].unsqueeze(-1).log1p()], -1)
        mask = inputs.mask[0].unsqueeze(-1)
        count = mask.sum(1)
        return (F.relu(self.edge(x)) * mask).sum(1) / count.clamp(min=1) + self.degree(count.float().log1p())


def test_dense_user_models_still_train(small_graph):
    torch.manual_seed(0)
    t = Trainer(DenseModel(small_graph.edge_dim), small_graph, config(train__lr=1e-2), progress=False)
    hist = t.fit(3)
    assert hist[-1]["loss"] < hist[0]["loss"]
    assert t.test_metrics["ap"] > 0.55


class Boom(RuntimeError):
    pass


def test_a_failing_stage_stops_every_thread_and_keeps_the_checkpoint(small_graph, tmp_path):
    torch.manual_seed(0)
    t = Trainer(build_model("tgn", small_graph, **TINY["tgn"]), small_graph, config(), progress=False,
                checkpoint_dir=tmp_path)
    t.fit(1)
    saved = (tmp_path / "checkpoint.pt").read_bytes()
    class Failing:
        """The real sampler, failing at its fourth batch."""

        def __init__(self, real):
            self.real, self.calls = real, 0

        def reset(self, epoch):
            self.real.reset(epoch)

        def sample(self, roots, times):
            self.calls += 1
            if self.calls == 4:
                raise Boom("sampler failed")
            return self.real.sample(roots, times)

    t.sampler = t.loader.sampler = Failing(t.sampler)
    with pytest.raises(Boom):
        t.fit(2)
    assert not [th for th in threading.enumerate() if th.name.startswith("fastopt-loader")]
    assert (tmp_path / "checkpoint.pt").read_bytes() == saved
    resumed = Trainer(build_model("tgn", small_graph, **TINY["tgn"]), small_graph, config(), progress=False)
    resumed.load_checkpoint(tmp_path / "checkpoint.pt")
    assert resumed.epoch == 1


def test_a_consumer_that_stops_early_stops_the_producer(small_graph):
    loader = Loader(small_graph, NumpySampler(small_graph, [3], "recent"), torch.device("cpu"), config())
    with loader.epoch("train", 0) as batches:
        for batch in batches:
            break
    assert not [th for th in threading.enumerate() if th.name.startswith("fastopt-loader")]


@pytest.mark.slow
def test_tgn_learns_on_a_small_real_graph(shared_data):
    from fastopt.data import load_dataset

    graph = load_dataset(shared_data / "CollegeMsg.txt.gz")
    torch.manual_seed(0)
    t = Trainer(build_model("tgn", graph, memory_dim=32, dim=32, time_dim=16), graph,
                config(train__batch_size=200, train__lr=1e-3, train__mrr_negatives=0), progress=False)
    t.fit(3)
    assert t.test_metrics["ap"] > 0.75


def cached_loader(graph, policy="auto", depth=2, async_sampling=True, budget=0.2):
    """A host-placement loader through SlimCache on the CPU (the loader builds it on CUDA only;
    on the CPU the same cache runs without copies)."""
    from fastopt.runtime import CacheTable, SlimCache

    cfg = config(cache__placement="host", cache__policy=policy, cache__budget_fraction=budget,
                 pipeline__prefetch_depth=depth, pipeline__async_sampling=async_sampling)
    loader = Loader(graph, NumpySampler(graph, [3, 2], "uniform", seed=5), torch.device("cpu"), cfg)
    assert loader.cache is None
    loader.cache = SlimCache({"edge": CacheTable(loader.edge_table)}, "cpu", cfg.cache, record=True)
    return loader


def run_epochs(loader, epochs=2):
    out = []
    for epoch in range(epochs):
        loader.sampler.reset(epoch)
        with loader.epoch("train", epoch) as batches:
            out.append([(b.inputs.edge_feat, b.inputs.mask) for b in batches])
    return out


@pytest.mark.parametrize("policy,depth,async_sampling", [("lru", 2, True), ("future", 2, True),
                                                         ("auto", 2, True), ("future", 0, False),
                                                         ("future", 8, True), ("static", 2, True)])
def test_cached_loader_serves_the_uncached_rows_bitwise(small_graph, policy, depth, async_sampling):
    """Whatever the policy and lookahead, the cache only decides what stays on the device: every
    valid slot's features are the uncached path's, bit for bit, and the lookups are the same."""
    plain = Loader(small_graph, NumpySampler(small_graph, [3, 2], "uniform", seed=5), torch.device("cpu"),
                   config(cache__placement="host"))
    want = run_epochs(plain)
    loader = cached_loader(small_graph, policy, depth, async_sampling)
    got = run_epochs(loader)
    assert len(got) == len(want) and all(len(g) == len(w) for g, w in zip(got, want))
    for g_epoch, w_epoch in zip(got, want):
        for (g_feat, g_mask), (w_feat, w_mask) in zip(g_epoch, w_epoch):
            for gf, wf, gm, wm in zip(g_feat, w_feat, g_mask, w_mask, strict=True):
                assert torch.equal(gm, wm) and gf.shape == wf.shape
                assert torch.equal(gf[gm], wf[wm])
    expected = {"auto": "future"}.get(policy, policy)  # auto: chosen on the first window
    assert loader.cache.policy("edge") == expected
    c = loader.cache.counters("edge")
    assert c.batches == sum(len(e) for e in want)
    assert c.hits <= c.lookups - loader.cache.optimum("edge").misses  # never above Belady


@pytest.mark.parametrize("edge_rows", [True, False])
def test_zero_copy_loader_serves_the_uncached_rows_with_several_staging_threads(small_graph, edge_rows):
    """Zero-copy reads (here on the CPU, the cache attached by hand) give every valid slot the
    uncached path's features for two epochs of each split; the batches are staged by several
    threads, as with device tables, and each split's second epoch starts from its hot set."""
    from fastopt.codegen import cached_rows
    from fastopt.runtime import CacheTable, SlimCache

    def epochs(loader):
        out = []
        for epoch, split in enumerate(["train", "val", "train", "val"]):
            loader.sampler.reset(epoch)
            with loader.epoch(split, epoch) as batches:
                assert batches.workers == 2
                for b in batches:
                    x = b.inputs
                    feats = ([x.layer_edges(i)[0][x.layer_edges(i)[1]] for i in range(2)] if edge_rows
                             else x.edge_feat)
                    out.append([f[m] for f, m in zip(feats, x.mask, strict=True)])
        return out

    cfg = config(cache__placement="host", cache__host_reads="zero_copy", cache__budget_fraction=0.2,
                 pipeline__stage_threads=2)
    plain = Loader(small_graph, NumpySampler(small_graph, [3, 2], "uniform", seed=5), torch.device("cpu"),
                   config(cache__placement="host", pipeline__stage_threads=2), edge_rows=edge_rows)
    want = epochs(plain)
    loader = Loader(small_graph, NumpySampler(small_graph, [3, 2], "uniform", seed=5), torch.device("cpu"),
                    cfg, edge_rows=edge_rows)
    loader.cache = SlimCache({"edge": CacheTable(loader.edge_table)}, "cpu", cfg.cache, read_rows=cached_rows)
    loader.zero_copy = True
    got = epochs(loader)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert all(torch.equal(x, y) for x, y in zip(g, w, strict=True))
    c = loader.cache.counters("edge")
    assert c.batches == len(want) and 0 < c.hits < c.lookups and c.preloaded > 0


@pytest.mark.parametrize("as_on_cuda", [False, True])
def test_cached_loader_hands_edge_rows_models_the_unique_rows(small_graph, as_on_cuda):
    """A model that reads edge rows by index gets SlimCache's unique rows and each slot's index
    into them, not a row per slot: every valid slot reads the uncached path's features. On CUDA
    (here the loader is told it runs there and copies as on the CPU) the rows are padded with
    zero rows to the high-water length, so that a captured step sees one shape."""
    from fastopt.runtime import CacheTable, SlimCache

    plain = Loader(small_graph, NumpySampler(small_graph, [3, 2], "uniform", seed=5), torch.device("cpu"),
                   config(cache__placement="host"))
    want = run_epochs(plain, epochs=1)[0]
    cfg = config(cache__placement="host", cache__policy="future", cache__budget_fraction=0.2)
    loader = Loader(small_graph, NumpySampler(small_graph, [3, 2], "uniform", seed=5), torch.device("cpu"),
                    cfg, edge_rows=True)
    loader.cache = SlimCache({"edge": CacheTable(loader.edge_table)}, "cpu", cfg.cache)
    if as_on_cuda:
        def upload(staged, small, rows):  # the CPU's copies: none
            staged.tensors.update(small)
            staged.tensors.update(rows)

        loader.cuda, loader._upload = True, upload
        loader._gather_host = lambda table, ids: table.index_select(0, ids)  # unpinned
    with loader.epoch("train", 0) as batches:
        for batch, (w_feat, w_mask) in zip(batches, want, strict=True):
            inputs = batch.inputs
            slots = sum(m.numel() for m in inputs.mask)
            unique = batch.sampled.unique_eids.values.numel()
            if as_on_cuda:  # the high water of the batches so far (one thread stages them in order)
                assert inputs.edge_rows.shape[0] >= bucket(unique) and not inputs.edge_rows[unique:].any()
            else:
                assert inputs.edge_rows.shape[0] == unique < slots
            for i, (wf, wm) in enumerate(zip(w_feat, w_mask, strict=True)):
                rows, index = inputs.layer_edges(i)
                assert torch.equal(inputs.mask[i], wm)
                assert torch.equal(rows[index][wm], wf[wm])


def test_loader_feeds_the_future_policy_ahead(small_graph):
    """With the batches sampled ahead announced, the future policy moves fewer rows than LRU and,
    looking ahead far enough, reaches the offline optimum of the epoch."""
    moved = {}
    for name, policy, depth in [("lru", "lru", 2), ("future", "future", 2), ("far", "future", 1000)]:
        loader = cached_loader(small_graph, policy, depth)
        run_epochs(loader, epochs=1)
        c = loader.cache.counters("edge")
        moved[name] = c.misses
        if name == "far":
            assert c.misses == loader.cache.optimum("edge").misses
    assert moved["far"] <= moved["future"] < moved["lru"]


@pytest.mark.parametrize("depth,async_sampling", [(2, True), (0, False)])
def test_an_epoch_left_early_leaves_the_cached_loader_usable(small_graph, depth, async_sampling):
    """Batches staged but never consumed have their cache lookups finished when the epoch closes;
    the next epoch runs under the future policy, and an ad-hoc batch reads past the cache."""
    loader = cached_loader(small_graph, "future", depth, async_sampling)
    reference = run_epochs(cached_loader(small_graph, "future", depth, async_sampling), epochs=1)[0]
    loader.sampler.reset(0)
    with loader.epoch("train", 0) as batches:
        for i, batch in enumerate(batches):
            if i == 2:
                if depth:  # let the producer stage the next batches before leaving
                    deadline = time.monotonic() + 5
                    while len(loader.cache._tables["edge"].pending) < 2 and time.monotonic() < deadline:
                        time.sleep(0.01)
                    assert len(loader.cache._tables["edge"].pending) == 2
                break
    again = run_epochs(loader, epochs=1)[0]
    for (g_feat, g_mask), (w_feat, w_mask) in zip(again, reference, strict=True):
        for gf, wf, gm in zip(g_feat, w_feat, g_mask, strict=True):
            assert torch.equal(gf[gm], wf[gm])
    plain = Loader(small_graph, NumpySampler(small_graph, [3, 2], "uniform", seed=5), torch.device("cpu"),
                   config(cache__placement="host"))
    batch = next(iter(loader.plan("train", 0)))
    for l in (loader, plain):
        l.sampler.reset(1)
    before = _traffic(loader.cache.counters("edge"))
    for _ in range(2):
        inputs = loader.inputs_for(batch.roots, batch.times)
        want = plain.inputs_for(batch.roots, batch.times)
        for gf, wf, m in zip(inputs.edge_feat, want.edge_feat, want.mask, strict=True):
            assert torch.equal(gf[m], wf[m])
    assert _traffic(loader.cache.counters("edge")) == before  # an ad-hoc batch reads past the cache


@pytest.mark.parametrize("policy", ["static", "future", "lru"])
def test_inputs_before_any_epoch_read_past_an_unplanned_cache(small_graph, policy):
    """``inputs_for`` before the first epoch (a trainer's check on its first batch) must not need
    the epoch's plan (the static policy has no hot set before it) nor change what the epoch does."""
    loader = cached_loader(small_graph, policy)
    plain = Loader(small_graph, NumpySampler(small_graph, [3, 2], "uniform", seed=5), torch.device("cpu"),
                   config(cache__placement="host"))
    batch = next(iter(loader.plan("train", 0)))
    inputs = loader.inputs_for(batch.roots, batch.times)
    want = plain.inputs_for(batch.roots, batch.times)
    for gf, wf, m in zip(inputs.edge_feat, want.edge_feat, want.mask, strict=True):
        assert torch.equal(gf[m], wf[m])
    assert loader.cache.counters("edge").lookups == 0
    loader.sampler.reset(0)
    reference = cached_loader(small_graph, policy)
    assert run_epochs(loader, epochs=1)[0].__len__() == len(run_epochs(reference, epochs=1)[0])
    assert _traffic(loader.cache.counters("edge")) == _traffic(reference.cache.counters("edge"))


def _traffic(c) -> tuple:
    """A cache's counted traffic (its host-time fields left out)."""
    return (c.batches, c.lookups, c.hits, c.misses, c.preloaded, c.bytes_h2d, c.evictions)
