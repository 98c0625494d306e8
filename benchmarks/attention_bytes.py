"""Blocked vs standard attention on the H100 target: HBM bytes, GEMMs, kernels, roofline.

One attention core (no projections), batch 1 x 4096 tokens, 32 query heads of 128, bf16,
forward + backward (the gradients of q, k and v for a given output gradient), compiled
by XLA for the H100 with jaxlib's compile-only client (`tfllm.plan.gpu_compile`, the
planner's flags: no autotuning, cuBLAS GEMMs) and read by `tfllm.compiler.hlo_stats`:
the roofline time (each kernel bound by its GEMM FLOPs or its bytes), HBM bytes, GEMM
calls, kernels, kernels per computed tile, and GEMMs with a float32 operand (they run at
the TF32 rate and move twice the bytes). Bytes are counted two ways: every fusion
operand read whole (as the issue measured), and a fusion operand that the fusion only
slices read as its slices (`partial_reads`; what the kernel reads, what `tfllm plan`
counts, and how XLA's own GPU performance model counts an operand by its utilization). Rows: 32 and 8 key/value heads, blocked (`Attention.attend_blocked`,
tiles of 512 and 1024) and standard (`Attention.attend`); and blocked with its causal
tiles' masks computed from the rows' positions, as the training forward pass makes them
(`masks.row_positions`), instead of constants; and blocked with the waits a DTensor mesh
gets (every tfllm train step runs under one, one device included: `+ 0 * y` sums instead
of XLA's optimization barrier, which DTensor cannot lay out).

    python benchmarks/attention_bytes.py --out benchmarks/results/attention_bytes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Optional

import tensorflow as tf

from tfllm.compiler import hlo_stats
from tfllm.compiler.targets import get_target
from tfllm.models.common.attention import Attention, AttentionSettings
from tfllm.models.common import flash
from tfllm.models.common.flash import blocks
from tfllm.plan.planner import compile_in_child
from host_info import cpu_name  # noqa: E402  (benchmarks/host_info.py)

LENGTH, HEADS, HEAD_DIM = 4096, 32, 128
# key/value heads:tile (0: standard attention)[:p (masks from positions) | :m (the waits
# on a DTensor mesh)]
ROWS = ("32:512", "32:1024", "32:0", "32:512:p", "32:512:m", "8:512", "8:1024", "8:0")


def causal_tiles(length: int, block: int) -> int:
    """Tiles a causal blocked pass computes (the others are skipped)."""
    spans = blocks(length, block)
    return sum(1 for qa, qb in spans for ka, _ in spans if ka <= qb - 1)


def program(kv_heads: int, block: int, length: int = LENGTH, positions: bool = False,
            mesh_waits: bool = False) -> bytes:
    """The serialized HLO of one attention core's forward and backward (`positions`: the
    blocked tiles' masks from a (1, T) argument of positions, else constants;
    `mesh_waits`: the tiles wait as under a DTensor mesh, `flash.after`'s sums)."""
    if mesh_waits:
        from unittest import mock
        with mock.patch.object(flash, "current", lambda: "a DTensor mesh"):
            return program(kv_heads, block, length, positions)
    layer = Attention(AttentionSettings(hidden_dim=HEADS * HEAD_DIM, num_query_heads=HEADS,
                                        num_key_value_heads=kv_heads, head_dim=HEAD_DIM,
                                        block_size=block), dtype="bfloat16")
    attend = layer.attend_blocked if block else layer.attend

    @tf.function(jit_compile=True, autograph=False)
    def step(q, k, v, d_out, rows):
        kwargs = {"positions": rows} if positions else {}
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = attend(q, k, v, attention_mask=None, **kwargs)
        return tape.gradient(out, [q, k, v], output_gradients=d_out)

    shapes = [(1, length, h, HEAD_DIM) for h in (HEADS, kv_heads, kv_heads, HEADS)]
    args = [tf.zeros(s, tf.bfloat16) for s in shapes] + [tf.range(length)[None]]
    return step.experimental_get_compiler_ir(*args)(stage="hlo_serialized")


def f32_gemm_operands(text: str) -> int:
    """GEMM launches of the optimized HLO with a float32 operand."""
    comps = hlo_stats.parse_module(text)
    by_name = {}
    for comp in comps.values():
        by_name.update(comp.by_name)
    ks, _ = hlo_stats.kernels(text)
    count = 0
    for k in ks:
        inst = by_name.get(k.name)
        if not k.gemm_flops or inst is None:
            continue
        types = [t for o in inst.operands[:2] if o in by_name
                 for t, _ in hlo_stats.arrays(by_name[o].type_text)]
        count += k.count if "f32" in types else 0
    return count


def measure(kv_heads: int, block: int, target, work: str, positions: bool = False,
            mesh_waits: bool = False) -> dict:
    path = os.path.join(work, f"attention_{kv_heads}_{block}_{int(positions)}"
                              f"{int(mesh_waits)}.hlo.pb")
    with open(path, "wb") as f:
        f.write(program(kv_heads, block, positions=positions, mesh_waits=mesh_waits))
    compiled = compile_in_child(path, target)
    text = compiled["optimized_hlo"]
    whole, sliced = (hlo_stats.summarize(text, target, partial_reads=p) for p in (False, True))
    tiles = causal_tiles(LENGTH, block) if block else 1
    scores = tiles * HEADS * (block or LENGTH) ** 2 if block else HEADS * LENGTH ** 2
    return {"kv_heads": kv_heads, "block": block, "tiles": tiles,
            "masks": "positions" if positions else "constants",
            "waits": "mesh" if mesh_waits else "barrier",
            "roofline_ms": whole["roofline_s"] * 1e3,
            "roofline_ms_sliced": sliced["roofline_s"] * 1e3,
            "hbm_gb": whole["bytes"] / 1e9, "hbm_gb_sliced": sliced["bytes"] / 1e9,
            "bytes_per_score": whole["bytes"] / scores,
            "bytes_per_score_sliced": sliced["bytes"] / scores,
            "gflop": whole["flops"] / 1e9, "gemms": whole["gemm_calls"],
            "kernels": whole["kernels"], "kernels_per_tile": whole["kernels"] / tiles,
            "f32_gemm_operands": f32_gemm_operands(text),
            "temp_gib": compiled["memory"]["temp"] / 2**30,
            "top_kernels": sliced["top_kernels"][:5]}


def table(rows) -> list:
    lines = ["| kv heads | attention | tiles | roofline ms (whole / sliced) | HBM GB "
             "(whole / sliced) | B per score (sliced) | GEMMs | kernels | kernels/tile | "
             "f32 GEMM operands | temp GiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kind = f"blocked {r['block']}" if r["block"] else "standard"
        if r.get("masks") == "positions":
            kind += ", masks from positions"
        if r.get("waits") == "mesh":
            kind += ", waits as on a DTensor mesh"
        lines.append(f"| {r['kv_heads']} | {kind} | {r['tiles']} | {r['roofline_ms']:.2f} / "
                     f"{r['roofline_ms_sliced']:.2f} | {r['hbm_gb']:.1f} / "
                     f"{r['hbm_gb_sliced']:.1f} | {r['bytes_per_score_sliced']:.1f} | "
                     f"{r['gemms']} | {r['kernels']} | {r['kernels_per_tile']:.1f} | "
                     f"{r['f32_gemm_operands']} | {r['temp_gib']:.2f} |")
    return lines


def markdown(result: dict, before: Optional[dict] = None) -> str:
    lines = [f"# Attention's HBM traffic on the H100 target ({result['date']})", "",
             f"`benchmarks/attention_bytes.py`: one attention core, batch 1 x {LENGTH}, "
             f"{HEADS} query heads of {HEAD_DIM}, bf16, forward + backward, compiled for "
             f"the {result['target']} without a GPU on {result['cpu']} (TensorFlow "
             f"{result['tensorflow']}, jax {result['jax']}, Python {result['python']}). "
             "Roofline: each kernel bound by its GEMM FLOPs or its HBM bytes, one after "
             "another. *whole*: every fusion operand read whole (the issue's 6.26 ms); "
             "*sliced*: an operand a fusion only slices read as its slices (what the "
             "kernel reads, and tfllm plan's count).", ""] + table(result["rows"])
    if before:
        lines += ["", f"## Before ({before['commit']}: the same script with that commit's "
                  "flash.py and attention.py)", ""] + table(before["rows"])
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="Write OUT.json and OUT.md.")
    parser.add_argument("--rows", default=",".join(ROWS),
                        help="kv_heads:tile[:p] (tile 0: standard attention; p: blocked "
                             "masks from positions).")
    parser.add_argument("--target", default="h100")
    parser.add_argument("--before", default=None,
                        help="A JSON result of this script on earlier code, shown beside.")
    args = parser.parse_args()
    target = get_target(args.target)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for pair in args.rows.split(","):
            kv, block, *flag = pair.split(":")
            row = measure(int(kv), int(block), target, work, positions=flag == ["p"],
                          mesh_waits=flag == ["m"])
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}),
                  flush=True)
    import jax  # the plan extra's; only the compile child needs it, this reports its version
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "cpu": cpu_name(), "tensorflow": tf.__version__, "jax": jax.__version__,
              "python": sys.version.split()[0], "target": target.name,
              "shape": {"batch": 1, "length": LENGTH, "heads": HEADS,
                        "head_dim": HEAD_DIM}, "rows": rows}
    before = None
    if args.before:
        with open(args.before) as f:
            before = json.load(f)
    text = markdown(result, before)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
