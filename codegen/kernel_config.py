"""Thread mapping of the generated kernels: :class:`KernelConfig` and its heuristic defaults.

A program of every kernel family handles ``rows_per_program`` destination (or table) rows and
``heads_per_program`` heads. The attention and segmented-reduction families hold ``block_m`` rows
side by side as one ``[block_m, lanes]`` tile (a program then covers ``rows_per_program`` such tiles)
and loop over neighbor slots; masked aggregation processes slots ``block_k`` at a time as a
``[block_k, block_d]`` tile. Defaults come from :func:`heuristic_config` (tile sizes from the
shape, warps from the tile and the GPU); every non-zero knob of ``config.kernels`` (set by the
tuner or ``FASTOPT_KERNELS_*``) overrides its heuristic, and an entry of
``config.kernels.op_overrides`` for the fused op and its ``(K, H, d)`` problem overrides both
(the tuner searches the mapping per fused op that way).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Dict, Tuple

from fastopt.config import default_config, parse_op_overrides
from fastopt.errors import KernelError

__all__ = ["KernelConfig", "heuristic_config", "op_override", "op_problem", "attention_mapping",
           "next_power_of_2", "FORWARD_ELEMENTS_PER_WARP", "MAX_TILE", "TIME_ENCODE_SLOTS"]

# Elements of one [block_k, heads, block_d] register tile above which heads are split over programs.
MAX_TILE = 8192
# Elements of the [block_m, lanes] row tile the heuristic aims for, and per warp of it.
ROW_TILE = 128
ELEMENTS_PER_WARP = 256
# The attention forward's warp share: its loop body is gathers and one reduction per slot, and
# spreading a row over more warps keeps more of them in flight (H200, K=10, H=2, d=100, M=18,000:
# forward 48.6 us on one warp, 45.7 on two; the backward, with three reductions per slot, is
# faster on one: f+b 0.2251 against 0.2273 ms with both on two). d=50 stays on one warp (24.2
# against 33.4 us).
FORWARD_ELEMENTS_PER_WARP = 128
# Widest head dimension one tile holds (block_d covers d in one piece).
MAX_BLOCK_D = 4096
# Time differences per time-encoding program (the K of its (K, 1, T) problem; block_k may change it).
TIME_ENCODE_SLOTS = 64


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _power_of_2(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


@dataclass(frozen=True)
class KernelConfig:
    """How a kernel maps work to programs and lanes (all sizes powers of two but rows/warps/stages).

    Attributes:
        rows_per_program: Destination (or table) rows one program handles, one after another
            (row tiles of ``block_m`` rows in the tiled families).
        block_m: Rows held side by side in one tile (attention, segmented reduction).
        block_k: Neighbor slots per tile (masked aggregation); slots beyond it are handled in
            further tiles.
        block_d: Lanes over the head dimension; must cover ``d`` (next power of two).
        heads_per_program: Heads per program; the grid's second axis covers the rest.
        num_warps: Warps per program.
        num_stages: Software-pipelining stages.
        max_registers: Registers per thread the compiler may use (``maxnreg``; more programs fit
            a multiprocessor, at the risk of spills), ``0`` for the compiler's choice.
        gather_eviction: L2 eviction hint of table-row gathers (``"evict_last"``; streamed
            inputs and outputs then get ``"evict_first"``), or ``""`` for none.
    """

    rows_per_program: int = 1
    block_m: int = 16
    block_k: int = 16
    block_d: int = 64
    heads_per_program: int = 1
    num_warps: int = 4
    num_stages: int = 2
    max_registers: int = 0
    gather_eviction: str = ""

    def validate(self, slots: int, heads: int, dim: int) -> "KernelConfig":
        """Raise :class:`KernelError` if this mapping cannot run a ``K, H, d`` problem."""
        for name in ("block_m", "block_k", "block_d", "heads_per_program"):
            value = getattr(self, name)
            if not _power_of_2(value):
                raise KernelError(
                    f"KernelConfig.{name}={value} must be a power of two; use "
                    f"{next_power_of_2(max(value, 1))}"
                )
        if self.block_d < dim:
            raise KernelError(
                f"KernelConfig.block_d={self.block_d} is below the head dimension d={dim}; use "
                f"block_d={next_power_of_2(dim)}"
            )
        if self.block_d > MAX_BLOCK_D:
            raise KernelError(
                f"KernelConfig.block_d={self.block_d} exceeds the limit {MAX_BLOCK_D}; split the "
                f"feature dimension (d={dim}) into heads"
            )
        if self.gather_eviction not in ("", "evict_last"):
            raise KernelError(
                f"KernelConfig.gather_eviction={self.gather_eviction!r} is not a gather hint; use "
                f"'evict_last' or '' (none)"
            )
        for name in ("rows_per_program", "num_warps", "num_stages"):
            value = getattr(self, name)
            if value < 1:
                raise KernelError(f"KernelConfig.{name}={value} must be >= 1; use 1")
        if self.max_registers and not 24 <= self.max_registers <= 255:
            raise KernelError(f"KernelConfig.max_registers={self.max_registers} is outside "
                              f"[24, 255]; use 0 (the compiler's choice) or a value in that range")
        return self

    def grid(self, rows: int, heads: int) -> Tuple[int, int]:
        """Programs along (rows, head groups)."""
        return (-(-rows // self.rows_per_program), -(-heads // self.heads_per_program))

    def tile_grid(self, rows: int, heads: int) -> Tuple[int, int]:
        """Programs along (row tiles, head groups) for the families that tile ``block_m`` rows."""
        return (-(-rows // (self.rows_per_program * self.block_m)),
                -(-heads // self.heads_per_program))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def heuristic_config(slots: int, heads: int, dim: int, capability: Tuple[int, int] = (0, 0),
                     apply_knobs: bool = True, row_tiles: bool = True,
                     warp_elements: int = ELEMENTS_PER_WARP, op: str = "") -> KernelConfig:
    """Default mapping for a ``K, H, d`` problem on a GPU of the given compute capability.

    All heads share a program while the ``[block_k, H, block_d]`` tile stays within
    :data:`MAX_TILE` elements; ``block_k`` covers K when it fits. Row-tiled families (attention,
    segmented reduction) get ``block_m`` rows of about :data:`ROW_TILE` elements and one warp per
    ``warp_elements`` (:data:`ELEMENTS_PER_WARP`; :data:`FORWARD_ELEMENTS_PER_WARP` for the
    attention forward) elements: on an H200 (K = 10, H = 2, d = 50 and 100, M = 18,000), one
    row per one-warp program ran forward+backward in 0.19 / 0.24 ms against 0.34 / 0.61 ms for 16
    (8) rows on 4 warps and 0.21 / 0.64 ms for 8 rows on 8 warps: a warp's reductions stay in
    registers, and many small programs keep the most row gathers in flight. The slot-tiled
    families (masked aggregation, time encoding) get a warp per 512 elements of their
    ``[block_k, block_d]`` tile, 2 to 8. Hopper and newer get one more pipelining stage.

    Args:
        slots: Neighbor slots K.
        heads: Heads H.
        dim: Head dimension d.
        capability: CUDA compute capability, ``(0, 0)`` for the CPU interpreter.
        apply_knobs: Let non-zero ``config.kernels`` knobs override the heuristics, and the
            ``config.kernels.op_overrides`` entry of ``op`` at this ``(K, H, d)`` override them.
        row_tiles: Warps for a ``[block_m, lanes]`` row tile (else for a slot tile).
        warp_elements: Elements of a row tile per warp.
        op: The fused operator the kernel runs for (``"temporal_attention"``, ...), ``""`` for
            none: the key of its ``op_overrides`` entries.
    """
    block_d = next_power_of_2(dim)
    block_k = next_power_of_2(slots)
    heads_per_program = next_power_of_2(heads)
    if block_k * heads_per_program * block_d > MAX_TILE:
        heads_per_program = 1
    block_k = max(1, min(block_k, MAX_TILE // (heads_per_program * block_d)))
    lanes = next_power_of_2(heads_per_program * dim)
    block_m = max(1, min(64, ROW_TILE // lanes))
    if row_tiles:
        num_warps = max(1, min(8, block_m * lanes // warp_elements))
    else:
        num_warps = max(2, min(8, block_k * block_d // 512))
    num_stages = 3 if capability[0] >= 9 else 2
    cfg = KernelConfig(rows_per_program=1, block_m=block_m, block_k=block_k, block_d=block_d,
                       heads_per_program=heads_per_program, num_warps=num_warps,
                       num_stages=num_stages)
    if apply_knobs:
        knobs = default_config().kernels
        changes = {name: getattr(knobs, name) for name in
                   ("rows_per_program", "heads_per_program", "num_warps", "num_stages", "block_k",
                    "block_m", "max_registers")
                   if getattr(knobs, name)}
        if knobs.gather_eviction != "auto":
            changes["gather_eviction"] = knobs.gather_eviction
        changes.update(op_override(op, (slots, heads, dim)))
        if "heads_per_program" in changes:
            changes["heads_per_program"] = next_power_of_2(min(changes["heads_per_program"], heads))
        if changes.get("gather_eviction") == "none":
            changes["gather_eviction"] = ""
        cfg = dataclasses.replace(cfg, **changes)
    return cfg.validate(slots, heads, dim)


def op_problem(op: str, sizes: Tuple[int, ...]) -> Tuple[int, int, int]:
    """The ``(K, H, d)`` problem under which the kernels of fused op ``op`` pick their mapping
    and read their ``config.kernels.op_overrides`` entry, from the op's sizes: the attention's
    ``(K, H, d)`` as they are, masked aggregation's ``(K, *feature)`` as ``(K, 1, product of the
    feature sizes)``, the time encoding's ``(T,)`` as ``(TIME_ENCODE_SLOTS, 1, T)``.

    Raises:
        KernelError: an op without kernels of its own, or sizes of another form.
    """
    sizes = tuple(int(n) for n in sizes)
    if op in ("temporal_attention", "shared_attention") and len(sizes) == 3:
        return sizes
    if op == "masked_aggregate" and len(sizes) >= 1:
        return (sizes[0], 1, math.prod(sizes[1:]))
    if op == "time_encode" and len(sizes) == 1:
        return (TIME_ENCODE_SLOTS, 1, sizes[0])
    raise KernelError(f"no kernel problem for op {op!r} of sizes {sizes}; ops with kernels: "
                      f"temporal_attention / shared_attention (K, H, d), masked_aggregate "
                      f"(K, *feature), time_encode (T,)")


def op_override(op: str, problem: Tuple[int, int, int]) -> Dict[str, object]:
    """The fields ``config.kernels.op_overrides`` sets for fused op ``op`` at ``problem``."""
    return _parsed(default_config().kernels.op_overrides).get((op, tuple(problem)), {}) if op else {}


@functools.lru_cache(maxsize=16)
def _parsed(text: str) -> dict:
    return parse_op_overrides(text)


def attention_mapping(slots: int, heads: int, dim: int) -> str:
    """The temporal-attention kernels' mapping for a ``K, H, d`` problem, in words: the forward's
    knobs, and the backward's warps where they differ (what a rewrite report shows)."""
    cfg = heuristic_config(slots, heads, dim, warp_elements=FORWARD_ELEMENTS_PER_WARP,
                           op="temporal_attention")
    knobs = ", ".join(f"{k}={v}" for k, v in cfg.to_dict().items())
    backward = heuristic_config(slots, heads, dim, op="temporal_attention").num_warps
    extra = f" (backward: num_warps={backward})" if backward != cfg.num_warps else ""
    return f"K={slots} H={heads} d={dim}: {knobs}{extra}"
