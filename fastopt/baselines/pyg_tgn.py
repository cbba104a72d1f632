"""PyTorch Geometric's TGN, trained the way PyG users run it today, as a baseline for fastopt.

This module reproduces the structure of PyG's ``examples/tgn.py`` so that PyG and fastopt can be
compared side by side on one :class:`~fastopt.data.TemporalGraph` in one process:

* memory: ``torch_geometric.nn.TGNMemory`` with ``IdentityMessage`` and ``LastAggregator``;
* neighbors: PyG's ``LastNeighborLoader`` keeping each node's most recent
  ``neighbors`` interactions;
* embedding: one ``torch_geometric.nn.TransformerConv`` (2 heads, dropout 0.1) whose edge
  attributes are the cosine encoding of ``last_update[neighbor] - t_edge`` (the memory's own time
  encoder) concatenated with the edge's features;
* decoder: a two-branch MLP link predictor; loss: BCE with logits, one negative per positive;
  optimizer: Adam with learning rate 1e-4;
* the whole event stream is moved to the device once; batches are chronological; every epoch
  resets the memory and the neighbor loader, trains over the training split (memory update and
  neighbor insert after each batch, ``memory.detach()`` after the optimizer step), then evaluates
  on validation and then test, continuing the memory and neighbor state in time order.

Negatives follow fastopt's trainer: destinations drawn uniformly from
``graph.destination_pool()`` with ``np.random.default_rng([seed, epoch, split_id, batch_index])``
(split ids: train 0, val 1, test 2; batch indices count from 0 within each split; the evaluation
after epoch ``e`` uses key ``e``), so both systems draw negatives the same way. AP and AUC pool all
positives of a split against their negatives (:func:`fastopt.metrics.average_precision`,
:func:`fastopt.metrics.roc_auc`), as fastopt's trainer does.

``run_pyg_tgn(..., modules=fastopt.optimize)`` hands the memory and the embedding module to a
function (``fastopt.optimize``) and trains what it returns, nothing else changed;
:func:`verify_modules` checks such a function against the unmodified example on real batches.

``torch_geometric`` is optional: it is imported when :func:`run_pyg_tgn` is called, and a missing
install raises :class:`~fastopt.errors.FastOptError` naming ``pip install "fastopt[pyg]"``.
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from fastopt.errors import ConfigError, DataError, FastOptError
from fastopt.metrics import average_precision, roc_auc

if TYPE_CHECKING:
    from fastopt.data import TemporalGraph

__all__ = ["run_pyg_tgn", "verify_modules", "difference"]

LEARNING_RATE = 1e-4
"""Adam's learning rate in PyG's example."""
ATTENTION_HEADS = 2
ATTENTION_DROPOUT = 0.1
_SPLIT_IDS = {"train": 0, "val": 1, "test": 2}


def run_pyg_tgn(graph, *, batch_size: int = 600, epochs: int = 1, device="cpu", seed: int = 0,
                memory_dim: int = 100, time_dim: int = 100, embedding_dim: int = 100,
                neighbors: int = 10, progress: bool = False,
                modules: Optional[Callable[[nn.Module], nn.Module]] = None,
                perturb: float = 0.0) -> dict:
    """Train PyG's TGN on ``graph`` for ``epochs`` and evaluate after each epoch.

    Args:
        graph: a :class:`fastopt.data.TemporalGraph`; its edge features are the raw messages
            (a graph without edge features gets one all-zero message column, see below).
        batch_size: events per chronological batch.
        epochs: training epochs; each one starts from a fresh memory and neighbor loader.
        device: torch device (``"cpu"``, ``"cuda"``, ``"cuda:1"``, or a ``torch.device``).
        seed: seeds torch (parameter init, dropout) and keys the negative samples.
        memory_dim: width of the TGN node memory.
        time_dim: width of the cosine time encoding.
        embedding_dim: width of the attention embedding (even: split over 2 heads).
        neighbors: most recent interactions kept per node by ``LastNeighborLoader``.
        progress: show tqdm progress bars.
        modules: applied to the memory (``TGNMemory``) and to the embedding module (time
            encoding and ``TransformerConv``) once built; the model trains what it returns
            (``fastopt.optimize``: the optimized modules, sharing the parameters).
        perturb: scale every initial parameter by ``1 + perturb * N(0, 1)`` (in float64, then
            rounded back; zeros stay zero), drawn from a generator of its own (torch's stream,
            hence dropout and everything after, untouched): ``1e-7`` changes most parameters by
            about one float32 step, a control run of the example whose distance from the plain
            run is what rounding alone moves its results by (training amplifies such differences).

    Returns:
        ``{"epoch_seconds": [float], "loss": [float], "val": {"ap", "auc"}, "test": {"ap", "auc"},
        "h2d_bytes_per_epoch": int, "peak_device_bytes": int}``. ``epoch_seconds`` and ``loss``
        have one entry per training epoch (wall time of the training pass only; evaluation is not
        timed); ``val`` and ``test`` are from the last epoch. ``h2d_bytes_per_epoch`` counts what
        this code copies host to device during one training epoch (the negatives, drawn with
        NumPy; the event stream was moved once before training and is not counted); it is 0 on
        the CPU. ``peak_device_bytes`` is ``torch.cuda.max_memory_allocated`` over the run (0
        off CUDA).

    Note:
        PyG's ``TGNMemory`` cannot handle zero-width messages (its message store drops empty
        tensors before concatenating them), so a graph without edge features trains on one
        all-zero column, which adds no information. It also keeps each node's last-update time
        in an int64 buffer, so timestamps are passed as int64 (as in PyG's datasets) and
        fractional ones raise :class:`~fastopt.errors.DataError` asking to rescale them.
    """
    pyg = _import_pyg()
    _check_args(batch_size=batch_size, epochs=epochs, memory_dim=memory_dim, time_dim=time_dim,
                embedding_dim=embedding_dim, neighbors=neighbors)
    if isinstance(perturb, bool) or not isinstance(perturb, (int, float)) or not 0 <= perturb < 1:
        raise ConfigError(f"perturb must be a number in [0, 1) (got {perturb!r}); pass 1e-7 for a "
                          f"rounding-level control run, or 0")
    dev = torch.device(device)
    on_cuda = dev.type == "cuda"
    torch.manual_seed(seed)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(dev)

    stream = _EventStream.from_graph(graph, dev)
    model = _TGN(pyg, graph.num_nodes, stream.msg.size(1), memory_dim=memory_dim, time_dim=time_dim,
                 embedding_dim=embedding_dim, neighbors=neighbors, device=dev)
    if perturb:
        noise = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for param in model.parameters():  # in float64: 1 + 1e-7 n is not a float32 multiplier
                scale = 1 + perturb * torch.randn(param.shape, generator=noise, dtype=torch.float64)
                param.copy_((param.double() * scale.to(param.device)).to(param.dtype))
    if modules is not None:
        model.apply_to_modules(modules)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    criterion = nn.BCEWithLogitsLoss()
    negatives = _Negatives(graph.destination_pool(), seed)

    epoch_seconds: list[float] = []
    losses: list[float] = []
    h2d_bytes = 0
    val: dict = {}
    test: dict = {}
    for epoch in range(epochs):
        t0 = time.perf_counter()
        model.reset_state()
        model.train()
        total_loss, total_events, h2d_bytes = 0.0, 0, 0
        for b, start, stop in _progress(_batches(graph, "train", batch_size), progress,
                                        f"pyg-tgn epoch {epoch}"):
            neg = negatives.draw(stop - start, epoch, "train", b, dev)
            if dev.type != "cpu":
                h2d_bytes += neg.nbytes
            loss, _ = _train_step(model, optimizer, criterion, stream, start, stop, neg)
            total_loss += float(loss.detach()) * (stop - start)
            total_events += stop - start
        if on_cuda:
            torch.cuda.synchronize(dev)
        epoch_seconds.append(time.perf_counter() - t0)
        losses.append(total_loss / max(total_events, 1))
        val = _evaluate(model, stream, graph, "val", epoch, negatives, batch_size, progress)
        test = _evaluate(model, stream, graph, "test", epoch, negatives, batch_size, progress)

    return {
        "epoch_seconds": epoch_seconds,
        "test": test,
        "val": val,
        "h2d_bytes_per_epoch": int(h2d_bytes),
        "peak_device_bytes": int(torch.cuda.max_memory_allocated(dev)) if on_cuda else 0,
        "loss": losses,
    }


def _train_step(model: "_TGN", optimizer, criterion, stream: "_EventStream", start: int, stop: int,
                neg: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """One step of the example: score, loss, memory and neighbor update, backward, Adam."""
    optimizer.zero_grad()
    pos_out, neg_out = model.score(stream, start, stop, neg)
    loss = (criterion(pos_out, torch.ones_like(pos_out))
            + criterion(neg_out, torch.zeros_like(neg_out)))
    model.observe(stream, start, stop)
    loss.backward()
    optimizer.step()
    model.memory.detach()
    return loss, (pos_out, neg_out)


def verify_modules(graph, modules: Callable[[nn.Module], nn.Module], *, batch_size: int = 600,
                   steps: int = 5, device="cpu", seed: int = 0, **sizes: int) -> dict:
    """Train the example and its copy with ``modules`` applied side by side for ``steps`` batches.

    Both start from the same parameters and see the same batches and negatives, and each step
    starts the copy from the example's parameters and memory again (Adam's normalization would
    otherwise compound float-order differences of tiny gradients) and from the example's
    generator state, so that attention dropout draws the same masks in both (training mode, as
    in the example).
    After each step the logits, every parameter's gradient, the memory and its last-update
    times are compared (float32 tolerance: ``1e-5 + 1e-4 * |eager|``, gradients
    against ``1e-5 *`` their largest element).

    Returns:
        ``{"ok": bool, "steps": int, "largest": {"logits", "gradients", "memory"}: float,
        "first_mismatch": str or None}``.
    """
    pyg = _import_pyg()
    sizes = {**dict(memory_dim=100, time_dim=100, embedding_dim=100, neighbors=10), **sizes}
    _check_args(batch_size=batch_size, steps=steps, **sizes)
    dev = torch.device(device)
    torch.manual_seed(seed)
    stream = _EventStream.from_graph(graph, dev)
    eager = _TGN(pyg, graph.num_nodes, stream.msg.size(1), device=dev, **sizes)
    other = copy.deepcopy(eager)
    other.apply_to_modules(modules)
    negatives = _Negatives(graph.destination_pool(), seed)
    largest = {"logits": 0.0, "gradients": 0.0, "memory": 0.0}
    runs = []
    for model in (eager, other):
        model.reset_state()
        model.train()
        runs.append((model, torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)))
    criterion = nn.BCEWithLogitsLoss()
    with _deterministic():
        done, largest, mismatch = _compare_steps(graph, batch_size, steps, runs, criterion, stream,
                                                 negatives, dev, largest)
    return {"ok": mismatch is None, "steps": done, "largest": largest, "first_mismatch": mismatch}


def difference(got: Tensor, want: Tensor, gradient: bool = False) -> Tuple[float, float]:
    """``(largest absolute difference, its float32 bound)``: ``1e-5 + 1e-4 * max|want|``, and for
    a gradient ``1e-5 * max(max|want|, 1)`` in place of ``1e-5`` (a gradient's rounding scales
    with its largest element)."""
    got, want = got.detach().double(), want.detach().double()
    if not want.numel():
        return 0.0, 1e-5
    diff, top = float((got - want).abs().max()), float(want.abs().max())
    return diff, (1e-5 * max(top, 1.0) if gradient else 1e-5) + 1e-4 * top


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """Deterministic algorithms where torch has them (warnings, not errors, where it has none):
    on CUDA, PyG's ``LastAggregator`` picks among messages of equal time by an indexed write with
    repeated indices, which may land differently in two runs of the same batch otherwise."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*deterministic.*")
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _compare_steps(graph, batch_size, steps, runs, criterion, stream, negatives, dev, largest):
    """``verify_modules``' loop: ``(steps done, largest differences, first mismatch or None)``."""
    (eager, _), (other, _) = runs
    mismatch = None
    done = 0
    for b, start, stop in _batches(graph, "train", batch_size):
        if done == steps:
            break
        neg = negatives.draw(stop - start, 0, "train", b, dev)
        (model, opt), (copied, copied_opt) = runs
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            _, want = _train_step(model, opt, criterion, stream, start, stop, neg)
        _, got = _train_step(copied, copied_opt, criterion, stream, start, stop, neg)
        checks = [("logits", f"logits of batch {b}", g, w) for g, w in zip(got, want)]
        for (name, p), q in zip(eager.named_parameters(), other.parameters()):
            checks.append(("gradients", f"gradient of {name} at batch {b}", q.grad, p.grad))
        checks += [("memory", f"memory after batch {b}", other.memory.memory, eager.memory.memory),
                   ("memory", f"last_update after batch {b}", other.memory.last_update,
                    eager.memory.last_update)]
        for kind, what, g, w in checks:
            if (g is None) != (w is None):
                mismatch = mismatch or f"{what}: one side has none"
                continue
            if g is None:
                continue
            diff, bound = difference(g, w, gradient=kind == "gradients")
            largest[kind] = max(largest[kind], diff)
            if diff > bound and mismatch is None:
                mismatch = f"{what}: largest difference {diff:.3g} > {bound:.3g}"
        # the next step starts from the eager model's parameters and memory: float-order
        # differences in tiny gradients would otherwise compound through Adam's normalization
        other.load_state_dict(eager.state_dict())
        done += 1
    return done, largest, mismatch


# --------------------------------------------------------------------------------- PyG import
def _import_pyg() -> SimpleNamespace:
    """The PyG classes this baseline uses, or a FastOptError that says how to install them."""
    try:
        import torch_geometric  # noqa: F401  (the package itself first: a submodule may be cached)
        from torch_geometric.nn import TGNMemory, TransformerConv
        from torch_geometric.nn.models import tgn

        # torch_geometric.loader exported LastNeighborLoader in some releases; it lives in tgn
        LastNeighborLoader = getattr(tgn, "LastNeighborLoader", None)
        if LastNeighborLoader is None:
            from torch_geometric.loader import LastNeighborLoader
        IdentityMessage, LastAggregator = tgn.IdentityMessage, tgn.LastAggregator
    except ImportError as exc:
        raise FastOptError(
            f"the PyG TGN baseline needs torch_geometric, which cannot be imported ({exc}); "
            f'install it with `pip install "fastopt[pyg]"`'
        ) from None
    return SimpleNamespace(LastNeighborLoader=LastNeighborLoader, TGNMemory=TGNMemory,
                           TransformerConv=TransformerConv, IdentityMessage=IdentityMessage,
                           LastAggregator=LastAggregator)


def _check_args(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ConfigError(f"{name} must be a positive integer (got {value!r}); pass e.g. "
                              f"{name}=100")
    if values["embedding_dim"] % ATTENTION_HEADS:
        raise ConfigError(f"embedding_dim must be divisible by the {ATTENTION_HEADS} attention heads "
                          f"(got {values['embedding_dim']}); pass an even width such as 100")


# --------------------------------------------------------------------------------- data
@dataclass
class _EventStream:
    """The whole event stream on the device, indexed by event id (as PyG's ``TemporalData``)."""

    src: Tensor
    dst: Tensor
    t: Tensor
    msg: Tensor

    @classmethod
    def from_graph(cls, graph: TemporalGraph, device: torch.device) -> "_EventStream":
        ts = graph.ts
        fractional = np.floor(ts) != ts
        if fractional.any() or np.abs(ts).max() >= 2.0 ** 62:
            i = int(np.argmax(fractional)) if fractional.any() else int(np.argmax(np.abs(ts)))
            raise DataError(
                f"PyG's TGNMemory keeps times as int64, but event {i} has ts={float(ts[i])!r}; rescale "
                f"the timestamps to whole units first (e.g. np.round(graph.ts * 1000) for "
                f"milliseconds)"
            )
        t = torch.from_numpy(ts.astype(np.int64))
        if graph.edge_feat is not None:
            msg = torch.from_numpy(graph.edge_feat)
        else:
            msg = torch.zeros(graph.num_events, 1, dtype=torch.float32)
        return cls(torch.from_numpy(graph.src).to(device), torch.from_numpy(graph.dst).to(device),
                   t.to(device), msg.to(device))


class _Negatives:
    """Uniform destinations from the pool, keyed by (seed, epoch, split, batch) like fastopt's."""

    def __init__(self, pool: np.ndarray, seed: int) -> None:
        self.pool = np.asarray(pool, dtype=np.int64)
        self.seed = seed

    def draw(self, n: int, epoch: int, split: str, batch: int, device: torch.device) -> Tensor:
        rng = np.random.default_rng([self.seed, epoch, _SPLIT_IDS[split], batch])
        return torch.from_numpy(self.pool[rng.integers(0, self.pool.size, size=n)]).to(device)


def _batches(graph: TemporalGraph, split: str, batch_size: int) -> Iterator[tuple[int, int, int]]:
    """``(batch index, start, stop)`` of ``split`` in chronological order."""
    r = graph.split_range(split)
    for b, start in enumerate(range(r.start, r.stop, batch_size)):
        yield b, start, min(start + batch_size, r.stop)


def _progress(batches: Iterator, enabled: bool, desc: str) -> Iterable:
    if not enabled:
        return batches
    from tqdm.auto import tqdm

    return tqdm(list(batches), desc=desc, leave=False, dynamic_ncols=True)


# --------------------------------------------------------------------------------- model
class _AttentionEmbedding(nn.Module):
    """One graph-attention layer over the last-neighbor graph.

    Edge attributes are ``[time_enc(last_update[neighbor] - t_edge), msg_edge]``; the time encoder
    is the memory's, so both share its parameters.
    """

    def __init__(self, conv_cls: type, in_channels: int, out_channels: int, msg_dim: int,
                 time_enc: nn.Module) -> None:
        super().__init__()
        self.time_enc = time_enc
        self.conv = conv_cls(in_channels, out_channels // ATTENTION_HEADS, heads=ATTENTION_HEADS,
                             dropout=ATTENTION_DROPOUT, edge_dim=msg_dim + time_enc.out_channels)

    def forward(self, x: Tensor, last_update: Tensor, edge_index: Tensor, t: Tensor,
                msg: Tensor) -> Tensor:
        rel_t = last_update[edge_index[0]] - t
        edge_attr = torch.cat([self.time_enc(rel_t.to(x.dtype)), msg], dim=-1)
        return self.conv(x, edge_index, edge_attr)


class _LinkPredictor(nn.Module):
    """``w . relu(A z_src + B z_dst)``: a logit per (source, destination) pair."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.lin_src = nn.Linear(channels, channels)
        self.lin_dst = nn.Linear(channels, channels)
        self.lin_out = nn.Linear(channels, 1)

    def forward(self, z_src: Tensor, z_dst: Tensor) -> Tensor:
        return self.lin_out((self.lin_src(z_src) + self.lin_dst(z_dst)).relu())


class _TGN(nn.Module):
    """Memory, neighbor loader, embedding and link predictor, wired as in PyG's example."""

    def __init__(self, pyg: SimpleNamespace, num_nodes: int, msg_dim: int, *, memory_dim: int,
                 time_dim: int, embedding_dim: int, neighbors: int, device: torch.device) -> None:
        super().__init__()
        self.memory = pyg.TGNMemory(num_nodes, msg_dim, memory_dim, time_dim,
                                    message_module=pyg.IdentityMessage(msg_dim, memory_dim, time_dim),
                                    aggregator_module=pyg.LastAggregator())
        self.gnn = _AttentionEmbedding(pyg.TransformerConv, memory_dim, embedding_dim, msg_dim,
                                       self.memory.time_enc)
        self.link_pred = _LinkPredictor(embedding_dim)
        self.to(device)
        self.loader = pyg.LastNeighborLoader(num_nodes, size=neighbors, device=device)
        # global node id -> row of the batch's embedding matrix
        self._assoc = torch.empty(num_nodes, dtype=torch.long, device=device)

    def apply_to_modules(self, modules: Callable[[nn.Module], nn.Module]) -> None:
        """Swap the memory and the embedding module for ``modules(memory)`` and
        ``modules(gnn)`` (the embedding's time encoder stays the memory's)."""
        self.memory = modules(self.memory)
        self.gnn = modules(self.gnn)

    def reset_state(self) -> None:
        self.memory.reset_state()
        self.loader.reset_state()

    def score(self, stream: _EventStream, start: int, stop: int, neg_dst: Tensor) -> tuple[Tensor, Tensor]:
        """Logits of events ``start:stop`` and of the same sources paired with ``neg_dst``."""
        src, pos_dst = stream.src[start:stop], stream.dst[start:stop]
        n_id = torch.cat([src, pos_dst, neg_dst]).unique()
        n_id, edge_index, e_id = self.loader(n_id)
        self._assoc[n_id] = torch.arange(n_id.size(0), device=n_id.device)
        z, last_update = self.memory(n_id)
        z = self.gnn(z, last_update, edge_index, stream.t[e_id], stream.msg[e_id])
        z_src = z[self._assoc[src]]
        return (self.link_pred(z_src, z[self._assoc[pos_dst]]).view(-1),
                self.link_pred(z_src, z[self._assoc[neg_dst]]).view(-1))

    def observe(self, stream: _EventStream, start: int, stop: int) -> None:
        """Feed events ``start:stop`` to the memory and the neighbor loader."""
        src, dst = stream.src[start:stop], stream.dst[start:stop]
        self.memory.update_state(src, dst, stream.t[start:stop], stream.msg[start:stop])
        self.loader.insert(src, dst)


@torch.no_grad()
def _evaluate(model: _TGN, stream: _EventStream, graph: TemporalGraph, split: str, epoch: int,
              negatives: _Negatives, batch_size: int, progress: bool) -> dict:
    """AP and AUC of ``split``'s positives against one negative each, continuing the state."""
    model.eval()
    dev = stream.src.device
    pos_all: list[np.ndarray] = []
    neg_all: list[np.ndarray] = []
    for b, start, stop in _progress(_batches(graph, split, batch_size), progress, f"pyg-tgn {split}"):
        neg = negatives.draw(stop - start, epoch, split, b, dev)
        pos_out, neg_out = model.score(stream, start, stop, neg)
        model.observe(stream, start, stop)
        pos_all.append(pos_out.cpu().numpy())
        neg_all.append(neg_out.cpu().numpy())
    if not pos_all:
        return {"ap": float("nan"), "auc": float("nan")}
    pos, neg = np.concatenate(pos_all), np.concatenate(neg_all)
    # logits, not sigmoids: AP and AUC depend on the ranking only, and float32 sigmoids saturate
    # into ties
    labels = np.r_[np.ones_like(pos), np.zeros_like(neg)]
    scores = np.r_[pos, neg]
    return {"ap": average_precision(labels, scores), "auc": roc_auc(labels, scores)}
