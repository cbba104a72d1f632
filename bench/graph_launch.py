"""Host time of launching a captured training step: each whole-step CUDA graph the Trainer captured.

Trains ``--epochs`` epochs (the step graphs are captured on the way), checks the optimized model
against eager (:func:`fastopt.verify_against_eager` on the first training batch, as
``bench/epoch_profile.py`` does; a disagreement prints ``WRONG RESULT`` and exits with status 1),
then for every captured step graph measures the host time of ``replay()`` (``cudaGraphLaunch``):

- ``idle_us``: the median over ``--iters`` launches, the device synchronized before each (an
  idle device, nothing queued);
- ``back_to_back_us``: the median over ``--iters`` launches one after another (a queue ahead);

beside a straight chain of ``--chain`` tiny kernels captured the same way (what the driver charges
for a graph of that many nodes). Prints a line per graph and writes JSON::

    python bench/graph_launch.py --model tgn --json bench/results/graph-launch.json

A diagnostic: a profiled epoch (``bench/epoch_profile.py``) reports ``cudaGraphLaunch`` with
the profiler's own cost in it; this measures the launch without a profiler.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import List, Tuple

import torch

from _meta import write_record
from epoch_profile import add_run_arguments, eager_disagreement, report_wrong
from fastopt.config import default_config
from fastopt.data import load_dataset
from fastopt.models import build_model
from fastopt.trainer import Trainer


def launch_us(graph: torch.cuda.CUDAGraph, iters: int) -> Tuple[float, float]:
    """Median host microseconds of ``graph.replay()``: device idle before each, then back to back."""
    idle: List[float] = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        idle.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    queued: List[float] = []
    for _ in range(iters):
        t0 = time.perf_counter()
        graph.replay()
        queued.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(idle) * 1e6, statistics.median(queued) * 1e6


def chain_graph(kernels: int) -> torch.cuda.CUDAGraph:
    """A captured straight line of ``kernels`` one-block elementwise kernels."""
    x = torch.zeros(16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.add_(1)
    return graph


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(p)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--chain", type=int, default=500, help="kernels in the reference straight-line graph")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_launch: needs a CUDA device (the step graphs are CUDA graphs)", file=sys.stderr)
        return 2
    cfg = default_config().copy()
    cfg.train.batch_size = args.batch_size
    graph = load_dataset(args.dataset, edge_dim=args.edge_dim)
    torch.manual_seed(0)
    trainer = Trainer(build_model(args.model, graph), graph, cfg, progress=False)
    for epoch in range(args.epochs):
        stats = trainer.train_epoch(epoch)
        print(f"epoch {epoch}: {stats.seconds:.3f} s", flush=True)
    wrong = eager_disagreement(trainer, args.model, graph)
    if wrong:
        return report_wrong(wrong)
    steps = trainer.step_graphs
    captured = steps.graphs() if steps else []
    if not captured:
        print(f"no whole-step graph was captured ({getattr(steps, 'disabled', None) or 'step graphs off'})")
        return 1
    rows = []
    for i, g in enumerate(captured):
        idle, queued = launch_us(g, args.iters)
        rows.append({"graph": i, "idle_us": idle, "back_to_back_us": queued})
        print(f"step graph {i}: cudaGraphLaunch host {idle:.1f} us (device idle), {queued:.1f} us (back to back)")
    idle, queued = launch_us(chain_graph(args.chain), args.iters)
    print(f"straight chain of {args.chain} kernels: {idle:.1f} us (device idle), {queued:.1f} us (back to back)")
    if args.json:
        write_record(args.json, model=args.model, dataset=args.dataset, batch_size=args.batch_size,
                     iters=args.iters, step_graphs=rows,
                     chain={"kernels": args.chain, "idle_us": idle, "back_to_back_us": queued})
    return 0


if __name__ == "__main__":
    sys.exit(main())
