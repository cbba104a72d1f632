"""Input checks shared by every temporal sampler (the NumPy oracle and the Cython sampler).

Each check raises :class:`~fastopt.errors.SamplerError` naming the offending value and the fix,
and converts silently only where no information is lost.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch

from fastopt.errors import SamplerError

__all__ = ["STRATEGIES", "check_fanouts", "check_graph_arrays", "check_roots", "check_threads",
           "check_sample_size"]

STRATEGIES = ("recent", "uniform")
# Bytes of one padded slot of a sampled layer: neighbor, edge id and time (8 each), dt (4), mask (1).
SLOT_BYTES = 29
# Bytes per node of the sampler's per-node arrays (T-CSR row pointers, time pointers, dedup bits).
NODE_BYTES = 17


def host_memory_bytes() -> int:
    """Physical memory of the host: no request above it can be served."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def check_sample_size(num_roots: int, fanouts: Sequence[int]) -> None:
    """Refuse a batch whose padded ``[M, k]`` layers could not fit in the host's memory (huge
    fan-outs), before anything is allocated."""
    rows, slots = int(num_roots), 0
    for k in fanouts:
        rows *= int(k)
        slots += rows
    limit = host_memory_bytes()
    if slots * SLOT_BYTES > limit:
        raise SamplerError(
            f"{num_roots} roots with fanouts {list(fanouts)} make {slots:,} sampled slots "
            f"({slots * SLOT_BYTES:,} bytes), above the {limit:,} bytes of host memory; use smaller "
            f"fanouts or fewer roots per batch (train.batch_size)")


def check_fanouts(fanouts: Sequence[int], strategy: str) -> list:
    """Validate the sampler's layer widths and strategy (shared by every sampler)."""
    fanouts = list(fanouts)
    for k in fanouts:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k <= 0:
            raise SamplerError(f"fanout {k!r} must be a positive integer; use e.g. fanouts=[10]")
    if strategy not in STRATEGIES:
        raise SamplerError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    return [int(k) for k in fanouts]


def check_threads(threads) -> int:
    """Validate an explicit sampler thread count."""
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads <= 0:
        raise SamplerError(f"threads={threads!r} must be a positive integer; pass e.g. threads=2, "
                           f"or leave it unset to use sampler.threads of the config")
    return int(threads)


def check_roots(roots, times, num_nodes: int):
    """Convert roots/times to int64/float64 NumPy arrays, raising on out-of-range or NaN input."""
    roots = roots.cpu().numpy() if isinstance(roots, torch.Tensor) else np.asarray(roots)
    times = times.cpu().numpy() if isinstance(times, torch.Tensor) else np.asarray(times)
    if roots.ndim != 1 or times.ndim != 1 or roots.shape != times.shape:
        raise SamplerError(f"roots and times must be 1-d and of one length (got shapes {roots.shape} "
                           f"and {times.shape}); pass one time per root")
    if roots.dtype.kind not in "iu":
        if roots.dtype.kind == "f" and roots.size and (roots == np.floor(roots)).all():
            pass  # integral floats convert without loss
        elif roots.size:
            raise SamplerError(f"roots must be integer node ids (got dtype {roots.dtype}); pass an "
                               f"int64 array")
    roots = roots.astype(np.int64, copy=False)
    if roots.size and (roots.min() < 0 or roots.max() >= num_nodes):
        bad = roots.min() if roots.min() < 0 else roots.max()
        raise SamplerError(f"root id {bad} is outside [0, num_nodes={num_nodes}); pass node ids of "
                           f"the sampled graph")
    if times.dtype.kind not in "iuf":
        raise SamplerError(f"times must be numeric (got dtype {times.dtype})")
    times = times.astype(np.float64, copy=False)
    if times.size and not np.isfinite(times).all():
        bad = times[~np.isfinite(times)][0]
        raise SamplerError(f"root time {bad} is not finite; pass finite timestamps")
    return roots, times


def check_graph_arrays(graph, limit=None):
    """The graph's first ``limit`` events as contiguous int64/int64/float64 arrays, checked."""
    n = int(graph.src.shape[0])
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or not 0 <= limit <= n:
            raise SamplerError(f"limit={limit!r} must be an integer in [0, {n}] (events of the "
                               f"graph); pass e.g. graph.train_end")
        n = int(limit)
    src = np.ascontiguousarray(graph.src[:n], dtype=np.int64)
    dst = np.ascontiguousarray(graph.dst[:n], dtype=np.int64)
    ts = np.ascontiguousarray(graph.ts[:n], dtype=np.float64)
    num_nodes = int(graph.num_nodes)
    if num_nodes < 0 or num_nodes * NODE_BYTES > host_memory_bytes():
        raise SamplerError(
            f"num_nodes={num_nodes:,} needs {max(num_nodes, 0) * NODE_BYTES:,} bytes of per-node arrays, "
            f"outside [0, {host_memory_bytes():,}] bytes of host memory; number the nodes densely "
            f"from 0 (the loaders do) so that num_nodes is the count of nodes")
    if n and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= num_nodes):
        raise SamplerError(f"event endpoints must lie in [0, num_nodes={num_nodes}); the graph "
                           f"has ids {min(src.min(), dst.min())}..{max(src.max(), dst.max())}")
    if n and not np.isfinite(ts).all():
        raise SamplerError("event times must be finite; repair the graph's timestamps")
    if n > 1 and (ts[1:] < ts[:-1]).any():
        i = int(np.argmax(ts[1:] < ts[:-1]))
        raise SamplerError(f"event times must be sorted: event {i + 1} has ts={ts[i + 1]} < "
                           f"ts={ts[i]} of event {i}; sort the events by time")
    return src, dst, ts
