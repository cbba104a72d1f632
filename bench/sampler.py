"""Temporal sampler benchmark: roots/s and epoch sampling time, Cython sampler vs the NumPy oracle.

Settings: TGN's (1 layer x 10 most recent) and TGAT's (2 layers x 10 uniform). One epoch walks
the whole event stream in chronological batches of ``--batch`` events; the roots of a batch are
its sources, its destinations and one negative destination per event drawn uniformly from the
destination pool with a fixed seed (3 x batch roots, drawn before timing). Every batch is
sampled to completion: all layers, the returned torch tensors and, with dedup, the unique node
and edge ids with inverse indices. The time pointers are reset at the start of every epoch. The
figure kept per configuration is the best of ``--repeats`` epochs (other work on the machine only
ever slows a run down). The NumPy oracle is measured in the same run on ``--oracle-batches``
batches spread evenly over the epoch, and its epoch time is extrapolated from them.

Before it is timed, every Cython configuration is checked against the oracle on
``--check-batches`` batches spread over the epoch: with ``recent``, every field of every layer
and the unique ids equal the oracle's; with ``uniform`` (other draws), every neighbor is an event
of its destination node strictly before its time with the right node, time and time gap, and each
row holds the oracle's number of neighbors (all candidates, the oracle's set, when fewer than
``k``). A mismatch is printed and the script exits with status 1.

Usage::

    python bench/sampler.py --json out.json [--datasets wikipedia ...] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import fastopt  # noqa: F401  (first: sets the OpenMP wait policy before torch loads it)
import numpy as np
import torch

from _meta import git_commit
from fastopt.data import load_dataset
from fastopt.runtime import OPENMP, TemporalSampler
from fastopt.sampling import NumpySampler

REPO = Path(__file__).resolve().parents[1]
DATASETS = {"wikipedia": "wikipedia.csv.gz", "email-Eu-core-temporal": "email-Eu-core-temporal.txt.gz",
            "sociopatterns-SFHH": "sociopatterns-SFHH.txt.gz"}
SETTINGS = {"tgn": ([10], "recent"), "tgat": ([10, 10], "uniform")}
TARGETS = {"tgn": 4.4e6, "tgat": 0.40e6}  # issue 3: roots/s on wikipedia with 2 threads
# read by libgomp when torch loads it: recorded with the results and in the command line
OPENMP_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "OMP_PROC_BIND")


def epoch_batches(graph, batch: int, seed: int, max_events: int = 0):
    """Roots and times of every batch of one chronological epoch (sources, destinations,
    negatives), over the first ``max_events`` events (0: all)."""
    rng = np.random.default_rng(seed)
    pool = graph.destination_pool()
    events = min(graph.num_events, max_events) if max_events > 0 else graph.num_events
    out = []
    for start in range(0, events, batch):
        e = slice(start, min(start + batch, events))
        n = e.stop - e.start
        out.append((np.concatenate([graph.src[e], graph.dst[e], rng.choice(pool, n)]),
                    np.concatenate([graph.ts[e]] * 3)))
    return out


FIELDS = ("dst_nodes", "dst_times", "nbr_nodes", "nbr_eids", "nbr_times", "dt", "mask", "indptr")


def _uniform_mismatch(graph, block, live: torch.Tensor, oracle: NumpySampler) -> str:
    """What is wrong with one layer of uniform draws, judged against ``graph`` and ``oracle``."""
    ref = oracle.sample(block.dst_nodes.numpy(), block.dst_times.numpy()).blocks[0]
    counts, want = block.mask.sum(1), ref.counts().masked_fill(~live, 0)
    if not torch.equal(counts, want):
        return f"neighbor counts differ from the oracle's in {int((counts != want).sum())} rows"
    if not (torch.equal(block.indptr.diff(), counts)
            and torch.equal(block.mask, torch.arange(block.fanout) < counts[:, None])):
        return "the mask does not hold each row's valid entries first, or indptr disagrees with it"
    eids = block.nbr_eids[block.mask]
    rows = torch.arange(block.num_dst).repeat_interleave(counts)
    node, time = block.dst_nodes[rows], block.dst_times[rows]
    src, dst = torch.from_numpy(graph.src)[eids], torch.from_numpy(graph.dst)[eids]
    ts = torch.from_numpy(graph.ts)[eids]
    checks = {"an event not touching its node": (src == node) | (dst == node),
              "a neighbor not strictly earlier than its root": ts < time,
              "a wrong neighbor node": block.nbr_nodes[block.mask] == torch.where(src == node, dst, src),
              "a wrong neighbor time": block.nbr_times[block.mask] == ts,
              "a wrong time gap": block.dt[block.mask] == (time - ts).float()}
    for what, ok in checks.items():
        if not bool(ok.all()):
            return f"{what} in {int((~ok).sum())} entries"
    full = (counts < block.fanout) & live  # every candidate taken: the oracle's set
    mine, theirs = block.nbr_eids[full].sort(1).values, ref.nbr_eids[full].sort(1).values
    if not torch.equal(mine, theirs):
        return "rows with fewer candidates than k hold other events than the oracle's"
    return ""


def oracle_mismatches(graph, sampler, fanouts, strategy: str, batches, seed: int) -> list:
    """Where ``sampler`` disagrees with the NumPy oracle on ``batches`` (empty: it agrees)."""
    found = []
    if strategy == "recent":
        oracle = NumpySampler(graph, fanouts, strategy, seed=seed)
    else:
        layers = {k: NumpySampler(graph, [k], strategy, seed=seed) for k in set(fanouts)}
    sampler.reset()
    for i, (roots, times) in enumerate(batches):
        got = sampler.sample(roots, times)
        if strategy == "recent":
            want = oracle.sample(roots, times)
            wrong = [f"layer {l} {name}" for l, (a, b) in enumerate(zip(got.blocks, want.blocks))
                     for name in FIELDS if not torch.equal(getattr(a, name), getattr(b, name))]
            if got.unique_nodes is not None and not torch.equal(got.unique_nodes.values,
                                                                want.unique_nodes.values):
                wrong.append("unique node ids")
            found += [f"batch {i}: {w} differs from the oracle's" for w in wrong]
            continue
        live = torch.ones(len(roots), dtype=torch.bool)
        for l, block in enumerate(got.blocks):
            what = _uniform_mismatch(graph, block, live, layers[block.fanout])
            if what:
                found.append(f"batch {i} layer {l}: {what}")
            live = block.mask.reshape(-1)
    sampler.reset()
    return found


def time_epochs(sampler, batches, repeats: int) -> float:
    """Best wall time of ``repeats`` epochs over ``batches``."""
    best = float("inf")
    for _ in range(repeats):
        sampler.reset()
        start = time.perf_counter()
        for roots, times in batches:
            sampler.sample(roots, times)
        best = min(best, time.perf_counter() - start)
    return best


def environment() -> dict:
    """Date, machine, load, versions and commit of this run."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"cpu_model": models[0] if models else platform.processor(),
                    "logical_cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
                    "load_average_at_start": list(os.getloadavg()), "host": platform.node()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "numpy": np.__version__, "openmp": bool(OPENMP)},
        "commit": git_commit(),
        "openmp_env": {k: os.environ[k] for k in OPENMP_ENV if k in os.environ},
        "command": " ".join([f"{k}={shlex.quote(os.environ[k])}" for k in OPENMP_ENV if k in os.environ]
                            + ["python"] + [shlex.quote(a) for a in sys.argv]),
    }


def run(args) -> dict:
    report = environment()
    report.update(batch_events=args.batch, repeats=args.repeats, seed=args.seed,
                  max_events=args.max_events, results=[], oracle_mismatches=[])
    for name in args.datasets:
        path = Path(args.data_dir) / DATASETS[name]
        graph = load_dataset(path if path.exists() else name)
        batches = epoch_batches(graph, args.batch, args.seed, args.max_events)
        checked = batches[:: max(1, len(batches) // args.check_batches)]
        roots = sum(r.shape[0] for r, _ in batches)
        for setting, (fanouts, strategy) in SETTINGS.items():
            rows = []
            oracle = NumpySampler(graph, fanouts, strategy, seed=args.seed)
            spread = batches[:: max(1, len(batches) // args.oracle_batches)]  # early and late ones
            seconds = time_epochs(oracle, spread, 1) * len(batches) / len(spread)
            rows.append(dict(sampler="numpy-oracle", threads=1, dedup=True, epoch_s=seconds))
            for threads in args.threads:
                for dedup in (True, False):
                    fast = TemporalSampler(graph, fanouts, strategy, threads=threads, seed=args.seed,
                                           reorder=args.reorder, pin_threads=args.pin, dedup=dedup)
                    for wrong in oracle_mismatches(graph, fast, fanouts, strategy, checked, args.seed):
                        line = f"{name} {setting} threads={threads} dedup={dedup}: {wrong}"
                        report["oracle_mismatches"].append(line)
                        print(f"WRONG RESULT: {line}", flush=True)
                    rows.append(dict(sampler="cython", threads=threads, dedup=dedup,
                                     epoch_s=time_epochs(fast, batches, args.repeats),
                                     placement=None if fast.placement is None else fast.placement.reason))
            for row in rows:
                row.update(dataset=name, setting=setting, fanouts=fanouts, strategy=strategy,
                           batches=len(batches), roots=roots, roots_per_s=roots / row["epoch_s"])
                if name == "wikipedia" and row["sampler"] == "cython" and row["threads"] == 2:
                    row["target_roots_per_s"] = TARGETS[setting]
                report["results"].append(row)
                print_row(row)
    report["machine"]["load_average_at_end"] = list(os.getloadavg())
    return report


def print_row(row: dict) -> None:
    if not getattr(print_row, "header", False):
        print(f"{'dataset':<24}{'setting':<7}{'sampler':<14}{'thr':>4}{'dedup':>7}"
              f"{'M roots/s':>11}{'epoch s':>10}{'target':>9}")
        print_row.header = True
    target = row.get("target_roots_per_s")
    print(f"{row['dataset']:<24}{row['setting']:<7}{row['sampler']:<14}{row['threads']:>4}"
          f"{'yes' if row['dedup'] else 'no':>7}{row['roots_per_s'] / 1e6:>11.3f}{row['epoch_s']:>10.3f}"
          f"{'' if target is None else f'{target / 1e6:.2f}':>9}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--data-dir", default=os.environ.get("FASTOPT_SHARED_DATA", str(REPO.parent / "shared" / "data")))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--batch", type=int, default=600, help="events per batch (roots = 3x)")
    parser.add_argument("--repeats", type=int, default=5, help="epochs per configuration; the best counts")
    parser.add_argument("--oracle-batches", type=int, default=40,
                        help="batches the NumPy oracle samples, spread over the epoch")
    parser.add_argument("--check-batches", type=int, default=20,
                        help="batches, spread over the epoch, each configuration is checked on "
                             "against the oracle before it is timed")
    parser.add_argument("--max-events", type=int, default=0,
                        help="walk only the first N events (0 = the whole stream)")
    parser.add_argument("--reorder", default="none", choices=["none", "degree", "rcm"])
    parser.add_argument("--pin", action="store_true", help="pin sampler threads (pin_threads=True)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    report = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if report["oracle_mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
