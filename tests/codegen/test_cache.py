"""The content-addressed kernel cache: key sensitivity, atomic files, reuse, miss explanations."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from fastopt.codegen import kernels
from fastopt.codegen.cache import KERNEL_NAME_PLACEHOLDER, CacheKey, KernelCache
from fastopt.codegen.kernel_config import KernelConfig

SOURCE = f"""
import triton
import triton.language as tl


@triton.jit
def {KERNEL_NAME_PLACEHOLDER}(X, N):
    offs = tl.arange(0, 8)
    tl.store(X + offs, offs.to(tl.float32) * 2.0, mask=offs < N)
"""

VERSIONS = {"torch": "2.11.0", "triton": "3.6.0", "fastopt": "0.1.0"}


def _key(**changes) -> CacheKey:
    key = CacheKey.build("demo", SOURCE, KernelConfig(), torch.device("cpu"), VERSIONS)
    return dataclasses.replace(key, **changes)


@pytest.mark.parametrize("field,value", [
    ("family", "other"),
    ("source_sha256", "0" * 64),
    ("config", json.dumps(KernelConfig(num_warps=8).to_dict(), sort_keys=True)),
    ("device_name", "NVIDIA H200"),
    ("capability", "9.0"),
    ("torch_version", "2.12.0"),
    ("triton_version", "3.7.0"),
    ("fastopt_version", "0.2.0"),
])
def test_each_component_changes_the_key(field, value):
    base = _key()
    changed = _key(**{field: value})
    assert changed.digest != base.digest
    assert changed.kernel_name != base.kernel_name
    assert set(base.differences(changed)) == {field}


def test_build_hashes_source_config_and_versions():
    base = CacheKey.build("demo", SOURCE, KernelConfig(), torch.device("cpu"), VERSIONS)
    assert CacheKey.build("demo", SOURCE + "\n", KernelConfig(), torch.device("cpu"),
                          VERSIONS).digest != base.digest
    for field in dataclasses.fields(KernelConfig):
        value = getattr(KernelConfig(), field.name)
        other = dataclasses.replace(KernelConfig(), **{field.name: "evict_last" if isinstance(
            value, str) else 2 * value or 64})
        assert CacheKey.build("demo", SOURCE, other, torch.device("cpu"),
                              VERSIONS).digest != base.digest, field.name
    for package in VERSIONS:
        versions = dict(VERSIONS, **{package: "9.9"})
        assert CacheKey.build("demo", SOURCE, KernelConfig(), torch.device("cpu"),
                              versions).digest != base.digest, package
    assert base.kernel_name.startswith("fo_demo_") and len(base.kernel_name) == len("fo_demo_") + 8


@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="launches on the CPU")
def test_load_writes_once_imports_and_reuses(tmp_path):
    cache = KernelCache(tmp_path)
    key = _key()
    fn = cache.load(key, SOURCE)
    assert cache.stats == {"memory_hits": 0, "disk_hits": 0, "writes": 1, "rebuilt": 0}
    module, meta = cache.paths(key)
    assert module.read_text() == SOURCE.replace(KERNEL_NAME_PLACEHOLDER, key.kernel_name)
    assert json.loads(meta.read_text())["source_sha256"] == key.source_sha256
    assert not list(tmp_path.glob("*.tmp")), "no temporary file may remain"
    assert cache.load(key, SOURCE) is fn
    assert cache.stats["memory_hits"] == 1
    fresh = KernelCache(tmp_path)
    fresh.load(key, SOURCE)
    assert fresh.stats == {"memory_hits": 0, "disk_hits": 1, "writes": 0, "rebuilt": 0}
    x = torch.full((8,), -1.0)
    fn[(1,)](x, 5)
    assert x.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, -1.0, -1.0, -1.0]


@pytest.mark.interpreter  # the rebuilt entry is imported, and it imports triton
@pytest.mark.parametrize("damage", ["truncated", "altered", "empty"])
def test_a_damaged_entry_is_rebuilt_and_reported_never_imported(tmp_path, damage):
    cache = KernelCache(tmp_path)
    key = _key()
    module, _ = cache.paths(key)
    good = SOURCE.replace(KERNEL_NAME_PLACEHOLDER, key.kernel_name)
    marker = tmp_path / "executed"
    module.write_text({
        "truncated": good[: len(good) // 2],
        # valid Python that would leave a trace if it ran
        "altered": f"open({str(marker)!r}, 'w').close()\n" + good,
        "empty": "",
    }[damage])
    with pytest.warns(RuntimeWarning, match="does not match its key.*rebuilt"):
        fn = cache.load(key, SOURCE)
    assert not marker.exists()
    assert cache.stats["writes"] == 1 and cache.stats["rebuilt"] == 1
    assert module.read_text() == good and fn.__name__ == key.kernel_name


@pytest.mark.interpreter  # loads an entry, which imports triton
def test_describe_explains_a_miss(tmp_path):
    cache = KernelCache(tmp_path)
    first = _key()
    assert "miss: no demo kernel" in cache.describe(first)
    cache.load(first, SOURCE)
    assert cache.describe(first).startswith("hit:")
    newer = _key(triton_version="3.7.0")
    text = cache.describe(newer)
    assert text.startswith("miss:") and first.module_name in text
    assert "triton_version ('3.7.0' vs cached '3.6.0')" in text
    assert "device_name" not in text.splitlines()[0]
    assert "capability: 0.0" in first.describe()


def test_generated_kernels_are_named_by_family_and_hash(kernel_cache_dir):
    source = kernels.render("segment_reduce", K=3, H=2, D=5, dtype="tl.float32", acc="tl.float32",
                            block_m=4, rows=1, block_h=2, block_d=8, pair=False)
    assert f"def {KERNEL_NAME_PLACEHOLDER}(" in source
    assert "{{" not in source and "{%" not in source
    key = CacheKey.build("segment_reduce", source, KernelConfig(), torch.device("cpu"))
    assert key.kernel_name.startswith("fo_segment_reduce_")
