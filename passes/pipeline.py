"""The one declarative pipeline of rewrite passes, in the order they run.

Attention passes come first (each anchors on a different node kind, so their relative order only
affects the report); masked aggregation runs after them because an attention's weighted sum is
also a masked-looking ``(a * v).sum``; the time encoding runs after attention; projection before
gather runs last. ``passes/README.md`` states the invariants every pass keeps.
"""

from __future__ import annotations

from fastopt.passes.aggregate import FuseMaskedAggregation
from fastopt.passes.attention import FuseTemporalAttention
from fastopt.passes.attention_mha import FuseMultiheadAttention
from fastopt.passes.attention_sdpa import FuseSdpaAttention
from fastopt.passes.manager import PassManager
from fastopt.passes.project_before_gather import ProjectBeforeGather
from fastopt.passes.time_encoding import FuseTimeEncoding

__all__ = ["PIPELINE", "default_pipeline"]

PIPELINE = (
    FuseMultiheadAttention,
    FuseSdpaAttention,
    FuseTemporalAttention,
    FuseMaskedAggregation,
    FuseTimeEncoding,
    ProjectBeforeGather,
)


def default_pipeline() -> PassManager:
    """A fresh :class:`PassManager` over fresh instances of :data:`PIPELINE` (counters at zero)."""
    return PassManager([cls() for cls in PIPELINE])
