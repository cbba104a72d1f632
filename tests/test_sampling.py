"""The NumPy reference sampler against a brute-force definition of temporal neighborhoods."""

import numpy as np
import pytest

from fastopt.data import TemporalGraph
from fastopt.errors import SamplerError
from fastopt.sampling import NumpySampler


def random_graph(seed, events=300, nodes=25):
    rng = np.random.default_rng(seed)
    ts = np.sort(rng.integers(0, 40, events)).astype(np.float64)  # many duplicate timestamps
    src = rng.integers(0, nodes - 3, events)  # the last nodes stay isolated
    dst = rng.integers(0, nodes - 3, events)  # self loops occur
    return TemporalGraph(src, dst, ts, nodes)


def brute_candidates(g, node, t, undirected=True):
    """(time, eid, neighbor) of every event touching ``node`` strictly before ``t``."""
    out = []
    for e in range(g.num_events):
        if g.ts[e] >= t:
            continue
        if g.src[e] == node:
            out.append((g.ts[e], e, g.dst[e]))
        if undirected and g.dst[e] == node:
            out.append((g.ts[e], e, g.src[e]))
    return sorted(out)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("k", [1, 3, 10])
def test_recent_is_exactly_the_k_latest(seed, k):
    g = random_graph(seed)
    rng = np.random.default_rng(seed + 100)
    roots = rng.integers(0, g.num_nodes, 60)
    times = rng.integers(0, 45, 60).astype(np.float64)
    block = NumpySampler(g, [k], "recent").sample(roots, times).blocks[0]
    for i, (v, t) in enumerate(zip(roots, times)):
        expected = brute_candidates(g, v, t)[::-1][:k]  # newest first, later edge id first on ties
        cnt = len(expected)
        assert block.mask[i].sum().item() == cnt and block.mask[i, :cnt].all()
        assert block.indptr[i + 1] - block.indptr[i] == cnt
        # the same multiset of (time, eid) pairs; a self loop appears twice with one eid
        got = sorted(zip(block.nbr_times[i, :cnt].tolist(), block.nbr_eids[i, :cnt].tolist(),
                         block.nbr_nodes[i, :cnt].tolist()))
        assert got == sorted((float(a), int(b), int(c)) for a, b, c in expected)
        assert (block.dt[i, :cnt].numpy() == (t - block.nbr_times[i, :cnt].numpy())).all()
        assert (block.nbr_eids[i, cnt:] == -1).all() and (block.dt[i, cnt:] == 0).all()


def test_uniform_never_leaks_and_takes_all_when_few():
    g = random_graph(2)
    rng = np.random.default_rng(7)
    roots = rng.integers(0, g.num_nodes, 200)
    times = rng.integers(0, 45, 200).astype(np.float64)
    batch = NumpySampler(g, [5, 4], "uniform", seed=1).sample(roots, times)
    b0 = batch.blocks[0]
    for i, (v, t) in enumerate(zip(roots, times)):
        cands = brute_candidates(g, v, t)
        cnt = int(b0.mask[i].sum())
        assert cnt == min(len(cands), 5)
        eids = b0.nbr_eids[i, :cnt].tolist()
        assert set(eids) <= {e for _, e, _ in cands}
        if len(cands) <= 5:
            assert sorted(eids) == sorted(e for _, e, _ in cands)
    # no leakage in any layer: every valid neighbor is strictly older than its destination
    for block in batch.blocks:
        m = block.mask
        assert (block.nbr_times[m] < block.dst_times.unsqueeze(1).expand_as(m)[m]).all()


def test_multi_hop_destinations_are_previous_neighbors():
    g = random_graph(3)
    roots = np.array([0, 1, 2, 3])
    times = np.full(4, 39.0)
    batch = NumpySampler(g, [3, 2], "recent").sample(roots, times)
    b0, b1 = batch.blocks
    assert b1.num_dst == 12
    assert (b1.dst_nodes == b0.nbr_nodes.reshape(-1)).all()
    assert (b1.dst_times == b0.nbr_times.reshape(-1)).all()
    # padded destinations yield fully masked rows
    assert not b1.mask[~b0.mask.reshape(-1)].any()
    u = batch.unique_nodes
    full = np.concatenate([roots, b0.nbr_nodes.reshape(-1).numpy(), b1.nbr_nodes.reshape(-1).numpy()])
    assert (u.values[u.inverse].numpy() == full).all()


def test_uniform_is_reproducible_per_epoch():
    g = random_graph(4)
    s = NumpySampler(g, [3], "uniform", seed=5)
    roots, times = np.arange(10), np.full(10, 40.0)
    s.reset(0)
    a = s.sample(roots, times).blocks[0].nbr_eids
    s.reset(0)
    b = s.sample(roots, times).blocks[0].nbr_eids
    assert (a == b).all()


@pytest.mark.parametrize("kwargs,roots,times,fragment", [
    ({}, [0, 99], [1.0, 1.0], "outside"),
    ({}, [0, 1], [1.0, np.nan], "not finite"),
    ({}, [0, 1], [1.0], "one length"),
    ({}, [0.5], [1.0], "integer"),
    ({"fanouts": [0]}, [0], [1.0], "positive integer"),
    ({"strategy": "latest"}, [0], [1.0], "unknown strategy"),
])
def test_bad_input(kwargs, roots, times, fragment):
    g = random_graph(0)
    with pytest.raises(SamplerError, match=fragment):
        NumpySampler(g, **kwargs).sample(np.array(roots), np.array(times))
