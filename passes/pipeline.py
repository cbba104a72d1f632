"""The one declarative pipeline of rewrite passes, in the order they run.

Attention passes come first (each anchors on a different node kind, so their relative order only
affects the report); masked aggregation runs after them because an attention's weighted sum is
also a masked-looking ``(a * v).sum``; the split of Linears over concatenations after them (the
attention matches read the projections); projection before gather after them; then the time
encoding factored out of key/value projections (it reads the merged projections). ``passes/README.md``
states the invariants every pass keeps.

``fuse_time_encoding`` joins the pipeline (last) when ``config.passes.fuse_time_encoding`` is
``"always"``, or ``"graphs"`` (the default) with CUDA graphs possible (``passes.cuda_graphs`` not
``"off"``, a CUDA device present). ``"graphs"`` runs the fused op only inside a captured graph,
where it costs no host time and saves the encoding's round trips through memory (H200,
``bench/optimize.py`` at c9e7a6c: TGAT step 2.118 -> 1.938 ms, TGN 1.201 -> 1.218 ms); called
from Python, one ``time_encode`` custom op costs more host time than the ``addmm`` and ``cos`` it
replaces.
"""

from __future__ import annotations

import torch

from fastopt.config import default_config
from fastopt.passes.aggregate import FuseMaskedAggregation
from fastopt.passes.attention import FuseTemporalAttention
from fastopt.passes.attention_mha import FuseMultiheadAttention
from fastopt.passes.attention_sdpa import FuseSdpaAttention
from fastopt.passes.edge_softmax import FuseEdgeSoftmaxAggregation
from fastopt.passes.manager import PassManager
from fastopt.passes.project_before_gather import ProjectBeforeGather
from fastopt.passes.split_linear import SplitLinearInputs
from fastopt.passes.time_encoding import FactorTimeEncoding, FuseTimeEncoding

__all__ = ["PIPELINE", "default_pipeline"]

PIPELINE = (
    FuseMultiheadAttention,
    FuseSdpaAttention,
    FuseTemporalAttention,
    FuseMaskedAggregation,
    FuseEdgeSoftmaxAggregation,
    SplitLinearInputs,
    ProjectBeforeGather,
)


def default_pipeline() -> PassManager:
    """A fresh :class:`PassManager` over fresh instances of :data:`PIPELINE` (counters at zero),
    :class:`FactorTimeEncoding` unless ``config.passes.factor_time_encoding`` is off, and
    :class:`FuseTimeEncoding` where ``config.passes.fuse_time_encoding`` asks for it."""
    passes = [cls() for cls in PIPELINE]
    if default_config().passes.factor_time_encoding != "off":
        passes.append(FactorTimeEncoding())
    if _time_encoding_fuses(default_config().passes):
        passes.append(FuseTimeEncoding())
    return PassManager(passes)


def _time_encoding_fuses(cfg) -> bool:
    # "graphs" fuses only inside a CUDA-graph capture: without one the rewrite would change
    # nothing but the module (a model whose only match is its time encoding, as JODIE's, would
    # come back rewritten and graph-wrapped)
    mode = cfg.fuse_time_encoding
    return mode == "always" or (mode == "graphs" and cfg.cuda_graphs != "off"
                                and torch.cuda.is_available())
