"""CPU-topology-aware placement of sampler threads.

Threads whose root chunks touch the same nodes read the same adjacency lists; placing them on
cores that share a cache lets one thread's misses warm the other's reads. The topology is read
from ``/sys/devices/system/cpu`` (SMT siblings and the ``shared_cpu_list`` of every cache
level), threads are paired by networkx's maximum-weight matching on the overlap of their root
chunks, and each pair is placed on two CPUs of the smallest cache domain with room for it.

When there is nothing to exploit (one usable CPU, more threads than CPUs, no cache shared by two
usable CPUs, no sysfs) or networkx is not installed (the ``topology`` extra) :func:`plan_placement` returns a placement without CPUs and a reason, and
the sampler leaves its threads where the OS puts them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["CpuTopology", "Placement", "read_topology", "plan_placement", "static_chunks", "usable_cpus"]

SYSFS_CPU = "/sys/devices/system/cpu"


@dataclass
class CpuTopology:
    """The CPUs this process may run on and the groups of them that share a cache level."""

    cpus: List[int]
    # level (1, 2, 3, ...; SMT siblings are level 0) -> distinct CPU groups sharing that level
    shared: Dict[int, List[Tuple[int, ...]]] = field(default_factory=dict)


@dataclass
class Placement:
    """Where each sampler thread runs: ``cpus[t]`` for thread ``t``, or ``None`` and why."""

    cpus: Optional[List[int]]
    reason: str
    pairs: List[Tuple[int, int]] = field(default_factory=list)
    level: Optional[int] = None


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask where the OS keeps one, else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _parse_cpu_list(text: str) -> List[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]``."""
    cpus: List[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def read_topology(root: str = SYSFS_CPU, allowed: Optional[Sequence[int]] = None) -> CpuTopology:
    """Read SMT siblings and shared caches of the usable CPUs from sysfs (missing files: no sharing)."""
    if allowed is None:
        allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    usable = set(allowed)
    shared: Dict[int, set] = {}
    for cpu in sorted(usable):
        base = Path(root) / f"cpu{cpu}"
        entries = [(0, base / "topology" / "thread_siblings_list")]
        for index in sorted((base / "cache").glob("index*")):
            try:
                level = int((index / "level").read_text())
                kind = (index / "type").read_text().strip()
            except (OSError, ValueError):
                continue
            if kind != "Instruction":
                entries.append((level, index / "shared_cpu_list"))
        for level, path in entries:
            try:
                group = tuple(c for c in _parse_cpu_list(path.read_text()) if c in usable)
            except (OSError, ValueError):
                continue
            if len(group) >= 2:
                shared.setdefault(level, set()).add(group)
    return CpuTopology(sorted(usable), {lvl: sorted(g) for lvl, g in sorted(shared.items())})


def static_chunks(n: int, threads: int) -> List[slice]:
    """The contiguous chunks of ``range(n)`` that OpenMP's static schedule gives each thread
    (libgomp's rule: ``n // threads`` each, the first ``n % threads`` threads one more)."""
    q, r = divmod(n, max(threads, 1))
    starts = [t * q + min(t, r) for t in range(threads + 1)]
    return [slice(starts[t], starts[t + 1]) for t in range(threads)]


def _pair_threads(chunk_nodes: Sequence[np.ndarray]) -> List[Tuple[int, int]]:
    """Maximum-weight matching of threads, weighted by how many nodes their chunks share."""
    import networkx as nx

    sets = [np.unique(c) for c in chunk_nodes]
    graph = nx.Graph()
    graph.add_nodes_from(range(len(sets)))
    for a in range(len(sets)):
        for b in range(a + 1, len(sets)):
            weight = np.intersect1d(sets[a], sets[b], assume_unique=True).size
            graph.add_edge(a, b, weight=weight + 1)  # +1: pair threads even without overlap
    matching = nx.max_weight_matching(graph, maxcardinality=True)
    pairs = [tuple(sorted(p)) for p in matching]
    return sorted(pairs, key=lambda p: -graph.edges[p]["weight"])


def plan_placement(topology: CpuTopology, threads: int,
                   chunk_nodes: Sequence[np.ndarray]) -> Placement:
    """Pick a CPU per thread so that the threads with the most overlapping chunks share a cache."""
    cpus = topology.cpus
    if threads < 2:
        return Placement(None, "one sampler thread: nothing to share")
    if len(cpus) < threads:
        return Placement(None, f"{threads} threads on {len(cpus)} usable CPUs: pinning would "
                               f"oversubscribe")
    if not topology.shared:
        return Placement(None, "no cache shared by two usable CPUs")
    try:
        pairs = _pair_threads(chunk_nodes)
    except ImportError:
        return Placement(None, "networkx, which pairs the threads, is not installed; "
                               "pip install \"fastopt[topology]\" to pin them")
    free = list(cpus)
    chosen: Dict[int, int] = {}
    level_used = None
    for a, b in pairs:
        for level, groups in topology.shared.items():
            group = next((g for g in groups if sum(c in free for c in g) >= 2), None)
            if group is not None:
                ca, cb = [c for c in group if c in free][:2]
                chosen[a], chosen[b] = ca, cb
                free.remove(ca)
                free.remove(cb)
                level_used = level if level_used is None else min(level_used, level)
                break
    for t in range(threads):
        if t not in chosen:
            chosen[t] = free.pop(0)
    where = "SMT siblings" if level_used == 0 else f"L{level_used}"
    return Placement([chosen[t] for t in range(threads)],
                     f"paired threads {pairs} on CPUs sharing {where}", pairs, level_used)
