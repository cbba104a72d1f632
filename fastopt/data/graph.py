"""The in-memory event stream every part of fastopt consumes."""

from __future__ import annotations

import mmap
from dataclasses import InitVar, dataclass, field
from typing import Optional

import numpy as np

from fastopt.errors import DataError

__all__ = ["TemporalGraph", "check_finite"]

TRAIN_FRACTION = 0.70
VAL_FRACTION = 0.15


@dataclass
class TemporalGraph:
    """A chronological stream of events ``(src[i], dst[i], ts[i])`` over ``num_nodes`` nodes.

    Event ``i`` has edge id ``eids[i] == i``: edge ids index the rows of ``edge_feat``. Node ids
    are dense ``0..num_nodes-1``; timestamps are non-decreasing float64. Features are float32;
    ``None`` means zero width. The chronological split puts events with time up to the 70%
    quantile of timestamps in train and up to the 85% quantile in validation, so events sharing
    a timestamp never straddle two splits.

    ``features_checked=True`` skips the NaN/infinity scan of the features (their shapes are still
    checked): for a caller that has just scanned them or holds a record that they were scanned,
    since the scan reads every byte of a table that may be tens of gigabytes on disk.
    """

    src: np.ndarray
    dst: np.ndarray
    ts: np.ndarray
    num_nodes: int
    node_feat: Optional[np.ndarray] = None
    edge_feat: Optional[np.ndarray] = None
    labels: Optional[np.ndarray] = None
    name: str = "graph"
    bipartite: bool = False
    eids: np.ndarray = field(init=False)
    train_end: int = field(init=False)
    val_end: int = field(init=False)
    features_checked: InitVar[bool] = False

    def __post_init__(self, features_checked: bool = False) -> None:
        self.src = np.ascontiguousarray(self.src, dtype=np.int64)
        self.dst = np.ascontiguousarray(self.dst, dtype=np.int64)
        self.ts = np.ascontiguousarray(self.ts, dtype=np.float64)
        self.num_nodes = int(self.num_nodes)
        n = self.src.shape[0]
        if self.src.ndim != 1 or self.dst.shape != (n,) or self.ts.shape != (n,):
            raise DataError(
                f"src, dst and ts must be 1-d arrays of one length (got shapes {self.src.shape}, "
                f"{self.dst.shape}, {self.ts.shape}); pass one entry per event"
            )
        if n == 0:
            raise DataError("the graph has no events (0 rows); give a file with at least one event")
        for name, ids in (("src", self.src), ("dst", self.dst)):
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_nodes:
                bad = lo if lo < 0 else hi
                raise DataError(
                    f"{name} id {bad} is outside [0, num_nodes={self.num_nodes}); remap ids to "
                    f"0..N-1 or raise num_nodes"
                )
        bad = ~np.isfinite(self.ts)
        if bad.any():
            i = int(np.argmax(bad))
            raise DataError(
                f"timestamp of event {i} is {self.ts[i]}; timestamps must be finite numbers. "
                f"Drop or repair that event"
            )
        if n > 1 and (np.diff(self.ts) < 0).any():
            i = int(np.argmax(np.diff(self.ts) < 0))
            raise DataError(
                f"timestamps are not sorted: event {i + 1} has ts={self.ts[i + 1]} < ts={self.ts[i]} "
                f"of event {i}; sort events by time (the loaders do this for you)"
            )
        self.node_feat = _check_feat("node_feat", self.node_feat, self.num_nodes, not features_checked)
        self.edge_feat = _check_feat("edge_feat", self.edge_feat, n, not features_checked)
        self.eids = np.arange(n, dtype=np.int64)
        val_time, test_time = np.quantile(self.ts, [TRAIN_FRACTION, TRAIN_FRACTION + VAL_FRACTION])
        self.train_end = int(np.searchsorted(self.ts, val_time, side="right"))
        self.val_end = int(np.searchsorted(self.ts, test_time, side="right"))

    # ----------------------------------------------------------------------------- shape
    @property
    def num_events(self) -> int:
        return int(self.src.shape[0])

    @property
    def node_dim(self) -> int:
        return 0 if self.node_feat is None else int(self.node_feat.shape[1])

    @property
    def edge_dim(self) -> int:
        return 0 if self.edge_feat is None else int(self.edge_feat.shape[1])

    # ----------------------------------------------------------------------------- splits
    def split_range(self, split: str) -> range:
        """Event indices of ``"train"``, ``"val"``, ``"test"`` or ``"all"``."""
        ranges = {
            "train": range(0, self.train_end),
            "val": range(self.train_end, self.val_end),
            "test": range(self.val_end, self.num_events),
            "all": range(0, self.num_events),
        }
        if split not in ranges:
            raise DataError(f"unknown split {split!r}; use one of {', '.join(ranges)}")
        return ranges[split]

    def inductive_mask(self, split: str) -> np.ndarray:
        """Events of ``split`` with at least one endpoint that no training event touches."""
        r = self.split_range(split)
        seen = np.zeros(self.num_nodes, dtype=bool)
        seen[self.src[: self.train_end]] = True
        seen[self.dst[: self.train_end]] = True
        return ~(seen[self.src[r.start : r.stop]] & seen[self.dst[r.start : r.stop]])

    def destination_pool(self) -> np.ndarray:
        """Node ids that negative samples are drawn from: every node seen as a destination."""
        return np.unique(self.dst)

    # ----------------------------------------------------------------------------- features
    def with_random_features(self, edge_dim: int = 0, node_dim: int = 0, seed: int = 0) -> "TemporalGraph":
        """Attach deterministic N(0, 1) features of the given widths where the data has none."""
        for name, width in (("edge_dim", edge_dim), ("node_dim", node_dim)):
            if width < 0:
                raise DataError(f"{name} must be >= 0 (got {width}); pass 0 for no features")
        rng = np.random.default_rng([seed, 0x5EED])
        edge = self.edge_feat
        node = self.node_feat
        if edge is None and edge_dim > 0:
            edge = rng.standard_normal((self.num_events, edge_dim), dtype=np.float32)
        if node is None and node_dim > 0:
            node = rng.standard_normal((self.num_nodes, node_dim), dtype=np.float32)
        return TemporalGraph(self.src, self.dst, self.ts, self.num_nodes, node, edge, self.labels,
                             self.name, self.bipartite)

    # ----------------------------------------------------------------------------- stats
    def info(self) -> dict:
        """Nodes, events, time span, degree percentiles and repeat-edge rate."""
        deg = np.bincount(self.src, minlength=self.num_nodes) + np.bincount(self.dst, minlength=self.num_nodes)
        pairs = self.src * self.num_nodes + self.dst
        _, first = np.unique(pairs, return_index=True)
        repeat_rate = 1.0 - first.size / self.num_events
        pct = np.percentile(deg, [50, 90, 99, 100])
        return {
            "name": self.name,
            "nodes": self.num_nodes,
            "events": self.num_events,
            "bipartite": self.bipartite,
            "time_min": float(self.ts[0]),
            "time_max": float(self.ts[-1]),
            "time_span": float(self.ts[-1] - self.ts[0]),
            "degree_p50": float(pct[0]),
            "degree_p90": float(pct[1]),
            "degree_p99": float(pct[2]),
            "degree_max": float(pct[3]),
            "repeat_rate": float(repeat_rate),
            "edge_dim": self.edge_dim,
            "node_dim": self.node_dim,
            "train_events": self.train_end,
            "val_events": self.val_end - self.train_end,
            "test_events": self.num_events - self.val_end,
        }

    # ----------------------------------------------------------------------------- PyG
    def to_pyg(self):
        """Convert to ``torch_geometric.data.TemporalData`` (needs torch_geometric)."""
        import torch

        TemporalData = _pyg_temporal_data()
        kwargs = dict(src=torch.from_numpy(self.src), dst=torch.from_numpy(self.dst),
                      t=torch.from_numpy(self.ts))
        if self.edge_feat is not None:
            kwargs["msg"] = torch.from_numpy(self.edge_feat)
        if self.labels is not None:
            kwargs["y"] = torch.from_numpy(np.asarray(self.labels))
        return TemporalData(**kwargs)

    @classmethod
    def from_pyg(cls, data, name: str = "pyg", num_nodes: Optional[int] = None) -> "TemporalGraph":
        """Build from a ``torch_geometric.data.TemporalData`` (events sorted stably by time)."""
        src = data.src.cpu().numpy()
        dst = data.dst.cpu().numpy()
        ts = data.t.cpu().numpy().astype(np.float64)
        order = np.argsort(ts, kind="stable")
        msg = getattr(data, "msg", None)
        y = getattr(data, "y", None)
        n = int(num_nodes if num_nodes is not None else max(src.max(), dst.max()) + 1)
        return cls(src[order], dst[order], ts[order], n,
                   edge_feat=None if msg is None else msg.cpu().numpy().astype(np.float32)[order],
                   labels=None if y is None else y.cpu().numpy()[order], name=name)


def _pyg_temporal_data():
    try:
        from torch_geometric.data import TemporalData
    except ImportError:
        raise DataError(
            "PyG conversion needs torch_geometric, which is not installed; "
            "run `pip install 'fastopt[pyg]'`"
        ) from None
    return TemporalData


# Bytes of a feature table checked at once: bounds the temporaries of the finiteness check.
_CHECK_BYTES = 16 << 20


def _check_feat(name: str, feat: Optional[np.ndarray], rows: int, finite: bool = True) -> Optional[np.ndarray]:
    """``feat`` as a C-contiguous float32 table of ``rows`` rows (None when zero wide), checked for
    NaN and infinity when ``finite``. A memory-mapped table (``np.memmap``) stays mapped, not read
    into RAM."""
    if feat is None:
        return None
    if not (isinstance(feat, np.memmap) and feat.dtype == np.float32 and feat.flags.c_contiguous):
        feat = np.ascontiguousarray(feat, dtype=np.float32)
    if feat.ndim == 1:
        feat = feat[:, None]
    if feat.ndim != 2 or feat.shape[0] != rows:
        raise DataError(f"{name} must have shape [{rows}, d] (got {feat.shape}); give one row per "
                        f"{'node' if name == 'node_feat' else 'event'}")
    if feat.shape[1] == 0:
        return None
    if finite:
        check_finite(name, feat)
    return feat


def check_finite(name: str, feat: np.ndarray) -> None:
    """Raise :class:`DataError` if the 2-d table ``feat`` holds a NaN or an infinity, reading it
    in pieces of about 16 MiB (a mapped table from its file, leaving no pages of it mapped)."""
    rows = feat.shape[0]
    step = max(1, _CHECK_BYTES // (feat.itemsize * max(1, feat.shape[1])))
    for lo in range(0, rows, step):
        if not np.isfinite(_rows(feat, lo, min(lo + step, rows))).all():
            raise DataError(f"{name} contains NaN or infinite values (in rows {lo}..{min(lo + step, rows) - 1}); "
                            f"clean the feature columns")


def _rows(feat: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Rows ``lo:hi`` of ``feat``; those of a file-mapped table read from its file, so that the
    check leaves no pages of the table mapped into the process (resident, counted in its RSS)."""
    # only a whole mapped file: a view of one keeps the file's offset, not its own
    if isinstance(feat, np.memmap) and isinstance(feat.base, mmap.mmap) and feat.ndim == 2:
        width = feat.shape[1]
        return np.fromfile(feat.filename, dtype=feat.dtype, count=(hi - lo) * width,
                           offset=feat.offset + lo * width * feat.itemsize)
    return feat[lo:hi]
