"""The SlimCache benchmark's stream definitions: TGL's hops, the negative rules, the NumPy cross-check."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from fastopt.data import TemporalGraph
from fastopt.errors import FastOptError

from bench_scripts import load

bench = load("slimcache")
sim = load("slimcache_sim")


def small_graph(seed: int = 0, n: int = 300, nodes: int = 25) -> TemporalGraph:
    rng = np.random.default_rng(seed)
    src = rng.integers(0, nodes, n)
    dst = (src + 1 + rng.integers(0, nodes - 1, n)) % nodes
    return TemporalGraph(src, dst, np.sort(rng.integers(0, 120, n)).astype(float), nodes)


def recent(graph: TemporalGraph, v: int, t: float, k: int) -> list:
    """Brute force: the k latest events touching v strictly before t, newest first (later id first)."""
    cands = [(graph.ts[e], e, int(graph.dst[e] if graph.src[e] == v else graph.src[e]))
             for e in range(graph.num_events) if v in (graph.src[e], graph.dst[e]) and graph.ts[e] < t]
    return sorted(cands, reverse=True)[:k]


def test_tgl_hops_sample_around_neighbors_and_roots():
    graph = small_graph()
    roots = np.array([3, 7, 7, 11, 0], dtype=np.int64)
    times = np.array([60.0, 80.0, 119.0, 5.0, 100.0])
    eids, nodes = bench.TglHops(graph, [3, 2], "recent", seed=0).sample(roots, times)
    hop1 = [recent(graph, int(v), t, 3) for v, t in zip(roots, times)]
    want = [e for row in hop1 for _, e, _ in row]
    # Hop 2's destinations: every valid hop-1 neighbor at its edge's time, then the roots again.
    dst2 = [(u, t) for row in hop1 for t, _, u in row] + list(zip(roots.tolist(), times.tolist()))
    hop2 = [recent(graph, int(v), t, 2) for v, t in dst2]
    want += [e for row in hop2 for _, e, _ in row]
    assert Counter(eids.tolist()) == Counter(want)
    assert (eids >= 0).all()
    want_nodes = roots.tolist() + [u for row in hop1 for *_, u in row] + [u for row in hop2 for *_, u in row]
    assert Counter(nodes.tolist()) == Counter(want_nodes)


def requested(epoch) -> list:
    """Valid edge rows each batch reads, duplicates included (the naive path's rows)."""
    return [int((u.values[u.inverse.long()] >= 0).sum()) for u in (b["edge_feat"] for b in epoch.batches)]


def test_layouts_agree_on_one_layer():
    graph = small_graph(1)
    tgl, fast = (bench.sample_epoch(graph, "tgn", 20, 0, seed=0, layout=lay) for lay in ("tgl", "fastopt"))
    for a, b in zip(tgl.batches, fast.batches, strict=True):
        for table in ("edge_feat", "memory"):
            assert torch.equal(a[table].values[a[table].values >= 0], b[table].values[b[table].values >= 0])
    # Padded slots are never counted as reads (of edge -1, or of node 0).
    assert requested(tgl) == requested(fast)
    assert all(int((b["memory"].values[b["memory"].inverse.long()] >= 0).sum()) == 20 * 3 + r
               for b, r in zip(fast.batches[:-1], requested(fast)))


def test_tgl_layout_adds_one_more_sample_of_the_roots(monkeypatch):
    graph = small_graph(1)
    monkeypatch.setitem(bench.STREAMS, "two_recent", ([4, 3], "recent"))
    tgl, fast = (bench.sample_epoch(graph, "two_recent", 20, 0, seed=0, layout=lay)
                 for lay in ("tgl", "fastopt"))
    # The same roots (same negatives' draws); hop 2 of TGL also samples 3 neighbors of every root.
    rng, pool = np.random.default_rng(0), bench.negative_pool(graph, "all")
    again = bench.NumpySampler(graph, fanouts=[3], strategy="recent")
    extra = []
    for start in range(0, graph.train_end, 20):
        stop = min(start + 20, graph.train_end)
        roots = np.concatenate([graph.src[start:stop], graph.dst[start:stop], rng.choice(pool, stop - start)])
        extra.append(int(again.sample(roots, np.tile(graph.ts[start:stop], 3)).blocks[0].mask.sum()))
    assert np.array_equal(np.array(requested(tgl)) - np.array(requested(fast)), extra)
    assert sum(extra) > 0


def test_negative_rules():
    graph = small_graph(2)
    assert np.array_equal(bench.negative_pool(graph, "all"), np.arange(graph.num_nodes))
    assert np.array_equal(bench.negative_pool(graph, "destinations"), np.unique(graph.dst))
    with pytest.raises(FastOptError, match="'sources'.*--negatives all"):
        bench.negative_pool(graph, "sources")
    with pytest.raises(FastOptError, match="'dgl'.*--layout tgl"):
        bench.sample_epoch(graph, "tgn", 20, 0, seed=0, layout="dgl")


def test_simulation_matches_the_bench_on_a_deterministic_stream():
    """Two hops of recent sampling in TGL's layout: the NumPy simulation reads the bench's rows."""
    graph = small_graph(3, nodes=12)
    events = sim.Events(graph.src, graph.dst, graph.ts)
    hops = bench.TglHops(graph, [3, 3], "recent", seed=0)
    for start in range(0, graph.train_end, 25):
        stop = min(start + 25, graph.train_end)
        roots = np.concatenate([graph.src[start:stop], graph.dst[start:stop]])
        at = np.tile(graph.ts[start:stop], 2)
        want, _ = hops.sample(roots, at)
        got, nodes, t = [], roots, at
        for k in (3, 3):
            e, nbr, nbr_t = events.hop(nodes, t, k, "recent", "tgl", None)
            got.append(e)
            nodes, t = np.concatenate([nbr, nodes]), np.concatenate([nbr_t, t])
        assert Counter(np.concatenate(got).tolist()) == Counter(want.tolist())


def test_simulation_uniform_rules():
    graph = small_graph(4, nodes=12)
    events = sim.Events(graph.src, graph.dst, graph.ts)
    nodes = np.arange(12)
    at = np.full(12, 30.0)
    avail = np.array([len(recent(graph, v, 30.0, 10 ** 6)) for v in nodes])
    k = 4
    rng = np.random.default_rng(0)
    e, _, _ = events.hop(nodes, at, k, "uniform", "tgl", rng)
    assert e.size == np.minimum(avail, k).sum()  # all candidates once when there are at most k
    e, _, _ = events.hop(nodes, at, k, "uniform", "always", rng)
    assert e.size == k * (avail > 0).sum()  # k draws whenever there is a candidate


def test_simulated_caches_on_a_handmade_stream():
    batches = [np.array(b) for b in ([0, 1, 2], [0, 3], [1, 2], [0, 4], [3])]
    # Belady, 2 rows: 5 first reads, and either 3 or 0 must be re-read, and one of 1 and 2.
    assert sim.belady_misses(batches, 2, 5) == 7
    assert sim.lru_misses(batches, 2, 5) == 9  # keeps {0,1} {0,3} {1,2} {0,4}
    assert sim.static_misses(batches, 2) == 5  # hot {0, 1} from the first two batches
    assert sim.belady_misses(batches, 5, 5) == 5 == sim.lru_misses(batches, 5, 5)
