"""Chronological link-prediction training and evaluation of a TGNN.

One step: draw negatives, sample neighbors of every root (sources, destinations, negatives),
gather features onto the device, embed, score, BCE loss, backward, optimizer step, then write
back the model's memory and mailbox (after the step, so no event sees its own batch).
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fastopt.checkpoint import BEST_FILE, load_model_state, plain, read_checkpoint, write_checkpoint
from fastopt.config import Config, resolve_config
from fastopt.data import TemporalGraph
from fastopt.errors import ConfigError, FastOptError, device_memory_guard
from fastopt.metrics import average_precision, mrr, roc_auc
from fastopt.progress import progress_bar
from fastopt.runtime.flatten import flatten, unflatten
from fastopt.runtime.inputs import GraphInputs
from fastopt.runtime.loader import EventBatch, Loader, NegativeSampler, StageTimer
from fastopt.runtime.timing import STAGES

__all__ = ["Trainer", "EventBatch", "resolve_device", "make_sampler", "make_optimizer", "NegativeSampler",
           "progress_bar", "read_checkpoint", "tuning_fingerprint"]


def _zero_copy_reads(device: torch.device) -> Optional[Callable]:
    """``codegen.cached_rows`` where the generated kernels run on ``device`` (SlimCache's zero-copy reads)."""
    from fastopt import codegen
    use = device.type == "cuda" and codegen.select_backend(torch.empty(0, device=device)) == "triton"
    return codegen.cached_rows if use else None


def resolve_device(spec: str) -> torch.device:
    """``"auto"`` picks CUDA when available; otherwise the named device, checked."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device {spec!r} is not a device; use 'auto', 'cpu' or 'cuda[:N]'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {spec!r} asked for, but CUDA is not available here; use --device cpu")
    return device


def make_sampler(graph: TemporalGraph, fanouts, strategy: str, config: Config, *,
                 hop_dedup: bool = False, pad_rows: bool = False):
    """The fastest available sampler: the compiled one when built, else the NumPy reference.
    ``hop_dedup`` (for models that read ``GraphInputs.nbr_index``) merges repeated slots when
    ``config.sampler.hop_dedup`` allows; ``pad_rows`` pads the merged layers (CUDA capture)."""
    if not fanouts:
        return None
    try:
        from fastopt.runtime import TemporalSampler
    except ImportError:
        TemporalSampler = None
    if TemporalSampler is not None:
        s = config.sampler
        return TemporalSampler(graph, fanouts=fanouts, strategy=strategy, threads=s.threads or None,
                               seed=config.train.seed, undirected=s.undirected, reorder=s.reorder,
                               pin_threads=s.pin_threads, hop_dedup=hop_dedup and s.hop_dedup, pad_rows=pad_rows)
    from fastopt.sampling import NumpySampler
    return NumpySampler(graph, fanouts, strategy, seed=config.train.seed, undirected=config.sampler.undirected,
                        hop_dedup=hop_dedup and config.sampler.hop_dedup)


def make_optimizer(params, lr: float, device: torch.device, capturable: bool = False,
                   kind: str = "auto") -> torch.optim.Optimizer:
    """Adam. ``kind`` ``"auto"``: on CUDA the fused implementation (one launch per group of
    tensors, steps kept on the device, so an optimizer step never waits for the host; with
    ``capturable`` a CUDA graph captures it, and it rounds as the uncaptured one does, so a
    captured run and an eager one take the same updates); the single-tensor one on the CPU.
    ``"fused"``, ``"foreach"``, ``"single"`` (``config.train.adam``) pick one: the same update,
    rounded differently."""
    if kind == "auto":
        kind = "fused" if device.type == "cuda" else "single"
    extra = {"capturable": True} if capturable else {}
    if kind == "fused":
        return torch.optim.Adam(params, lr=lr, fused=True, **extra)
    return torch.optim.Adam(params, lr=lr, foreach=kind == "foreach", **extra)


def tuning_fingerprint(model: nn.Module) -> dict:
    """The key tuning records file ``model`` under (:func:`fastopt.tuner.records.model_fingerprint`
    of :func:`fastopt.passes.graph_structure`), here where the passes and the tuner may both be
    imported: the trainer, :func:`fastopt.optimize` and the tuner compute one and the same key."""
    from fastopt.passes import graph_structure
    from fastopt.tuner.records import model_fingerprint

    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    return model_fingerprint(model, graph_structure(model))


def wants_step_graphs(config: Config, device: torch.device, optimized: bool) -> bool:
    """Whether ``config.pipeline.step_graphs`` asks for whole-step CUDA graphs (``"auto"``: for an
    optimized model on CUDA)."""
    mode = config.pipeline.step_graphs
    return device.type == "cuda" and (mode == "on" or (mode == "auto" and optimized))


def wants_optimize(config: Config, device: torch.device) -> bool:
    """Whether ``config.train.optimize`` asks for :func:`fastopt.optimize` on ``device``."""
    mode = config.train.optimize
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def _memory_advice(where: str):
    """Run a Trainer method under :func:`~fastopt.errors.device_memory_guard`: a device
    out-of-memory error names the run's memory knobs and their present values."""
    def wrap(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            c = self.config
            knobs = {"train.batch_size": c.train.batch_size, "cache.budget_fraction": c.cache.budget_fraction,
                     "cache.placement": c.cache.placement}
            with device_memory_guard(where, knobs):
                return method(self, *args, **kwargs)
        return guarded
    return wrap


@dataclass
class EpochStats:
    epoch: int
    loss: float = 0.0
    seconds: float = 0.0
    events_per_s: float = 0.0
    stages: dict = field(default_factory=dict)
    val: dict = field(default_factory=dict)
    bytes_h2d: int = 0
    captures: int = 0  # CUDA-graph captures in the epoch (graph_captures): none in a steady one


class Trainer:
    """Train a TGNN for link prediction on a temporal graph.

    The data path is :class:`~fastopt.runtime.Loader` (sampling and staging ahead of the step on a
    background thread, features where ``cache.placement`` puts them); the model runs through
    :func:`fastopt.optimize` when ``config.train.optimize`` asks for it (``"auto"``: on CUDA).
    A step never waits for the host: losses and scores stay on the device until the end of the
    epoch, stage times come from CUDA events, and Adam is the fused one on CUDA.

    Args:
        model: a :class:`~fastopt.models.TGNNModel` (or what :func:`fastopt.optimize` returned, or
            ``torch.compile`` of one).
        graph: the event stream with its chronological split.
        config: ``"auto"`` (defaults and ``FASTOPT_*`` overrides, with the values of the tuning
            record matching this device, model and graph, see :mod:`fastopt.tuner.records`), a
            :class:`Config`, or a dict.
        log_path: JSON-lines file receiving a record of the run (configuration, seed, command,
            start time, versions), one record per epoch and the final test metrics.
        checkpoint_dir: where ``checkpoint.pt`` is written after every epoch (and ``best.pt``,
            the best validation epoch's weights, with ``config.train.restore_best``).
        progress: ``True`` prints one line per epoch and for the test, with progress bars where
            they can be drawn (a terminal or a notebook); ``"lines"`` the lines alone; ``False``
            nothing.
        records: apply the matching tuning record (:attr:`tuned`); None: only for ``"auto"``.
    """

    def __init__(self, model: nn.Module, graph: TemporalGraph, config: Union[str, Config, dict, None] = "auto",
                 *, log_path: Optional[Union[str, os.PathLike]] = None,
                 checkpoint_dir: Optional[Union[str, os.PathLike]] = None,
                 progress: Union[bool, str] = True, records: Optional[bool] = None) -> None:
        if progress not in (True, False, "lines"):
            raise ConfigError(f"progress must be True, False or 'lines' (got {progress!r}); pass "
                              f"progress=False for a silent run")
        self.config = resolve_config(config)
        self.graph = graph
        self.progress = progress
        self.device = resolve_device(self.config.train.device)
        self.tuned = None  # the tuning record applied (a fastopt.tuner.RecordMatch), if any
        if records or (records is None and (config is None or isinstance(config, str))):
            from fastopt.tuner.records import apply_tuned

            self.config, self.tuned = apply_tuned(self.config, lambda: tuning_fingerprint(model), graph,
                                                  self.device)
            self._say(f"config: {self.tuned.describe() if self.tuned else 'no tuned record matches; defaults'}")
        tc = self.config.train
        model = model.to(self.device)
        if wants_optimize(self.config, self.device) and not hasattr(model, "fastopt_report"):
            from fastopt.optimize import optimize

            model = optimize(model, config=self.config)
        self.model = model
        capture = wants_step_graphs(self.config, self.device, hasattr(model, "fastopt_report"))
        self.optimizer = make_optimizer(self.model.parameters(), tc.lr, self.device, capturable=capture,
                                        kind=tc.adam)
        self._step_graphs = None
        if capture:
            from fastopt.runtime.step_graph import StepGraphs

            self._step_graphs = StepGraphs(
                lambda tensors, constant: self._whole_step(tensors, *constant),
                max_graphs=self.config.passes.max_graphs)
        self.sampler = make_sampler(graph, list(getattr(model, "fanouts", [])),
                                    getattr(model, "strategy", "recent"), self.config,
                                    hop_dedup=getattr(model, "reads_nbr_index", False),
                                    pad_rows=self.device.type == "cuda")
        self.loader = Loader(graph, self.sampler, self.device, self.config,
                             edge_rows=getattr(model, "reads_edge_rows", False),
                             read_rows=_zero_copy_reads(self.device),
                             read_in_step=self._step_graphs is not None and self.config.cache.read_in_step)
        self._read_stream = torch.cuda.Stream(self.device) if self.loader.read_in_step and self.config.cache.read_overlap \
            and getattr(model, "waits_for_edges", False) else None  # the step's reads, joined as the model takes them
        self.negatives = self.loader.negatives
        self._say(f"features: {self.loader.describe()}")
        self._shape_plan = self._load_shape_plan(graph) if self.device.type == "cuda" \
            and self.config.pipeline.shape_plans else None
        self.log_path = Path(log_path) if log_path else None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.epoch, self.history = 0, []
        self.test_metrics: dict = {}
        self.test_seconds = 0.0
        self._best_state: Optional[dict] = None  # weights and state of the best epoch (restore_best)

    @property
    def step_graphs(self):
        """The captured whole training steps (:class:`~fastopt.runtime.step_graph.StepGraphs`:
        ``captures``, ``replays``, ``disabled``), None where steps run eagerly."""
        return self._step_graphs

    def graph_captures(self) -> int:
        """CUDA-graph captures made so far: whole training steps and the optimized model's own
        (its modules' runners, as evaluation replays them)."""
        report = getattr(self.model, "fastopt_report", None)
        return ((self._step_graphs.captures if self._step_graphs is not None else 0)
                + sum(g.captures for g in getattr(report, "graphs", ())))

    def _load_shape_plan(self, graph: TemporalGraph):
        """Seed the padded lengths that shape a captured step (the loader's and the sampler's) from
        an earlier run's (:class:`~fastopt.runtime.shape_plans.ShapePlan`)."""
        from fastopt.codegen.cache import default_cache_dir
        from fastopt.runtime.shape_plans import ShapePlan, plan_key

        s, sampler = self.config.sampler, self.sampler
        key = plan_key(graph.src, graph.dst, graph.ts, fanouts=list(getattr(self.model, "fanouts", [])),
                       strategy=getattr(self.model, "strategy", "recent"), undirected=s.undirected,
                       dedup=s.dedup, hop_dedup=bool(getattr(sampler, "hop_dedup", False)),
                       batch_size=self.config.train.batch_size)
        found = {"loader": self.loader.high_water, "sampler": getattr(sampler, "high_water", None)}
        return ShapePlan(default_cache_dir() / "plans", key, {n: hw for n, hw in found.items() if hw is not None})

    def _save_shape_plan(self) -> None:
        if self._shape_plan is not None:
            self._shape_plan.save()

    def plan_shapes(self, split: str = "train", epoch: int = 0, hot_sets: bool = False) -> bool:
        """Raise the padded lengths to those a whole pass over ``split`` reaches, by sampling its
        batches without training (no features read, no step), and save them: the steps that
        follow pad to their final lengths from the first batch, as a steady epoch's do, and
        capture one step per batch size rather than one each time a length grows. ``hot_sets``:
        a pass over the next epoch's draws counts the uses of the edge rows read zero-copy: the
        epoch reads through hot sets planned, as a steady epoch's are, from another epoch's uses
        (:meth:`Loader.presample`), not an empty cache.
        Returns whether it sampled (not without shape plans to make nor zero-copy reads)."""
        plan = self._shape_plan
        shapes, hot_sets = plan is not None and not plan.found, hot_sets and self.loader.zero_copy and self.sampler is not None
        if shapes:
            self.loader.presample(split, epoch)
            plan.save()
            plan.found = True
        if hot_sets:  # another epoch's draws, as a steady epoch's are
            self.loader.presample(split, epoch + 1, reserve=False, foresee=True)
        return shapes or hot_sets

    # ----------------------------------------------------------------------------- inputs
    def build_inputs(self, roots: np.ndarray, times: np.ndarray) -> GraphInputs:
        """Everything the model needs for ``roots`` at ``times``, sampled and on the device."""
        return self.loader.inputs_for(roots, times)

    def plan(self, split: str, epoch: int, mrr_negatives: int = 0):
        """The batches of ``split`` in chronological order, with their negatives (not yet sampled)."""
        return self.loader.plan(split, epoch, mrr_negatives)

    # ----------------------------------------------------------------------------- training
    def fit(self, epochs: Optional[int] = None, *, resume: Optional[Union[str, os.PathLike]] = None,
            on_epoch: Optional[Callable[[dict], None]] = None) -> list:
        """Train for ``epochs`` (default ``config.train.epochs``), evaluating on validation after
        each epoch and on test at the end. ``resume`` continues from a checkpoint file;
        ``on_epoch`` receives each epoch's record (loss, seconds, stage times, validation metrics,
        ``val_seconds``). With ``config.train.patience`` training stops once validation AP has not
        improved for that many epochs; with ``config.train.restore_best`` the test runs on the
        weights and state of the epoch with the best validation AP (:attr:`best_epoch`). The
        test's duration is :attr:`test_seconds`."""
        for _ in self.fit_epochs(epochs, resume=resume, on_epoch=on_epoch):
            pass
        return self.history

    def fit_epochs(self, epochs: Optional[int] = None, *, resume: Optional[Union[str, os.PathLike]] = None,
                   on_epoch: Optional[Callable[[dict], None]] = None) -> Iterator[dict]:
        """:meth:`fit` an epoch per step (each epoch's record; the test once exhausted), so that
        trainers' epochs can take turns (``fastopt bench --interleave``)."""
        tc = self.config.train
        epochs = tc.epochs if epochs is None else int(epochs)
        if epochs < 1:
            raise ConfigError(f"epochs must be >= 1 (got {epochs}); pass --epochs 10 or any positive integer")
        if resume is not None:
            self.load_checkpoint(resume)
            self._best_state = self._read_best(Path(resume).with_name(BEST_FILE))
        else:
            torch.manual_seed(tc.seed)
        self._log(self._run_record(resume))
        while self.epoch < epochs and not self._patience_spent():
            stats = self.train_epoch(self.epoch)
            t0, captured = time.perf_counter(), self.graph_captures()
            stats.val = self.evaluate("val")
            record = _as_dict(stats)
            record["val_seconds"] = time.perf_counter() - t0
            record["val_captures"] = self.graph_captures() - captured
            self.history.append(record)
            self._log(record)
            self._say(format_epoch(record))
            if on_epoch is not None:
                on_epoch(record)
            self.epoch += 1
            self._keep_if_best()
            if self.checkpoint_dir is not None:
                self.save_checkpoint(self.checkpoint_dir / "checkpoint.pt")
            yield record
        best = self.best_epoch
        if self._patience_spent() and self.epoch < epochs:
            self._say(f"early stop after epoch {self.epoch - 1}: validation ap has not improved for "
                      f"{tc.patience} epoch(s) (best: epoch {best})")
        if tc.restore_best and best is not None and best != self.epoch - 1:
            self.model.load_state_dict(self._best_state)
            self._say(f"restored epoch {best} (validation ap={self.history[best]['val']['ap']:.4f})")
        t0 = time.perf_counter()
        self.test_metrics = self.evaluate("test", mrr_negatives=tc.mrr_negatives)
        self.test_seconds = time.perf_counter() - t0
        self._log({"test": self.test_metrics, "test_seconds": self.test_seconds, "best_epoch": best,
                   "tested_epoch": best if tc.restore_best else self.epoch - 1})
        self._say("test: " + "  ".join(f"{k}={v:.4f}" for k, v in self.test_metrics.items())
                  + f"  ({self.test_seconds:.1f}s)")

    @property
    def best_epoch(self) -> Optional[int]:
        """The epoch with the highest validation AP so far (the first of equals), or None."""
        aps = [h["val"].get("ap", float("nan")) for h in self.history]
        if not aps or all(ap != ap for ap in aps):
            return None
        return int(np.nanargmax(aps))

    def _patience_spent(self) -> bool:
        patience, best = self.config.train.patience, self.best_epoch
        return patience > 0 and best is not None and len(self.history) - 1 - best >= patience

    def _keep_if_best(self) -> None:
        """With ``restore_best``, copy the weights and state of a new best epoch (host memory, and
        ``best.pt`` beside the checkpoint so a resumed run can restore it too)."""
        if not self.config.train.restore_best or self.best_epoch != self.epoch - 1:
            return
        self._best_state = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        if self.checkpoint_dir is not None:
            write_checkpoint(self.checkpoint_dir / BEST_FILE,
                             {"epoch": self.epoch - 1, "model": self._best_state})

    def _read_best(self, path: Path) -> Optional[dict]:
        """The best epoch's weights saved beside a checkpoint being resumed, when they are needed."""
        best = self.best_epoch
        if not self.config.train.restore_best or best is None or best == self.epoch - 1:
            return None
        saved = torch.load(path, map_location="cpu", weights_only=True) if path.exists() else None
        if saved is None or saved.get("epoch") != best:
            raise FastOptError(
                f"restore_best needs the weights of epoch {best} (the best validation ap), but "
                f"{str(path)!r} {'holds another epoch' if saved else 'does not exist'}; resume a run "
                f"that was written with restore_best on, or resume without it (--restore-best)")
        return saved["model"]

    def _run_record(self, resume) -> dict:
        """What the log keeps about the run: when, how, with what."""
        from fastopt import __version__
        from fastopt.benchmark import command_line, git_commit, timestamp

        return {"start": timestamp(), "command": command_line(), "seed": self.config.train.seed,
                "model": type(getattr(self.model, "_orig_mod", self.model)).__name__,
                "dataset": self.graph.name, "events": self.graph.num_events, "device": str(self.device),
                "resume": None if resume is None else str(resume), "fastopt": __version__,
                "tuned": self.tuned.summary() if self.tuned else None,
                "torch": torch.__version__, "git_commit": git_commit(), "config": self.config.to_dict()}

    def _say(self, line: str) -> None:
        if self.progress:
            print(line, flush=True)

    def train_steps(self, epoch: int = 0) -> Iterator[torch.Tensor]:
        """The training steps of ``epoch`` one at a time, yielding each step's loss (left on the
        device): a window of the training loop for a caller that times steps (the tuner).
        Closing the generator early stops the loader's threads."""
        timer = self._begin_epoch(epoch)
        with self.loader.epoch("train", epoch, timer=timer) as batches:
            for batch in batches:
                yield self._step(batch, timer, train=True)

    def _begin_epoch(self, epoch: int) -> StageTimer:
        self.model.train()
        self.model.reset_state()
        if self.sampler is not None:
            self.sampler.reset(epoch)
        return StageTimer(self.device)

    @_memory_advice("the training step")
    def train_epoch(self, epoch: int) -> EpochStats:
        """One pass over the training events in chronological batches."""
        timer = self._begin_epoch(epoch)
        split = self.graph.split_range("train")
        total_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        moved, captured = self.loader.bytes_moved(), self.graph_captures()
        t0 = time.perf_counter()
        with self.loader.epoch("train", epoch, timer=timer) as batches:
            bar = progress_bar(batches, f"epoch {epoch}", self.progress, total=self.loader.num_batches("train"))
            for batch in bar:
                loss = self._step(batch, timer, train=True)
                total_loss += loss.double() * batch.size
                if not getattr(bar, "disable", True) and batch.index % 25 == 0:
                    elapsed = time.perf_counter() - t0  # reading the loss waits for the device: rarely
                    bar.set_postfix(loss=f"{float(loss):.4f}",
                                    ev_s=f"{(batch.stop - split.start) / max(elapsed, 1e-9):,.0f}")
        mean_loss = float(total_loss)  # the epoch's one wait for the device
        self._save_shape_plan()
        seconds = time.perf_counter() - t0
        n = split.stop - split.start
        return EpochStats(epoch, mean_loss / max(n, 1), seconds, n / seconds, timer.totals(),
                          bytes_h2d=self.loader.bytes_moved() - moved, captures=self.graph_captures() - captured)

    def _step(self, batch: EventBatch, timer: StageTimer, train: bool):
        """One batch: a training step (returns the loss) or an evaluation (returns the scores)."""
        if train and self._step_graphs is not None:  # rows left to read (batch.reads): read in the step
            tensors, spec = flatten((batch.inputs, batch.event_feat, batch.reads))
            with timer("step"):
                return self._step_graphs(tensors, constant=(batch.size, spec))
        model, inputs, b = self.model, batch.read().inputs, batch.size
        with timer("forward"):
            loss, pos, negs, extra = self._scores(inputs, b, batch.extra)
        if train:
            with timer("backward"):
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
        with timer("update"):
            roots, ts = inputs.nodes[0], inputs.times[0]
            model.commit(roots[:b], roots[b : 2 * b], ts[:b], batch.event_feat)
        if train:
            return loss.detach()
        return pos.detach(), negs.detach(), None if extra is None else extra.detach()

    def _scores(self, inputs: GraphInputs, b: int, extra_neg: Optional[np.ndarray]):
        """Embed, score positives and negatives, BCE loss (and evaluation negatives' scores)."""
        model = self.model
        # the module call, not .embed(): an optimized model's CUDA graphs wrap its forward
        h = model(inputs)
        h_src = h[:b]
        pos = model.score(h_src, h[b : 2 * b])
        negs = model.score(h_src, h[2 * b : 3 * b])
        loss = F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos)) + \
            F.binary_cross_entropy_with_logits(negs, torch.zeros_like(negs))
        extra = None
        if extra_neg is not None:
            n_extra = extra_neg.shape[1]
            h_extra = h[3 * b :].view(b, n_extra, -1)
            extra = model.score(h_src.unsqueeze(1).expand(-1, n_extra, -1), h_extra)
        return loss, pos, negs, extra

    def _whole_step(self, tensors: List[torch.Tensor], b: int, spec: tuple) -> torch.Tensor:
        """One training batch's reads, forward, loss, backward, update and write-back (StepGraphs captures it)."""
        inputs, event_feat, reads = unflatten(spec, tensors)
        if reads is not None:  # SlimCache's zero-copy reads, inside the captured step
            inputs, event_feat = reads.apply(inputs, event_feat, self._read_stream)
        try:
            loss, _, _, _ = self._scores(inputs, b, None)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        finally:  # the events' rows (and any the model left) are read; a capture's fork joined as it raises
            inputs.edges_ready()
        roots, ts = inputs.nodes[0], inputs.times[0]
        self.model.commit(roots[:b], roots[b : 2 * b], ts[:b], event_feat)
        return loss.detach()

    # ----------------------------------------------------------------------------- evaluation
    @_memory_advice("evaluation")
    @torch.no_grad()
    def evaluate(self, split: str, mrr_negatives: int = 0) -> dict:
        """AP and AUC (all events and the inductive subset) and, with negatives, MRR on ``split``.

        The model's memory continues from wherever it is (after training for ``"val"``, after
        validation for ``"test"``), as in chronological evaluation.
        """
        model = self.model
        model.eval()
        pos_all, neg_all, extra_all = [], [], []
        timer = StageTimer(self.device)
        with self.loader.epoch(split, self.epoch, mrr_negatives, timer=timer) as batches:
            for batch in progress_bar(batches, f"eval {split}", self.progress, total=self.loader.num_batches(split)):
                pos, negs, ext = self._step(batch, timer, train=False)
                pos_all.append(pos)
                neg_all.append(negs)
                if ext is not None:
                    extra_all.append(ext)
        pos, negs = torch.cat(pos_all).cpu().numpy(), torch.cat(neg_all).cpu().numpy()
        labels = np.r_[np.ones_like(pos), np.zeros_like(negs)]
        scores = np.r_[pos, negs]
        out = {"ap": average_precision(labels, scores), "auc": roc_auc(labels, scores)}
        ind = self.graph.inductive_mask(split)
        if ind.any():
            mask = np.r_[ind, ind]
            out["ap_inductive"] = average_precision(labels[mask], scores[mask])
            out["auc_inductive"] = roc_auc(labels[mask], scores[mask])
        if extra_all:
            out["mrr"] = mrr(pos, torch.cat(extra_all).cpu().numpy())
        return out

    # ----------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: Union[str, os.PathLike]) -> None:
        """Everything needed to continue bit-identically: weights, state, optimizer, RNG, history.

        The file holds only tensors, numbers, strings, lists and dicts, so that
        :meth:`load_checkpoint` reads it with ``torch.load(weights_only=True)``. It is written to a
        temporary file in the same folder, flushed to disk, then renamed over ``path``: a process
        killed while writing leaves the previous checkpoint whole.
        """
        state = {
            "epoch": self.epoch,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **random_state(),
            "history": plain(self.history),
            "config": plain(self.config.to_dict()),
        }
        write_checkpoint(path, state)

    def load_checkpoint(self, path: Union[str, os.PathLike]) -> None:
        """Continue from a file written by :meth:`save_checkpoint`.

        The file is read with ``torch.load(weights_only=True)``: a pickle that would build any
        other object (and so could run code) is refused, never executed.

        Raises:
            FastOptError: the file is missing, damaged, not a fastopt checkpoint, or needs more
                than tensors, numbers, strings, lists and dicts to load.
        """
        path = Path(path)
        if not path.exists():
            raise FastOptError(f"checkpoint {str(path)!r} does not exist; pass the checkpoint.pt "
                               f"written by an earlier run (--checkpoint-dir)")
        state = read_checkpoint(path, map_location=self.device)
        load_model_state(self.model, state["model"], f"checkpoint {str(path)!r}")
        self.optimizer.load_state_dict(state["optimizer"])
        set_random_state(state)
        self.epoch = int(state["epoch"])
        self.history = list(state["history"])

    def _log(self, record: dict) -> None:
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "a") as f:
                f.write(json.dumps(record, default=float) + "\n")


def random_state() -> dict:
    """The state of torch's default generators that training draws from (dropout, ...): the CPU's
    and every CUDA device's (``torch_rng``, ``cuda_rng``), as a checkpoint keeps them."""
    return {"torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_random_state(state: dict) -> None:
    """Restore what :func:`random_state` returned (the CUDA part where this process has CUDA)."""
    torch.set_rng_state(state["torch_rng"].cpu())
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda_rng"]])


def _as_dict(stats: EpochStats) -> dict:
    return {"epoch": stats.epoch, "loss": stats.loss, "seconds": stats.seconds,
            "events_per_s": stats.events_per_s, "stages": stats.stages, "bytes_h2d": stats.bytes_h2d,
            "captures": stats.captures, "val": stats.val}


def format_epoch(record: dict) -> str:
    """One line per epoch: loss, time, events/s, the stages that took time, validation."""
    st = record["stages"]
    # a stage the step never waited on (sampling running ahead on its thread) shows no 0.0s
    stages = " ".join(f"{k}={st[k]:.1f}s" for k in STAGES if st.get(k, 0.0) >= 0.05)
    val = record["val"]
    return (f"epoch {record['epoch']:>3}  loss={record['loss']:.4f}  {record['seconds']:.1f}s "
            f"({record['events_per_s']:,.0f} ev/s{'; ' + stages if stages else ''})  val ap={val['ap']:.4f} "
            f"auc={val['auc']:.4f} ({record.get('val_seconds', 0.0):.1f}s)")
