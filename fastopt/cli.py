"""``fastopt`` command line: ``train``, ``bench`` and ``data info|synth``."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Optional, Sequence

from fastopt.errors import FastOptError

__all__ = ["main"]


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a reference TGNN for link prediction")
    p.add_argument("--dataset", default="wikipedia", help="built-in name (wikipedia) or a path to an event file")
    p.add_argument("--model", default="tgn", help="tgn, tgat, jodie or apan")
    p.add_argument("--epochs", type=int, default=None, help="training epochs (default 10)")
    p.add_argument("--batch-size", type=int, default=None, help="positive events per batch (default 200)")
    p.add_argument("--lr", type=float, default=None, help="Adam learning rate (default 1e-4)")
    p.add_argument("--device", default=None, help="auto, cpu or cuda[:N] (default auto)")
    p.add_argument("--seed", type=int, default=None, help="seed of every random choice (default 0)")
    p.add_argument("--edge-dim", type=int, default=None, help="random edge features of this width when the data has none")
    p.add_argument("--node-dim", type=int, default=None, help="random node features of this width when the data has none")
    p.add_argument("--mrr-negatives", type=int, default=None, help="negatives per positive for test MRR (default 20)")
    p.add_argument("--config", default=None, help="JSON file of config values (see `Config.to_json`)")
    p.add_argument("--log", default=None, help="JSON-lines metrics log")
    p.add_argument("--checkpoint-dir", default=None, help="write checkpoint.pt here after every epoch")
    p.add_argument("--resume", default=None, help="continue from this checkpoint.pt")
    p.add_argument("--no-optimize", action="store_true",
                   help="train the eager model (default: fastopt.optimize on CUDA, eager on the CPU)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_train)


def _add_bench(sub) -> None:
    from fastopt.benchmark import CONTENDERS

    p = sub.add_parser("bench", help="fastopt against eager, torch.compile, TGL's data path and PyG, one run")
    p.add_argument("--dataset", default="wikipedia", help="built-in name (wikipedia) or a path to an event file")
    p.add_argument("--model", default="tgn", help="tgn, tgat, jodie or apan")
    p.add_argument("--batch-size", type=int, default=600, help="positive events per batch (default 600)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per contender; the steady time is the "
                   "median after the first (default 3)")
    p.add_argument("--device", default=None, help="auto, cpu or cuda[:N] (default auto)")
    p.add_argument("--seed", type=int, default=None, help="seed of every random choice (default 0)")
    p.add_argument("--edge-dim", type=int, default=172,
                   help="random edge features of this width when the data has none (default 172)")
    p.add_argument("--node-dim", type=int, default=None, help="random node features of this width")
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help=f"comma-separated, from {', '.join(CONTENDERS)} (default all)")
    p.add_argument("--mrr-negatives", type=int, default=0, help="negatives per positive for test MRR (default 0)")
    p.add_argument("--config", default=None, help="JSON file of config values (see `Config.to_json`)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a bar chart (PNG) here (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_bench, no_optimize=False, lr=None)


def _add_data(sub) -> None:
    p = sub.add_parser("data", help="inspect or synthesize temporal graphs")
    dsub = p.add_subparsers(dest="data_cmd", required=True)
    info = dsub.add_parser("info", help="nodes, events, time span, degree percentiles, repeat rate")
    info.add_argument("file", help="built-in name or path")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=_cmd_info)
    syn = dsub.add_parser("synth", help="generate a large stream with the statistics of a real one")
    syn.add_argument("--like", default="wikipedia", help="graph whose statistics are copied")
    syn.add_argument("--events", type=int, required=True, help="number of events to generate")
    syn.add_argument("--nodes", type=int, default=None, help="node count (default: scaled with events)")
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument("--out", required=True, help="output .npz")
    syn.set_defaults(func=_cmd_synth)


def _build_config(args):
    from fastopt.config import Config, default_config

    cfg = default_config().copy()
    if args.config:
        with open(args.config) as f:
            loaded = Config.from_json(f.read())
        cfg = loaded
    for flag, key in (("epochs", "epochs"), ("batch_size", "batch_size"), ("lr", "lr"),
                      ("device", "device"), ("seed", "seed"), ("edge_dim", "edge_dim"),
                      ("node_dim", "node_dim"), ("mrr_negatives", "mrr_negatives")):
        value = getattr(args, flag)
        if value is not None:
            cfg.set(f"train.{key}", value)
    if args.no_optimize:
        cfg.set("train.optimize", "off")
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
    model = build_model(args.model, graph)
    trainer = Trainer(model, graph, cfg, log_path=args.log, checkpoint_dir=args.checkpoint_dir,
                      progress=not args.no_progress)
    print(f"fastopt train: {args.model} on {graph.name} ({graph.num_nodes:,} nodes, "
          f"{graph.num_events:,} events; train/val/test {graph.train_end:,}/"
          f"{graph.val_end - graph.train_end:,}/{graph.num_events - graph.val_end:,}) on {trainer.device}",
          flush=True)
    t0 = time.perf_counter()
    history = trainer.fit(tc.epochs, resume=args.resume, on_epoch=_print_epoch)
    test = trainer.test_metrics
    print("test: " + "  ".join(f"{k}={v:.4f}" for k, v in test.items()))
    summary = {
        "model": args.model, "dataset": graph.name, "device": str(trainer.device),
        "epochs": tc.epochs, "batch_size": tc.batch_size, "seconds": time.perf_counter() - t0,
        "epoch_seconds": [h["seconds"] for h in history], "test": test,
        "val": history[-1]["val"] if history else {}, "machine": platform.processor() or platform.machine(),
    }
    print(json.dumps(summary, default=float))
    return 0


def _print_epoch(record: dict) -> None:
    st = record["stages"]
    stages = " ".join(f"{k}={st[k]:.1f}s" for k in ("sample", "gather", "forward", "backward", "update", "step")
                      if k in st)
    val = record["val"]
    print(f"epoch {record['epoch']:>3}  loss={record['loss']:.4f}  {record['seconds']:.1f}s "
          f"({record['events_per_s']:,.0f} ev/s; {stages})  val ap={val['ap']:.4f} auc={val['auc']:.4f}",
          flush=True)


def _cmd_bench(args) -> int:
    import platform

    import torch

    from fastopt import __version__
    from fastopt.benchmark import format_table, git_commit, plot, run_bench, timestamp
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
    results = run_bench(graph, args.model, cfg, contenders, epochs=args.epochs,
                        progress=not args.no_progress, log=lambda line: print(line, flush=True))
    print()
    print(format_table(results))
    if args.json:
        from pathlib import Path

        record = {"date": timestamp(), "device": str(device), "gpu": gpu, "torch": torch.__version__,
                  "fastopt": __version__, "git_commit": git_commit(),
                  "command": "fastopt " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("fastopt") else " ".join(sys.argv),
                  "dataset": graph.name, "model": args.model, "batch_size": tc.batch_size,
                  "epochs": args.epochs, "edge_dim": graph.edge_dim, "config": cfg.to_dict(),
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
            print(f"{k:<{width}}  {v:,.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    return 0


def _cmd_synth(args) -> int:
    from fastopt.data import load_dataset, save_npz
    from fastopt.data.synth import synthesize

    like = load_dataset(args.like)
    t0 = time.perf_counter()
    graph = synthesize(like, args.events, num_nodes=args.nodes, seed=args.seed)
    save_npz(graph, args.out)
    print(f"wrote {args.out}: {graph.num_events:,} events over {graph.num_nodes:,} nodes "
          f"like {like.name} in {time.perf_counter() - t0:.1f}s")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="fastopt", description="fast temporal GNN training")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_train(sub)
    _add_bench(sub)
    _add_data(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except FastOptError as exc:
        print(f"fastopt: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
