"""``fastopt`` command line: ``train``, ``bench``, ``tune``, ``export``, ``configs list|show`` and
``data info|synth``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from typing import Optional, Sequence

from fastopt.errors import FastOptError

__all__ = ["main"]


def _add_run_flags(p, epochs_help: str) -> None:
    """Flags ``train`` and ``bench`` share: data, model, its hyperparameters and the run."""
    from fastopt.models import MODELS

    p.add_argument("--dataset", default="wikipedia", help="built-in name (wikipedia, email-eu-core) or a path to an event file")
    p.add_argument("--model", default="tgn", help=f"one of {', '.join(MODELS)} (default tgn)")
    if epochs_help:
        p.add_argument("--epochs", type=int, default=None, help=epochs_help)
    p.add_argument("--device", default=None, help="auto, cpu or cuda[:N] (default auto)")
    p.add_argument("--seed", type=int, default=None, help="seed of every random choice (default 0)")
    p.add_argument("--node-dim", type=int, default=None, help="random node features of this width when the data has none")
    p.add_argument("--config", default=None, help="JSON file of config values (see `Config.to_json`); "
                   "flags override it, it overrides FASTOPT_* variables; train without it (or with "
                   "'auto') applies the tuning record matching the run (see fastopt tune)")
    model = p.add_argument_group("model hyperparameters (config group `model`)")
    model.add_argument("--fanouts", default=None,
                       help="neighbors per attention layer, comma-separated (TGN default 10, TGAT 10,10)")
    model.add_argument("--memory-dim", type=int, default=None, help="node memory width (default 100)")
    model.add_argument("--dim", type=int, default=None, help="embedding width (default 100)")
    model.add_argument("--time-dim", type=int, default=None, help="time encoding width (default 100)")
    model.add_argument("--heads", type=int, default=None, help="attention heads (default 2)")
    model.add_argument("--dropout", type=float, default=None, help="attention dropout (default 0.1)")
    model.add_argument("--mailbox-size", type=int, default=None, help="mails kept per node, APAN (default 10)")
    model.add_argument("--node-embedding", type=int, default=None, metavar="WIDTH",
                       help="a learnable row of this width per node, read beside its features; "
                            "gives TGAT something to learn from on graphs without node features "
                            "(try 100 with --lr 1e-3; default 0: none)")


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a reference TGNN for link prediction")
    _add_run_flags(p, "training epochs (default 10)")
    p.add_argument("--batch-size", type=int, default=None, help="positive events per batch (default 200)")
    p.add_argument("--lr", type=float, default=None, help="Adam learning rate (default 1e-4)")
    p.add_argument("--adam", default=None, choices=("auto", "fused", "foreach", "single"),
                   help="Adam's implementation: the same update, rounded differently (default auto)")
    p.add_argument("--edge-dim", type=int, default=None, help="random edge features of this width when the data has none")
    p.add_argument("--mrr-negatives", type=int, default=None, help="negatives per positive for test MRR (default 20)")
    p.add_argument("--patience", type=int, default=None,
                   help="stop once validation AP has not improved for this many epochs (default 0: never)")
    p.add_argument("--restore-best", action="store_true",
                   help="test the weights and state of the epoch with the best validation AP")
    p.add_argument("--log", default=None, help="JSON-lines log: the run's configuration, then one record per epoch")
    p.add_argument("--checkpoint-dir", default=None, help="write checkpoint.pt here after every epoch")
    p.add_argument("--resume", default=None, help="continue from this checkpoint.pt")
    p.add_argument("--no-optimize", action="store_true",
                   help="train the eager model (default: fastopt.optimize on CUDA, eager on the CPU)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (the per-epoch lines stay)")
    p.set_defaults(func=_cmd_train)


def _add_bench(sub) -> None:
    from fastopt.benchmark import CONTENDERS

    p = sub.add_parser("bench", help="fastopt against eager, torch.compile, TGL's data path and PyG, one run")
    _add_run_flags(p, "epochs per contender; the steady time is the median after the first (default 3)")
    p.add_argument("--batch-size", type=int, default=600, help="positive events per batch (default 600)")
    p.add_argument("--edge-dim", type=int, default=172,
                   help="random edge features of this width when the data has none (default 172)")
    p.add_argument("--contenders", default=",".join(c for c in CONTENDERS if c not in ("fastopt-host", "fastopt-tuned")),
                   help=f"comma-separated, from {', '.join(CONTENDERS)} (default all but fastopt-host, "
                        f"fastopt with the features in host memory through SlimCache, and fastopt-tuned, "
                        f"which runs fastopt with its tuning record beside the defaults)")
    p.add_argument("--mrr-negatives", type=int, default=0, help="negatives per positive for test MRR (default 0)")
    p.add_argument("--interleave", action="store_true",
                   help="build and verify every contender first, then let their epochs take turns, so "
                        "that the machine's drift in speed reaches each alike (each keeps its own "
                        "random state, so it trains as it does alone); also prints each contender's "
                        "steady epochs over fastopt's, epoch by epoch")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a bar chart (PNG) here (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_bench, no_optimize=False, lr=None, epochs=3)


def _add_data(sub) -> None:
    p = sub.add_parser("data", help="inspect or synthesize temporal graphs")
    dsub = p.add_subparsers(dest="data_command", metavar="{info,synth}", required=True)
    info = dsub.add_parser("info", help="nodes, events, time span, degree percentiles, repeat rate")
    info.add_argument("file", help="built-in name or path")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=_cmd_info)
    syn = dsub.add_parser("synth", help="generate a large stream with the statistics of a real one, "
                                        "or with the GDELT-like profile (--like gdelt)")
    syn.add_argument("--like", default="wikipedia",
                     help="graph whose statistics are copied, or gdelt: the GDELT-like profile, "
                          "generated a chunk at a time")
    syn.add_argument("--events", type=int, required=True, help="number of events to generate")
    syn.add_argument("--nodes", type=int, default=None,
                     help="node count (default: scaled with events; 16682 for gdelt)")
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument("--out", required=True,
                     help="a new folder of memory-mapped .npy files, or a file ending in .npz (held in RAM)")
    gdelt = syn.add_argument_group("the GDELT-like profile (--like gdelt)")
    gdelt.add_argument("--edge-dim", type=int, default=None, help="edge feature width (default 186)")
    gdelt.add_argument("--repeat", type=float, default=None,
                       help="probability of meeting a past partner again (default 0.9)")
    gdelt.add_argument("--activity-exponent", type=float, default=None,
                       help="Zipf exponent of actor activity (default 1.0)")
    gdelt.add_argument("--chunk-events", type=int, default=None,
                       help="events held in RAM at a time (default 131072; the graph does not depend on it)")
    syn.set_defaults(func=_cmd_synth)


# flags setting config values: (group, field); a flag's name is the field's with dashes
_FLAGS = tuple(("train", name) for name in ("epochs", "batch_size", "lr", "adam", "device", "seed", "edge_dim",
                                             "node_dim", "mrr_negatives", "patience")) + \
    tuple(("model", name) for name in ("fanouts", "memory_dim", "dim", "time_dim", "heads", "dropout",
                                       "mailbox_size", "node_embedding"))


def _build_config(args):
    """Defaults, then ``FASTOPT_*`` variables, then ``--config``, then the flags given."""
    from fastopt.config import Config, default_config
    from fastopt.errors import ConfigError

    from_file = args.config and args.config != "auto"
    cfg = Config.from_file(args.config, base=default_config()) if from_file else default_config().copy()
    for group, name in _FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            try:
                cfg.set(f"{group}.{name}", value)
            except ConfigError as exc:
                raise ConfigError(f"--{name.replace('_', '-')} {value}: {exc}") from None
    if getattr(args, "no_optimize", False):
        cfg.set("train.optimize", "off")
    if getattr(args, "restore_best", False):
        cfg.set("train.restore_best", True)
    return cfg


def _cmd_train(args) -> int:
    import torch

    from fastopt.data import load_dataset
    from fastopt.models import build_model
    from fastopt.trainer import Trainer

    cfg = _build_config(args)
    tc = cfg.train
    graph = load_dataset(args.dataset, edge_dim=tc.edge_dim, node_dim=tc.node_dim, seed=tc.seed)
    torch.manual_seed(tc.seed)
    model = build_model(args.model, graph, cfg)
    trainer = Trainer(model, graph, cfg, log_path=args.log, checkpoint_dir=args.checkpoint_dir,
                      progress="lines" if args.no_progress else True,
                      records=args.config in (None, "auto"))
    print(f"fastopt train: {args.model} on {graph.name} ({graph.num_nodes:,} nodes, "
          f"{graph.num_events:,} events; train/val/test {graph.train_end:,}/"
          f"{graph.val_end - graph.train_end:,}/{graph.num_events - graph.val_end:,}) on {trainer.device}",
          flush=True)
    if not hasattr(model, "memory") and graph.node_dim == 0 and graph.edge_dim == 0 \
            and cfg.model.node_embedding == 0:
        # TGAT at 0.69 test AP on featureless wikipedia looks like a bug; say what it lacks
        print(f"fastopt train: note: {graph.name} has no node or edge features and {args.model} no "
              f"node memory, so its attention cannot tell neighbors apart; --node-embedding 100 "
              f"--lr 1e-3 gives every node a learnable row to learn from (README: graphs without "
              f"node features)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    history = trainer.fit(tc.epochs, resume=args.resume)
    summary = {
        "model": args.model, "dataset": graph.name, "device": str(trainer.device),
        "epochs": len(history), "batch_size": tc.batch_size, "seconds": time.perf_counter() - t0,
        "epoch_seconds": [h["seconds"] for h in history], "test": trainer.test_metrics,
        "test_seconds": trainer.test_seconds, "best_epoch": trainer.best_epoch,
        "val": history[-1]["val"] if history else {}, "machine": platform.processor() or platform.machine(),
    }
    print(json.dumps(summary, default=float))
    return 0


def _cmd_bench(args) -> int:
    import platform

    import torch

    from fastopt import __version__
    from fastopt.benchmark import (command_line, format_ratios, format_table, git_commit, paired_ratios, plot,
                                   run_bench, timestamp)
    from fastopt.data import load_dataset

    cfg = _build_config(args)
    tc = cfg.train
    graph = load_dataset(args.dataset, edge_dim=tc.edge_dim, node_dim=tc.node_dim, seed=tc.seed)
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    from fastopt.trainer import resolve_device

    device = resolve_device(tc.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"fastopt bench: {args.model} on {graph.name} ({graph.num_events:,} events, edge dim "
          f"{graph.edge_dim}), batch {tc.batch_size}, {args.epochs} epoch(s) each, on {device} ({gpu})",
          flush=True)
    results = run_bench(graph, args.model, cfg, contenders, epochs=args.epochs, interleave=args.interleave,
                        progress=not args.no_progress, log=lambda line: print(line, flush=True))
    print()
    print(format_table(results))
    ratios = paired_ratios(results) if args.interleave else {}
    if ratios:
        print(format_ratios(ratios))
    if args.json:
        from pathlib import Path

        record = {"date": timestamp(), "device": str(device), "gpu": gpu, "torch": torch.__version__,
                  "fastopt": __version__, "git_commit": git_commit(),
                  "command": command_line(),
                  "dataset": graph.name, "model": args.model, "batch_size": tc.batch_size,
                  "epochs": args.epochs, "interleave": args.interleave, "edge_dim": graph.edge_dim,
                  "config": cfg.to_dict(), "paired_ratios": ratios,
                  "results": [r.to_dict() for r in results]}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2, default=float))
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot, f"{args.model} on {graph.name}, batch {tc.batch_size}, {gpu}")
        print(f"wrote {args.plot}")
    return 0


def _cmd_info(args) -> int:
    from fastopt.data import load_dataset

    info = load_dataset(args.file).info()
    if args.json:
        print(json.dumps(info))
    else:
        width = max(len(k) for k in info)
        for k, v in info.items():
            print(f"{k:<{width}}  {_number(v)}")
    return 0


def _number(value) -> str:
    """One format for every figure: whole numbers with thousands separators, others to four
    significant digits (with separators from 1,000 up)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.1f}" if abs(value) >= 1000 else f"{value:.4g}"


def _cmd_synth(args) -> int:
    import dataclasses

    from fastopt.data import load_dataset, save_npz
    from fastopt.data.npydir import write_npy_dir
    from fastopt.data.synth import BLOCK_EVENTS, GdeltProfile, gdelt_chunks, synthesize, synthesize_gdelt
    from fastopt.errors import DataError

    t0 = time.perf_counter()
    profile_flags = {"edge_dim": args.edge_dim, "repeat": args.repeat,
                     "activity_exponent": args.activity_exponent}
    to_npz = args.out.endswith(".npz")
    if args.like == "gdelt":
        profile = GdeltProfile(**{k: v for k, v in {**profile_flags, "num_nodes": args.nodes}.items()
                                  if v is not None})
        if to_npz:
            graph = synthesize_gdelt(profile, args.events, seed=args.seed)
        else:
            chunks = gdelt_chunks(profile, args.events, seed=args.seed,
                                  chunk_events=args.chunk_events or BLOCK_EVENTS)
            write_npy_dir(args.out, chunks, num_events=args.events, num_nodes=profile.num_nodes,
                          edge_dim=profile.edge_dim, name="synth-gdelt",
                          meta={"like": "gdelt", "seed": args.seed, **dataclasses.asdict(profile)})
            graph = None
        nodes, like = profile.num_nodes, "the GDELT-like profile"
    else:
        given = [f"--{k.replace('_', '-')}" for k, v in {**profile_flags, "chunk_events": args.chunk_events}.items()
                 if v is not None]
        if given:
            raise DataError(f"{', '.join(given)} set the GDELT-like profile, not --like {args.like}; "
                            f"drop them or pass --like gdelt")
        source = load_dataset(args.like)
        graph = synthesize(source, args.events, num_nodes=args.nodes, seed=args.seed)
        nodes, like = graph.num_nodes, source.name
        if not to_npz:
            write_npy_dir(args.out, [(graph.src, graph.dst, graph.ts, graph.edge_feat)],
                          num_events=graph.num_events, num_nodes=graph.num_nodes, edge_dim=graph.edge_dim,
                          name=graph.name, bipartite=graph.bipartite, node_feat=graph.node_feat,
                          meta={"like": source.name, "seed": args.seed})
    if to_npz:
        save_npz(graph, args.out)
    print(f"wrote {args.out}: {args.events:,} events over {nodes:,} nodes like {like} in "
          f"{time.perf_counter() - t0:.1f}s")
    return 0


def _parser() -> argparse.ArgumentParser:
    from fastopt import __version__

    parser = argparse.ArgumentParser(prog="fastopt", description="fast temporal GNN training")
    parser.add_argument("--version", action="version", version=f"fastopt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{train,bench,tune,export,configs,data}")
    _add_train(sub)
    _add_bench(sub)
    from fastopt.tuner.cli import add_configs, add_export, add_tune

    add_tune(sub, _add_run_flags, _build_config)
    add_export(sub)
    add_configs(sub)
    _add_data(sub)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"fastopt: warning: {message}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``fastopt`` command; returns the exit status (2 for a user error)."""
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning  # one line per warning, no source line
        try:
            parser = _parser()
            args = parser.parse_args(argv)
            if args.command is None:
                parser.error("choose a command: train, bench, tune, export, configs or data (fastopt --help lists them)")
            from fastopt.config import default_config

            default_config()  # FASTOPT_* variables are read here, at the start, for every command
            status = args.func(args)
            sys.stdout.flush()  # a closed pipe surfaces here, not at interpreter exit
            return status
        except FastOptError as exc:
            print(f"fastopt: error: {exc}", file=sys.stderr)
            return 2
        except BrokenPipeError:
            # the reader stopped early (`fastopt data info ... | head`): not an error of ours;
            # point stdout at /dev/null so the interpreter's last flush does not raise again
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return 141  # 128 + SIGPIPE, as a command the signal ended


if __name__ == "__main__":
    sys.exit(main())
