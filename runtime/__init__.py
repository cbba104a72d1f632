"""fastopt.runtime: temporal neighbor sampling, SlimCache and the prefetch pipeline.

Layering: this package imports nothing of fastopt but :mod:`fastopt.config` and
:mod:`fastopt.errors`; it never imports ``fastopt.passes``, ``fastopt.models`` or the trainer.
"""

from fastopt.runtime.blocks import SampledBatch, TemporalBlock, Unique

__all__ = ["SampledBatch", "TemporalBlock", "Unique"]
