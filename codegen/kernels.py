"""Generate, cache and launch the Triton kernels: the machinery every family's launchers share.

A launcher reads the shapes and forms of its inputs into a *specialization* (K, H, d, dtype, mask
form, indexing, dropout, ...), and :func:`specialize` turns it into a kernel: it picks a
:class:`KernelConfig` (:func:`~fastopt.codegen.kernel_config.heuristic_config`), renders the
family's template (``families/<family>.py.jinja``) and gets the kernel from the
content-addressed cache (:mod:`fastopt.codegen.cache`), once per process and specialization.
Families whose tiles do not follow a ``(K, H, d)`` problem choose their mapping and call
:func:`fixed`. Inputs are already validated by the family's checks.

Accumulation is float32 for float16/bfloat16/float32 inputs and float64 for float64 inputs (so
``gradcheck`` runs the kernels themselves): :func:`fastopt.codegen.layout.acc_dtype`.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from fastopt.codegen.cache import KERNEL_NAME_PLACEHOLDER, CacheKey, device_identity, kernel_cache
from fastopt.codegen.kernel_config import (ELEMENTS_PER_WARP, KernelConfig, heuristic_config,
                                           next_power_of_2)
from fastopt.config import default_config

__all__ = [
    "TL_DTYPES",
    "render",
    "Specialized",
    "specialize",
    "fixed",
    "compiled_resources",
    "pipeline_stages",
    "multiprocessors",
    "empty",
    "empty_like",
]

TEMPLATE_DIR = Path(__file__).parent / "families"

TL_DTYPES = {
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
}


@functools.lru_cache(maxsize=None)
def _templates():
    # Imported on first render: importing fastopt.codegen (and running the references) needs
    # neither jinja2 nor triton.
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.globals["next_power_of_2"] = next_power_of_2
    return env


def render(family: str, **spec) -> str:
    """Source of ``families/<family>.py.jinja`` for one specialization (kernel unnamed)."""
    summary = ", ".join(f"{k}={v}" for k, v in sorted(spec.items()))
    return _templates().get_template(f"{family}.py.jinja").render(
        name=KERNEL_NAME_PLACEHOLDER, summary=summary, **spec)


class Specialized(NamedTuple):
    """A compiled-on-first-launch kernel and the thread mapping it was generated for."""

    fn: object
    cfg: KernelConfig

    def launch(self, grid: Tuple[int, int], *args) -> None:
        if grid[0] == 0:
            return
        extra = {"maxnreg": self.cfg.max_registers} if self.cfg.max_registers else {}
        self.fn[grid](*args, num_warps=self.cfg.num_warps, num_stages=self.cfg.num_stages, **extra)


# (family, device, problem, knobs, spec) -> Specialized. Rendering, hashing and the cache lookup
# run once per specialization; a warm call only packs arguments and launches.
_SPECIALIZED: Dict[tuple, Specialized] = {}


def _knobs() -> tuple:
    knobs = default_config().kernels
    return (knobs.rows_per_program, knobs.block_m, knobs.heads_per_program, knobs.block_k,
            knobs.num_warps, knobs.num_stages, knobs.max_registers, knobs.gather_eviction,
            knobs.op_overrides, knobs.cache_dir)


def specialize(family: str, device: torch.device, problem: Tuple[int, int, int],
               derive: Callable[[KernelConfig], dict] = lambda cfg: {}, *, row_tiles: bool,
               warp_elements: int = ELEMENTS_PER_WARP, all_heads: bool = False,
               op: Optional[str] = None, **spec) -> Specialized:
    """The kernel of ``family`` for ``spec`` on a ``(K, H, d)`` problem, memoized per process.

    ``derive`` maps the thread mapping to template variables beyond the common ones (it must
    depend on nothing but the mapping and ``spec``, which are part of the memo key);
    ``row_tiles``: the family's programs hold ``[block_m, lanes]`` row tiles (else they tile
    neighbor slots); ``warp_elements``: the row-tile elements per warp of the heuristic mapping;
    ``all_heads``: every head in one program, whatever the heuristic or the knobs say (a kernel
    that sums over heads); ``op``: the fused operator the kernel runs for, whose
    ``config.kernels.op_overrides`` entries at ``problem`` apply (default: ``family``; ``""``:
    none).
    """
    op = family if op is None else op
    key = (family, device, problem, _knobs(), row_tiles, warp_elements, all_heads, op,
           tuple(sorted(spec.items())))
    hit = _SPECIALIZED.get(key)
    if hit is None:
        cfg = heuristic_config(*problem, _capability(device), row_tiles=row_tiles,
                               warp_elements=warp_elements, op=op)
        if all_heads:
            cfg = dataclasses.replace(cfg, heads_per_program=next_power_of_2(problem[1]))
        source = render(family, rows=cfg.rows_per_program, block_m=cfg.block_m, block_k=cfg.block_k,
                        block_d=cfg.block_d, block_h=min(cfg.heads_per_program, problem[1]),
                        num_warps=cfg.num_warps, gather_eviction=cfg.gather_eviction,
                        **derive(cfg), **spec)
        fn = kernel_cache().load(CacheKey.build(family, source, cfg, device), source)
        hit = _SPECIALIZED[key] = Specialized(fn, cfg)
    return hit


def fixed(family: str, device: torch.device, cfg: KernelConfig, **spec) -> Specialized:
    """The kernel of ``family`` for ``spec`` under a mapping its caller chose (the families whose
    tiles do not follow a ``(K, H, d)`` problem), memoized per process."""
    key = (family, device, cfg, default_config().kernels.cache_dir, tuple(sorted(spec.items())))
    hit = _SPECIALIZED.get(key)
    if hit is None:
        source = render(family, **spec)
        fn = kernel_cache().load(CacheKey.build(family, source, cfg, device), source)
        hit = _SPECIALIZED[key] = Specialized(fn, cfg)
    return hit


def compiled_resources() -> List[dict]:
    """Registers and spills per thread and shared memory per program of every kernel this
    process compiled (Triton's metadata), with its family, specialization and thread mapping:
    how many programs fit a multiprocessor, and whether the unrolled loops spill. Empty under
    the CPU interpreter, which compiles nothing."""
    found = []
    for key, hit in _SPECIALIZED.items():
        spec = dict(key[-1])
        for entry in getattr(hit.fn, "device_caches", {}).values():
            for compiled in entry[0].values():
                found.append(dict(
                    family=key[0], shape=key[2], stage=spec.get("stage", ""),
                    spec={k: v for k, v in spec.items() if isinstance(v, (int, float, str, bool))},
                    mapping=hit.cfg.to_dict(), n_regs=getattr(compiled, "n_regs", None),
                    n_spills=getattr(compiled, "n_spills", None),
                    shared_bytes=getattr(getattr(compiled, "metadata", None), "shared", None)))
    return found


def _capability(device: torch.device) -> Tuple[int, int]:
    return tuple(int(x) for x in device_identity(device)[1].split("."))


def pipeline_stages(device: torch.device) -> int:
    """Software-pipelining stages of a mapping chosen by hand: one more on Hopper and newer."""
    return 3 if _capability(device)[0] >= 9 else 2


def multiprocessors(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (4 under the CPU interpreter), for grids sized to fill it."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def empty(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """An output buffer every element of which the kernel must write (NaN-filled when poisoning)."""
    if default_config().kernels.poison_outputs:
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def empty_like(t: Tensor) -> Tensor:
    return empty(t.shape, t.dtype, t.device)
