"""Synthetic event streams for scale tests beyond the real files: fitted to a real one
(:func:`synthesize`), or with the GDELT-like profile of :class:`GdeltProfile` (:func:`gdelt_chunks`,
generated a chunk at a time for graphs that do not fit in RAM; both share :func:`_repeat_pointers`).

The fitted generator keeps three statistics of the source graph: the activity (degree) distribution
of sources and of destinations, the distribution of inter-event times, and the repeat-edge rate
(the fraction of events whose pair occurred before; a repeat is a source meeting one of its past
partners again). Node counts scale with the event count so
that mean degree is preserved, unless ``num_nodes`` is given. Bipartite sources stay bipartite.
Generation is vectorized in chunks, so tens of millions of events take seconds per million.
The fitted generator holds the whole stream in RAM; the GDELT-like one holds one chunk and each
source's last few partners.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import numpy as np

from fastopt.data.graph import TemporalGraph
from fastopt.errors import DataError

__all__ = ["BLOCK_EVENTS", "GdeltProfile", "gdelt_chunks", "synthesize", "synthesize_gdelt"]

_CHUNK = 1 << 22


def _activity(ids: np.ndarray, num_nodes: int, target: int, rng) -> np.ndarray:
    """Per-node sampling weights for ``target`` nodes, drawn from the empirical activity."""
    counts = np.bincount(ids, minlength=num_nodes).astype(np.float64)
    counts = counts[counts > 0]
    return rng.choice(counts, size=target, replace=True)


def _grouped(ids: np.ndarray):
    """Events grouped by ``ids``, each group in time order: the stable sort order, and for each
    position of the sorted events where its group starts and where it ends (one past its last)."""
    order = np.argsort(ids, kind="stable")
    grouped = ids[order]
    starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
    sizes = np.diff(np.r_[starts, ids.size])
    return order, np.repeat(starts, sizes), np.repeat(starts + sizes, sizes)


def _repeat_pointers(src: np.ndarray, repeat: float, rng, *, window: Optional[int] = None,
                     fixed: int = 0) -> np.ndarray:
    """For each event, the event whose freshly drawn destination it takes: itself, or (with
    probability ``repeat``, when its source has earlier events) a uniformly chosen earlier event of
    the same source, followed to the fresh draw it took. A repeat is a source meeting a past partner
    again, so a node's activity stays what its weight draws; copying any earlier event instead made
    the counts an urn that rich nodes win (median degree 0, maximum 15x the source's).

    Args:
        src: source of each event, in time order.
        repeat: probability that an event with an earlier event of its source repeats one.
        rng: the random generator (two draws per event).
        window: choose among the source's last ``window`` events only (None: all earlier ones).
        fixed: the first ``fixed`` events are history carried over from earlier chunks: their
            destinations are final, they are never repeats themselves.
    """
    m = src.size
    order, start_of, _ = _grouped(src)
    rank = np.arange(m) - start_of  # occurrence index of each event among its source's
    first = 0 if window is None else np.maximum(rank - window, 0)
    earlier = first + (rng.random(m) * (rank - first)).astype(np.int64)  # uniform in [first, rank)
    repeats = (rng.random(m) < repeat) & (rank > 0) & (order >= fixed)
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


# Events generated from one random stream: the unit that makes the graph independent of how many
# events are held in RAM at once (a chunk is a whole number of blocks).
BLOCK_EVENTS = 1 << 17
# threads drawing a chunk's features at most (numpy's generators fill arrays without the GIL),
# each a tile of FEATURE_ROWS events at a time from the tile's own stream (a block holds 16)
FEATURE_THREADS = 16
FEATURE_ROWS = 1 << 13
assert BLOCK_EVENTS % FEATURE_ROWS == 0  # chunks of whole blocks start on whole tiles


@dataclass(frozen=True)
class GdeltProfile:
    """The degree and repeat profile of a GDELT-like event graph, as explicit parameters.

    GDELT (the Global Database of Events, Language and Tone, as released with TGL) is a dense
    actor-to-actor stream: about 17 thousand actors, 191 million events, 186-d edge features, a
    few actors in most events and pairs that meet again and again. This profile reproduces those
    traits by construction; it is **not fitted to the real GDELT file** (none is at hand), so its
    percentiles are those its parameters give, not GDELT's. ``fastopt data info`` reports them.

    Attributes:
        num_nodes: actors (GDELT's TGL release has 16,682).
        activity_exponent: Zipf exponent of activity: the actor of activity rank ``r`` (from 1)
            takes part in events with weight ``r ** -activity_exponent``, as a source and, for a
            freshly drawn partner, as a destination (actors active on both ends, as in GDELT).
        repeat: probability that an event whose source acted before meets one of that source's
            last ``window`` partners again instead of drawing a fresh one. The pair repeat rate
            ``fastopt data info`` measures is then about ``repeat`` times the share of events
            whose source acted before, plus fresh draws that hit a past partner by chance:
            little where a source's partners are few against ``num_nodes``, much on long
            streams over few actors (50 M events over the default 16,682 actors).
        window: past partners remembered per source (bounds the generator's state to
            ``num_nodes * window`` ids, whatever the event count).
        time_span: seconds between the first and the last event (five years).
        time_step: timestamps are whole multiples of it (GDELT publishes every 15 minutes), so
            many events share one timestamp; events are spread evenly over the span.
        edge_dim: width of the edge features (standard normal float32).
    """

    num_nodes: int = 16_682
    activity_exponent: float = 1.0
    repeat: float = 0.9
    window: int = 16
    time_span: float = 5 * 365 * 86_400.0
    time_step: float = 900.0
    edge_dim: int = 186

    def check(self) -> None:
        """Refuse parameters outside their range, naming the value, the limit and the flag."""
        if self.num_nodes < 2:
            raise DataError(f"num_nodes must be >= 2 (got {self.num_nodes}); pass e.g. --nodes 16682")
        if not 0.0 <= self.repeat <= 1.0:
            raise DataError(f"repeat must be in [0, 1] (got {self.repeat}); pass e.g. --repeat 0.9")
        if not np.isfinite(self.activity_exponent) or self.activity_exponent < 0:
            raise DataError(f"activity_exponent must be a finite number >= 0 (got "
                            f"{self.activity_exponent}); pass e.g. --activity-exponent 1.0")
        if self.window < 1:
            raise DataError(f"window must be >= 1 (got {self.window}); pass e.g. 16")
        if self.edge_dim < 0:
            raise DataError(f"edge_dim must be >= 0 (got {self.edge_dim}); pass 0 for no features")
        if not (self.time_span >= 0 and self.time_step > 0):
            raise DataError(f"time_span must be >= 0 and time_step > 0 (got {self.time_span}, "
                            f"{self.time_step}); keep the defaults (five years, 900 s)")


def gdelt_chunks(profile: GdeltProfile, num_events: int, *, seed: int = 0,
                 chunk_events: int = BLOCK_EVENTS) -> Iterator[Tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                     Optional[np.ndarray]]]:
    """The events of a GDELT-like graph as consecutive ``(src, dst, ts, edge_feat)`` chunks.

    Events come in blocks of :data:`BLOCK_EVENTS`, block ``b`` drawn from its own random stream
    ``(seed, 1, b)``, and their features in tiles of :data:`FEATURE_ROWS` events, tile ``t`` from
    ``(seed, 2, t)``; the only state carried between blocks is each source's last ``window``
    partners. So the graph depends on ``seed`` alone, not on ``chunk_events``, and RAM holds one
    chunk and that state, whatever ``num_events`` is. The features (nearly all of the bytes) are
    drawn on up to :data:`FEATURE_THREADS` threads, each tile into its rows of the chunk, while
    this thread draws the events.

    Args:
        profile: the degree, repeat, time and feature parameters.
        num_events: events in all (>= 1).
        seed: random seed.
        chunk_events: events per chunk, rounded up to a whole number of blocks.
    """
    if num_events < 1:
        raise DataError(f"num_events must be >= 1 (got {num_events}); pass e.g. --events 1000000")
    if chunk_events < 1:
        raise DataError(f"chunk_events must be >= 1 (got {chunk_events}); pass e.g. {BLOCK_EVENTS}")
    profile.check()
    n, window = profile.num_nodes, profile.window
    rank_to_node = np.random.default_rng([seed, 0]).permutation(n)
    weight = np.empty(n)
    weight[rank_to_node] = np.arange(1, n + 1, dtype=np.float64) ** -profile.activity_exponent
    cdf = np.cumsum(weight) / weight.sum()
    history = np.zeros((n, window), dtype=np.int64)  # each source's last partners, newest last
    known = np.zeros(n, dtype=np.int64)  # how many of them are set
    ticks = profile.time_span / profile.time_step
    per_chunk = -(-chunk_events // BLOCK_EVENTS)
    blocks = -(-num_events // BLOCK_EVENTS)
    threads = max(1, min(FEATURE_THREADS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                         else (os.cpu_count() or 1)))
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fastopt-synth")
    try:
        for first in range(0, blocks, per_chunk):
            ids = range(first, min(first + per_chunk, blocks))
            sizes = [min(BLOCK_EVENTS, num_events - b * BLOCK_EVENTS) for b in ids]
            feat = np.empty((sum(sizes), profile.edge_dim), dtype=np.float32) if profile.edge_dim else None
            first_row = first * BLOCK_EVENTS
            fills = [] if feat is None else [
                pool.submit(_fill_features, feat[t * FEATURE_ROWS - first_row:(t + 1) * FEATURE_ROWS - first_row],
                            seed, t)
                for t in range(first_row // FEATURE_ROWS, -(-(first_row + feat.shape[0]) // FEATURE_ROWS))]
            parts = [_gdelt_block(profile, cdf, history, known, b, size, ticks, num_events, seed)
                     for b, size in zip(ids, sizes)]
            for fill in fills:
                fill.result()
            yield tuple(np.concatenate([p[k] for p in parts]) for k in range(3)) + (feat,)
    except BaseException:  # an error or Ctrl-C: drop the fills not started, do not wait for them
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


def _fill_features(out: np.ndarray, seed: int, tile: int) -> None:
    """The edge features of events ``tile * FEATURE_ROWS ...`` (``len(out)`` of them), standard
    normal float32, drawn into ``out``."""
    np.random.default_rng([seed, 2, tile]).standard_normal(out=out, dtype=np.float32)


def _gdelt_block(profile: GdeltProfile, cdf: np.ndarray, history: np.ndarray, known: np.ndarray,
                 block: int, size: int, ticks: float, num_events: int, seed: int):
    """Block ``block``'s events of :func:`gdelt_chunks` (``size`` of them, without features):
    ``(src, dst, ts)``; updates ``history``/``known``."""
    rng = np.random.default_rng([seed, 1, block])
    n, window = cdf.size, profile.window
    src = np.searchsorted(cdf, rng.random(size), side="right").clip(max=n - 1)
    fresh = np.searchsorted(cdf, rng.random(size), side="right").clip(max=n - 1)
    fresh = np.where(fresh == src, (fresh + 1) % n, fresh)  # no self-loops
    # The sources' remembered partners go first, as events whose destinations are final.
    active = np.unique(src)
    kept = known[active]
    past_src = np.repeat(active, kept)
    column = np.arange(past_src.size) - np.repeat(np.cumsum(kept) - kept, kept) + np.repeat(window - kept, kept)
    every_src = np.concatenate([past_src, src])
    every_dst = np.concatenate([history[past_src, column], fresh])
    every_dst = every_dst[_repeat_pointers(every_src, profile.repeat, rng, window=window, fixed=past_src.size)]
    # Remember each source's last `window` partners (events grouped by source, in time order).
    order, _, end_of = _grouped(every_src)
    from_end = end_of - 1 - np.arange(order.size)  # 0 for each source's newest event
    keep = from_end < window
    history[every_src[order][keep], window - 1 - from_end[keep]] = every_dst[order][keep]
    known[active] = np.minimum(kept + np.bincount(src, minlength=n)[active], window)
    start = block * BLOCK_EVENTS
    ts = np.floor(np.arange(start, start + size) * (ticks / num_events)) * profile.time_step
    return src, every_dst[past_src.size:], ts


def synthesize_gdelt(profile: GdeltProfile, num_events: int, *, seed: int = 0) -> TemporalGraph:
    """A GDELT-like graph held in RAM: the events of :func:`gdelt_chunks` in one chunk."""
    src, dst, ts, feat = next(gdelt_chunks(profile, num_events, seed=seed, chunk_events=num_events))
    return TemporalGraph(src, dst, ts, profile.num_nodes, edge_feat=feat, name="synth-gdelt")
