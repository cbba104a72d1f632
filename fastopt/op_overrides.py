"""The syntax of ``kernels.op_overrides``: mapping fields of one fused op at one shape.

``op@KxHxd:field=value,...`` entries joined by ``;`` (``temporal_attention@10x2x50:block_m=1,num_warps=2``)
set the thread mapping of one fused operator at one (neighbors, heads, head width) over the global
``kernels.*`` knobs; :mod:`fastopt.config` checks the text when it is set, the kernels and the
tuner read and write it through these functions.

This module imports nothing of fastopt but :mod:`fastopt.errors`.
"""

from __future__ import annotations

from fastopt.errors import ConfigError, check_setting

__all__ = ["OP_OVERRIDE_FIELDS", "parse_op_overrides", "format_op_overrides"]

# the mapping fields kernels.op_overrides may set per fused op (those its kernels read); the
# attention's also apply to its backward's segmented reduction, and to shared_attention
OP_OVERRIDE_FIELDS = {
    "temporal_attention": ("rows_per_program", "block_m", "heads_per_program", "num_warps",
                           "num_stages", "max_registers", "gather_eviction"),
    "masked_aggregate": ("rows_per_program", "block_k", "block_m", "num_warps", "num_stages",
                         "max_registers"),
    "time_encode": ("block_k", "num_warps", "num_stages", "max_registers"),
}


def parse_op_overrides(text: str) -> dict:
    """``kernels.op_overrides`` as ``{(op, (K, H, d)): {field: value}}``.

    Raises:
        ConfigError: naming the entry, the rule it breaks and the form expected.
    """
    form = "write op@KxHxd:field=value,... entries joined by ';', e.g. temporal_attention@10x2x50:block_m=1,num_warps=2"
    out: dict = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        head, _, body = entry.partition(":")
        op, _, dims = head.strip().partition("@")
        shape = tuple(int(x) for x in dims.split("x") if x.isdigit())
        if op not in OP_OVERRIDE_FIELDS or len(shape) != 3 or len(dims.split("x")) != 3 or min(shape) < 1:
            raise ConfigError(f"kernels.op_overrides entry {entry!r} must start with one of "
                              f"{', '.join(OP_OVERRIDE_FIELDS)} and a shape KxHxd of positive sizes; {form}")
        if (op, shape) in out:
            raise ConfigError(f"kernels.op_overrides names {head.strip()!r} twice; merge its fields into one entry")
        fields = out[(op, shape)] = {}
        for item in filter(None, (i.strip() for i in body.split(","))):
            name, _, value = (x.strip() for x in item.partition("="))
            if name not in OP_OVERRIDE_FIELDS[op]:
                raise ConfigError(f"kernels.op_overrides: {op} has no field {name!r} (its fields: "
                                  f"{', '.join(OP_OVERRIDE_FIELDS[op])}); {form}")
            fields[name] = _override_value(op, name, value)
        if not fields:
            raise ConfigError(f"kernels.op_overrides entry {entry!r} sets no field; {form}")
    return out


def _override_value(op: str, name: str, value: str):
    if name == "gather_eviction":
        check_setting(value in ("none", "evict_last"), f"kernels.op_overrides {op}.{name}", value,
               "'none' or 'evict_last'")
        return value
    number = int(value) if value.isdigit() else -1
    if name.startswith("block_") or name == "heads_per_program":
        check_setting(number >= 1 and number & (number - 1) == 0, f"kernels.op_overrides {op}.{name}",
               value, "a power of two >= 1")
    elif name == "max_registers":
        check_setting(24 <= number <= 255, f"kernels.op_overrides {op}.{name}", value, "in [24, 255]")
    else:
        check_setting(number >= 1, f"kernels.op_overrides {op}.{name}", value, "an integer >= 1")
    return number


def format_op_overrides(overrides: dict) -> str:
    """The ``kernels.op_overrides`` text of ``{(op, (K, H, d)): {field: value}}`` (sorted; ops
    with no field left out): what :func:`parse_op_overrides` reads back."""
    return ";".join(f"{op}@{'x'.join(map(str, shape))}:" + ",".join(f"{k}={v}" for k, v in sorted(fields.items()))
                    for (op, shape), fields in sorted(overrides.items()) if fields)

