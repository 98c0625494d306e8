"""Blocked vs standard attention on the H100 target: HBM bytes, GEMMs, kernels, roofline.

One attention core (no projections), batch 1 x 4096 tokens, 32 query heads of 128, bf16,
forward + backward (the gradients of q, k and v for a given output gradient), compiled
by XLA for the H100 with jaxlib's compile-only client (`tfllm.plan.gpu_compile`, the
planner's flags: no autotuning, cuBLAS GEMMs) and read by `tfllm.compiler.hlo_stats`:
the roofline time (each kernel bound by its GEMM FLOPs or its bytes), HBM bytes, GEMM
calls, kernels, kernels per computed tile, and GEMMs whose operands are float32 (they
run at the TF32 rate and move twice the bytes). Rows: multi-head (32 key/value heads)
and grouped-query (8 key/value heads), each blocked (`Attention.attend_blocked`) and
standard (`Attention.attend`).

    python benchmarks/attention_bytes.py --out benchmarks/results/attention_bytes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

from tfllm.compiler import hlo_stats
from tfllm.compiler.targets import get_target
from tfllm.models.common.attention import Attention, AttentionSettings
from tfllm.models.common.flash import blocks
from tfllm.plan.planner import compile_in_child

LENGTH, HEADS, HEAD_DIM, BLOCK = 4096, 32, 128, 512


def causal_tiles(length: int, block: int) -> int:
    """Tiles a causal blocked pass computes (the others are skipped)."""
    spans = blocks(length, block)
    return sum(1 for qa, qb in spans for ka, kb in spans if ka <= qb - 1)


def program(kv_heads: int, block: int, length: int = LENGTH) -> bytes:
    """The serialized HLO of one attention core's forward and backward."""
    layer = Attention(AttentionSettings(hidden_dim=HEADS * HEAD_DIM, num_query_heads=HEADS,
                                        num_key_value_heads=kv_heads, head_dim=HEAD_DIM,
                                        block_size=block), dtype="bfloat16")
    attend = layer.attend_blocked if block else layer.attend

    @tf.function(jit_compile=True)
    def step(q, k, v, d_out):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = attend(q, k, v)
        return tape.gradient(out, [q, k, v], output_gradients=d_out)

    spec = lambda h: tf.TensorSpec((1, length, h, HEAD_DIM), tf.bfloat16)  # noqa: E731
    args = [tf.zeros(s.shape, s.dtype) for s in (spec(HEADS), spec(kv_heads),
                                                 spec(kv_heads), spec(HEADS))]
    return step.experimental_get_compiler_ir(*args)(stage="hlo_serialized")


def f32_gemm_operands(text: str) -> int:
    """GEMM kernels of the optimized HLO with a float32 operand."""
    ks, _ = hlo_stats.kernels(text)
    return sum(k.count for k in ks if k.gemm_flops and k.operand_type == "f32")


def measure(kv_heads: int, block: int, target, work: str) -> dict:
    path = os.path.join(work, f"attention_{kv_heads}_{block}.hlo.pb")
    with open(path, "wb") as f:
        f.write(program(kv_heads, block))
    compiled = compile_in_child(path, target)
    text = compiled["optimized_hlo"]
    stats = hlo_stats.summarize(text, target)
    tiles = causal_tiles(LENGTH, block) if block else 1
    return {"kv_heads": kv_heads, "block": block, "tiles": tiles,
            "roofline_ms": stats["roofline_s"] * 1e3,
            "roofline_gemm_ms": stats["roofline_gemm_s"] * 1e3,
            "hbm_gb": stats["bytes"] / 1e9, "gflop": stats["flops"] / 1e9,
            "gemms": stats["gemm_calls"], "kernels": stats["kernels"],
            "kernels_per_tile": stats["kernels"] / tiles,
            "f32_gemm_operands": f32_gemm_operands(text),
            "bytes_per_score": stats["bytes"] / (tiles * HEADS * min(block or LENGTH, LENGTH)
                                                 ** 2),
            "temp_gib": compiled["memory"]["temp"] / 2**30,
            "top_kernels": stats["top_kernels"][:5]}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="Write OUT.json and OUT.md.")
    parser.add_argument("--block", type=int, default=BLOCK)
    parser.add_argument("--kv-heads", default="32,8")
    parser.add_argument("--target", default="h100")
    parser.add_argument("--blocked-only", action="store_true")
    args = parser.parse_args()
    target = get_target(args.target)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for kv in [int(n) for n in args.kv_heads.split(",")]:
            for block in (args.block,) if args.blocked_only else (args.block, 0):
                row = measure(kv, block, target, work)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}),
                      flush=True)
    import jax
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "cpu": cpu_name(), "tensorflow": tf.__version__, "jax": jax.__version__,
              "python": sys.version.split()[0], "target": target.name,
              "shape": {"batch": 1, "length": LENGTH, "heads": HEADS,
                        "head_dim": HEAD_DIM}, "rows": rows}
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()
