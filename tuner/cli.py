"""``fastopt tune`` and ``fastopt export``: the tuner's commands, added to ``fastopt``'s parser.

``fastopt tune`` takes the run flags of ``fastopt train`` (dataset, model, hyperparameters,
device, seed, ``--config``) for the baseline config, searches the knobs of
:mod:`fastopt.tuner.space` in an Optuna study (one progress line per trial, with the best so far)
and writes the best trial as a :class:`~fastopt.tuner.TuningRecord` JSON file. ``fastopt export``
writes the record of an existing study, finished or not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional

from fastopt.errors import ConfigError

__all__ = ["add_export", "add_tune"]


def add_tune(sub, add_run_flags: Callable, build_config: Callable) -> None:
    """The ``tune`` subcommand; ``add_run_flags`` and ``build_config`` are ``fastopt train``'s."""
    p = sub.add_parser("tune", help="search the fastest knobs for a model, dataset and device (Optuna)")
    add_run_flags(p, None)
    p.add_argument("--batch-size", type=int, default=None, help="the baseline's batch size (default 200)")
    p.add_argument("--edge-dim", type=int, default=None, help="random edge features of this width when the data has none")
    p.add_argument("--trials", type=int, default=None,
                   help="finished trials the study should hold, the baseline's included (default 40); "
                        "a resumed study runs those left")
    p.add_argument("--timeout", type=float, default=None, help="seconds after which no new trial starts")
    p.add_argument("--storage", default=None,
                   help="SQLite file or RDB URL, e.g. sqlite:///tune.db or postgresql://user@host/db "
                        "(default fastopt-tune.db); a study there of the same name resumes")
    p.add_argument("--study-name", default=None, help="default <model>-<dataset>-<device>")
    p.add_argument("--batch-sizes", default=None, metavar="B1,B2",
                   help="batch sizes to search, comma-separated (they change what the model learns; "
                        "default: the baseline's alone)")
    p.add_argument("--max-device-memory", type=float, default=None, metavar="GB",
                   help="device memory a trial may hold (CUDA); trials above it are pruned")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per trial (default 5)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per trial (default 50)")
    p.add_argument("--out", default=None,
                   help="folder for the record (default tuner.records_dir, else the working directory)")
    p.set_defaults(func=lambda args: _cmd_tune(args, build_config))


def add_export(sub) -> None:
    """The ``export`` subcommand."""
    p = sub.add_parser("export", help="write the tuning record of an existing study")
    p.add_argument("--storage", default=None, help="SQLite file or RDB URL (default fastopt-tune.db)")
    p.add_argument("--study-name", required=True, help="the study to export")
    p.add_argument("--out", default=".", help="folder for the record (default the working directory)")
    p.set_defaults(func=_cmd_export)


# tune's flags setting tuner config values: flag attribute -> field
_TUNER_FLAGS = {"trials": "trials", "storage": "storage", "warmup": "warmup_steps", "steps": "steps_per_trial"}


def _cmd_tune(args, build_config: Callable) -> int:
    from fastopt.data import load_dataset
    from fastopt.tuner.objective import Window
    from fastopt.tuner.storage import storage_url
    from fastopt.tuner.study import record_from_study, tune

    cfg = build_config(args)
    for flag, name in _TUNER_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            try:
                cfg.set(f"tuner.{name}", value)
            except ConfigError as exc:
                raise ConfigError(f"--{flag} {value}: {exc}") from None
    sizes = _batch_sizes(args.batch_sizes)
    limit = _memory_limit(args.max_device_memory)
    if args.timeout is not None and not args.timeout > 0:
        raise ConfigError(f"--timeout must be > 0 seconds (got {args.timeout}); leave it out to run "
                          f"every trial")
    tc, tu = cfg.train, cfg.tuner
    graph = load_dataset(args.dataset, edge_dim=tc.edge_dim, node_dim=tc.node_dim, seed=tc.seed)
    print(f"fastopt tune: {args.model} on {graph.name} ({graph.num_events:,} events), {tu.trials} "
          f"trials of {tu.warmup_steps} + {tu.steps_per_trial} steps, storage {storage_url(tu.storage)}",
          flush=True)
    run = tune(graph, args.model, cfg, trials=tu.trials, timeout=args.timeout, storage=tu.storage,
               study_name=args.study_name, batch_sizes=sizes, max_device_memory=limit,
               window=Window(tu.warmup_steps, tu.steps_per_trial), say=lambda line: print(line, flush=True))
    record = run.record or record_from_study(run.study)  # raises, naming why no trial completed
    path = record.save(args.out or tu.records_dir or ".")
    print(_summary(record, path))
    return 0


def _cmd_export(args) -> int:
    from fastopt.config import default_config
    from fastopt.tuner.study import export_record

    record, path = export_record(args.storage or default_config().tuner.storage, args.study_name, args.out)
    print(_summary(record, path))
    return 0


def _summary(record, path: Path) -> str:
    values = " ".join(f"{k}={v}" for k, v in record.values.items()) or "the baseline's values"
    line = f"best: {record.epoch_seconds:.3f} s/epoch, step {record.step_seconds * 1e3:.2f} ms ({values})"
    if record.default_epoch_seconds:
        line += (f"; baseline {record.default_epoch_seconds:.3f} s/epoch, step "
                 f"{record.default_step_seconds * 1e3:.2f} ms ({record.speedup:.2f}x)")
    return f"{line}\nwrote {path}"


def _batch_sizes(text: Optional[str]) -> Optional[List[int]]:
    if text is None:
        return None
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--batch-sizes {text!r} must be comma-separated batch sizes >= 1, e.g. 200,600")
    return sizes


def _memory_limit(gigabytes: Optional[float]) -> Optional[int]:
    if gigabytes is None:
        return None
    if not gigabytes > 0:
        raise ConfigError(f"--max-device-memory must be > 0 GB (got {gigabytes}); leave it out for no limit")
    return int(gigabytes * 2**30)
