"""``fastopt bench``: fastopt against what users run today, side by side in one process.

Every contender trains the same model (same initial weights, seeds, data, negatives and
device) for ``epochs`` epochs through :class:`~fastopt.Trainer` and is evaluated on validation
after each epoch and on test at the end:

=============  ============================================================================
``tgl``        the eager model; features gathered on the host per sampled slot and copied
               every batch (``cache.placement="host"``, no dedup, no cache: TGL's path)
``eager``      the eager model; features resident on the device (the plain Trainer)
``compile``    ``torch.compile(model)``, features on the device
``compile-ro`` ``torch.compile(model, mode="reduce-overhead")``
``pyg``        PyG's TGN (``TGNMemory`` + ``LastNeighborLoader`` + ``TransformerConv``), when the
               model is TGN and torch_geometric is installed
``fastopt``    the whole pipeline: ``fastopt.optimize`` (fused kernels, CUDA graphs) and the loader
``fastopt-``   ``fastopt`` with the features in host memory (``cache.placement="host"``), served
``host``       through SlimCache's device cache of ``cache.budget_fraction`` of their bytes
``fastopt-``   ``fastopt`` with the tuning record that matches the run applied (``fastopt tune``;
``tuned``      what ``config="auto"`` picks), beside ``fastopt``'s defaults; the note names the
               record, or says that none matched and the defaults ran
=============  ============================================================================

Reported per contender: the first and the steady epoch time (median of the epochs after the
first), the stage breakdown of the steady epochs, bytes host->device per epoch, peak device
memory, validation and test AP; with ``--interleave``, each contender's steady epochs over
``fastopt``'s epoch by epoch (:func:`paired_ratios`: median, min and max). Before timing, each contender's model is checked against an
eager copy with the same weights on a real batch (the 21st, the memory and mailboxes advanced
through the 20 before it, so that a memory model's updater is exercised), outputs and parameter
gradients (after a CUDA-graph capture where one happens); a disagreement fails the run
(:class:`~fastopt.errors.FastOptError`). PyG's TGN is another implementation, so it is compared by
accuracy only.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from fastopt.config import Config
from fastopt.errors import ConfigError, FastOptError
from fastopt.runtime.timing import STAGES

# contenders trained on their own, after the others, even with --interleave (another implementation)
ALONE = ("pyg",)

__all__ = ["CONTENDERS", "ALONE", "BenchResult", "run_bench", "format_table", "paired_ratios", "format_ratios",
           "verify_against_eager", "git_commit"]

CONTENDERS = ("tgl", "eager", "compile", "compile-ro", "pyg", "fastopt", "fastopt-host", "fastopt-tuned")
# Relative error allowed between a contender's outputs/gradients and eager's (fp32).
TOLERANCE = 1e-4


@dataclass
class BenchResult:
    contender: str
    epoch_seconds: List[float] = field(default_factory=list)
    stages: Dict[str, float] = field(default_factory=dict)
    bytes_h2d: float = 0.0
    peak_device_bytes: int = 0
    # the process's peak resident memory when the contender ended: since the process started (so
    # at least any earlier contender's) and with the pages of mapped feature files it read
    peak_host_bytes: int = 0
    train_events: int = 0  # events of a training epoch
    val_ap: float = float("nan")
    test_ap: float = float("nan")
    verified: str = ""
    max_rel_error: float = 0.0
    note: str = ""
    # CUDA-graph captures per epoch, in training and in its validation (none in a steady epoch)
    captures: List[int] = field(default_factory=list)
    val_captures: List[int] = field(default_factory=list)

    @property
    def first(self) -> float:
        return self.epoch_seconds[0] if self.epoch_seconds else float("nan")

    @property
    def steady(self) -> float:
        rest = self.epoch_seconds[1:] or self.epoch_seconds
        return statistics.median(rest) if rest else float("nan")

    def to_dict(self) -> dict:
        return {"contender": self.contender, "epoch_seconds": self.epoch_seconds,
                "captures_per_epoch": self.captures, "val_captures_per_epoch": self.val_captures,
                "first_epoch_s": self.first, "steady_epoch_s": self.steady, "stages": self.stages,
                "bytes_h2d_per_epoch": self.bytes_h2d, "peak_device_bytes": self.peak_device_bytes,
                "peak_host_bytes": self.peak_host_bytes,
                "train_events_per_second": self.train_events / self.steady if self.train_events else None,
                "val_ap": self.val_ap, "test_ap": self.test_ap, "verified": self.verified,
                "error_vs_eager": self.max_rel_error, "note": self.note}


def _contender_config(base: Config, name: str) -> Config:
    cfg = base.copy()
    fast = name.startswith("fastopt")
    cfg.train.optimize = "on" if fast else "off"
    if name == "tgl":
        cfg.cache.placement, cfg.sampler.dedup, cfg.cache.budget_fraction = "host", False, 0.0
    elif name == "fastopt-host":
        cfg.cache.placement = "host"
    elif not fast:
        cfg.cache.placement = "device"
    return cfg


def _wrap(name: str, model: nn.Module) -> nn.Module:
    if name == "compile":
        return torch.compile(model)
    if name == "compile-ro":
        return torch.compile(model, mode="reduce-overhead")
    return model


def _rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) if b.numel() else 0.0


def _as_double(inputs):
    """``inputs`` with every floating tensor in float64 (ids and masks unchanged)."""
    def conv(x):
        if isinstance(x, list):
            return [conv(t) for t in x]
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.double()
        return x
    return dataclasses.replace(inputs, **{f.name: conv(getattr(inputs, f.name))
                                          for f in dataclasses.fields(inputs)})


def _run(model: nn.Module, inputs) -> Dict[str, torch.Tensor]:
    """Output and parameter gradients of one call (a loss that reaches every output element)."""
    model.zero_grad(set_to_none=True)
    state = {name: b.clone() for name, b in model.named_buffers()}
    h = model(inputs)
    (h.square().mean() + h.sum() * 1e-3).backward()
    with torch.no_grad():  # every call sees the state the first one saw
        for name, b in model.named_buffers():
            b.copy_(state[name])
    out = {"output": h.detach()}
    # torch.compile's wrapper names parameters "_orig_mod.<name>"
    out.update({f"grad {k.removeprefix('_orig_mod.')}": p.grad for k, p in model.named_parameters()
                if p.grad is not None})
    model.zero_grad(set_to_none=True)
    return out


def verify_against_eager(model: nn.Module, eager: nn.Module, inputs, calls: int = 3) -> float:
    """Check ``model`` against the eager model it came from, on real ``inputs``.

    ``eager`` holds the same weights. Both run in eval mode (dropout off) ``calls`` times (a
    captured CUDA graph replays on the later calls); their outputs and parameter gradients are
    compared with the eager model run in float64, the reference. A quantity fails when its error
    against the reference exceeds both :data:`TOLERANCE` and 8x the float32 eager model's own
    error (gradients that are sums of cancelling terms carry a float32 error far above 1e-4
    relative, in eager as much as in any reordering of the sums). Returns the largest error
    ratio to eager's (at least 1 means no worse than eager); raises :class:`FastOptError`.
    """
    eager64 = copy.deepcopy(eager).double()
    for m in (model, eager, eager64):
        m.eval()
    truth = _run(eager64, _as_double(inputs))
    base = _run(eager, inputs)
    worst = 0.0
    for call in range(calls):
        got = _run(model, inputs)
        for key, ref in truth.items():
            if key not in got:
                if not bool((base[key] == 0).all()):
                    raise FastOptError(f"{key} is missing from the optimized model where eager has it")
                continue  # no gradient where eager's is all zeros: the same (None means zero)
            err, err_eager = _rel_error(got[key], ref), _rel_error(base[key], ref)
            worst = max(worst, err / max(err_eager, TOLERANCE))
            if err > TOLERANCE and err > 8 * err_eager:
                raise FastOptError(
                    f"call {call}: {key} differs from the float64 reference by relative error "
                    f"{err:.3g}, eager float32 by {err_eager:.3g} (limit: max({TOLERANCE}, 8x eager)); "
                    f"the optimized model is wrong here, report it with `fastopt.optimize(model, verify=True)`")
    for m in (model, eager):
        m.train()
    return worst


def run_bench(graph, model_name: str, base: Config, contenders: Sequence[str] = CONTENDERS,
              epochs: int = 3, progress: bool = False,
              log: Callable[[str], None] = print, interleave: bool = False) -> List[BenchResult]:
    """Train each of ``contenders`` on ``graph`` (see the module docstring); one result each.

    ``interleave``: every contender is built and verified first, then their epochs take turns
    (epoch 0 of each, epoch 1 of each, ...), so that a drift in the machine's speed during the
    run reaches each alike. Each contender's epochs continue its own random sequence (its own
    generator state, kept between its turns), as when it trains alone. The contenders share the
    device memory: each one's peak includes the others' resident tables, and ``auto`` placement
    decides each one's beside those built before it (logged). ``pyg`` trains on its own as it
    is reached.
    """
    unknown = [c for c in contenders if c not in CONTENDERS]
    if unknown:
        raise ConfigError(f"unknown contender(s) {unknown}; choose from {', '.join(CONTENDERS)}")
    if epochs < 1:
        raise ConfigError(f"epochs must be >= 1 (got {epochs}); the steady epoch needs 2 or more")
    from fastopt.trainer import resolve_device

    device = resolve_device(base.train.device)
    results, turns = [], []
    for name in contenders:
        if name in ALONE:  # another implementation: trained on its own, never interleaved
            result = _run_pyg(graph, model_name, base, epochs, device, progress, log)
            if result is not None:
                results.append(result)
            continue
        if name == "compile-ro" and device.type == "cpu":
            log(f"  {name}: skipped (reduce-overhead needs CUDA graphs)")
            continue
        result, trainer = _prepare(graph, model_name, base, name, device, progress, log)
        if interleave:  # built beside the others' tables: where "auto" put this one's features
            log(f"  {name}: features: {trainer.loader.describe()}")
        log(f"  {name}: training {epochs} epoch(s){' in turns' if interleave else ''} ...")
        results.append(result)
        turns.append((result, trainer, trainer.fit_epochs(epochs)))
        del trainer  # the turns hold it, and let it go when it has trained (_take_turns)
        if not interleave:
            _take_turns(turns, device, graph, log)
            _release(device)
    if interleave:
        _take_turns(turns, device, graph, log)
        _release(device)
    return results


def _release(device) -> None:
    """Return the cached device memory of the trainers just let go to the driver, so that the
    next contender's free-memory checks (``auto`` placement, SlimCache's budget) see it."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _prepare(graph, model_name: str, base: Config, name: str, device, progress: bool, log):
    """Contender ``name``'s trainer, its model checked against eager (see the module docstring)."""
    from fastopt.models import build_model
    from fastopt.trainer import Trainer

    cfg = _contender_config(base, name)
    torch.manual_seed(base.train.seed)
    model = build_model(model_name, graph, base).to(device)
    eager = copy.deepcopy(model)
    trainer = Trainer(_wrap(name, model), graph, cfg, progress=progress, records=name == "fastopt-tuned")
    result = BenchResult(name)
    if name == "fastopt-tuned":
        result.note = (trainer.tuned.describe() if trainer.tuned else
                       "no tuning record matches this run: the defaults")
        log(f"  {name}: {result.note}")
    log(f"  {name}: verifying against eager ...")
    if name == "tgl":
        batch = next(iter(trainer.plan("train", 0)))
        # same model code, other data path: its inputs must be the device path's, exactly;
        # both padded from nothing (a shape plan saved by an earlier run pads one further)
        fresh = [cfg.copy(), _contender_config(base, "eager")]
        for c in fresh:
            c.pipeline.shape_plans = False
        _same_inputs(*(Trainer(copy.deepcopy(eager), graph, c, progress=False).build_inputs(batch.roots, batch.times)
                       for c in fresh))
        result.verified = "inputs equal to the device path's; model is eager"
    else:
        inputs = _warm_batch(trainer, eager)
        result.max_rel_error = verify_against_eager(trainer.model, eager, inputs)
        result.verified = (f"outputs+grads vs float64 eager: error at most "
                           f"{result.max_rel_error:.2f}x max(1e-4, eager float32's)")
    if hasattr(trainer.model, "reset_state"):
        trainer.model.reset_state()
    return result, trainer


def _take_turns(turns, device, graph, log) -> None:
    """Run the contenders' epochs in turns until each has trained and tested; fill their results
    and empty ``turns`` (the trainers go)."""
    from fastopt.trainer import random_state, set_random_state

    cuda = device.type == "cuda"
    peaks = {id(result): 0 for result, _, _ in turns}
    # each contender draws from a generator of its own (dropout, ...): its epochs continue its own
    # sequence, as when it trains alone, whatever ran between them (None: seeded by its first epoch)
    generators: dict = {id(result): None for result, _, _ in turns}
    live = list(turns)
    while live:
        for turn in list(live):
            result, trainer, epochs = turn
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
            if generators[id(result)] is not None:
                set_random_state(generators[id(result)])
            if next(epochs, None) is None:  # trained and tested
                live.remove(turn)
            generators[id(result)] = random_state()
            if cuda:
                peaks[id(result)] = max(peaks[id(result)], torch.cuda.max_memory_allocated(device))
    for result, trainer, _ in turns:
        history = trainer.history
        result.epoch_seconds = [h["seconds"] for h in history]
        result.captures = [h["captures"] for h in history]
        result.val_captures = [h["val_captures"] for h in history]
        steady = history[1:] or history
        result.stages = {k: statistics.median(h["stages"].get(k, 0.0) for h in steady) for k in STAGES}
        result.bytes_h2d = statistics.median(h["bytes_h2d"] for h in steady)
        result.peak_device_bytes = peaks[id(result)]
        result.peak_host_bytes = peak_host_bytes()
        result.train_events = len(graph.split_range("train"))
        result.val_ap = history[-1]["val"]["ap"]
        result.test_ap = trainer.test_metrics["ap"]
        captured = ", ".join(f"{c}/{v}" for c, v in zip(result.captures, result.val_captures))
        log(f"  {result.contender}: {result.steady:.3f} s/epoch steady, first {result.first:.3f} s, "
            f"test AP {result.test_ap:.4f}; graph captures per epoch (training/validation) {captured}")
    turns.clear()  # the trainers go (the caller releases their cached memory)


def _warm_batch(trainer, eager: nn.Module, batches: int = 20):
    """The inputs of training batch ``batches``, the model's state (memory, mailboxes) advanced
    through the batches before it as evaluation advances it, and copied into ``eager``: a memory
    model checked at the first batch, its state all zeros, would check none of its updater."""
    from fastopt.runtime.loader import StageTimer

    timer, model = StageTimer(trainer.device), trainer.model
    model.eval()
    with torch.no_grad(), trainer.loader.epoch("train", 0, timer=timer) as stream:
        for i, batch in enumerate(stream):
            if i == batches:
                break
            trainer._step(batch, timer, train=False)
    model.train()
    with torch.no_grad():
        own = {name.removeprefix("_orig_mod."): b for name, b in model.named_buffers()}
        for name, b in eager.named_buffers():
            b.copy_(own[name])
    return batch.read().inputs  # (a batch not stepped may hold rows the step would read)


def _same_inputs(a, b) -> None:
    for name in ("nodes", "times", "node_feat", "edge_feat", "dt", "mask"):
        for i, (x, y) in enumerate(zip(getattr(a, name), getattr(b, name))):
            if x.shape != y.shape or not torch.equal(x.cpu(), y.cpu()):
                raise FastOptError(f"host-gathered {name}[{i}] differs from the device path's")


def _run_pyg(graph, model_name: str, base: Config, epochs: int, device, progress, log) -> Optional[BenchResult]:
    if model_name != "tgn":
        log("  pyg: skipped (PyG's TGN is compared with --model tgn only)")
        return None
    try:
        import torch_geometric  # noqa: F401
    except ImportError:
        log('  pyg: skipped (torch_geometric is not installed: pip install "fastopt[pyg]")')
        return None
    from fastopt.baselines.pyg_tgn import run_pyg_tgn

    log(f"  pyg: training {epochs} epoch(s) ...")
    out = run_pyg_tgn(graph, batch_size=base.train.batch_size, epochs=epochs, device=device,
                      seed=base.train.seed, progress=progress)
    result = BenchResult("pyg", epoch_seconds=list(out["epoch_seconds"]),
                         bytes_h2d=float(out["h2d_bytes_per_epoch"]),
                         peak_device_bytes=int(out["peak_device_bytes"]), peak_host_bytes=peak_host_bytes(),
                         train_events=len(graph.split_range("train")), val_ap=out["val"]["ap"],
                         test_ap=out["test"]["ap"], verified="other implementation: accuracy only",
                         note="PyG examples/tgn.py structure")
    log(f"  pyg: {result.steady:.3f} s/epoch steady, first {result.first:.3f} s, test AP {result.test_ap:.4f}")
    return result


def peak_host_bytes() -> int:
    """The process's peak resident memory so far, in bytes (0 where the platform does not say)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def paired_ratios(results: Sequence[BenchResult], reference: Optional[str] = None) -> Dict[str, dict]:
    """Each contender's steady epochs over ``reference``'s (default ``fastopt`` where it ran, else
    the first contender), epoch by epoch: with ``--interleave`` the epochs of a pair ran back to
    back, so that a slow stretch of a noisy host moves both, and the spread of the ratios says how
    far one run's ratio of medians can be trusted. ``{contender: {"reference", "median", "min",
    "max", "pairs"}}``; empty with fewer than two contenders or no steady epochs. Contenders that
    never take turns (:data:`ALONE`) are left out."""
    results = [r for r in results if r.contender not in ALONE]
    names = [r.contender for r in results]
    if reference is None:
        reference = "fastopt" if "fastopt" in names else (names[0] if names else "")
    ref = next((r for r in results if r.contender == reference), None)
    out: Dict[str, dict] = {}
    for r in results:
        if ref is None or r is ref:
            continue
        ratios = [a / b for a, b in zip(r.epoch_seconds[1:], ref.epoch_seconds[1:]) if b > 0]
        if ratios:
            out[r.contender] = {"reference": reference, "median": statistics.median(ratios),
                                "min": min(ratios), "max": max(ratios), "pairs": len(ratios)}
    return out


def format_ratios(ratios: Dict[str, dict]) -> str:
    """:func:`paired_ratios` as one line per contender."""
    return "\n".join(f"{name} / {r['reference']}, epoch by epoch: median {r['median']:.2f}x "
                     f"(min {r['min']:.2f}, max {r['max']:.2f}, {r['pairs']} pairs)" for name, r in ratios.items())


def format_table(results: Sequence[BenchResult], baseline: str = "eager") -> str:
    """The results as an aligned text table; speedups against ``baseline``'s steady epoch."""
    ref = next((r.steady for r in results if r.contender == baseline), float("nan"))
    head = ["contender", "s/epoch", "first s", f"x {baseline}", *STAGES,
            "H2D MB/ep", "peak MB", "host MB", "val AP", "test AP"]
    rows = [head]
    for r in results:
        st = r.stages
        rows.append([r.contender, f"{r.steady:.3f}", f"{r.first:.3f}", f"{ref / r.steady:.2f}",
                     *(f"{st.get(k, float('nan')):.3f}" if st else "-"
                       for k in STAGES),
                     f"{r.bytes_h2d / 1e6:.1f}", f"{r.peak_device_bytes / 1e6:.0f}",
                     f"{r.peak_host_bytes / 1e6:.0f}" if r.peak_host_bytes else "-",
                     f"{r.val_ap:.4f}", f"{r.test_ap:.4f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def plot(results: Sequence[BenchResult], path: str, title: str) -> None:
    """A bar chart of steady epoch times (matplotlib, an optional dependency)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FastOptError('--plot needs matplotlib; pip install "fastopt[plot]"') from None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r.contender for r in results]
    ax.barh(names, [r.steady for r in results], color=["#d62728" if n.startswith("fastopt") else "#7f7f7f" for n in names])
    ax.set_xlabel("seconds per epoch (steady)")
    ax.set_title(title)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def git_commit(cwd: Optional[str] = None) -> str:
    """HEAD of the checkout holding ``cwd`` (default: this package), ``+dirty`` when tracked files
    differ from it.

    ``$FASTOPT_GIT_COMMIT``, where set, wins: a tree copied onto a GPU machine may carry no
    ``.git`` or a stale one, and the copying command names the commit it copied. Without either,
    ``"unknown"``.
    """
    import os
    import subprocess

    if os.environ.get("FASTOPT_GIT_COMMIT"):
        return os.environ["FASTOPT_GIT_COMMIT"]
    cwd = cwd or os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def command_line() -> str:
    """The command this process runs, as typed (``fastopt ...`` for the console script)."""
    import os
    import shlex
    import sys

    argv = list(sys.argv)
    if argv and os.path.basename(argv[0]) == "fastopt":
        argv[0] = "fastopt"
    elif argv and argv[0].endswith(os.path.join("fastopt", "__main__.py")):
        argv[:1] = ["python", "-m", "fastopt"]
    return shlex.join(argv)
