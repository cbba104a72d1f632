"""Chronological link-prediction training and evaluation of a TGNN.

One step: draw negatives, sample neighbors of every root (sources, destinations, negatives),
gather features onto the device, embed, score, BCE loss, backward, optimizer step, then write
back the model's memory and mailbox (after the step, so no event sees its own batch).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from fastopt.config import Config, default_config
from fastopt.data import TemporalGraph
from fastopt.errors import ConfigError, FastOptError
from fastopt.metrics import average_precision, mrr, roc_auc
from fastopt.models.base import GraphInputs, TGNNModel

__all__ = ["Trainer", "EventBatch", "resolve_device", "make_sampler", "NegativeSampler"]

STAGES = ("sample", "gather", "forward", "backward", "update")
_SPLIT_IDS = {"train": 0, "val": 1, "test": 2}


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


def make_sampler(graph: TemporalGraph, fanouts, strategy: str, config: Config):
    """The fastest available sampler: the compiled one when built, else the NumPy reference."""
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
                               pin_threads=s.pin_threads)
    from fastopt.sampling import NumpySampler

    return NumpySampler(graph, fanouts, strategy, seed=config.train.seed, undirected=config.sampler.undirected)


class NegativeSampler:
    """Uniform negative destinations, a pure function of (seed, epoch, split, batch index).

    Drawing per batch from its own key keeps negatives identical across resumes and orderings.
    """

    def __init__(self, pool: np.ndarray, seed: int) -> None:
        self.pool = np.asarray(pool, dtype=np.int64)
        self.seed = seed

    def draw(self, n: int, epoch: int, split: str, batch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch, _SPLIT_IDS[split], batch])
        return self.pool[rng.integers(0, self.pool.size, size=n)]


@dataclass
class EpochStats:
    epoch: int
    loss: float = 0.0
    seconds: float = 0.0
    events_per_s: float = 0.0
    stages: dict = field(default_factory=dict)
    val: dict = field(default_factory=dict)


@dataclass
class EventBatch:
    """One chronological batch: its positive events, negatives, roots and (once sampled) neighbors.

    Roots are ``[src, dst, neg, extra.ravel()]`` at the events' times; ``extra`` holds the MRR
    negatives ``[B, n]`` of an evaluation batch.
    """

    index: int
    start: int
    stop: int
    src: np.ndarray
    dst: np.ndarray
    ts: np.ndarray
    neg: np.ndarray
    extra: Optional[np.ndarray] = None
    sampled: Optional[object] = None

    @property
    def roots(self) -> np.ndarray:
        parts = [self.src, self.dst, self.neg] + ([self.extra.reshape(-1)] if self.extra is not None else [])
        return np.concatenate(parts)

    @property
    def times(self) -> np.ndarray:
        copies = 3 + (self.extra.shape[1] if self.extra is not None else 0)
        return np.tile(self.ts, copies)


class Trainer:
    """Train a TGNN for link prediction on a temporal graph.

    Args:
        model: a :class:`~fastopt.models.TGNNModel` (or what :func:`fastopt.optimize` returned).
        graph: the event stream with its chronological split.
        config: ``"auto"`` (defaults and ``FASTOPT_*`` overrides), a :class:`Config`, or a dict.
        log_path: JSON-lines file receiving one record per epoch and the final test metrics.
        checkpoint_dir: where ``checkpoint.pt`` is written after every epoch.
        progress: show a progress bar.
    """

    def __init__(self, model: TGNNModel, graph: TemporalGraph, config: Union[str, Config, dict, None] = "auto",
                 *, log_path: Optional[Union[str, os.PathLike]] = None,
                 checkpoint_dir: Optional[Union[str, os.PathLike]] = None, progress: bool = True) -> None:
        self.config = _resolve_config(config)
        self.graph = graph
        tc = self.config.train
        self.device = resolve_device(tc.device)
        self.model = model.to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=tc.lr)
        self.sampler = make_sampler(graph, list(getattr(model, "fanouts", [])),
                                    getattr(model, "strategy", "recent"), self.config)
        self.negatives = NegativeSampler(graph.destination_pool(), tc.seed)
        self.log_path = Path(log_path) if log_path else None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.progress = progress
        self.epoch = 0
        self.history: list = []
        self.test_metrics: dict = {}
        dev = self.device
        self._node_feat = torch.from_numpy(graph.node_feat).to(dev) if graph.node_feat is not None else None
        self._edge_feat = torch.from_numpy(graph.edge_feat).to(dev) if graph.edge_feat is not None else None

    # ----------------------------------------------------------------------------- gathering
    def _feat(self, table: Optional[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        if table is None:
            return torch.zeros(*ids.shape, 0, device=self.device)
        return table[ids.to(self.device).clamp(min=0)]

    def build_inputs(self, roots: np.ndarray, times: np.ndarray, timer=None, sampled=None) -> GraphInputs:
        """Gather everything the model needs for ``roots`` at ``times`` (sampling them first unless
        ``sampled`` holds their neighborhoods already)."""
        timer = timer or _Timer(self.device)
        dev = self.device
        batch = sampled
        if batch is None and self.sampler is not None:
            with timer("sample"):
                batch = self.sampler.sample(roots, times)
        with timer("gather"):
            roots_t = torch.from_numpy(roots).to(dev)
            nodes, ntimes = [roots_t], [torch.from_numpy(times).to(dev)]
            edge_feat, dt, mask = [], [], []
            for block in batch.blocks if batch is not None else []:
                nodes.append(block.nbr_nodes.reshape(-1).to(dev, non_blocking=True))
                ntimes.append(block.nbr_times.reshape(-1).to(dev, non_blocking=True))
                edge_feat.append(self._feat(self._edge_feat, block.nbr_eids))
                dt.append(block.dt.to(dev, non_blocking=True))
                mask.append(block.mask.to(dev, non_blocking=True))
            node_feat = [self._feat(self._node_feat, n) for n in nodes]
        return GraphInputs(nodes, ntimes, node_feat, edge_feat, dt, mask)

    def plan(self, split: str, epoch: int, mrr_negatives: int = 0) -> Iterator[EventBatch]:
        """The batches of ``split`` in chronological order, with their negatives (not yet sampled)."""
        g, size = self.graph, self.config.train.batch_size
        r = g.split_range(split)
        for b, start in enumerate(range(r.start, r.stop, size)):
            stop = min(start + size, r.stop)
            n = stop - start
            extra = None
            if mrr_negatives:
                extra = self.negatives.draw(n * mrr_negatives, epoch, split, b + 1_000_000).reshape(n, mrr_negatives)
            yield EventBatch(b, start, stop, g.src[start:stop], g.dst[start:stop], g.ts[start:stop],
                             self.negatives.draw(n, epoch, split, b), extra)

    def _sampled(self, batches: Iterator[EventBatch], timer) -> Iterator[EventBatch]:
        """``batches`` with their neighborhoods sampled.

        With ``pipeline.async_sampling`` a background thread samples up to
        ``pipeline.prefetch_depth`` batches ahead of the one being trained (neighborhoods never
        depend on training state, and the compiled sampler runs without the GIL); the time the
        training loop still waits for a batch is charged to the ``sample`` stage.
        """
        pipe = self.config.pipeline
        if self.sampler is None:
            yield from batches
            return
        if not pipe.async_sampling or pipe.prefetch_depth == 0:
            for batch in batches:
                with timer("sample"):
                    batch.sampled = self.sampler.sample(batch.roots, batch.times)
                yield batch
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastopt-sampler") as pool:
            ahead = deque()
            for batch in batches:
                ahead.append((batch, pool.submit(self.sampler.sample, batch.roots, batch.times)))
                if len(ahead) > pipe.prefetch_depth:
                    yield _collect(ahead.popleft(), timer)
            while ahead:
                yield _collect(ahead.popleft(), timer)

    # ----------------------------------------------------------------------------- training
    def fit(self, epochs: Optional[int] = None, *, resume: Optional[Union[str, os.PathLike]] = None,
            on_epoch: Optional[Callable[[dict], None]] = None) -> list:
        """Train for ``epochs`` (default ``config.train.epochs``), evaluating on validation after
        each epoch and on test at the end. ``resume`` continues from a checkpoint file;
        ``on_epoch`` receives each epoch's record (loss, seconds, stage times, validation)."""
        epochs = self.config.train.epochs if epochs is None else int(epochs)
        if epochs < 1:
            raise ConfigError(f"epochs must be >= 1 (got {epochs}); pass --epochs 10 or any positive integer")
        if resume is not None:
            self.load_checkpoint(resume)
        else:
            torch.manual_seed(self.config.train.seed)
        while self.epoch < epochs:
            stats = self.train_epoch(self.epoch)
            stats.val = self.evaluate("val")
            record = _as_dict(stats)
            self.history.append(record)
            self._log(record)
            if on_epoch is not None:
                on_epoch(record)
            self.epoch += 1
            if self.checkpoint_dir is not None:
                self.save_checkpoint(self.checkpoint_dir / "checkpoint.pt")
        self.test_metrics = self.evaluate("test", mrr_negatives=self.config.train.mrr_negatives)
        self._log({"test": self.test_metrics})
        return self.history

    def train_epoch(self, epoch: int) -> EpochStats:
        """One pass over the training events in chronological batches."""
        model, cfg = self.model, self.config.train
        model.train()
        model.reset_state()
        if self.sampler is not None:
            self.sampler.reset(epoch)
        timer = _Timer(self.device)
        split = self.graph.split_range("train")
        total_loss, t0 = 0.0, time.perf_counter()
        bar = _progress(self._sampled(self.plan("train", epoch), timer), f"epoch {epoch}", self.progress,
                        total=-(-(split.stop - split.start) // cfg.batch_size))
        for batch in bar:
            loss = self._step(batch, timer, train=True)
            total_loss += loss * (batch.stop - batch.start)
            if self.progress and batch.index % 10 == 0:
                elapsed = time.perf_counter() - t0
                bar.set_postfix(loss=f"{loss:.4f}", ev_s=f"{(batch.stop - split.start) / max(elapsed, 1e-9):,.0f}")
        seconds = time.perf_counter() - t0
        n = split.stop - split.start
        return EpochStats(epoch, total_loss / max(n, 1), seconds, n / seconds, dict(timer.totals))

    def _step(self, batch: EventBatch, timer, train: bool):
        model, dev = self.model, self.device
        b, extra_neg = batch.src.shape[0], batch.extra
        inputs = self.build_inputs(batch.roots, batch.times, timer, sampled=batch.sampled)
        with timer("forward"):
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
        if train:
            with timer("backward"):
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
        with timer("update"):
            eids = torch.arange(batch.start, batch.stop, device=dev)
            efeat = self._feat(self._edge_feat, eids)
            model.commit(torch.from_numpy(batch.src).to(dev), torch.from_numpy(batch.dst).to(dev),
                         torch.from_numpy(batch.ts).to(dev), efeat)
        if train:
            return float(loss.detach())
        return pos.detach().cpu().numpy(), negs.detach().cpu().numpy(), None if extra is None else extra.cpu().numpy()

    # ----------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, split: str, mrr_negatives: int = 0) -> dict:
        """AP and AUC (all events and the inductive subset) and, with negatives, MRR on ``split``.

        The model's memory continues from wherever it is (after training for ``"val"``, after
        validation for ``"test"``), as in chronological evaluation.
        """
        model, cfg = self.model, self.config.train
        model.eval()
        rng_split = self.graph.split_range(split)
        pos_all, neg_all, extra_all = [], [], []
        timer = _Timer(self.device)
        batches = self._sampled(self.plan(split, self.epoch, mrr_negatives), timer)
        for batch in _progress(batches, f"eval {split}", self.progress,
                               total=-(-(rng_split.stop - rng_split.start) // cfg.batch_size)):
            pos, negs, ext = self._step(batch, timer, train=False)
            pos_all.append(pos)
            neg_all.append(negs)
            if ext is not None:
                extra_all.append(ext)
        pos, negs = np.concatenate(pos_all), np.concatenate(neg_all)
        labels = np.r_[np.ones_like(pos), np.zeros_like(negs)]
        scores = np.r_[pos, negs]
        out = {"ap": average_precision(labels, scores), "auc": roc_auc(labels, scores)}
        ind = self.graph.inductive_mask(split)
        if ind.any():
            mask = np.r_[ind, ind]
            out["ap_inductive"] = average_precision(labels[mask], scores[mask])
            out["auc_inductive"] = roc_auc(labels[mask], scores[mask])
        if extra_all:
            out["mrr"] = mrr(pos, np.concatenate(extra_all))
        return out

    # ----------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: Union[str, os.PathLike]) -> None:
        """Everything needed to continue bit-identically: weights, state, optimizer, RNG, history."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "epoch": self.epoch,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "history": self.history,
            "config": self.config.to_dict(),
        }
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)

    def load_checkpoint(self, path: Union[str, os.PathLike]) -> None:
        path = Path(path)
        if not path.exists():
            raise FastOptError(f"checkpoint {str(path)!r} does not exist; pass the checkpoint.pt "
                               f"written by an earlier run (--checkpoint-dir)")
        state = torch.load(path, map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self.epoch = int(state["epoch"])
        self.history = list(state["history"])

    def _log(self, record: dict) -> None:
        if self.log_path is None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as f:
            f.write(json.dumps(record, default=float) + "\n")


def _resolve_config(config) -> Config:
    if config is None or config == "auto":
        return default_config().copy()
    if isinstance(config, Config):
        config.validate()
        return config
    if isinstance(config, dict):
        return Config.from_dict(config)
    raise ConfigError(f"config must be 'auto', a fastopt.Config or a dict (got {type(config).__name__})")


def _as_dict(stats: EpochStats) -> dict:
    return {"epoch": stats.epoch, "loss": stats.loss, "seconds": stats.seconds,
            "events_per_s": stats.events_per_s, "stages": stats.stages, "val": stats.val}


def _progress(iterable, desc: str, enabled: bool, total: Optional[int] = None):
    if not enabled:
        return _Quiet(iterable)
    from tqdm.auto import tqdm

    # disable=None: bars on a terminal only, so logs and pipes get the per-epoch lines alone
    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True, disable=None)


def _collect(pending, timer) -> EventBatch:
    """Wait for a prefetched batch's neighborhoods; the wait is what sampling still costs."""
    batch, future = pending
    with timer("sample"):
        batch.sampled = future.result()
    return batch


class _Quiet:
    def __init__(self, iterable) -> None:
        self._it = iterable

    def __iter__(self):
        return iter(self._it)

    def set_postfix(self, **kwargs) -> None:
        pass


class _Timer:
    """Accumulates wall time per stage; synchronizes CUDA so GPU work is charged to its stage."""

    def __init__(self, device: torch.device) -> None:
        self.totals = defaultdict(float)
        self._sync = device.type == "cuda"

    def __call__(self, stage: str):
        return _Stage(self, stage)


class _Stage:
    def __init__(self, timer: _Timer, stage: str) -> None:
        self.timer, self.stage = timer, stage

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.timer._sync:
            torch.cuda.synchronize()
        self.timer.totals[self.stage] += time.perf_counter() - self.t0
        return False
