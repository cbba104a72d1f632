"""Property-based fuzzing of the sampler, the loaders and SlimCache with hostile input: ids at and
beyond 2**31, negative ids, NaN and unsorted times, one-event and empty graphs, huge fan-outs,
malformed files and random budgets. Every case ends in a FastOptError or in a result equal to the
NumPy oracle (or the direct gather a cache must reproduce): never a crash, a hang or garbage."""

from __future__ import annotations

import gzip
import math
import types

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fault_helpers import TALLY
from fastopt.config import CacheConfig
from fastopt.data import TemporalGraph, load_file
from fastopt.errors import DataError, FastOptError
from fastopt.runtime import CacheTable, SlimCache, TemporalSampler
from fastopt.sampling import NumpySampler

# Bounded for CI: a few hundred cases per target, no per-case deadline (2 shared cores).
FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BLOCK_FIELDS = ("dst_nodes", "dst_times", "nbr_nodes", "nbr_eids", "nbr_times", "dt", "mask", "indptr")
HOSTILE_IDS = [-1, -(2 ** 31), 2 ** 31, 2 ** 31 + 7, 2 ** 62, -(2 ** 63)]
HOSTILE_TIMES = [math.nan, math.inf, -math.inf]


def outcome(fn, *args):
    """``(result, None)`` or ``(None, error)`` for a FastOptError; anything else propagates."""
    try:
        return fn(*args), None
    except FastOptError as exc:
        return None, exc


# ------------------------------------------------------------------------- TemporalSampler
@st.composite
def event_streams(draw):
    """Graphs of one to 40 events over 1 to 20 nodes, tied times, self loops, isolated nodes."""
    n = draw(st.integers(1, 20))
    m = draw(st.integers(1, 40))
    ids = st.lists(st.integers(0, n - 1), min_size=m, max_size=m)
    ts = sorted(draw(st.lists(st.integers(0, 6) | st.floats(0, 6, allow_nan=False), min_size=m, max_size=m)))
    return TemporalGraph(np.array(draw(ids)), np.array(draw(ids)), np.array(ts, dtype=np.float64), n)


@st.composite
def hostile_queries(draw, num_nodes):
    """Roots and times in any order, in several dtypes, sometimes with one hostile id or time."""
    r = draw(st.integers(0, 25))
    roots = draw(st.lists(st.integers(0, num_nodes - 1), min_size=r, max_size=r))
    times = draw(st.lists(st.floats(-1, 8, allow_nan=False), min_size=r, max_size=r))
    if r and draw(st.booleans()):
        roots[draw(st.integers(0, r - 1))] = draw(st.sampled_from(HOSTILE_IDS + [num_nodes]))
    if r and draw(st.integers(0, 4)) == 0:
        times[draw(st.integers(0, r - 1))] = draw(st.sampled_from(HOSTILE_TIMES))
    dtype = draw(st.sampled_from(["int64", "int32", "float64", "tensor"]))
    if dtype == "tensor":
        return torch.tensor(roots, dtype=torch.int64), torch.tensor(times, dtype=torch.float64)
    fits = all(np.iinfo(np.int32).min <= x <= np.iinfo(np.int32).max for x in roots)
    if dtype == "int32" and not fits:
        dtype = "int64"
    return np.array(roots, dtype=dtype), np.array(times)


def fanout_lists():
    """One to three layers whose padded outputs stay small, and single huge fan-outs."""
    layered = st.lists(st.integers(1, 12), min_size=1, max_size=3)
    return layered | st.sampled_from([[300], [4096], [1, 2000]])


def check_uniform(fast_batch, ref: NumpySampler) -> None:
    """Uniform draws differ from the oracle's generator; what must agree: counts, candidates."""
    valid = None
    for block in fast_batch.blocks:
        start, end = ref.candidates(block.dst_nodes.numpy(), block.dst_times.numpy())
        live = np.ones(block.num_dst, bool) if valid is None else valid
        avail = np.where(live, end - start, 0)
        counts = block.counts().numpy()
        assert np.array_equal(counts, np.minimum(avail, block.fanout))
        for i in np.flatnonzero(counts):
            drawn = block.nbr_eids[i, : counts[i]].numpy()
            assert np.isin(drawn, ref.eid[start[i]:end[i]]).all()
            assert (block.nbr_times[i, : counts[i]].numpy() < block.dst_times[i].item()).all()
        valid = block.mask.numpy().reshape(-1)


@FUZZ
@given(data=st.data(), graph=event_streams(), fanouts=fanout_lists(),
       strategy=st.sampled_from(["recent", "uniform"]), undirected=st.booleans(),
       threads=st.sampled_from([1, 2]), limit=st.sampled_from([None, 0, 1]))
def test_sampler_equals_the_oracle_or_refuses(data, graph, fanouts, strategy, undirected, threads, limit):
    roots, times = data.draw(hostile_queries(graph.num_nodes))
    fast = TemporalSampler(graph, fanouts, strategy, threads=threads, undirected=undirected,
                           limit=limit, pin_threads=False)
    ref = NumpySampler(graph, fanouts, strategy, undirected=undirected, limit=limit)
    TALLY["fuzzed"] += 1
    a, a_err = outcome(fast.sample, roots, times)
    b, b_err = outcome(ref.sample, roots, times)
    assert (a_err is None) == (b_err is None), (a_err, b_err)
    if a_err is not None:
        TALLY["clean_errors"] += 1
        return
    if strategy == "recent":
        for x, y in zip(a.blocks, b.blocks, strict=True):
            for name in BLOCK_FIELDS:
                assert torch.equal(getattr(x, name), getattr(y, name)), name
    else:
        check_uniform(a, ref)
    TALLY["oracle_equal"] += 1


@FUZZ
@given(n=st.integers(1, 12), num_nodes=st.sampled_from([0, 5, 2 ** 40, -3]),
       flaw=st.sampled_from(["nan", "unsorted", "negative", "beyond", "none"]), data=st.data())
def test_a_hostile_graph_is_refused_by_both_samplers(n, num_nodes, flaw, data):
    """Graphs that skip TemporalGraph's checks (any object with src/dst/ts/num_nodes)."""
    hi = max(min(num_nodes, 5), 1)
    src = np.array(data.draw(st.lists(st.integers(0, hi - 1), min_size=n, max_size=n)))
    dst = np.array(data.draw(st.lists(st.integers(0, hi - 1), min_size=n, max_size=n)))
    ts = np.sort(np.array(data.draw(st.lists(st.floats(0, 9, allow_nan=False), min_size=n, max_size=n))))
    if flaw == "nan":
        ts[n // 2] = np.nan
    elif flaw == "unsorted" and n > 1 and ts[0] < ts[-1]:
        ts = ts[::-1].copy()
    elif flaw == "negative":
        src[0] = -(2 ** 31)
    elif flaw == "beyond":
        dst[-1] = 2 ** 31 + num_nodes
    graph = types.SimpleNamespace(src=src, dst=dst, ts=ts, num_nodes=num_nodes)
    TALLY["fuzzed"] += 1
    made = [outcome(lambda: TemporalSampler(graph, [3], "recent", threads=1, pin_threads=False)),
            outcome(lambda: NumpySampler(graph, [3], "recent"))]
    errors = [err for _, err in made]
    assert (errors[0] is None) == (errors[1] is None), errors
    if errors[0] is not None:
        TALLY["clean_errors"] += 1
        return
    roots = np.arange(min(num_nodes, 5))
    times = np.full(roots.shape, 10.0)
    for x, y in zip(made[0][0].sample(roots, times).blocks, made[1][0].sample(roots, times).blocks):
        for name in BLOCK_FIELDS:
            assert torch.equal(getattr(x, name), getattr(y, name)), name
    TALLY["oracle_equal"] += 1


def test_absurd_fanouts_are_refused_before_anything_is_allocated():
    graph = TemporalGraph(np.array([0, 1]), np.array([1, 0]), np.array([1.0, 2.0]), 2)
    for fanouts in ([2 ** 40], [2 ** 62], [2 ** 20, 2 ** 20]):
        for sampler in (TemporalSampler(graph, fanouts, threads=1), NumpySampler(graph, fanouts)):
            TALLY["fuzzed"] += 1
            with pytest.raises(FastOptError, match="sampled slots.*above the .* bytes of host memory"):
                sampler.sample(np.array([0, 1]), np.array([3.0, 3.0]))
            TALLY["clean_errors"] += 1


# ------------------------------------------------------------------------- loaders
def expected_graph(src, dst, ts, bipartite) -> tuple:
    """The oracle of every text loader: dense ids (users before items when bipartite), events
    sorted stably by time."""
    src, dst, ts = np.array(src, np.int64), np.array(dst, np.int64), np.array(ts, np.float64)
    if bipartite:
        users, s = np.unique(src, return_inverse=True)
        _, d = np.unique(dst, return_inverse=True)
        d = d + users.size
    else:
        _, inv = np.unique(np.r_[src, dst], return_inverse=True)
        s, d = inv[: src.size], inv[src.size:]
    order = np.argsort(ts, kind="stable")
    return s[order], d[order], ts[order]


@st.composite
def event_files(draw):
    """A table of events written as JODIE CSV, TGL CSV or a SNAP edge list, maybe gzipped."""
    m = draw(st.integers(1, 25))
    ids = st.integers(-(2 ** 40), 2 ** 40) | st.integers(0, 6) | st.sampled_from(HOSTILE_IDS[:4])
    src = draw(st.lists(ids, min_size=m, max_size=m))
    dst = draw(st.lists(ids, min_size=m, max_size=m))
    ts = draw(st.lists(st.floats(-1e9, 1e9, allow_nan=False, allow_infinity=False), min_size=m, max_size=m))
    fmt = draw(st.sampled_from(["jodie", "tgl", "snap"]))
    if fmt == "snap":  # headerless: the time column is found as the one that never decreases
        ts = sorted(ts)
        text = "".join(f"{s} {d} {t!r}\n" for s, d, t in zip(src, dst, ts))
    elif fmt == "jodie":
        text = "u,i,ts,label\n" + "".join(f"{s},{d},{t!r},0\n" for s, d, t in zip(src, dst, ts))
    else:
        text = ",src,dst,time,ext_roll\n" + "".join(f"{j},{s},{d},{t!r},0\n"
                                                    for j, (s, d, t) in enumerate(zip(src, dst, ts)))
    raw = text.encode()
    return (src, dst, ts, fmt == "jodie"), gzip.compress(raw) if draw(st.booleans()) else raw


def mutate(raw: bytes, data) -> bytes:
    kind = data.draw(st.sampled_from(["truncate", "flip", "nan", "splice", "binary"]))
    if kind == "truncate":
        return raw[: data.draw(st.integers(0, len(raw)))]
    if kind == "flip":
        i = data.draw(st.integers(0, len(raw) - 1))
        return raw[:i] + bytes([raw[i] ^ data.draw(st.integers(1, 255))]) + raw[i + 1:]
    if kind == "nan":
        return raw.replace(b",0\n", b",nan\n", 1).replace(b" ", b" nan ", 1)
    if kind == "splice":
        return raw + data.draw(st.sampled_from([b"1,2\n", b"x y z\n", b"1 2 3 4 5\n", b"\x00\xff"]))
    return data.draw(st.binary(max_size=64))


@FUZZ
@given(data=st.data(), case=event_files(), damaged=st.booleans())
def test_loaders_equal_the_oracle_or_raise_data_error(tmp_path_factory, data, case, damaged):
    (src, dst, ts, bipartite), raw = case
    if damaged:
        raw = mutate(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw, data)
    path = tmp_path_factory.mktemp("fuzz-files") / "events.txt"
    path.write_bytes(raw)
    TALLY["fuzzed"] += 1
    graph, err = outcome(load_file, path, False)
    if err is not None:
        assert isinstance(err, DataError)
        TALLY["clean_errors"] += 1
        return
    assert isinstance(graph, TemporalGraph)  # its own checks held: ids dense, times sorted, finite
    if not damaged:
        assert max(map(abs, src + dst)) < 2 ** 53
        s, d, t = expected_graph(src, dst, ts, bipartite)
        assert np.array_equal(graph.src, s) and np.array_equal(graph.dst, d) and np.array_equal(graph.ts, t)
        TALLY["oracle_equal"] += 1


@FUZZ
@given(data=st.data())
def test_hostile_npz_files_raise_data_error_or_load(tmp_path_factory, data):
    arrays = {}
    for key in data.draw(st.sets(st.sampled_from(["src", "dst", "ts", "num_nodes", "edge_feat", "labels",
                                                 "bipartite"]), min_size=1)):
        n = data.draw(st.integers(0, 6))
        kind = data.draw(st.sampled_from(["int", "float", "nan", "huge", "2d", "str", "scalar"]))
        arrays[key] = {"int": np.arange(n), "float": np.linspace(0, 1, n), "nan": np.full(n, np.nan),
                       "huge": np.full(n, 2 ** 62), "2d": np.zeros((n, 2)), "str": np.array(["x"] * n),
                       "scalar": np.int64(data.draw(st.sampled_from([-1, 0, 3, 2 ** 40])))}[kind]
    path = tmp_path_factory.mktemp("fuzz-npz") / "g.npz"
    np.savez(path, **arrays)
    TALLY["fuzzed"] += 1
    graph, err = outcome(load_file, path, False)
    if err is not None:
        assert isinstance(err, DataError)
        TALLY["clean_errors"] += 1
    else:
        assert isinstance(graph, TemporalGraph)


# ------------------------------------------------------------------------- SlimCache
def direct_gather(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """What a lookup must return: rows by id, zeros for padding (-1)."""
    rows = table[ids.clamp(min=0)]
    keep = (ids >= 0).reshape(ids.shape + (1,) * (rows.dim() - ids.dim()))
    return torch.where(keep, rows, torch.zeros((), dtype=table.dtype))


@FUZZ
@given(data=st.data(), rows=st.integers(1, 40), width=st.sampled_from([None, 1, 3]),
       writable=st.booleans(), policy=st.sampled_from(["static", "lru", "future", "auto"]),
       budget=st.sampled_from([None, 0, 1, 64, 10 ** 12, -5]), fraction=st.floats(0, 1))
def test_slimcache_serves_the_direct_gather_or_refuses(data, rows, width, writable, policy, budget, fraction):
    shape = (rows,) if width is None else (rows, width)
    mirror = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    batches = []
    for _ in range(data.draw(st.integers(1, 5))):
        ids = data.draw(st.lists(st.integers(-1, rows - 1), min_size=0, max_size=12))
        if ids and data.draw(st.integers(0, 5)) == 0:
            ids[0] = data.draw(st.sampled_from(HOSTILE_IDS + [rows, -2]))
        batches.append(torch.tensor(ids, dtype=torch.int64))
    TALLY["fuzzed"] += 1
    config = CacheConfig(budget_fraction=fraction, policy=policy)
    cache, err = outcome(lambda: SlimCache({"t": CacheTable(mirror.clone(), writable=writable)},
                                           config=config, budget_bytes=budget))
    if err is not None:
        TALLY["clean_errors"] += 1
        return
    in_range = [b for b in batches if not b.numel() or (b.min() >= -1 and b.max() < rows)]
    _, err = outcome(cache.plan, [{"t": b} for b in in_range])
    assert err is None, err
    for ids in batches:
        served, err = outcome(cache.lookup, "t", ids)
        if ids.numel() and (ids.min() < -1 or ids.max() >= rows):
            assert err is not None and str(ids.min().item() if ids.min() < -1 else ids.max().item()) in str(err)
            TALLY["clean_errors"] += 1
            continue
        assert err is None, err
        assert torch.equal(served.expand(), direct_gather(mirror, ids))
        TALLY["oracle_equal"] += 1
        if writable:
            changed = torch.unique(ids[ids >= 0])
            values = torch.randn((changed.numel(),) + shape[1:])
            cache.write("t", changed, values)
            mirror[changed] = values
    if writable:
        cache.flush()
        assert torch.equal(cache.host("t").reshape(shape), mirror)
