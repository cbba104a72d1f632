"""fastopt.codegen: fused temporal-attention / aggregation operators and their generated kernels.

Layering: imports nothing of fastopt but :mod:`fastopt.config` and :mod:`fastopt.errors`.
"""

__all__: list = []
