"""Synthetic event streams fitted to a real one, for scale tests beyond the real files.

The generator keeps three statistics of the source graph: the activity (degree) distribution
of sources and of destinations, the distribution of inter-event times, and the repeat-edge rate
(the fraction of events whose pair occurred before; a repeat is a source meeting one of its past
partners again). Node counts scale with the event count so
that mean degree is preserved, unless ``num_nodes`` is given. Bipartite sources stay bipartite.
Generation is vectorized in chunks, so tens of millions of events take seconds per million.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from fastopt.data.graph import TemporalGraph
from fastopt.errors import DataError

__all__ = ["synthesize"]

_CHUNK = 1 << 22


def _activity(ids: np.ndarray, num_nodes: int, target: int, rng) -> np.ndarray:
    """Per-node sampling weights for ``target`` nodes, drawn from the empirical activity."""
    counts = np.bincount(ids, minlength=num_nodes).astype(np.float64)
    counts = counts[counts > 0]
    return rng.choice(counts, size=target, replace=True)


def _repeat_pointers(src: np.ndarray, repeat: float, rng) -> np.ndarray:
    """For each event, the event whose freshly drawn destination it takes: itself, or (with
    probability ``repeat``, when its source has earlier events) a uniformly chosen earlier event of
    the same source, followed to the fresh draw it took. A repeat is a source meeting a past partner
    again, so a node's activity stays what its weight draws; copying any earlier event instead made
    the counts an urn that rich nodes win (median degree 0, maximum 15x the source's)."""
    m = src.size
    order = np.argsort(src, kind="stable")  # events grouped by source, in time order
    grouped = src[order]
    starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
    start_of = np.repeat(starts, np.diff(np.r_[starts, m]))
    rank = np.arange(m) - start_of  # occurrence index of each event among its source's
    earlier = (rng.random(m) * rank).astype(np.int64)  # uniform in [0, rank)
    repeats = (rng.random(m) < repeat) & (rank > 0)
    ptr = np.empty(m, dtype=np.int64)
    ptr[order] = np.where(repeats, order[start_of + earlier], order)
    while True:  # pointer jumping: every chain ends at an event that drew its own destination
        nxt = ptr[ptr]
        if np.array_equal(nxt, ptr):
            return ptr
        ptr = nxt


def synthesize(like: TemporalGraph, num_events: int, *, num_nodes: Optional[int] = None,
               seed: int = 0) -> TemporalGraph:
    """Generate ``num_events`` events with the statistics of ``like``.

    Args:
        like: the graph whose degree, inter-event-time and repeat statistics are copied.
        num_events: events to generate (>= 1).
        num_nodes: node count; default scales ``like.num_nodes`` with the event count.
        seed: random seed.
    """
    if num_events < 1:
        raise DataError(f"num_events must be >= 1 (got {num_events}); pass e.g. --events 1000000")
    rng = np.random.default_rng(seed)
    scale = num_events / like.num_events
    n = int(num_nodes) if num_nodes else max(2, int(round(like.num_nodes * scale)))
    if n < 2:
        raise DataError(f"num_nodes must be >= 2 (got {n})")
    info = like.info()
    repeat = info["repeat_rate"]
    gaps = np.diff(like.ts)
    if like.bipartite:
        n_src = max(1, int(round(n * np.unique(like.src).size / like.num_nodes)))
        src_w = _activity(like.src, like.num_nodes, n_src, rng)
        dst_w = _activity(like.dst, like.num_nodes, n - n_src, rng)
        dst_offset = n_src
    else:  # a node's sending and receiving activity come from one real node (they correlate)
        sends = np.bincount(like.src, minlength=like.num_nodes).astype(np.float64)
        receives = np.bincount(like.dst, minlength=like.num_nodes).astype(np.float64)
        active = np.flatnonzero(sends + receives)
        pick = rng.choice(active, size=n, replace=True)
        src_w, dst_w = sends[pick] + 1e-3, receives[pick] + 1e-3
        dst_offset = 0
    src_cdf = np.cumsum(src_w) / src_w.sum()
    dst_cdf = np.cumsum(dst_w) / dst_w.sum()
    src = np.empty(num_events, dtype=np.int64)
    fresh = np.empty(num_events, dtype=np.int64)
    for lo in range(0, num_events, _CHUNK):
        hi = min(lo + _CHUNK, num_events)
        src[lo:hi] = np.searchsorted(src_cdf, rng.random(hi - lo), side="right").clip(max=src_cdf.size - 1)
        fresh[lo:hi] = np.searchsorted(dst_cdf, rng.random(hi - lo), side="right").clip(
            max=dst_cdf.size - 1) + dst_offset
    dst = fresh[_repeat_pointers(src, repeat, rng)]
    ts = np.concatenate([[like.ts[0]], like.ts[0] + np.cumsum(rng.choice(gaps, size=num_events - 1))]) \
        if gaps.size else np.full(num_events, like.ts[0])
    return TemporalGraph(src, dst, ts, n, name=f"synth-{like.name}", bipartite=like.bipartite)
