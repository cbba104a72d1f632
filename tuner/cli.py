"""``fastopt tune``, ``fastopt export`` and ``fastopt configs``: the tuner's commands, added to
``fastopt``'s parser.

``fastopt tune`` takes the run flags of ``fastopt train`` (dataset, model, hyperparameters,
device, seed, ``--config``) for the baseline config, searches the knobs of
:mod:`fastopt.tuner.space` in an Optuna study (a progress bar with the best so far on a terminal,
else one line per trial)
and writes the best trial as a :class:`~fastopt.tuner.TuningRecord` JSON file; stopped by Ctrl-C
or SIGTERM (a scheduler, ``timeout``), it writes the record of the trials that finished and exits
with 130 or 143. ``fastopt export``
writes the record of an existing study, finished or not. ``fastopt configs list`` shows the
records ``config="auto"`` can pick (``tuner.records_dir``, then those shipped in the package) and
``fastopt configs show`` one of them in full.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from fastopt.errors import ConfigError

__all__ = ["add_configs", "add_export", "add_tune"]


def add_tune(sub, add_run_flags: Callable, build_config: Callable) -> None:
    """The ``tune`` subcommand; ``add_run_flags`` and ``build_config`` are ``fastopt train``'s."""
    p = sub.add_parser("tune", help="search the fastest knobs for a model, dataset and device (Optuna)")
    add_run_flags(p, None)
    p.add_argument("--batch-size", type=int, default=None, help="the baseline's batch size (default 200)")
    p.add_argument("--edge-dim", type=int, default=None, help="random edge features of this width when the data has none")
    p.add_argument("--trials", type=int, default=None,
                   help="finished trials the study should hold, the baseline's included (default 40); "
                        "a resumed study runs those left")
    p.add_argument("--timeout", type=float, default=None, help="wall seconds the study may take: no trial starts that would end later "
                   "at the pace of the last trials")
    p.add_argument("--storage", default=None,
                   help="SQLite file or RDB URL, e.g. sqlite:///tune.db or postgresql://user@host/db "
                        "(default fastopt-tune.db); a study there of the same name resumes")
    p.add_argument("--study-name", default=None, help="default <model>-<dataset>-<device>")
    p.add_argument("--batch-sizes", default=None, metavar="B1,B2",
                   help="batch sizes to search, comma-separated (they change what the model learns; "
                        "default: the baseline's alone)")
    p.add_argument("--max-device-memory", type=float, default=None, metavar="GB",
                   help="device memory a trial may hold while it trains (CUDA; the check against eager, "
                        "which holds an eager copy of the model, runs outside it); trials above it are pruned")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per trial (default 5)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per trial, at most the rest of the epoch (default 1000)")
    p.add_argument("--trial-seconds", type=float, default=None, metavar="S",
                   help="wall seconds one trial may take, or it is pruned (default 60; 0 = no limit)")
    p.add_argument("--out", default=None,
                   help="folder for the record (default tuner.records_dir, else the working directory)")
    p.add_argument("--no-progress", action="store_true",
                   help="a line per trial, not a progress bar, on a terminal too")
    p.set_defaults(func=lambda args: _cmd_tune(args, build_config))


def add_export(sub) -> None:
    """The ``export`` subcommand."""
    p = sub.add_parser("export", help="write the tuning record of an existing study")
    p.add_argument("--storage", default=None, help="SQLite file or RDB URL (default fastopt-tune.db)")
    p.add_argument("--study-name", required=True, help="the study to export")
    p.add_argument("--out", default=".", help="folder for the record (default the working directory)")
    p.set_defaults(func=_cmd_export)


def add_configs(sub) -> None:
    """The ``configs list|show`` subcommand."""
    p = sub.add_parser("configs", help="list or show the tuning records config='auto' can pick")
    csub = p.add_subparsers(dest="configs_command", metavar="{list,show}", required=True)
    records = dict(default=None, metavar="DIR",
                   help="records folder to read instead of tuner.records_dir (the shipped records are read too)")
    lst = csub.add_parser("list", help="one line per record: device, model, dataset, measured speedup")
    lst.add_argument("--records", **records)
    lst.set_defaults(func=_cmd_configs_list)
    show = csub.add_parser("show", help="every field of one record")
    show.add_argument("record", help="a record file, or the name of one that fastopt configs list shows")
    show.add_argument("--records", **records)
    show.add_argument("--json", action="store_true", help="print the record's JSON")
    show.set_defaults(func=_cmd_configs_show)


# tune's flags setting tuner config values: flag attribute -> field
_TUNER_FLAGS = {"trials": "trials", "storage": "storage", "warmup": "warmup_steps", "steps": "steps_per_trial",
                "trial_seconds": "trial_seconds"}


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
    with _sigterm_interrupts() as received:
        run = tune(graph, args.model, cfg, trials=tu.trials, timeout=args.timeout, storage=tu.storage,
                   study_name=args.study_name, batch_sizes=sizes, max_device_memory=limit,
                   window=Window.of(cfg), say=lambda line: print(line, flush=True),
                   progress=not args.no_progress)
    if run.interrupted and run.record is None:
        print("fastopt tune: no trial had finished; no record written", flush=True)
    else:
        record = run.record or record_from_study(run.study)  # raises, naming why no trial completed
        path = record.save(args.out or tu.records_dir or ".")
        print(_summary(record, path))
    if run.interrupted:  # as a shell reports a command the signal ended
        return 128 + (received[0] if received else signal.SIGINT)
    return 0


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM (a scheduler's or ``timeout``'s stop) raises KeyboardInterrupt in the block, as
    Ctrl-C does, so that :func:`~fastopt.tuner.study.tune` stops the study and the finished
    trials' record is still written; yields the signals received."""
    received: List[int] = []

    def interrupt(signum, frame):
        received.append(signum)
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: signals cannot be handled here
        yield received
        return
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


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


def _visible_dirs(records: Optional[str]) -> List[Path]:
    """The folders ``config="auto"`` reads, with ``--records`` in place of tuner.records_dir."""
    from fastopt.config import default_config
    from fastopt.tuner.records import records_dirs

    cfg = default_config().copy()
    if records is not None:
        cfg.set("tuner.records_dir", records)
    return records_dirs(cfg)


def _cmd_configs_list(args) -> int:
    from fastopt.tuner.records import SHIPPED_RECORDS, read_records

    for folder in _visible_dirs(args.records):
        role = "shipped with fastopt" if folder == SHIPPED_RECORDS else "tuner.records_dir"
        found = read_records([folder])
        print(f"{folder} ({role}): {len(found)} record(s)" + ("" if folder.is_dir() else ", no such folder"))
        for path, record in found:
            print(f"  {path.name}: {_device_text(record.device)} | {_model_text(record.model)} | "
                  f"{_dataset_text(record.dataset)} | {_speedup_text(record)}")
    return 0


def _cmd_configs_show(args) -> int:
    from fastopt.tuner.records import TuningRecord

    path = _find_record_file(args.record, _visible_dirs(args.records))
    record = TuningRecord.load(path)
    if args.json:
        print(record.to_json())
        return 0
    m = record.measurement
    study = record.study
    values = "\n".join(f"  {k} = {v}" for k, v in record.values.items()) or "  (the baseline's values)"
    limit = m.get("max_device_memory")
    lines = [
        f"record: {path}",
        f"device: {_device_text(record.device)}",
        f"model: {_model_text(record.model)}, key {record.model.get('key')}, fanouts {record.model.get('fanouts')}",
        f"dataset: {_dataset_text(record.dataset)}",
        f"values:\n{values}",
        f"step: {_ms(record.step_seconds)} best, {_ms(record.default_step_seconds)} baseline "
        f"({_speedup_text(record)})",
        f"epoch: {_s(record.epoch_seconds)} best, {_s(record.default_epoch_seconds)} baseline",
        f"measured: {m.get('timing') or '?'} timing, {m.get('warmup', '?')} warm-up + {m.get('timed', '?')} "
        f"timed steps, device memory limit {f'{limit / 2**30:.1f} GB' if limit else 'none'}, "
        + (f"medians of {m['confirm_rounds']} confirmation round(s)" if m.get("confirm_rounds")
           else "one window per trial"),
        "versions: " + ", ".join(f"{k} {v or '-'}" for k, v in record.versions.items()),
        f"study: {study.get('name', '?')} ({study.get('model_name', '?')}), {study.get('trials', '?')} trial(s), "
        f"{study.get('complete', 0)} complete, {study.get('pruned', 0)} pruned, best trial "
        f"{study.get('best_trial', '?')}",
        f"created: {record.created or '?'}",
    ]
    print("\n".join(lines))
    return 0


def _find_record_file(name: str, dirs: List[Path]) -> Path:
    """``name`` as a file, else the record of that file name (``.json`` optional) in ``dirs``."""
    from fastopt.tuner.records import RecordError

    if Path(name).is_file():
        return Path(name)
    file = name if name.endswith(".json") else f"{name}.json"
    for folder in dirs:
        if (folder / file).is_file():
            return folder / file
    raise RecordError(f"tuning record {name!r} is neither a file nor a record in "
                      f"{', '.join(str(d) for d in dirs)}; fastopt configs list names the records there "
                      f"(--records DIR reads another folder)")


def _device_text(device: Dict[str, str]) -> str:
    capability = device.get("capability")
    return device.get("name", "?") + (f" (sm {capability})" if capability not in (None, "cpu") else "")


def _model_text(model: Dict[str, Any]) -> str:
    return f"{model.get('family', '?')} ({model.get('parameters', 0):,} parameters)"


def _dataset_text(ds: Dict[str, Any]) -> str:
    return (f"{ds.get('name', '?')}: {ds.get('nodes', 0):,} nodes, {ds.get('events', 0):,} events, "
            f"features {ds.get('edge_dim', 0)}/{ds.get('node_dim', 0)} (edge/node), degree p50 "
            f"{ds.get('degree_p50', 0):g} p99 {ds.get('degree_p99', 0):g} max {ds.get('degree_max', 0):g}")


def _speedup_text(record) -> str:
    speedup = record.speedup
    return f"{speedup:.2f}x the defaults" if speedup else "no baseline measured"


def _ms(seconds: Optional[float]) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds else "-"


def _s(seconds: Optional[float]) -> str:
    return f"{seconds:.3f} s" if seconds else "-"
