"""``project_before_gather``: ``Linear(table[index])`` -> ``Linear(table)[index]`` on small tables.

Pattern::

    y = self.proj(table[index])                       # or table.index_select(0, index)

SlimCache hands a model tables of the batch's unique rows plus an index; projecting every
sampled neighbor's copy repeats the work per duplicate. A row-wise Linear commutes with a row
gather, so the replacement (:func:`project_rows`, below) projects the table once
and gathers the projected rows whenever the table has fewer rows than the index selects (checked
per call, so both directions keep the same result).

Left alone: gathers along another dimension, non-Linear consumers.

Order: last; it does not interact with the attention patterns (their keys are projections of
dense neighbor tensors in the reference models).
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor, fx, nn

from fastopt.passes.pattern import Match, RewritePass, gather_of, module_of
from fastopt.passes.sites import record

__all__ = ["ProjectBeforeGather", "project_rows"]


class ProjectBeforeGather(RewritePass):
    """Project a gathered table before gathering it."""

    name = "project_before_gather"

    def anchors(self, gm: fx.GraphModule) -> List[fx.Node]:
        return [n for n in gm.graph.nodes if module_of(gm, n, (nn.Linear,)) is not None]

    def match(self, gm: fx.GraphModule, node: fx.Node) -> Optional[Match]:
        got = gather_of(node.args[0])
        if got is None or len(node.args) != 1 or node.kwargs:
            return None
        table, index = got
        return Match(
            anchor=node, output=node, nodes=[node, node.args[0]], target=project_rows,
            args=(("module", node.target), table, index), kwargs={},
            op="project_rows", pattern="Linear(table[index])")


# ----------------------------------------------------------------------------------------------
# lowering: what the rewritten graph calls
# ----------------------------------------------------------------------------------------------


def project_rows(linear: torch.nn.Module, table: Tensor, index: Tensor, *, site: str = "") -> Tensor:
    """``linear(table[index])``, computed as ``linear(table)[index]`` when the table is smaller.

    A row-wise projection commutes with a row gather; projecting the unique table rows once is
    cheaper whenever the table has fewer rows than the index selects.
    """
    if table.dim() >= 1 and index.dtype in (torch.int32, torch.int64) and \
            table.shape[0] < index.numel():
        record(site, (table.shape[0], index.numel()))
        return linear(table)[index]
    return linear(table[index])
