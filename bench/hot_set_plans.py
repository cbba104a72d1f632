"""Hot-set planning at scale: the time an epoch's start spends choosing a static hot set.

At each split's epoch start a cached table with a static hot set ranks its rows by the uses its
last epoch counted (``TableCache.begin_split``), once per run of the epoch with
``cache.hot_set_phases`` > 1. This runs on the training thread, so at 50 M rows it is part of
every epoch. The script builds use counts shaped like a chronological edge table's (a run of the
epoch reads its own stretch of events and, less often, any earlier one), times
``runtime.run_plans.RunPlans`` per number of runs (at the epoch's start: run 0's; the rest on
its thread), and checks every plan against a brute force ranking (all used rows sorted by count,
descending, then id); a plan that differs is printed and the script exits with status 1. ``begin_epoch``: the whole epoch start of a zero-copy
SlimCache on the CPU (plans, the first run's install, the new counts), checked to leave the
first run's set in the slots.

Usage::

    python bench/hot_set_plans.py [--rows 50000000] [--budget 0.1] [--phases 1 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from _meta import write_record
from fastopt.runtime.run_plans import RunPlans


def synthetic_uses(rows: int, runs: int, reads: int, seed: int) -> torch.Tensor:
    """Uses ``[runs, rows]``: each run ``reads`` reads, two thirds inside its own stretch of the
    rows, one third anywhere before its end (heavier towards it)."""
    rng = np.random.default_rng(seed)
    used = torch.zeros(runs, rows, dtype=torch.int32)
    for p in range(runs):
        lo, hi = p * rows // runs, (p + 1) * rows // runs
        local = rng.integers(lo, hi, size=2 * reads // 3)
        past = (hi * np.sqrt(rng.random(reads - local.size))).astype(np.int64)
        used[p] = torch.from_numpy(np.bincount(np.concatenate([local, past]), minlength=rows).astype(np.int32))
    return used


def brute_force(uses: np.ndarray, capacity: int) -> np.ndarray:
    """Every used row by (count descending, id), the first ``capacity``."""
    ids = np.flatnonzero(uses > 0)
    return ids[np.lexsort((ids, -uses[ids]))][:capacity]


def reference_plans(used: torch.Tensor, phases: int, capacity: int) -> list:
    """The plans :class:`RunPlans` documents, from :func:`brute_force`."""
    u = used.numpy().astype(np.int64)
    total = brute_force(u.sum(0), capacity)
    if phases == 1 or total.size < capacity:
        return [total]
    last, plans = u.shape[0], []
    for p in range(phases):
        rows = [r for r in range(last) if r * phases // last == p] or [p * last // phases]
        hot = brute_force(u[rows].sum(0), capacity)
        plans.append(np.concatenate([hot, total[~np.isin(total, hot)]])[:capacity])
    return plans


def epoch_start(used: torch.Tensor, phases: int, budget: float, repeats: int, want: np.ndarray):
    """Seconds of ``SlimCache.begin_epoch`` for a training epoch whose last epoch counted ``used``
    (a zero-copy cache of a 1-wide table on the CPU: plans, the first run's install, the new
    counts), best of ``repeats``; and whether the slots then hold the first run's set ``want``."""
    from fastopt.codegen import cached_rows
    from fastopt.config import CacheConfig
    from fastopt.runtime import SlimCache

    times = []
    for _ in range(repeats):  # a cache each time: the first run's rows all come in
        cache = SlimCache({"edge": torch.zeros(used.shape[1], 1)}, read_rows=cached_rows,
                          config=CacheConfig(budget_fraction=budget, host_reads="zero_copy", policy="static"))
        cache.plan([{"edge": torch.arange(1)}], split="train")
        table = cache._tables["edge"]
        cache.begin_epoch("train", phases, phases)
        table.seen.copy_(used)  # the epoch's counts, as the staging threads leave them
        cache.begin_epoch("val", 1, 1)
        t0 = time.perf_counter()
        cache.begin_epoch("train", phases, phases)
        times.append(time.perf_counter() - t0)
        table.runs.join()
    held = torch.nonzero(cache.slot_map("edge") >= 0).flatten().numpy()
    # a set smaller than the capacity leaves earlier residents beside it
    return min(times), bool(np.isin(want, held).all()) and held.size <= cache.capacity("edge")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=50_000_000)
    ap.add_argument("--budget", type=float, default=0.1, help="capacity as a fraction of the rows")
    ap.add_argument("--phases", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reads", type=float, default=0.6, help="reads per run, as a fraction of the rows")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    capacity = int(args.rows * args.budget)
    rows, failed = [], False
    for phases in args.phases:
        used = synthetic_uses(args.rows, phases, int(args.reads * args.rows), seed=phases)
        starts, times = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            runs = RunPlans(used, phases, capacity)
            starts.append(time.perf_counter() - t0)
            plans = runs.all()
            times.append(time.perf_counter() - t0)
        want = reference_plans(used, phases, capacity)
        ok = len(plans) == len(want) and all(np.array_equal(a.numpy(), b) for a, b in zip(plans, want))
        begin, installed = epoch_start(used, phases, args.budget, args.repeats, want[0])
        failed |= not (ok and installed)
        rows.append({"phases": phases, "rows": args.rows, "capacity": capacity, "plans": len(plans),
                     "start_seconds": min(starts), "seconds": min(times), "median_seconds": float(np.median(times)),
                     "begin_epoch_seconds": begin, "verified": ok, "installed": installed})
        print(f"{phases:>6} runs  {len(plans):>2} plans  at the start {min(starts):6.3f} s  all {min(times):6.3f} s  "
              f"begin_epoch {begin:6.3f} s (best of {args.repeats})  "
              f"{'ok' if ok and installed else 'PLANS DIFFER FROM THE BRUTE FORCE RANKING' if not ok else 'SLOTS DO NOT HOLD RUN 0'}",
              flush=True)
    if args.json:
        write_record(args.json, threads=torch.get_num_threads(), results=rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
