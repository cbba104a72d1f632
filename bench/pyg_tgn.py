"""Benchmark: PyG's TGN example, unmodified vs with ``fastopt.optimize`` on its memory and embedding.

In one process on one device (``--device``), on ``--dataset`` (default the shipped wikipedia
with 172-d random edge features) at ``--batch-size`` (600):

1. **check**: the example and its copy with ``fastopt.optimize`` applied to the memory and the
   embedding module train side by side for ``--verify-steps`` batches from the same parameters;
   logits, every parameter gradient, the memory and the last-update times must agree within
   float32 tolerance (:func:`fastopt.baselines.pyg_tgn.verify_modules`);
2. **TransformerConv forward+backward** at the example's sizes (the neighbor graph of training
   batch ``--conv-batch`` from PyG's ``LastNeighborLoader``: the batch's nodes and their last 10
   neighbors; 100-d inputs, 2 heads of 50, 272-d edge features): eager vs the optimized layer,
   checked in eval mode (outputs, input and parameter gradients), then timed in training mode
   (dropout on) over ``--iters`` steps after ``--warmup``, the two layers' steps taking turns
   (median; CUDA synchronized around each step on a GPU);
3. **epochs**: the example trained for ``--epochs`` epochs unmodified, then with
   ``fastopt.optimize(memory)`` and ``fastopt.optimize(gnn)`` (nothing else changed), once per
   seed of ``--seeds``: seconds per training epoch (median after each run's first epoch) and
   test AP after the last epoch, per seed and as a mean
   (:func:`fastopt.baselines.pyg_tgn.run_pyg_tgn`). With ``--control``, per seed also the
   example with its initial parameters changed at rounding level (``1 + 1e-7 N(0, 1)``): its AP
   gap to the plain example is what float32 rounding alone moves the result by, since training
   amplifies differences of that size (two runs of a seed part in the loss's 4th digit within the
   first epoch).

4. **AP study** (``--ap-seeds S ...``; ``--ap-merge FILE ...`` adds the runs of earlier calls,
   or only merges them): test AP after ``--epochs`` of the example unmodified,
   optimized and perturbed as the control, once per seed, ``--jobs`` runs at a time in worker
   processes (not timed): the gaps to PyG paired by seed, with their standard errors, so that
   a gap can be told from rounding with more seeds than a timed run can afford.

Prints a table, writes JSON (``--json``: date, device, versions, commit, command, every
figure), and exits with status 1 when a check fails (nothing is timed after a failed check)::

    python bench/pyg_tgn.py --device cuda --epochs 5 --seeds 0 1 2 --json bench/results/pyg-tgn-h200.json
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import sys
import time

import torch

import fastopt
from _meta import write_record
from fastopt.baselines.pyg_tgn import difference, run_pyg_tgn, verify_modules
from fastopt.data import TemporalGraph, load_dataset
from fastopt.errors import FastOptError

IN_CHANNELS, HEADS, HEAD_DIM, TIME_DIM = 100, 2, 50, 100
AP_LABELS = ("pyg", "fastopt", "pyg-control")
# the runtime's and driver's launch entry points: cudaLaunchKernel, cudaLaunchKernelExC,
# cuLaunchKernel, cuLaunchKernelEx, cudaGraphLaunch
_LAUNCH = re.compile(r"cu(da)?(Graph)?Launch(Kernel\w*)?")
# the control run's relative change of each initial parameter: rounding level for float32
CONTROL_PERTURBATION = 1e-7


def _graph(args) -> TemporalGraph:
    g = load_dataset(args.dataset, edge_dim=args.edge_dim)
    if args.events and args.events < g.num_events:
        feat = None if g.edge_feat is None else g.edge_feat[:args.events]
        g = TemporalGraph(g.src[:args.events], g.dst[:args.events], g.ts[:args.events],
                          g.num_nodes, edge_feat=feat, name=f"{g.name}-head{args.events}")
    return g


def _conv_inputs(graph: TemporalGraph, args, device: torch.device):
    """The example's TransformerConv inputs at training batch ``args.conv_batch``."""
    import torch_geometric.nn.models.tgn as tgn

    loader_cls = getattr(tgn, "LastNeighborLoader", None)
    if loader_cls is None:
        from torch_geometric.loader import LastNeighborLoader as loader_cls
    loader = loader_cls(graph.num_nodes, size=10, device=device)
    src = torch.from_numpy(graph.src).to(device)
    dst = torch.from_numpy(graph.dst).to(device)
    train = graph.split_range("train")
    starts = list(range(train.start, train.stop, args.batch_size))
    batch = min(args.conv_batch, len(starts) - 1)
    for start in starts[:batch]:
        stop = min(start + args.batch_size, train.stop)
        loader.insert(src[start:stop], dst[start:stop])
    start = starts[batch]
    stop = min(start + args.batch_size, train.stop)
    g = torch.Generator().manual_seed(args.seed)
    pool = torch.from_numpy(graph.destination_pool())
    neg = pool[torch.randint(0, pool.numel(), (stop - start,), generator=g)].to(device)
    n_id = torch.cat([src[start:stop], dst[start:stop], neg]).unique()
    n_id, edge_index, _ = loader(n_id)
    edge_dim = (graph.edge_feat.shape[1] if graph.edge_feat is not None else 1) + TIME_DIM
    x = torch.randn(n_id.numel(), IN_CHANNELS, generator=g).to(device)
    edge_attr = torch.randn(edge_index.shape[1], edge_dim, generator=g).to(device)
    return x, edge_index, edge_attr


def _step(conv, x, edge_index, edge_attr):
    xs, ea = x.detach().requires_grad_(), edge_attr.detach().requires_grad_()
    out = conv(xs, edge_index, ea)
    grads = torch.autograd.grad(out, [xs, ea, *conv.parameters()], torch.ones_like(out))
    return out, grads


def _check_conv(eager, fast, inputs) -> tuple:
    """Largest differences of output and gradients (eval mode), and the first beyond tolerance."""
    eager.eval()
    fast.eval()
    want, want_grads = _step(eager, *inputs)
    got, got_grads = _step(fast, *inputs)
    largest, bad = 0.0, None
    for what, g, w in [("output", got, want), *((f"gradient {i}", a, b) for i, (a, b) in
                                                enumerate(zip(got_grads, want_grads)))]:
        diff, bound = difference(g, w, gradient=what != "output")
        largest = max(largest, diff)
        if diff > bound and bad is None:
            bad = f"{what}: largest difference {diff:.3g} > {bound:.3g}"
    return largest, bad


def _time_convs(convs, inputs, args, device) -> list:
    """Median milliseconds of forward+backward in training mode of each layer of ``convs``, their
    steps taking turns (the order alternating from one round to the next), so that a change in
    the machine's speed during the run moves every layer's figure alike; node and edge features
    require gradients, as the memory's output and the time encoding do in the example.

    Each entry is ``(step_ms, phases)``, ``phases`` the median microseconds until the forward
    call returned, until ``backward()`` returned and waiting for the device after it: where the
    step's time goes (host work or device work left when the host is done)."""
    x, edge_index, edge_attr = inputs
    x, edge_attr = x.detach().requires_grad_(), edge_attr.detach().requires_grad_()
    times = [[] for _ in convs]
    for conv in convs:
        conv.train()
    for i in range(args.warmup + args.iters):
        order = range(len(convs)) if i % 2 == 0 else reversed(range(len(convs)))
        for j in order:
            convs[j].zero_grad(set_to_none=True)
            x.grad = edge_attr.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            out = convs[j](x, edge_index, edge_attr)
            t1 = time.perf_counter()
            out.sum().backward()
            t2 = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= args.warmup:
                times[j].append((time.perf_counter() - t0, t1 - t0, t2 - t1, time.perf_counter() - t2))
    result = []
    for t in times:
        step = statistics.median(s[0] for s in t) * 1e3
        phases = {name: statistics.median(s[k] for s in t) * 1e6
                  for k, name in enumerate(("forward_us", "backward_us", "device_wait_us"), 1)}
        result.append((step, phases))
    return result


def _profile_conv(conv, inputs, args, device, label: str) -> None:
    """torch.profiler over ``--iters`` training steps of ``conv`` (after the timing warmed it):
    host and device time per step and the operators with the most of each (``--profile-conv``)."""
    from torch.profiler import ProfilerActivity, profile

    conv.train()
    x, edge_index, edge_attr = inputs
    x, edge_attr = x.detach().requires_grad_(), edge_attr.detach().requires_grad_()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(args.iters):
            conv.zero_grad(set_to_none=True)
            x.grad = edge_attr.grad = None
            conv(x, edge_index, edge_attr).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    # kernels and copies only: an operator's self device time counts its kernels again
    device_us = sum(e.self_device_time_total for e in events
                    if e.device_type != torch.autograd.DeviceType.CPU) / args.iters
    host_us = sum(e.self_cpu_time_total for e in events
                  if e.device_type == torch.autograd.DeviceType.CPU) / args.iters
    launches = sum(e.count for e in events if _LAUNCH.fullmatch(e.key)) / args.iters
    print(f"\n== profile: {label} TransformerConv, {args.iters} training steps: host time "
          f"{host_us:.1f} us, device time {device_us:.1f} us per step (host time with the "
          f"profiler's overhead), {launches:.1f} kernel/graph launches per step")
    for sort in ("self_cpu_time_total",) + (("self_device_time_total",) if device.type == "cuda" else ()):
        print(events.table(sort_by=sort, row_limit=args.profile_conv))


def _epochs(graph: TemporalGraph, args, device: torch.device) -> dict:
    """The example trained unmodified and optimized, once per seed (PyG first each time):
    steady seconds per epoch (median after the first epoch, over all seeds' runs) and test AP
    after the last epoch (per seed and mean). Both draw the same attention dropout masks and
    negatives; they part by rounding (and, on CUDA, by the order in which PyG's LastAggregator
    resolves messages of equal time), which training can amplify."""
    contenders = [("pyg", None, 0.0), ("fastopt", fastopt.optimize, 0.0)]
    if args.control:  # PyG against itself, parameters scaled by 1 + 1e-7 N(0, 1)
        contenders.append(("pyg-control", None, CONTROL_PERTURBATION))
    runs = {label: [] for label, _, _ in contenders}
    for seed in args.seeds:
        for label, modules, perturb in contenders:
            runs[label].append(run_pyg_tgn(graph, batch_size=args.batch_size, epochs=args.epochs,
                                           device=device, seed=seed, modules=modules, perturb=perturb))
    steady = {k: statistics.median(s for run in v for s in (run["epoch_seconds"][1:]
                                                             or run["epoch_seconds"]))
              for k, v in runs.items()}
    ap = {k: [run["test"]["ap"] for run in v] for k, v in runs.items()}
    out = {"seeds": list(args.seeds), "epochs": runs, "steady_epoch_seconds": steady,
           "epoch_speedup": steady["pyg"] / steady["fastopt"], "test_ap": ap,
           "test_ap_points": 100 * (statistics.mean(ap["fastopt"]) - statistics.mean(ap["pyg"]))}
    if args.control:  # the same gap for a rounding-level change of PyG itself: the noise floor
        out["control_ap_points"] = 100 * (statistics.mean(ap["pyg-control"]) - statistics.mean(ap["pyg"]))
    print(f"\n{'':10s} {'s / epoch (steady)':>20s} {'first epoch':>12s} "
          f"{'test AP (' + str(args.epochs) + ' ep.), per seed':>30s}")
    for label, seeded in runs.items():
        print(f"{label:11s} {steady[label]:19.3f} {seeded[0]['epoch_seconds'][0]:12.3f} "
              f"{' '.join(f'{a:.4f}' for a in ap[label]):>30s}")
    print(f"epoch speedup {out['epoch_speedup']:.2f}x; mean test AP fastopt minus PyG "
          f"{out['test_ap_points']:+.2f} points over {len(args.seeds)} seed(s)")
    if args.control:
        print(f"control: PyG with its initial parameters scaled by 1 + {CONTROL_PERTURBATION:g} N(0,1), "
              f"minus PyG: {out['control_ap_points']:+.2f} points (what rounding alone moves the mean by)")
    return out


def _ap_run(job: dict) -> dict:
    """One training run of the AP study (a worker process's job, or in-process for ``--jobs 1``):
    ``job`` holds the script's arguments as a dict, the contender's label and the seed."""
    args = argparse.Namespace(**job["args"])
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    modules = fastopt.optimize if job["label"] == "fastopt" else None
    perturb = CONTROL_PERTURBATION if job["label"] == "pyg-control" else 0.0
    run = run_pyg_tgn(_graph(args), batch_size=args.batch_size, epochs=args.epochs,
                      device=torch.device(args.device), seed=job["seed"], modules=modules,
                      perturb=perturb)
    return {"label": job["label"], "seed": job["seed"], "test_ap": run["test"]["ap"],
            "val_ap": run["val"]["ap"], "final_loss": run["loss"][-1]}


def _paired_gap(ap: dict, label: str, seeds: list) -> dict:
    """``label``'s test AP minus PyG's, per seed, in points: mean and its standard error."""
    gaps = [100 * (ap[label][s] - ap["pyg"][s]) for s in seeds]
    se = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else float("nan")
    return {"per_seed": gaps, "mean": statistics.mean(gaps), "standard_error": se}


def _ap_study(args, merged: list) -> dict:
    """Test AP after ``--epochs`` of the example unmodified, optimized and perturbed at rounding
    level (the control), per seed of ``--ap-seeds``, ``--jobs`` runs at a time in worker
    processes (their epoch times are shared machines' and not reported): the gaps to PyG, paired
    by seed, with their standard errors, ``merged`` (earlier calls' runs) included. The
    control's gap is what rounding alone makes, so fastopt's is judged against it."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing
    import os

    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    jobs = [{"args": vars(args), "label": label, "seed": seed, "threads": threads}
            for seed in args.ap_seeds for label in args.ap_labels]
    results = []

    def keep(run: dict) -> None:  # one line per run as it ends: a run cut short keeps them
        results.append(run)
        print(f"  run {run['label']:12s} seed {run['seed']:3d}: test AP {run['test_ap']:.4f}", flush=True)

    if args.jobs == 1:
        for job in jobs:
            keep(_ap_run(job))
    else:  # spawned: CUDA cannot be used in a forked child
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for run in pool.map(_ap_run, jobs):
                keep(run)
    return _ap_summary(merged + results, args.epochs, args.jobs)


_RUN_LINE = re.compile(r"^\s+run (\S+)\s+seed\s+(\d+): test AP ([0-9.]+)")


def _merged_runs(paths: list) -> list:
    """AP-study runs of earlier calls (``--ap-merge``): a JSON file this script wrote (its
    ``ap_study.runs``), or a log of it (the per-run lines; a study cut by a time limit leaves
    those and no JSON)."""
    runs = []
    for path in paths:
        text = open(path).read()
        if path.endswith(".json"):
            runs += json.loads(text)["ap_study"]["runs"]
            continue
        for line in text.splitlines():
            m = _RUN_LINE.match(line)
            if m:
                runs.append({"label": m[1], "seed": int(m[2]), "test_ap": float(m[3]), "from": path})
    return runs


def _ap_summary(results: list, epochs: int, jobs: int) -> dict:
    """The study (a seed run twice keeps its last run): each contender's gap to PyG over the
    seeds both finished, paired by seed, and the contenders' means and spreads over the seeds
    every contender finished (where there are such seeds)."""
    ap = {label: {r["seed"]: r["test_ap"] for r in results if r["label"] == label} for label in AP_LABELS}
    out = {"epochs": epochs, "jobs": jobs, "runs": results}
    print(f"\nAP study: test AP after {epochs} epochs, {jobs} run(s) at a time")
    for label, key, what in (("fastopt", "fastopt_minus_pyg", "fastopt minus PyG"),
                             ("pyg-control", "control_minus_pyg", "control minus PyG (rounding alone)")):
        seeds = sorted(set(ap[label]) & set(ap["pyg"]))
        if not seeds:
            continue
        gap = out[key] = dict(_paired_gap(ap, label, seeds), seeds=seeds)
        print(f"  {what}, {len(seeds)} seeds: {gap['mean']:+.2f} +- {gap['standard_error']:.2f} "
              f"points (standard error); means {statistics.mean(ap[label][s] for s in seeds):.4f} "
              f"and {statistics.mean(ap['pyg'][s] for s in seeds):.4f}")
    if "fastopt_minus_pyg" not in out:
        raise SystemExit("the AP study has no seed that both PyG and fastopt finished")
    common = sorted(set.intersection(*(set(ap[label]) for label in AP_LABELS)))
    out["seeds"] = common
    for label in AP_LABELS if len(common) > 1 else ():
        values = [ap[label][s] for s in common]
        print(f"  {label:12s} over the {len(common)} seeds all three finished: mean "
              f"{statistics.mean(values):.4f}  sd {statistics.stdev(values):.4f}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dataset", default="wikipedia")
    parser.add_argument("--edge-dim", type=int, default=172)
    parser.add_argument("--events", type=int, default=0, help="only the first N events (0: all)")
    parser.add_argument("--batch-size", type=int, default=600)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="seed of the checks")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="seeds of the epoch runs (both trained once per seed)")
    parser.add_argument("--verify-steps", type=int, default=5)
    parser.add_argument("--conv-batch", type=int, default=100)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--skip-epochs", action="store_true", help="no timed epochs: the checks, the layer (and the AP study when asked)")
    parser.add_argument("--control", action="store_true",
                        help="also train PyG's example with its initial parameters changed at rounding "
                             "level, per seed: the AP gap that rounding alone makes (the noise floor)")
    parser.add_argument("--profile-conv", type=int, default=0, metavar="ROWS",
                        help="after timing the layer, profile its eager and fastopt steps and print "
                             "the ROWS operators with the most host and device time")
    parser.add_argument("--ap-seeds", type=int, nargs="*", default=[], metavar="SEED",
                        help="after the rest, the AP study: the example unmodified, optimized and as "
                             "the control trained once per seed (test AP only, no timing)")
    parser.add_argument("--jobs", type=int, default=1, help="the AP study's runs at a time (processes)")
    parser.add_argument("--ap-labels", nargs="+", default=list(AP_LABELS), choices=AP_LABELS,
                        help="the AP study's contenders (default all; the gaps pair each with pyg "
                             "over the seeds both have, merged runs included)")
    parser.add_argument("--ap-merge", nargs="*", default=[], metavar="FILE",
                        help="add the AP-study runs of earlier calls (their --json files, or their logs) "
                             "to this one's; with no --ap-seeds, only merge them (no training)")
    parser.add_argument("--json", help="write the record to this JSON file")
    args = parser.parse_args(argv)
    for name in ("batch_size", "epochs", "iters", "verify_steps", "jobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r} is not a torch device; pass cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device} but this torch sees no CUDA device; pass --device cpu")
    try:  # read before any training: a bad file must not cost a whole run
        merged = _merged_runs(args.ap_merge)
    except (OSError, KeyError, ValueError) as exc:
        parser.error(f"--ap-merge: {exc}")
    if args.ap_merge and not args.ap_seeds:  # the study of earlier calls' runs alone
        study = _ap_summary(merged, args.epochs, args.jobs)
        if args.json:
            write_record(args.json, ap_study=study, merged=args.ap_merge)
            print(f"wrote {args.json}")
        return 0
    try:
        graph = _graph(args)
    except FastOptError as exc:
        parser.error(str(exc))
    record = {"dataset": graph.name, "events": graph.num_events, "batch_size": args.batch_size,
              "device": str(device)}

    check = verify_modules(graph, fastopt.optimize, batch_size=args.batch_size,
                           steps=args.verify_steps, device=device, seed=args.seed)
    record["model_check"] = check
    print(f"model check ({check['steps']} training steps): "
          f"{'ok' if check['ok'] else 'FAILED: ' + check['first_mismatch']}; largest differences "
          + ", ".join(f"{k} {v:.3g}" for k, v in check["largest"].items()))

    from torch_geometric.nn import TransformerConv

    torch.manual_seed(args.seed)
    inputs = _conv_inputs(graph, args, device)
    eager = TransformerConv(IN_CHANNELS, HEAD_DIM, heads=HEADS, dropout=0.1,
                            edge_dim=inputs[2].shape[1]).to(device)
    fast = fastopt.optimize(copy.deepcopy(eager))
    largest, bad = _check_conv(eager, fast, inputs)
    conv = {"nodes": inputs[0].shape[0], "edges": inputs[1].shape[1],
            "edge_dim": inputs[2].shape[1], "largest_difference": largest, "ok": bad is None,
            "mismatch": bad, "report": str(fast.fastopt_report)}
    record["transformer_conv"] = conv
    print(f"TransformerConv check ({conv['nodes']} nodes, {conv['edges']} edges): "
          f"{'ok' if bad is None else 'FAILED: ' + bad}; largest difference {largest:.3g}")
    failed = not check["ok"] or bad is not None
    if not failed:
        (conv["eager_ms"], conv["eager_phases"]), (conv["fastopt_ms"], conv["fastopt_phases"]) = \
            _time_convs([eager, fast], inputs, args, device)
        conv["speedup"] = conv["eager_ms"] / conv["fastopt_ms"]
        print(f"TransformerConv forward+backward: eager {conv['eager_ms']:.3f} ms, fastopt "
              f"{conv['fastopt_ms']:.3f} ms ({conv['speedup']:.2f}x)")
        for name in ("eager", "fastopt"):
            print(f"  {name} step, median us: " + ", ".join(
                f"{k[:-3].replace('_', ' ')} {v:.0f}" for k, v in conv[f"{name}_phases"].items()))
        if args.profile_conv:
            for label, layer in (("eager", eager), ("fastopt", fast)):
                _profile_conv(layer, inputs, args, device, label)

    if not failed and not args.skip_epochs:
        record.update(_epochs(graph, args, device))
    if not failed and args.ap_seeds:
        record["ap_study"] = _ap_study(args, merged)

    if args.json:
        write_record(args.json, **record)
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
