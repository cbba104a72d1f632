"""The NumPy reference temporal neighbor sampler: the test oracle for every faster sampler.

It is vectorized (no Python loop over roots) so that it can also drive CPU training, but it
favours obvious correctness over speed. Semantics shared with :class:`fastopt.runtime.TemporalSampler`:

* candidates of a root ``(v, t)`` are the events touching ``v`` with timestamp strictly before
  ``t`` (with ``undirected=True`` an event ``u -> w`` is a neighbor of both endpoints);
* ``"recent"`` returns the ``k`` latest candidates, newest first (ties in time broken by the
  later edge id first);
* ``"uniform"`` returns all candidates when there are at most ``k``, else ``k`` draws with
  replacement;
* layer ``l + 1`` samples around layer ``l``'s neighbors, each at its own edge's timestamp;
  padded neighbors yield fully masked rows; with ``hop_dedup`` around the distinct
  ``(neighbor, edge)`` pairs of layer ``l``'s valid slots (:func:`~fastopt.runtime.blocks.merge_repeats`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from fastopt.runtime.blocks import SampledBatch, TemporalBlock, Unique, merge_repeats
from fastopt.runtime.validate import check_fanouts, check_graph_arrays, check_roots, check_sample_size

__all__ = ["NumpySampler", "check_roots", "check_fanouts"]

class NumpySampler:
    """Reference temporal sampler over a :class:`~fastopt.data.TemporalGraph`.

    Args:
        graph: the event stream (``src``, ``dst``, ``ts``, ``num_nodes``).
        fanouts: neighbors per layer, outermost first, e.g. ``[10, 10]``.
        strategy: ``"recent"`` or ``"uniform"``.
        seed: seed of uniform draws.
        undirected: add each event as a neighbor of both endpoints.
        limit: use only events ``[0, limit)`` (default: all).
        hop_dedup: merge the repeats of a layer's slots into one destination of the next layer.
    """

    def __init__(self, graph, fanouts: Sequence[int] = (10,), strategy: str = "recent",
                 seed: int = 0, undirected: bool = True, limit: int | None = None,
                 hop_dedup: bool = False) -> None:
        self.fanouts = check_fanouts(fanouts, strategy)
        self.strategy = strategy
        self.num_nodes = int(graph.num_nodes)
        self.seed = int(seed)
        self.hop_dedup = bool(hop_dedup)
        self.undirected = bool(undirected)
        self._epoch = 0
        self._calls = 0
        src, dst, ts = check_graph_arrays(graph, limit)
        n = self.num_edges = src.shape[0]
        eid = np.arange(n, dtype=np.int64)
        if undirected:
            node = np.concatenate([src, dst])
            nbr = np.concatenate([dst, src])
            ets = np.concatenate([ts, ts])
            eid = np.concatenate([eid, eid])
        else:
            node, nbr, ets = src, dst, ts
        order = np.lexsort((eid, ets, node))
        self.node, self.nbr, self.ets, self.eid = node[order], nbr[order], ets[order], eid[order]
        self.indptr = np.zeros(self.num_nodes + 1, dtype=np.int64)
        np.cumsum(np.bincount(self.node, minlength=self.num_nodes), out=self.indptr[1:])
        self._utimes = np.unique(self.ets)
        self._radix = np.int64(self._utimes.size + 1)
        self._keys = self.node * self._radix + np.searchsorted(self._utimes, self.ets)

    def reset(self, epoch: int | None = None) -> None:
        """Start an epoch (default: the next one); uniform draws are keyed by (seed, epoch, call)."""
        self._epoch = self._epoch + 1 if epoch is None else int(epoch)
        self._calls = 0

    def sample(self, roots, times, batch: int | None = None) -> SampledBatch:
        """Sample every layer for ``roots`` at ``times``; ``batch`` keys the uniform draws
        (default: the number of calls since :meth:`reset`)."""
        roots, times = check_roots(roots, times, self.num_nodes)
        check_sample_size(roots.shape[0], self.fanouts)
        rng = np.random.default_rng([self.seed, self._epoch, self._calls if batch is None else int(batch)])
        self._calls += 1
        blocks = []
        dst, dst_t, valid = roots, times, np.ones(roots.shape[0], dtype=bool)
        for layer, k in enumerate(self.fanouts):
            block = self._sample_layer(dst, dst_t, valid, k, rng)
            blocks.append(block)
            if self.hop_dedup and layer + 1 < len(self.fanouts):
                dst, dst_t, valid = (t.numpy() for t in merge_repeats(block, self.num_edges, undirected=self.undirected))
                continue
            dst = block.nbr_nodes.numpy().reshape(-1)
            dst_t = block.nbr_times.numpy().reshape(-1)
            valid = block.mask.numpy().reshape(-1)
        all_nodes = torch.cat([torch.from_numpy(roots)] + [b.nbr_nodes.reshape(-1) for b in blocks])
        all_eids = torch.cat([b.nbr_eids.reshape(-1) for b in blocks]) if blocks else torch.empty(0, dtype=torch.int64)
        return SampledBatch(torch.from_numpy(roots), torch.from_numpy(times), blocks,
                            Unique.of(all_nodes), Unique.of(all_eids))

    def candidates(self, dst: np.ndarray, dst_t: np.ndarray) -> tuple:
        """T-CSR range ``[start, end)`` of events of each ``dst`` strictly before its time."""
        start = self.indptr[dst]
        rank = np.searchsorted(self._utimes, dst_t, side="left")
        end = np.searchsorted(self._keys, dst * self._radix + rank, side="left")
        return start, end

    def _sample_layer(self, dst, dst_t, valid, k, rng: np.random.Generator) -> TemporalBlock:
        m = dst.shape[0]
        start, end = self.candidates(dst, dst_t)
        avail = np.where(valid, end - start, 0)
        cnt = np.minimum(avail, k)
        col = np.arange(k)[None, :]
        mask = col < cnt[:, None]
        if self.strategy == "recent":
            pos = end[:, None] - 1 - col
        else:
            draw = rng.random((m, k))
            pos = np.where(avail[:, None] <= k, start[:, None] + col,
                           start[:, None] + (draw * avail[:, None]).astype(np.int64))
        pos = np.where(mask, pos, 0)
        nbr = np.where(mask, self.nbr[pos] if self.nbr.size else 0, 0)
        eid = np.where(mask, self.eid[pos] if self.eid.size else -1, -1)
        nts = np.where(mask, self.ets[pos] if self.ets.size else 0.0, 0.0)
        dt = np.where(mask, dst_t[:, None] - nts, 0.0).astype(np.float32)
        indptr = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(cnt, out=indptr[1:])
        nbr_t = torch.from_numpy(np.ascontiguousarray(nbr, dtype=np.int64))
        eid_t = torch.from_numpy(np.ascontiguousarray(eid, dtype=np.int64))
        return TemporalBlock(
            dst_nodes=torch.from_numpy(np.ascontiguousarray(dst, dtype=np.int64)),
            dst_times=torch.from_numpy(np.ascontiguousarray(dst_t, dtype=np.float64)),
            nbr_nodes=nbr_t, nbr_eids=eid_t,
            nbr_times=torch.from_numpy(np.ascontiguousarray(nts)),
            dt=torch.from_numpy(dt), mask=torch.from_numpy(mask), indptr=torch.from_numpy(indptr),
            unique_nodes=Unique.of(nbr_t), unique_eids=Unique.of(eid_t),
        )
