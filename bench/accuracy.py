"""Accuracy of the reference models under fastopt's training protocol, one `fastopt train` each.

Runs every (model, dataset) pair as its own process (chronological 70/15/15 split, one random
negative per positive, batch 200, test MRR against 20 random destinations), prints a table and
writes JSON with the date, machine, commit and the exact commands.

    python bench/accuracy.py --json bench/results/accuracy.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from _meta import git_commit

REPO = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_one(model: str, dataset: str, epochs: int, extra: list) -> dict:
    cmd = ["fastopt", "train", "--dataset", dataset, "--model", model, "--epochs", str(epochs),
           "--batch-size", "200", "--no-progress"] + extra
    print("+", shlex.join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        return {"model": model, "dataset": dataset, "command": shlex.join(cmd), "error": proc.stderr[-2000:]}
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    summary["command"] = shlex.join(cmd)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["tgn", "jodie", "apan", "tgat"])
    p.add_argument("--datasets", nargs="+", default=["wikipedia", str(REPO.parent / "shared" / "data" / "CollegeMsg.txt.gz")])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="more `fastopt train` flags after --")
    args = p.parse_args(argv)
    extra = [a for a in args.extra if a != "--"]
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": cpu_model(),
              "cores": os.cpu_count(), "commit": git_commit(), "command": shlex.join([sys.executable] + sys.argv),
              "runs": []}
    for dataset in args.datasets:
        for model in args.models:
            record["runs"].append(run_one(model, dataset, args.epochs, extra))
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(record, indent=2, default=float))
    print(f"\n{'model':<6} {'dataset':<12} {'AP':>7} {'AUC':>7} {'AP ind':>7} {'MRR':>7} {'s/epoch':>8}")
    for r in record["runs"]:
        if "error" in r:
            print(f"{r['model']:<6} {Path(r['dataset']).name[:12]:<12} failed")
            continue
        t = r["test"]
        ep = sum(r["epoch_seconds"]) / max(len(r["epoch_seconds"]), 1)
        print(f"{r['model']:<6} {r['dataset'][:12]:<12} {t['ap']:7.4f} {t['auc']:7.4f} "
              f"{t.get('ap_inductive', float('nan')):7.4f} {t.get('mrr', float('nan')):7.4f} {ep:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
