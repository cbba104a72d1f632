"""One chronological batch of events as the loader hands it over (:class:`EventBatch`), its
negatives (:class:`NegativeSampler`) and the rows its step reads itself (:class:`RowReads`).

Layering: imports nothing of fastopt but other runtime modules.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import numpy as np
import torch

from fastopt.runtime.blocks import SampledBatch, Unique
from fastopt.runtime.inputs import GraphInputs, per_slot

__all__ = ["EventBatch", "NegativeSampler", "RowReads", "SPLIT_IDS"]

SPLIT_IDS = {"train": 0, "val": 1, "test": 2}


class NegativeSampler:
    """Uniform negative destinations, a pure function of (seed, epoch, split, batch index).

    Drawing per batch from its own key keeps negatives identical across resumes and orderings.
    """

    def __init__(self, pool: np.ndarray, seed: int) -> None:
        self.pool = np.asarray(pool, dtype=np.int64)
        self.seed = seed

    def draw(self, n: int, epoch: int, split: str, batch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch, SPLIT_IDS[split], batch])
        return self.pool[rng.integers(0, self.pool.size, size=n)]


class RowReads(NamedTuple):
    """A batch's edge rows, left for its consumer to read on its own stream: SlimCache's
    zero-copy reads of a training batch run inside the captured training step (one graph node,
    no launch on the staging threads; ``cache.read_in_step``).

    A named tuple of tensors and constants, so that :func:`~fastopt.runtime.flatten.flatten`
    makes ``ids`` and ``index`` inputs of the step's graph and ``read`` (one per cache, whose
    tensors keep their addresses) and ``shapes`` part of its key.
    """

    ids: torch.Tensor  # the unique edge ids (padded), then the batch's own events' (on the device)
    read: Callable[[torch.Tensor], torch.Tensor]  # ids -> rows, on the current stream
    events: int  # trailing rows that are the batch's own events' features
    # models reading per-slot features: every layer's slots' rows (flattened in layer order) and
    # each layer's [M_i, k_i] (None: the model reads GraphInputs.edge_rows)
    index: Optional[torch.Tensor] = None
    shapes: Tuple[Tuple[int, ...], ...] = ()

    def apply(self, inputs: GraphInputs, event_feat: Optional[torch.Tensor],
              side: Optional[torch.cuda.Stream] = None) -> Tuple[GraphInputs, Optional[torch.Tensor]]:
        """``inputs`` with the rows read (as ``edge_rows``, or expanded per slot as
        ``edge_feat``), and the events' features. ``side``: a CUDA stream to read on, which the
        current stream waits for only at ``inputs.edges_ready()`` (a model's first use of the rows;
        the consumer's before it takes the events' features), so that the read overlaps the work
        queued before that; the wait is captured with the rest where a CUDA graph captures it."""
        if side is not None:
            current = torch.cuda.current_stream(side.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                inputs, event_feat = self.apply(inputs, event_feat)
            # the stream current where they are taken waits (a runner's capture may take them on its own)
            inputs.edges_pending = lambda: torch.cuda.current_stream(side.device).wait_stream(side)
            return inputs, event_feat
        rows = self.read(self.ids)
        n = rows.shape[0] - self.events
        inputs = copy.copy(inputs)
        if self.index is None:
            inputs.edge_rows = rows[:n]
        else:
            inputs.edge_feat = per_slot(rows[:n], self.index, self.shapes)
        return inputs, (rows[n:] if self.events else event_feat)


@dataclass
class EventBatch:
    """One chronological batch: its positive events, negatives, roots and, once staged, inputs.

    Roots are ``[src, dst, neg, extra.ravel()]`` at the events' times; ``extra`` holds the MRR
    negatives ``[B, n]`` of an evaluation batch. ``inputs`` (the model's
    :class:`~fastopt.runtime.GraphInputs`) and ``event_feat`` (the features of the batch's own
    events, ``[B, d_edge]``, for the memory write-back) are on the device once staged, but
    where ``reads`` holds rows the consumer reads itself (:meth:`read`).
    """

    index: int
    start: int
    stop: int
    src: np.ndarray
    dst: np.ndarray
    ts: np.ndarray
    neg: np.ndarray
    extra: Optional[np.ndarray] = None
    split: str = "train"
    sampled: Optional[SampledBatch] = None
    inputs: Optional[GraphInputs] = None
    event_feat: Optional[torch.Tensor] = None
    announced: bool = False  # its cached ids were announced to SlimCache (_CachePlanner)
    padded: Optional[Dict[str, int]] = None  # lengths reserved in batch order (Loader.reserve)
    root_nodes: Optional[Unique] = None  # the roots' unique ids where no sampler dedups (reserve)
    reads: Optional[RowReads] = None  # edge rows not read yet (inputs.edge_rows and event_feat wait)

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def roots(self) -> np.ndarray:
        parts = [self.src, self.dst, self.neg] + ([self.extra.reshape(-1)] if self.extra is not None else [])
        return np.concatenate(parts)

    @property
    def times(self) -> np.ndarray:
        copies = 3 + (self.extra.shape[1] if self.extra is not None else 0)
        return np.tile(self.ts, copies)

    def read(self) -> "EventBatch":
        """Read the rows ``reads`` left (on the current stream) into ``inputs`` and ``event_feat``."""
        if self.reads is not None:
            self.inputs, self.event_feat = self.reads.apply(self.inputs, self.event_feat)
            self.reads = None
        return self
