"""SlimCache's slot directory: host time of one lookup against the cache's size.

A staged cache decides on the host, per batch, which ids hit, which misses enter and which
residents leave (:class:`~fastopt.runtime.cache_policy.SlotDirectory`). This times that decision
alone, for each policy and cache size, on a stream of batches of distinct random ids (the worst
case: nearly every id misses, so every lookup evicts): the steady lookups, after the cache has
filled. The directory is run twice, finding its eviction candidates by ranking every resident
and by its incremental ranking (``RankedSlots``, what caches above ``_SCAN_SLOTS`` use); the two
must give the same hit and eviction counts for ``future`` (Belady's rule has no ties that change
them here) and both must keep the directory consistent (each resident id in one slot, the slot
map and its inverse agreeing), else the script names the run and exits with status 1::

    python bench/cache_directory.py --sizes 160000:40000 5000000:60000 --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import List

import numpy as np
import torch

from _meta import write_record
from fastopt.runtime import cache_policy
from fastopt.runtime.cache_policy import SlotDirectory, make_policy


def consistent(d: SlotDirectory) -> bool:
    resident = torch.nonzero(d.id_of >= 0).flatten()
    ids = d.id_of[resident]
    return (bool((d.slot_of[ids].long() == resident).all()) and ids.unique().numel() == ids.numel()
            and int((d.slot_of >= 0).sum()) == resident.numel())


def run(policy: str, capacity: int, batch: int, ranked: bool, seed: int) -> dict:
    """Lookups of ``batch`` random ids over ``10 * capacity`` rows until the cache has been
    filled about twice; the last ten are timed."""
    rows = 10 * capacity
    saved = cache_policy._SCAN_SLOTS
    cache_policy._SCAN_SLOTS = -1 if ranked else rows
    try:
        pol, index = make_policy(policy, rows)
        d = SlotDirectory(rows, capacity, pol)
    finally:
        cache_policy._SCAN_SLOTS = saved
    g = torch.Generator().manual_seed(seed)
    batches = [torch.unique(torch.randint(0, rows, (batch,), generator=g))
               for _ in range(2 * capacity // batch + 10)]
    if index is not None:
        for b in batches:
            d.refresh(index.announce(b), index.announced - 1)
    if policy == "static":
        d.preload(torch.arange(capacity))
    seconds, hits, evictions = [], 0, 0
    for b in batches:
        t0 = time.perf_counter()
        plan = d.access(b)
        seconds.append(time.perf_counter() - t0)
        hits += plan.hit_pos.numel()
        evictions += plan.evict_ids.numel()
    return {"policy": policy, "capacity": capacity, "batch": batch,
            "candidates": "ranked" if ranked else "every resident",
            "ms_per_lookup": 1e3 * statistics.median(seconds[-10:]), "hits": hits,
            "evictions": evictions, "consistent": consistent(d)}


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["16000:5000", "160000:40000", "5000000:60000"],
                   help="CAPACITY:BATCH pairs (slots, ids per lookup)")
    p.add_argument("--policies", nargs="+", default=["future", "lru", "static"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results, wrong = [], []
    print(f"{'policy':<8}{'slots':>10}{'ids':>8}  {'candidates':<16}{'ms/lookup':>10}{'hits':>10}{'evictions':>11}")
    for size in args.sizes:
        capacity, batch = (int(x) for x in size.split(":"))
        for policy in args.policies:
            pair = [run(policy, capacity, batch, ranked, args.seed) for ranked in (False, True)]
            for r in pair:
                results.append(r)
                print(f"{policy:<8}{capacity:>10}{batch:>8}  {r['candidates']:<16}{r['ms_per_lookup']:>10.2f}"
                      f"{r['hits']:>10}{r['evictions']:>11}", flush=True)
                if not r["consistent"]:
                    wrong.append(f"{policy} {capacity} slots, {r['candidates']}: the directory is inconsistent")
            if policy == "future" and (pair[0]["hits"], pair[0]["evictions"]) != (pair[1]["hits"], pair[1]["evictions"]):
                wrong.append(f"future {capacity} slots: {pair[0]['hits']} hits ranking every resident, "
                             f"{pair[1]['hits']} with the incremental ranking")
    if args.json:
        write_record(args.json, results=results, wrong=wrong)
    for line in wrong:
        print(f"WRONG RESULT: {line}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
