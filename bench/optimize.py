"""Benchmark of fastopt.optimize: embedding forward+backward step time of each reference model.

Runs, in one process on one GPU and the same inputs: the eager model, ``torch.compile(model)``
(default mode), ``torch.compile(model, mode="reduce-overhead")`` (CUDA graphs of the compiled
model: the stronger baseline), and ``fastopt.optimize(model)`` with CUDA graphs on and, for
reference: off (``config.passes.cuda_graphs``); without the split of Linears over
concatenations (``config.passes.split_linear_inputs``); without the merge of sibling
projections into one product (``config.passes.merge_sibling_linears``); and without the
fused time encoding (``config.passes.fuse_time_encoding = "off"``; by default it is fused inside
captured graphs); and with torch's bias-gradient reductions (``config.passes.bias_grad_kernel =
"off"``; by default the generated column sums inside captured graphs). Batch shapes of TGN/TGAT: 600 roots (200 events
with their destinations and negatives), 10 most recent neighbors for TGN, 10 x 10 uniform for
TGAT, width 100, 2 heads, 172 edge features as in Wikipedia/Reddit. Each step is timed with CUDA
events after warm-up, gradients set to None before it (untimed, as a training loop's
``zero_grad()``); the median is reported. The eager and fastopt columns take their timed steps in
``--rounds`` interleaved rounds (a drift of the machine during the run reaches them alike); the
``torch.compile`` columns follow, one at a time. After its timed steps (its CUDA graphs captured)
every column is checked against the eager model (:func:`fastopt.benchmark.verify_against_eager`:
outputs and parameter gradients in eval mode, against the eager model run in float64); a column
that fails is reported without a time or speedup, and the script exits with status 1. Prints a
table and writes JSON with the date, GPU, versions, git commit and the exact command::

    python bench/optimize.py --json bench/results/optimize_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Optional

import torch

import fastopt
from _meta import write_record
from fastopt.benchmark import verify_against_eager
from fastopt.errors import FastOptError
from fastopt.models import APAN, JODIE, TGAT, TGN, GraphInputs


def _inputs(model, roots: int, num_nodes: int, edge_dim: int, device) -> GraphInputs:
    g = torch.Generator(device="cpu").manual_seed(0)
    nodes = [torch.randint(0, num_nodes, (roots,), generator=g)]
    times = [torch.rand(roots, generator=g) * 1e6]
    edge_feat, dt, mask = [], [], []
    for k in model.fanouts:
        n = nodes[-1].numel()
        nodes.append(torch.randint(0, num_nodes, (n * k,), generator=g))
        times.append(torch.rand(n * k, generator=g) * 1e6)
        edge_feat.append(torch.randn(n, k, edge_dim, generator=g))
        dt.append(torch.rand(n, k, generator=g) * 1e4)
        m = torch.rand(n, k, generator=g) < 0.9
        mask.append(m)
    node_feat = [torch.zeros(n.numel(), 0) for n in nodes]
    to = lambda xs: [x.to(device) for x in xs]  # noqa: E731
    return GraphInputs(to(nodes), to(times), to(node_feat), to(edge_feat), to(dt), to(mask))


def _warm_memory(model) -> None:
    mem = getattr(model, "memory", None)
    if mem is not None:
        g = torch.Generator(device="cpu").manual_seed(1)
        mem.memory.copy_(torch.randn(mem.memory.shape, generator=g))
        mem.mails.copy_(torch.randn(mem.mails.shape, generator=g))
        mem.mail_ts.copy_(torch.rand(mem.mail_ts.shape, generator=g) * 1e4)
        mem.mail_count.copy_(torch.randint(0, mem.slots + 1, mem.mail_count.shape, generator=g))
        mem.pending.fill_(True)


def add_batch_args(parser: argparse.ArgumentParser, models: str) -> None:
    """Batch-shape and timing options (shared with bench/step_breakdown.py)."""
    parser.add_argument("--json", help="write results to this JSON file")
    parser.add_argument("--models", default=models)
    parser.add_argument("--roots", type=int, default=600)
    parser.add_argument("--num-nodes", type=int, default=9227)
    parser.add_argument("--edge-dim", type=int, default=172)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)


def cuda_device(script: str) -> Optional[torch.device]:
    """The GPU to measure on, TF32 off (every column multiplies in float32); None, said, if none."""
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU; none is available here. Nothing was measured.")
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    return torch.device("cuda")


def model_and_inputs(name: str, args, device):
    """Reference model ``name`` (seeded, training mode, memory warmed) and its batch inputs."""
    torch.manual_seed(0)
    model = _models(args.num_nodes, args.edge_dim)[name]().to(device).train()
    _warm_memory(model)
    return model, _inputs(model, args.roots, args.num_nodes, args.edge_dim, device)


def _step_begin() -> None:
    # cudagraph trees of mode="reduce-overhead": each timed call is a new training step
    torch.compiler.cudagraph_mark_step_begin()


def _times(columns, inputs, warmup: int, iters: int, rounds: int = 1, params=()) -> dict:
    """CUDA-event times of ``fn(inputs).sum().backward()`` per column (``{name: (fn, before)}``):
    ``{name: median ms}``, or ``{name: exception}`` for a column that failed. Before each step
    (untimed) the gradients are set to None, as ``optimizer.zero_grad()`` does in a training loop
    (and the Trainer), so every column's backward stores its gradients rather than adding to old
    ones. After each column's warm-up, the timed steps run in ``rounds`` rounds that visit every
    column in turn: a drift of the machine during the run (clocks, host load) reaches every
    column alike."""
    params = list(params)

    def step(fn, before, timed: bool):
        for p in params:
            p.grad = None
        if before:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(inputs).sum().backward()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) if timed else None

    results, times = {}, {}
    for name, (fn, before) in columns.items():
        try:
            for _ in range(warmup):
                step(fn, before, timed=False)
            times[name] = []
        except Exception as exc:  # noqa: BLE001 - a failed column is reported, not fatal
            results[name] = exc
    per_round = -(-iters // rounds)
    for _ in range(rounds):
        for name in list(times):
            try:
                times[name] += [step(*columns[name], timed=True) for _ in range(per_round)]
            except Exception as exc:  # noqa: BLE001
                results[name] = exc
                del times[name]
    results.update({name: statistics.median(t) for name, t in times.items()})
    return results


def verify_columns(columns, model, inputs, timed: dict) -> dict:
    """Check each timed column of ``columns`` (``{name: (fn, before)}``) against ``model``, eager.

    Runs after the column's timed steps, so that a column replaying CUDA graphs is checked through
    them. Returns ``{name: verdict}``; a verdict starting with ``"FAILED"`` is a wrong result. A
    column whose check raises anything else lands in ``timed`` as that exception (its time is not
    reported: it could not be shown right).
    """
    verdicts = {}
    for name, (fn, before) in columns.items():
        if fn is model or isinstance(timed.get(name), Exception):
            continue
        if before:
            before()
        try:
            ratio = verify_against_eager(fn, model, inputs)
        except FastOptError as exc:
            verdicts[name] = f"FAILED: {exc}"
        except Exception as exc:  # noqa: BLE001 - a column that cannot run the check is reported
            timed[name] = exc
        else:
            verdicts[name] = f"outputs+grads within {ratio:.2f}x max(1e-4, eager float32's error)"
    return verdicts


def _models(num_nodes: int, edge_dim: int):
    return {
        "tgn": lambda: TGN(num_nodes, 0, edge_dim),
        "tgat": lambda: TGAT(0, edge_dim),
        "jodie": lambda: JODIE(num_nodes, 0, edge_dim),
        "apan": lambda: APAN(num_nodes, 0, edge_dim),
    }


def _profile(fn, inputs, path: Path, steps: int = 10) -> None:
    """Where a step's host and device time go: operator tables sorted by CPU and by CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn(inputs).sum().backward()
        torch.cuda.synchronize()
    table = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{steps} steps\n\n# by CPU time\n"
                    + table.table(sort_by="cpu_time_total", row_limit=30)
                    + "\n\n# by CUDA time\n" + table.table(sort_by="cuda_time_total", row_limit=30))


def _write(args, rows) -> None:
    """The JSON record, rewritten after each model so a cut-short run keeps what it measured."""
    write_record(args.json, timing=f"CUDA events, median of {args.iters} steps after "
                                   f"{args.warmup} warm-up; eager and fastopt columns "
                                   f"interleaved in {args.rounds} rounds", results=rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(parser, "tgn,tgat,jodie,apan")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile columns")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds over the eager and fastopt columns the timed steps take")
    parser.add_argument("--profile", metavar="DIR",
                        help="also write torch.profiler tables of the eager, fastopt and fastopt "
                             "without CUDA graphs steps to DIR")
    args = parser.parse_args(argv)
    device = cuda_device("bench/optimize.py")
    if device is None:
        return 0
    rows, wrong = [], []
    for name in args.models.split(","):
        model, inputs = model_and_inputs(name, args, device)
        fast = fastopt.optimize(model)
        plain = fastopt.optimize(model, config={"passes": {"cuda_graphs": "off"}})
        unsplit = fastopt.optimize(model, config={"passes": {"split_linear_inputs": False}})
        unmerged = fastopt.optimize(model, config={"passes": {"merge_sibling_linears": False}})
        time_unfused = fastopt.optimize(model, config={"passes": {"fuse_time_encoding": "off"}})
        torch_bias = fastopt.optimize(model, config={"passes": {"bias_grad_kernel": "off"}})
        factored = fastopt.optimize(model, config={"passes": {"factor_time_encoding": "auto"}})
        row = {"model": name, "roots": args.roots, "fanouts": list(model.fanouts),
               "rewrites": [f"{r.where} {r.pattern} -> {r.op}"
                            for r in fast.fastopt_report.rewrites]}
        # eager and the fastopt columns interleaved; then torch.compile, one mode at a time: its
        # caches must not see (or touch) the other columns' calls
        columns = {"eager_ms": (model, None), "fastopt_nographs_ms": (plain, None),
                   "fastopt_nosplit_ms": (unsplit, None), "fastopt_nomerge_ms": (unmerged, None),
                   "fastopt_notimeenc_ms": (time_unfused, None),
                   "fastopt_torchbias_ms": (torch_bias, None),
                   "fastopt_factor_ms": (factored, None), "fastopt_ms": (fast, None)}
        timed = _times(columns, inputs, args.warmup, args.iters, args.rounds, model.parameters())
        verdicts = verify_columns(columns, model, inputs, timed)
        if not args.no_compile:
            for column, mode, before in (("compile_ms", "default", None),
                                         ("compile_ro_ms", "reduce-overhead", _step_begin)):
                torch._dynamo.reset()
                try:
                    compiled = torch.compile(model, mode=mode)
                except Exception as exc:  # noqa: BLE001 - a failed column is reported
                    timed[column] = exc
                    continue
                compiled_column = {column: (compiled, before)}
                timed.update(_times(compiled_column, inputs, args.warmup, args.iters, 1,
                                    model.parameters()))
                verdicts.update(verify_columns(compiled_column, model, inputs, timed))
                torch._dynamo.reset()
        row["verified"] = verdicts
        for column, value in timed.items():
            if isinstance(value, Exception):
                row[column] = None
                row.setdefault("errors", {})[column] = f"{type(value).__name__}: {value}"[:500]
            elif verdicts.get(column, "").startswith("FAILED"):
                row[column] = None  # a wrong result has no time worth reporting
                wrong.append(f"{name} {column}: {verdicts[column]}")
            else:
                row[column] = value
        report = fast.fastopt_report
        row["cuda_graphs"] = [str(g) for g in report.graphs]
        row["captured"] = report.captured_modules()
        row["report"] = str(report)  # the kernels chosen, time encoding fused in the capture
        if args.profile:
            for label, fn in (("eager", model), ("fastopt", fast), ("fastopt-nographs", plain)):
                _profile(fn, inputs, Path(args.profile) / f"profile-{name}-{label}.txt")
        for base in ("eager", "compile", "compile_ro"):
            if row.get(f"{base}_ms") and row.get("fastopt_ms"):
                row[f"speedup_vs_{base}"] = row[f"{base}_ms"] / row["fastopt_ms"]
        rows.append(row)
        torch._dynamo.reset()
        if args.json:
            _write(args, rows)
    head = ("model", "eager ms", "compile ms", "compile-ro ms", "fastopt-nograph ms",
            "fastopt-nosplit ms", "fastopt-nomerge ms",
            "fastopt-notimeenc ms", "fastopt-torchbias ms", "fastopt-factor ms", "fastopt ms",
            "x eager", "x compile",
            "x compile-ro")
    print(" ".join(f"{h:>18}" for h in head))
    for r in rows:
        cells = [r["model"]] + [r.get(k) for k in ("eager_ms", "compile_ms", "compile_ro_ms",
                                                   "fastopt_nographs_ms", "fastopt_nosplit_ms",
                                                   "fastopt_nomerge_ms",
                                                   "fastopt_notimeenc_ms",
                                                   "fastopt_torchbias_ms",
                                                   "fastopt_factor_ms", "fastopt_ms",
                                                   "speedup_vs_eager", "speedup_vs_compile",
                                                   "speedup_vs_compile_ro")]
        print(" ".join(f"{c:>18}" if isinstance(c, str) else
                       (f"{c:18.3f}" if c is not None else f"{'-':>18}") for c in cells))
        print(f"    captured: {', '.join(r['captured']) or 'nothing'}")
        for err in r.get("errors", {}).items():
            print(f"    failed: {err[0]}: {err[1]}")
    if args.json:
        print(f"wrote {args.json}")
    for line in wrong:
        print(f"WRONG RESULT: {line}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
