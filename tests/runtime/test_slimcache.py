"""SlimCache on the CPU: served rows, dedup, counters, write-back, policies against the optimum."""

from __future__ import annotations

import itertools
import warnings
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastopt.config import CacheConfig
from fastopt.errors import CacheError, FastOptError
from fastopt.runtime import CacheTable, SlimCache, Unique, belady_optimum
from fastopt.runtime.staging import HostGatherer
from fastopt.runtime.staging import pack_tensors, unpack_tensors
from fastopt.runtime.table_cache import admitted_first

POLICIES = ["static", "lru", "future", "auto"]
# Fractions of the tables' bytes: nothing, a few rows, part, everything.
BUDGETS = {"zero": 0.0, "tiny": 0.01, "partial": 0.2, "all": 1.0}

EDGES, NODES, FEAT, MEM = 400, 60, 6, 5


@pytest.fixture(params=["scan", "ranked"])
def eviction(request, monkeypatch):
    """Both ways the directory finds eviction candidates: ranking every resident (small caches)
    and the incremental ranking (RankedSlots) that large caches keep."""
    from fastopt.runtime import cache_policy

    if request.param == "ranked":
        monkeypatch.setattr(cache_policy, "_SCAN_SLOTS", -1)
    return request.param


def make_tables(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(EDGES, FEAT, generator=g), torch.randn(NODES, MEM, generator=g)


def make_stream(batches: int = 24, seed: int = 1, skew: bool = True):
    """Batches of padded ``[M, k]`` edge ids (-1 = padding) and node ids, with reuse across batches."""
    g = torch.Generator().manual_seed(seed)
    stream = []
    for b in range(batches):
        # A sliding window of recent edges plus a few old ones, like recent-neighbor sampling.
        lo = min(b * 12, EDGES - 80) if skew else 0
        eids = torch.randint(lo, lo + 80, (8, 5), generator=g)
        eids[torch.rand(8, 5, generator=g) < 0.2] = -1
        nodes = torch.randint(0, NODES, (30,), generator=g)
        stream.append({"edge": eids, "memory": nodes})
    return stream


def gather(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The direct gather the cache must reproduce: padding (-1) rows are zeros."""
    rows = table[ids.clamp(min=0)]
    return torch.where((ids >= 0).reshape(ids.shape + (1,) * (rows.dim() - ids.dim())), rows,
                       torch.zeros((), dtype=table.dtype))


def build(policy: str, budget: float, edge, mem, stream, **config):
    cfg = CacheConfig(budget_fraction=budget, policy=policy, **config)
    cache = SlimCache({"edge": edge, "memory": CacheTable(mem, writable=True)}, config=cfg,
                      record=True)
    cache.plan(stream)
    return cache


def check_counters(cache: SlimCache, name: str) -> None:
    c = cache.counters(name)
    assert c.hits + c.misses == c.lookups
    assert c.rows_h2d == c.misses + c.preloaded
    assert c.bytes_h2d == c.rows_h2d * c.row_bytes
    assert c.naive_bytes == c.requested * c.row_bytes
    assert c.dedup_bytes == c.lookups * c.row_bytes
    assert c.lookups <= c.requested
    assert c.evictions <= c.misses
    # The device map mirrors the directory, and every resident slot holds its row.
    slot_map = cache.slot_map(name)
    resident = torch.nonzero(slot_map >= 0).flatten()
    assert resident.numel() <= cache.capacity(name)
    slots = slot_map[resident].long()
    assert torch.unique(slots).numel() == slots.numel()
    if name == "edge":
        assert torch.equal(cache.slots(name)[slots], cache.host(name)[resident])


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("policy", POLICIES)
def test_rows_equal_direct_gather_and_counters_add_up(policy, budget, eviction):
    edge, mem = make_tables()
    stream = make_stream()
    cache = build(policy, BUDGETS[budget], edge, mem, stream)
    requested = 0
    for batch in stream:
        eids = batch["edge"]
        rows = cache.lookup("edge", eids)
        assert torch.equal(rows.expand(), gather(edge, eids))
        assert torch.equal(rows.ids, torch.unique(eids))
        assert rows.index.shape == eids.shape
        nodes = batch["memory"]
        mrows = cache.lookup("memory", unique=Unique.of(nodes))
        assert torch.equal(mrows.expand(), mem[nodes])
        requested += int((eids >= 0).sum())
    for name in ("edge", "memory"):
        check_counters(cache, name)
    c = cache.counters("edge")
    assert c.requested == requested
    assert c.batches == len(stream)
    if budget == "zero":
        assert c.hits == 0 and cache.capacity("edge") == 0
    if budget == "all" and policy != "static":
        # Everything fits: each row crosses once, and only rows that are used.
        distinct = torch.unique(torch.cat([b["edge"].flatten() for b in stream]))
        assert c.rows_h2d == int((distinct >= 0).sum())
    total = cache.counters()
    assert total.bytes_h2d == c.bytes_h2d + cache.counters("memory").bytes_h2d


def test_dedup_reconstructs_the_batch_and_moves_only_unique_rows():
    edge, mem = make_tables()
    eids = torch.tensor([[5, 5, 7, -1], [7, 9, 5, -1]])
    cache = SlimCache({"edge": edge, "memory": mem}, config=CacheConfig(budget_fraction=0.0, policy="lru"))
    rows = cache.lookup("edge", eids)
    assert torch.equal(rows.ids, torch.tensor([-1, 5, 7, 9]))
    assert rows.rows.shape == (4, FEAT)
    assert torch.equal(rows.rows[0], torch.zeros(FEAT))
    assert torch.equal(rows.ids[rows.index], eids)
    c = cache.counters("edge")
    assert (c.requested, c.lookups, c.rows_h2d) == (6, 3, 3)


def run_epoch_with_updates(cache: SlimCache, mem: torch.Tensor, stream, seed: int):
    """Read memory rows, update a random subset of them, as TGN does for a batch's roots."""
    reference = mem.clone()
    g = torch.Generator().manual_seed(seed)
    for batch in stream:
        nodes = batch["memory"]
        rows = cache.lookup("memory", nodes)
        assert torch.equal(rows.expand(), reference[nodes])
        cache.lookup("edge", batch["edge"])
        chosen = rows.ids[torch.rand(rows.ids.numel(), generator=g) < 0.5]
        extra = torch.randint(0, NODES, (3,), generator=g)  # rows not read this batch
        ids = torch.unique(torch.cat([chosen, extra]))
        new = reference[ids] * 0.75 + torch.randn(ids.numel(), MEM, generator=g)
        reference[ids] = new
        cache.write("memory", ids, new)
    cache.flush()
    return reference


@pytest.mark.parametrize("policy", POLICIES)
def test_write_back_equals_an_all_on_device_run_bit_for_bit(policy, eviction):
    edge, mem = make_tables()
    stream = make_stream(batches=30, seed=3)
    cache = build(policy, 0.15, edge, mem, stream, split="proportional")
    reference = run_epoch_with_updates(cache, mem, stream, seed=4)
    assert torch.equal(cache.host("memory"), reference)
    c = cache.counters("memory")
    assert c.writebacks > 0
    if policy != "static":
        assert c.evictions > 0
    assert not torch.equal(mem, reference)  # the cache works on its own copy
    # A second epoch continues from the written state.
    cache.plan(stream)
    reference = run_epoch_with_updates(cache, reference, stream, seed=5)
    assert torch.equal(cache.host("memory"), reference)


DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])]


def stall(device: str) -> None:
    """Queue a long kernel on the current stream: a copy that does not wait for it reads stale rows."""
    if device == "cuda" and hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(5_000_000)


def memory_update(rows: torch.Tensor) -> torch.Tensor:
    # Elementwise, so the cache's run and the plain tensor's compute identical bits on one device
    # (tanh itself differs in the last bits between the CPU and CUDA).
    return torch.tanh(rows * 0.9 + 0.1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ["static", "lru", "future"])
def test_write_back_on_the_cache_device_equals_a_plain_tensor_run_bit_for_bit(device, policy):
    """The training loop on the cache's device: edge lookups staged a batch ahead, node memory read,
    updated on the device (read rows and a few unread ones) and written, under a budget that
    forces dirty evictions and write-throughs; the reference applies the same updates to one plain
    tensor on the same device."""
    g = torch.Generator().manual_seed(7)
    edges, nodes, batches = 6000, 1500, 40
    edge, mem = torch.randn(edges, 48, generator=g), torch.randn(nodes, 24, generator=g)
    stream = []
    for b in range(batches):
        lo = (b * 120) % (edges - 600)
        eids = torch.randint(lo, lo + 600, (200, 4), generator=g)
        eids[torch.rand(200, 4, generator=g) < 0.1] = -1
        read = torch.randint(0, nodes, (400,), generator=g)
        written = torch.unique(torch.cat([read[:150], torch.randint(0, nodes, (20,), generator=g)]))
        stream.append((eids, read, written))
    cache = SlimCache({"edge": edge, "memory": CacheTable(mem, writable=True)}, device=device,
                      config=CacheConfig(policy=policy, budget_fraction=0.1, split="proportional"))
    cache.plan([{"edge": e, "memory": r} for e, r, _ in stream])
    edge_dev, reference = edge.to(device), mem.to(device, copy=True)
    pending = cache.stage("edge", stream[0][0])
    for i, (eids, read, written) in enumerate(stream):
        ahead = cache.stage("edge", stream[i + 1][0]) if i + 1 < batches else None
        stall(device)
        rows = cache.finish(pending)
        pending = ahead
        assert torch.equal(rows.expand(), gather(edge_dev, eids.to(device)))
        stall(device)
        mrows = cache.lookup("memory", read)
        assert mrows.rows.device.type == device
        assert torch.equal(mrows.expand(), reference[read.to(device)])
        dev_written = written.to(device)
        new = memory_update(reference[dev_written])
        stall(device)
        cache.write("memory", written, new)
        reference[dev_written] = new
    stall(device)
    cache.flush()
    assert torch.equal(cache.host("memory"), reference.cpu())
    c = cache.counters("memory")
    assert c.writebacks > 0 and c.writethroughs > 0
    if policy != "static":
        assert c.evictions > 0
    check_counters(cache, "memory")
    cache.close()


def recorded_streams(data_dir: Path):
    """Edge-id streams of a real dataset under recent (1x10) and uniform (2x10) sampling."""
    from fastopt.data import load_dataset
    from fastopt.sampling import NumpySampler

    graph = load_dataset(data_dir / "CollegeMsg.txt.gz")
    rng = np.random.default_rng(0)
    pool = graph.destination_pool()
    streams = {}
    for label, fanouts, strategy in (("recent", [10], "recent"), ("uniform", [10, 10], "uniform")):
        sampler = NumpySampler(graph, fanouts=fanouts, strategy=strategy, seed=0)
        batches = []
        for start in range(0, 12000, 200):
            src, dst, ts = (a[start:start + 200] for a in (graph.src, graph.dst, graph.ts))
            neg = rng.choice(pool, src.size)
            sampled = sampler.sample(np.concatenate([src, dst, neg]), np.concatenate([ts, ts, ts]))
            values = sampled.unique_eids.values
            batches.append(values[values >= 0])
        streams[label] = (batches, graph.num_events)
    return streams


@lru_cache(maxsize=1)
def cached_streams(data_dir: Path):
    return recorded_streams(data_dir)


@pytest.mark.parametrize("stream_name", ["recent", "uniform"])
def test_future_matches_the_optimum_and_never_loses_to_lru_on_recorded_streams(shared_data,
                                                                                stream_name):
    batches, rows = cached_streams(shared_data)[stream_name]
    table = torch.zeros(rows, 1)
    for capacity in (0, 50, 300, 1500):
        misses = {}
        for policy in ("lru", "future"):
            cache = SlimCache({"e": table}, config=CacheConfig(policy=policy),
                              budget_bytes=capacity * 4, record=True)
            cache.plan([{"e": b} for b in batches])
            for b in batches:
                cache.lookup("e", b)
            misses[policy] = cache.counters("e").misses
        optimum = belady_optimum(batches, capacity).misses
        assert misses["future"] == optimum
        assert misses["future"] <= misses["lru"]
    assert optimum < misses["lru"] or capacity == 0


def brute_force_optimum(stream, capacity: int) -> int:
    """Fewest misses over every schedule: after a batch keep any subset of residents + batch."""
    best = {frozenset(): 0}
    for batch in stream:
        batch = frozenset(batch)
        nxt = {}
        for state, cost in best.items():
            cost += len(batch - state)
            pool = sorted(state | batch)
            for size in range(min(capacity, len(pool)) + 1):
                for keep in itertools.combinations(pool, size):
                    key = frozenset(keep)
                    if nxt.get(key, 1 << 30) > cost:
                        nxt[key] = cost
        best = nxt
    return min(best.values())


def future_misses(stream, capacity: int, rows: int = 8) -> int:
    cache = SlimCache({"t": torch.arange(rows, dtype=torch.float32)},
                      config=CacheConfig(policy="future"), budget_bytes=capacity * 4)
    cache.plan([{"t": torch.tensor(b, dtype=torch.int64)} for b in stream])
    for b in stream:
        rows_out = cache.lookup("t", torch.tensor(b, dtype=torch.int64))
        assert torch.equal(rows_out.expand(), torch.tensor(b, dtype=torch.float32))
    return cache.counters("t").misses


HANDMADE = [
    # Classic Belady: keep 1 and 2, whose reuse comes first.
    ([[1], [2], [3], [1], [2], [3], [1]], 2),
    # A batch larger than the cache: some of its rows bypass.
    ([[0, 1, 2, 3], [0, 1], [2, 3], [0, 1, 2, 3]], 2),
    # LRU thrashes on a cyclic scan; the optimum keeps part of the cycle.
    ([[0], [1], [2], [3], [0], [1], [2], [3], [0], [1]], 3),
    ([[0, 1], [2, 3], [0, 2], [1, 3], [0, 1, 2], [3]], 1),
]


@pytest.mark.parametrize("stream,capacity", HANDMADE)
def test_future_equals_the_offline_optimum_on_handmade_streams(stream, capacity, eviction):
    optimum = brute_force_optimum(stream, capacity)
    assert belady_optimum(stream, capacity).misses == optimum
    assert future_misses(stream, capacity) == optimum


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True),
                min_size=1, max_size=6),
       st.integers(0, 3))
def test_future_equals_brute_force_on_random_small_streams(eviction, stream, capacity):
    optimum = brute_force_optimum(stream, capacity)
    assert belady_optimum(stream, capacity, num_rows=8).misses == optimum
    assert future_misses(stream, capacity) == optimum


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_future_with_a_short_lookahead_serves_correct_rows(eviction, window, seed):
    """Announcing only ``window`` batches ahead still serves exact rows, never beating the optimum."""
    edge, mem = make_tables(seed % 7)
    stream = make_stream(batches=12, seed=seed % 1000)
    cache = SlimCache({"edge": edge}, config=CacheConfig(policy="future", budget_fraction=0.1),
                      record=True)
    cache.begin_epoch()
    for b in stream[:window]:
        cache.announce({"edge": b["edge"]})
    for i, b in enumerate(stream):
        if i + window < len(stream):
            cache.announce({"edge": stream[i + window]["edge"]})
        assert torch.equal(cache.lookup("edge", b["edge"]).expand(), gather(edge, b["edge"]))
    check_counters(cache, "edge")
    assert cache.counters("edge").misses >= cache.optimum("edge").misses


def test_staged_lookups_are_double_buffered_and_finish_in_order():
    edge, mem = make_tables()
    stream = make_stream()
    cache = build("future", 0.2, edge, mem, stream)
    pending = [cache.stage("edge", stream[0]["edge"]), cache.stage("edge", stream[1]["edge"])]
    with pytest.raises(CacheError, match="limit is 2"):
        cache.stage("edge", stream[2]["edge"])
    with pytest.raises(CacheError, match="order"):
        cache.finish(pending[1])
    for i in range(2, len(stream)):
        done = cache.finish(pending.pop(0))
        assert torch.equal(done.expand(), gather(edge, stream[i - 2]["edge"]))
        pending.append(cache.stage("edge", stream[i]["edge"]))
    for i, p in zip((len(stream) - 2, len(stream) - 1), pending):
        assert torch.equal(cache.finish(p).expand(), gather(edge, stream[i]["edge"]))
    check_counters(cache, "edge")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_transfer_halves_the_bytes(dtype):
    edge, mem = make_tables()
    stream = make_stream()
    full = build("lru", 0.2, edge, mem, stream, split="proportional")
    half = build("lru", 0.2, edge, mem, stream, split="proportional", transfer_dtype=dtype)
    for batch in stream:
        rows = half.lookup("edge", batch["edge"]).expand()
        assert rows.dtype == getattr(torch, dtype)
        assert torch.equal(rows, gather(edge.to(rows.dtype), batch["edge"]))
        full.lookup("edge", batch["edge"])
        # Read-write state always travels at full precision.
        assert half.lookup("memory", batch["memory"]).rows.dtype == torch.float32
        full.lookup("memory", batch["memory"])
    assert half.capacity("edge") == full.capacity("edge")
    assert half.counters("edge").misses == full.counters("edge").misses
    assert half.counters("edge").bytes_h2d * 2 == full.counters("edge").bytes_h2d > 0


def test_greedy_split_gives_the_budget_to_the_most_hits_per_byte():
    edge, mem = make_tables()
    stream = make_stream()
    budget = NODES * MEM * 4  # exactly the memory table
    greedy = SlimCache({"edge": edge, "memory": mem}, config=CacheConfig(policy="static"),
                       budget_bytes=budget)
    greedy.plan(stream)
    proportional = SlimCache({"edge": edge, "memory": mem},
                             config=CacheConfig(policy="static", split="proportional"),
                             budget_bytes=budget)
    proportional.plan(stream)
    total = EDGES * FEAT * 4 + NODES * MEM * 4
    assert proportional.capacity("edge") == budget * EDGES * FEAT * 4 // total // (FEAT * 4)
    assert proportional.capacity("memory") == budget * NODES * MEM * 4 // total // (MEM * 4)
    # Memory rows are used in more batches and are smaller: they take most of the budget.
    assert greedy.capacity("memory") > 0.7 * NODES
    assert greedy.capacity("memory") > 4 * proportional.capacity("memory")
    assert (greedy.capacity("memory") * MEM + greedy.capacity("edge") * FEAT) * 4 <= budget


def test_auto_picks_the_policy_moving_fewest_rows_on_the_sample():
    edge, mem = make_tables()
    stream = make_stream()
    cache = build("auto", 0.1, edge, mem, stream)
    # With the epoch's batches announced, Belady's rule cannot move more rows than the others.
    assert cache.policy("edge") == "future"
    unplanned = SlimCache({"edge": edge}, config=CacheConfig(policy="auto", budget_fraction=0.1))
    unplanned.lookup("edge", stream[0]["edge"])
    assert unplanned.policy("edge") == "lru"


def test_bad_input_raises_cache_errors_that_name_value_and_limit():
    edge, mem = make_tables()
    with pytest.raises(CacheError, match=r"-5"):
        SlimCache({"edge": edge}, budget_bytes=-5)
    with pytest.raises(CacheError, match="policy.*'belady'"):
        SlimCache({"edge": edge}, config=CacheConfig(policy="belady"))
    with pytest.raises(CacheError, match=r"budget_fraction.*1\.5"):
        SlimCache({"edge": edge}, config=CacheConfig(budget_fraction=1.5))
    with pytest.raises(CacheError, match="width 6 but width 172"):
        SlimCache({"edge": CacheTable(edge, width=172)})
    with pytest.raises(CacheError, match="float64"):
        SlimCache({"edge": CacheTable(edge, dtype=torch.float64)})
    cache = SlimCache({"edge": edge, "memory": CacheTable(mem, writable=True)},
                      config=CacheConfig(policy="lru", budget_fraction=0.5))
    with pytest.raises(CacheError, match=f"{EDGES}"):
        cache.lookup("edge", torch.tensor([EDGES]))
    with pytest.raises(CacheError, match="-2"):
        cache.lookup("edge", torch.tensor([-2, 3]))
    with pytest.raises(CacheError, match="float64"):
        cache.write("memory", torch.tensor([1]), torch.zeros(1, MEM, dtype=torch.float64))
    with pytest.raises(CacheError, match=r"\(1, 3\)"):
        cache.write("memory", torch.tensor([1]), torch.zeros(1, 3))
    with pytest.raises(CacheError, match="static"):
        cache.write("edge", torch.tensor([1]), torch.zeros(1, FEAT))
    with pytest.raises(CacheError, match="repeat"):
        cache.write("memory", torch.tensor([1, 1]), torch.zeros(2, MEM))
    with pytest.raises(CacheError, match="read-write"):
        cache.stage("memory", torch.tensor([1]))
    with pytest.raises(CacheError, match="unknown cache table 'nope'"):
        cache.lookup("nope", torch.tensor([1]))
    future = SlimCache({"edge": edge}, config=CacheConfig(policy="future"))
    future.plan([{"edge": torch.tensor([1, 2])}])
    with pytest.raises(CacheError, match="announced"):
        future.lookup("edge", torch.tensor([3]))
    future.lookup("edge", torch.tensor([2, 1, 1]))
    with pytest.raises(CacheError, match="batch 1 is looked up but only 1"):
        future.lookup("edge", torch.tensor([1]))
    with pytest.raises(CacheError, match="plan"):
        SlimCache({"edge": edge}, config=CacheConfig(policy="static")).lookup("edge", torch.tensor([1]))
    assert issubclass(CacheError, FastOptError)


def mapped_table(table: torch.Tensor, folder: Path) -> torch.Tensor:
    """``table`` written to an ``.npy`` file and read back as a read-only memory map."""
    np.save(folder / "table.npy", table.numpy())
    arr = np.load(folder / "table.npy", mmap_mode="r")
    assert isinstance(arr, np.memmap)
    with warnings.catch_warnings():  # read-only mapping: the cache only reads it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("policy", ["lru", "future"])
def test_a_mapped_table_is_read_in_place_and_serves_the_rows_of_the_table_in_ram(tmp_path, policy,
                                                                                  dtype, device):
    """Misses and evictions over a mapped table give the rows of the same table in RAM bit for
    bit; on a GPU too, where a table in RAM gets a pinned copy and the mapped one none."""
    edge, _ = make_tables()
    stream = make_stream()
    mapped = mapped_table(edge, tmp_path)
    cfg = CacheConfig(budget_fraction=0.1, policy=policy, transfer_dtype=dtype, split="proportional")
    in_ram = SlimCache({"edge": edge}, device, config=cfg)
    on_file = SlimCache({"edge": CacheTable(mapped, mapped=True)}, device, config=cfg)
    for cache in (in_ram, on_file):
        cache.plan([{"edge": b["edge"]} for b in stream])
    for batch in stream:
        want, got = in_ram.lookup("edge", batch["edge"]), on_file.lookup("edge", batch["edge"])
        assert got.rows.dtype == want.rows.dtype == getattr(torch, dtype)
        assert torch.equal(got.rows, want.rows) and torch.equal(got.index, want.index)
    c, ref = on_file.counters("edge"), in_ram.counters("edge")
    assert c.to_dict() == {**ref.to_dict(), "staging_seconds": c.staging_seconds}
    assert c.misses > c.evictions > 0  # misses and evictions were both exercised
    # No copy of the table: the cache's host table is the mapping itself, in its own dtype.
    host = on_file.host("edge")
    assert host.data_ptr() == mapped.data_ptr() and host.dtype == torch.float32
    assert on_file.slots("edge").dtype == getattr(torch, dtype)


def test_gathers_convert_dtype_slice_by_slice_on_several_threads():
    table = torch.randn(10_000, 3)
    ids = torch.randint(0, 10_000, (9_000,))
    out = torch.empty(9_000, 3, dtype=torch.bfloat16)
    gatherer = HostGatherer(3)
    try:
        gatherer.gather(table, ids, out)
    finally:
        gatherer.close()
    assert torch.equal(out, table[ids].to(torch.bfloat16))


def test_a_mapped_table_must_be_static_and_contiguous():
    edge, _ = make_tables()
    with pytest.raises(CacheError, match="mapped=True and writable=True.*mapped=False"):
        SlimCache({"edge": CacheTable(edge, writable=True, mapped=True)})
    with pytest.raises(CacheError, match=r"not contiguous.*strided view"):
        SlimCache({"edge": CacheTable(edge.t(), mapped=True)})


@pytest.mark.parametrize("admit,m,order", [([], 4, [0, 1, 2, 3]), ([0, 1, 2], 3, [0, 1, 2]),
                                           ([1, 3], 5, [1, 3, 0, 2, 4]), ([], 0, [])])
def test_admitted_misses_are_staged_first_in_order(admit, m, order):
    got = admitted_first(np.array(admit, dtype=np.int64), m)
    assert got.tolist() == order


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [3, 0, 5, 1, 4, 2]])
def test_tensors_of_any_dtypes_travel_packed_in_one_byte_buffer(order):
    """Each tensor comes back with its dtype, shape and bits (a negative zero and -1 included),
    in the order given, whatever order the dtypes come in, starting 16 bytes apart at least; a
    non-contiguous one is packed whole."""
    tensors = [torch.tensor([3, -1, 2**40]), torch.empty(0, 3, dtype=torch.int64),
               torch.tensor([[-0.0, 1.5], [float("inf"), -2.0]]), torch.tensor([True, False, True]),
               torch.arange(12, dtype=torch.int32).reshape(3, 4)[:, 1:3], torch.arange(10.0, dtype=torch.float64)[::3]]
    tensors = [tensors[i] for i in order]
    packed, layout = pack_tensors(tensors, pinned=False)
    assert packed.dtype == torch.uint8
    assert packed.numel() == sum(-(-t.numel() * t.element_size() // 16) * 16 for t in tensors)
    copy = packed.clone()
    got = unpack_tensors(copy, layout)
    for t, g in zip(tensors, got, strict=True):
        assert g.dtype == t.dtype and g.shape == t.shape and g.is_contiguous()
        assert (g.data_ptr() - copy.data_ptr()) % 16 == 0
        assert torch.equal(g.reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8))


def test_a_static_hot_set_refresh_writes_dirty_rows_home_before_reusing_their_slots():
    """A read-write table under the static policy: when a split's next epoch installs its hot set
    over rows another split wrote, those rows reach the host first; nothing written is lost."""
    mem = torch.zeros(100, 4)
    cache = SlimCache({"m": CacheTable(mem, writable=True)}, config=CacheConfig(policy="static", budget_fraction=0.2))
    train, val = torch.arange(0, 20), torch.arange(50, 70)
    cache.plan([{"m": train}] * 3, split="train")
    cache.lookup("m", train)
    cache.write("m", train, torch.full((20, 4), 7.0))  # resident, dirty
    cache.begin_epoch("val")
    cache.lookup("m", val)
    cache.begin_epoch("val")  # val's hot set takes the train rows' slots
    assert bool((cache.slot_map("m")[val] >= 0).all()) and bool((cache.slot_map("m")[train] < 0).all())
    assert torch.equal(cache.lookup("m", train).expand(), torch.full((20, 4), 7.0))
    cache.flush()
    assert torch.equal(cache._tables["m"].host[:20], torch.full((20, 4), 7.0))


def static_cache(edge, budget: float, stream, reads: str, split: str = "train") -> SlimCache:
    from fastopt.codegen import cached_rows

    cache = SlimCache({"edge": edge}, read_rows=cached_rows,
                      config=CacheConfig(budget_fraction=budget, host_reads=reads, policy="static"))
    cache.plan(stream[:4], split=split)
    return cache


def test_a_new_epoch_is_refused_while_a_staged_static_lookup_is_pending():
    """A new epoch's hot set reuses slots a staged lookup still reads: begin_epoch refuses,
    naming the table and the fix, before changing anything; after finish() it goes ahead."""
    edge, _ = make_tables()
    stream = [b["edge"] for b in make_stream()]
    cache = static_cache(edge, 0.25, [{"edge": s} for s in stream], "staged")
    cache.begin_epoch("val")
    for ids in stream[:3]:
        cache.lookup("edge", unique=Unique.of(ids))
    pending = cache.stage("edge", unique=Unique.of(stream[3]))
    slot_map = cache.slot_map("edge").clone()
    with pytest.raises(CacheError, match=r"table 'edge' has 1 staged lookups.*finish them \(or drain\(\)\)"):
        cache.begin_epoch("train")
    assert torch.equal(cache.slot_map("edge"), slot_map)  # nothing changed
    rows = cache.finish(pending).expand()
    assert torch.equal(rows, gather(edge, stream[3]))
    cache.begin_epoch("train")


@pytest.mark.parametrize("reads", ["zero_copy", "staged"])
@pytest.mark.parametrize("budget", list(BUDGETS))
def test_a_static_hot_set_serves_the_table_and_is_refreshed_per_split(budget, reads):
    """Zero-copy reads and staged lookups of a static hot set: served rows equal the table's bit
    for bit in every epoch; the counters add up (a hit is a row the slots held); each split's
    next epoch starts with the rows its last epoch used most."""
    edge, _ = make_tables()
    stream = [b["edge"] for b in make_stream()]
    cache = static_cache(edge, BUDGETS[budget], [{"edge": s} for s in stream], reads)
    assert cache.zero_copy("edge") == (reads == "zero_copy") and cache.policy("edge") == "static"
    capacity = cache.capacity("edge")
    for epoch, split in enumerate(["train", "val", "train", "val"]):
        if epoch:
            cache.begin_epoch(split)
        batches = stream if split == "train" else stream[::-1][:10]
        uses, hits, lookups = torch.zeros(EDGES, dtype=torch.long), 0, 0
        before = cache.counters("edge").hits
        for ids in batches:
            unique = Unique.of(ids)
            resident = cache.slot_map("edge")[unique.values.clamp(min=0)] >= 0
            hits += int(resident[unique.values >= 0].sum())
            valid = unique.values[unique.values >= 0]
            lookups += valid.numel()
            uses[valid] += 1
            if reads == "zero_copy":
                rows = cache.serve("edge", unique.values.clamp(min=0), unique=unique)
            else:
                rows = cache.lookup("edge", unique=unique).rows
            assert torch.equal(rows[unique.values >= 0].view(torch.int32), edge[valid].view(torch.int32))
        assert cache.counters("edge").hits - before == hits
        if epoch >= 2 and capacity:  # the split's last epoch's most used rows are resident
            want = torch.sort(uses, descending=True, stable=True).indices[:min(capacity, int((uses > 0).sum()))]
            resident = cache.slot_map("edge")[want] >= 0
            assert bool(resident.all())
        slot_map = cache.slot_map("edge")
        held = torch.nonzero(slot_map >= 0).flatten()
        assert held.numel() <= capacity
        assert torch.equal(cache.slots("edge")[slot_map[held].long()], edge[held])
    c = cache.counters("edge")
    assert c.hits + c.misses == c.lookups and c.rows_h2d == c.misses + c.preloaded
    assert c.bytes_h2d == c.rows_h2d * c.row_bytes and c.lookups <= c.requested
    if capacity == 0:
        assert c.hits == 0 and c.preloaded == 0


@pytest.mark.parametrize("budget", ["tiny", "partial"])
def test_zero_copy_reads_through_a_hot_set_per_run_of_the_epoch(budget):
    """``begin_epoch(phases=P)``: the epoch's batches in P runs, each read through the hot set the
    same run of the last epoch used most (``cache.hot_set_phases``). Served rows equal the
    table's bit for bit; the hits counted on the host (ahead of the reads, from the planned hot
    sets) are exactly the rows the slots hold when each batch is read; on a stream whose rows
    move through the table, four runs hit more than one."""
    edge, _ = make_tables()
    stream = [b["edge"] for b in make_stream()]
    rates = {}
    for phases in (1, 4):
        cache = static_cache(edge, BUDGETS[budget], [{"edge": s} for s in stream], "zero_copy")
        capacity = cache.capacity("edge")
        for epoch in range(3):
            cache.begin_epoch("train", phases, len(stream))
            before, hits, lookups = cache.counters("edge").hits, 0, 0
            for i, ids in enumerate(stream):
                unique = Unique.of(ids)
                cache.count("edge", unique, i)  # counted first, as the staging threads do
                cache.enter("edge", i)
                valid = unique.values[unique.values >= 0]
                hits += int((cache.slot_map("edge")[valid] >= 0).sum())
                lookups += valid.numel()
                rows = cache.reader("edge")(unique.values.clamp(min=0))
                assert torch.equal(rows[unique.values >= 0].view(torch.int32), edge[valid].view(torch.int32))
                held = torch.nonzero(cache.slot_map("edge") >= 0).flatten()
                assert held.numel() <= capacity
                assert torch.equal(cache.slots("edge")[cache.slot_map("edge")[held].long()], edge[held])
            assert cache.counters("edge").hits - before == hits
        rates[phases] = hits / lookups  # the third epoch's: runs planned from the second's
        c = cache.counters("edge")
        assert c.hits + c.misses == c.lookups and c.rows_h2d == c.misses + c.preloaded
    assert rates[4] > 1.5 * rates[1] > 0, rates


def test_an_epoch_left_early_keeps_the_uses_of_the_splits_last_whole_epoch():
    """The next epoch's hot sets come from the split's last whole epoch: an epoch left after a
    few of its batches (a window of it) does not replace those uses; a split's first epoch, left
    early, gives what it counted (nothing better is known)."""
    edge, _ = make_tables()
    stream = [b["edge"] for b in make_stream()]
    cache = static_cache(edge, BUDGETS["partial"], [{"edge": s} for s in stream], "zero_copy")
    table = cache._table("edge")

    def epoch(batches: int) -> None:
        cache.begin_epoch("train", 1, len(stream))
        for i, ids in enumerate(stream[:batches]):
            cache.count("edge", Unique.of(ids), i)

    epoch(2)  # the first, left early
    first = table.seen.clone()
    epoch(len(stream))
    assert torch.equal(table.used["train"], first)
    whole = table.seen.clone()
    epoch(2)
    assert torch.equal(table.used["train"], whole)
    cache.begin_epoch("train", 1, len(stream))  # after the window: the whole epoch's uses still
    assert torch.equal(table.used["train"], whole) and not torch.equal(whole, first)


def test_a_count_waiting_for_a_later_runs_hot_set_holds_up_no_batch_of_the_current_run(monkeypatch):
    """A staging thread counting a batch of a run whose hot set is still being planned waits
    outside the cache's lock: the current run's counts and installs go on meanwhile."""
    import threading
    import time

    from fastopt.runtime import run_plans

    edge, _ = make_tables()
    stream = [b["edge"] for b in make_stream()]
    cache = static_cache(edge, BUDGETS["partial"], [{"edge": s} for s in stream], "zero_copy")
    cache.begin_epoch("train", 4, len(stream))
    for i, ids in enumerate(stream):
        cache.count("edge", Unique.of(ids), i)
    ranked, gate = run_plans.hot_set, threading.Event()

    def gated(counts, capacity):
        if threading.current_thread().name == "fastopt-hot-sets":
            gate.wait(timeout=10)
        return ranked(counts, capacity)

    monkeypatch.setattr(run_plans, "hot_set", gated)
    cache.begin_epoch("train", 4, len(stream))
    assert cache._tables["edge"].runs.count == 4
    last, done = len(stream) - 1, threading.Event()
    worker = threading.Thread(target=lambda: (cache.count("edge", Unique.of(stream[last]), last), done.set()))
    try:
        worker.start()
        time.sleep(0.2)  # the worker waits for the last run's plan by now
        cache.count("edge", Unique.of(stream[0]), 0)
        cache.enter("edge", 0)
        assert not done.is_set()  # still waiting, without holding up run 0's batch
    finally:
        gate.set()
    worker.join(timeout=30)
    assert done.is_set()


def test_hot_set_runs_need_a_batch_each_and_fall_back_to_one_hot_set():
    """More runs than batches, or a last epoch that used fewer rows than the capacity: one hot
    set for the epoch (its uses still counted per run where there are enough batches)."""
    edge, _ = make_tables()
    stream = [b["edge"] for b in make_stream(batches=3)]
    cache = static_cache(edge, 1.0, [{"edge": s} for s in stream], "zero_copy")
    t = cache._tables["edge"]
    cache.begin_epoch("train", 8, len(stream))
    assert t.phases == 1 and t.seen.shape == (1, EDGES)
    for i, ids in enumerate(stream):
        cache.serve("edge", Unique.of(ids).values.clamp(min=0), unique=Unique.of(ids), index=i)
    cache.begin_epoch("train", 3, len(stream))
    assert t.phases == 3 and t.runs.count == 1 and t.runs.bits is None  # every used row fits
    with pytest.raises(CacheError, match=r"phases must be in \[1, 8\] \(got 9\).*cache.hot_set_phases"):
        cache.begin_epoch("train", 9, 24)
    assert t.phases == 3  # refused before anything changed


def test_zero_copy_reads_of_a_1d_table_return_a_vector():
    from fastopt.codegen import cached_rows

    table = torch.arange(10.0)
    cache = SlimCache({"t": table}, config=CacheConfig(host_reads="zero_copy", budget_fraction=0.5),
                      read_rows=cached_rows)
    ids = torch.tensor([3, 1, 7])
    assert torch.equal(cache.serve("t", ids, unique=Unique.of(ids)), table[ids])


def test_zero_copy_reads_refuse_what_they_cannot_serve(tmp_path):
    from fastopt.codegen import cached_rows

    edge, mem = make_tables()
    zero = CacheConfig(host_reads="zero_copy")
    with pytest.raises(CacheError, match="read-write"):
        SlimCache({"memory": CacheTable(mem, writable=True)}, config=zero, read_rows=cached_rows)
    with pytest.raises(CacheError, match="admits rows per batch"):
        SlimCache({"edge": edge}, config=CacheConfig(host_reads="zero_copy", policy="lru"), read_rows=cached_rows)
    with pytest.raises(CacheError, match="no row-reading kernel"):
        SlimCache({"edge": edge}, config=zero)
    # auto: never on the CPU, where nothing is gained; staged reads are the same lookups
    assert not SlimCache({"edge": edge}, read_rows=cached_rows).zero_copy("edge")
    staged = SlimCache({"edge": edge})
    with pytest.raises(CacheError, match="not read zero-copy"):
        staged.serve("edge", torch.zeros(1, dtype=torch.long), unique=Unique.of(torch.zeros(1, dtype=torch.long)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 64), st.integers(0, 2**31 - 1))
def test_ranked_slots_find_the_largest_keys_as_a_full_ranking_does(monkeypatch, capacity, seed):
    """Random filings, refilings and drops: the n largest keys found are the n largest of the
    live slots, each slot once, with its current key; the entries stay within twice the slots
    (no slack here, so the buckets are rebuilt from the live slots again and again)."""
    from fastopt.runtime import cache_policy
    from fastopt.runtime.cache_policy import RankedSlots

    monkeypatch.setattr(cache_policy, "_STALE_SLACK", 0)

    rng = np.random.default_rng(seed)
    ranked, keys, live = RankedSlots(capacity), np.zeros(capacity, dtype=np.int64), np.zeros(capacity, bool)
    for _ in range(30):
        op = rng.integers(3)
        slots = rng.choice(capacity, rng.integers(1, capacity + 1), replace=False)
        if op == 0:
            new = rng.integers(-5, 5, slots.size)
            ranked.set(slots, new)
            keys[slots], live[slots] = new, True
        elif op == 1:
            ranked.drop(slots)
            live[slots] = False
        else:
            n = int(rng.integers(1, capacity + 1))
            got, got_keys = ranked.largest(n)
            want = np.sort(keys[live])[::-1][:n]
            assert np.unique(got).size == got.size and live[got].all()
            assert np.array_equal(got_keys, keys[got]) and np.array_equal(np.sort(got_keys)[::-1], want)
        assert ranked._entries <= 2 * capacity


@settings(max_examples=300, deadline=None)
@given(counts=st.lists(st.integers(0, 4), max_size=300) | st.lists(st.sampled_from([0, 1, 5, 2**22 - 1, 2**22, 2**40]), max_size=60),
       capacity=st.integers(0, 320), narrow=st.booleans())
def test_hot_set_is_the_most_used_rows_lower_ids_first_on_ties(counts, capacity, narrow):
    """Counts below 2**22 (int32 or int64) are ranked by a histogram of themselves, larger ones by one of their ranks."""
    from fastopt.runtime.cache_policy import hot_set

    # brute force: every used row ranked by (count descending, id)
    used = sorted((i for i, c in enumerate(counts) if c > 0), key=lambda i: (-counts[i], i))[:capacity]
    narrow = narrow and max(counts, default=0) < 2**31
    got = hot_set(torch.tensor(counts, dtype=torch.int32 if narrow else torch.int64), capacity)
    assert got.dtype == torch.int64
    assert got.tolist() == used


@settings(max_examples=150, deadline=None)
@given(last=st.integers(1, 9), phases=st.integers(1, 8), capacity=st.integers(0, 40), seed=st.integers(0, 2**31 - 1))
def test_run_plans_rank_the_runs_of_the_last_epoch_that_fall_in_them(last, phases, capacity, seed):
    """Run ``p`` of ``phases`` ranks the uses of the last epoch's runs ``r`` (of ``last``) with
    ``r * phases // last == p`` (else the one it falls in), then fills up with the whole epoch's."""
    from fastopt.runtime.run_plans import RunPlans

    used = np.random.default_rng(seed).integers(0, 4, size=(last, 60)).astype(np.int32)

    def ranked(uses):
        return sorted((i for i in range(uses.size) if uses[i] > 0), key=lambda i: (-uses[i], i))[:capacity]

    total = ranked(used.sum(0))
    runs = RunPlans(torch.from_numpy(used), phases, capacity)
    plans = runs.all()
    if phases == 1 or capacity == 0 or len(total) < capacity:
        assert [p.tolist() for p in plans] == [total]
        return
    assert len(plans) == phases
    for p, plan in enumerate(plans):
        theirs = [r for r in range(last) if r * phases // last == p] or [p * last // phases]
        hot = ranked(used[theirs].sum(0))
        assert plan.tolist() == (hot + [i for i in total if i not in hot])[:capacity]
        assert np.array_equal(np.flatnonzero(runs.bits & (1 << p)), np.sort(plan.numpy()))  # its bit: its rows


def test_run_plans_after_the_first_come_from_a_thread_whose_error_is_raised_where_they_are_waited_for(monkeypatch):
    """Only run 0's hot set is planned at the epoch's start; a failure planning a later run is
    raised by whoever waits for that run, and the runs planned before it stay usable."""
    import threading

    from fastopt.runtime import run_plans

    used = torch.from_numpy(np.random.default_rng(0).integers(1, 4, size=(4, 50)).astype(np.int32))
    ranked, gate = run_plans.hot_set, threading.Event()

    def slow_then_failing(counts, capacity):
        if threading.current_thread().name == "fastopt-hot-sets":
            gate.wait(timeout=60)
            if len(runs._plans) == 2:
                raise MemoryError("no room for run 2's counts")
        return ranked(counts, capacity)

    monkeypatch.setattr(run_plans, "hot_set", slow_then_failing)
    runs = run_plans.RunPlans(used, 4, 10)
    try:
        assert runs.count == 4 and len(runs._plans) == 1 and not runs._ready[1].is_set()  # run 0's alone
    finally:
        gate.set()
    assert runs.get(1).numel() == 10
    with pytest.raises(CacheError, match=r"run 2 of 4 failed: MemoryError: no room for run 2's counts") as err:
        runs.get(2)
    assert isinstance(err.value.__cause__, MemoryError)
    with pytest.raises(CacheError, match="run 3 of 4"):
        runs.ready(3)
    runs.join()  # returns: every run is done with, planned or failed
