"""What the mixture-of-experts block costs on CPU against the dense MLP of its active size.

A token of a MoE block with E experts of width F, k per token, does the FLOPs of one
SwiGLU MLP of width k*F: that dense MLP is the baseline. Each variant runs one
XLA-compiled forward and backward pass (loss sum(y^2), gradients of every weight):

* `dense`: GatedMLP(D, k*F), the active-size baseline;
* `moe_dropless`: MoeMLP dropless, C = T slots per expert and row (E/k x the active
  FLOPs: TensorFlow has no ragged grouped matmul);
* `moe_capacity_1.25`: MoeMLP with capacity factor 1.25 (1.25 x the active FLOPs);
* `moe_grouped`: MoeMLP dropless by grouped matmul over expert tiles of 32 rows (the
  active FLOPs plus the tiles' padding, at most E*31 rows per sequence);
* `dispatch_only`: router, top-k, sort, gather in and gather back of the dropless slot
  plan, no expert matmuls: the dispatch's own cost.

Rounds interleave the variants (machine noise hits all alike); each figure is the median
over rounds of one round's mean step time. Writes benchmarks/results/moe_dispatch.json.

Usage: python benchmarks/moe_dispatch.py [--rounds 3] [--steps 3]  (about 2 minutes on 2 cores)
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from tfllm.models.common.mlp import GatedMLP  # noqa: E402
from tfllm.models.common.dispatch import (expert_capacity, gather_back,  # noqa: E402
                                          gather_rows, num_tiles, plan_slots)
from tfllm.models.common.moe import MoeMLP, route  # noqa: E402
from host_info import cpu_name  # noqa: E402  (benchmarks/host_info.py)

TILE = 32

# (name, rows B, length T, hidden D, expert width F, experts E, top k)
SHAPES = (("mixtral-like E=8 k=2", 4, 256, 256, 256, 8, 2),
          ("qwen3-moe-like E=32 k=4", 4, 256, 256, 128, 32, 4))




def _variants(d, f, e, k):
    """name -> (forward x -> y, the weights it reads)."""
    dense = GatedMLP(d, k * f, name="dense")
    dropless = MoeMLP(d, f, e, k, name="moe")
    capacity = MoeMLP(d, f, e, k, capacity_factor=1.25, name="moe_capacity")
    grouped = MoeMLP(d, f, e, k, dispatch="grouped", tile=TILE, name="moe_grouped")
    router_only = MoeMLP(d, f, e, k, name="moe_dispatch")

    def dispatch_only(x):
        logits = tf.cast(router_only.router(x), tf.float32)
        weights, experts = route(logits, k, router_only.routing)
        plan = plan_slots(experts, e, x.shape[1])
        return gather_back(gather_rows(x, plan), plan, weights)

    for layer in (dense, dropless, capacity, grouped, router_only):
        layer.build(None)
    return {"dense": (dense, dense.trainable_variables),
            "moe_dropless": (lambda x: dropless(x)[0], dropless.trainable_variables),
            "moe_capacity_1.25": (lambda x: capacity(x)[0], capacity.trainable_variables),
            "moe_grouped": (lambda x: grouped(x)[0], grouped.trainable_variables),
            "dispatch_only": (dispatch_only, router_only.router.trainable_variables)}


def _step(forward, weights):
    @tf.function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.square(forward(x)))
        return tape.gradient(loss, [x] + weights)
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    summary = {}
    for name, b, t, d, f, e, k in SHAPES:
        steps = {}
        for variant, (forward, weights) in _variants(d, f, e, k).items():
            steps[variant] = _step(forward, weights)
        x = tf.random.normal((b, t, d))
        for step in steps.values():  # compile outside the timed rounds
            tf.nest.map_structure(lambda g: g.numpy(), step(x))
        times = {v: [] for v in steps}
        for _ in range(args.rounds):
            for variant, step in steps.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    out = step(x)
                tf.nest.map_structure(lambda g: g.numpy(), out)
                times[variant].append((time.perf_counter() - start) / args.steps)
        medians = {v: statistics.median(s) for v, s in times.items()}
        summary[name] = {
            "shape": dict(rows=b, length=t, hidden=d, expert_width=f, experts=e, top_k=k),
            "median_ms": {v: round(1e3 * s, 2) for v, s in medians.items()},
            "over_dense": {v: round(s / medians["dense"], 2) for v, s in medians.items()},
            # FLOPs of the expert matmuls relative to the dense baseline's
            "flops_over_dense": {"moe_dropless": e / k, "moe_capacity_1.25": round(
                e * expert_capacity(t, k, e, 1.25) / (k * t), 2), "moe_grouped_at_most": round(
                num_tiles(t, k, e, TILE) * TILE / (k * t), 2)},
            "runs_s": times,
        }
        print(name, json.dumps(summary[name]), flush=True)
    summary["_meta"] = {"rounds": args.rounds, "steps": args.steps, "cpu": cpu_name(),
                        "cores": os.cpu_count(), "tensorflow": tf.__version__,
                        "date": time.strftime("%Y-%m-%d")}
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "moe_dispatch.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary["_meta"]))


if __name__ == "__main__":
    main()
