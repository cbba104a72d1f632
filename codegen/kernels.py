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

import math
from pathlib import Path
from typing import Optional, Tuple

import jinja2
import torch
from torch import Tensor

from fastopt.codegen import reference
from fastopt.codegen.cache import KERNEL_NAME_PLACEHOLDER, CacheKey, device_identity, kernel_cache
from fastopt.codegen.kernel_config import KernelConfig, heuristic_config
from fastopt.config import default_config

__all__ = [
    "attention_forward",
    "attention_backward",
    "time_encoded_attention_forward",
    "time_encoded_attention_backward",
    "aggregate_forward",
    "aggregate_backward",
    "time_encode_forward",
    "time_encode_backward",
    "segment_reduce",
    "render",
]

_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
)

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


def _kernel(family: str, cfg: KernelConfig, device: torch.device, **spec):
    """The cached kernel of ``family`` for ``spec`` under the thread mapping ``cfg``."""
    source = render(family, rows=cfg.rows_per_program, block_k=cfg.block_k, block_d=cfg.block_d,
                    block_h=cfg.heads_per_program, **spec)
    return kernel_cache().load(CacheKey.build(family, source, cfg, device), source)


def _config(slots: int, heads: int, dim: int, device: torch.device) -> KernelConfig:
    capability = tuple(int(x) for x in device_identity(device)[1].split("."))
    return heuristic_config(slots, heads, dim, capability)


def _launch(fn, cfg: KernelConfig, grid: Tuple[int, int], *args) -> None:
    if grid[0] == 0:
        return
    fn[grid](*args, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


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
                    dropout_p: float, time_dim: int, stage: str) -> dict:
    rows, heads, dim = q.shape
    slots = (k_index if k_index is not None else k).shape[1]
    return dict(stage=stage, K=slots, H=heads, D=dim, dtype=_TL_DTYPES[q.dtype],
                acc=_TL_DTYPES[_acc_dtype(q.dtype)], mask_form=_mask_form(mask, indptr),
                k_indexed=k_index is not None, v_indexed=v_index is not None,
                dropout=dropout_p > 0.0, dropout_bits=reference.DROPOUT_BITS, time_dim=time_dim)


def _time_args(time: Optional[Tuple[Tensor, ...]]) -> Tuple[Tensor, ...]:
    return tuple(time) if time is not None else ()


def _attention_forward(q, k, v, mask, indptr, k_index, v_index, scale, dropout_p, seed,
                       time: Optional[Tuple[Tensor, ...]]) -> Tuple[Tensor, Tensor]:
    rows, heads, dim = q.shape
    spec = _attention_spec(q, k, v, mask, indptr, k_index, v_index, dropout_p,
                           time[1].shape[0] if time is not None else 0, "forward")
    cfg = _config(spec["K"], heads, dim, q.device)
    spec["k_blocks"] = -(-spec["K"] // cfg.block_k)
    fn = _kernel("temporal_attention", cfg, q.device, backward_mode="", write_coef=False, **spec)
    out = _empty_like(q)
    lse = _empty((rows, heads), _acc_dtype(q.dtype), q.device)
    mask_arg, indptr_arg = _mask_arg(mask, indptr, q)
    threshold, drop_scale = _dropout_args(dropout_p)
    _launch(fn, cfg, cfg.grid(rows, heads), q, k, v, mask_arg, indptr_arg,
            k_index if k_index is not None else q, v_index if v_index is not None else q,
            *_time_args(time), out, lse, rows, scale, seed, threshold, drop_scale)
    return out, lse


def _attention_backward(grad_out, q, k, v, out, lse, mask, indptr, k_index, v_index, scale,
                        dropout_p, seed, time: Optional[Tuple[Tensor, ...]]):
    """Returns ``(dq, dk, dv, ds_coef, pd_coef)``; the coefficients only with a time prologue."""
    rows, heads, dim = q.shape
    mode = default_config().kernels.backward_mode
    spec = _attention_spec(q, k, v, mask, indptr, k_index, v_index, dropout_p,
                           time[1].shape[0] if time is not None else 0, "backward")
    slots = spec["K"]
    cfg = _config(slots, heads, dim, q.device)
    spec["k_blocks"] = -(-slots // cfg.block_k)
    indexed = k_index is not None or v_index is not None
    write_coef = time is not None or (indexed and mode == "deterministic")
    fn = _kernel("temporal_attention", cfg, q.device, backward_mode=mode, write_coef=write_coef,
                 grad_dtype=spec["dtype"], **spec)
    acc = _acc_dtype(q.dtype)
    dq = _empty_like(q)

    def grad_buffer(t: Tensor, index: Optional[Tensor]) -> Tensor:
        if index is None:
            return _empty_like(t)
        if mode == "atomic":
            return torch.zeros(t.shape, device=t.device, dtype=acc)
        return q  # unused: rows are produced by segment_reduce below

    dk, dv = grad_buffer(k, k_index), grad_buffer(v, v_index)
    coef_shape = (rows, heads, slots) if write_coef else (1,)
    ds_coef = _empty(coef_shape, acc, q.device)
    pd_coef = _empty(coef_shape, acc, q.device)
    mask_arg, indptr_arg = _mask_arg(mask, indptr, q)
    threshold, drop_scale = _dropout_args(dropout_p)
    _launch(fn, cfg, cfg.grid(rows, heads), q, k, v, mask_arg, indptr_arg,
            k_index if k_index is not None else q, v_index if v_index is not None else q,
            *_time_args(time), out, grad_out, lse, dq, dk, dv, ds_coef, pd_coef, rows, scale,
            seed, threshold, drop_scale)
    segments = _Segments()
    if k_index is not None:
        dk = (dk.to(k.dtype) if mode == "atomic"
              else segment_reduce(ds_coef, q, k_index, k.shape[0], k.dtype, segments))
    if v_index is not None:
        dv = (dv.to(v.dtype) if mode == "atomic"
              else segment_reduce(pd_coef, grad_out, v_index, v.shape[0], v.dtype, segments))
    return dq, dk, dv, ds_coef, pd_coef


def attention_forward(q, k, v, mask=None, indptr=None, *, k_index=None, v_index=None, scale,
                      dropout_p=0.0, seed=0) -> Tuple[Tensor, Tensor]:
    """Forward kernel of ``fastopt::temporal_attention``: ``(out, lse)``."""
    return _attention_forward(q, k, v, mask, indptr, k_index, v_index, scale, dropout_p, seed,
                              None)


def attention_backward(grad_out, q, k, v, out, lse, mask=None, indptr=None, *, k_index=None,
                       v_index=None, scale, dropout_p=0.0, seed=0) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward kernels of ``fastopt::temporal_attention``: ``(dq, dk, dv)``."""
    dq, dk, dv, _, _ = _attention_backward(grad_out, q, k, v, out, lse, mask, indptr, k_index,
                                           v_index, scale, dropout_p, seed, None)
    return dq, dk, dv


def time_encoded_attention_forward(q, k, v, dt, time_w, time_b, k_time_proj, v_time_proj,
                                   mask=None, indptr=None, *, k_index=None, v_index=None, scale,
                                   dropout_p=0.0, seed=0) -> Tuple[Tensor, Tensor]:
    """Forward kernel of ``fastopt::time_encoded_attention``; the encoding stays in registers."""
    time = (dt, time_w, time_b, k_time_proj, v_time_proj)
    return _attention_forward(q, k, v, mask, indptr, k_index, v_index, scale, dropout_p, seed,
                              time)


def time_encoded_attention_backward(grad_out, q, k, v, dt, time_w, time_b, k_time_proj,
                                    v_time_proj, out, lse, mask=None, indptr=None, *,
                                    k_index=None, v_index=None, scale, dropout_p=0.0, seed=0):
    """Backward of ``fastopt::time_encoded_attention``.

    The attention kernel gives dq, dk, dv and the per-slot coefficients ``c_k = scale * ds`` and
    ``c_v = p_dropped`` (``[M, H, K]``); the time part needs no ``[M, K, H, d]`` tensor:
    ``dk_time_proj[t, h] = sum_m (sum_j enc[m, j, t] c_k[m, h, j]) q[m, h]`` (likewise with
    ``dout`` for values) and ``d enc[m, j, t] = sum_h c_k[m, h, j] (q[m, h] . k_time_proj[t, h])
    + c_v[m, h, j] (dout[m, h] . v_time_proj[t, h])``.
    """
    time = (dt, time_w, time_b, k_time_proj, v_time_proj)
    dq, dk, dv, ck, cv = _attention_backward(grad_out, q, k, v, out, lse, mask, indptr, k_index,
                                             v_index, scale, dropout_p, seed, time)
    acc = ck.dtype
    qa, ga = q.to(acc), grad_out.to(acc)
    phase = dt.to(acc)[..., None] * time_w.to(acc) + time_b.to(acc)
    enc = torch.cos(phase)
    dkp = torch.einsum("mjt,mhj,mhd->thd", enc, ck, qa)
    dvp = torch.einsum("mjt,mhj,mhd->thd", enc, cv, ga)
    q_dot = torch.einsum("mhd,thd->mht", qa, k_time_proj.to(acc))
    g_dot = torch.einsum("mhd,thd->mht", ga, v_time_proj.to(acc))
    denc = torch.einsum("mhj,mht->mjt", ck, q_dot) + torch.einsum("mhj,mht->mjt", cv, g_dot)
    dphase = -torch.sin(phase) * denc
    ddt = (dphase * time_w.to(acc)).sum(-1)
    dw = (dphase * dt.to(acc)[..., None]).sum((0, 1))
    db = dphase.sum((0, 1))
    return (dq, dk, dv, ddt.to(dt.dtype), dw.to(time_w.dtype), db.to(time_b.dtype),
            dkp.to(k_time_proj.dtype), dvp.to(v_time_proj.dtype))


# ----------------------------------------------------------------------------------------------
# deterministic scatter into table rows
# ----------------------------------------------------------------------------------------------


class _Segments:
    """Slots grouped by table row (sorted permutation + CSR offsets), shared by k and v."""

    def __init__(self):
        self._cache = {}

    def of(self, index: Tensor, table_rows: int) -> Tuple[Tensor, Tensor]:
        key = (index.data_ptr(), tuple(index.shape), table_rows)
        if key not in self._cache:
            flat = index.reshape(-1).long()
            perm = torch.sort(flat, stable=True).indices
            counts = torch.bincount(flat, minlength=table_rows)
            segptr = torch.zeros(table_rows + 1, device=index.device, dtype=torch.int64)
            torch.cumsum(counts, 0, out=segptr[1:])
            self._cache[key] = (perm, segptr)
        return self._cache[key]


def segment_reduce(coef: Tensor, x: Tensor, index: Tensor, table_rows: int, dtype: torch.dtype,
                   segments: Optional[_Segments] = None) -> Tensor:
    """``out[u] = sum over slots (m, j) with index[m, j] == u of coef[m, :, j] * x[m]``.

    Deterministic: each table row sums its slots in sorted order within one program.

    Args:
        coef: Per-slot, per-head coefficients ``[M, H, K]``.
        x: Row vectors ``[M, H, d]``.
        index: Table rows ``[M, K]``.
        table_rows: U.
        dtype: Result dtype.

    Returns:
        ``[U, H, d]``.
    """
    rows, heads, dim = x.shape
    slots = index.shape[1]
    perm, segptr = (segments or _Segments()).of(index, table_rows)
    cfg = _config(slots, heads, dim, x.device)
    fn = _kernel("segment_reduce", cfg, x.device, K=slots, H=heads, D=dim,
                 dtype=_TL_DTYPES[dtype], acc=_TL_DTYPES[coef.dtype], block_s=cfg.block_k)
    out = _empty((table_rows, heads, dim), dtype, x.device)
    _launch(fn, cfg, cfg.grid(table_rows, heads), coef, x, perm, segptr, out, table_rows)
    return out


# ----------------------------------------------------------------------------------------------
# masked aggregation
# ----------------------------------------------------------------------------------------------


def _aggregate_launch(stage: str, x: Tensor, mask, indptr, index, reduce: str, rows: int,
                      slots: int, features: int, *outputs: Tensor, backward_mode: str = ""):
    cfg = _config(slots, 1, features, x.device)
    fn = _kernel("masked_aggregate", cfg, x.device, stage=stage, K=slots, F=features,
                 k_blocks=-(-slots // cfg.block_k), dtype=_TL_DTYPES[x.dtype],
                 acc=_TL_DTYPES[_acc_dtype(x.dtype)], mask_form=_mask_form(mask, indptr),
                 indexed=index is not None, reduce=reduce, backward_mode=backward_mode)
    mask_arg, indptr_arg = _mask_arg(mask, indptr, x)
    grid = (cfg.grid(rows, 1)[0], -(-features // cfg.block_d))
    _launch(fn, cfg, grid, x, mask_arg, indptr_arg, index if index is not None else x, *outputs,
            rows)


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
    table = segment_reduce(coef, grad_out.reshape(rows, 1, features), index, x.shape[0], x.dtype)
    return table.view(x.shape)


# ----------------------------------------------------------------------------------------------
# time encoding
# ----------------------------------------------------------------------------------------------


def _time_encode_kernel(stage: str, dt: Tensor, w: Tensor):
    width = w.shape[0]
    cfg = _config(64, 1, width, dt.device)
    fn = _kernel("time_encode", cfg, dt.device, stage=stage, T=width, block_n=cfg.block_k,
                 block_t=cfg.block_d, dtype=_TL_DTYPES[w.dtype], dt_dtype=_TL_DTYPES[dt.dtype],
                 acc=_TL_DTYPES[_acc_dtype(w.dtype)])
    return fn, cfg


def time_encode_forward(dt: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Forward kernel of ``fastopt::time_encode``."""
    fn, cfg = _time_encode_kernel("forward", dt, w)
    out = _empty((*dt.shape, w.shape[0]), w.dtype, dt.device)
    count = dt.numel()
    _launch(fn, cfg, (-(-count // cfg.block_k), 1), dt, w, b, out, count)
    return out


def time_encode_backward(grad_out: Tensor, dt: Tensor, w: Tensor,
                         b: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward kernel of ``fastopt::time_encode``: ``(ddt, dw, db)``, deterministic."""
    fn, cfg = _time_encode_kernel("backward", dt, w)
    count = dt.numel()
    programs = -(-count // cfg.block_k)
    ddt = _empty_like(dt)
    partial = torch.zeros((max(programs, 1), 2, w.shape[0]), device=dt.device,
                          dtype=_acc_dtype(w.dtype))
    _launch(fn, cfg, (programs, 1), dt, w, b, grad_out, ddt, partial, count)
    return ddt, partial[:, 0].sum(0).to(w.dtype), partial[:, 1].sum(0).to(b.dtype)
