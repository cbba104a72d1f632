"""The synthetic generator keeps the source's degree profile, repeat rate and time gaps."""

import numpy as np
import pytest

from fastopt.data import load_dataset
from fastopt.data.synth import synthesize
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
