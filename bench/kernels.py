"""Fused temporal-attention kernels vs the eager PyTorch chain vs torch.compile of that chain.

TGN/TGAT shapes: M destinations (1,800 to 36,000), K = 10 sampled neighbors, H = 2 heads,
d = 50 and 100, keys/values as rows of unique tables (U = M*K/3) addressed by an index, a
padded [M, K] mask (some rows empty). For each shape, forward and forward+backward are timed with
CUDA events after warm-up (median of many runs, L2 flushed before each run), and the forward's
minimal traffic (q, out, lse, index, mask, each table row once) is compared with a device-to-device
copy bandwidth measured in the same run. Each shape's fused forward and both backward modes are
checked against the eager chain (largest difference relative to the eager result's largest
element); beyond ``--max-error`` the script exits with status 1.

    python bench/kernels.py --json bench/results/kernels-h200.json

Prints a table and writes JSON with the date, GPU, torch/triton versions, git commit and command.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import math
import os
import pstats
import shlex
import statistics
import sys
from typing import Callable, Dict, List

import torch

from _meta import git_commit


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--rows", type=int, nargs="+", default=[1800, 18000, 36000],
                        help="destinations M per batch")
    parser.add_argument("--dims", type=int, nargs="+", default=[50, 100], help="head dims d")
    parser.add_argument("--slots", type=int, default=10, help="neighbors K per destination")
    parser.add_argument("--heads", type=int, default=2, help="heads H")
    parser.add_argument("--warmup", type=int, default=10, help="untimed runs before timing")
    parser.add_argument("--iters", type=int, default=100, help="timed runs (median reported)")
    parser.add_argument("--no-flush", action="store_true", help="do not flush L2 between runs")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--mappings", nargs="*", default=[], metavar="KNOB=V[,KNOB=V]",
                        help="also time the fused op under these thread mappings (config.kernels "
                             "knobs, e.g. rows_per_program=2,num_warps=4)")
    parser.add_argument("--no-graph", action="store_true",
                        help="skip the graph-replay timing (device time without host launch gaps)")
    parser.add_argument("--graph-reps", type=int, default=20,
                        help="calls captured per CUDA graph in the graph-replay timing")
    parser.add_argument("--max-error", type=float, default=1e-4,
                        help="largest error of the fused forward or gradients relative to the "
                             "eager chain's largest element; beyond it the run fails")
    parser.add_argument("--profile", action="store_true",
                        help="print the device time of each kernel of the fused forward+backward "
                             "(torch.profiler) for the first shape, to split host from device time")
    return parser.parse_args(argv)


def parse_mapping(text: str) -> Dict[str, object]:
    """``"rows_per_program=2,gather_eviction=evict_last"`` -> ``{"rows_per_program": 2,
    "gather_eviction": "evict_last"}`` (integers where the value is one)."""
    knobs = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        value = value.strip()
        knobs[name.strip()] = int(value) if value.lstrip("-").isdigit() else value
    return knobs


# ----------------------------------------------------------------------------------------------
# the eager chain a TGNN layer runs (and torch.compile compiles)
# ----------------------------------------------------------------------------------------------


def eager_chain(q, k_table, v_table, index, mask, scale: float):
    """Gather, score, masked edge softmax, weighted sum: the unfused layer."""
    k = k_table[index]
    v = v_table[index]
    scores = torch.einsum("mhd,mkhd->mhk", q, k) * scale
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    weights = weights.masked_fill(~mask[:, None, :], 0.0)
    return torch.einsum("mhk,mkhd->mhd", weights, v)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|`` (NaN anywhere counts as infinitely wrong)."""
    error = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    return error if math.isfinite(error) else math.inf


def gradient_errors(q, k, v, index, mask, scale: float, grad) -> Dict[str, float]:
    """Largest :func:`relative_error` of dq, dk, dv per backward mode (the benchmark's own
    correctness check at its sizes, where table sizes pick the sort-key width)."""
    import fastopt.config as fconfig

    want = torch.autograd.grad(eager_chain(q, k, v, index, mask, scale), (q, k, v), grad)
    errors = {}
    for mode in ("deterministic", "atomic"):
        with fconfig.patch(kernels__backward_mode=mode):
            got = torch.autograd.grad(fused(q, k, v, index, mask, scale), (q, k, v), grad)
        errors[mode] = max(relative_error(g, w) for g, w in zip(got, want))
    return errors


def accuracy_failures(result: Dict[str, object], max_error: float) -> List[str]:
    """What of one shape's recorded errors exceeds ``max_error`` (empty: the kernels are right)."""
    where = f"M={result['M']} d={result['d']}"
    errors = {"forward": result["fwd_rel_error"],
              **{f"{mode} backward": e for mode, e in result["grad_rel_error"].items()}}
    return [f"{where}: {what} relative error {error:.3g} exceeds {max_error:g}"
            for what, error in errors.items() if not error <= max_error]


def fused(q, k_table, v_table, index, mask, scale: float):
    from fastopt.codegen import temporal_attention

    return temporal_attention(q, k_table, v_table, mask, k_index=index, v_index=index, scale=scale)


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------


class Timer:
    """Median milliseconds of a CUDA callable, timed with events, L2 flushed before each run."""

    def __init__(self, warmup: int, iters: int, flush: bool):
        self.warmup, self.iters = warmup, iters
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
        self.scrub = torch.empty(max(4 * l2, 256 << 20), dtype=torch.uint8, device="cuda") if flush else None

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        events = []
        for _ in range(self.iters):
            if self.scrub is not None:
                self.scrub.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)


class GraphTimer:
    """Median milliseconds per call of a CUDA callable replayed from a captured CUDA graph.

    ``fn(i)`` runs one call on input set ``i``; ``reps`` calls cycling over ``sets`` input sets
    (together larger than the L2 cache, so no call finds its inputs cached by the one before) are
    captured in one graph, and replays of it are timed with events: the device time of the work
    without the host's launch gaps, the same way for every implementation compared.
    """

    def __init__(self, warmup: int, iters: int, reps: int):
        self.warmup, self.iters, self.reps = warmup, iters, reps

    def __call__(self, fn: Callable[[int], object], sets: int) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(max(self.warmup, sets)):
                fn(i % sets)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(self.reps):
                fn(i % sets)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / self.reps)
        del graph
        return statistics.median(times)


def copy_bandwidth(timer: Timer, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def forward_bytes(rows: int, slots: int, heads: int, dim: int, table_rows: int,
                  elem: int = 4) -> int:
    """Minimal forward traffic: q and out, lse, the index and mask, each table row once."""
    qo = 2 * rows * heads * dim * elem
    lse = rows * heads * 4
    index_mask = rows * slots * (8 + 1)
    tables = 2 * table_rows * heads * dim * elem
    return qo + lse + index_mask + tables


def make_inputs(rows: int, slots: int, heads: int, dim: int, seed: int = 0, device: str = "cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    table_rows = rows * slots // 3
    q = torch.randn(rows, heads, dim, device=device, generator=gen, requires_grad=True)
    k = torch.randn(table_rows, heads, dim, device=device, generator=gen, requires_grad=True)
    v = torch.randn(table_rows, heads, dim, device=device, generator=gen, requires_grad=True)
    index = torch.randint(0, table_rows, (rows, slots), device=device, generator=gen)
    counts = torch.randint(0, slots + 1, (rows,), device=device, generator=gen)
    mask = torch.arange(slots, device=device)[None, :] < counts[:, None]
    return q, k, v, index, mask, table_rows


def accuracy(q, k, v, index, mask, scale: float, grad) -> Dict[str, object]:
    """The fused op against the eager chain: forward (absolute and relative) and gradient errors."""
    with torch.no_grad():
        want, got = eager_chain(q, k, v, index, mask, scale), fused(q, k, v, index, mask, scale)
    return {"max_abs_diff": float((want - got).abs().max()), "fwd_rel_error": relative_error(got, want),
            "grad_rel_error": gradient_errors(q, k, v, index, mask, scale, grad)}


def run_shape(timer: Timer, rows: int, slots: int, heads: int, dim: int, compile_baseline: bool,
              bandwidth: float, mappings: List[str] = ()) -> Dict[str, object]:
    import fastopt.config as fconfig

    q, k, v, index, mask, table_rows = make_inputs(rows, slots, heads, dim)
    scale = 1.0 / math.sqrt(dim)
    grad = torch.randn_like(q)
    impls = {"eager": eager_chain}
    if compile_baseline:
        impls["compile"] = torch.compile(eager_chain)
    result: Dict[str, object] = {"M": rows, "K": slots, "H": heads, "d": dim, "U": table_rows}

    def forward(fn):
        with torch.no_grad():
            return fn(q, k, v, index, mask, scale)

    def forward_backward(fn):
        q.grad = k.grad = v.grad = None
        fn(q, k, v, index, mask, scale).backward(grad)

    with fconfig.patch(kernels__check_inputs=False):
        for mode in ("deterministic", "atomic"):
            with fconfig.patch(kernels__backward_mode=mode):
                name = "fused" if mode == "deterministic" else "fused_atomic"
                if mode == "deterministic":
                    result["fused_fwd_ms"] = timer(lambda: forward(fused))
                result[f"{name}_fwdbwd_ms"] = timer(lambda: forward_backward(fused))
        result.update(accuracy(q, k, v, index, mask, scale, grad))
        result["mappings"] = []
        for text in mappings:
            knobs = parse_mapping(text)
            with fconfig.patch(**{f"kernels__{k}": v for k, v in knobs.items()}):
                result["mappings"].append(dict(
                    knobs=knobs, fused_fwd_ms=timer(lambda: forward(fused)),
                    fused_fwdbwd_ms=timer(lambda: forward_backward(fused))))
    for name, fn in impls.items():
        result[f"{name}_fwd_ms"] = timer(lambda: forward(fn))
        result[f"{name}_fwdbwd_ms"] = timer(lambda: forward_backward(fn))
    nbytes = forward_bytes(rows, slots, heads, dim, table_rows)
    achieved = nbytes / (result["fused_fwd_ms"] * 1e-3)
    result.update(
        forward_min_bytes=nbytes,
        fused_fwd_bytes_per_s=achieved,
        fused_fwd_fraction_of_copy=achieved / bandwidth,
        speedup_fwd_vs_eager=result["eager_fwd_ms"] / result["fused_fwd_ms"],
        speedup_fwdbwd_vs_eager=result["eager_fwdbwd_ms"] / result["fused_fwdbwd_ms"],
    )
    if compile_baseline:
        result["speedup_fwd_vs_compile"] = result["compile_fwd_ms"] / result["fused_fwd_ms"]
        result["speedup_fwdbwd_vs_compile"] = result["compile_fwdbwd_ms"] / result["fused_fwdbwd_ms"]
    return result


def run_shape_graph(gtimer: GraphTimer, rows: int, slots: int, heads: int, dim: int,
                    compile_fns: Dict[str, Callable], bandwidth: float,
                    mappings: List[str] = ()) -> Dict[str, object]:
    """Graph-replay device times of fused (deterministic and atomic), eager and compiled chains."""
    import fastopt.config as fconfig

    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    table_rows = rows * slots // 3
    set_bytes = forward_bytes(rows, slots, heads, dim, table_rows)
    count = max(2, min(8, math.ceil(3 * l2 / set_bytes)))
    sets = [make_inputs(rows, slots, heads, dim, seed=i)[:5] for i in range(count)]
    grads = [torch.randn_like(s[0]) for s in sets]
    scale = 1.0 / math.sqrt(dim)

    def forward(fn):
        def call(i):
            with torch.no_grad():
                return fn(*sets[i], scale)
        return call

    def forward_backward(fn):
        def call(i):
            q, k, v, index, mask = sets[i]
            return torch.autograd.grad(fn(q, k, v, index, mask, scale), (q, k, v), grads[i])
        return call

    result: Dict[str, object] = {"M": rows, "d": dim, "input_sets": count}
    with fconfig.patch(kernels__check_inputs=False):
        result["fused_fwd_ms"] = gtimer(forward(fused), count)
        for mode in ("deterministic", "atomic"):
            name = "fused" if mode == "deterministic" else "fused_atomic"
            with fconfig.patch(kernels__backward_mode=mode):
                result[f"{name}_fwdbwd_ms"] = gtimer(forward_backward(fused), count)
        result["mappings"] = []
        for text in mappings:
            knobs = parse_mapping(text)
            with fconfig.patch(**{f"kernels__{k}": v for k, v in knobs.items()}):
                entry = dict(knobs=knobs, fused_fwd_ms=gtimer(forward(fused), count))
                for mode in ("deterministic", "atomic"):
                    with fconfig.patch(kernels__backward_mode=mode):
                        entry[f"{mode}_fwdbwd_ms"] = gtimer(forward_backward(fused), count)
            result["mappings"].append(entry)
    for name, fn in {"eager": eager_chain, **compile_fns}.items():
        for stage, wrap in (("fwd", forward), ("fwdbwd", forward_backward)):
            try:
                result[f"{name}_{stage}_ms"] = gtimer(wrap(fn), count)
            except Exception as exc:  # a baseline that cannot be captured is reported, not fatal
                result[f"{name}_{stage}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    nbytes = forward_bytes(rows, slots, heads, dim, table_rows)
    result["fused_fwd_fraction_of_copy"] = nbytes / (result["fused_fwd_ms"] * 1e-3) / bandwidth
    for entry in result["mappings"]:
        entry["fused_fwd_fraction_of_copy"] = nbytes / (entry["fused_fwd_ms"] * 1e-3) / bandwidth
    for base in ("eager", "compile"):
        if f"{base}_fwdbwd_ms" in result:
            result[f"speedup_fwdbwd_vs_{base}"] = result[f"{base}_fwdbwd_ms"] / result["fused_fwdbwd_ms"]
            result[f"speedup_atomic_fwdbwd_vs_{base}"] = (result[f"{base}_fwdbwd_ms"]
                                                         / result["fused_atomic_fwdbwd_ms"])
            result[f"speedup_fwd_vs_{base}"] = result[f"{base}_fwd_ms"] / result["fused_fwd_ms"]
    return result


def print_resources(resources: List[Dict[str, object]]) -> None:
    """Registers and spills per thread of each compiled attention kernel and its mapping."""
    print("compiled attention kernels (registers / spills per thread, shared bytes per program):")
    for r in resources:
        if not r["family"].startswith("temporal_attention"):
            continue
        spec, cfg = r["spec"], r["mapping"]
        print(f"  {r['stage']:>8} K,H,d={r['shape']} softmax={spec.get('softmax', '-'):>8} "
              f"rows={cfg['rows_per_program']} block_m={cfg['block_m']} "
              f"warps={cfg['num_warps']}: {r['n_regs']} regs, {r['n_spills']} spills, "
              f"{r['shared_bytes']} B shared")


def print_graph_table(rows: List[Dict[str, object]]) -> None:
    header = ["M", "d", "fused fwd", "eager fwd", "compile fwd", "fused f+b", "atomic f+b",
              "eager f+b", "compile f+b", "x eager f+b", "x compile f+b", "fwd % copy BW"]
    print("graph replay (device time per call, launch gaps removed):")
    print(" | ".join(f"{h:>12}" for h in header))
    nan = float("nan")
    for r in rows:
        cells = [r["M"], r["d"], r["fused_fwd_ms"], r.get("eager_fwd_ms", nan),
                 r.get("compile_fwd_ms", nan), r["fused_fwdbwd_ms"], r["fused_atomic_fwdbwd_ms"],
                 r.get("eager_fwdbwd_ms", nan), r.get("compile_fwdbwd_ms", nan),
                 r.get("speedup_fwdbwd_vs_eager", nan), r.get("speedup_fwdbwd_vs_compile", nan),
                 100 * r["fused_fwd_fraction_of_copy"]]
        print(" | ".join(f"{c:>12}" if isinstance(c, int) else f"{c:>12.4f}" for c in cells))
        for entry in r.get("mappings", []):
            knobs = ",".join(f"{k}={v}" for k, v in entry["knobs"].items())
            print(f"  mapping {knobs:>36}: fused fwd {entry['fused_fwd_ms']:.4f} ms "
                  f"({100 * entry['fused_fwd_fraction_of_copy']:.1f} % copy BW), f+b "
                  f"{entry['deterministic_fwdbwd_ms']:.4f} ms, atomic f+b "
                  f"{entry['atomic_fwdbwd_ms']:.4f} ms")
        for key, value in r.items():
            if key.endswith("_error"):
                print(f"  M={r['M']} d={r['d']} {key}: {value}")


def profile_fused(rows: int, slots: int, heads: int, dim: int, iters: int = 20) -> None:
    """Device time per kernel of the fused forward+backward against the wall time per call."""
    import time

    import fastopt.config as fconfig
    from torch.profiler import ProfilerActivity, profile

    q, k, v, index, mask, _ = make_inputs(rows, slots, heads, dim)
    grad = torch.randn_like(q)
    scale = 1.0 / math.sqrt(dim)

    def step():
        q.grad = k.grad = v.grad = None
        fused(q, k, v, index, mask, scale).backward(grad)

    with fconfig.patch(kernels__check_inputs=False):
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                step()
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / iters
    print(f"profile M={rows} d={dim}: {wall_ms:.4f} ms wall per forward+backward "
          f"({iters} back to back)")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14))
    host = cProfile.Profile()
    with fconfig.patch(kernels__check_inputs=False):
        host.enable()
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
        host.disable()
    print(f"host profile of {iters} fused forward+backward calls (cProfile, by own time):")
    pstats.Stats(host).sort_stats("tottime").print_stats(22)


def print_table(rows: List[Dict[str, object]], bandwidth: float) -> None:
    print(f"device copy bandwidth: {bandwidth / 1e9:.0f} GB/s")
    header = ["M", "d", "fused fwd", "eager fwd", "compile fwd", "fused f+b", "atomic f+b",
              "eager f+b", "compile f+b", "x eager f+b", "x compile f+b", "fwd % copy BW"]
    print(" | ".join(f"{h:>12}" for h in header))
    for r in rows:
        cells = [r["M"], r["d"], r["fused_fwd_ms"], r["eager_fwd_ms"],
                 r.get("compile_fwd_ms", float("nan")), r["fused_fwdbwd_ms"],
                 r["fused_atomic_fwdbwd_ms"], r["eager_fwdbwd_ms"],
                 r.get("compile_fwdbwd_ms", float("nan")), r["speedup_fwdbwd_vs_eager"],
                 r.get("speedup_fwdbwd_vs_compile", float("nan")),
                 100 * r["fused_fwd_fraction_of_copy"]]
        print(" | ".join(f"{c:>12}" if isinstance(c, int) else f"{c:>12.3f}" for c in cells))
    print("times in ms (median, CUDA events); x = speedup of fused; f+b = forward+backward")
    for r in rows:
        errors = ", ".join(f"{mode} {err:.1e}" for mode, err in r["grad_rel_error"].items())
        print(f"M={r['M']} d={r['d']}: forward max |fused - eager| {r['max_abs_diff']:.1e}; "
              f"gradients max relative error {errors}")
    for r in rows:
        for entry in r.get("mappings", []):
            knobs = ",".join(f"{k}={v}" for k, v in entry["knobs"].items())
            print(f"mapping M={r['M']} d={r['d']} {knobs:>40}: fused fwd {entry['fused_fwd_ms']:.4f}"
                  f" ms, fused f+b {entry['fused_fwdbwd_ms']:.4f} ms")


def record_run(args, **fields) -> Dict[str, object]:
    """The JSON record: date, GPU, versions, commit, command and settings, then ``fields``."""
    import triton

    from fastopt.codegen import kernels as codegen_kernels

    resources = codegen_kernels.compiled_resources()
    print_resources(resources)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "commit": git_commit(),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "warmup": args.warmup,
        "iters": args.iters,
        "l2_flushed": not args.no_flush,
        "max_error": args.max_error,
        **fields,
        "compiled_kernels": resources,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU (none found); nothing was measured.")
        return 0
    timer = Timer(args.warmup, args.iters, flush=not args.no_flush)
    bandwidth = copy_bandwidth(timer)
    # extra mappings are timed by graph replay when it runs (device time is what they change)
    wall_mappings = args.mappings if args.no_graph else []
    results = [run_shape(timer, m, args.slots, args.heads, d, not args.no_compile, bandwidth,
                         wall_mappings)
               for d in args.dims for m in args.rows]
    print_table(results, bandwidth)
    failures = [f for r in results for f in accuracy_failures(r, args.max_error)]
    graph_results = []
    if not args.no_graph:
        gtimer = GraphTimer(args.warmup, max(10, args.iters // 5), args.graph_reps)
        compile_fns = {} if args.no_compile else {"compile": torch.compile(eager_chain)}
        graph_results = [run_shape_graph(gtimer, m, args.slots, args.heads, d, compile_fns,
                                         bandwidth, args.mappings)
                         for d in args.dims for m in args.rows]
        print_graph_table(graph_results)
    if args.profile:
        for d in args.dims:
            profile_fused(args.rows[0], args.slots, args.heads, d)
    record = record_run(args, copy_bandwidth_bytes_per_s=bandwidth, accuracy_failures=failures,
                        results=results,
                        graph_replay={"calls_per_graph": args.graph_reps, "results": graph_results})
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=2)
        print(f"wrote {args.json}")
    for failure in failures:
        print(f"WRONG RESULT: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
