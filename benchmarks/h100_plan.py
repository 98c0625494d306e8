"""H100 plans of the presets (no GPU needed): memory, largest batch, FP8 coverage, MFU.

    python benchmarks/h100_plan.py [--out benchmarks/results/h100_plan] [--models ...]

For each model and policy at sequence 2048: plans at micro-batch 1 and 2 give the
memory as a + b * batch (temporaries grow linearly with the batch); the largest batch
that fits is then planned to confirm it (and lowered until it fits). Also plans the
8-GPU meshes of llama-7b. Writes OUT.json and OUT.md.
"""

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfllm.config import load_config  # noqa: E402
from tfllm.plan.planner import plan  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 2048


def config_for(model, policy, batch, mesh="data=1"):
    return load_config(os.path.join(ROOT, "configs", f"{model}.yaml"), [
        f"precision.policy={policy}", f"data.sequence_length={SEQ}",
        f"model.max_sequence_length={SEQ}", f"train.global_batch_size={batch}",
        "train.grad_accum_steps=1", f"mesh.axes={mesh}"])


def row(model, policy, batch, p):
    m = p["memory"]
    return {"model": model, "policy": policy, "batch": batch, "mesh": p.get("mesh"),
            "method": p["method"], "params": p["num_params"],
            "total_gib": m["total"] / 2**30, "arguments_gib": m["arguments"] / 2**30,
            "temp_gib": m["temp"] / 2**30, "fits": m["fits"],
            "margin_gib": m["margin"] / 2**30, "gemm_calls": p["gemm_calls"],
            "fp8_gemm_calls": p["fp8_gemm_calls"], "fp8_projections": p["fp8_projections"],
            "fp8_flops_share": p["fp8_flops"] / p["flops"] if p["flops"] else 0.0,
            "flops": p["flops"], "model_flops": p["model_flops"], "bytes": p["bytes"],
            "estimated_step_s": p["estimated_step_s"],
            "estimated_tokens_per_s": p["estimated_tokens_per_s"],
            "estimated_mfu": p["estimated_mfu"], "compile_s": p["compile_s"],
            "collectives_gb": (p.get("collectives") or {}).get("bytes_per_device", 0) / 1e9,
            "top_kernels": p.get("top_kernels", [])[:5]}


def largest_batch(model, policy, log):
    p1 = plan(config_for(model, policy, 1))
    p2 = plan(config_for(model, policy, 2))
    a, b = p1["memory"]["total"], p2["memory"]["total"] - p1["memory"]["total"]
    device = p1["memory"]["device"]
    rows = [row(model, policy, 1, p1), row(model, policy, 2, p2)]
    log(rows[0]), log(rows[1])
    guess = max(1, math.floor((device - a) / b) + 1) if b > 0 else 1
    while guess > 2:
        p = plan(config_for(model, policy, guess))
        rows.append(row(model, policy, guess, p))
        log(rows[-1])
        if p["memory"]["fits"]:
            return guess, rows
        guess -= max(1, guess // 16)
    return (2 if p2["memory"]["fits"] else 1 if p1["memory"]["fits"] else 0), rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "h100_plan"))
    parser.add_argument("--models", default="gpt2-small,llama-1b,llama-7b")
    parser.add_argument("--policies", default="bfloat16,fp8")
    parser.add_argument("--meshes", default="fsdp=8;fsdp=4,model=2;data=2,fsdp=4;model=8")
    args = parser.parse_args()
    results = {"date": time.strftime("%Y-%m-%d"), "sequence_length": SEQ, "rows": [],
               "largest_batch": {}, "mesh_rows": []}
    log = lambda r: print(json.dumps({k: v for k, v in r.items() if k != "top_kernels"}),
                          flush=True)
    for model in filter(None, args.models.split(",")):
        for policy in args.policies.split(","):
            best, rows = largest_batch(model, policy, log)
            results["rows"] += rows
            results["largest_batch"][f"{model}/{policy}"] = best
            with open(args.out + ".json", "w") as f:
                json.dump(results, f, indent=1)
    for mesh in filter(None, args.meshes.split(";")):
        for policy in args.policies.split(","):
            p = plan(config_for("llama-7b", policy, 8 * 4, mesh))  # 4 sequences per device
            results["mesh_rows"].append(row("llama-7b", policy, 32, p))
            log(results["mesh_rows"][-1])
            with open(args.out + ".json", "w") as f:
                json.dump(results, f, indent=1)
    results["jax"] = p["jax"]
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
