"""Nested call arguments as a flat list of tensors plus a hashable description of the rest.

A CUDA graph replays on fixed tensors; what varies between calls of one graph is only the
values of its input tensors. :func:`flatten` separates the two: every tensor inside lists,
tuples, namedtuples, dicts and dataclasses (:class:`~fastopt.runtime.GraphInputs` among them)
becomes a leaf, everything else a constant of the spec, so that the spec (with the tensors'
shapes) can key a graph and :func:`unflatten` can rebuild the arguments around a graph's static
buffers.

Layering: imports nothing of fastopt but :mod:`fastopt.errors`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from torch import Tensor

from fastopt.errors import TraceError

__all__ = ["flatten", "unflatten"]


_TENSOR = "T"


def flatten(obj: Any) -> Tuple[List[Tensor], tuple]:
    """``(tensors, spec)``: every tensor in ``obj`` in order, and a hashable description of the rest.

    Lists, tuples, namedtuples, dicts and dataclass instances are descended into; tensors become
    leaves; any other value is a constant of the spec (compared by value, so it must be
    hashable for the spec to be). :func:`unflatten` rebuilds ``obj`` from a spec and tensors.
    """
    leaves: List[Tensor] = []
    return leaves, _flatten(obj, leaves)


def _flatten(obj: Any, leaves: List[Tensor]):
    if isinstance(obj, Tensor):
        leaves.append(obj)
        return _TENSOR
    kind = type(obj)
    if kind is list or kind is tuple:
        return (kind.__name__, tuple(_flatten(x, leaves) for x in obj))
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return ("namedtuple", kind, tuple(_flatten(x, leaves) for x in obj))
    if kind is dict:
        keys = tuple(obj)
        return ("dict", keys, tuple(_flatten(obj[k], leaves) for k in keys))
    names = _FIELD_NAMES.get(kind, False)
    if names is False:
        names = _FIELD_NAMES[kind] = (tuple(f.name for f in dataclasses.fields(kind))
                                      if dataclasses.is_dataclass(kind) else None)
    if names is not None:
        return ("dataclass", kind, names, tuple(_flatten(getattr(obj, n), leaves) for n in names))
    return ("const", kind, obj)


# field names per argument type, None where it is no dataclass (dataclasses.fields() costs
# microseconds a call)
_FIELD_NAMES: Dict[type, Optional[tuple]] = {}


def unflatten(spec: tuple, tensors: Sequence[Tensor]) -> Any:
    """The object :func:`flatten` described by ``spec``, with ``tensors`` as its leaves."""
    it = iter(tensors)
    out = _unflatten(spec, it)
    if next(it, None) is not None:
        raise TraceError(f"unflatten got more tensors than the spec holds ({len(tensors)}); "
                         f"pass the tensors flatten returned with this spec")
    return out


def _unflatten(spec, it: Iterator[Tensor]):
    if spec is _TENSOR or spec == _TENSOR:
        try:
            return next(it)
        except StopIteration:
            raise TraceError("unflatten ran out of tensors; pass the tensors flatten returned "
                             "with this spec") from None
    tag = spec[0]
    if tag == "list":
        return [_unflatten(s, it) for s in spec[1]]
    if tag == "tuple":
        return tuple(_unflatten(s, it) for s in spec[1])
    if tag == "namedtuple":
        return spec[1](*(_unflatten(s, it) for s in spec[2]))
    if tag == "dict":
        return {k: _unflatten(s, it) for k, s in zip(spec[1], spec[2])}
    if tag == "dataclass":
        fields = {n: _unflatten(s, it) for n, s in zip(spec[2], spec[3])}
        init = {f.name for f in dataclasses.fields(spec[1]) if f.init}
        obj = spec[1](**{n: v for n, v in fields.items() if n in init})
        for n, v in fields.items():
            if n not in init:
                object.__setattr__(obj, n, v)
        return obj
    return spec[2]

