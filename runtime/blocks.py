"""What a temporal neighbor sampler returns: one :class:`TemporalBlock` per layer.

Every sampler (the NumPy oracle in :mod:`fastopt.sampling`, the Cython
:class:`~fastopt.runtime.TemporalSampler`) returns a :class:`SampledBatch` of this shape, so they
are interchangeable behind one interface.

Layout of a block with ``M`` destinations and fanout ``k``: neighbors are padded ``[M, k]``
arrays whose valid entries come first in each row (``mask[i, :cnt[i]]`` is True, the rest
False); ``indptr`` (``[M + 1]``) is the CSR view of the same valid entries, so
``nbr_nodes[mask]`` equals the CSR column array. Padded entries hold node 0, edge -1, time 0
and Δt 0. Layer ``l + 1``'s destinations are layer ``l``'s neighbors flattened (``M * k`` rows,
padded ones included, whose rows are then fully masked), each at its own edge's timestamp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

__all__ = ["TemporalBlock", "SampledBatch", "Unique"]


@dataclass
class Unique:
    """Within-batch compression of an id array: ``ids == values[inverse]``."""

    values: torch.Tensor  # [U] int64, sorted unique ids
    inverse: torch.Tensor  # same shape as the compressed array, int64 positions into values

    @classmethod
    def of(cls, ids: torch.Tensor) -> "Unique":
        values, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        return cls(values, inverse)


@dataclass
class TemporalBlock:
    """Sampled neighbors of one layer."""

    dst_nodes: torch.Tensor  # [M] int64
    dst_times: torch.Tensor  # [M] float64
    nbr_nodes: torch.Tensor  # [M, k] int64 (0 where padded)
    nbr_eids: torch.Tensor  # [M, k] int64 (-1 where padded)
    nbr_times: torch.Tensor  # [M, k] float64 (0 where padded)
    dt: torch.Tensor  # [M, k] float32: dst_time - nbr_time (0 where padded)
    mask: torch.Tensor  # [M, k] bool, valid entries first in each row
    indptr: torch.Tensor  # [M + 1] int64, CSR view of the valid entries
    unique_nodes: Optional[Unique] = None  # of nbr_nodes (all entries, padded ones included)
    unique_eids: Optional[Unique] = None  # of nbr_eids (padded -1 included)

    @property
    def num_dst(self) -> int:
        return int(self.dst_nodes.shape[0])

    @property
    def fanout(self) -> int:
        return int(self.nbr_nodes.shape[1])

    def counts(self) -> torch.Tensor:
        return self.indptr[1:] - self.indptr[:-1]


@dataclass
class SampledBatch:
    """All layers sampled for one batch of roots, outermost-first (``blocks[0]`` has the roots)."""

    roots: torch.Tensor  # [R] int64
    times: torch.Tensor  # [R] float64
    blocks: List[TemporalBlock] = field(default_factory=list)
    unique_nodes: Optional[Unique] = None  # over roots and every layer's neighbors
    unique_eids: Optional[Unique] = None  # over every layer's neighbor edges

    @property
    def num_layers(self) -> int:
        return len(self.blocks)
