"""The Cython TemporalSampler against the NumPy oracle, on generated and real graphs."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from fastopt.data import TemporalGraph
from fastopt.errors import SamplerError
from fastopt.runtime import OPENMP, TemporalSampler
from fastopt.runtime.reorder import node_rows
from fastopt.runtime.topology import (CpuTopology, Placement, _parse_cpu_list, plan_placement,
                                      read_topology, static_chunks, usable_cpus)
from fastopt.sampling import NumpySampler

BLOCK_FIELDS = ("dst_nodes", "dst_times", "nbr_nodes", "nbr_eids", "nbr_times", "dt", "mask", "indptr")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def graphs(draw, max_nodes=12, max_events=40):
    """Small event streams with duplicate timestamps, self loops and isolated nodes."""
    n = draw(st.integers(1, max_nodes))
    m = draw(st.integers(1, max_events))
    ids = st.integers(0, n - 1)
    src = draw(st.lists(ids, min_size=m, max_size=m))
    dst = draw(st.lists(ids, min_size=m, max_size=m))
    ts = sorted(draw(st.lists(st.integers(0, 8), min_size=m, max_size=m)))
    return TemporalGraph(np.array(src), np.array(dst), np.array(ts, dtype=np.float64), n)


@st.composite
def queries(draw, graph, size=st.integers(0, 30)):
    """Roots (any node, isolated ones included) and times, some equal to event times."""
    r = draw(size)
    roots = draw(st.lists(st.integers(0, graph.num_nodes - 1), min_size=r, max_size=r))
    times = draw(st.lists(st.sampled_from([0.0, 0.5, 3.0, 4.0, 8.0, 9.5]), min_size=r, max_size=r))
    return np.array(roots, dtype=np.int64), np.array(times, dtype=np.float64)


def assert_blocks_equal(a, b):
    assert a.num_layers == b.num_layers
    torch.testing.assert_close(a.roots, b.roots, rtol=0, atol=0)
    for x, y in zip(a.blocks, b.blocks):
        for name in BLOCK_FIELDS:
            torch.testing.assert_close(getattr(x, name), getattr(y, name), rtol=0, atol=0,
                                       msg=lambda m: f"{name}: {m}")


def assert_uniques(batch):
    """Every Unique holds sorted distinct ids whose inverse rebuilds its array."""
    pairs = [(b.unique_nodes, b.nbr_nodes) for b in batch.blocks]
    pairs += [(b.unique_eids, b.nbr_eids) for b in batch.blocks]
    pairs.append((batch.unique_nodes, torch.cat([batch.roots] + [b.nbr_nodes.reshape(-1) for b in batch.blocks])))
    pairs.append((batch.unique_eids, torch.cat([b.nbr_eids.reshape(-1) for b in batch.blocks])))
    for uniq, ids in pairs:
        assert uniq.inverse.shape == ids.shape
        assert torch.equal(uniq.values[uniq.inverse], ids)
        assert torch.equal(uniq.values, torch.unique(ids))


def candidate_sets(graph, node, time, undirected=True):
    """Sorted edge ids of the events touching ``node`` strictly before ``time``, an undirected
    self loop twice (the oracle's definition: every event is an entry in both endpoints' lists)."""
    before = graph.ts < time
    out = np.flatnonzero(before & (graph.src == node))
    if undirected:
        out = np.sort(np.concatenate([out, np.flatnonzero(before & (graph.dst == node))]))
    return out


# ---------------------------------------------------------------------------- "recent"
@SETTINGS
@given(data=st.data(), graph=graphs(), fanouts=st.sampled_from([[1], [3], [2, 3], [3, 1, 2]]),
       undirected=st.booleans(), threads=st.sampled_from([1, 2]),
       reorder=st.sampled_from(["none", "degree", "rcm"]))
def test_recent_equals_oracle(data, graph, fanouts, undirected, threads, reorder):
    roots, times = data.draw(queries(graph))
    fast = TemporalSampler(graph, fanouts, "recent", threads=threads, undirected=undirected,
                           reorder=reorder)
    ref = NumpySampler(graph, fanouts, "recent", undirected=undirected)
    a, b = fast.sample(roots, times), ref.sample(roots, times)
    assert_blocks_equal(a, b)
    assert_uniques(a)
    for x, y in zip(a.blocks, b.blocks):
        assert torch.equal(x.unique_nodes.values, y.unique_nodes.values)
        assert torch.equal(x.unique_eids.inverse, y.unique_eids.inverse)


@SETTINGS
@given(data=st.data(), graph=graphs())
def test_recent_chronological_batches_use_pointers_then_reset(data, graph):
    """Batches in time order, one going back in time, then a new epoch: always the oracle's answer."""
    fast = TemporalSampler(graph, [4, 2], "recent", threads=2)
    ref = NumpySampler(graph, [4, 2], "recent")
    times = np.unique(np.concatenate([graph.ts, [9.5]]))
    for epoch in range(2):
        for t in list(times) + [times[0], times[-1]]:
            roots = np.array(data.draw(st.lists(st.integers(0, graph.num_nodes - 1), min_size=1,
                                                max_size=6)), dtype=np.int64)
            stamp = np.full(roots.shape, t)
            assert_blocks_equal(fast.sample(roots, stamp), ref.sample(roots, stamp))
        fast.reset()
        assert fast.epoch == epoch + 1


def assert_merge_expands_to(merged, plain):
    """Every valid slot of a merged layer reads, through ``nbr_rows``, a next-layer row with the
    slot's node and time and the very neighbors the unmerged sampler gives that slot; each
    distinct (neighbor, edge) is one row, and every row before the padding is read."""
    m, p = merged.blocks[0], plain.blocks[0]
    nxt_m, nxt_p = merged.blocks[1], plain.blocks[1]
    valid = p.mask.reshape(-1)
    rows = m.nbr_rows.reshape(-1)[valid]
    count = int(rows.max()) + 1 if rows.numel() else 0
    assert torch.equal(rows.unique(), torch.arange(count))
    assert torch.equal(nxt_m.dst_nodes[rows], p.nbr_nodes.reshape(-1)[valid])
    assert torch.equal(nxt_m.dst_times[rows], p.nbr_times.reshape(-1)[valid])
    for name in ("nbr_nodes", "nbr_eids", "nbr_times", "dt", "mask"):
        assert torch.equal(getattr(nxt_m, name)[rows], getattr(nxt_p, name)[valid]), name
    pairs = torch.stack([nxt_m.dst_nodes[:count], m.nbr_eids.reshape(-1)[m.row_slots[:count]]])
    assert torch.unique(pairs, dim=1).shape[1] == count


@SETTINGS
@given(data=st.data(), graph=graphs(), fanouts=st.sampled_from([[2, 3], [3, 2, 2]]),
       undirected=st.booleans(), threads=st.sampled_from([1, 2]))
def test_merged_repeats_equal_oracle_and_expand_to_the_unmerged_sample(data, graph, fanouts, undirected, threads):
    roots, times = data.draw(queries(graph))
    fast = TemporalSampler(graph, fanouts, "recent", threads=threads, undirected=undirected, hop_dedup=True)
    ref = NumpySampler(graph, fanouts, "recent", undirected=undirected, hop_dedup=True)
    plain = NumpySampler(graph, fanouts, "recent", undirected=undirected)
    a, b = fast.sample(roots, times), ref.sample(roots, times)
    assert_blocks_equal(a, b)
    assert_uniques(a)
    for x, y in zip(a.blocks[:-1], b.blocks[:-1]):
        assert torch.equal(x.nbr_rows, y.nbr_rows) and torch.equal(x.row_slots, y.row_slots)
    assert a.blocks[-1].nbr_rows is None
    if len(fanouts) == 2:  # a deeper merge changes what the layer below the second samples
        assert_merge_expands_to(a, plain.sample(roots, times))


def test_merged_rows_are_padded_to_a_high_water_length(wikipedia):
    s = TemporalSampler(wikipedia, [10, 10], "uniform", threads=1, hop_dedup=True, pad_rows=True)
    lengths = []
    for start in (0, 20_000, 5_000):
        roots, times = wikipedia.src[start:start + 300], wikipedia.ts[start:start + 300]
        batch = s.sample(roots, times)
        first = batch.blocks[0]
        count = int(first.nbr_rows[first.mask].max()) + 1 if first.mask.any() else 0
        rows = batch.blocks[1].num_dst
        assert rows >= count and rows == first.row_slots.numel()
        assert not batch.blocks[1].mask[count:].any()  # padding rows are never valid
        lengths.append(rows)
    assert lengths == sorted(lengths) and lengths[2] == lengths[1]  # only grows
    more = s.sample(np.tile(wikipedia.src[5_000:5_300], 4), np.tile(wikipedia.ts[5_000:5_300], 4))
    assert s.sample(roots, times).blocks[1].num_dst == lengths[2]  # more roots pad apart
    assert more.blocks[1].num_dst >= more.blocks[0].nbr_rows.max() + 1


# ---------------------------------------------------------------------------- "uniform"
@SETTINGS
@given(data=st.data(), graph=graphs(), k=st.integers(1, 5), undirected=st.booleans())
def test_uniform_draws_only_valid_candidates(data, graph, k, undirected):
    roots, times = data.draw(queries(graph))
    batch = TemporalSampler(graph, [k, 2], "uniform", threads=2, undirected=undirected).sample(roots, times)
    ref = NumpySampler(graph, [k, 2], "uniform", undirected=undirected)
    for block in batch.blocks:
        for i in range(block.num_dst):
            mask = block.mask[i]
            cnt = int(mask.sum())
            assert mask[:cnt].all() and not mask[cnt:].any()  # valid entries first
            assert int(block.counts()[i]) == cnt
            node, time = int(block.dst_nodes[i]), float(block.dst_times[i])
            live = i < len(roots) if block is batch.blocks[0] else bool(prev_mask[i])
            cands = candidate_sets(graph, node, time, undirected) if live else np.array([], int)
            assert cnt == min(len(cands), block.fanout)
            eids = block.nbr_eids[i, :cnt].numpy()
            assert set(eids) <= set(cands)
            assert (graph.ts[eids] < time).all()  # no leakage
            assert np.array_equal(block.nbr_times[i, :cnt].numpy(), graph.ts[eids])
            other = np.where(graph.src[eids] == node, graph.dst[eids], graph.src[eids])
            assert np.array_equal(block.nbr_nodes[i, :cnt].numpy(), other)
            if len(cands) <= block.fanout:  # all of them, oldest first, as the oracle returns them
                assert np.array_equal(np.sort(eids), cands)
            assert (block.nbr_eids[i, cnt:] == -1).all() and (block.nbr_nodes[i, cnt:] == 0).all()
            assert (block.dt[i, cnt:] == 0).all() and (block.nbr_times[i, cnt:] == 0).all()
        prev_mask = block.mask.reshape(-1)
    # layer l + 1's destinations are layer l's neighbors at their own edge's time
    for up, down in zip(batch.blocks, batch.blocks[1:]):
        assert torch.equal(down.dst_nodes, up.nbr_nodes.reshape(-1))
        assert torch.equal(down.dst_times, up.nbr_times.reshape(-1))
    assert_uniques(batch)
    # with at most k candidates everywhere uniform equals the oracle exactly
    if all(bool((b.counts() < b.fanout).all()) for b in batch.blocks):
        assert_blocks_equal(batch, ref.sample(roots, times))


def test_uniform_is_uniform_chi_square():
    """One root with 40 candidates sampled 20,000 times: every candidate about equally often."""
    n = 40
    graph = TemporalGraph(np.zeros(n, np.int64), np.arange(1, n + 1), np.arange(n, dtype=np.float64), n + 1)
    sampler = TemporalSampler(graph, [8], "uniform", threads=2, seed=3)
    roots = np.zeros(2500, np.int64)
    times = np.full(2500, float(n))
    counts = np.zeros(n)
    for _ in range(8):
        eids = sampler.sample(roots, times).blocks[0].nbr_eids.reshape(-1).numpy()
        counts += np.bincount(eids, minlength=n)
    assert counts.sum() == 8 * 2500 * 8
    assert chisquare(counts).pvalue > 1e-3
    # draws with replacement: some rows repeat a candidate, as 8 of 40 do ~52% of the time
    rows = sampler.sample(roots, times).blocks[0].nbr_eids.numpy()
    repeats = np.mean([len(set(r)) < 8 for r in rows])
    assert 0.4 < repeats < 0.65


@pytest.mark.parametrize("k", [1, 7, 10, 32, 70])
def test_uniform_fanouts_wide_and_narrow(k):
    """Rows with more candidates than k, fewer, and none; k beyond the prefetched slots too."""
    rng = np.random.default_rng(k)
    n = 400
    src = rng.integers(0, 6, n)
    graph = TemporalGraph(src, rng.integers(0, 40, n), np.sort(rng.integers(0, 50, n)).astype(float), 41)
    roots = np.array([0, 1, 5, 40, 7, 0])
    times = np.array([50.0, 25.0, 3.0, 50.0, 50.0, 0.0])
    one = TemporalSampler(graph, [k], "uniform", threads=1, seed=k).sample(roots, times).blocks[0]
    two = TemporalSampler(graph, [k], "uniform", threads=2, seed=k).sample(roots, times).blocks[0]
    for name in BLOCK_FIELDS:
        assert torch.equal(getattr(one, name), getattr(two, name))
    for i, (v, t) in enumerate(zip(roots, times)):
        cands = candidate_sets(graph, v, t)
        cnt = int(one.counts()[i])
        assert cnt == min(len(cands), k)
        assert set(one.nbr_eids[i, :cnt].tolist()) <= set(cands.tolist())


def test_uniform_draws_differ_across_batches_and_epochs_not_threads(wikipedia):
    roots = np.concatenate([wikipedia.src[5000:5600], wikipedia.dst[5000:5600]])
    times = np.concatenate([wikipedia.ts[5000:5600]] * 2)
    runs = {}
    for threads in (1, 2):
        for reorder in ("none", "degree", "rcm"):
            s = TemporalSampler(wikipedia, [10, 10], "uniform", threads=threads, seed=7, reorder=reorder)
            runs[threads, reorder] = [s.sample(roots, times), s.sample(roots, times)]
            s.reset()
            runs[threads, reorder].append(s.sample(roots, times))
    first = runs[1, "none"]
    for batches in runs.values():
        for a, b in zip(batches, first):
            assert_blocks_equal(a, b)
            assert torch.equal(a.unique_eids.values, b.unique_eids.values)
    assert not torch.equal(first[0].blocks[1].nbr_eids, first[1].blocks[1].nbr_eids)  # next batch
    assert not torch.equal(first[0].blocks[1].nbr_eids, first[2].blocks[1].nbr_eids)  # next epoch
    other_seed = TemporalSampler(wikipedia, [10, 10], "uniform", threads=2, seed=8).sample(roots, times)
    assert not torch.equal(other_seed.blocks[1].nbr_eids, first[0].blocks[1].nbr_eids)


# ---------------------------------------------------------------------------- real data, dedup
@pytest.mark.parametrize("threads", [1, 2])
def test_wikipedia_batches_equal_oracle(wikipedia, threads):
    """Chronological batches of 200 events with negatives, TGN's and a 2-layer recent setting."""
    rng = np.random.default_rng(0)
    pool = wikipedia.destination_pool()
    for fanouts in ([10], [10, 5]):
        fast = TemporalSampler(wikipedia, fanouts, "recent", threads=threads, reorder="degree")
        ref = NumpySampler(wikipedia, fanouts, "recent")
        for start in range(20000, 24000, 200):
            e = slice(start, start + 200)
            roots = np.concatenate([wikipedia.src[e], wikipedia.dst[e], rng.choice(pool, 200)])
            times = np.concatenate([wikipedia.ts[e]] * 3)
            a, b = fast.sample(roots, times), ref.sample(roots, times)
            assert_blocks_equal(a, b)
            assert torch.equal(a.unique_nodes.values, b.unique_nodes.values)
            assert torch.equal(a.unique_eids.inverse, b.unique_eids.inverse)
        assert_uniques(a)


def test_batch_keys_fix_the_draws_whatever_the_call_order(wikipedia):
    s = TemporalSampler(wikipedia, [10, 5], "uniform", threads=2, seed=3)
    queries = [(wikipedia.src[i:i + 200], wikipedia.ts[i:i + 200]) for i in (40_000, 60_000, 80_000)]
    forward = [s.sample(r, t, batch=b) for b, (r, t) in enumerate(queries)]
    s.reset(s.epoch)
    backward = [s.sample(r, t, batch=b) for b, (r, t) in reversed(list(enumerate(queries)))][::-1]
    for a, b in zip(forward, backward):
        assert_blocks_equal(a, b)
    other = s.sample(*queries[0], batch=7)
    assert not torch.equal(other.blocks[0].nbr_eids, forward[0].blocks[0].nbr_eids)
    with pytest.raises(SamplerError, match="batch -1"):
        s.sample(*queries[0], batch=-1)


def test_limit_uses_only_the_first_events(wikipedia):
    end = wikipedia.train_end
    fast = TemporalSampler(wikipedia, [10], "recent", limit=end)
    ref = NumpySampler(wikipedia, [10], "recent", limit=end)
    roots = wikipedia.src[end: end + 500]
    times = wikipedia.ts[end: end + 500] + 1e9
    assert fast.num_edges == end
    assert_blocks_equal(fast.sample(roots, times), ref.sample(roots, times))


def test_defaults_come_from_the_config(small_graph):
    from fastopt import config

    with config.patch(sampler__threads=1, sampler__reorder="rcm", sampler__dedup=False,
                      sampler__undirected=False):
        s = TemporalSampler(small_graph, [3])
    assert (s.threads, s.reorder, s.dedup, s.undirected) == (1, "rcm", False, False)
    assert TemporalSampler(small_graph, [3], threads=2, dedup=True).dedup


def test_dedup_off_leaves_uniques_empty(small_graph):
    batch = TemporalSampler(small_graph, [5, 5], dedup=False).sample(small_graph.src[:50], small_graph.ts[:50])
    assert batch.unique_nodes is None and batch.unique_eids is None
    assert all(b.unique_nodes is None and b.unique_eids is None for b in batch.blocks)


def test_returned_tensors_are_not_reused(small_graph):
    s = TemporalSampler(small_graph, [5], "recent")
    a = s.sample(small_graph.src[100:200], small_graph.ts[100:200])
    kept = a.blocks[0].nbr_eids.clone()
    s.sample(small_graph.dst[200:300], small_graph.ts[200:300])
    assert torch.equal(a.blocks[0].nbr_eids, kept)


def test_inputs_of_other_dtypes_and_tensors(small_graph):
    s = TemporalSampler(small_graph, [5])
    roots, times = small_graph.src[10:60], small_graph.ts[10:60]
    want = s.sample(roots, times)
    for r, t in [(roots.astype(np.int32), times.astype(np.float32).astype(np.float64)),
                 (torch.from_numpy(roots), torch.from_numpy(times)),
                 (roots.astype(np.float64), times.astype(np.int64).astype(np.float64)),
                 (list(roots), list(times))]:
        assert_blocks_equal(s.sample(r, t), want)


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("roots, times, match", [
    ([0, 99999], [1.0, 1.0], "root id 99999"),
    ([-1], [1.0], "root id -1"),
    ([0], [float("nan")], "root time nan"),
    ([0], [float("inf")], "root time inf"),
    ([0, 1], [1.0], "one length"),
    ([[0]], [[1.0]], "1-d"),
    ([0.5], [1.0], "float64"),
    (["a"], [1.0], "integer node ids"),
    ([0], ["x"], "numeric"),
])
def test_bad_roots_and_times(small_graph, roots, times, match):
    s = TemporalSampler(small_graph, [3])
    with pytest.raises(SamplerError, match=match):
        s.sample(np.array(roots), np.array(times))


def test_bad_fast_path_input_names_the_value(small_graph):
    """Bad values in int64/float64 arrays are caught inside the Cython loop, same messages."""
    s = TemporalSampler(small_graph, [3, 2])
    with pytest.raises(SamplerError, match="root id 100000"):
        s.sample(np.array([1, 100000]), np.array([5.0, 5.0]))
    with pytest.raises(SamplerError, match="root time nan"):
        s.sample(torch.tensor([1, 2]), torch.tensor([5.0, float("nan")], dtype=torch.float64))
    assert s.sample(np.array([1]), np.array([5.0])).num_layers == 2  # still usable


@pytest.mark.parametrize("kwargs, match", [
    (dict(fanouts=[0]), "fanout 0"),
    (dict(fanouts=[10, -1]), "fanout -1"),
    (dict(fanouts=[True]), "fanout True"),
    (dict(fanouts=[2.5]), "fanout 2.5"),
    (dict(strategy="latest"), "strategy 'latest'"),
    (dict(threads=0), "threads=0"),
    (dict(threads=-2), "threads=-2"),
    (dict(threads=1.5), "threads=1.5"),
    (dict(reorder="random"), "reorder 'random'"),
    (dict(seed="x"), "seed 'x'"),
    (dict(limit=10**9), "limit=1000000000"),
])
def test_bad_constructor_arguments(small_graph, kwargs, match):
    with pytest.raises(SamplerError, match=match):
        TemporalSampler(small_graph, **kwargs)


def test_unsorted_or_nan_event_times_are_rejected():
    class Raw:  # a graph-like object that skipped TemporalGraph's own checks
        src, dst, num_nodes = np.array([0, 1]), np.array([1, 0]), 2
        ts = np.array([2.0, 1.0])
    with pytest.raises(SamplerError, match="ts=1.0 < ts=2.0"):
        TemporalSampler(Raw)
    Raw.ts = np.array([0.0, np.nan])
    with pytest.raises(SamplerError, match="finite"):
        TemporalSampler(Raw)
    Raw.ts, Raw.dst = np.array([0.0, 1.0]), np.array([1, 5])
    with pytest.raises(SamplerError, match="num_nodes=2"):
        TemporalSampler(Raw)


# ---------------------------------------------------------------------------- topology
def test_node_rows_are_permutations(small_graph):
    for method in ("degree", "rcm"):
        rows = node_rows(small_graph.src, small_graph.dst, small_graph.num_nodes, method)
        assert np.array_equal(np.sort(rows), np.arange(small_graph.num_nodes))
    deg = np.bincount(small_graph.src, minlength=small_graph.num_nodes) + \
        np.bincount(small_graph.dst, minlength=small_graph.num_nodes)
    rows = node_rows(small_graph.src, small_graph.dst, small_graph.num_nodes, "degree")
    assert deg[rows == 0][0] == deg.max()
    assert node_rows(small_graph.src, small_graph.dst, small_graph.num_nodes, "none") is None


def fake_sysfs(root, cpus, l2_groups):
    """A sysfs cpu tree: one SMT sibling per core, L2 shared within ``l2_groups``, one L3."""
    for cpu in cpus:
        base = root / f"cpu{cpu}"
        (base / "topology").mkdir(parents=True)
        (base / "topology" / "thread_siblings_list").write_text(f"{cpu}\n")
        group = next(g for g in l2_groups if cpu in g)
        for index, (level, kind, shared) in enumerate([
                (1, "Data", str(cpu)), (1, "Instruction", str(cpu)),
                (2, "Unified", ",".join(map(str, group))),
                (3, "Unified", f"{min(cpus)}-{max(cpus)}")]):
            d = base / "cache" / f"index{index}"
            d.mkdir(parents=True)
            (d / "level").write_text(f"{level}\n")
            (d / "type").write_text(f"{kind}\n")
            (d / "shared_cpu_list").write_text(shared + "\n")


def test_read_topology_and_pairing_on_fake_sysfs(tmp_path):
    fake_sysfs(tmp_path, range(4), [(0, 2), (1, 3)])
    topo = read_topology(str(tmp_path), allowed=[0, 1, 2, 3])
    assert topo.shared == {2: [(0, 2), (1, 3)], 3: [(0, 1, 2, 3)]}
    # threads 0 and 3 share most nodes, as do 1 and 2: each pair lands on one L2
    chunks = [np.array([1, 2, 3, 4]), np.array([10, 11, 12]), np.array([11, 12, 13]), np.array([2, 3, 4])]
    plan = plan_placement(topo, 4, chunks)
    assert sorted(plan.pairs) == [(0, 3), (1, 2)] and plan.level == 2
    l2 = {0: 0, 2: 0, 1: 1, 3: 1}
    assert l2[plan.cpus[0]] == l2[plan.cpus[3]] and l2[plan.cpus[1]] == l2[plan.cpus[2]]
    assert sorted(plan.cpus) == [0, 1, 2, 3]


def test_placement_without_networkx_leaves_threads_unpinned(tmp_path, monkeypatch):
    import sys

    fake_sysfs(tmp_path, range(4), [(0, 2), (1, 3)])
    topo = read_topology(str(tmp_path), allowed=[0, 1, 2, 3])
    monkeypatch.setitem(sys.modules, "networkx", None)  # import networkx raises ImportError
    plan = plan_placement(topo, 4, [np.arange(3)] * 4)
    assert plan.cpus is None and 'pip install "fastopt[topology]"' in plan.reason


def test_placement_falls_back_when_nothing_to_exploit(tmp_path):
    fake_sysfs(tmp_path, range(2), [(0,), (1,)])
    no_l3 = read_topology(str(tmp_path), allowed=[0])
    assert no_l3.shared == {}
    assert plan_placement(no_l3, 2, [np.arange(3)] * 2).cpus is None  # more threads than CPUs
    assert plan_placement(no_l3, 1, [np.arange(3)]).cpus is None
    assert plan_placement(CpuTopology([0, 1], {}), 2, [np.arange(3)] * 2).reason.startswith("no cache")
    assert read_topology(str(tmp_path / "missing"), allowed=[0, 1]).shared == {}
    assert _parse_cpu_list("0-2,5\n") == [0, 1, 2, 5]
    assert static_chunks(5, 2) == [slice(0, 3), slice(3, 5)]
    assert static_chunks(10, 4) == [slice(0, 3), slice(3, 6), slice(6, 8), slice(8, 10)]


@pytest.mark.skipif(not OPENMP, reason="a build without OpenMP runs one thread")
def test_warns_about_spin_waiting_on_busy_cores(small_graph, monkeypatch):
    import os
    import warnings

    from fastopt.runtime import sampler

    busy = float(len(os.sched_getaffinity(0)) + 1)
    monkeypatch.setattr(os, "getloadavg", lambda: (busy, busy, busy))
    monkeypatch.setattr(sampler, "_startup_environ", lambda: {"PATH": "/bin"})
    with pytest.warns(RuntimeWarning, match="OMP_WAIT_POLICY=passive"):
        TemporalSampler(small_graph, [3], threads=2)
    monkeypatch.setattr(sampler, "_startup_environ", lambda: {"OMP_WAIT_POLICY": "passive"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TemporalSampler(small_graph, [3], threads=2)
        TemporalSampler(small_graph, [3], threads=1)


def test_pinned_sampler_gives_the_same_batches(small_graph):
    roots, times = small_graph.src[500:1100], small_graph.ts[500:1100]
    plain = TemporalSampler(small_graph, [5, 5], "uniform", threads=2).sample(roots, times)
    pinned = TemporalSampler(small_graph, [5, 5], "uniform", threads=2, pin_threads=True)
    assert_blocks_equal(pinned.sample(roots, times), plain)
    assert isinstance(pinned.placement, Placement) and pinned.placement.reason


def _masks() -> dict:
    """Every thread of this process: its CPU affinity."""
    return {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")}


@pytest.mark.skipif(not OPENMP or not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="pinning needs OpenMP threads and two CPUs on Linux")
def test_pinning_leaves_the_caller_and_later_samplers_every_cpu(small_graph):
    """A pinned sampler pins its loop threads, not the thread that calls it: a thread the caller
    starts later inherits its affinity (a tuning study's next trials ran on one CPU), and an
    unpinned sampler called from the same thread gets its loop threads back on every CPU."""
    roots, times = small_graph.src[500:1100], small_graph.ts[500:1100]
    home = os.sched_getaffinity(0)
    pinned = TemporalSampler(small_graph, [5, 5], "uniform", threads=2, pin_threads=True)
    pinned.sample(roots, times)
    if pinned.placement.cpus is None:
        pytest.skip(pinned.placement.reason)
    assert os.sched_getaffinity(0) == home
    seen = []
    child = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
    child.start()
    child.join()
    assert seen == [home]
    held = {tid for tid, mask in _masks().items() if mask != home}
    assert held and threading.get_native_id() not in held  # the loop's other thread stays pinned
    TemporalSampler(small_graph, [5, 5], "uniform", threads=2).sample(roots, times)
    assert all(_masks().get(tid, home) == home for tid in held)


def test_usable_cpus_counts_the_affinity_mask_else_every_cpu(monkeypatch):
    import os

    assert usable_cpus() == len(os.sched_getaffinity(0))
    monkeypatch.delattr(os, "sched_getaffinity")  # not on Linux
    monkeypatch.setattr(os, "cpu_count", lambda: 7)
    assert usable_cpus() == 7
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # unknown
    assert usable_cpus() == 1
