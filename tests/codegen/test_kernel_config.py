"""Thread mapping: heuristic defaults, knob overrides, limits."""

from __future__ import annotations

import pytest

import fastopt.config as fconfig
from fastopt.codegen.kernel_config import (FORWARD_ELEMENTS_PER_WARP, KernelConfig,
                                           heuristic_config, next_power_of_2)
from fastopt.errors import ConfigError, KernelError


@pytest.mark.parametrize("slots,heads,dim", [(1, 1, 16), (7, 2, 50), (10, 2, 100), (32, 4, 64),
                                             (10, 8, 1000)])
def test_heuristic_covers_the_problem(slots, heads, dim):
    cfg = heuristic_config(slots, heads, dim)
    assert cfg.block_d == next_power_of_2(dim)
    assert cfg.block_k * cfg.heads_per_program * cfg.block_d <= 8192
    assert 1 <= cfg.num_warps <= 8
    assert 2 <= heuristic_config(slots, heads, dim, row_tiles=False).num_warps <= 8
    rows, groups = cfg.grid(100, heads)
    assert rows * cfg.rows_per_program >= 100 and groups * cfg.heads_per_program >= heads


@pytest.mark.parametrize("dim,rows,warps", [(16, 4, 1), (50, 1, 1), (100, 1, 1), (300, 1, 2)])
def test_row_tiles_keep_a_warp_per_256_elements(dim, rows, warps):
    cfg = heuristic_config(10, 2, dim)
    assert (cfg.block_m, cfg.num_warps) == (rows, warps)
    assert cfg.tile_grid(1000, 2) == (-(-1000 // rows), 2 // cfg.heads_per_program)


@pytest.mark.parametrize("dim,warps", [(16, 1), (50, 1), (100, 2), (300, 4)])
def test_attention_forward_keeps_a_warp_per_128_elements(dim, warps):
    cfg = heuristic_config(10, 2, dim, warp_elements=FORWARD_ELEMENTS_PER_WARP)
    assert cfg.num_warps == warps
    assert cfg.block_m == heuristic_config(10, 2, dim).block_m


def test_hopper_gets_more_stages():
    assert heuristic_config(10, 2, 50, (9, 0)).num_stages > heuristic_config(10, 2, 50, (8, 0)).num_stages


def test_knobs_override_heuristics():
    with fconfig.patch(kernels__rows_per_program=4, kernels__num_warps=8, kernels__block_k=4,
                       kernels__heads_per_program=3):
        cfg = heuristic_config(10, 4, 50)
    assert (cfg.rows_per_program, cfg.num_warps, cfg.block_k, cfg.heads_per_program) == (4, 8, 4, 4)
    assert heuristic_config(10, 4, 50, apply_knobs=False).rows_per_program == 1
    with fconfig.patch(kernels__gather_eviction="evict_last"):
        assert heuristic_config(10, 4, 50).gather_eviction == "evict_last"
    with fconfig.patch(kernels__gather_eviction="none"):
        assert heuristic_config(10, 4, 50).gather_eviction == ""


@pytest.mark.parametrize("cfg,match", [
    (KernelConfig(block_k=12), "block_k=12 must be a power of two; use 16"),
    (KernelConfig(block_d=32), "block_d=32 is below the head dimension d=50; use block_d=64"),
    (KernelConfig(block_d=64, num_warps=0), "num_warps=0 must be >= 1"),
    (KernelConfig(block_d=64, gather_eviction="evict_first"), "gather_eviction='evict_first' is not"),
    (KernelConfig(block_d=64, max_registers=300), r"max_registers=300 is outside \[24, 255\]; use 0"),
])
def test_invalid_mapping_names_value_and_fix(cfg, match):
    with pytest.raises(KernelError, match=match):
        cfg.validate(10, 2, 50)


def test_config_rejects_unknown_backend():
    with pytest.raises(ConfigError, match="kernels.backend"):
        with fconfig.patch(kernels__backend="cuda"):
            pass


def test_config_rejects_register_caps_outside_the_hardware_range():
    with pytest.raises(ConfigError, match=r"kernels.max_registers must be 0 .* or in \[24, 255\] \(got 8\)"):
        with fconfig.patch(kernels__max_registers=8):
            pass
    with fconfig.patch(kernels__max_registers=64):
        assert heuristic_config(10, 2, 50).max_registers == 64
    assert heuristic_config(10, 2, 50).max_registers == 0


def test_op_overrides_apply_to_their_op_and_shape_only():
    """kernels.op_overrides sets the mapping of one fused op at one (K, H, d), over the global
    knobs; other ops and shapes keep theirs."""
    entry = "temporal_attention@10x4x50:block_m=2,rows_per_program=3,heads_per_program=2,gather_eviction=evict_last"
    with fconfig.patch(kernels__num_warps=4, kernels__op_overrides=entry + ";masked_aggregate@10x1x64:block_k=4"):
        cfg = heuristic_config(10, 4, 50, op="temporal_attention")
        assert (cfg.block_m, cfg.rows_per_program, cfg.heads_per_program, cfg.num_warps,
                cfg.gather_eviction) == (2, 3, 2, 4, "evict_last")
        other = heuristic_config(10, 4, 64, op="temporal_attention")  # another shape
        plain = heuristic_config(10, 4, 50)  # no op: global knobs only
        assert other.rows_per_program == plain.rows_per_program == 1 and other.num_warps == 4
        assert heuristic_config(10, 1, 64, op="masked_aggregate", row_tiles=False).block_k == 4
        assert heuristic_config(10, 1, 64, op="time_encode", row_tiles=False).block_k == 16
    with fconfig.patch(kernels__op_overrides="temporal_attention@10x4x50:gather_eviction=none",
                       kernels__gather_eviction="evict_last"):
        assert heuristic_config(10, 4, 50, op="temporal_attention").gather_eviction == ""


@pytest.mark.parametrize("text,match", [
    ("attention@10x2x50:block_m=1", "must start with one of temporal_attention"),
    ("temporal_attention@10x2:block_m=1", "a shape KxHxd of positive sizes"),
    ("temporal_attention@10x2x50:block_k=4", "temporal_attention has no field 'block_k'"),
    ("temporal_attention@10x2x50:block_m=3", "block_m must be a power of two >= 1 \\(got '3'\\)"),
    ("temporal_attention@10x2x50:num_warps=0", "num_warps must be an integer >= 1"),
    ("temporal_attention@10x2x50:max_registers=12", "max_registers must be in \\[24, 255\\]"),
    ("temporal_attention@10x2x50:gather_eviction=evict_first", "'none' or 'evict_last'"),
    ("temporal_attention@10x2x50:", "sets no field"),
    ("time_encode@64x1x8:num_warps=2;time_encode@64x1x8:block_k=8", "names 'time_encode@64x1x8' twice"),
])
def test_op_overrides_refuse_bad_entries(text, match):
    cfg = fconfig.Config()
    with pytest.raises(ConfigError, match=match):
        cfg.set("kernels.op_overrides", text)
    assert cfg.kernels.op_overrides == ""


def test_op_overrides_round_trip():
    text = "temporal_attention@10x2x50:num_warps=2,block_m=1; masked_aggregate@7x1x100:block_k=8"
    parsed = fconfig.parse_op_overrides(text)
    assert parsed == {("temporal_attention", (10, 2, 50)): {"num_warps": 2, "block_m": 1},
                      ("masked_aggregate", (7, 1, 100)): {"block_k": 8}}
    assert fconfig.parse_op_overrides(fconfig.format_op_overrides(parsed)) == parsed
