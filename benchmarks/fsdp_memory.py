"""Peak memory and collective sizes of one FSDP train step against one device.

Each case runs two train steps in a fresh process on a host split into 8 logical CPU
devices. All logical devices share the host's RAM, so a sharded step's peak RSS compares
directly with one device's: real FSDP stays near 1x, a step that gathers the whole model
on every device is many times larger. Two peaks are measured per step:

* live tensor bytes (`TF_CPU_ALLOCATOR_USE_BFC=true`: the host's one allocator, shared by
  the logical devices, keeps exact statistics; `reset_memory_stats` before each step);
* peak RSS (VmHWM, reset with `/proc/self/clear_refs` before the second step).

The first step also traces the step and runs DTensor's lowering (host memory spent once
per program); the second step is what every later step costs. The largest collective
of a device's executed program is read from the run metadata of the first step.

    python benchmarks/fsdp_memory.py --out benchmarks/results/fsdp_memory
    python benchmarks/fsdp_memory.py --size small --meshes none fsdp=8   # a quick check
    python benchmarks/fsdp_memory.py --size small --meshes fsdp=8 --remat none full \
        --set data.sequence_length=256 train.global_batch_size=16   # what remat saves

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


def child(size: str, mesh: str, policy: str, out_path: str, *sets: str) -> None:
    """Two steps; writes their peaks (RSS, live tensors), the tensors held after them and
    the first step's largest collective to `out_path` (JSON). `sets`: more settings
    (`key=value`), applied last."""
    from tfllm.runtime.devices import setup_cpu_devices
    setup_cpu_devices(8)
    from tfllm.compiler.reports import FirstCall
    from tfllm.data import feed
    from tfllm.config import load_config
    from tfllm.data import SyntheticTokens
    from tfllm.parallel import make_parallel
    from tfllm.train.state import build_train_state
    values = dict(COMMON, **SIZES[size])
    values["precision.policy"] = policy
    values["mesh.axes"] = "data=1" if mesh == "none" else mesh
    cfg = load_config(None, [f"{k}={v}" for k, v in values.items()] + list(sets))
    parallel = None if mesh == "none" else make_parallel(cfg.mesh, cfg.model, cfg.optimizer)
    state = build_train_state(cfg, parallel, jit_compile=False)
    params = sum(int(v.shape.num_elements()) for v in state.model.trainable_variables)
    largest_weight = max(int(v.shape.num_elements()) for v in state.model.trainable_variables)
    # The weights that move together (tfllm.parallel.blocks): the largest block's.
    largest_block = max(sum(int(v.shape.num_elements()) for v in b.trainable_variables)
                        for b in state.model.blocks)
    data = SyntheticTokens(cfg.model.vocab_size, cfg.data.sequence_length + 1, seed=7)
    batch = feed.to_device(state.step.parallel, data.batch(0, cfg.train.global_batch_size, 1))
    import tensorflow as tf
    # Peaks of live tensor bytes per step (TF_CPU_ALLOCATOR_USE_BFC: the host's one
    # allocator, shared by the logical devices, keeps exact statistics).
    tf.config.experimental.reset_memory_stats("CPU:0")
    first = FirstCall(state.step.parallel, False)  # reads the first step's executed graphs
    state.step(batch, reader=first)
    rss_first = _peak_rss_gib()
    tensors_first = tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**30
    tf.config.experimental.reset_memory_stats("CPU:0")
    _reset_peak_rss()
    state.step(batch)
    tensors = tf.config.experimental.get_memory_info("CPU:0")
    rss_second = _peak_rss_gib()
    report = first.report.costs
    largest = report.largest.elements if report.largest is not None else 0
    count = len(report.collectives)
    with open(out_path, "w") as f:
        json.dump({"params": params, "largest_weight": largest_weight,
                   "largest_block": largest_block,
                   "peak_tensor_gib": tensors["peak"] / 2**30,
                   "held_tensor_gib": tensors["current"] / 2**30,
                   "largest_collective": largest, "collectives": count,
                   "first_rss_gib": rss_first, "first_tensor_gib": tensors_first,
                   "peak_rss_gib": rss_second}, f)


def _reset_peak_rss() -> None:
    """Resets the kernel's peak RSS of this process (Linux 4.0+: `clear_refs` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss_gib() -> float:
    """Peak RSS since the last reset (VmHWM), GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    raise OSError("no VmHWM in /proc/self/status")


def run_case(size: str, mesh: str, policy: str, sets=()) -> dict:
    """One case in a fresh process (see `child`); `sets`: more `key=value` settings."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        r = subprocess.run([sys.executable, __file__, "--child",
                            size, mesh, policy, out, *sets], capture_output=True, text=True,
                           cwd=ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                                              MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD,
                                              TF_CPU_ALLOCATOR_USE_BFC="true"))
        if r.returncode:
            raise SystemExit(f"{mesh} failed:\n{r.stderr[-3000:]}")
        return json.load(open(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="120m", choices=sorted(SIZES))
    parser.add_argument("--policy", default="float32")
    parser.add_argument("--meshes", nargs="+",
                        default=["none", "fsdp=8", "data=2,fsdp=4", "fsdp=4,model=2"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", help="write OUT.json and OUT.md")
    parser.add_argument("--remat", nargs="+", default=["none"],
                        help="model.remat policies: each mesh runs under each")
    parser.add_argument("--set", nargs="*", default=[], help="more key=value settings")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    cases = [(m, r) for m in args.meshes for r in args.remat]
    name = lambda m, r: m if args.remat == ["none"] else f"{m} remat={r}"  # noqa: E731
    runs = {name(m, r): [] for m, r in cases}
    for _ in range(args.repeats):
        for mesh, remat in cases:
            result = run_case(args.size, mesh, args.policy,
                              [f"model.remat={remat}", *args.set])
            runs[name(mesh, remat)].append(result)
            print(name(mesh, remat), result, flush=True)
    keys = ("peak_rss_gib", "peak_tensor_gib", "first_rss_gib", "first_tensor_gib")
    base = {k: statistics.median(r[k] for r in runs[name(*cases[0])]) for k in keys}
    rows = []
    for mesh, results in runs.items():
        row = {"mesh": mesh}
        for k in keys:
            value = statistics.median(r[k] for r in results)
            row[k] = round(value, 2)
            row[k.replace("_gib", "_ratio")] = round(value / base[k], 2)
        row["peak_rss_all"] = [round(r["peak_rss_gib"], 2) for r in results]
        row["held_tensor_gib"] = round(results[0]["held_tensor_gib"], 2)
        row.update({k: results[0][k] for k in (
            "params", "largest_weight", "largest_collective", "collectives")})
        rows.append(row)
    for row in rows:
        print(json.dumps(row))
    if args.out:
        import tensorflow as tf
        meta = {"size": args.size, "policy": args.policy, "repeats": args.repeats,
                "settings_set": args.set,
                "tensorflow": tf.__version__, "host": "8 logical CPU devices, shared RAM",
                "settings": {k: v for k, v in os.environ.items()
                             if k.startswith(("DTENSOR_", "LOWER_DTENSOR"))}}
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(f"# FSDP step memory ({args.size} llama, {args.policy}; medians of "
                    f"{args.repeats} runs; x = ratio to `{name(*cases[0])}`)\n\n"
                    "| mesh | step: peak RSS GiB | runs | x | step: peak live tensors "
                    "GiB | x | first step (traces, lowers): peak RSS GiB | x | live "
                    "tensors GiB | x | largest collective (elements) | largest weight | "
                    "collectives/device |\n|" + "---|" * 13 + "\n")
            for r in rows:
                f.write(f"| {r['mesh']} | {r['peak_rss_gib']} | {r['peak_rss_all']} | "
                        f"{r['peak_rss_ratio']} | {r['peak_tensor_gib']} | "
                        f"{r['peak_tensor_ratio']} | {r['first_rss_gib']} | "
                        f"{r['first_rss_ratio']} | {r['first_tensor_gib']} | "
                        f"{r['first_tensor_ratio']} | {r['largest_collective']:,} | "
                        f"{r['largest_weight']:,} | {r['collectives']} |\n")

if __name__ == "__main__":
    main()
