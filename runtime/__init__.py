"""fastopt.runtime: temporal neighbor sampling (and ``LastNeighborLoader``, PyG's interface to
each node's last neighbors on dense tensors), SlimCache, the loader and its ``GraphInputs``, and
CUDA-graph capture and replay (of a module's calls, ``graphs.py``; of whole training steps,
``step_graph.py``).

Layering: this package imports nothing of fastopt but :mod:`fastopt.config` and
:mod:`fastopt.errors`; it never imports ``fastopt.passes``, ``fastopt.models`` or the trainer.
"""

from fastopt.runtime.blocks import SampledBatch, TemporalBlock, Unique
from fastopt.runtime.inputs import GraphInputs, bucket
from fastopt.runtime.sampler import OPENMP, TemporalSampler
from fastopt.runtime.cache_policy import BeladyResult, belady_optimum
from fastopt.runtime.slimcache import CacheCounters, CacheTable, PendingRows, SlimCache, UniqueRows
from fastopt.runtime.loader import EventBatch, Loader, NegativeSampler, StageTimer
from fastopt.runtime.graphs import GraphCapture, GraphRunner, attach_graph_runners, capturing, drop_graphs
from fastopt.runtime.last_neighbors import LastNeighborLoader
from fastopt.runtime.padding import RowPad, constant_rows, pad_rows

__all__ = ["SampledBatch", "TemporalBlock", "Unique", "SlimCache", "CacheTable", "UniqueRows",
           "PendingRows", "CacheCounters", "BeladyResult", "belady_optimum", "TemporalSampler", "OPENMP",
           "GraphInputs", "EventBatch", "Loader", "NegativeSampler", "StageTimer", "GraphCapture",
           "GraphRunner", "attach_graph_runners", "capturing", "drop_graphs", "LastNeighborLoader", "bucket", "RowPad",
           "constant_rows", "pad_rows"]
