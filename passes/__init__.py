"""fastopt.passes: torch.fx tracing and rewrites onto fastopt.codegen operators.

Layout: ``tracing.py`` (side-effect-free tracing), ``pattern.py`` (matching helpers, the pass base
class), one file per pattern family with its lowering, the run-time function rewritten graphs call
(``attention.py``, ``attention_mha.py``, ``attention_sdpa.py``, ``aggregate.py``,
``time_encoding.py``, ``project_before_gather.py``; ``split_linear.py`` with
``split_linear_lowering.py``), ``attention_layout.py`` (attention in any layout onto the fused
operator, shared by the attention lowerings), ``sites.py`` (run-time shapes per rewrite site),
``pipeline.py`` (the declarative pipeline), ``manager.py`` (the pass manager), ``optimizer.py``
(whole-model driver), ``report.py``, ``verify.py``. Invariants: ``README.md``.
"""

from fastopt.passes.aggregate import FuseMaskedAggregation
from fastopt.passes.attention import FuseTemporalAttention
from fastopt.passes.attention_mha import FuseMultiheadAttention
from fastopt.passes.attention_sdpa import FuseSdpaAttention
from fastopt.passes.manager import PassManager
from fastopt.passes.optimizer import optimize_module
from fastopt.passes.pipeline import PIPELINE, default_pipeline
from fastopt.passes.project_before_gather import ProjectBeforeGather
from fastopt.passes.split_linear import SplitLinearInputs
from fastopt.passes.report import LeftAlone, Rewrite, RewriteReport
from fastopt.passes.time_encoding import FuseTimeEncoding
from fastopt.passes.tracing import FastOptTracer, graph_structure, trace

__all__ = [
    "FuseMultiheadAttention",
    "FuseSdpaAttention",
    "FuseTemporalAttention",
    "FuseMaskedAggregation",
    "FuseTimeEncoding",
    "ProjectBeforeGather",
    "SplitLinearInputs",
    "PIPELINE",
    "PassManager",
    "default_pipeline",
    "optimize_module",
    "RewriteReport",
    "Rewrite",
    "LeftAlone",
    "FastOptTracer",
    "graph_structure",
    "trace",
]
