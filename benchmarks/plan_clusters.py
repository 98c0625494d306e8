"""XLA clusters per device of DTensor's real train step, for the plan's dispatch term.

    python benchmarks/plan_clusters.py [--out benchmarks/results/h100_plan]

On a mesh, TensorFlow hands XLA not one program per device but many clusters, split at
every collective; `tfllm plan` prices each cluster's dispatch (`tfllm.plan.timing`). This
runs the step that `tfllm train` runs (`jit_compile`, DTensor, 8 logical CPU devices) of
each model's family on each mesh at tiny widths with 1, 2 and 3 layers, reads the busiest
device's clusters from the executed graphs (`tfllm.compiler.costs`), checks that each block
adds the same count, and extrapolates to the model's layers. One case also runs at the
model's own widths (a short sequence) to check that widths do not change the count.
Adds {"clusters": [...]} to OUT.json; `benchmarks/h100_plan.py --markdown-only` writes
the table.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfllm.config import load_config  # noqa: E402
from tfllm.footprint import layout as footprint  # noqa: E402
from tfllm.plan import measured  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: (model, mesh, global batch): the presets' meshes and one hybrid one
CASES = [("gpt2-small", "fsdp=8", 8), ("llama-1b", "fsdp=8", 8),
         ("llama-1b", "data=2,fsdp=4", 8), ("llama-7b", "fsdp=8", 16),
         ("llama-7b", "fsdp=4,model=2", 8)]
#: the case also run at the model's own widths (sequence 64: the count is per op, not
#: per element)
WIDTH_CHECK = ("gpt2-small", "fsdp=8", 8)


def config_for(model, mesh, batch, sequence=2048):
    return load_config(os.path.join(ROOT, "configs", f"{model}.yaml"), [
        "precision.policy=bfloat16", f"data.sequence_length={sequence}",
        f"model.max_sequence_length={sequence}", f"train.global_batch_size={batch}",
        "train.grad_accum_steps=1", f"mesh.axes={mesh}", "model.remat=none",
        "model.attention_chunk=0"])


def count(model, mesh, batch, log) -> dict:
    config = config_for(model, mesh, batch)
    shape = footprint.mesh_shape(config)
    start = time.time()
    runs = measured.run_tiny(config, shape, layers=(1, 2, 3), timeout=3600)
    c = {n: r["clusters"] for n, r in runs.items()}
    per_block = c[2] - c[1]
    layers = config.model.num_layers
    row = {"model": model, "mesh": mesh, "batch": batch, "layers": layers,
           "tiny_clusters": {str(n): v for n, v in c.items()},
           "tiny_collectives": {str(n): len(r["collectives"]) for n, r in runs.items()},
           "linear": c[3] - c[2] == per_block, "per_block": per_block,
           "clusters": c[1] + per_block * (layers - 1),
           "collectives": len(runs[1]["collectives"]) + (
               len(runs[2]["collectives"]) - len(runs[1]["collectives"])) * (layers - 1),
           "seconds": time.time() - start}
    log(row)
    return row


def width_check(model, mesh, batch, log) -> dict:
    """The 1-layer count at the model's own widths against the tiny widths'."""
    config = config_for(model, mesh, batch, sequence=64)
    shape = footprint.mesh_shape(config)
    own = measured.run_tiny(config, shape, layers=(1,), tiny=False, timeout=3600)[1]
    tiny = measured.run_tiny(config, shape, layers=(1,), timeout=3600)[1]
    row = {"model": model, "mesh": mesh, "layers": 1, "own_widths": own["clusters"],
           "tiny_widths": tiny["clusters"], "own_collectives": len(own["collectives"]),
           "tiny_collectives": len(tiny["collectives"])}
    log(row)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "h100_plan"))
    parser.add_argument("--cases", default=None,
                        help="MODEL:MESH:BATCH;... (default: CASES)")
    parser.add_argument("--no-width-check", action="store_true")
    args = parser.parse_args()
    cases = CASES if not args.cases else [
        (m, mesh, int(b)) for m, mesh, b in (c.split(":") for c in args.cases.split(";"))]
    def save(key, value):  # each case takes minutes: keep each one
        with open(args.out + ".json") as f:
            results = json.load(f)
        if key == "clusters":
            done = {(r["model"], r["mesh"]): r for r in results.get("clusters", [])}
            done[(value["model"], value["mesh"])] = value
            value = list(done.values())
        results[key] = value
        results["clusters_date"] = time.strftime("%Y-%m-%d")
        with open(args.out + ".json", "w") as f:
            json.dump(results, f, indent=1)

    if not args.no_width_check:
        save("clusters_width_check", width_check(*WIDTH_CHECK, print))
    for case in cases:
        save("clusters", count(*case, print))


if __name__ == "__main__":
    main()
