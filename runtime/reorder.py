"""Node reorderings that make the adjacency lists a sampler reads most often lie close together.

A reordering is a *row map*: ``rows[v]`` is the T-CSR row of node ``v``. The sampler looks rows up
through it and stores original node ids in its rows, so callers only ever see original ids.

* ``"degree"``: rows sorted by descending event degree, so the hot lists of high-degree nodes
  share pages and cache lines.
* ``"rcm"``: reverse Cuthill-McKee on the static symmetric adjacency (scipy.sparse.csgraph), so
  nodes that are neighbors get nearby rows and a multi-hop expansion stays in a narrow band.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from fastopt.errors import SamplerError

__all__ = ["REORDERINGS", "node_rows"]

REORDERINGS = ("none", "degree", "rcm")


def node_rows(src: np.ndarray, dst: np.ndarray, num_nodes: int, method: str) -> Optional[np.ndarray]:
    """Row of each node under ``method`` (``None`` for ``"none"``: the identity, no lookup)."""
    if method not in REORDERINGS:
        raise SamplerError(f"unknown reorder {method!r}; use one of {', '.join(REORDERINGS)}")
    if method == "none":
        return None
    if method == "degree":
        deg = np.bincount(src, minlength=num_nodes) + np.bincount(dst, minlength=num_nodes)
        order = np.argsort(-deg, kind="stable")
    else:
        from scipy.sparse import coo_matrix
        from scipy.sparse.csgraph import reverse_cuthill_mckee

        ones = np.ones(src.shape[0], dtype=np.int32)
        adj = coo_matrix((ones, (src, dst)), shape=(num_nodes, num_nodes)).tocsr()
        adj = (adj + adj.T).tocsr()
        order = np.asarray(reverse_cuthill_mckee(adj, symmetric_mode=True), dtype=np.int64)
    rows = np.empty(num_nodes, dtype=np.int64)
    rows[order] = np.arange(num_nodes, dtype=np.int64)
    return rows
