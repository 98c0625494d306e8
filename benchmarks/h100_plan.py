"""H100 plans of the presets (no GPU needed): memory, largest batch, FP8 coverage, MFU.

    python benchmarks/h100_plan.py [--out benchmarks/results/h100_plan] [--models ...]

For each model and policy at sequence 2048: plans at micro-batch 1 and 2 give the
memory as a + b * batch (temporaries grow linearly with the batch); the largest batch
that fits is then planned to confirm it (and lowered until it fits). Also plans the
8-GPU meshes of llama-7b. Writes OUT.json and OUT.md.
"""

import argparse
import importlib.metadata
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
    """(largest micro-batch that fits one device, its rows): a linear guess from batches
    1 and 2, then compiles that refine it (re-estimating the slope, then bisecting) until
    the fitting and the failing batch are within 1/16 of each other."""
    p1 = plan(config_for(model, policy, 1))
    p2 = plan(config_for(model, policy, 2))
    rows = [row(model, policy, 1, p1), row(model, policy, 2, p2)]
    log(rows[0]), log(rows[1])
    device, a = p1["memory"]["device"], p1["memory"]["total"]
    if not p1["memory"]["fits"]:
        return 0, rows
    lo, hi = (2, None) if p2["memory"]["fits"] else (1, 2)
    slope = p2["memory"]["total"] - a
    guess = max(lo + 1, math.floor((device - a) / slope) + 1) if hi is None else None
    while hi is None or hi - lo > max(1, lo // 16):
        if hi is not None:
            guess = (lo + hi) // 2
        p = plan(config_for(model, policy, guess))
        rows.append(row(model, policy, guess, p))
        log(rows[-1])
        if p["memory"]["fits"]:
            lo = guess
            if hi is None:  # the memory grew slower than linearly: aim higher
                slope = (p["memory"]["total"] - a) / (guess - 1)
                guess = max(guess + 1, math.floor((device - a) / slope) + 1)
        else:
            hi = guess
    return lo, rows


def extrapolation_check(model, log):
    """Full compile against the 1+2-layer extrapolation, bf16 batch 1."""
    cfg = config_for(model, "bfloat16", 1)
    full, est = plan(cfg, layers="full"), plan(cfg, layers="extrapolate")
    out = {"model": model, "full_temp_gib": full["memory"]["temp"] / 2**30,
           "extrapolated_temp_gib": est["memory"]["temp"] / 2**30,
           "full_total_gib": full["memory"]["total"] / 2**30,
           "extrapolated_total_gib": est["memory"]["total"] / 2**30,
           "full_step_ms": 1e3 * full["estimated_step_s"],
           "extrapolated_step_ms": 1e3 * est["estimated_step_s"]}
    log(out)
    return out


def state_only(model, mesh, devices):
    """Bytes per device of weights + AdamW moments in the mesh's layout (no compile)."""
    from tfllm.plan import sharded
    cfg = config_for(model, "bfloat16", devices, mesh)
    state, _ = sharded.state_bytes(cfg, sharded.mesh_shape(cfg))
    return {"model": model, "mesh": mesh, "state_gib_per_device": state / 2**30}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "h100_plan"))
    parser.add_argument("--models", default="gpt2-small,llama-1b,llama-7b")
    parser.add_argument("--policies", default="bfloat16,fp8")
    parser.add_argument("--meshes", default="fsdp=8;fsdp=4,model=2;data=2,fsdp=4;model=8")
    parser.add_argument("--check-extrapolation", default="gpt2-small,gpt2-medium")
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
    results["extrapolation"] = [extrapolation_check(m, log) for m in
                                filter(None, args.check_extrapolation.split(","))]
    results["state_only"] = [state_only(m, mesh, 8) for m in ("llama-7b", "llama-70b")
                             for mesh in filter(None, args.meshes.split(";"))]
    results["jax"] = importlib.metadata.version("jax")
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
