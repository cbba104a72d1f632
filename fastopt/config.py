"""The typed configuration of fastopt: every knob, grouped by concern.

Each field has a one-line comment, an environment override ``FASTOPT_<GROUP>_<FIELD>`` (read once,
when :func:`default_config` is first called) and appears in :meth:`Config.to_json`. Tests change
knobs with :func:`patch`, never by mutating the global::

    with fastopt.config.patch(sampler__threads=1):
        ...

This module imports nothing of fastopt but :mod:`fastopt.errors` and the syntax of
``kernels.op_overrides`` (:mod:`fastopt.op_overrides`); every layer may import it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import json
import os
import sys
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Union

from fastopt.errors import ConfigError, check_setting as _check
from fastopt.op_overrides import OP_OVERRIDE_FIELDS, format_op_overrides, parse_op_overrides

# OpenMP threads (PyTorch's and the sampler's share one runtime) must sleep, not spin, between
# parallel regions: with few, busy cores a spinning team makes the next loop wait for a
# descheduled thread, which made training steps several times slower on a 2-core machine. The
# runtime reads the variable once, when torch loads it, so it is set here, before fastopt imports
# torch; an explicit setting in the environment wins. It cannot wait until a sampler is created:
# torch (and with it the runtime) is loaded by then, and a later change is never read.
# ``OPENMP_WAIT_POLICY`` records what the runtime will read, or None when torch was loaded before
# fastopt (then only the process's starting environment tells).
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    OPENMP_WAIT_POLICY: Optional[str] = os.environ["OMP_WAIT_POLICY"]
else:
    OPENMP_WAIT_POLICY = None

__all__ = ["DataConfig", "SamplerConfig", "CacheConfig", "KernelsConfig", "PassesConfig", "PipelineConfig",
           "ModelConfig", "TrainConfig", "TunerConfig", "Config", "ConfigWarning", "MAX_HOT_SET_PHASES",
           "OP_OVERRIDE_FIELDS", "OTHER_VARIABLES", "default_config", "format_op_overrides", "parse_op_overrides", "patch",
           "resolve_config"]


MAX_HOT_SET_PHASES = 8  # cache.hot_set_phases: one bit per run and row counts a run's hits


@dataclass
class DataConfig:
    # parsed event files (.npz, keyed by content hash); "" = ~/.cache/fastopt/datasets (or
    # $XDG_CACHE_HOME); nothing is written beside the data
    cache_dir: str = ""


@dataclass
class SamplerConfig:
    threads: int = 0  # sampler threads; 0 = one per available core
    # graph reordering inside the sampler: "none", "degree" or "rcm" (reverse Cuthill-McKee)
    reorder: str = "none"
    # pin sampler threads to cores that share a cache, read from /sys/devices/system/cpu (pairing
    # the threads needs networkx: pip install "fastopt[topology]")
    pin_threads: bool = False
    undirected: bool = True  # treat every event as two directed edges (src->dst and dst->src)
    # move a batch's unique feature rows only (False: every sampled slot's row, duplicates included)
    dedup: bool = True
    # models of 2+ layers: a node reached through one event by several slots of a layer is expanded once
    # (sampled and embedded once, read by every slot; TGAT's H200 epoch 0.72 s with it, 0.82 s without)
    hop_dedup: bool = True


@dataclass
class CacheConfig:
    # where static features live: "device" (whole tables on the GPU), "host" (pinned or mapped
    # host tables, read through the budgeted cache) or "auto" (device when they fit, else host)
    placement: str = "auto"
    device_budget_fraction: float = 0.5  # "auto" placement: the free device memory tables may take
    budget_fraction: float = 0.1  # GPU cache budget, a fraction of the cached tables' bytes (0: dedup only)
    policy: str = "auto"  # eviction: "static", "lru", "future" (Belady with the sampler's lookahead), "auto"
    # how a GPU gets rows the cache lacks: "zero_copy" (it reads pinned host memory itself; static
    # hot set per split, refreshed each epoch), "staged" (host gathers, then copies) or "auto"
    host_reads: str = "auto"
    # a training batch's zero-copy reads run inside its captured step, not on the staging threads,
    # read_overlap: on a side stream the step joins where the model takes the rows (waits_for_edges)
    read_in_step: bool = True
    read_overlap: bool = False
    # zero-copy reads in the training step: the epoch's batches in this many runs (1 to
    # MAX_HOT_SET_PHASES), each through the hot set the same run of the last epoch used most
    hot_set_phases: int = 1
    # a mapped edge table that zero-copy reads would serve is read into pinned RAM when it takes at
    # most this fraction of the available host memory (else read in place); 0 = never
    pin_ram_fraction: float = 0.5
    transfer_dtype: str = "float32"  # static features on the wire and in the cache: float32, bfloat16, float16
    gather_threads: int = 2  # threads gathering cache misses into pinned staging buffers
    # leading fraction of the planned epoch counted to pick the static hot set and auto's policy
    sample_fraction: float = 0.5
    # budget split between tables: "greedy" (sampled hits per byte) or "proportional" (to table bytes)
    split: str = "greedy"


@dataclass
class KernelsConfig:
    # use generated Triton kernels on CUDA (False: plain PyTorch references everywhere)
    enabled: bool = True
    # rows (attention/reduction: tiles of block_m rows) one program handles in turn; 0 = heuristic
    rows_per_program: int = 0
    # rows held side by side in one attention/reduction tile (power of two); 0 = heuristic
    block_m: int = 0
    heads_per_program: int = 0  # heads handled by one program; 0 = all heads
    # neighbor slots per tile (power of two); 0 = heuristic (covers K when the tile fits)
    block_k: int = 0
    num_warps: int = 0  # warps per program; 0 = heuristic per GPU
    num_stages: int = 0  # software-pipelining stages; 0 = heuristic per GPU
    # registers per thread the generated kernels may use (maxnreg, 24..255); 0 = the compiler's choice
    max_registers: int = 0
    # per fused op and problem shape, mapping fields over the heuristics and the knobs above:
    # "op@KxHxd:field=value,...;..." (OP_OVERRIDE_FIELDS lists each op's fields), "" = none
    op_overrides: str = ""
    # attention reads a head that starts off a 16-byte boundary (d = 50 floats) from the boundary
    # below and zeroes the lanes outside it: 16-byte vector loads (False: exact lanes only)
    aligned_rows: bool = True
    # L2 hint of attention's table-row gathers: "evict_last" keeps gathered key/value rows in L2
    # (streamed queries, indices and outputs get "evict_first"), "none" gives no hint, "auto" = heuristic
    gather_eviction: str = "auto"
    # attention forward's edge softmax: "online" (running maximum, rescaled per neighbor slot),
    # "two_pass" (all slots' scores, then one maximum; where the slots are unrolled) or "auto"
    # (two passes while the unrolled slots' value rows fit in about 48 registers per thread)
    attention_softmax: str = "auto"
    # projections rewritten by the passes (split/merged Linears): "off" (cuBLAS through torch),
    # "tf32x3" (generated matmuls on tensor cores, about float32 accuracy) or "ieee" (generated, float32 FMA)
    matmul_precision: str = "off"
    # tile of the generated matmuls: rows, columns and depth per step (powers of two), warps; 0 = 64, 64, 32, 4
    matmul_block_m: int = 0
    matmul_block_n: int = 0
    matmul_block_k: int = 0
    matmul_warps: int = 0
    # backward into indexed tables: "deterministic" (segmented reduction) or "atomic"
    backward_mode: str = "deterministic"
    # on-disk kernel cache; "" = ~/.cache/fastopt/kernels (or $XDG_CACHE_HOME)
    cache_dir: str = ""
    # "auto" (Triton on CUDA, references on CPU), "triton" (also on CPU under TRITON_INTERPRET=1) or "reference"
    backend: str = "auto"
    # check index ranges and CSR counts of fused-op inputs (one device sync per call on CUDA)
    check_inputs: bool = True
    # fill kernel outputs with NaN before each launch (tests: catches elements a kernel never writes)
    poison_outputs: bool = False


@dataclass
class PassesConfig:
    # fuse attention whose dropout is active (training) into the kernel's own Philox dropout
    fuse_dropout: bool = True
    # CUDA graphs of the optimized forward+backward: "auto" (capture a call signature on its second
    # CUDA call), "on" (capture on the first) or "off"
    cuda_graphs: str = "auto"
    # captured forward/backward graph pairs kept per captured module (least recently used go first)
    max_graphs: int = 8
    # Linear(cat(parts)): multiply the parts needing no gradient apart (no input gradient for them)
    split_linear_inputs: bool = True
    # Linears of one concatenated input (keys and values): one product of their stacked weights
    merge_sibling_linears: bool = True
    # cos(Linear(1, T)(dt)) as one fused op: "off", "graphs" (inside captured CUDA graphs only,
    # where its launch costs no host time; rewritten only where graphs can capture) or "always";
    # read when fastopt.optimize runs (the rewrite) and per call (whether a capture is running)
    fuse_time_encoding: str = "graphs"
    # bias gradients of the projections the passes rewrite (split/merged Linears) summed by the
    # generated column-sum kernel rather than torch's reduction: "off", "graphs" (inside captured
    # CUDA graphs only, where its autograd node costs no host time) or "always"
    bias_grad_kernel: str = "graphs"
    # keys and values projected from [x_j ; cos(Linear(dt_j))]: factor the time part out of the
    # projection (q W_t^T against the encoding, the encoding's weighted sum times W_t) so the
    # [M, K, H, d] product of the encoding is never computed: "off", "auto" (where the generated
    # kernels run) or "always" (also through the references). H200, TGAT on wikipedia, batch
    # 600 (5e97864): 0.565 s an epoch against 0.643 s off, peak device memory 1.79 against 1.44 GB
    factor_time_encoding: str = "auto"


@dataclass
class PipelineConfig:
    # batches whose neighborhoods are sampled ahead of the one being trained (0 = in the loop)
    prefetch_depth: int = 2
    # sample and stage batches on a background thread (the compiled sampler runs without the GIL)
    async_sampling: bool = True
    # threads staging batches ahead in turn (at most prefetch_depth; 1 with SlimCache's staged
    # lookups): one batch's packing and copies overlap the next one's sampling; 0 = 2 on CUDA, 1 on the CPU
    stage_threads: int = 0
    # the interpreter's thread switch interval during an epoch, in microseconds: how long the training
    # thread may wait for the GIL while staging threads run Python; 0 = Python's own (5,000)
    gil_switch_us: int = 0
    # whole training steps (forward, loss, backward, Adam, write-back) replayed from CUDA graphs,
    # one per batch shape: "auto" (for a model fastopt.optimize returned, on CUDA), "on", "off"
    step_graphs: str = "auto"
    # start from the padded lengths an earlier run with the same events and sampling reached (kept
    # beside the kernel cache), so that its first epoch captures one step per batch size (CUDA)
    shape_plans: bool = True


@dataclass
class ModelConfig:
    # neighbors sampled per attention layer, comma-separated ("10,10": two layers);
    # "" = the model's own (TGN: 10, TGAT: 10,10; JODIE and APAN sample none)
    fanouts: str = ""
    # width of the node memory (TGN, JODIE, APAN)
    memory_dim: int = 100
    # width of the node embeddings the link predictor scores
    dim: int = 100
    # width of the time encoding
    time_dim: int = 100
    # attention heads (TGN, TGAT, APAN); the attention widths must divide by it
    heads: int = 2
    # dropout of the attention layers (TGN, TGAT, APAN)
    dropout: float = 0.1
    # mails kept per node (APAN)
    mailbox_size: int = 10
    # width of a learnable row per node, appended to its features where the model reads them
    # (TGAT's layer 0; the node projection of TGN, JODIE, APAN); 0 = none. Gives TGAT something
    # to tell neighbors apart by on graphs without node features (README, "Graphs without node
    # features": 100 with train.lr 1e-3)
    node_embedding: int = 0


@dataclass
class TrainConfig:
    # training epochs
    epochs: int = 10
    # positive events per mini-batch
    batch_size: int = 200
    # Adam learning rate
    lr: float = 1e-4
    # Adam's implementation, one update rounded differently: "auto" (fused on CUDA, captured with
    # the step inside whole-step CUDA graphs; the single-tensor one on the CPU), "fused",
    # "foreach" or "single"
    adam: str = "auto"
    # seed of every random choice (weights, negatives, sampling, dropout)
    seed: int = 0
    # "auto" (cuda if available), "cpu" or "cuda[:N]"
    device: str = "auto"
    # negatives per positive for MRR at evaluation (TGB style); 0 = skip MRR
    mrr_negatives: int = 20
    # width of deterministic random edge features for datasets without them (0 = none)
    edge_dim: int = 0
    # width of deterministic random node features for datasets without them (0 = none)
    node_dim: int = 0
    # run the model through fastopt.optimize: "auto" (on CUDA, where the fused kernels and CUDA
    # graphs pay; on the CPU the eager model is faster), "on" or "off"
    optimize: str = "auto"
    # stop once validation AP has not improved for this many epochs (0 = train every epoch)
    patience: int = 0
    # before testing, go back to the weights and state of the epoch with the best validation AP
    restore_best: bool = False


@dataclass
class TunerConfig:
    # Optuna trials per study
    trials: int = 40
    # Optuna storage: an RDB URL or a SQLite file ("" = fastopt-tune.db in the working directory)
    storage: str = ""
    # timed training steps per trial, at most the rest of the epoch after the warm-up (the whole
    # epoch of the shipped graphs: the epoch's first steps are its cheapest)
    steps_per_trial: int = 1000
    # training steps run before the timed ones in each trial (warm-up: compiles, captures, caches)
    warmup_steps: int = 5
    # wall seconds a trial may take (build, check, warm-up and window; the baseline excepted); a
    # trial past it is cut, even in a compile, and pruned with the reason (0 = no limit)
    trial_seconds: float = 60.0
    # rounds after the trials in which the baseline and the confirm_top best trials are measured
    # again in turns; the record compares their medians (0 = one window per trial)
    confirm_rounds: int = 3
    confirm_top: int = 3
    # share of a new study's trials that first vary one knob of the baseline each (the rest: TPE)
    neighbor_share: float = 0.5
    # tuning records config="auto" reads before the ones shipped in the package ("" = shipped only)
    records_dir: str = ""


@dataclass
class Config:
    """All knobs of fastopt, grouped by concern."""

    data: DataConfig = field(default_factory=DataConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    passes: PassesConfig = field(default_factory=PassesConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tuner: TunerConfig = field(default_factory=TunerConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), indent=kwargs.pop("indent", 2), sort_keys=True, **kwargs)

    @classmethod
    def from_dict(cls, data: dict) -> "Config":
        """Build a config from a (possibly partial) nested dict; unknown keys are errors."""
        return cls().update(data)

    @classmethod
    def from_json(cls, text: str, where: str = "config JSON") -> "Config":
        return cls().update(_parse_json(text, where))

    @classmethod
    def from_file(cls, path: Union[str, os.PathLike], base: Optional["Config"] = None) -> "Config":
        """The values of a JSON file (``{"train": {"epochs": 5}, ...}``, partial or whole as
        :meth:`to_json` writes it) set over a copy of ``base`` (default: the built-in defaults).

        Raises:
            ConfigError: the file is missing or unreadable, not JSON, or names an unknown or
                out-of-range value (the message names the file).
        """
        where = f"config file {str(path)!r}"
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise ConfigError(f"{where} does not exist; pass the path of a JSON file of config "
                              f"values (fastopt.Config().to_json() writes a complete one)") from None
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            raise ConfigError(f"{where} cannot be read ({reason}); pass a readable UTF-8 JSON "
                              f"file") from None
        cfg = (base or cls()).copy()
        try:
            return cfg.update(_parse_json(text, where))
        except ConfigError as exc:
            message = str(exc)
            raise ConfigError(message if message.startswith(where) else f"{where}: {message}") from None

    def update(self, data: dict) -> "Config":
        """Set every ``{group: {field: value}}`` of ``data`` (a partial nested dict); returns self."""
        if not isinstance(data, dict):
            raise ConfigError(f"a config must be a JSON object of groups (got {type(data).__name__}); "
                              f'write e.g. {{"train": {{"epochs": 5}}}}')
        for group, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"config group {group!r} must be a mapping (got {values!r}); "
                                  f'write e.g. {{"{group}": {{"field": value}}}}')
            for name, value in values.items():
                self.set(f"{group}.{name}", value)
        return self

    def set(self, dotted: str, value: Any) -> None:
        """Set ``group.field`` to ``value``, converting strings and checking the type."""
        group_name, _, name = dotted.partition(".")
        group = getattr(self, group_name, None)
        if group is None or not dataclasses.is_dataclass(group):
            raise ConfigError(
                f"unknown config group {group_name!r}; known groups: {', '.join(_group_names())}"
            )
        fields = {f.name: f for f in dataclasses.fields(group)}
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f"did you mean '{group_name}.{close[0]}'? " if close else ""
            raise ConfigError(
                f"unknown config field {dotted!r}; {hint}fields of {group_name}: {', '.join(fields)}"
            )
        ftype = typing.get_type_hints(type(group))[name]
        before = getattr(group, name)
        setattr(group, name, _coerce(dotted, value, ftype))
        try:
            self.validate()
        except ConfigError:
            setattr(group, name, before)  # a refused value leaves the config as it was
            raise

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first value outside its range."""
        _check(self.sampler.threads >= 0, "sampler.threads", self.sampler.threads, ">= 0 (0 = all cores)")
        _check(self.sampler.reorder in ("none", "degree", "rcm"), "sampler.reorder",
               self.sampler.reorder, "one of 'none', 'degree', 'rcm'")
        _check(self.cache.placement in ("auto", "device", "host"), "cache.placement",
               self.cache.placement, "one of 'auto', 'device', 'host'")
        _check(0.0 < self.cache.device_budget_fraction <= 1.0, "cache.device_budget_fraction",
               self.cache.device_budget_fraction, "in (0, 1]")
        _check(self.pipeline.step_graphs in ("auto", "on", "off"), "pipeline.step_graphs",
               self.pipeline.step_graphs, "one of 'auto', 'on', 'off'")
        _check(self.train.optimize in ("auto", "on", "off"), "train.optimize", self.train.optimize,
               "one of 'auto' (on CUDA), 'on', 'off'")
        _check(self.train.adam in ("auto", "fused", "foreach", "single"), "train.adam", self.train.adam,
               "one of 'auto', 'fused', 'foreach', 'single'")
        for key in ("budget_fraction", "pin_ram_fraction"):
            _check(0.0 <= getattr(self.cache, key) <= 1.0, f"cache.{key}", getattr(self.cache, key), "in [0, 1]")
        _check(self.cache.policy in ("static", "lru", "future", "auto"), "cache.policy",
               self.cache.policy, "one of 'static', 'lru', 'future', 'auto'")
        _check(self.cache.host_reads in ("auto", "zero_copy", "staged"), "cache.host_reads",
               self.cache.host_reads, "one of 'auto', 'zero_copy', 'staged'")
        _check(self.cache.transfer_dtype in ("float32", "bfloat16", "float16"), "cache.transfer_dtype",
               self.cache.transfer_dtype, "one of 'float32', 'bfloat16', 'float16'")
        _check(self.cache.gather_threads >= 1, "cache.gather_threads", self.cache.gather_threads, ">= 1")
        _check(1 <= self.cache.hot_set_phases <= MAX_HOT_SET_PHASES, "cache.hot_set_phases",
               self.cache.hot_set_phases, f"in [1, {MAX_HOT_SET_PHASES}]")
        _check(0.0 < self.cache.sample_fraction <= 1.0, "cache.sample_fraction",
               self.cache.sample_fraction, "in (0, 1]")
        _check(self.cache.split in ("greedy", "proportional"), "cache.split", self.cache.split,
               "'greedy' or 'proportional'")
        _check(self.kernels.backward_mode in ("deterministic", "atomic"), "kernels.backward_mode",
               self.kernels.backward_mode, "'deterministic' or 'atomic'")
        _check(self.kernels.gather_eviction in ("auto", "none", "evict_last"), "kernels.gather_eviction",
               self.kernels.gather_eviction, "one of 'auto', 'none', 'evict_last'")
        _check(self.kernels.attention_softmax in ("auto", "online", "two_pass"),
               "kernels.attention_softmax", self.kernels.attention_softmax,
               "one of 'auto', 'online', 'two_pass'")
        _check(self.kernels.matmul_precision in ("off", "tf32x3", "ieee"), "kernels.matmul_precision",
               self.kernels.matmul_precision, "one of 'off', 'tf32x3', 'ieee'")
        _check(self.kernels.backend in ("auto", "triton", "reference"), "kernels.backend",
               self.kernels.backend, "one of 'auto', 'triton', 'reference'")
        for knob in ("rows_per_program", "block_m", "heads_per_program", "block_k", "num_warps",
                     "num_stages", "matmul_warps"):
            value = getattr(self.kernels, knob)
            _check(value >= 0, f"kernels.{knob}", value, ">= 0 (0 = heuristic)")
        _check(self.kernels.max_registers == 0 or 24 <= self.kernels.max_registers <= 255,
               "kernels.max_registers", self.kernels.max_registers,
               "0 (the compiler's choice) or in [24, 255]")
        parse_op_overrides(self.kernels.op_overrides)
        for knob in ("matmul_block_m", "matmul_block_n", "matmul_block_k"):
            value = getattr(self.kernels, knob)
            _check(value == 0 or (value >= 16 and value & (value - 1) == 0), f"kernels.{knob}",
                   value, "0 (default) or a power of two >= 16 (tl.dot's smallest tile)")
        _check(self.passes.fuse_time_encoding in ("off", "graphs", "always"),
               "passes.fuse_time_encoding", self.passes.fuse_time_encoding,
               "one of 'off', 'graphs', 'always'")
        _check(self.passes.factor_time_encoding in ("off", "auto", "always"),
               "passes.factor_time_encoding", self.passes.factor_time_encoding,
               "one of 'off', 'auto', 'always'")
        _check(self.passes.bias_grad_kernel in ("off", "graphs", "always"),
               "passes.bias_grad_kernel", self.passes.bias_grad_kernel,
               "one of 'off', 'graphs', 'always'")
        _check(self.passes.cuda_graphs in ("auto", "on", "off"), "passes.cuda_graphs",
               self.passes.cuda_graphs, "one of 'auto', 'on', 'off'")
        _check(self.passes.max_graphs >= 1, "passes.max_graphs", self.passes.max_graphs,
               ">= 1 (use passes.cuda_graphs='off' to capture none)")
        for knob in ("prefetch_depth", "gil_switch_us"):
            _check(getattr(self.pipeline, knob) >= 0, f"pipeline.{knob}", getattr(self.pipeline, knob), ">= 0")
        _check(self.pipeline.stage_threads >= 0, "pipeline.stage_threads", self.pipeline.stage_threads,
               ">= 0 (0 = 2 on CUDA, 1 on the CPU)")
        for knob, low in (("epochs", 1), ("batch_size", 1), ("mrr_negatives", 0), ("edge_dim", 0), ("node_dim", 0)):
            _check(getattr(self.train, knob) >= low, f"train.{knob}", getattr(self.train, knob), f">= {low}")
        _check(self.train.lr > 0, "train.lr", self.train.lr, "> 0")
        _check(self.train.patience >= 0, "train.patience", self.train.patience,
               ">= 0 (0 = no early stopping)")
        for knob in ("memory_dim", "dim", "time_dim", "heads", "mailbox_size"):
            value = getattr(self.model, knob)
            _check(value >= 1, f"model.{knob}", value, ">= 1")
        _check(0.0 <= self.model.dropout < 1.0, "model.dropout", self.model.dropout, "in [0, 1)")
        _check(self.model.node_embedding >= 0, "model.node_embedding", self.model.node_embedding,
               ">= 0 (0 = no node embedding)")
        self.model_fanouts()  # raises on a malformed list
        _check(self.tuner.trials >= 1, "tuner.trials", self.tuner.trials, ">= 1")
        _check(self.tuner.steps_per_trial >= 1, "tuner.steps_per_trial", self.tuner.steps_per_trial, ">= 1")
        _check(self.tuner.warmup_steps >= 0, "tuner.warmup_steps", self.tuner.warmup_steps, ">= 0")
        _check(self.tuner.confirm_rounds >= 0, "tuner.confirm_rounds", self.tuner.confirm_rounds, ">= 0")
        _check(self.tuner.confirm_top >= 1, "tuner.confirm_top", self.tuner.confirm_top, ">= 1")
        _check(self.tuner.trial_seconds >= 0, "tuner.trial_seconds", self.tuner.trial_seconds,
               ">= 0 (0 = no limit)")
        _check(0 <= self.tuner.neighbor_share <= 1, "tuner.neighbor_share", self.tuner.neighbor_share,
               "between 0 and 1 (0: TPE alone after the baseline)")

    def model_fanouts(self) -> Optional[list]:
        """``model.fanouts`` as a list of ints, or None for the model's own."""
        text = self.model.fanouts.strip()
        if not text:
            return None
        try:
            fanouts = [int(part) for part in text.split(",")]
        except ValueError:
            fanouts = []
        _check(bool(fanouts) and min(fanouts) >= 1, "model.fanouts", self.model.fanouts,
               "comma-separated neighbor counts >= 1, one per layer (e.g. '10,10'), or '' for the "
               "model's own")
        return fanouts

    def copy(self) -> "Config":
        return copy.deepcopy(self)


def _group_names() -> list[str]:
    return [f.name for f in dataclasses.fields(Config)]


def resolve_config(config: Any) -> Config:
    """``"auto"``/None (a copy of :func:`default_config`), a :class:`Config` (validated) or a dict."""
    if config is None or (isinstance(config, str) and config == "auto"):
        return default_config().copy()
    if isinstance(config, Config):
        config.validate()
        return config
    if isinstance(config, dict):
        return Config.from_dict(config)
    raise ConfigError(f"config must be 'auto', a fastopt.Config or a dict (got {type(config).__name__})")


def _coerce(name: str, value: Any, ftype: Any) -> Any:
    try:
        if ftype is bool:
            if isinstance(value, str):
                low = value.strip().lower()
                if low in ("1", "true", "yes", "on"):
                    return True
                if low in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            if isinstance(value, (bool, int)) and value in (0, 1):
                return bool(value)
            raise ValueError(value)
        if ftype is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if ftype is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if ftype is str:
            if not isinstance(value, str):
                raise ValueError(value)
            return value
    except (TypeError, ValueError):
        raise ConfigError(
            f"{name} must be of type {getattr(ftype, '__name__', ftype)} (got {value!r}); give a "
            f"value of that type"
        ) from None
    return value


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where} is not valid JSON: {exc.msg} at line {exc.lineno}, column "
                          f"{exc.colno}; write one JSON object of config groups, e.g. "
                          f'{{"train": {{"epochs": 5}}}}') from None


class ConfigWarning(UserWarning):
    """A ``FASTOPT_*`` environment variable that is no setting of fastopt (a misspelling)."""


# FASTOPT_* variables read elsewhere (not config knobs): tests' data folder, graph dumps of the
# passes, the commit a benchmark record names, the build without OpenMP, the tests' PostgreSQL server.
OTHER_VARIABLES = ("FASTOPT_SHARED_DATA", "FASTOPT_DUMP_GRAPHS", "FASTOPT_GIT_COMMIT",
                   "FASTOPT_NO_OPENMP", "FASTOPT_TEST_POSTGRES_URL")


def _env_keys(cfg: Config) -> dict:
    """``FASTOPT_<GROUP>_<FIELD>`` of every knob, mapped to its ``group.field``."""
    return {f"FASTOPT_{group.name}_{f.name}".upper(): f"{group.name}.{f.name}"
            for group in dataclasses.fields(cfg) for f in dataclasses.fields(getattr(cfg, group.name))}


def _from_env(cfg: Config, environ: dict) -> Config:
    keys = _env_keys(cfg)
    for key, dotted in keys.items():
        if key in environ:
            try:
                cfg.set(dotted, environ[key])
            except ConfigError as exc:
                raise ConfigError(f"environment variable {key}={environ[key]!r}: {exc} (or unset "
                                  f"{key})") from None
    for key in sorted(environ):
        if key.startswith("FASTOPT_") and key not in keys and key not in OTHER_VARIABLES:
            close = difflib.get_close_matches(key, list(keys) + list(OTHER_VARIABLES), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            warnings.warn(f"environment variable {key} is not a fastopt setting and is ignored; "
                          f"{hint}Each knob is FASTOPT_<GROUP>_<FIELD> (see fastopt.Config.to_json())",
                          ConfigWarning, stacklevel=3)
    return cfg


_DEFAULT: Optional[Config] = None


def default_config() -> Config:
    """The process-wide defaults: dataclass defaults overridden by ``FASTOPT_*`` variables."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = _from_env(Config(), dict(os.environ))
    return _DEFAULT


@contextlib.contextmanager
def patch(**changes: Any) -> Iterator[Config]:
    """Temporarily change defaults: ``patch(sampler__threads=1, cache__policy="lru")``."""
    cfg = default_config()
    saved = copy.deepcopy(cfg)
    try:
        for key, value in changes.items():
            cfg.set(key.replace("__", ".", 1), value)
        yield cfg
    finally:
        for group in dataclasses.fields(cfg):
            setattr(cfg, group.name, getattr(saved, group.name))
