"""Accuracy of the reference models under fastopt's training protocol, one `fastopt train` each.

Runs every (model, dataset, variant, seed) as its own process (chronological 70/15/15 split, one
random negative per positive, test MRR against ``--mrr-negatives`` random destinations), ``--jobs``
at a time, prints a table of test AP per run and the mean over seeds, and writes JSON with the
date, machine, commit and the exact commands. The variants are ``fastopt`` (what `fastopt train`
runs by default: `fastopt.optimize` and whole-step CUDA graphs on a GPU) and ``eager`` (the same
command with ``--no-optimize``); ``eager-foreach`` is eager with another Adam implementation (one
update, rounded differently), whose gap to eager shows how far rounding alone moves a mean over
these seeds. With eager and fastopt, the script compares their mean test AP per model and dataset
(with the standard error of the difference) and exits with status 1 when a gap exceeds
``--max-gap`` points::

    python bench/accuracy.py --json bench/results/accuracy.json
    python bench/accuracy.py --datasets wikipedia --seeds 0 1 2 --variants eager fastopt \\
        --jobs 6 --json acc.json -- --batch-size 600 --edge-dim 172 --mrr-negatives 0
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _meta import git_commit

REPO = Path(__file__).resolve().parents[1]
# eager-foreach: the eager model with another Adam implementation, the same update rounded
# differently: its gap to eager is what rounding alone moves a mean of these seeds by
VARIANTS = {"fastopt": [], "eager": ["--no-optimize"], "eager-foreach": ["--no-optimize", "--adam", "foreach"]}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_one(model: str, dataset: str, variant: str, seed: int, epochs: int, extra: list) -> dict:
    cmd = ["fastopt", "train", "--dataset", dataset, "--model", model, "--epochs", str(epochs),
           "--seed", str(seed), "--batch-size", "200", "--no-progress"] + VARIANTS[variant] + extra
    proc = subprocess.run(cmd, capture_output=True, text=True)
    head = {"model": model, "dataset": dataset, "variant": variant, "seed": seed, "command": shlex.join(cmd)}
    if proc.returncode != 0:
        print(f"+ {shlex.join(cmd)}  (exit {proc.returncode})", flush=True)
        return {**head, "error": proc.stderr[-2000:]}
    run = {**head, **json.loads(proc.stdout.strip().splitlines()[-1])}
    # each run's figure as it ends, so that a run cut by a time limit keeps the finished ones
    print(f"+ {shlex.join(cmd)}  (exit 0, test AP {run['test']['ap']:.4f})", flush=True)
    return run


def summarize(runs: list, max_gap: float) -> tuple:
    """Mean test AP per (model, dataset, variant) and, where both variants ran, their gaps in points."""
    means, failed = {}, []
    for r in runs:
        if "error" in r:
            failed.append(r)
            continue
        means.setdefault((r["model"], Path(r["dataset"]).name, r["variant"]), []).append(r["test"]["ap"])
    rows = []
    for (model, dataset, variant), aps in sorted(means.items()):
        rows.append({"model": model, "dataset": dataset, "variant": variant, "seeds": len(aps),
                     "test_ap_mean": statistics.fmean(aps), "test_ap": aps})
    gaps = []
    for (model, dataset, variant), aps in sorted(means.items()):
        base = means.get((model, dataset, "eager"))
        if variant == "eager" or base is None:
            continue
        gap = 100 * (statistics.fmean(aps) - statistics.fmean(base))
        gaps.append({"model": model, "dataset": dataset, "variant": variant, "gap_points": gap,
                     "stderr_points": 100 * _stderr_of_difference(aps, base),
                     "within": abs(gap) <= max_gap, "judged": variant == "fastopt"})
    return rows, gaps, failed


def _stderr_of_difference(a: list, b: list) -> float:
    """Standard error of ``mean(a) - mean(b)`` for independent samples (NaN below two each)."""
    if len(a) < 2 or len(b) < 2:
        return float("nan")
    return (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["tgn", "jodie", "apan", "tgat"])
    p.add_argument("--datasets", nargs="+", default=["wikipedia", str(REPO.parent / "shared" / "data" / "CollegeMsg.txt.gz")])
    p.add_argument("--variants", nargs="+", default=["fastopt"], choices=sorted(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--jobs", type=int, default=1, help="runs at a time")
    p.add_argument("--max-gap", type=float, default=0.5, help="largest |fastopt - eager| mean test AP, points")
    p.add_argument("--json", default=None)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="more `fastopt train` flags after -- (later flags win)")
    args = p.parse_args(argv)
    extra = [a for a in args.extra if a != "--"]
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": cpu_model(),
              "cores": os.cpu_count(), "commit": git_commit(), "command": shlex.join([sys.executable] + sys.argv)}
    jobs = [(m, d, v, s) for d in args.datasets for m in args.models for v in args.variants for s in args.seeds]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        runs = list(pool.map(lambda job: run_one(*job, args.epochs, extra), jobs))
    rows, gaps, failed = summarize(runs, args.max_gap)
    record.update(runs=runs, means=rows, gaps=gaps)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2, default=float))
    print(f"\n{'model':<6} {'dataset':<12} {'variant':<13} {'seeds':>5} {'test AP (mean)':>15}  per seed")
    for r in rows:
        print(f"{r['model']:<6} {r['dataset'][:12]:<12} {r['variant']:<13} {r['seeds']:>5} "
              f"{r['test_ap_mean']:15.4f}  " + " ".join(f"{ap:.4f}" for ap in r["test_ap"]))
    for g in gaps:
        verdict = f" ({'within' if g['within'] else 'BEYOND'} {args.max_gap})" if g["judged"] else " (rounding alone)"
        print(f"{g['model']:<6} {g['dataset'][:12]:<12} {g['variant']} - eager: {g['gap_points']:+.2f} "
              f"+- {g['stderr_points']:.2f} points{verdict}")
    for r in failed:
        print(f"failed: {r['command']}\n{r['error']}", file=sys.stderr)
    return 1 if failed or not all(g["within"] for g in gaps if g["judged"]) else 0


if __name__ == "__main__":
    sys.exit(main())
