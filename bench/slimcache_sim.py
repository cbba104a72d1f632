"""Batch-granular cache simulation of TGN's and TGAT's edge-feature streams, in plain NumPy.

An independent cross-check of ``bench/slimcache.py`` (it imports nothing from fastopt): it reads
the event file itself, samples the streams itself and simulates the policies itself, and it
reconstructs the figures quoted in issue 6. Per stream it prints the naive rows (every valid
sampled edge's feature row of every hop, duplicates included: what TGL copies) divided by the
rows moved by dedup alone (unique rows per batch), a static hot set (the rows touched by the most
batches of the first half epoch), LRU and the offline Belady optimum, at ``--budget`` of the
edge-feature table's rows. Caches are batch-granular: a batch's unique rows are looked up, the
misses move, then the cache keeps the rows the policy ranks first among its old rows and the
batch's (LRU: most recent batch first, ties by lower edge id; Belady: soonest next use).

Common to every stream: wikipedia's events in time order, the first 70 % of the timestamps'
range quantile as the train split, batches of 600 events, roots = source, destination and one
negative per event at the event's time, reverse edges, neighbors strictly before the root's time.
The variants differ in three rules:

* negatives: ``all`` = uniform over every node id (TGL's ``NegLinkSampler``); ``destinations`` =
  uniform over the nodes seen as destinations (fastopt's Trainer);
* hops: ``tgl`` = hop 2 samples around hop 1's neighbors and the roots (TGL's sampler);
  ``neighbors`` = around hop 1's neighbors only (fastopt's reference sampler);
* uniform: ``tgl`` = all candidates when there are at most ``k``, else ``k`` draws with
  replacement (TGL and fastopt); ``always`` = ``k`` draws with replacement whenever there is a
  candidate (the original TGAT code's rule), which repeats rows of nodes with fewer than ``k``
  candidates and so inflates the naive count with rows TGL never copies.

Usage::

    python bench/slimcache_sim.py [--data path/to/wikipedia.csv.gz] [--budget 0.1] [--seed 0]
"""

from __future__ import annotations

import argparse
import gzip
import os
from pathlib import Path

import numpy as np

DATA = Path(os.environ.get("FASTOPT_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
PACKAGED = Path(__file__).resolve().parents[1] / "fastopt" / "datasets" / "wikipedia.csv.gz"

# name: (fanouts, strategy, negatives, hops, uniform rule)
VARIANTS = {
    "tgn issue-6 / TGL": ([10], "recent", "all", "tgl", "tgl"),
    "tgn fastopt Trainer negatives": ([10], "recent", "destinations", "tgl", "tgl"),
    "tgat issue-6 figures (always k draws)": ([10, 10], "uniform", "all", "neighbors", "always"),
    "tgat TGL": ([10, 10], "uniform", "all", "tgl", "tgl"),
    "tgat fastopt sampler, TGL negatives": ([10, 10], "uniform", "all", "neighbors", "tgl"),
    "tgat fastopt sampler, Trainer negatives": ([10, 10], "uniform", "destinations", "neighbors", "tgl"),
}
ISSUE = {"tgn": (3.3, 4.8, 9.9, 17.4), "tgat": (6.9, 11.4, 10.8, 16.0)}


def load_events(path: Path):
    """``u,i,ts,label`` rows (wikipedia's JODIE format), sorted by time."""
    with gzip.open(path, "rt") as f:
        a = np.loadtxt(f, delimiter=",", skiprows=1, usecols=(0, 1, 2))
    order = np.argsort(a[:, 2], kind="stable")
    return a[order, 0].astype(np.int64), a[order, 1].astype(np.int64), a[order, 2]


class Events:
    """Per node, the events touching it (both directions), sorted by time then edge id."""

    def __init__(self, src, dst, ts):
        self.num_nodes = int(max(src.max(), dst.max())) + 1
        eid = np.arange(src.size)
        node, nbr = np.concatenate([src, dst]), np.concatenate([dst, src])
        ets, eid = np.concatenate([ts, ts]), np.concatenate([eid, eid])
        order = np.lexsort((eid, ets, node))
        self.nbr, self.ets, self.eid = nbr[order], ets[order], eid[order]
        self.start = np.searchsorted(node[order], np.arange(self.num_nodes))
        self.times = np.unique(ets)
        self.key = node[order] * (self.times.size + 1) + np.searchsorted(self.times, ets[order])

    def hop(self, nodes, at, k, strategy, uniform, rng):
        """Valid (edge id, neighbor, neighbor time) of ``k`` samples around each node."""
        lo = self.start[nodes]
        hi = np.searchsorted(self.key, nodes * (self.times.size + 1) + np.searchsorted(self.times, at))
        avail = hi - lo
        col = np.arange(k)[None, :]
        if strategy == "recent":
            pos, valid = hi[:, None] - 1 - col, col < np.minimum(avail, k)[:, None]
        else:
            drawn = lo[:, None] + (rng.random((nodes.size, k)) * avail[:, None]).astype(np.int64)
            if uniform == "always":
                pos, valid = drawn, np.broadcast_to(avail[:, None] > 0, drawn.shape)
            else:
                pos = np.where(avail[:, None] <= k, lo[:, None] + col, drawn)
                valid = col < np.minimum(avail, k)[:, None]
        pos = pos[valid]
        return self.eid[pos], self.nbr[pos], self.ets[pos]


def epoch(events, src, dst, ts, end, fanouts, strategy, negatives, hops, uniform, seed,
          batch=600):
    """(naive rows, per-batch sorted unique edge ids) of one training epoch."""
    rng = np.random.default_rng(seed)
    pool = np.arange(events.num_nodes) if negatives == "all" else np.unique(dst)
    naive, batches = 0, []
    for a in range(0, end, batch):
        b = min(a + batch, end)
        nodes = np.concatenate([src[a:b], dst[a:b], rng.choice(pool, b - a)])
        at = np.tile(ts[a:b], 3)
        eids = []
        for k in fanouts:
            e, nbr, nbr_t = events.hop(nodes, at, k, strategy, uniform, rng)
            eids.append(e)
            nodes, at = ((np.concatenate([nbr, nodes]), np.concatenate([nbr_t, at]))
                         if hops == "tgl" else (nbr, nbr_t))
        e = np.concatenate(eids)
        naive += e.size
        batches.append(np.unique(e))
    return naive, batches


def static_misses(batches, cap):
    ids, count = np.unique(np.concatenate(batches[: max(1, len(batches) // 2)]), return_counts=True)
    hot = ids[np.argsort(-count, kind="stable")[:cap]]
    return sum(int((~np.isin(u, hot)).sum()) for u in batches)


def _replay(batches, cap, n, rank):
    """Misses of a batch-granular cache keeping the ``cap`` best-ranked rows after each batch."""
    present = np.zeros(n, bool)
    held = np.empty(0, np.int64)
    misses = 0
    for i, u in enumerate(batches):
        misses += int((~present[u]).sum())
        keep = rank(i, u, np.union1d(held, u))
        present[held] = False
        present[keep] = True
        held = keep
    return misses


def lru_misses(batches, cap, n):
    last = np.full(n, -1, np.int64)

    def rank(i, u, cand):
        last[u] = i
        return cand[np.argsort(-last[cand], kind="stable")[:cap]]
    return _replay(batches, cap, n, rank)


def belady_misses(batches, cap, n):
    never = len(batches)
    upcoming, nxt = [], np.full(n, never, np.int64)
    for i in range(len(batches) - 1, -1, -1):
        upcoming.append(nxt[batches[i]].copy())
        nxt[batches[i]] = i
    upcoming.reverse()
    next_use = np.full(n, never, np.int64)

    def rank(i, u, cand):
        next_use[u] = upcoming[i]
        cand = cand[next_use[cand] < never]
        return cand if cand.size <= cap else cand[np.argpartition(next_use[cand], cap - 1)[:cap]]
    return _replay(batches, cap, n, rank)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=None, help="wikipedia.csv.gz (u,i,ts,label)")
    parser.add_argument("--budget", type=float, default=0.10, help="fraction of the edge rows")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = args.data or (DATA / "wikipedia.csv.gz" if (DATA / "wikipedia.csv.gz").exists() else PACKAGED)
    src, dst, ts = load_events(path)
    events = Events(src, dst, ts)
    end = int(np.searchsorted(ts, np.quantile(ts, 0.70), side="right"))
    cap = int(args.budget * src.size)
    print(f"# {path.name}: {src.size} events, train {end}, cache {cap} rows ({args.budget:.0%})")
    print(f"{'stream':<42}{'naive rows':>12}{'dedup':>8}{'static':>8}{'LRU':>8}{'Belady':>8}")
    for name, (fanouts, strategy, negatives, hops, uniform) in VARIANTS.items():
        naive, batches = epoch(events, src, dst, ts, end, fanouts, strategy, negatives, hops,
                               uniform, args.seed)
        moved = (sum(u.size for u in batches), static_misses(batches, cap),
                 lru_misses(batches, cap, src.size), belady_misses(batches, cap, src.size))
        print(f"{name:<42}{naive:>12}" + "".join(f"{naive / m:>8.2f}" for m in moved), flush=True)
    for stream, figures in ISSUE.items():
        print(f"{stream + ' as quoted in issue 6':<42}{'':>12}" + "".join(f"{x:>8.1f}" for x in figures))


if __name__ == "__main__":
    main()
