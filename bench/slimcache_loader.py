"""SlimCache through the training loader: hit rate and bytes host->device per epoch, per policy.

``bench/slimcache.py`` replays whole epochs it samples itself; this one runs the real
:class:`~fastopt.runtime.Loader` (the Trainer's sampler, host-placed edge features, its
lookahead of ``--prefetch-depths`` batches announced to the cache) for one training epoch of
``--dataset`` per stream, policy and depth, with a SlimCache on the CPU (the loader builds one on
CUDA only; on the CPU the same cache runs without copies). Every run's served edge features are
checked against the loader without a cache (a CRC of every batch's valid slots' rows, in order);
a run that serves other rows fails the benchmark (status 1). ``--edge-rows`` hands the batches
over as to a model that reads edge rows by index (TGAT): the unique rows and each slot's index,
not a row per slot. Prints a table with each run's seconds (the epoch through the loader, the
CRC left out: a loader running ahead of it still shows as the time the consumer waited), writes
JSON (``--json``)::

    python bench/slimcache_loader.py --json bench/results/slimcache-loader-cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib

import torch

from _meta import write_record
from fastopt.config import Config
from fastopt.data import load_dataset
from fastopt.runtime import CacheTable, Loader, SlimCache
from fastopt.trainer import make_sampler

STREAMS = {"tgn": ([10], "recent"), "tgat": ([10, 10], "uniform")}
"""Fanouts and sampling of the two reference streams (TGN 1x10 recent, TGAT 2x10 uniform)."""


def run_epoch(graph, stream: str, policy: str, depth: int, args) -> dict:
    """One training epoch through the loader; ``policy`` None runs it without a cache."""
    fanouts, strategy = STREAMS[stream]
    cfg = Config()
    cfg.train.device, cfg.train.batch_size, cfg.train.seed = "cpu", args.batch_size, args.seed
    cfg.cache.placement, cfg.cache.budget_fraction = "host", args.budget
    cfg.cache.policy = policy or "auto"
    cfg.pipeline.prefetch_depth = depth
    sampler = make_sampler(graph, fanouts, strategy, cfg)
    loader = Loader(graph, sampler, torch.device("cpu"), cfg, edge_rows=args.edge_rows)
    if policy is not None:
        loader.cache = SlimCache({"edge": CacheTable(loader.edge_table)}, "cpu", cfg.cache, record=True)
    sampler.reset(0)
    crc, checking, start = 0, 0.0, time.perf_counter()
    with loader.epoch("train", 0) as batches:
        for batch in batches:
            t0 = time.perf_counter()
            for i in range(len(batch.inputs.mask)):  # every layer, whatever form its edges take
                rows, index = batch.inputs.layer_edges(i)  # per-slot features, whatever the form
                # valid slots only: a padded slot reads the cache's zero row, or edge 0 without one
                valid = rows[index][batch.inputs.mask[i]]
                crc = zlib.crc32(valid.contiguous().numpy().tobytes(), crc)
            checking += time.perf_counter() - t0
    # seconds: the epoch through the loader, the bench's own checking (the CRC) left out
    row = {"stream": stream, "policy": policy or "no cache", "prefetch_depth": depth,
           "crc": f"{crc:08x}", "seconds": time.perf_counter() - start - checking}
    if policy is not None:
        cache = loader.cache
        c, best = cache.counters("edge"), cache.optimum("edge")
        row.update(resolved=cache.policy("edge"), capacity=cache.capacity("edge"), batches=c.batches,
                   hit_rate=c.hit_rate, belady_hit_rate=best.hit_rate, mb_h2d=c.bytes_h2d / 1e6,
                   mb_naive=c.naive_bytes / 1e6)
        cache.close()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="wikipedia")
    p.add_argument("--edge-dim", type=int, default=172)
    p.add_argument("--streams", nargs="+", default=list(STREAMS), choices=list(STREAMS))
    p.add_argument("--policies", nargs="+", default=["lru", "auto"],
                   choices=["lru", "future", "static", "auto"])
    p.add_argument("--prefetch-depths", nargs="+", type=int, default=[2])
    p.add_argument("--budget", type=float, default=0.10, help="cache budget, share of the table")
    p.add_argument("--batch-size", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--edge-rows", action="store_true",
                   help="hand over unique edge rows and an index per slot (TGAT's form)")
    p.add_argument("--json", help="write the record here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    graph = load_dataset(args.dataset, edge_dim=args.edge_dim)
    rows, wrong = [], []
    print(f"{'stream':6s} {'policy':9s} {'depth':>5s} {'resolved':>8s} {'hit rate':>8s} "
          f"{'Belady':>7s} {'MB h2d':>8s} {'x naive':>8s} {'seconds':>9s}")
    for stream in args.streams:
        truth = run_epoch(graph, stream, None, 0, args)
        rows.append(truth)
        for policy in args.policies:
            for depth in args.prefetch_depths:
                row = run_epoch(graph, stream, policy, depth, args)
                rows.append(row)
                if row["crc"] != truth["crc"]:
                    wrong.append(f"{stream} {policy} depth {depth}: served rows differ from the "
                                 f"loader without a cache (crc {row['crc']} != {truth['crc']})")
                print(f"{stream:6s} {policy:9s} {depth:5d} {row['resolved']:>8s} "
                      f"{row['hit_rate']:8.2%} {row['belady_hit_rate']:7.2%} {row['mb_h2d']:8.1f} "
                      f"{row['mb_naive'] / max(row['mb_h2d'], 1e-9):8.1f} {row['seconds']:9.2f}")
    for line in wrong:
        print(f"WRONG RESULT: {line}")
    if args.json:
        write_record(args.json, dataset=args.dataset, budget=args.budget, batch_size=args.batch_size,
                     edge_rows=args.edge_rows,
                     rows=rows, failures=wrong)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
