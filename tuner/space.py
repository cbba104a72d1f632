"""The search space: the knobs worth tuning for one model, graph and device.

Only knobs that can change the speed of *this* run are searched: sampler threads only when the
model samples neighbors, ``sampler.hop_dedup`` only for models of two or more layers, cache
placement, budget and policy only where features can live on the host apart from a CUDA device,
CUDA graphs and the kernels' thread mapping only on CUDA (the mapping only where the generated
kernels run). The batch size changes what the model learns, so it is searched only over sizes
the user allows; by default the user's own size is kept.

The candidates are one declarative table, each with its own condition on the run
(:class:`SpaceContext`) and, for knobs that only matter under another knob's value (the cache
budget under host placement), a condition on the values chosen before it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from fastopt.config import Config
from fastopt.errors import ConfigError

__all__ = ["Knob", "SearchSpace", "SpaceContext", "build_space"]


def _always(values: Dict[str, Any]) -> bool:
    return True


@dataclass(frozen=True)
class Knob:
    """One searched config field.

    Attributes:
        name: the config field, ``"group.field"`` (also the Optuna parameter's name).
        choices: the values tried, the baseline config's first.
        when: whether the knob matters given the values chosen before it (knobs are suggested in
            order); a knob that does not matter keeps the baseline config's value.
        why: one line saying what the knob trades, for ``fastopt tune``'s listing.
    """

    name: str
    choices: Tuple[Any, ...]
    when: Callable[[Dict[str, Any]], bool] = _always
    why: str = ""


@dataclass(frozen=True)
class SpaceContext:
    """What a run contains, as far as the search space is concerned."""

    layers: int  # attention layers of the model (0: it samples no neighbors)
    cuda: bool  # the run's device is a CUDA device
    optimized: bool  # the model runs through fastopt.optimize (fused kernels, CUDA graphs)
    kernels: bool  # the generated kernels run (CUDA, triton installed, kernels enabled)
    tables: bool  # the graph has static feature tables whose placement can be chosen
    cached: bool  # an edge feature table that the SlimCache can cache under host placement
    cores: int  # CPU cores this process may run on
    batch_sizes: Tuple[int, ...]  # batch sizes the user allows


@dataclass(frozen=True)
class _Candidate:
    name: str
    applies: Callable[[SpaceContext], bool]
    choices: Callable[[SpaceContext], Tuple[Any, ...]]
    when: Callable[[Dict[str, Any]], bool] = _always
    why: str = ""


def _fixed(*values: Any) -> Callable[[SpaceContext], Tuple[Any, ...]]:
    return lambda ctx: values


def _thread_choices(ctx: SpaceContext) -> Tuple[int, ...]:
    """Powers of two up to the cores, and the cores themselves."""
    counts = {1 << i for i in range(ctx.cores.bit_length()) if 1 << i <= ctx.cores}
    return tuple(sorted(counts | {ctx.cores}))


def _host_placement(values: Dict[str, Any]) -> bool:
    return values.get("cache.placement") == "host"


def _host_cache(values: Dict[str, Any]) -> bool:
    return _host_placement(values) and values.get("cache.budget_fraction", 0.0) > 0.0


_CANDIDATES: Tuple[_Candidate, ...] = (
    _Candidate("train.batch_size", lambda ctx: len(ctx.batch_sizes) > 1, lambda ctx: ctx.batch_sizes,
               why="only sizes the user allows: the batch size changes what the model learns"),
    _Candidate("sampler.threads", lambda ctx: ctx.layers > 0, _thread_choices,
               why="sampling throughput against the cores the training step needs"),
    _Candidate("sampler.hop_dedup", lambda ctx: ctx.layers >= 2, _fixed(False, True),
               why="a smaller second hop against the host time of finding repeats"),
    _Candidate("pipeline.prefetch_depth", lambda ctx: True, _fixed(0, 1, 2, 4),
               why="batches staged ahead: overlap against memory held by staged batches"),
    _Candidate("pipeline.stage_threads", lambda ctx: True, _fixed(1, 2, 3),
               when=lambda values: values.get("pipeline.prefetch_depth", 0) >= 2,
               why="threads staging batches in turn (at most prefetch_depth)"),
    _Candidate("cache.placement", lambda ctx: ctx.cuda and ctx.tables, _fixed("device", "host"),
               why="static features on the device, or gathered on the host and copied per batch"),
    _Candidate("cache.budget_fraction", lambda ctx: ctx.cuda and ctx.cached,
               _fixed(0.0, 0.05, 0.1, 0.25, 0.5, 1.0), when=_host_placement,
               why="device memory given to the cross-batch cache against host-to-device copies"),
    _Candidate("cache.policy", lambda ctx: ctx.cuda and ctx.cached, _fixed("static", "lru", "future"),
               when=_host_cache, why="which rows the cache keeps"),
    _Candidate("passes.cuda_graphs", lambda ctx: ctx.cuda and ctx.optimized, _fixed("auto", "off"),
               why="replaying the optimized forward/backward against capture time and memory"),
    _Candidate("pipeline.step_graphs", lambda ctx: ctx.cuda,
               lambda ctx: ("auto", "off") if ctx.optimized else ("auto", "on"),
               why="whole training steps replayed from CUDA graphs"),
    _Candidate("kernels.block_m", lambda ctx: ctx.kernels, _fixed(0, 16, 32, 64),
               why="rows per attention/reduction tile (0: the heuristic)"),
    _Candidate("kernels.rows_per_program", lambda ctx: ctx.kernels, _fixed(0, 1, 2, 4),
               why="row tiles one program handles in turn (0: the heuristic)"),
    _Candidate("kernels.num_warps", lambda ctx: ctx.kernels, _fixed(0, 2, 4, 8),
               why="warps per program (0: the heuristic)"),
    _Candidate("kernels.num_stages", lambda ctx: ctx.kernels, _fixed(0, 1, 2, 3),
               why="software-pipelining stages (0: the heuristic)"),
    _Candidate("kernels.attention_softmax", lambda ctx: ctx.kernels, _fixed("auto", "online", "two_pass"),
               why="running-maximum or two-pass edge softmax"),
    _Candidate("kernels.gather_eviction", lambda ctx: ctx.kernels, _fixed("auto", "none", "evict_last"),
               why="L2 hint of the attention's row gathers"),
)


@dataclass(frozen=True)
class SearchSpace:
    """The knobs of one run, in the order they are suggested.

    Attributes:
        knobs: the searched config fields.
        fixed: values every trial sets (a single allowed batch size).
        context: what the space was built from.
    """

    knobs: Tuple[Knob, ...]
    fixed: Dict[str, Any]
    context: SpaceContext

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(k.name for k in self.knobs)

    def suggest(self, trial) -> Dict[str, Any]:
        """The values of one trial: each knob that matters given the earlier ones, through
        ``trial.suggest_categorical`` (an :class:`optuna.trial.Trial` or anything with that
        method), then the fixed values."""
        values: Dict[str, Any] = {}
        for knob in self.knobs:
            if knob.when(values):
                values[knob.name] = trial.suggest_categorical(knob.name, list(knob.choices))
        values.update(self.fixed)
        return values

    def baseline(self) -> Dict[str, Any]:
        """The searched values of the baseline config (each knob's first choice), for the trial
        that measures the defaults in the same run."""
        values: Dict[str, Any] = {}
        for knob in self.knobs:
            if knob.when(values):
                values[knob.name] = knob.choices[0]
        return values

    def apply(self, config: Config, values: Dict[str, Any]) -> Config:
        """A copy of ``config`` with ``values`` set (fixed values included).

        Raises:
            ConfigError: a value the configuration refuses (naming the field and its range).
        """
        out = config.copy()
        for name, value in {**values, **self.fixed}.items():
            out.set(name, value)
        return out

    def describe(self) -> str:
        """One line per knob: its name, choices and what it trades."""
        if not self.knobs:
            return "no knobs to search for this model and device"
        width = max(len(k.name) for k in self.knobs)
        lines = [f"{k.name:<{width}}  {', '.join(map(str, k.choices))}  ({k.why})" for k in self.knobs]
        lines += [f"{name:<{width}}  {value} (fixed)" for name, value in self.fixed.items()]
        return "\n".join(lines)


def build_space(model, graph, config: Config, device, *,
                batch_sizes: Optional[Sequence[int]] = None) -> SearchSpace:
    """The search space of training ``model`` on ``graph`` with ``config`` on ``device``.

    Args:
        model: the model to train (its ``fanouts`` say how many layers it samples).
        graph: the event stream (its feature tables decide the cache knobs).
        config: the baseline configuration; its value of each knob is tried first.
        device: a ``torch.device`` or a string (``"cpu"``, ``"cuda"``).
        batch_sizes: batch sizes the user allows; None keeps ``config.train.batch_size``.

    Raises:
        ConfigError: an allowed batch size below 1.
    """
    context = space_context(model, graph, config, device, batch_sizes)
    baseline = config.to_dict()
    knobs = []
    for cand in _CANDIDATES:
        if not cand.applies(context):
            continue
        group, _, field = cand.name.partition(".")
        base = baseline[group][field]
        choices = tuple(cand.choices(context))
        if cand.name != "train.batch_size" or base in choices:
            choices = (base,) + tuple(c for c in choices if c != base)
        knobs.append(Knob(cand.name, choices, cand.when, cand.why))
    fixed = {}
    if len(context.batch_sizes) == 1 and context.batch_sizes[0] != config.train.batch_size:
        fixed["train.batch_size"] = context.batch_sizes[0]
    return SearchSpace(tuple(knobs), fixed, context)


def space_context(model, graph, config: Config, device, batch_sizes=None) -> SpaceContext:
    """What ``build_space`` needs to know of the run."""
    import torch

    from fastopt.trainer import wants_optimize

    device = torch.device(device)
    sizes = tuple(dict.fromkeys(int(b) for b in batch_sizes)) if batch_sizes else (config.train.batch_size,)
    bad = [b for b in sizes if b < 1]
    if bad:
        raise ConfigError(f"batch sizes to tune over must be >= 1 (got {bad[0]}); list positive "
                          f"sizes, e.g. 200,600")
    cuda = device.type == "cuda"
    optimized = hasattr(model, "fastopt_report") or wants_optimize(config, device)
    kernels = (cuda and optimized and config.kernels.enabled and config.kernels.backend != "reference"
               and importlib.util.find_spec("triton") is not None)
    edge = getattr(graph, "edge_feat", None)
    node = getattr(graph, "node_feat", None)
    has_edge = edge is not None and edge.shape[1] > 0
    has_node = node is not None and node.shape[1] > 0
    return SpaceContext(layers=len(getattr(model, "fanouts", []) or []), cuda=cuda, optimized=optimized,
                        kernels=kernels, tables=has_edge or has_node,
                        cached=has_edge and config.sampler.dedup, cores=_cores(), batch_sizes=sizes)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def knob_fields() -> Tuple[str, ...]:
    """Every config field some space may search (a record applies only these)."""
    return tuple(c.name for c in _CANDIDATES)

