"""The layout table of a config: every variable's path, shape, layout and bytes per device.

Computed from a model built under `keras.StatelessScope` (shapes only) and the rules
table, without devices or memory, so it works for llama-70b on a laptop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from tfllm.parallel import rules as rules_lib
from tfllm.parallel.mesh import parse_axes, resolve_axes

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4}

# AdamW keeps two float32 states (m, v) per parameter.
OPTIMIZER_STATES_PER_PARAM = 2


@dataclass
class Row:
    path: str
    shape: Tuple[int, ...]
    dtype: str
    logical_axes: Tuple[Optional[str], ...]
    spec: rules_lib.Spec
    optimizer_spec: rules_lib.Spec
    bytes_per_device: int
    optimizer_bytes_per_device: int


def mesh_shape_from_config(mesh, num_devices: Optional[int] = None) -> Dict[str, int]:
    """{axis: size} of a mesh section (`config.mesh`); a -1 axis needs `num_devices`."""
    return dict(resolve_axes(parse_axes(mesh.axes), num_devices))


def layout_rows(model, rules, mesh_shape: Dict[str, int], zero1: bool = False) -> List[Row]:
    """One `Row` per variable of an (abstract) model.

    Raises:
      ShardingError: a variable cannot be laid out (names the variable).
    """
    rows = []
    for var in model.variables:
        shape = tuple(int(n) for n in var.shape)
        spec = rules_lib.resolve_spec(var.path, shape, var.logical_axes, rules, mesh_shape)
        opt_spec = rules_lib.zero1_spec(var.path, shape, spec, mesh_shape) if zero1 else spec
        local = math.prod(rules_lib.shard_shape(shape, spec, mesh_shape))
        opt_local = math.prod(rules_lib.shard_shape(shape, opt_spec, mesh_shape))
        trainable = var.trainable
        rows.append(Row(var.path, shape, var.dtype, tuple(var.logical_axes), spec, opt_spec,
                        local * _DTYPE_BYTES.get(var.dtype, 4),
                        opt_local * 4 * OPTIMIZER_STATES_PER_PARAM if trainable else 0))
    return rows


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def format_table(rows: List[Row], mesh_shape: Dict[str, int]) -> str:
    """The printed table with per-device totals for parameters and optimizer state."""
    header = ("variable", "global shape", "layout", "bytes/device", "opt state/device")
    body = [(r.path, "x".join(map(str, r.shape)) or "scalar", rules_lib.spec_to_str(r.spec),
             _human(r.bytes_per_device), _human(r.optimizer_bytes_per_device)) for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    line = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()
    params = sum(math.prod(r.shape) for r in rows)
    out = [f"mesh: {', '.join(f'{k}={v}' for k, v in mesh_shape.items())} "
           f"({math.prod(mesh_shape.values())} devices)", line(header),
           line(["-" * w for w in widths])]
    out += [line(b) for b in body]
    p_bytes = sum(r.bytes_per_device for r in rows)
    o_bytes = sum(r.optimizer_bytes_per_device for r in rows)
    out += ["", f"parameters: {params:,} ({len(rows)} variables)",
            f"parameters per device: {_human(p_bytes)}",
            f"optimizer state per device (AdamW m, v in float32): {_human(o_bytes)}",
            f"total per device: {_human(p_bytes + o_bytes)}"]
    return "\n".join(out)
