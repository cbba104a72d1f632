"""fastopt.runtime: temporal neighbor sampling, SlimCache and the prefetch pipeline.

Layering: this package imports nothing of fastopt but :mod:`fastopt.config` and
:mod:`fastopt.errors`; it never imports ``fastopt.passes``, ``fastopt.models`` or the trainer.
"""

import os

# The sampler's OpenMP threads must sleep, not spin, between batches: with few cores a spinning
# team steals the cores PyTorch's own (separate) OpenMP runtime needs for the model, which made
# training steps several times slower on a 2-core machine. The variable is read when the
# sampler's OpenMP runtime loads, just below; an explicit user setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from fastopt.runtime.blocks import SampledBatch, TemporalBlock, Unique  # noqa: E402
from fastopt.runtime.sampler import OPENMP, TemporalSampler  # noqa: E402
from fastopt.runtime.cache_policy import BeladyResult, belady_optimum  # noqa: E402
from fastopt.runtime.slimcache import CacheCounters, CacheTable, PendingRows, SlimCache, UniqueRows  # noqa: E402

__all__ = ["SampledBatch", "TemporalBlock", "Unique", "SlimCache", "CacheTable", "UniqueRows",
           "PendingRows", "CacheCounters", "BeladyResult", "belady_optimum", "TemporalSampler", "OPENMP"]
