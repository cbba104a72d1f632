"""Where a training epoch's time goes: torch.profiler over one steady epoch of the Trainer.

Trains one warm-up epoch, then profiles the next (host and device activity) and prints the
operators with the most host time and the most device time, and the epoch's stage breakdown::

    python bench/epoch_profile.py --model tgn --batch-size 600 [--no-optimize] [--trace out.json]
    python bench/epoch_profile.py --model tgat --shapes   # matrix products by input shape

``--loader`` profiles the loader's producer instead (``Loader.stage`` of one epoch's batches,
called in turn on this thread, under cProfile): where the host time that feeds the step goes.
``--pipeline N`` runs N epochs as ``fit`` does (training, then validation) with nothing
profiled, one line each: the epoch, its stages, the steps captured in it, the padded lengths it
ended with, the seconds the staging threads spent sampling (``Loader.sample``) and staging
(``Loader.stage``, its own sampling and SlimCache's counting of zero-copy reads (``SlimCache.count``) left out;
the reads themselves run in ``stage``, or in the step under ``cache.read_in_step``), the training thread finishing batches
(``Loader.finish``), each with the seconds its threads spent on a CPU (``time.thread_time``:
a wall time well above it is waiting, on the GIL, a lock or the driver), and the minor page
faults of the training pass: whether an epoch waits on its producer, and why.
``--shapes`` runs without CUDA graphs (a replayed graph hides its operators from the profiler)
and lists the matrix products grouped by their input shapes, by device time. On CUDA it also
says how long the device sat idle in the profiled epoch (no kernel running on any stream) and
where the longest gaps fell, between which kernels: an epoch longer than its device time is
waiting on the host or the loader there. Then the host time each thread spent in CUDA runtime and
driver calls, the costliest calls per thread: the same calls taking longer on one path than on
another are waiting (on another thread's calls into the driver, or the GIL). Under the profiler
``cudaGraphLaunch`` costs far more than it does without one (H200, TGN's step graphs: 325 us per
launch profiled, 15-33 us measured by ``bench/graph_launch.py``): read it as the profiler's cost.

A diagnostic, not a comparison: it times nothing against eager and records no result. It still
checks what it runs: an epoch whose mean loss is not finite, or an optimized model whose outputs
or parameter gradients disagree with eager after the warm-up (:func:`fastopt.verify_against_eager`
on the first training batch, the model's state as the warm-up left it), is printed as
``WRONG RESULT``, nothing more is profiled or printed, and the script exits with status 1.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from typing import List, Optional, Tuple

import torch

from fastopt import verify_against_eager
from fastopt.config import default_config
from fastopt.data import load_dataset
from fastopt.errors import FastOptError
from fastopt.models import build_model
from fastopt.trainer import Trainer


# the CUDA runtime's and driver's entry points as the profiler names them (cudaLaunchKernel, cuLaunchKernelEx)
_CUDA_API = re.compile(r"cu(da)?[A-Z]")
_TRAINING = "epoch_profile::training_thread"


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The run a diagnostic trains: model, dataset, batch size, edge feature width."""
    p.add_argument("--model", default="tgn")
    p.add_argument("--dataset", default="wikipedia")
    p.add_argument("--batch-size", type=int, default=600)
    p.add_argument("--edge-dim", type=int, default=172)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(p)
    p.add_argument("--no-optimize", action="store_true")
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--trace", default=None, help="write a Chrome trace here")
    p.add_argument("--shapes", action="store_true", help="matrix products by input shape (no CUDA graphs)")
    p.add_argument("--loader", action="store_true", help="profile the loader's producer (cProfile)")
    p.add_argument("--pipeline", type=int, default=0, metavar="EPOCHS",
                   help="EPOCHS epochs as fit runs them, a line each: stages, captures, producer time")
    args = p.parse_args(argv)
    cfg = default_config().copy()
    cfg.train.batch_size = args.batch_size
    cfg.train.optimize = "off" if args.no_optimize else "auto"
    if args.shapes:
        cfg.passes.cuda_graphs, cfg.pipeline.step_graphs = "off", "off"
    graph = load_dataset(args.dataset, edge_dim=args.edge_dim)
    torch.manual_seed(0)
    trainer = Trainer(build_model(args.model, graph), graph, cfg, progress=False)
    if args.loader:
        return profile_loader(trainer, args.rows)
    if args.pipeline:
        return profile_pipeline(trainer, args.pipeline) or report_wrong(
            eager_disagreement(trainer, args.model, graph))
    wrong = []
    for epoch in range(2):
        t0 = time.perf_counter()
        stats = trainer.train_epoch(epoch)
        print(f"warm-up epoch {epoch}: {time.perf_counter() - t0:.3f} s, stages "
              + " ".join(f"{k}={v:.3f}" for k, v in stats.stages.items()), flush=True)
        wrong += loss_failures(stats)
    wrong = wrong or eager_disagreement(trainer, args.model, graph)
    if wrong:
        return report_wrong(wrong)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # a CUDA call outside any recorded op is given the thread that collects the profile (this
    # one): staging runs inside one, so that its calls are the staging threads' (recorded when
    # the profiler records every thread's operators, profiler_options)
    stage = trainer.loader.stage
    trainer.loader.stage = lambda *a, **kw: _marked("epoch_profile::stage", stage, *a, **kw)
    options = profiler_options()
    if not options:
        print("note: this torch records only the collecting thread's operators: the staging threads' "
              "CUDA calls are counted as the training thread's")
    with torch.profiler.profile(activities=activities, record_shapes=args.shapes, **options) as prof:
        with torch.profiler.record_function(_TRAINING):  # marks this thread's id in the profile
            pass
        stats = trainer.train_epoch(2)
    del trainer.loader.stage
    print(f"profiled epoch: {stats.seconds:.3f} s (with profiler overhead), stages "
          + " ".join(f"{k}={v:.3f}" for k, v in stats.stages.items()))
    wrong = loss_failures(stats)
    if wrong:
        return report_wrong(wrong)
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if torch.cuda.is_available():
        print(table.table(sort_by="self_device_time_total", row_limit=args.rows))
    if args.shapes:
        products = [e for e in prof.key_averages(group_by_input_shape=True)
                    if e.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")]
        products.sort(key=lambda e: -e.device_time_total)
        print(f"{'op':<12} {'calls':>6} {'device ms':>10}  input shapes")
        for e in products[: args.rows]:
            print(f"{e.key:<12} {e.count:>6} {e.device_time_total / 1e3:>10.1f}  {e.input_shapes}")
    if torch.cuda.is_available():
        kernels = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Memcpy")]
        print(idle_report(kernels, args.rows))
        calls = [(e.thread, e.name, e.time_range.elapsed_us()) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CPU and _CUDA_API.match(e.name)]
        training = next((e.thread for e in prof.events() if e.name == _TRAINING), None)
        print(api_report(calls, training, rows=4))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    return 0


def profile_pipeline(trainer: Trainer, epochs: int) -> int:
    """``epochs`` epochs of training then validation, a line each (see the module docstring);
    1 (after printing why) when an epoch's mean loss is not finite."""
    import resource
    import threading
    from collections import defaultdict

    loader, lock, inside = trainer.loader, threading.Lock(), threading.local()
    spent, cpu = defaultdict(float), defaultdict(float)  # wall seconds, and the calling thread's CPU seconds

    def timed(name, method):
        def call(*args, **kwargs):
            outer = getattr(inside, "call", None)  # stage samples a batch nothing sampled yet
            inside.call = name
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                seconds, on_cpu = time.perf_counter() - t0, time.thread_time() - c0
                inside.call = outer
                with lock:
                    spent[name] += seconds
                    cpu[name] += on_cpu
                    if outer is not None:
                        spent[outer] -= seconds
                        cpu[outer] -= on_cpu
        return call

    for name in ("sample", "stage", "finish"):  # the loader's own calls go through these too
        setattr(loader, name, timed(name, getattr(loader, name)))
    if loader.cache is not None:  # SlimCache's counting of zero-copy reads, inside stage
        loader.cache.count = timed("count", loader.cache.count)
    graphs = trainer.step_graphs  # None: no whole-step capture on this device
    for epoch in range(epochs):
        spent.clear()
        cpu.clear()
        captured = graphs.captures if graphs is not None else 0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        stats = trainer.train_epoch(epoch)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        captured = (graphs.captures - captured) if graphs is not None else 0
        wrong = loss_failures(stats)
        if wrong:  # before validation, which refuses non-finite scores
            return report_wrong(wrong)
        training, on_cpu = dict(spent), dict(cpu)  # validation goes through the same calls
        t0 = time.perf_counter()
        trainer.evaluate("val")
        trainer.epoch = epoch + 1
        print(f"epoch {epoch}: {stats.seconds:.3f} s, stages "
              + " ".join(f"{k}={v:.3f}" for k, v in stats.stages.items())
              + f"; {captured} step(s) captured; staging threads sampling {training.get('sample', 0):.3f} s "
              f"({on_cpu.get('sample', 0):.3f} on a CPU), staging {training.get('stage', 0):.3f} s "
              f"({on_cpu.get('stage', 0):.3f}), counting reads {training.get('count', 0):.3f} s ({on_cpu.get('count', 0):.3f})"
              f"; training thread finishing {training.get('finish', 0):.3f} s "
              f"({on_cpu.get('finish', 0):.3f}); {faults} minor faults; validation {time.perf_counter() - t0:.2f} s; "
              f"padded lengths {dict(loader.high_water.lengths)}", flush=True)
    return 0


def idle_report(kernels: List[Tuple[float, float, str]], rows: int) -> str:
    """How long no kernel ran between the first kernel's start and the last one's end, and the
    ``rows`` longest such gaps with when each began (from the first kernel's start) and the
    kernels around it (times in microseconds)."""
    if not kernels:
        return "device idle: no kernel was recorded"
    kernels = sorted(kernels)
    first = kernels[0][0]
    gaps, end, last = [], kernels[0][1], kernels[0][2]
    for start, stop, name in kernels[1:]:
        if start > end:
            gaps.append((start - end, end - first, last, name))
        if stop > end:
            end, last = stop, name
    span = end - first
    idle = sum(g[0] for g in gaps)
    lines = [f"device idle: {idle / 1e3:.1f} ms of {span / 1e3:.1f} ms ({100 * idle / max(span, 1e-9):.1f} %) "
             f"in {len(gaps)} gaps, {sum(g[0] > 50 for g in gaps)} of them over 50 us; the longest:"]
    for gap, at, before, after in sorted(gaps, reverse=True)[:rows]:
        lines.append(f"  {gap / 1e3:8.3f} ms  at +{at / 1e3:.1f} ms  after {before[:60]}  before {after[:60]}")
    return "\n".join(lines)


def profiler_options() -> dict:
    """``torch.profiler.profile`` keywords that record every thread's operators, not only the
    collecting thread's (without them a staging thread's operators are not recorded at all, and
    its CUDA calls are counted as the training thread's); empty where this torch has no such
    option."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        return {}


def _marked(name: str, fn, *args, **kwargs):
    with torch.profiler.record_function(name):
        return fn(*args, **kwargs)


def api_report(calls: List[Tuple[int, str, float]], training: Optional[int], rows: int) -> str:
    """Host time in CUDA runtime and driver calls per thread (``calls``: thread, call, duration
    in microseconds), the training thread (id ``training``) first, each with its ``rows`` costliest
    calls: a call that takes longer on one path than on another, the same number of times, waits
    for something (another thread's calls into the driver, the GIL). The profiler gives a call
    made outside any recorded op the collecting thread's id: only calls inside one (main marks
    ``Loader.stage``) on a thread whose operators are recorded (:func:`profiler_options`) are told
    apart."""
    if not calls:
        return "CUDA API: no call was recorded"
    by: dict = {}
    for thread, name, us in calls:
        n, total = by.setdefault(thread, {}).get(name, (0, 0.0))
        by[thread][name] = (n + 1, total + us)
    lines = ["CUDA API host time by thread:"]
    for thread in sorted(by, key=lambda t: (t != training, -sum(v[1] for v in by[t].values()))):
        named = by[thread]
        total = sum(v[1] for v in named.values())
        lines.append(f"  {'training' if thread == training else f'thread {thread}'}: {total / 1e3:.1f} ms in "
                     f"{sum(v[0] for v in named.values())} calls")
        for name, (n, us) in sorted(named.items(), key=lambda kv: -kv[1][1])[:rows]:
            lines.append(f"    {name:<28} {us / 1e3:8.1f} ms  {n:>6} calls  {us / n:8.1f} us each")
    return "\n".join(lines)


def loss_failures(stats) -> List[str]:
    """An epoch's mean loss that is not finite, said (empty: it is finite)."""
    return [] if math.isfinite(stats.loss) else [f"epoch {stats.epoch}'s mean loss is {stats.loss}"]


def eager_disagreement(trainer: Trainer, model: str, graph) -> List[str]:
    """The trainer's model, where it runs optimized, against an eager ``model`` given the same
    weights and state, on the first training batch (empty: it agrees, or it runs eager)."""
    if getattr(trainer.model, "fastopt_report", None) is None:
        return []
    eager = build_model(model, graph).to(trainer.device)
    eager.load_state_dict(trainer.model.state_dict())
    batch = next(iter(trainer.plan("train", 0)))
    try:
        verify_against_eager(trainer.model, eager, trainer.build_inputs(batch.roots, batch.times))
    except FastOptError as exc:
        return [f"optimized {model}: {exc}"]
    return []


def report_wrong(wrong: List[str]) -> int:
    """Print each wrong result; the exit status (1, or 0 when there is none)."""
    for line in wrong:
        print(f"WRONG RESULT: {line}")
    return 1 if wrong else 0


def profile_loader(trainer: Trainer, rows: int) -> int:
    """cProfile of ``Loader.stage`` over one epoch's training batches (after one warm-up pass)."""
    import cProfile
    import pstats

    loader = trainer.loader

    def fresh_epoch():
        """The epoch's batches, none sampled yet, the sampler rewound (each pass samples all)."""
        if loader.sampler is not None:
            loader.sampler.reset(0)
        return list(loader.plan("train", 0))

    def stage(batch):
        loader.stage(batch)
        if loader.cache is not None:  # the staged cache lookups applied, as the consumer does
            loader.cache.drain()

    for batch in fresh_epoch()[:20]:
        stage(batch)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    batches = fresh_epoch()
    t0 = time.perf_counter()
    for batch in batches:
        loader.sample(batch)  # the draws keyed by the batch, as staging threads make them
        batch.sampled = None  # let it go, as the consumer does
    sample = time.perf_counter() - t0
    batches = fresh_epoch()
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for batch in batches:
        stage(batch)
        batch.sampled = None  # freed once consumed, as in an epoch (kept, every batch's pages fault)
    profiler.disable()
    staged = time.perf_counter() - t0
    print(f"{len(batches)} batches: Loader.sample alone {sample:.3f} s, Loader.stage {staged:.3f} s "
          f"(under cProfile)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
