"""Plain-PyTorch reference of every fused operator, in one namespace.

These functions are the CPU path of :mod:`fastopt.codegen` and the oracle of its tests: each
generated kernel must match them (float32: relative error < 1e-4; tests compare against float64).
They take exactly the arguments of the public operators, already validated, and compute in
float64 when given float64, else in float32 (half-precision inputs are upcast, results cast back
to the input dtype). Each lives with its family (:mod:`fastopt.codegen.families`); the neighbor
layout they share is described in :mod:`fastopt.codegen.layout`.

Dropout draws one 32-bit Philox-4x32-10 number per attention weight (:func:`dropout_keep`), the
same generator ``tl.randint`` runs inside the kernels, so a seed gives bit-identical masks on
every backend.
"""

from fastopt.codegen.families.edge_attention import reference_edge_attention as edge_attention
from fastopt.codegen.families.masked_aggregate import reference as masked_aggregate
from fastopt.codegen.families.masked_aggregate import (
    reference_backward as masked_aggregate_backward,
)
from fastopt.codegen.families.temporal_attention.reference import (
    dropout_keep,
    dropout_threshold,
    shared_attention,
    shared_attention_backward,
    shared_attention_forward,
    temporal_attention,
    temporal_attention_backward,
    temporal_attention_forward,
)
from fastopt.codegen.families.time_encode import reference as time_encode
from fastopt.codegen.families.time_encode import reference_backward as time_encode_backward
from fastopt.codegen.layout import valid_slots

__all__ = [
    "temporal_attention",
    "temporal_attention_forward",
    "temporal_attention_backward",
    "shared_attention",
    "shared_attention_forward",
    "shared_attention_backward",
    "edge_attention",
    "masked_aggregate",
    "masked_aggregate_backward",
    "time_encode",
    "time_encode_backward",
    "valid_slots",
    "dropout_keep",
    "dropout_threshold",
]
