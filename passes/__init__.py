"""fastopt.passes: torch.fx tracing and rewrites onto fastopt.codegen operators.

Layout: ``tracing.py`` (side-effect-free tracing), ``pattern.py`` (matching helpers, the pass base
class), one file per pattern family (``attention.py``, ``attention_mha.py``, ``attention_sdpa.py``,
``aggregate.py``, ``time_encoding.py``, ``project_before_gather.py``), ``lowering.py`` (the
run-time functions rewritten graphs call), ``pipeline.py`` (the declarative pipeline),
``manager.py`` (the pass manager), ``optimizer.py`` (whole-model driver), ``report.py``,
``verify.py``. Invariants: ``README.md``.
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
from fastopt.passes.tracing import FastOptTracer, trace

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
    "trace",
]
