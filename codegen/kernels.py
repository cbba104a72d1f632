"""Specialize, generate, cache and launch the Triton kernels of the fused operators.

Each launcher reads the shapes and forms of its inputs into a *specialization* (K, H, d, dtype,
mask form, indexing, dropout, time encoding), picks a :class:`KernelConfig`
(:func:`~fastopt.codegen.kernel_config.heuristic_config`), renders the family's template
(``templates/<family>.py.jinja``) and gets the kernel from the content-addressed cache
(:mod:`fastopt.codegen.cache`). Inputs are already validated by :mod:`fastopt.codegen.checks`.

Accumulation is float32 for float16/bfloat16/float32 inputs and float64 for float64 inputs (so
``gradcheck`` runs the kernels themselves).
"""

from __future__ import annotations

import dataclasses

import math
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jinja2
import torch
from torch import Tensor

from fastopt.codegen import checks, reference
from fastopt.codegen.cache import KERNEL_NAME_PLACEHOLDER, CacheKey, device_identity, kernel_cache
from fastopt.codegen.kernel_config import (ELEMENTS_PER_WARP, FORWARD_ELEMENTS_PER_WARP,
                                           KernelConfig, heuristic_config, next_power_of_2)
from fastopt.config import default_config
from fastopt.errors import KernelError

__all__ = [
    "attention_forward",
    "attention_backward",
    "aggregate_forward",
    "aggregate_backward",
    "time_encode_forward",
    "time_encode_backward",
    "segment_reduce",
    "column_sum",
    "render",
    "compiled_resources",
]

_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
)
_TEMPLATES.globals["next_power_of_2"] = next_power_of_2

_TL_DTYPES = {
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
}


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def render(family: str, **spec) -> str:
    """Source of ``templates/<family>.py.jinja`` for one specialization (kernel unnamed)."""
    summary = ", ".join(f"{k}={v}" for k, v in sorted(spec.items()))
    return _TEMPLATES.get_template(f"{family}.py.jinja").render(
        name=KERNEL_NAME_PLACEHOLDER, summary=summary, **spec)


class _Specialized(NamedTuple):
    """A compiled-on-first-launch kernel and the thread mapping it was generated for."""

    fn: object
    cfg: KernelConfig

    def launch(self, grid: Tuple[int, int], *args) -> None:
        if grid[0] == 0:
            return
        extra = {"maxnreg": self.cfg.max_registers} if self.cfg.max_registers else {}
        self.fn[grid](*args, num_warps=self.cfg.num_warps, num_stages=self.cfg.num_stages, **extra)


# Families whose programs hold [block_m, lanes] row tiles (the others tile neighbor slots).
_ROW_TILED_FAMILIES = ("temporal_attention", "segment_reduce")

# (family, device, problem, knobs, spec) -> _Specialized. Rendering, hashing and the cache lookup
# run once per specialization; a warm call only packs arguments and launches.
_SPECIALIZED: Dict[tuple, _Specialized] = {}


def _knobs() -> tuple:
    knobs = default_config().kernels
    return (knobs.rows_per_program, knobs.block_m, knobs.heads_per_program, knobs.block_k,
            knobs.num_warps, knobs.num_stages, knobs.max_registers, knobs.gather_eviction,
            knobs.cache_dir)


def _kernel(family: str, device: torch.device, problem: Tuple[int, int, int],
            derive: Callable[[KernelConfig], dict] = lambda cfg: {},
            warp_elements: int = ELEMENTS_PER_WARP, all_heads: bool = False,
            **spec) -> _Specialized:
    """The kernel of ``family`` for ``spec`` on a ``(K, H, d)`` problem, memoized per process.

    ``derive`` maps the thread mapping to template variables beyond the common ones (it must
    depend on nothing but the mapping and ``spec``, which are part of the memo key);
    ``warp_elements``: the row-tile elements per warp of the heuristic mapping; ``all_heads``:
    every head in one program, whatever the heuristic or the knobs say (a kernel that sums over
    heads).
    """
    key = (family, device, problem, _knobs(), warp_elements, all_heads,
           tuple(sorted(spec.items())))
    hit = _SPECIALIZED.get(key)
    if hit is None:
        cfg = heuristic_config(*problem, _capability(device),
                               row_tiles=family in _ROW_TILED_FAMILIES,
                               warp_elements=warp_elements)
        if all_heads:
            cfg = dataclasses.replace(cfg, heads_per_program=next_power_of_2(problem[1]))
        source = render(family, rows=cfg.rows_per_program, block_m=cfg.block_m, block_k=cfg.block_k,
                        block_d=cfg.block_d, block_h=min(cfg.heads_per_program, problem[1]),
                        num_warps=cfg.num_warps, gather_eviction=cfg.gather_eviction,
                        **derive(cfg), **spec)
        fn = kernel_cache().load(CacheKey.build(family, source, cfg, device), source)
        hit = _SPECIALIZED[key] = _Specialized(fn, cfg)
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


def _empty(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """An output buffer every element of which the kernel must write (NaN-filled when poisoning)."""
    if default_config().kernels.poison_outputs:
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def _empty_like(t: Tensor) -> Tensor:
    return _empty(t.shape, t.dtype, t.device)


def _mask_form(mask: Optional[Tensor], indptr: Optional[Tensor]) -> str:
    if mask is not None:
        return "mask"
    return "csr" if indptr is not None else "none"


def _mask_arg(mask: Optional[Tensor], indptr: Optional[Tensor], dummy: Tensor) -> Tuple[Tensor, Tensor]:
    mask_arg = mask.view(torch.uint8) if mask is not None else dummy
    return mask_arg, indptr if indptr is not None else dummy


def _dropout_args(dropout_p: float) -> Tuple[int, float]:
    return reference.dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p)


# ----------------------------------------------------------------------------------------------
# temporal attention
# ----------------------------------------------------------------------------------------------


def _attention_spec(q: Tensor, k: Tensor, v: Tensor, mask, indptr, k_index, v_index,
                    dropout_p: float, stage: str, seed=0) -> dict:
    rows, heads, dim = q.shape
    slots = (k_index if k_index is not None else k).shape[1]
    strides = [checks.row_stride(t, index is None) for t, index in ((k, k_index), (v, v_index))]
    if None in strides:
        raise KernelError("attention keys and values need rows of H*d contiguous elements, evenly "
                          f"spaced (strides {tuple(k.stride())}, {tuple(v.stride())}); pass "
                          ".contiguous() tensors")
    align = 16 // q.element_size() if default_config().kernels.aligned_rows else 1
    return dict(stage=stage, K=slots, H=heads, D=dim, k_stride=strides[0], v_stride=strides[1],
                shared_index=_same_index(k_index, v_index), align=align, shared_dim=0,
                dk_stride=heads * dim, dv_stride=heads * dim, dtype=_TL_DTYPES[q.dtype],
                acc=_TL_DTYPES[_acc_dtype(q.dtype)], mask_form=_mask_form(mask, indptr),
                k_indexed=k_index is not None, v_indexed=v_index is not None,
                dropout=dropout_p > 0.0, dropout_bits=reference.DROPOUT_BITS,
                seed_in_memory=isinstance(seed, Tensor))


def _attention_forward(q, k, v, mask, indptr, k_index, v_index, scale, dropout_p, seed,
                       shared: Optional[Tuple[Tensor, Tensor]] = None):
    """``(out, lse, shared_out)``; ``shared_out`` is None without a shared block ``(sq, se)``."""
    rows, heads, dim = q.shape
    spec = _attention_spec(q, k, v, mask, indptr, k_index, v_index, dropout_p, "forward", seed)
    if shared is not None:
        spec["shared_dim"] = shared[0].shape[-1]
    # a slot's shared-block gradient sums over heads: the shared variant keeps them together
    kernel = _kernel("temporal_attention", q.device, (spec["K"], heads, dim),
                     warp_elements=FORWARD_ELEMENTS_PER_WARP, all_heads=shared is not None,
                     backward_mode="", write_coef=False,
                     softmax=default_config().kernels.attention_softmax, **spec)
    out = _empty_like(q)
    lse = _empty((rows, heads), _acc_dtype(q.dtype), q.device)
    shared_out = None
    shared_args: Tuple[Tensor, ...] = ()
    if shared is not None:
        shared_out = _empty_like(shared[0])
        shared_args = (*shared, shared_out)
    mask_arg, indptr_arg = _mask_arg(mask, indptr, q)
    threshold, drop_scale = _dropout_args(dropout_p)
    kernel.launch(kernel.cfg.tile_grid(rows, heads), q, k, v, mask_arg, indptr_arg,
                  k_index if k_index is not None else q, v_index if v_index is not None else q,
                  *shared_args, out, lse, rows, scale, seed, threshold,
                  drop_scale)
    return out, lse, shared_out


def packed_blocks(k: Tensor, v: Tensor) -> bool:
    """Whether dense keys and values are the two column blocks ``[..., :H*d]``, ``[..., H*d:]``
    of one ``[M, K, 2*H*d]`` product (projected together): their gradients then fill one such
    buffer, which the product's backward takes without concatenating them."""
    width = k.shape[-2] * k.shape[-1]
    return (k.dim() == 4 and k.shape == v.shape and k.stride() == v.stride() and k.numel() > 0
            and k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
            and v.storage_offset() == k.storage_offset() + width
            and checks.row_stride(k, True) == 2 * width)


def _attention_backward(grad_out, q, k, v, out, lse, mask, indptr, k_index, v_index, scale,
                        dropout_p, seed, pack: bool = False,
                        shared: Optional[Tuple[Tensor, ...]] = None):
    """Returns ``(dq, dk, dv, dsq, dse)``; ``dsq, dse`` only with a shared block ``shared = (sq,
    se, shared_out, grad_shared_out)`` (else None).

    With ``pack`` and keys/values that are :func:`packed_blocks`, dk and dv are the two halves
    of one ``[M, K, 2*H*d]`` buffer (views of it, laid out as the keys and values were).
    """
    rows, heads, dim = q.shape
    mode = default_config().kernels.backward_mode
    spec = _attention_spec(q, k, v, mask, indptr, k_index, v_index, dropout_p, "backward", seed)
    if shared is not None:
        spec["shared_dim"] = shared[0].shape[-1]
    packed = pack and k_index is None and v_index is None and packed_blocks(k, v)
    if packed:
        spec.update(dk_stride=2 * heads * dim, dv_stride=2 * heads * dim)
    slots = spec["K"]
    indexed = k_index is not None or v_index is not None
    # per-slot coefficients that segment_reduce sums per table row
    write_coef = indexed and mode == "deterministic"
    kernel = _kernel("temporal_attention", q.device, (slots, heads, dim), backward_mode=mode,
                     all_heads=shared is not None, write_coef=write_coef,
                     grad_dtype=spec["dtype"], **spec)
    acc = _acc_dtype(q.dtype)
    dq = _empty_like(q)

    def grad_buffer(t: Tensor, index: Optional[Tensor]) -> Tensor:
        if index is None:
            return _empty_like(t)
        if mode == "atomic":
            return torch.zeros(t.shape, device=t.device, dtype=acc)
        return q  # unused: rows are produced by segment_reduce below

    if packed:
        both = _empty((*k.shape[:2], 2 * heads * dim), k.dtype, k.device)
        dk, dv = (half.view(k.shape) for half in both.split(heads * dim, -1))
    else:
        dk, dv = grad_buffer(k, k_index), grad_buffer(v, v_index)
    if write_coef:
        ds_coef = _empty((rows, heads, slots), acc, q.device)
        pd_coef = _empty((rows, heads, slots), acc, q.device)
    else:
        ds_coef = pd_coef = q  # unused by a kernel generated without write_coef
    dsq = dse = None
    shared_in: Tuple[Tensor, ...] = ()
    shared_grads: Tuple[Tensor, ...] = ()
    if shared is not None:
        sq, se, shared_out, grad_shared_out = shared
        dsq, dse = _empty_like(sq), _empty_like(se)
        shared_in, shared_grads = (sq, se, shared_out), (grad_shared_out, dsq, dse)
    mask_arg, indptr_arg = _mask_arg(mask, indptr, q)
    threshold, drop_scale = _dropout_args(dropout_p)
    kernel.launch(kernel.cfg.tile_grid(rows, heads), q, k, v, mask_arg, indptr_arg,
                  k_index if k_index is not None else q, v_index if v_index is not None else q,
                  *shared_in, out, grad_out, lse, dq, dk, dv, ds_coef,
                  pd_coef, *shared_grads, rows, scale, seed, threshold, drop_scale)
    if mode == "atomic":
        dk = dk.to(k.dtype) if k_index is not None else dk
        dv = dv.to(v.dtype) if v_index is not None else dv
    elif _same_index(k_index, v_index) and k.shape[0] == v.shape[0] and k.dtype == v.dtype:
        dk, dv = segment_reduce(((ds_coef, q), (pd_coef, grad_out)), k_index, k.shape[0],
                                k.dtype)
    else:
        segments = _Segments()
        if k_index is not None:
            (dk,) = segment_reduce(((ds_coef, q),), k_index, k.shape[0], k.dtype, segments)
        if v_index is not None:
            (dv,) = segment_reduce(((pd_coef, grad_out),), v_index, v.shape[0], v.dtype, segments)
    return dq, dk, dv, dsq, dse


def _same_index(a: Optional[Tensor], b: Optional[Tensor]) -> bool:
    """Whether two indices are one tensor (the common case: keys and values of one table set)."""
    return (a is not None and b is not None and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)


def attention_forward(q, k, v, mask=None, indptr=None, *, k_index=None, v_index=None, scale,
                      dropout_p=0.0, seed=0) -> Tuple[Tensor, Tensor]:
    """Forward kernel of ``fastopt::temporal_attention``: ``(out, lse)``."""
    out, lse, _ = _attention_forward(q, k, v, mask, indptr, k_index, v_index, scale, dropout_p,
                                     seed)
    return out, lse


def attention_backward(grad_out, q, k, v, out, lse, mask=None, indptr=None, *, k_index=None,
                       v_index=None, scale, dropout_p=0.0, seed=0,
                       pack: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward kernels of ``fastopt::temporal_attention``: ``(dq, dk, dv)``; ``pack``: see
    :func:`_attention_backward` (not for the custom op, whose outputs may not alias)."""
    dq, dk, dv, *_ = _attention_backward(grad_out, q, k, v, out, lse, mask, indptr, k_index,
                                         v_index, scale, dropout_p, seed, pack)
    return dq, dk, dv


def shared_attention_forward(q, k, v, sq, se, mask=None, indptr=None, *, k_index=None,
                             v_index=None, scale, dropout_p=0.0,
                             seed=0) -> Tuple[Tensor, Tensor, Tensor]:
    """Forward kernel of ``fastopt::shared_attention``: ``(out, shared_out, lse)``."""
    out, lse, shared_out = _attention_forward(q, k, v, mask, indptr, k_index, v_index, scale,
                                              dropout_p, seed, (sq, se))
    return out, shared_out, lse


def shared_attention_backward(grad_out, grad_shared_out, q, k, v, sq, se, out, shared_out, lse,
                              mask=None, indptr=None, *, k_index=None, v_index=None, scale,
                              dropout_p=0.0, seed=0, pack: bool = False):
    """Backward kernels of ``fastopt::shared_attention``: ``(dq, dk, dv, dsq, dse)``."""
    return _attention_backward(grad_out, q, k, v, out, lse, mask, indptr, k_index, v_index, scale,
                               dropout_p, seed, pack, (sq, se, shared_out, grad_shared_out))


# ----------------------------------------------------------------------------------------------
# deterministic scatter into table rows
# ----------------------------------------------------------------------------------------------


class _Segments:
    """Slots grouped by table row (sorted permutation + CSR offsets), shared by k and v.

    One stable sort of the flattened index and a ``searchsorted`` of the row ids into the sorted
    keys give the inverse index as CSR, all on the device and without a host synchronization
    (``bincount`` on CUDA would read its maximum back to size the result). Keys are as narrow as
    the table allows, since the radix sort makes one pass per key byte: int16 up to 65,536 rows
    (shifted by -32,768 above 32,768, which keeps the order), int32 below 2**31, int64 beyond.
    """

    def __init__(self):
        self._cache = {}

    def of(self, index: Tensor, table_rows: int) -> Tuple[Tensor, Tensor]:
        key = (index.data_ptr(), tuple(index.shape), table_rows)
        if key not in self._cache:
            key_dtype, shift = _sort_keys(table_rows)
            flat = index.reshape(-1)
            keys = (flat - shift if shift else flat).to(key_dtype)
            sorted_keys, perm = torch.sort(keys, stable=True)
            segptr = torch.empty(table_rows + 1, dtype=torch.int64, device=index.device)
            segptr[:1].zero_()
            # segptr[u + 1] = number of slots whose row is <= u
            torch.searchsorted(sorted_keys, _row_ids(table_rows, index.device, key_dtype, shift),
                               right=True, out=segptr[1:])
            self._cache[key] = (perm, segptr)
        return self._cache[key]


def _sort_keys(table_rows: int) -> Tuple[torch.dtype, int]:
    """Narrowest sort-key dtype for row ids ``0 .. table_rows - 1`` and the shift that fits them."""
    if table_rows <= 1 << 15:
        return torch.int16, 0
    if table_rows <= 1 << 16:
        return torch.int16, 1 << 15
    return (torch.int32, 0) if table_rows < 2**31 else (torch.int64, 0)


# row ids - shift, per (device, dtype, shift), grown on demand: one arange launch saved per backward.
# Every size ever handed out stays alive: a captured CUDA graph keeps reading the one it was given.
_ROW_IDS: Dict[tuple, List[Tensor]] = {}


def _row_ids(count: int, device: torch.device, dtype: torch.dtype, shift: int = 0) -> Tensor:
    sizes = _ROW_IDS.setdefault((device, dtype, shift), [])
    if not sizes or sizes[-1].numel() < count:
        limit = torch.iinfo(dtype).max + shift + 1
        size = min(limit, max(count, 2 * sizes[-1].numel())) if sizes else count
        sizes.append((torch.arange(size, device=device, dtype=torch.int64) - shift).to(dtype))
    return sizes[-1][:count]


def segment_reduce(terms: Sequence[Tuple[Tensor, Tensor]], index: Tensor, table_rows: int,
                   dtype: torch.dtype, segments: Optional[_Segments] = None) -> Tuple[Tensor, ...]:
    """``out[u] = sum over slots (m, j) with index[m, j] == u of coef[m, :, j] * x[m]``.

    Deterministic: each table row sums its slots in sorted order within one program. One or two
    ``(coef, x)`` terms share the index, its sort and one launch.

    Args:
        terms: ``(coef [M, H, K], x [M, H, d])`` pairs: per-slot, per-head coefficients and the
            row vectors they scale.
        index: Table rows ``[M, K]``.
        table_rows: U.
        dtype: Result dtype.
        segments: Sorted slots to reuse across calls with the same index.

    Returns:
        One ``[U, H, d]`` table per term.
    """
    if len(terms) not in (1, 2):
        raise KernelError(f"segment_reduce takes 1 or 2 (coef, x) terms (got {len(terms)}); "
                          f"call it once per pair of terms")
    rows, heads, dim = terms[0][1].shape
    slots = index.shape[1]
    perm, segptr = (segments or _Segments()).of(index, table_rows)
    kernel = _kernel("segment_reduce", index.device, (slots, heads, dim), K=slots, H=heads, D=dim,
                     dtype=_TL_DTYPES[dtype], acc=_TL_DTYPES[terms[0][0].dtype],
                     pair=len(terms) == 2)
    outs = tuple(_empty((table_rows, heads, dim), dtype, index.device) for _ in terms)
    args = [a for (coef, x), out in zip(terms, outs) for a in (coef, x, out)]
    kernel.launch(kernel.cfg.tile_grid(table_rows, heads), *args, perm, segptr, table_rows)
    return outs


# ----------------------------------------------------------------------------------------------
# masked aggregation
# ----------------------------------------------------------------------------------------------


def _aggregate_launch(stage: str, x: Tensor, mask, indptr, index, reduce: str, rows: int,
                      slots: int, features: int, *outputs: Tensor, backward_mode: str = ""):
    kernel = _kernel("masked_aggregate", x.device, (slots, 1, features),
                     lambda cfg: {"k_blocks": -(-slots // cfg.block_k)}, stage=stage, K=slots,
                     F=features, dtype=_TL_DTYPES[x.dtype], acc=_TL_DTYPES[_acc_dtype(x.dtype)],
                     mask_form=_mask_form(mask, indptr), indexed=index is not None,
                     reduce=reduce, backward_mode=backward_mode)
    mask_arg, indptr_arg = _mask_arg(mask, indptr, x)
    grid = (kernel.cfg.grid(rows, 1)[0], -(-features // kernel.cfg.block_d))
    kernel.launch(grid, x, mask_arg, indptr_arg, index if index is not None else x, *outputs, rows)


def _aggregate_shape(x: Tensor, index: Optional[Tensor]) -> Tuple[int, int, Tuple[int, ...]]:
    if index is None:
        return x.shape[0], x.shape[1], tuple(x.shape[2:])
    return index.shape[0], index.shape[1], tuple(x.shape[1:])


def aggregate_forward(x: Tensor, mask=None, indptr=None, *, index=None, reduce="mean") -> Tensor:
    """Forward kernel of ``fastopt::masked_aggregate``."""
    rows, slots, feature_shape = _aggregate_shape(x, index)
    features = math.prod(feature_shape)
    out = _empty((rows, *feature_shape), x.dtype, x.device)
    _aggregate_launch("forward", x, mask, indptr, index, reduce, rows, slots, features, out)
    return out


def aggregate_backward(grad_out: Tensor, x: Tensor, mask=None, indptr=None, *, index=None,
                       reduce="mean") -> Tensor:
    """Backward kernels of ``fastopt::masked_aggregate``: the gradient of ``x``."""
    rows, slots, feature_shape = _aggregate_shape(x, index)
    features = math.prod(feature_shape)
    mode = default_config().kernels.backward_mode if index is not None else ""
    acc = _acc_dtype(x.dtype)
    if index is None:
        dx, coef = _empty_like(x), x
    elif mode == "atomic":
        dx, coef = torch.zeros(x.shape, device=x.device, dtype=acc), x
    else:
        dx, coef = x, _empty((rows, 1, slots), acc, x.device)
    _aggregate_launch("backward", x, mask, indptr, index, reduce, rows, slots, features,
                      grad_out, dx, coef, backward_mode=mode)
    if index is None:
        return dx
    if mode == "atomic":
        return dx.to(x.dtype)
    (table,) = segment_reduce(((coef, grad_out.reshape(rows, 1, features)),), index, x.shape[0],
                              x.dtype)
    return table.view(x.shape)


# ----------------------------------------------------------------------------------------------
# time encoding
# ----------------------------------------------------------------------------------------------


def _time_encode_kernel(stage: str, dt: Tensor, w: Tensor) -> _Specialized:
    width = w.shape[0]
    return _kernel("time_encode", dt.device, (64, 1, width),
                   lambda cfg: {"block_n": cfg.block_k, "block_t": cfg.block_d}, stage=stage,
                   T=width, dtype=_TL_DTYPES[w.dtype], dt_dtype=_TL_DTYPES[dt.dtype],
                   acc=_TL_DTYPES[_acc_dtype(w.dtype)])


def time_encode_forward(dt: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Forward kernel of ``fastopt::time_encode``."""
    kernel = _time_encode_kernel("forward", dt, w)
    out = _empty((*dt.shape, w.shape[0]), w.dtype, dt.device)
    count = dt.numel()
    kernel.launch((-(-count // kernel.cfg.block_k), 1), dt, w, b, out, count)
    return out


def time_encode_backward(grad_out: Tensor, dt: Tensor, w: Tensor,
                         b: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward kernel of ``fastopt::time_encode``: ``(ddt, dw, db)``, deterministic."""
    kernel = _time_encode_kernel("backward", dt, w)
    count = dt.numel()
    programs = -(-count // kernel.cfg.block_k)
    ddt = _empty_like(dt)
    partial = torch.empty((max(programs, 1), 2, w.shape[0]), device=dt.device,
                          dtype=_acc_dtype(w.dtype))
    if programs == 0:
        partial.zero_()
    kernel.launch((programs, 1), dt, w, b, grad_out, ddt, partial, count)
    return ddt, partial[:, 0].sum(0).to(w.dtype), partial[:, 1].sum(0).to(b.dtype)


# ----------------------------------------------------------------------------------------------
# matrix products of the projections (templates/matmul.py.jinja)
# ----------------------------------------------------------------------------------------------

# Default tile of C per program and K slice per step (config.kernels.matmul_block_* override);
# K spans of weight-gradient products (K = batch rows) are split over programs when C has too
# few tiles to occupy the GPU.
MATMUL_TILE = (64, 64, 32)
MAX_SPLITS = 64


def _matmul_tile() -> Tuple[int, int, int, int]:
    knobs = default_config().kernels
    return (knobs.matmul_block_m or MATMUL_TILE[0], knobs.matmul_block_n or MATMUL_TILE[1],
            knobs.matmul_block_k or MATMUL_TILE[2], knobs.matmul_warps or 4)


def _matmul_kernel(device: torch.device, tile: Tuple[int, int, int, int],
                   **spec) -> _Specialized:
    block_m, block_n, block_k, warps = tile
    cfg = KernelConfig(block_m=block_m, block_k=block_k, block_d=block_n, num_warps=warps,
                       num_stages=3 if _capability(device)[0] >= 9 else 2)
    return _fixed_kernel("matmul", device, cfg, block_m=block_m, block_n=block_n,
                         block_k=block_k, **spec)


def _fixed_kernel(family: str, device: torch.device, cfg: KernelConfig, **spec) -> _Specialized:
    """The kernel of ``family`` for ``spec`` under a mapping its caller chose (the families whose
    tiles do not follow a ``(K, H, d)`` problem), memoized per process."""
    key = (family, device, cfg, default_config().kernels.cache_dir, tuple(sorted(spec.items())))
    hit = _SPECIALIZED.get(key)
    if hit is None:
        source = render(family, **spec)
        fn = kernel_cache().load(CacheKey.build(family, source, cfg, device), source)
        hit = _SPECIALIZED[key] = _Specialized(fn, cfg)
    return hit


class _Strides(tuple):
    """Element strides of a product's operands (A, B, C, the residual) by name, hashable."""

    am, ak, bk, bn, cm, cn, rm, rn = (property(lambda self, i=i: self[i]) for i in range(8))


def _strides(a: Tensor, b: Tensor, out: Optional[Tensor] = None,
             res: Optional[Tensor] = None) -> _Strides:
    # a split product writes contiguous partials and reads no residual: those strides are unused
    c = out.stride() if out is not None else (0, 0)
    r = res.stride() if res is not None else (0, 0)
    return _Strides((*a.stride(), *b.stride(), *c, *r))


def _splits(tiles: int, depth: int, block_k: int, device: torch.device) -> int:
    """K spans for a product of ``tiles`` C tiles over ``depth`` rows of K: enough programs for
    two per multiprocessor, each span at least four K slices deep."""
    processors = (torch.cuda.get_device_properties(device).multi_processor_count
                  if device.type == "cuda" else 4)
    if tiles >= processors:
        return 1
    return max(1, min(MAX_SPLITS, -(-2 * processors // tiles), depth // (4 * block_k)))


def matmul(a: Tensor, b: Tensor, *, bias: Optional[Tensor] = None,
           residual: Optional[Tensor] = None, precision: str = "tf32x3",
           row_sums: bool = False):
    """``a @ b (+ residual) (+ bias)`` for float32 ``a [M, K]``, ``b [K, N]`` of any strides;
    with ``row_sums``, ``(product, a.sum(1))``, the sums from the product's own reads of ``a``."""
    rows, depth = a.shape
    cols = b.shape[1]
    tile = _matmul_tile()
    block_m, block_n, block_k, _ = tile
    out = _empty((rows, cols), torch.float32, a.device)
    if rows == 0 or cols == 0 or depth == 0:
        if depth == 0 and rows * cols:
            out.zero_()
            if residual is not None:
                out += residual
            if bias is not None:
                out += bias
        return (out, a.sum(1, dtype=torch.float32)) if row_sums else out
    tiles = (-(-rows // block_m), -(-cols // block_n))
    splits = _splits(tiles[0] * tiles[1], depth, block_k, a.device)
    span = -(-depth // splits)
    span = -(-span // block_k) * block_k
    splits = -(-depth // span)
    sums = _empty((splits, rows), torch.float32, a.device) if row_sums else out
    if splits > 1:
        part = _empty((splits, rows, cols), torch.float32, a.device)
        kernel = _matmul_kernel(a.device, tile, precision=precision, split=True, residual=False,
                                bias=False, row_sums=row_sums, strides=_strides(a, b))
        kernel.fn[(tiles[0], tiles[1], splits)](
            a, b, part, part, part, sums, rows, cols, depth, span, num_warps=kernel.cfg.num_warps,
            num_stages=kernel.cfg.num_stages)
        torch.sum(part, 0, out=out)
        if residual is not None:
            out += residual
        if bias is not None:
            out += bias
    else:
        res = residual if residual is not None else out
        kernel = _matmul_kernel(a.device, tile, precision=precision, split=False,
                                residual=residual is not None, bias=bias is not None,
                                row_sums=row_sums, strides=_strides(a, b, out, res))
        kernel.fn[(tiles[0], tiles[1], 1)](
            a, b, out, res, bias if bias is not None else out, sums, rows, cols, depth, depth,
            num_warps=kernel.cfg.num_warps, num_stages=kernel.cfg.num_stages)
    return (out, sums.sum(0)) if row_sums else out


# ----------------------------------------------------------------------------------------------
# column sums (bias gradients)
# ----------------------------------------------------------------------------------------------

# Elements of a column-sum program's [block_r, block_n] tile; programs per multiprocessor the
# row chunks aim for.
COLUMN_TILE = 4096
COLUMN_PROGRAMS_PER_SM = 4


def column_sum(x: Tensor) -> Tensor:
    """``x.sum(0)`` of a ``[M, N]`` matrix with unit column stride, in ``x``'s dtype (float32 or
    float64 accumulation): row chunks summed into partial rows by one launch, the partials by a
    second; the order depends only on ``M``, ``N`` and the GPU, so the result is deterministic."""
    rows, cols = x.shape
    acc = _acc_dtype(x.dtype)
    if rows == 0 or cols == 0:
        return torch.zeros(cols, dtype=x.dtype, device=x.device)
    processors = (torch.cuda.get_device_properties(x.device).multi_processor_count
                  if x.device.type == "cuda" else 4)
    block_n = min(next_power_of_2(cols), 256)
    block_r = max(1, COLUMN_TILE // block_n)
    col_blocks = -(-cols // block_n)
    # row chunks: enough programs to fill the GPU, each at least one tile of rows
    chunks = max(1, min(-(-rows // block_r), -(-COLUMN_PROGRAMS_PER_SM * processors // col_blocks)))
    per_chunk = -(-rows // chunks)
    chunk = -(-per_chunk // block_r) * block_r
    chunks = -(-rows // chunk)
    partial = _empty((chunks, cols), acc, x.device)
    _column_sum_launch(x, partial, rows, chunk, chunks, block_r, block_n)
    out = _empty((1, cols), x.dtype, x.device)
    # the partials in one chunk; column blocks narrow enough to give several programs
    block_n2 = min(block_n, 32)
    _column_sum_launch(partial, out, chunks, chunks, 1, max(1, COLUMN_TILE // block_n2), block_n2)
    return out[0]


def _column_sum_launch(x: Tensor, out: Tensor, rows: int, chunk: int, chunks: int, block_r: int,
                       block_n: int) -> None:
    cols = x.shape[1]
    cfg = KernelConfig(block_m=block_r, block_d=block_n, num_warps=4,
                       num_stages=3 if _capability(x.device)[0] >= 9 else 2)
    kernel = _fixed_kernel("column_sum", x.device, cfg, N=cols, stride=x.stride(0),
                           block_r=block_r, block_n=block_n, acc=_TL_DTYPES[_acc_dtype(x.dtype)],
                           out_dtype=_TL_DTYPES[out.dtype])
    kernel.launch((chunks, -(-cols // block_n)), x, out, rows, chunk)
