"""fastopt.codegen: fused temporal-attention / aggregation operators and their generated kernels.

Public surface (stable signatures; the fx passes rewrite onto these):

- :func:`temporal_attention` ``(q, k, v, mask=None, indptr=None, *, k_index=None, v_index=None,
  scale=None, dropout_p=0.0, seed=0)``; ``seed`` may be a device tensor (:func:`dropout_seed`)
- :func:`shared_attention` ``(q, k, v, sq, se, mask=None, indptr=None, *, k_index=None,
  v_index=None, scale=None, dropout_p=0.0, seed=0)`` -> ``(out, shared_out)``: keys and values
  carry a feature block ``se [M, K, S]`` shared by all heads (a factored time encoding)
- :func:`masked_aggregate` ``(x, mask=None, indptr=None, *, index=None, reduce="mean")``
- :func:`time_encode` ``(dt, w, b)``
- :func:`linear` ``(x, w, bias=None, residual=None, *, bias_grad="torch")``: projections, by
  generated matmuls when ``config.kernels.matmul_precision`` asks for them; the bias gradient by
  :func:`column_sum` with ``bias_grad="column_sum"``
- :func:`column_sum` ``(x)``: ``x.sum(0)`` of a matrix, deterministic, by a generated kernel
- :func:`attention_mapping` ``(slots, heads, dim)``: the attention kernels' thread mapping for
  that shape, in words (for reports)

Each of the first four is a ``torch.library`` custom op (``torch.ops.fastopt.*``) with autograd and a fake
implementation; :mod:`fastopt.codegen.reference` holds the plain-PyTorch reference of each, which
is the CPU path and the test oracle.

Layout: ``reference.py`` (oracles), ``checks.py`` (input validation), ``ops.py`` (custom ops,
backend choice), ``kernels.py`` (specialization and launch), ``kernel_config.py`` (thread mapping),
``cache.py`` (content-addressed kernel cache), ``templates/*.py.jinja`` (one per kernel family).

Layering: imports nothing of fastopt but :mod:`fastopt.config` and :mod:`fastopt.errors`.
"""

from fastopt.codegen import reference
from fastopt.codegen.kernel_config import attention_mapping
from fastopt.codegen.ops import (
    column_sum,
    dropout_seed,
    linear,
    masked_aggregate,
    select_backend,
    shared_attention,
    temporal_attention,
    time_encode,
)

__all__ = [
    "temporal_attention",
    "dropout_seed",
    "shared_attention",
    "masked_aggregate",
    "time_encode",
    "linear",
    "column_sum",
    "attention_mapping",
    "select_backend",
    "reference",
]
