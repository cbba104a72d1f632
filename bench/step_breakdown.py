"""Where a CUDA-graphed fastopt step's time goes: host work before, between and after the graphs.

For each reference model, at the batch shapes of ``bench/optimize.py``, with the optimized
model's CUDA graphs captured, measures (medians of ``--iters`` steps after ``--warmup``):

- ``step_ms``: forward + ``sum().backward()``, CUDA events around it, gradients set to None
  before it (untimed), as in bench/optimize.py;
- ``fwd_graph_ms`` / ``bwd_graph_ms``: device time of the forward / backward graph replayed alone;
- ``prelaunch_us``: host time from the call until the forward graph's launch (argument checks,
  call key, input copies);
- ``fwd_launch_us`` / ``bwd_launch_us``: host time of launching each graph;
- ``host_fwd_us`` / ``host_bwd_us``: host time until the forward call returns / until backward
  returns (no synchronization inside either);
- ``bwd_enter_us``: host time from the call until the backward graph's launch (compare with
  ``prelaunch_us + fwd_launch_us + 1000 * fwd_graph_ms``, when the forward graph ends on the
  device: a launch at that moment waited for it); ``after_bwd_launch_us``: host time from that
  launch until backward returns; ``before_copy_us``, ``input_copy_us``, ``copy_to_launch_us``:
  ``prelaunch_us`` split at the copy of the call's tensors into the graph's inputs.

``step_ms - fwd_graph_ms - bwd_graph_ms`` is what the device spends waiting for the host (or in
work outside the graphs). Before it is timed, each optimized model is checked against the eager
model (:func:`fastopt.verify_against_eager`: outputs and parameter gradients against float64
eager); one that disagrees is not timed, is printed as ``WRONG RESULT``, and the script exits with
status 1. Prints a table and writes JSON with the date, GPU, versions, commit and command::

    python bench/step_breakdown.py --json bench/results/step-breakdown.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import fastopt
from _meta import write_record
from fastopt.errors import FastOptError
from optimize import add_batch_args, cuda_device, model_and_inputs


def _median_events(fn, iters: int, prepare=None) -> float:
    times = []
    for _ in range(iters):
        if prepare is not None:
            prepare()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _graphs_of(model) -> list:
    runner = model.__dict__.get("_fastopt_graph_runner")
    return list(runner._graphs.values()) if runner is not None else []


def breakdown(fast, inputs, warmup: int, iters: int) -> dict:
    params = list(fast.parameters())
    earlier = {id(g) for g in _graphs_of(fast)}  # the eager check's (eval mode), if it captured

    def step():
        fast(inputs).sum().backward()

    def prepare():  # as a training loop's zero_grad(), untimed
        for p in params:
            p.grad = None

    for _ in range(warmup):
        prepare()
        step()
    torch.cuda.synchronize()
    new = [g for g in _graphs_of(fast) if id(g) not in earlier]
    graphs = new[0] if len(new) == 1 else None
    if graphs is None or graphs.bwd is None:
        return {"error": "the model's root call was not captured as one forward/backward pair"}
    row = {"step_ms": _median_events(step, iters, prepare),
           "fwd_graph_ms": _median_events(graphs.fwd.replay, iters),
           "bwd_graph_ms": _median_events(graphs.bwd.replay, iters)}
    marks = {}

    def timed(graph, name):
        replay = graph.replay

        def wrapper():
            marks[f"{name}_enter"] = time.perf_counter()
            replay()
            marks[f"{name}_exit"] = time.perf_counter()
        return wrapper

    from fastopt.runtime import capture as graph_module  # where a replay copies its inputs

    copy = graph_module._copy_grouped

    def timed_copy(*args):  # the first copy of a step is the input copy
        first = "copy_enter" not in marks
        if first:
            marks["copy_enter"] = time.perf_counter()
        copy(*args)
        if first:
            marks["copy_exit"] = time.perf_counter()

    graphs.fwd.replay, graphs.bwd.replay = timed(graphs.fwd, "fwd"), timed(graphs.bwd, "bwd")
    graph_module._copy_grouped = timed_copy
    samples = {k: [] for k in ("prelaunch_us", "fwd_launch_us", "bwd_launch_us", "host_fwd_us",
                               "host_bwd_us", "bwd_enter_us", "after_bwd_launch_us",
                               "before_copy_us", "input_copy_us", "copy_to_launch_us")}
    try:
        for _ in range(iters):
            prepare()
            torch.cuda.synchronize()
            marks.clear()
            t0 = time.perf_counter()
            out = fast(inputs)
            t1 = time.perf_counter()
            out.sum().backward()
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            samples["prelaunch_us"].append(marks["fwd_enter"] - t0)
            samples["fwd_launch_us"].append(marks["fwd_exit"] - marks["fwd_enter"])
            samples["bwd_launch_us"].append(marks["bwd_exit"] - marks["bwd_enter"])
            samples["host_fwd_us"].append(t1 - t0)
            samples["host_bwd_us"].append(t2 - t1)
            samples["bwd_enter_us"].append(marks["bwd_enter"] - t0)
            samples["after_bwd_launch_us"].append(t2 - marks["bwd_exit"])
            samples["before_copy_us"].append(marks["copy_enter"] - t0)
            samples["input_copy_us"].append(marks["copy_exit"] - marks["copy_enter"])
            samples["copy_to_launch_us"].append(marks["fwd_enter"] - marks["copy_exit"])
    finally:
        del graphs.fwd.replay, graphs.bwd.replay
        graph_module._copy_grouped = copy
    row.update({k: 1e6 * statistics.median(v) for k, v in samples.items()})
    row["device_idle_ms"] = row["step_ms"] - row["fwd_graph_ms"] - row["bwd_graph_ms"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(parser, "tgn,tgat")
    args = parser.parse_args(argv)
    device = cuda_device("bench/step_breakdown.py")
    if device is None:
        return 0
    rows, wrong = [], []
    for name in args.models.split(","):
        model, inputs = model_and_inputs(name, args, device)
        fast = fastopt.optimize(model)
        try:
            ratio = fastopt.verify_against_eager(fast, model, inputs)
        except FastOptError as exc:
            wrong.append(f"{name}: {exc}")
            rows.append({"model": name, "verified": f"FAILED: {exc}"})  # no time: it is wrong
            continue
        rows.append({"model": name, "verified": f"outputs+grads within {ratio:.2f}x max(1e-4, "
                                                f"eager float32's error)",
                     **breakdown(fast, inputs, args.warmup, args.iters)})
    cols = ("step_ms", "fwd_graph_ms", "bwd_graph_ms", "device_idle_ms", "prelaunch_us",
            "fwd_launch_us", "bwd_launch_us", "host_fwd_us", "host_bwd_us", "bwd_enter_us",
            "after_bwd_launch_us", "before_copy_us", "input_copy_us", "copy_to_launch_us")
    print(f"{'model':>8} " + " ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print(f"{r['model']:>8} " + " ".join(f"{r[c]:14.3f}" if c in r else f"{'-':>14}"
                                            for c in cols), r.get("error", ""))
    if args.json:
        write_record(args.json, results=rows,
                     timing=f"medians of {args.iters} steps after {args.warmup} warm-up; host times "
                            f"by perf_counter, device times by CUDA events")
    for line in wrong:
        print(f"WRONG RESULT: {line}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
