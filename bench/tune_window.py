"""Whether the tuner's trial window times the steady training step.

A trial (``fastopt tune``) times a window of epoch 0 (:func:`fastopt.tuner.objective.measure_window`;
by default the rest of the epoch after the warm-up) and multiplies its mean step by the epoch's
batches. This script builds a trainer for the
default config as a trial does, checks it against eager as a trial does
(:func:`~fastopt.tuner.objective.check_against_eager`), times the window, then trains
``--epochs`` whole epochs with the same trainer and times the window once more::

    python bench/tune_window.py --model tgat --json bench/results/tune-window.json

One line each: the window's estimate of an epoch (mean step times batches; its steps' 10th and
90th percentiles; the steps captured in it) and the trained epochs (wall seconds, the ``step``
stage). ``--no-plan`` leaves the shape plan out (``pipeline.shape_plans`` off: the window's
lengths grow as the history fills, as every trial's did before
:meth:`~fastopt.trainer.Trainer.plan_shapes`); ``--profile N`` prints the N costliest functions
of the first window under cProfile (host time: where a window slower than its epochs goes).

A check, not a comparison against eager: a model whose outputs or gradients disagree with eager
prints ``WRONG RESULT`` and the script exits with status 1.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from typing import Any, Dict

from _meta import write_record
from epoch_profile import add_run_arguments, report_wrong
from fastopt.config import default_config
from fastopt.data import load_dataset
from fastopt.errors import FastOptError
from fastopt.models import build_model
from fastopt.tuner.objective import Window, check_against_eager, measure_window
from fastopt.tuner.study import default_trainer


def window_line(trainer, window: Window, label: str, profile: int = 0) -> Dict[str, Any]:
    """Time ``window`` on ``trainer`` (under cProfile with ``profile`` rows) and print a line."""
    graphs = trainer.step_graphs
    before = graphs.captures if graphs is not None else 0
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        result = prof.runcall(measure_window, trainer, window)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(profile)
    else:
        result = measure_window(trainer, window)
    steps = sorted(result.steps)
    row = {"what": label, "epoch_s": result.epoch_seconds, "step_ms": result.step_seconds * 1e3,
           "p10_ms": steps[len(steps) // 10] * 1e3, "p90_ms": steps[(9 * len(steps)) // 10] * 1e3,
           "captures": (graphs.captures - before) if graphs is not None else 0,
           "warmup_s": result.warmup_seconds}
    print(f"{label:<24} {row['epoch_s']:8.3f} s/epoch  step {row['step_ms']:7.2f} ms "
          f"(p10 {row['p10_ms']:.2f}, p90 {row['p90_ms']:.2f})  captures {row['captures']}  "
          f"warm-up {row['warmup_s']:.1f} s", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(p)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--no-plan", action="store_true", help="pipeline.shape_plans off")
    p.add_argument("--profile", type=int, default=0, help="cProfile rows of the first window")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cfg = default_config().copy()
    cfg.train.batch_size = args.batch_size
    if args.no_plan:
        cfg.pipeline.shape_plans = False
    graph = load_dataset(args.dataset, edge_dim=args.edge_dim)
    window = Window.of(cfg)
    trainer = default_trainer(args.model, graph)(cfg)
    try:
        check_against_eager(lambda c: build_model(args.model, graph, c))(trainer)
    except FastOptError as exc:
        return report_wrong([f"optimized {args.model}: {exc}"])
    print(f"{args.model} on {args.dataset}, batch {args.batch_size}, on {trainer.device}; window "
          f"{window.warmup} + {window.timed} steps; shape plan {'off' if args.no_plan else 'on'}", flush=True)
    rows = [window_line(trainer, window, "window (fresh trainer)", args.profile)]
    epochs = []
    for epoch in range(args.epochs):
        stats = trainer.train_epoch(epoch)
        epochs.append({"epoch": epoch, "seconds": stats.seconds, "step_s": stats.stages.get("step", 0.0),
                       "loss": stats.loss})
        print(f"{'epoch ' + str(epoch):<24} {stats.seconds:8.3f} s  step stage {epochs[-1]['step_s']:.3f} s  "
              f"loss {stats.loss:.4f}", flush=True)
        if not math.isfinite(stats.loss):
            return report_wrong([f"epoch {epoch}'s mean loss is not finite"])
    rows.append(window_line(trainer, window, "window (after epochs)"))
    steady = statistics.median(e["seconds"] for e in epochs[1:]) if len(epochs) > 1 else None
    if steady:
        print(f"window / steady epoch: fresh {rows[0]['epoch_s'] / steady:.2f}x, "
              f"after epochs {rows[1]['epoch_s'] / steady:.2f}x (steady {steady:.3f} s)")
    if args.json:
        write_record(args.json, model=args.model, dataset=args.dataset, batch_size=args.batch_size,
                     shape_plan=not args.no_plan, windows=rows, epochs=epochs, steady_epoch_s=steady,
                     device=str(trainer.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
