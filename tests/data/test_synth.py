"""The synthetic generators: one keeps the source's degree profile, repeat rate and time gaps; the
GDELT-like one has the degree and repeat profile its parameters ask for, whatever the chunk size."""

import numpy as np
import pytest

from fastopt.data import load_dataset
from fastopt.data.synth import BLOCK_EVENTS, GdeltProfile, gdelt_chunks, synthesize, synthesize_gdelt
from fastopt.errors import DataError

PERCENTILES = (50, 75, 90, 99, 100)


def degree_profile(graph) -> np.ndarray:
    degree = np.bincount(np.r_[graph.src, graph.dst], minlength=graph.num_nodes)
    return np.percentile(degree, PERCENTILES)


def check_like(source, synthetic) -> None:
    real, fake = degree_profile(source), degree_profile(synthetic)
    ratio = np.maximum(fake, 1) / np.maximum(real, 1)
    assert np.all((ratio >= 0.5) & (ratio <= 2.0)), dict(zip(PERCENTILES, zip(real, fake)))
    assert abs(synthetic.info()["repeat_rate"] - source.info()["repeat_rate"]) < 0.1
    assert np.all(np.diff(synthetic.ts) >= 0)


def test_wikipedia_sized_stream_keeps_the_degree_profile(wikipedia):
    synthetic = synthesize(wikipedia, wikipedia.num_events, seed=0)
    assert synthetic.bipartite and synthetic.num_nodes == wikipedia.num_nodes
    assert synthetic.src.max() < synthetic.dst.min()  # sources and destinations stay apart
    check_like(wikipedia, synthetic)


def test_a_unipartite_stream_keeps_its_profile(shared_data):
    source = load_dataset(shared_data / "CollegeMsg.txt.gz")
    check_like(source, synthesize(source, source.num_events, seed=1))


def test_every_repeat_meets_a_past_partner_of_its_source(wikipedia):
    synthetic = synthesize(wikipedia, 20_000, seed=2)
    seen = set()
    pairs = list(zip(synthetic.src.tolist(), synthetic.dst.tolist()))
    partners = {}
    for s, d in pairs:
        if (s, d) in seen:
            assert d in partners[s]
        seen.add((s, d))
        partners.setdefault(s, set()).add(d)
    assert len(seen) < len(pairs)  # repeats happen


def test_bad_sizes_are_refused(wikipedia):
    with pytest.raises(DataError, match="num_events"):
        synthesize(wikipedia, 0)


# ----------------------------------------------------------------------------- GDELT-like profile
def test_gdelt_chunks_give_one_graph_whatever_the_chunk_size():
    profile = GdeltProfile(num_nodes=2_000, edge_dim=3)
    n = 2 * BLOCK_EVENTS + 1_234  # three blocks, the last one short
    whole = synthesize_gdelt(profile, n, seed=4)
    for chunk in (1, BLOCK_EVENTS, 2 * BLOCK_EVENTS + 1):
        parts = list(gdelt_chunks(profile, n, seed=4, chunk_events=chunk))
        assert len(parts) == -(-3 // -(-chunk // BLOCK_EVENTS))  # whole blocks per chunk
        for k, name in enumerate(("src", "dst", "ts", "edge_feat")):
            joined = np.concatenate([p[k] for p in parts])
            assert joined.dtype == getattr(whole, name).dtype
            assert np.array_equal(joined, getattr(whole, name)), (chunk, name)


def test_gdelt_features_are_the_same_on_any_number_of_threads(monkeypatch):
    """Each tile of features comes from its own stream, whatever thread draws it, and every row
    is drawn (a row left unfilled would be whatever the allocation held)."""
    import fastopt.data.synth as synth

    profile = GdeltProfile(num_nodes=500, edge_dim=5)
    n = BLOCK_EVENTS + 3 * synth.FEATURE_ROWS + 17  # a short last tile in a short last block
    seen = []
    monkeypatch.setattr(synth.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    for threads in (1, 3):  # 3 threads whatever the machine's cores
        monkeypatch.setattr(synth, "FEATURE_THREADS", threads)
        seen.append(synthesize_gdelt(profile, n, seed=2).edge_feat)
    assert np.array_equal(seen[0], seen[1])
    tiles = seen[0][: (n // synth.FEATURE_ROWS) * synth.FEATURE_ROWS].reshape(-1, synth.FEATURE_ROWS, 5)
    assert abs(float(seen[0].mean())) < 0.01 and abs(float(seen[0].std()) - 1) < 0.01
    assert not any(np.array_equal(tiles[0], t) for t in tiles[1:])  # a stream per tile, not one reused
    assert np.all(np.abs(seen[0][-17:]).sum(axis=1) > 0)


def test_gdelt_profile_is_heavy_tailed_with_the_asked_exponent():
    graph = synthesize_gdelt(GdeltProfile(num_nodes=5_000, edge_dim=0), 400_000, seed=0)
    sends = np.sort(np.bincount(graph.src, minlength=graph.num_nodes))[::-1]
    ranks = np.arange(1, 201)  # the head of the rank-activity curve: log-log slope -exponent
    slope = np.polyfit(np.log(ranks), np.log(sends[:200]), 1)[0]
    assert -1.15 < slope < -0.85, slope
    info = graph.info()
    assert info["degree_max"] > 100 * info["degree_p50"]
    assert np.all(np.diff(graph.ts) >= 0) and np.all(graph.ts % 900.0 == 0)
    assert not np.any(graph.src == graph.dst)


@pytest.mark.parametrize("repeat", [0.2, 0.6])
def test_gdelt_profile_has_the_asked_repeat_rate(repeat):
    # 20 events per actor and a flat activity: nearly every source acted before, and a fresh
    # partner rarely repeats a pair by chance, so the pair repeat rate is close to `repeat`
    profile = GdeltProfile(num_nodes=20_000, activity_exponent=0.5, repeat=repeat, edge_dim=0)
    graph = synthesize_gdelt(profile, 400_000, seed=1)
    measured = graph.info()["repeat_rate"]
    _, first = np.unique(graph.src, return_index=True)
    acted_before = 1 - first.size / graph.num_events  # the events that can repeat
    assert abs(measured - repeat * acted_before) < 0.015, (measured, acted_before)
    assert abs(measured - repeat) < 0.05, measured


def test_gdelt_repeats_meet_a_recent_partner_of_their_source():
    profile = GdeltProfile(num_nodes=300, repeat=0.7, window=4, edge_dim=0)
    graph = synthesize_gdelt(profile, 20_000, seed=3)
    recent = {}
    fresh_or_recent = 0
    for s, d in zip(graph.src.tolist(), graph.dst.tolist()):
        fresh_or_recent += d in recent.get(s, ())
        recent[s] = (recent.get(s, ()) + (d,))[-4:]
    assert fresh_or_recent > 0.7 * 0.9 * graph.num_events  # repeats come from the last 4 partners


@pytest.mark.parametrize("change,match", [
    (dict(num_nodes=1), "num_nodes"), (dict(repeat=1.5), "repeat"),
    (dict(activity_exponent=-1.0), "activity_exponent"), (dict(window=0), "window"),
    (dict(edge_dim=-2), "edge_dim")])
def test_bad_gdelt_parameters_are_refused(change, match):
    with pytest.raises(DataError, match=match):
        synthesize_gdelt(GdeltProfile(**change), 100)
    with pytest.raises(DataError, match="num_events"):
        synthesize_gdelt(GdeltProfile(), 0)
