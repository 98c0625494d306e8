"""Peak memory and collective sizes of one FSDP train step against one device.

Each case runs two train steps (tracing, DTensor's lowering and the step itself) in a
fresh process under `/usr/bin/time -f %M` on a host split into 8 logical CPU devices. All
logical devices share the host's RAM, so a sharded step's peak RSS compares directly with
one device's: real FSDP stays near 1x, a step that gathers the whole model on every
device is many times larger. The largest collective of a device's executed program is
read from the run metadata (`tfllm.train.tf_internal.collect_executed_graphs`).

    python benchmarks/fsdp_memory.py --out benchmarks/results/fsdp_memory
    python benchmarks/fsdp_memory.py --size small --meshes none fsdp=8   # a quick check

Cases run interleaved (one, then the next, repeated) because the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {
    # ~120M parameters: 8 x 12.8M in the blocks, 2 x 8.4M embedding and head.
    "120m": {"model.hidden_dim": 1024, "model.num_layers": 8, "model.vocab_size": 8192,
             "model.intermediate_dim": 2816, "model.num_query_heads": 16,
             "model.num_key_value_heads": 16},
    "small": {"model.hidden_dim": 256, "model.num_layers": 4, "model.vocab_size": 2048,
              "model.intermediate_dim": 704, "model.num_query_heads": 8,
              "model.num_key_value_heads": 8},
}
# glibc raises its mmap threshold up to 32 MiB after freeing a large block, and keeps
# later freed blocks of that size in its arenas: RSS then stays at the largest amount
# ever freed per thread, not what is alive. A fixed threshold returns every large tensor
# to the system when freed, so peak RSS follows the live tensors.
MMAP_THRESHOLD = "65536"
COMMON = {"model.family": "llama", "model.max_sequence_length": 64,
          "data.sequence_length": 32, "train.global_batch_size": 8, "train.steps": 1,
          "data.source": "synthetic", "precision.policy": "float32"}


def child(size: str, mesh: str, policy: str, out_path: str) -> None:
    """One step; writes the largest collective of device 0's program to `out_path`."""
    from tfllm.parallel.mesh import setup_cpu_devices
    setup_cpu_devices(8)
    from tfllm.config import load_config
    from tfllm.data import SyntheticTokens
    from tfllm.parallel import make_parallel
    from tfllm.train.state import build_train_state
    values = dict(COMMON, **SIZES[size])
    values["precision.policy"] = policy
    values["mesh.axes"] = "data=1" if mesh == "none" else mesh
    cfg = load_config(None, [f"{k}={v}" for k, v in values.items()])
    parallel = None if mesh == "none" else make_parallel(cfg)
    state = build_train_state(cfg, parallel, jit_compile=False)
    params = sum(int(v.shape.num_elements()) for v in state.model.trainable_variables)
    largest_weight = max(int(v.shape.num_elements()) for v in state.model.trainable_variables)
    data = SyntheticTokens(cfg.model.vocab_size, cfg.data.sequence_length + 1, seed=7)
    batch = state.step.to_device(data.batch(0, cfg.train.global_batch_size, 1))
    state.step(batch)
    # The second step's peak of live tensor bytes (TF_CPU_ALLOCATOR_USE_BFC: the host's
    # one allocator, shared by the logical devices, keeps exact statistics).
    import tensorflow as tf
    tf.config.experimental.reset_memory_stats("CPU:0")
    state.step(batch)
    tensors = tf.config.experimental.get_memory_info("CPU:0")
    report = state.step.cost_report  # read from the first step's executed graphs
    largest = report.largest.elements if report.largest is not None else 0
    count = len(report.collectives)
    with open(out_path, "w") as f:
        json.dump({"params": params, "largest_weight": largest_weight,
                   "peak_tensor_gib": tensors["peak"] / 2**30,
                   "held_tensor_gib": tensors["current"] / 2**30,
                   "largest_collective": largest, "collectives": count}, f)


def run_case(size: str, mesh: str, policy: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        r = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, __file__, "--child",
                            size, mesh, policy, out], capture_output=True, text=True,
                           cwd=ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                                              MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD,
                                              TF_CPU_ALLOCATOR_USE_BFC="true"))
        if r.returncode:
            raise SystemExit(f"{mesh} failed:\n{r.stderr[-3000:]}")
        result = json.load(open(out))
    result["peak_rss_gib"] = int(r.stderr.strip().splitlines()[-1]) / 2**20
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="120m", choices=sorted(SIZES))
    parser.add_argument("--policy", default="float32")
    parser.add_argument("--meshes", nargs="+",
                        default=["none", "fsdp=8", "data=2,fsdp=4", "fsdp=4,model=2"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", help="write OUT.json and OUT.md")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    runs = {m: [] for m in args.meshes}
    for _ in range(args.repeats):
        for mesh in args.meshes:
            runs[mesh].append(run_case(args.size, mesh, args.policy))
            print(mesh, runs[mesh][-1], flush=True)
    base = statistics.median(r["peak_rss_gib"] for r in runs[args.meshes[0]])
    base_tensors = statistics.median(r["peak_tensor_gib"] for r in runs[args.meshes[0]])
    rows = []
    for mesh, results in runs.items():
        peak = statistics.median(r["peak_rss_gib"] for r in results)
        tensors = statistics.median(r["peak_tensor_gib"] for r in results)
        rows.append({"mesh": mesh, "peak_rss_gib": round(peak, 2),
                     "peak_tensor_gib": round(tensors, 2),
                     "tensor_ratio": round(tensors / base_tensors, 2),
                     "held_tensor_gib": round(results[0]["held_tensor_gib"], 2),
                     "peak_rss_all": [round(r["peak_rss_gib"], 2) for r in results],
                     "ratio": round(peak / base, 2), **{k: results[0][k] for k in (
                         "params", "largest_weight", "largest_collective", "collectives")}})
    for row in rows:
        print(json.dumps(row))
    if args.out:
        import tensorflow as tf
        meta = {"size": args.size, "policy": args.policy, "repeats": args.repeats,
                "tensorflow": tf.__version__, "host": "8 logical CPU devices, shared RAM",
                "settings": {k: v for k, v in os.environ.items()
                             if k.startswith(("DTENSOR_", "LOWER_DTENSOR"))}}
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(f"# FSDP step memory ({args.size} llama, {args.policy}, one step)\n\n"
                    "| mesh | peak RSS GiB (median) | runs | x first | peak live tensors GiB "
                    "(2nd step) | x first | largest collective (elements) | largest weight "
                    "| collectives/device |\n|---|---|---|---|---|---|---|---|---|\n")
            for r in rows:
                f.write(f"| {r['mesh']} | {r['peak_rss_gib']} | {r['peak_rss_all']} | "
                        f"{r['ratio']} | {r['peak_tensor_gib']} | {r['tensor_ratio']} | "
                        f"{r['largest_collective']:,} | "
                        f"{r['largest_weight']:,} | {r['collectives']} |\n")


if __name__ == "__main__":
    main()
