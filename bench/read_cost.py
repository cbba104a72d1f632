"""The device time of a training batch's edge-feature read, per path: what TGN's host step runs
inside the step that the device path runs at staging, on the copy stream.

The batches of an epoch are sampled as a model samples them (TGN: the 10 most recent neighbors;
TGAT: 10 and 10 uniform), then each path's kernels run once per batch and their device time is
summed from the profiler's kernel records (``--device cuda``; launch gaps and Python left out;
on the CPU, wall time): ``device``: the batch's unique rows gathered from a device table;
``zero_copy@B``: the same rows read by :func:`fastopt.codegen.cached_rows` from a device cache
holding the B fraction of the table's rows the epoch used most (a static hot set) and, for the
rest, from the pinned host table over the bus. ``+ per slot`` (models that take per-slot
features, TGN): the rows then expanded to every sampled slot (:func:`runtime.inputs.per_slot`).
Every path's rows are checked against the device path's, bit for bit; a batch that differs is
printed and the script exits with status 1.

Usage::

    python bench/read_cost.py [--model tgn] [--batch-size 600] [--budgets 0 0.1 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, List

import numpy as np
import torch

from _meta import write_record
from fastopt.codegen import cached_rows
from fastopt.config import Config
from fastopt.data import load_dataset
from fastopt.runtime import Loader
from fastopt.runtime.cache_policy import hot_set
from fastopt.runtime.inputs import per_slot
from fastopt.trainer import make_sampler

SAMPLING = {"tgn": ("recent", [10]), "tgat": ("uniform", [10, 10])}


def sampled_batches(graph, model: str, batch_size: int) -> list:
    """Each training batch's ``(unique edge ids, inverse over every layer's slots, slot shapes)``."""
    cfg = Config()
    cfg.train.batch_size = batch_size
    strategy, fanouts = SAMPLING[model]
    loader = Loader(graph, make_sampler(graph, fanouts, strategy, cfg), torch.device("cpu"), cfg)
    out = []
    for batch in loader.plan("train", 0):
        sampled = loader.sample(batch)
        if sampled is None or not sampled.blocks or sampled.unique_eids is None:
            continue
        u = sampled.unique_eids
        out.append((u.values.clamp(min=0), u.inverse.reshape(-1), [tuple(b.mask.shape) for b in sampled.blocks]))
    return out


def device_seconds(run: Callable[[], None], device: torch.device) -> float:
    """Seconds of device time the kernels ``run`` launches take (the CPU: wall time)."""
    if device.type != "cuda":
        start = time.perf_counter()
        run()
        return time.perf_counter() - start
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize(device)
    total = 0.0
    for event in prof.key_averages():
        total += getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
    return total / 1e6


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="wikipedia")
    p.add_argument("--model", choices=sorted(SAMPLING), default="tgn")
    p.add_argument("--batch-size", type=int, default=600)
    p.add_argument("--edge-dim", type=int, default=172)
    p.add_argument("--budgets", type=float, nargs="+", default=[0.0, 0.1, 1.0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    graph = load_dataset(args.dataset, edge_dim=args.edge_dim)
    batches = sampled_batches(graph, args.model, args.batch_size)
    table = torch.from_numpy(np.ascontiguousarray(graph.edge_feat))
    host = table.pin_memory() if device.type == "cuda" else table
    resident = table.to(device)
    ids = [i.to(device) for i, _, _ in batches]
    inverse = [v.to(device) for _, v, _ in batches]
    expand = args.model == "tgn"
    uses = torch.zeros(table.shape[0], dtype=torch.int32)
    for i, _, _ in batches:
        uses[i] += 1
    readers = {"device": lambda rows_ids: resident.index_select(0, rows_ids)}
    for budget in args.budgets:
        hot = hot_set(uses, int(budget * table.shape[0])).to(device)
        slot_map = torch.full((table.shape[0],), -1, dtype=torch.int32, device=device)
        slot_map[hot] = torch.arange(hot.numel(), dtype=torch.int32, device=device)
        slots = resident.index_select(0, hot) if hot.numel() else resident[:1].clone()  # (one slot, never used)
        readers[f"zero_copy@{budget:g}"] = cached_rows.bind(slot_map, slots, host)

    def epoch(read, per_slot_too: bool) -> Callable[[], None]:
        def run() -> None:
            for (_, _, shapes), i, v in zip(batches, ids, inverse):
                rows = read(i)
                if per_slot_too:
                    per_slot(rows, v, shapes)
        return run

    wrong, results = 0, []
    truth = [readers["device"](i) for i in ids]
    for name, read in readers.items():
        for b, i in enumerate(ids):
            got = read(i)
            if not torch.equal(got.view(torch.int32), truth[b].view(torch.int32)):
                print(f"WRONG RESULT: {name}'s rows of batch {b} differ from the device table's")
                wrong += 1
                break
        for per_slot_too in ([False, True] if expand else [False]):
            run = epoch(read, per_slot_too)
            run()  # compiles and warms up
            seconds = min(device_seconds(run, device) for _ in range(3))
            results.append({"path": name + (" + per slot" if per_slot_too else ""), "seconds": seconds,
                            "us_per_batch": 1e6 * seconds / len(batches)})
    base = {r["path"]: r["seconds"] for r in results}
    print(f"{args.model} on {args.dataset}: {len(batches)} training batches of {args.batch_size}, "
          f"{sum(i.numel() for i in ids) / len(ids):,.0f} unique edges and "
          f"{sum(v.numel() for v in inverse) / len(ids):,.0f} slots a batch, on {device} "
          f"({'kernel time' if device.type == 'cuda' else 'wall time'})")
    print(f"{'path':28s} {'s/epoch':>9s} {'us/batch':>9s} {'x device':>9s}")
    for r in results:
        ref = base["device + per slot" if r["path"].endswith("per slot") else "device"]
        r["x_device"] = r["seconds"] / ref if ref else float("nan")
        print(f"{r['path']:28s} {r['seconds']:9.4f} {r['us_per_batch']:9.1f} {r['x_device']:9.2f}")
    if args.json:
        write_record(args.json, dataset=args.dataset, model=args.model, batch_size=args.batch_size,
                     edge_dim=args.edge_dim, batches=len(batches), timing="kernel" if device.type == "cuda" else "wall",
                     results=results, rows_wrong=wrong)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
