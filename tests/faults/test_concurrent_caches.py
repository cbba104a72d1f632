"""Processes racing for one cache: several compile the same kernels into one kernel cache, several
parse the same dataset into one .npz cache entry, from an empty cache or over a damaged entry.
Every process succeeds with the right answer, and the cache is left whole."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fault_helpers import TALLY, finish, spawn

PROCESSES = 2

# Each child waits for the go file, so that all of them reach the cache at once.
BARRIER = r"""
import os, sys, time
go = sys.argv[1]
while not os.path.exists(go):
    time.sleep(0.005)
"""

KERNELS = BARRIER + r"""
import json
import torch
import fastopt.codegen as cg
from fastopt.codegen import reference
from fastopt.codegen.cache import kernel_cache

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(n, 2, 8, generator=g) for n in (4, 6, 6))
index = torch.randint(0, 6, (4, 5), generator=g)
mask = torch.arange(5)[None, :] < torch.tensor([0, 5, 2, 3])[:, None]
out = cg.temporal_attention(q, k, v, mask, k_index=index, v_index=index)
torch.testing.assert_close(out, reference.temporal_attention(q, k, v, mask, k_index=index, v_index=index))
agg = cg.masked_aggregate(k, mask, index=index, reduce="mean")
torch.testing.assert_close(agg, reference.masked_aggregate(k, mask, index=index, reduce="mean"))
print(json.dumps(kernel_cache().stats))
"""

DATASET = BARRIER + r"""
import hashlib, warnings
from fastopt.data import load_file
if sys.argv[3] == "silent":  # the entry must be whole: used without a warning
    warnings.simplefilter("error")
g = load_file(sys.argv[2], cache=sys.argv[3] != "uncached")
print(hashlib.sha256(g.src.tobytes() + g.dst.tobytes() + g.ts.tobytes() + g.labels.tobytes()).hexdigest())
"""


def race(script: str, go, args=(), processes: int = PROCESSES, **env) -> list:
    """Start the children, release them together by creating ``go``, return the last line each
    printed (each must exit 0)."""
    procs = [spawn(["-c", script, str(go), *map(str, args)], **env) for _ in range(processes)]
    go.touch()
    return [finish(p).strip().splitlines()[-1] for p in procs]


@pytest.mark.interpreter
@pytest.mark.parametrize("start", ["empty", "damaged"])
def test_processes_compiling_the_same_kernels_all_succeed(tmp_path, start):
    cache_dir = tmp_path / "kernels"
    env = dict(TRITON_INTERPRET="1", FASTOPT_KERNELS_BACKEND="triton", FASTOPT_KERNELS_CACHE_DIR=str(cache_dir))
    if start == "damaged":  # fill the cache once, then truncate every module in it
        race(KERNELS, tmp_path / "first", processes=1, **env)
        for entry in cache_dir.glob("fo_*.py"):
            entry.write_text(entry.read_text()[:100])
            TALLY["faults"] += 1
    stats = [json.loads(line) for line in race(KERNELS, tmp_path / "go", **env)]
    TALLY["faults"] += 1  # the race itself
    assert len(stats) == PROCESSES
    if start == "damaged":
        assert all(s["disk_hits"] + s["rebuilt"] == 2 for s in stats)
        assert sum(s["rebuilt"] for s in stats) >= 1
    assert not list(cache_dir.glob("*.tmp")), "a temporary file was left behind"
    modules = sorted(cache_dir.glob("fo_*.py"))
    assert len(modules) == 2 and len(list(cache_dir.glob("fo_*.json"))) == 2
    # what the race left is whole: the next process takes every entry from disk, silently
    (again,) = map(json.loads, race(KERNELS, tmp_path / "again", processes=1, **env))
    assert again["disk_hits"] == 2 and again["rebuilt"] == again["writes"] == 0
    TALLY["oracle_equal"] += PROCESSES


@pytest.mark.parametrize("start", ["empty", "damaged"])
def test_processes_parsing_the_same_dataset_all_succeed(tmp_path, start):
    rng = np.random.default_rng(0)
    n = 20_000
    rows = np.c_[rng.integers(0, 500, n), rng.integers(0, 300, n), np.sort(rng.uniform(0, 1e6, n)).round(3),
                 rng.integers(0, 2, n)]
    source = tmp_path / "events.csv"
    source.write_text("u,i,ts,label\n" + "\n".join(",".join(map(str, r)) for r in rows.tolist()) + "\n")
    # the children cache under tmp_path, wherever the loaders put their entries
    cache_dir = tmp_path / "xdg" / "fastopt" / "datasets"
    env = dict(XDG_CACHE_HOME=str(tmp_path / "xdg"), FASTOPT_DATA_CACHE_DIR=str(cache_dir))

    def entries():
        return list(tmp_path.rglob("events.csv.*.npz"))

    (expected,) = race(DATASET, tmp_path / "uncached", args=[source, "uncached"], processes=1, **env)
    if start == "damaged":
        race(DATASET, tmp_path / "first", args=[source, "cached"], processes=1, **env)
        (entry,) = entries()
        entry.write_bytes(entry.read_bytes()[:1000])
        TALLY["faults"] += 1
    digests = race(DATASET, tmp_path / "go", args=[source, "cached"], **env)
    TALLY["faults"] += 1
    assert digests == [expected] * PROCESSES
    assert not list(tmp_path.rglob("*.tmp*")), "a temporary file was left behind"
    assert len(entries()) == 1
    assert race(DATASET, tmp_path / "again", args=[source, "silent"], processes=1, **env) == [expected]
    TALLY["oracle_equal"] += PROCESSES
