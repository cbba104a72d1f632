"""The one declarative pipeline of rewrite passes, in the order they run.

Attention passes come first (each anchors on a different node kind, so their relative order only
affects the report); masked aggregation runs after them because an attention's weighted sum is
also a masked-looking ``(a * v).sum``; the split of Linears over concatenations after them (the
attention matches read the projections); projection before gather runs last. ``passes/README.md``
states the invariants every pass keeps.

``fuse_time_encoding`` is not in the default pipeline: on its own, one ``time_encode`` custom op
costs more host time per call than the ``addmm`` and ``cos`` it replaces (H200 profile of
TGN/TGAT steps, ``bench/optimize.py --profile``); it pays only as the prologue of
``time_encoded_attention``, which needs the key/value projection split first. Run it explicitly
with ``PassManager([FuseTimeEncoding()])`` where a standalone encoding is wanted.
"""

from __future__ import annotations

from fastopt.passes.aggregate import FuseMaskedAggregation
from fastopt.passes.attention import FuseTemporalAttention
from fastopt.passes.attention_mha import FuseMultiheadAttention
from fastopt.passes.attention_sdpa import FuseSdpaAttention
from fastopt.passes.manager import PassManager
from fastopt.passes.project_before_gather import ProjectBeforeGather
from fastopt.passes.split_linear import SplitLinearInputs

__all__ = ["PIPELINE", "default_pipeline"]

PIPELINE = (
    FuseMultiheadAttention,
    FuseSdpaAttention,
    FuseTemporalAttention,
    FuseMaskedAggregation,
    SplitLinearInputs,
    ProjectBeforeGather,
)


def default_pipeline() -> PassManager:
    """A fresh :class:`PassManager` over fresh instances of :data:`PIPELINE` (counters at zero)."""
    return PassManager([cls() for cls in PIPELINE])
