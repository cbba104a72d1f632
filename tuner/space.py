"""The search space: the knobs worth tuning for one model, graph and device.

Only knobs that can change the speed of *this* run are searched: sampler threads, node
reordering and thread placement only when the model samples neighbors (placement where networkx
can pair threads and more than one runs), ``sampler.hop_dedup`` only for models of two or more
layers, cache placement, budget, reads (zero-copy or staged) and the staged policy only where
features can live on the host apart from a CUDA device, CUDA graphs only on CUDA, factoring the
time encoding out of the keys and values only where the kernels run and the pass finds one to
factor (:func:`time_encoding_factorable`: the FLOPs it saves against the shared-block kernel
depend on the neighbors per row, the heads and the widths). The batch size
changes what the model learns, so it is searched only over sizes the user allows; by default the
user's own size is kept.

The generated kernels' thread mapping is searched per fused op, where those kernels run: the
optimized model's fused ops and the problem shape of each are found by one training step of a
copy of it on the CPU through the reference operators (:func:`fused_ops`; the shapes are those of
the real run, the device aside), and each op at each shape gets the mapping fields its kernels
read, with the values valid for that shape (:func:`op_choices`). A trial's values of those knobs
become one ``kernels.op_overrides`` value (``temporal_attention@10x2x50:block_m=1,...``), which
the kernels read per op and shape; ``0`` (``"auto"``) leaves a field to the heuristics.

The candidates are one declarative table, each with its own condition on the run
(:class:`SpaceContext`) and, for knobs that only matter under another knob's value (the cache
budget under host placement), a condition on the values chosen before it.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from fastopt.codegen.kernel_config import MAX_TILE, next_power_of_2, op_problem
from fastopt.config import Config, format_op_overrides, parse_op_overrides
from fastopt.errors import ConfigError
from fastopt.runtime.epoch import stage_workers
from fastopt.runtime.topology import usable_cpus

__all__ = ["FusedOp", "Knob", "SearchSpace", "SpaceContext", "build_space", "fused_ops", "op_choices",
           "time_encoding_factorable"]

# the config field a trial's per-op mapping values are joined into
OP_OVERRIDES = "kernels.op_overrides"
# a per-op knob's name: kernels.op_overrides[<op>@<K>x<H>x<d>].<field>
_OP_KNOB = re.compile(r"^kernels\.op_overrides\[(\w+)@(\d+)x(\d+)x(\d+)\]\.(\w+)$")


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
class FusedOp:
    """A fused operator of the optimized model at one problem shape.

    Attributes:
        op: the operator whose kernels read the mapping (``temporal_attention``,
            ``masked_aggregate``, ``time_encode``).
        problem: its ``(K, H, d)`` (:func:`fastopt.codegen.kernel_config.op_problem`).
        where: the rewrite sites (``module.path:node``) that run it at that shape.
    """

    op: str
    problem: Tuple[int, int, int]
    where: Tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """``op@KxHxd``: the op's entry in ``kernels.op_overrides``."""
        return f"{self.op}@{'x'.join(map(str, self.problem))}"


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
    ops: Tuple[FusedOp, ...] = ()  # fused ops the generated kernels run (found where they run)
    pairing: bool = False  # networkx is installed: sampler threads can be paired on shared caches
    factorable: bool = False  # an attention's keys/values carry a time encoding that can be factored out
    waits: bool = False  # the model takes its edge features only after inputs.edges_ready() (waits_for_edges)


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


def _threads_beyond_one(values: Dict[str, Any]) -> bool:
    return values.get("sampler.threads", 0) != 1  # 0: one per core, and there are several


def _host_placement(values: Dict[str, Any]) -> bool:
    return values.get("cache.placement") == "host"


def _host_cache(values: Dict[str, Any]) -> bool:
    return _host_placement(values) and values.get("cache.budget_fraction", 0.0) > 0.0


def _zero_copy_cache(values: Dict[str, Any]) -> bool:
    return _host_cache(values) and values.get("cache.host_reads") == "zero_copy"


_CANDIDATES: Tuple[_Candidate, ...] = (
    _Candidate("train.batch_size", lambda ctx: len(ctx.batch_sizes) > 1, lambda ctx: ctx.batch_sizes,
               why="only sizes the user allows: the batch size changes what the model learns"),
    _Candidate("sampler.threads", lambda ctx: ctx.layers > 0, _thread_choices,
               why="sampling throughput against the cores the training step needs"),
    _Candidate("sampler.reorder", lambda ctx: ctx.layers > 0, _fixed("none", "degree", "rcm"),
               why="row order of the adjacency lists: those read together lie together"),
    _Candidate("sampler.pin_threads", lambda ctx: ctx.layers > 0 and ctx.cores > 1 and ctx.pairing,
               _fixed(False, True), when=_threads_beyond_one,
               why="sampler threads placed in pairs on CPUs that share a cache"),
    _Candidate("sampler.hop_dedup", lambda ctx: ctx.layers >= 2, _fixed(False, True),
               why="a smaller second hop against the host time of finding repeats"),
    _Candidate("pipeline.prefetch_depth", lambda ctx: True, _fixed(0, 1, 2, 4),
               why="batches staged ahead: overlap against memory held by staged batches"),
    _Candidate("pipeline.stage_threads", lambda ctx: True, _fixed(1, 2, 3),
               when=lambda values: values.get("pipeline.prefetch_depth", 0) >= 2,
               why="threads staging batches in turn (at most prefetch_depth)"),
    _Candidate("pipeline.gil_switch_us", lambda ctx: ctx.cuda, _fixed(250, 1000),
               when=lambda values: values.get("pipeline.prefetch_depth", 0) >= 1,
               why="how soon the training thread takes the GIL back from the staging threads"),
    _Candidate("cache.placement", lambda ctx: ctx.cuda and ctx.tables, _fixed("device", "host"),
               why="static features on the device, or gathered on the host and copied per batch"),
    _Candidate("cache.budget_fraction", lambda ctx: ctx.cuda and ctx.cached,
               _fixed(0.0, 0.05, 0.1, 0.25, 0.5, 1.0), when=_host_placement,
               why="device memory given to the cross-batch cache against host-to-device copies"),
    _Candidate("cache.host_reads", lambda ctx: ctx.cuda and ctx.cached, _fixed("zero_copy", "staged"),
               when=_host_cache, why="misses read by the GPU from pinned host memory (a static hot set), "
                                     "or gathered on the host and copied"),
    _Candidate("cache.policy", lambda ctx: ctx.cuda and ctx.cached, _fixed("static", "lru", "future"),
               when=lambda values: _host_cache(values) and values.get("cache.host_reads") == "staged",
               why="which rows the staged cache keeps"),
    _Candidate("cache.hot_set_phases", lambda ctx: ctx.cuda and ctx.cached and ctx.layers > 0, _fixed(1, 4, 8),
               when=_zero_copy_cache, why="hot sets an epoch for the reads in the step: rows of recent "
                                          "events against the installs"),
    _Candidate("cache.read_overlap", lambda ctx: ctx.cuda and ctx.cached and ctx.waits, _fixed(False, True),
               when=_zero_copy_cache, why="the step's reads on a side stream, overlapping the work before "
                                          "the model takes them"),
    _Candidate("passes.cuda_graphs", lambda ctx: ctx.cuda and ctx.optimized, _fixed("auto", "off"),
               why="replaying the optimized forward/backward against capture time and memory"),
    _Candidate("pipeline.step_graphs", lambda ctx: ctx.cuda,
               lambda ctx: ("auto", "off") if ctx.optimized else ("auto", "on"),
               why="whole training steps replayed from CUDA graphs"),
    _Candidate("passes.factor_time_encoding", lambda ctx: ctx.kernels and ctx.factorable, _fixed("auto", "off"),
               why="the time encoding's key/value columns multiplied into the queries (no per-slot "
                   "projection) against the attention kernel's shared block"),
    _Candidate("kernels.attention_softmax",
               lambda ctx: any(o.op == "temporal_attention" for o in ctx.ops),
               _fixed("auto", "online", "two_pass"), why="running-maximum or two-pass edge softmax"),
)

# the per-op mapping fields searched, the values of each for an op's (K, H, d) (valid for that
# shape: tiles within the register tile limit, heads up to H); every field of an op is one knob
# per op and shape, 0 ("auto") first: the heuristic


# Elements of the attention's [block_m, lanes] row tile searched at most (one row where a row is
# wider): 16 times the heuristic's (ROW_TILE). Of 15 trials with larger tiles in nine H200
# studies (TGN d=100 block_m 16 and 32, TGAT d=50 block_m 32 and 64; 3e7aa7b-3cb13da) none
# finished: each was 8-57 % slower than its baseline where it reported, or cut while its kernels
# compiled (60-250 s each, about 1,000 s of the studies' time in all).
MAX_SEARCHED_ROW_TILE = 2048


def _powers(top: int) -> Tuple[int, ...]:
    return tuple(1 << i for i in range(top.bit_length()) if 1 << i <= top)


def op_choices(op: FusedOp) -> Dict[str, Tuple[Any, ...]]:
    """The mapping fields searched for ``op`` and the values tried for each (no heuristic
    value among them): those the op's kernels read and that can run its shape."""
    slots, heads, dim = op.problem
    if op.op == "temporal_attention":
        lanes = next_power_of_2(next_power_of_2(heads) * dim)  # the widest row: all heads
        choices = {"block_m": _powers(max(1, min(64, MAX_SEARCHED_ROW_TILE // lanes))), "rows_per_program": (1, 2, 4),
                   "num_warps": (1, 2, 4, 8), "num_stages": (1, 2, 3),
                   "gather_eviction": ("none", "evict_last")}
        if heads > 1:
            choices["heads_per_program"] = _powers(next_power_of_2(heads))
        return choices
    if op.op == "masked_aggregate":
        return {"block_k": _powers(min(next_power_of_2(slots), MAX_TILE // next_power_of_2(dim))),
                "rows_per_program": (1, 2, 4), "num_warps": (2, 4, 8), "num_stages": (1, 2, 3)}
    if op.op == "time_encode":  # block_k time differences a program, each a row of block_d lanes
        rows = _powers(min(128, MAX_TILE // next_power_of_2(dim)))
        return {"block_k": tuple(b for b in rows if b >= 16) or rows[-1:], "num_warps": (1, 2, 4, 8),
                "num_stages": (1, 2, 3)}
    return {}


def _op_knobs(ops: Sequence[FusedOp], overrides: str) -> List[Knob]:
    """A knob per op and field, the baseline config's value (its ``kernels.op_overrides``
    entry, else the heuristic) first."""
    base = parse_op_overrides(overrides)
    knobs = []
    for op in ops:
        entry = base.get((op.op, op.problem), {})
        for field, values in op_choices(op).items():
            heuristic = "auto" if field == "gather_eviction" else 0
            first = entry.get(field, heuristic)
            choices = (first,) + tuple(v for v in (heuristic,) + values if v != first)
            knobs.append(Knob(f"{OP_OVERRIDES}[{op.key}].{field}", choices,
                              why=f"{field} of the {op.op} kernels at K={op.problem[0]} "
                                  f"H={op.problem[1]} d={op.problem[2]} "
                                  f"({len(op.where)} site(s); {heuristic}: the heuristic)"))
    return knobs


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
    overrides: str = ""  # the baseline config's kernels.op_overrides

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(k.name for k in self.knobs)

    def suggest(self, trial) -> Dict[str, Any]:
        """The config values of one trial: each knob that matters given the earlier ones, through
        ``trial.suggest_categorical`` (an :class:`optuna.trial.Trial` or anything with that
        method), as :meth:`values` turns them into config fields."""
        params: Dict[str, Any] = {}
        for knob in self.knobs:
            if knob.when(params):
                params[knob.name] = trial.suggest_categorical(knob.name, list(knob.choices))
        return self.values(params)

    def baseline(self) -> Dict[str, Any]:
        """The knobs' values of the baseline config (each knob's first choice) by knob name, for
        the trial that measures the defaults in the same run."""
        params: Dict[str, Any] = {}
        for knob in self.knobs:
            if knob.when(params):
                params[knob.name] = knob.choices[0]
        return params

    def neighbors(self, limit: int, first: Sequence[str] = ()) -> List[Dict[str, Any]]:
        """Up to ``limit`` variations of the baseline that change one knob each, in rounds:
        every knob's first other choice, then every knob's second, and so on (knobs in the order
        they are suggested), so that a list at least as long as the knobs moves each knob once;
        the knobs named in ``first`` (those in the space) go through all their choices before
        the rounds (under a device-memory limit: the feature tables' placement). A
        knob that matters only under another's value is varied where the baseline makes it
        matter; a change that makes such a knob matter gives it its first choice. A variation
        that runs as the baseline or an earlier one does (:meth:`_runs_as`: ``0`` for automatic
        sampler or staging threads, staging threads beyond the prefetch depth) is left out. A new
        study runs them after the baseline (``tuner.neighbor_share``): a look around the
        defaults, which the sampler's own search then starts from."""
        base = self.baseline()
        out: List[Dict[str, Any]] = []
        seen = {self._runs_as(base)}
        early = [k for k in self.knobs if k.name in first]
        rounds = range(1, max((len(k.choices) for k in self.knobs), default=1))
        order = [(k, r) for k in early for r in range(1, len(k.choices))]
        order += [(k, r) for r in rounds for k in self.knobs if k not in early]
        for knob, r in order:
            if len(out) >= limit:
                break
            if knob.name not in base or r >= len(knob.choices):
                continue
            params: Dict[str, Any] = {}
            for other in self.knobs:
                if other.when(params):
                    params[other.name] = (knob.choices[r] if other is knob
                                          else base.get(other.name, other.choices[0]))
            key = self._runs_as(params)
            if key not in seen:
                seen.add(key)
                out.append(params)
        return out

    def _runs_as(self, params: Dict[str, Any]) -> Tuple[Tuple[str, Any], ...]:
        """``params`` as the run reads them: sampler threads ``0`` are one per core, staging
        threads ``0`` are 2 on CUDA and 1 on the CPU, and no more than the prefetch depth run
        (:class:`~fastopt.runtime.epoch.EpochStream`); two knob values that run alike give one key."""
        ran = dict(params)
        if ran.get("sampler.threads") == 0:
            ran["sampler.threads"] = self.context.cores
        if "pipeline.stage_threads" in ran:
            ran["pipeline.stage_threads"] = stage_workers(ran["pipeline.stage_threads"],
                                                          ran["pipeline.prefetch_depth"], self.context.cuda)
        return tuple(sorted(ran.items(), key=lambda kv: kv[0]))

    def values(self, params: Dict[str, Any]) -> Dict[str, Any]:
        """Config values of knob values: the per-op knobs joined into one
        ``kernels.op_overrides`` over the baseline's (0 and ``"auto"`` leave a field out), the
        others as they are, then the fixed values."""
        values = {name: value for name, value in params.items() if not _OP_KNOB.match(name)}
        per_op = [(_OP_KNOB.match(name), value) for name, value in params.items() if _OP_KNOB.match(name)]
        if per_op:
            base = parse_op_overrides(self.overrides)
            entries = copy.deepcopy(base)
            for match, value in per_op:
                op, k, h, d, field = match.groups()
                fields = entries.setdefault((op, (int(k), int(h), int(d))), {})
                if value in (0, "auto"):
                    fields.pop(field, None)
                else:
                    fields[field] = value
            entries = {key: fields for key, fields in entries.items() if fields}
            values[OP_OVERRIDES] = self.overrides if entries == base else format_op_overrides(entries)
        values.update(self.fixed)
        return values

    def apply(self, config: Config, values: Dict[str, Any]) -> Config:
        """A copy of ``config`` with ``values`` set (config fields, or knob values as
        :meth:`baseline` gives them; fixed values included).

        Raises:
            ConfigError: a value the configuration refuses (naming the field and its range).
        """
        out = config.copy()
        for name, value in self.values(values).items():
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
    knobs += _op_knobs(context.ops, config.kernels.op_overrides)
    fixed = {}
    if len(context.batch_sizes) == 1 and context.batch_sizes[0] != config.train.batch_size:
        fixed["train.batch_size"] = context.batch_sizes[0]
    return SearchSpace(tuple(knobs), fixed, context, config.kernels.op_overrides)


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
                        cached=has_edge and config.sampler.dedup, cores=_cores(), batch_sizes=sizes,
                        ops=fused_ops(model, graph, config) if kernels else (),
                        pairing=importlib.util.find_spec("networkx") is not None,
                        factorable=kernels and time_encoding_factorable(model, graph, config),
                        waits=bool(getattr(model, "waits_for_edges", False)))


# what the probe of fused_ops changes in the run's config: the CPU, the optimized model through
# the reference operators (where the CPU would run the code they replace), the time encoding fused
# as it is inside CUDA graphs, and no threads beyond the step's
_PROBE = {"train.device": "cpu", "train.optimize": "on", "kernels.backend": "reference",
          "sampler.threads": 1, "pipeline.prefetch_depth": 0, "pipeline.async_sampling": False}


def fused_ops(model, graph, config: Config) -> Tuple[FusedOp, ...]:
    """The fused ops the optimized ``model`` runs when trained on ``graph`` with ``config``, one
    per op and problem shape, in the order first run.

    One training step of a copy of ``model``, optimized, runs on the CPU through the reference
    operators (``model`` is left as it was); each rewrite site of its report that ran a fused op
    gives the op and its sizes. A model of which nothing is rewritten has none.
    """
    from fastopt.trainer import Trainer

    probe = config.copy()
    for name, value in _PROBE.items():
        probe.set(name, value)
    if probe.passes.fuse_time_encoding == "graphs":
        probe.set("passes.fuse_time_encoding", "always")
    trainer = Trainer(copy.deepcopy(model).cpu(), graph, probe, progress=False, records=False)
    steps = trainer.train_steps(epoch=0)
    try:
        next(steps)
    finally:
        steps.close()
    report = getattr(trainer.model, "fastopt_report", None)
    found: Dict[Tuple[str, Tuple[int, int, int]], List[str]] = {}
    for rewrite in (report.rewrites if report is not None else ()):
        sizes = report.site_shapes(rewrite.site)
        if sizes and rewrite.op in ("temporal_attention", "shared_attention", "masked_aggregate",
                                    "time_encode"):
            op = "temporal_attention" if rewrite.op == "shared_attention" else rewrite.op
            found.setdefault((op, op_problem(rewrite.op, sizes)), []).append(rewrite.where)
    return tuple(FusedOp(op, problem, tuple(where)) for (op, problem), where in found.items())


def time_encoding_factorable(model, graph, config: Config) -> bool:
    """Whether ``passes.factor_time_encoding`` finds a time encoding to factor out of an
    attention's keys and values in ``model`` (a copy of it is optimized for ``graph`` on the CPU
    with the pass on, as :func:`fused_ops` probes; ``model`` is left as it was)."""
    from fastopt.trainer import Trainer

    probe = config.copy()
    for name, value in _PROBE.items():
        probe.set(name, value)
    probe.set("passes.factor_time_encoding", "always")
    trainer = Trainer(copy.deepcopy(model).cpu(), graph, probe, progress=False, records=False)
    report = getattr(trainer.model, "fastopt_report", None)
    return report is not None and report.count("shared_attention") > 0


def _cores() -> int:
    return usable_cpus()


def knob_fields() -> Tuple[str, ...]:
    """Every config field some space may search (a record applies only these)."""
    return tuple(c.name for c in _CANDIDATES) + (OP_OVERRIDES,)

