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
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfllm.config import load_config  # noqa: E402
from tfllm.plan import timing  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 2048
ATTENTION_CHUNK = 0  # --attention-chunk: blocked attention's block size (0: standard)


def overrides_for(model, policy, batch, mesh="data=1"):
    return [f"precision.policy={policy}", f"data.sequence_length={SEQ}",
            f"model.max_sequence_length={SEQ}", f"train.global_batch_size={batch}",
            "train.grad_accum_steps=1", f"mesh.axes={mesh}", "model.remat=none",
            f"model.attention_chunk={ATTENTION_CHUNK}"]


def config_for(model, policy, batch, mesh="data=1"):
    return load_config(os.path.join(ROOT, "configs", f"{model}.yaml"),
                       overrides_for(model, policy, batch, mesh))


def plan(model, policy, batch, mesh="data=1", layers="auto", collectives="measured"):
    """`tfllm plan --json` in a process of its own: the variables of each exported step
    are then freed with the process (in one process, gpt2-small's ten plans and then
    llama-1b's took 20 GB of host memory and were OOM-killed)."""
    cmd = [sys.executable, "-m", "tfllm.cli.main", "plan", "--json", "--layers", layers,
           "--collectives", collectives,
           "--config", os.path.join(ROOT, "configs", f"{model}.yaml")]
    for o in overrides_for(model, policy, batch, mesh):
        cmd += ["--set", o]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout)


def _basis(r) -> str:
    basis = (r.get("collectives_basis") or "assumed").split(":")[0]
    if basis == "measured" and r.get("collectives_assumed_gb"):
        return f"{basis} ({r['collectives_assumed_gb']:.1f})"
    return basis


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
            "collectives_basis": (p.get("collectives") or {}).get("basis", ""),
            "collectives_assumed_gb": (p.get("collectives_assumed") or {}).get(
                "bytes_per_device", 0) / 1e9,
            "top_kernels": p.get("top_kernels", [])[:5],
            # since issue 35 item 6: fits against the usable memory, the modelled step
            "usable_gib": m.get("usable", m["device"]) / 2**30,
            "roofline_step_s": p.get("roofline_step_s", p["estimated_step_s"]),
            "step_time": p.get("step_time"), "optimizer_update": p.get("optimizer_update"),
            "clusters": p.get("clusters", 1)}


def largest_batch(model, policy, log, refinements=3):
    """(largest micro-batch known to fit one device, its rows): a linear guess from
    batches 1 and 2, then up to `refinements` compiles that refine it (re-estimating the
    slope from the last fitting batch, then bisecting)."""
    p1 = plan(model, policy, 1)
    rows = [row(model, policy, 1, p1)]
    log(rows[0])
    if not p1["memory"]["fits"]:
        return 0, rows
    p2 = plan(model, policy, 2)
    rows.append(row(model, policy, 2, p2))
    log(rows[-1])
    device, a = p1["memory"]["device"], p1["memory"]["total"]
    lo, hi = (2, None) if p2["memory"]["fits"] else (1, 2)
    slope = p2["memory"]["total"] - a
    guess = max(lo + 1, math.floor((device - a) / slope) + 1)
    for _ in range(refinements):
        if hi is not None:
            if hi - lo <= 1:
                break
            guess = (lo + hi) // 2
        p = plan(model, policy, guess)
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
    full = plan(model, "bfloat16", 1, layers="full")
    est = plan(model, "bfloat16", 1, layers="extrapolate")
    out = {"model": model, "full_temp_gib": full["memory"]["temp"] / 2**30,
           "extrapolated_temp_gib": est["memory"]["temp"] / 2**30,
           "full_total_gib": full["memory"]["total"] / 2**30,
           "extrapolated_total_gib": est["memory"]["total"] / 2**30,
           "full_step_ms": 1e3 * full["estimated_step_s"],
           "extrapolated_step_ms": 1e3 * est["estimated_step_s"]}
    log(out)
    return out


def seq_sweep(model, lengths, log):
    """Memory of one sequence of each length (bf16): how attention's T x T terms grow."""
    global SEQ
    out, keep = [], SEQ
    try:
        for length in lengths:
            SEQ = length
            p = plan(model, "bfloat16", 1)
            out.append({"model": model, "sequence_length": length,
                        "temp_gib": p["memory"]["temp"] / 2**30,
                        "total_gib": p["memory"]["total"] / 2**30,
                        "estimated_step_ms": 1e3 * p["estimated_step_s"],
                        "estimated_mfu": p["estimated_mfu"]})
            log(out[-1])
    finally:
        SEQ = keep
    return out


def state_only(model, mesh, devices):
    """Bytes per device of weights + AdamW moments in the mesh's layout (no compile)."""
    from tfllm.footprint import layout as footprint
    cfg = config_for(model, "bfloat16", devices, mesh)
    plan = footprint.mesh_plan(cfg)
    state, buffers = plan.state_bytes, plan.buffers.bytes
    return {"model": model, "mesh": mesh, "state_gib_per_device": state / 2**30,
            "gather_buffers_gib": buffers / 2**30}


def _axis(mesh: str, name: str) -> int:
    """The size of axis `name` in a mesh string such as 'fsdp=4, model=2 (...)'."""
    for part in mesh.split(" (")[0].split(","):
        key, _, size = part.strip().partition("=")
        if key == name:
            return int(size)
    return 1


def _devices(mesh: str) -> int:
    return _axis(mesh, "data") * _axis(mesh, "fsdp") * _axis(mesh, "model")


def write_markdown(results, path):
    """The tables of h100_plan.md from the results JSON."""
    gib = lambda x: f"{x:.1f}"
    out = [f"# H100 plans of the presets (`tfllm plan`, no GPU)", "",
           f"{results['date']}, jax {results.get('jax')}, sequence {results['sequence_length']}, "
           "target h100 (XLA's `h100_sxm.txtpb`: 79.1 GiB, 3.35 TB/s, 989 TFLOP/s bf16, "
           "1979 TFLOP/s FP8 dense). Made by `python benchmarks/h100_plan.py` on a 2-core "
           "CPU machine without a GPU; figures are XLA's compiled memory and a roofline "
           "lower bound on the step time (docs/planning.md, \"How it works\").", "",
           "## One H100: memory, largest batch, FP8 coverage, estimated MFU", "",
           "| model | policy | largest batch found to fit | memory at that batch (GiB) | "
           "memory at batch 1 (GiB) | + per sequence (GiB) | FP8 GEMMs / projections | "
           "FP8 share of GEMM FLOPs | est. step at that batch (ms) | est. tokens/s | "
           "est. MFU | method |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, best in results["largest_batch"].items():
        model, policy = key.split("/")
        rows = {r["batch"]: r for r in results["rows"]
                if r["model"] == model and r["policy"] == policy}
        one, two = rows.get(1), rows.get(2)
        top = rows.get(best)
        if not (one and two and top):
            continue
        failing = [b for b, r in rows.items() if not r["fits"] and b > best]
        bracket = f"{best} ({min(failing)} does not)" if failing else f"{best}"
        out.append(
            f"| {model} | {policy} | {bracket} | {gib(top['total_gib'])} | "
            f"{gib(one['total_gib'])} | {two['total_gib'] - one['total_gib']:.2f} | "
            f"{top['fp8_gemm_calls']} / {top['fp8_projections']} | "
            f"{100 * top['fp8_flops_share']:.0f}% | {1e3 * top['estimated_step_s']:.0f} | "
            f"{top['estimated_tokens_per_s']:,.0f} | {100 * top['estimated_mfu']:.0f}% | "
            f"{top['method'].split(' to ')[0]} |")
    out += ["", "Every batch that was compiled:", "",
            "| model | policy | batch | total GiB | arguments GiB | temp GiB | fits | "
            "GEMM calls | FP8 GEMM calls | est. step ms | est. MFU | compile s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        out.append(f"| {r['model']} | {r['policy']} | {r['batch']} | {gib(r['total_gib'])} | "
                   f"{gib(r['arguments_gib'])} | {gib(r['temp_gib'])} | "
                   f"{'yes' if r['fits'] else 'no'} | {r['gemm_calls']:.0f} | "
                   f"{r['fp8_gemm_calls']:.0f} | {1e3 * r['estimated_step_s']:.1f} | "
                   f"{100 * r['estimated_mfu']:.0f}% | {r['compile_s']:.0f} |")
    for model in sorted({r.get("model", "llama-7b") for r in results.get("mesh_rows", [])},
                        key=lambda m: (len(m), m)):
        rows = [r for r in results["mesh_rows"] if r.get("model", "llama-7b") == model]
        gpus = sorted({_devices(r["mesh"]) for r in rows})
        out += ["", f"## {model} on {' or '.join(map(str, gpus))} H100s (per device; sharded "
                "plans are estimates)", "",
                "Memory: the "
                "per-device program compiled for the H100 with its state replaced by the "
                "layout's exact bytes, plus FSDP's gather buffers where measured; "
                "collectives at 450 GB/s NVLink, not overlapped: *measured* rows take "
                "their kinds, dtypes and sizes from the executed CPU program of the same "
                "mesh scaled to the model (`tfllm.plan.measured`), *assumed* rows the "
                "ring formula (shown beside the measured figure).", "",
                "| mesh | policy | global batch (sequences per device) | memory GiB | fits | "
                "state GiB (args) | temp GiB | "
                "collectives GB/device/step | basis (assumed GB) | est. step ms | "
                "est. tokens/s (all GPUs) | est. MFU |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            shards = _devices(r["mesh"]) // _axis(r["mesh"], "model")
            out.append(f"| {r['mesh'].split(' (')[0]} | {r['policy']} | "
                       f"{r['batch']} ({r['batch'] // shards}) | "
                       f"{gib(r['total_gib'])} | {'yes' if r['fits'] else 'no'} | "
                       f"{gib(r['arguments_gib'])} | {gib(r['temp_gib'])} | "
                       f"{r['collectives_gb']:.1f} | {_basis(r)} | "
                       f"{1e3 * r['estimated_step_s']:.0f} | "
                       f"{r['estimated_tokens_per_s']:,.0f} | "
                       f"{100 * r['estimated_mfu']:.0f}% |")
    if results.get("state_only"):
        out += ["", "## Weights + AdamW state alone per device on 8 devices (no compile)",
                "", "| model | mesh | state GiB / device | + block buffers GiB (bf16; "
                "`tfllm/parallel/blocks.py`) | fits 79.1 GiB before activations |", "|---|---|---|---|---|"]
        for r in results["state_only"]:
            need = r["state_gib_per_device"] + r.get("gather_buffers_gib", 0.0)
            out.append(f"| {r['model']} | {r['mesh']} | {r['state_gib_per_device']:.1f} | "
                       f"{r.get('gather_buffers_gib', 0.0):.2f} | "
                       f"{'yes' if need < 79.1 else 'no'} |")
    if results.get("extrapolation"):
        out += ["", "## Extrapolating over layers against the full compile (bf16, batch 1)",
                "", "| model | temp full / extrapolated GiB | total full / extrapolated GiB "
                "| est. step full / extrapolated ms |", "|---|---|---|---|"]
        for r in results["extrapolation"]:
            out.append(f"| {r['model']} | {r['full_temp_gib']:.3f} / "
                       f"{r['extrapolated_temp_gib']:.3f} | {r['full_total_gib']:.3f} / "
                       f"{r['extrapolated_total_gib']:.3f} | {r['full_step_ms']:.2f} / "
                       f"{r['extrapolated_step_ms']:.2f} |")
    if results.get("seq_sweep"):
        out += ["", "## One sequence of gpt2-small (bf16) against its length", "",
                "| sequence | temporaries GiB | total GiB | est. step ms | est. MFU |",
                "|---|---|---|---|---|"]
        for r in results["seq_sweep"]:
            out.append(f"| {r['sequence_length']} | {r['temp_gib']:.2f} | "
                       f"{r['total_gib']:.2f} | {r['estimated_step_ms']:.2f} | "
                       f"{100 * r['estimated_mfu']:.0f}% |")
    if results.get("moved"):
        out += moved_markdown(results)
    out += clusters_markdown(results)
    out += rise_markdown(results)
    out.append("")
    with open(path, "w") as f:
        f.write("\n".join(out) + results.get("notes", ""))


def comparison_markdown(standard, blocked) -> list:
    """A section of h100_plan.md: each model and mesh with standard attention (`standard`,
    this file's results) beside blocked attention (`blocked`, a run with
    --attention-chunk)."""
    def best(results, key):
        model, policy = key.split("/")
        rows = {r["batch"]: r for r in results["rows"]
                if r["model"] == model and r["policy"] == policy}
        top = results["largest_batch"].get(key)
        return rows.get(1), rows.get(2), rows.get(top), top

    chunk = blocked.get("attention_chunk")
    out = ["", f"## Standard attention beside blocked attention (`model.attention_chunk="
           f"{chunk}`)", "",
           f"Standard: the tables above ({standard['date']}); blocked: "
           f"`python benchmarks/h100_plan.py --attention-chunk {chunk}` ({blocked['date']}, "
           f"jax {blocked.get('jax')}; `{os.path.basename(blocked.get('out', ''))}.json`). "
           "Blocked attention keeps no (B, H, T, T) tensor: its temporaries grow linearly "
           "in the sequence, and it recomputes each block's scores in the backward pass.",
           ""]
    check = blocked.get("standard_check")
    if check:
        out += [f"Consistency: {check['model']} {check['policy']} at batch 1 re-planned "
                f"with standard attention on {blocked['date']}: {check['total_gib']:.1f} GiB "
                f"(stored above: {check['stored_total_gib']:.1f} GiB).", ""]
    out += ["| model | policy | largest batch (standard / blocked) | memory at batch 1 GiB | "
            "+ per sequence GiB | est. step at largest batch ms | est. tokens/s | "
            "est. MFU |", "|---|---|---|---|---|---|---|---|"]
    per = lambda one, two: f"{two['total_gib'] - one['total_gib']:.2f}" if two else "-"
    step = lambda r: f"{1e3 * r['estimated_step_s']:.0f}" if r else "-"
    tps = lambda r: f"{r['estimated_tokens_per_s']:,.0f}" if r else "-"
    mfu = lambda r: f"{100 * r['estimated_mfu']:.0f}%" if r else "-"
    yes = lambda r: "yes" if r["fits"] else "no"
    for key in standard["largest_batch"]:
        a1, a2, at, ab = best(standard, key)
        b1, b2, bt, bb = best(blocked, key)
        if not (a1 and b1):
            continue
        model, policy = key.split("/")
        out.append(f"| {model} | {policy} | {ab} / {bb} | {a1['total_gib']:.1f} / "
                   f"{b1['total_gib']:.1f} | {per(a1, a2)} / {per(b1, b2)} | "
                   f"{step(at)} / {step(bt)} | {tps(at)} / {tps(bt)} | {mfu(at)} / "
                   f"{mfu(bt)} |")
    mesh_key = lambda r: (r.get("model", "llama-7b"), r["mesh"].split(" (")[0], r["policy"],
                          r["batch"])
    theirs = {mesh_key(r): r for r in blocked.get("mesh_rows", [])}
    pairs = [(r, theirs[mesh_key(r)]) for r in standard.get("mesh_rows", [])
             if mesh_key(r) in theirs]
    if pairs:
        out += ["", "Meshes of 8 H100s (per device; collectives as in the mesh tables "
                "above):", "", "| model | mesh | policy | global batch (per device) | "
                "memory GiB (standard / blocked) | fits | est. step ms | est. MFU |",
                "|---|---|---|---|---|---|---|---|"]
        for a, b in pairs:
            shards = _devices(a["mesh"]) // _axis(a["mesh"], "model")
            out.append(f"| {a.get('model', 'llama-7b')} | {a['mesh'].split(' (')[0]} | "
                       f"{a['policy']} | {a['batch']} ({a['batch'] // shards}) | "
                       f"{a['total_gib']:.1f} / {b['total_gib']:.1f} | {yes(a)} / {yes(b)} | "
                       f"{1e3 * a['estimated_step_s']:.0f} / {1e3 * b['estimated_step_s']:.0f} | "
                       f"{100 * a['estimated_mfu']:.0f}% / {100 * b['estimated_mfu']:.0f}% |")
    return out


def clusters_markdown(results) -> list:
    """Sections of h100_plan.md: DTensor's clusters per device (benchmarks/
    plan_clusters.py) and the real per-device clusters compiled for the H100 against the
    no-mesh proxy (benchmarks/plan_device_clusters.py)."""
    out = []
    rows = results.get("clusters") or []
    if rows:
        out += ["", f"## XLA clusters per device: DTensor's executed program "
                f"({results['clusters_date']})", "",
                "`python benchmarks/plan_clusters.py`: the train step as `tfllm train` runs "
                "it (bf16, `jit_compile`, DTensor) on 8 logical CPU devices, at tiny widths "
                "with 1, 2 and 3 layers; the busiest device's `_XlaCompile` ops counted in "
                "the executed graphs (`tfllm.compiler.costs`). `tfllm plan` measures the same "
                "way with 1 and 2 layers (a + b x layers) for the dispatch term of its step "
                "time; the 3-layer count checks that extrapolation: a middle block (its "
                "re-gather prefetched by the block after, its own prefetching the one "
                "before) adds a little more than the second block of a 2-layer model, so "
                "the plan's count is low by that difference per block.", "",
                "| model | mesh | layers | clusters at 1 / 2 / 3 layers | added by block 2 / "
                "block 3 | clusters per step from 1-2 layers (the plan) / from 2-3 layers | "
                "collectives per step |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            c = {int(k): v for k, v in r["tiny_clusters"].items()}
            from_23 = c[3] + (c[3] - c[2]) * (r["layers"] - 3)
            out.append(f"| {r['model']} | {r['mesh']} | {r['layers']} | {c[1]} / {c[2]} "
                       f"/ {c[3]} | {c[2] - c[1]} / {c[3] - c[2]} | {r['clusters']:,} / "
                       f"{from_23:,} | {r['collectives']:,} |")
        w = results.get("clusters_width_check")
        if w:
            out += ["", f"Widths do not change the count: {w['model']} {w['mesh']} with 1 "
                    f"layer has {w['own_widths']} clusters ({w['own_collectives']} "
                    f"collectives) at its own widths (sequence 64) and {w['tiny_widths']} "
                    f"({w['tiny_collectives']}) at the tiny ones."]
    dev = results.get("device_clusters") or []
    if dev:
        gf = lambda x: f"{x / 1e9:,.0f}"  # noqa: E731
        ms = lambda x: f"{1e3 * x:.2f}"  # noqa: E731
        out += ["", f"## The real per-device clusters against the no-mesh proxy "
                f"({results['device_clusters_date']})", "",
                "`python benchmarks/plan_device_clusters.py`: a model's step on the mesh "
                "(bf16, sequence 2048, 1 sequence per device) executed once on CPU devices "
                "with XLA dumping every cluster; each distinct cluster compiled for the H100 "
                "(`tfllm.plan.gpu_compile`) and counted per device; beside it the program "
                "`tfllm plan` compiles, the no-mesh step at one device's shapes. Only models "
                "whose devices' activations fit this host's 23 GB can be run: gpt2-small at "
                "1-2 layers would (not run yet: the host was busy with the re-plans above); "
                "llama-1b would not. Run so far: configs/tiny.yaml's llama (the check of the "
                "script, and a first measure of what the proxy misses).", "",
                "| model | mesh | layers | clusters | kernels launched: clusters / no-mesh | "
                "GEMM GFLOP: clusters / no-mesh | roofline ms: clusters / no-mesh | "
                "largest cluster's temporaries GiB / no-mesh temporaries GiB |",
                "|---|---|---|---|---|---|---|---|"]
        for r in dev:
            d, n = r["dtensor"], r["no_mesh"]
            p = d["per_device"]
            out.append(f"| {r['model']} | {r['mesh']} | {d['layers']} | {d['clusters']} | "
                       f"{p['kernel_launches']:,.0f} / {n['kernel_launches']:,.0f} | "
                       f"{gf(p['flops'])} / {gf(n['flops'])} | {ms(p['roofline_s'])} / "
                       f"{ms(n['roofline_s'])} | {d['largest_cluster_temp'] / 2**30:.2f} / "
                       f"{n['temp'] / 2**30:.2f} |")
    return out


def rise_markdown(results) -> list:
    """A section of h100_plan.md: why a re-plan's one-device memory rose (`layer_check`:
    full compiles at several layer counts of two versions of the step)."""
    check = results.get("layer_check")
    if not check:
        return []
    out = ["", f"## Why the no-mesh memory rose between the stored run and the re-plan "
           f"({check['date']})", "", check["text"], "",
           "| layers (full compile, batch 1) | " + " | ".join(check["versions"]) + " |",
           "|---|" + "---|" * len(check["versions"])]
    for layers, temps in sorted(check["temp_gib"].items(), key=lambda kv: int(kv[0])):
        out.append(f"| {layers} | " + " | ".join("-" if t is None else f"{t:.3f}"
                                                for t in temps) + " |")
    return out


#: [MODEL, POLICY, BATCH, MESH] of the stored rows planned again by --moved: each
#: model's batch 1 and largest batch on one H100, and the llama-7b meshes a user would pick
MOVED = [("gpt2-small", "bfloat16", 1, "data=1"), ("gpt2-small", "bfloat16", 24, "data=1"),
         ("llama-1b", "bfloat16", 1, "data=1"), ("llama-1b", "bfloat16", 5, "data=1"),
         ("llama-7b", "bfloat16", 1, "data=1"),
         ("gpt2-small", "bfloat16", 8, "fsdp=8"), ("llama-1b", "bfloat16", 8, "fsdp=8"),
         ("llama-1b", "bfloat16", 8, "data=2,fsdp=4"),
         ("llama-7b", "bfloat16", 16, "fsdp=8"), ("llama-7b", "bfloat16", 8, "fsdp=4,model=2")]


def moved(results, log, meshes_only=False, save=lambda results: None, only=None):
    """Plans the MOVED rows again with today's planner; mesh rows measure their
    collectives and DTensor's clusters (`tfllm.plan.measured`: tiny steps with XLA on
    this machine's CPU devices, several minutes each). `meshes_only` keeps the stored
    one-device rows (nothing a mesh changes moves them)."""
    stored = {(r["model"], r["policy"], r["batch"], r["mesh_axes"]): r
              for r in results.get("moved", [])}
    out = []
    for model, policy, batch, mesh in MOVED:
        key = (model, policy, batch, mesh)
        if key in stored and (meshes_only and mesh == "data=1"
                              or only is not None and (model, mesh) not in only):
            out.append(stored[key])
            continue
        if only is not None and (model, mesh) not in only:
            continue
        p = plan(model, policy, batch, mesh,
                 collectives="assumed" if mesh == "data=1" else "measured")
        out.append(dict(row(model, policy, batch, p), mesh_axes=mesh,
                        sources=p.get("sources"), memory_detail=p["memory"].get(
                            "gather_detail"), collective_count=p.get("collective_count")))
        log(out[-1])
        done = {(o["model"], o["policy"], o["batch"], o["mesh_axes"]) for o in out}
        results["moved"] = out + [r for k, r in stored.items() if k not in done]
        save(results)  # a plan takes minutes: keep each one
    results["moved"] = out
    results["moved_date"] = time.strftime("%Y-%m-%d")
    return out


def moved_markdown(results) -> list:
    """The section of h100_plan.md that says how each re-planned row moved."""
    def stored(model, policy, batch, mesh):
        rows = results["rows"] if mesh == "data=1" else results["mesh_rows"]
        for r in rows:
            if (r["model"] == model and r["policy"] == policy and r["batch"] == batch
                    and (mesh == "data=1" or r["mesh"].split(" (")[0].replace(" ", "") == mesh)):
                return r
        return None

    ms = lambda s: f"{1e3 * s:.0f}"  # noqa: E731
    pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
    out = ["", f"## How the rows moved: the plan that predicts (issue 35 item 6, "
           f"{results['moved_date']})", "",
           "Re-planned with today's `tfllm plan` (mesh rows with measured collectives and "
           "clusters); the tables above are the stored run. Three corrections move every row: "
           "**fits** compares against 75.1 GiB (79.1 GiB less `mesh.gpu_memory_reserve_mb` "
           "= 4096 MiB, which TensorFlow leaves to NCCL and cuBLAS), not 79.1; **the AdamW "
           "update** of a sharded layout is counted for the device's shard (the no-mesh "
           "program updates every weight: 28 bytes per parameter at HBM bandwidth); **the "
           "step** is the roofline corrected by named factors (`tfllm/plan/timing.py`):", "",
           "| factor | value | source |", "|---|---|---|",
           f"| GEMM efficiency | {timing.GEMM_EFFICIENCY} of the dense peak | measured: an "
           "8192-square bf16 GEMM on the first lent H200 (XLA, jax 0.11.2), median of five "
           "runs (benchmarks/results/gpu_h200_2026-11-30.json); until 2026-11-30, 0.75 from "
           "NVIDIA's \"New cuBLAS 12.0 Features and Matrix Multiplication Performance on "
           "NVIDIA Hopper GPUs\" (2023) |",
           "| kernel gap | 2 µs per kernel launch | NVIDIA, \"Getting Started with CUDA "
           "Graphs\" (2019): a few µs of launch overhead per short kernel without graphs |",
           "| cluster dispatch | 20 µs per DTensor XLA cluster | assumed: TensorFlow's "
           "per-op overhead (\"Better performance with tf.function\"); no GPU measurement "
           "yet. The count of clusters is measured: DTensor's executed program of the mesh "
           "(`tfllm.plan.measured`, next sections) |",
           "| NCCL | 15 µs per collective + bytes at 450 GB/s | NVLink 4: 18 links x 25 "
           "GB/s (H100 datasheet); nccl-tests all_reduce_perf on 8 H100 SXM: 460-480 GB/s "
           "bus bandwidth at large sizes, tens of µs at small ones |",
           "| overlap | 0 | tfllm's FSDP ordered every gather behind a scalar all-reduce "
           "(issue 35 items 1-2); raise it once the executed program overlaps |", "",
           "Every compute and memory figure is compiled from **the no-mesh program at one "
           "device's shapes**, not from DTensor's per-device clusters: running the real "
           "model's DTensor step at sequence 2048 on 8 CPU devices of this 23 GB host "
           "fits for gpt2-small at 1-2 layers only (`benchmarks/plan_device_clusters.py` "
           "compiles those clusters for the H100 beside the proxy; llama-1b's 128k-token "
           "logits alone would take 21 GB for 8 devices); the plan's `sources` field (in the "
           "JSON) says per figure which program it used. Mesh memory adds the block buffers of "
           "`tfllm/parallel/blocks.py` (modelled from the model's blocks: the prefetched "
           "16-bit gather of the block before, the block's 16-bit partial gradients and its "
           "float32 reduction buffer). The MFU column also moves with tfllm's "
           "model FLOPs, which now count causal attention at half (MaxText's convention, "
           "issue 35 item 8). Rows not listed here were not planned again (one plan takes "
           "1-20 minutes on this 2-core machine); the fits of a stored row against 75.1 GiB "
           "can be read from its memory column.", "",
           "| model | policy | mesh | batch | memory GiB | fits 79.1 → fits 75.1 | "
           "AdamW update ms (program → layout) | clusters | est. step ms: stored → roofline "
           "→ modelled | est. MFU stored → modelled |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["moved"]:
        old = stored(r["model"], r["policy"], r["batch"], r["mesh_axes"])
        yes = lambda f: "yes" if f else "no"  # noqa: E731
        upd = r.get("optimizer_update")
        update = (f"{ms(upd['program_s'])} → {ms(upd['layout_s'])}" if upd else "-")
        out.append(
            f"| {r['model']} | {r['policy']} | {r['mesh_axes']} | {r['batch']} | "
            f"{r['total_gib']:.1f} | {yes(old['fits']) if old else '-'} → {yes(r['fits'])} | "
            f"{update} | {r['clusters']} | "
            f"{ms(old['estimated_step_s']) if old else '-'} → {ms(r['roofline_step_s'])} → "
            f"{ms(r['estimated_step_s'])} | "
            f"{pct(old['estimated_mfu']) if old else '-'} → "
            f"{100 * r['estimated_mfu']:.0f}% |")
    before = {(r["model"], r["policy"], r["batch"], r["mesh_axes"]): dict(
        r, collective_count=r.get("collective_count", r["clusters"] - 1))
        for r in results.get("moved_previous") or []}  # then clusters = collectives + 1
    # the mesh rows planned again since the previous run (they carry their sources)
    mesh_rows = [r for r in results["moved"] if r["mesh_axes"] != "data=1" and r.get("sources")]
    if before and mesh_rows:
        out += ["", f"Mesh rows against the previous re-plan ({results['moved_previous_date']}"
                "; one-device rows did not move): memory now adds the block buffers in "
                "place of per-weight gather buffers, clusters are DTensor's measured count "
                "(before: collectives + 1, with the per-weight count of collectives assumed), "
                "and collectives are measured on the executed program with blocks.", "",
                "| model | mesh | batch | memory GiB before → now | block buffers GiB | "
                "clusters before → now | collectives before → now | modelled step ms "
                "before → now |", "|---|---|---|---|---|---|---|---|"]
        for r in mesh_rows:
            b = before.get((r["model"], r["policy"], r["batch"], r["mesh_axes"]))
            arrow = lambda f, k: (f"{f(b[k])} → " if b and b.get(k) is not None  # noqa: E731
                                  else "- → ") + f(r[k])
            buffers = (r.get("memory_detail") or {})
            size = sum(buffers.get(k, 0) for k in ("gathered", "partials", "gradient"))
            out.append(f"| {r['model']} | {r['mesh_axes']} | {r['batch']} | "
                       f"{arrow(lambda x: f'{x:.1f}', 'total_gib')} | {size / 2**30:.2f} | "
                       f"{arrow(lambda x: f'{x:,}', 'clusters')} | "
                       f"{arrow(lambda x: f'{x:,}', 'collective_count')} | "
                       f"{arrow(ms, 'estimated_step_s')} |")
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "h100_plan"))
    parser.add_argument("--models", default="gpt2-small,llama-1b,llama-7b")
    parser.add_argument("--policies", default="bfloat16,fp8")
    parser.add_argument("--meshes", default="fsdp=8;fsdp=4,model=2;data=2,fsdp=4;model=8")
    parser.add_argument("--check-extrapolation", default="gpt2-small")
    parser.add_argument("--resume", action="store_true",
                        help="Keep the model/policy results already in OUT.json.")
    parser.add_argument("--seq-sweep-only", action="store_true",
                        help="Add the gpt2-small sequence sweep to OUT.json and OUT.md.")
    parser.add_argument("--replan-assumed", action="store_true",
                        help="With --resume: plan again the mesh rows whose collectives "
                             "were assumed (the ring formula), measuring them.")
    parser.add_argument("--markdown-only", action="store_true",
                        help="Rewrite OUT.md from OUT.json without compiling.")
    parser.add_argument("--attention-chunk", type=int, default=0,
                        help="Plan with blocked attention of this block size "
                             "(model.attention_chunk); write to another --out.")
    parser.add_argument("--standard-check", default="llama-1b/bfloat16",
                        help="With --attention-chunk: re-plan MODEL/POLICY at batch 1 with "
                             "standard attention, beside the stored h100_plan.json row.")
    parser.add_argument("--compare-blocked", default=None,
                        help="With --markdown-only: add a section comparing OUT.json "
                             "(standard attention) with this blocked run's JSON.")
    parser.add_argument("--moved", action="store_true",
                        help="Plan the MOVED rows again and add how they moved to OUT.md.")
    parser.add_argument("--moved-meshes", action="store_true",
                        help="Like --moved, planning only the mesh rows again.")
    parser.add_argument("--rows", default=None,
                        help="With --moved-meshes: MODEL:MESH;... to plan again (the others "
                             "keep their stored figures; the previous run stays the 'before').")
    args = parser.parse_args()
    global ATTENTION_CHUNK
    ATTENTION_CHUNK = args.attention_chunk
    if args.seq_sweep_only:
        with open(args.out + ".json") as f:
            done = json.load(f)
        done["seq_sweep"] = seq_sweep("gpt2-small", (512, 1024, 2048, 4096), print)
        with open(args.out + ".json", "w") as f:
            json.dump(done, f, indent=1)
        write_markdown(done, args.out + ".md")
        return
    if args.moved or args.moved_meshes:
        with open(args.out + ".json") as f:
            results = json.load(f)

        def save(results):
            with open(args.out + ".json", "w") as f:
                json.dump(results, f, indent=1)

        if results.get("moved") and not args.rows:  # how the mesh rows move: in OUT.md
            results["moved_previous"] = results["moved"]
            results["moved_previous_date"] = results["moved_date"]
        only = ({tuple(r.split(":")) for r in args.rows.split(";")} if args.rows else None)
        moved(results, print, meshes_only=args.moved_meshes, save=save, only=only)
        # the state-only rows' buffers follow today's model (no compile: seconds)
        results["state_only"] = [state_only(r["model"], r["mesh"], 8)
                                 for r in results.get("state_only", [])]
        save(results)
        args.markdown_only = True
    if args.markdown_only:
        with open(args.out + ".json") as f:
            results = json.load(f)
        if args.compare_blocked:
            with open(args.compare_blocked) as f:
                blocked = json.load(f)
            heading = "\n## Standard attention beside blocked attention"
            notes = results.get("notes", "").split(heading)[0]  # a previous one replaced
            results["notes"] = notes + "\n".join(comparison_markdown(results, blocked)) + "\n"
        write_markdown(results, args.out + ".md")
        return
    results = {"date": time.strftime("%Y-%m-%d"), "sequence_length": SEQ, "rows": [],
               "largest_batch": {}, "mesh_rows": [], "attention_chunk": ATTENTION_CHUNK,
               "out": os.path.relpath(args.out, ROOT)}
    if args.resume and os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            done = json.load(f)
        # Everything already there is kept (tables this run does not plan, the notes).
        results.update({k: v for k, v in done.items() if k not in ("date", "jax")})
    log = lambda r: print(json.dumps({k: v for k, v in r.items() if k != "top_kernels"}),
                          flush=True)

    def save():
        with open(args.out + ".json", "w") as f:
            json.dump(results, f, indent=1)

    for model in filter(None, args.models.split(",")):
        for policy in args.policies.split(","):
            if f"{model}/{policy}" in results["largest_batch"]:
                continue
            best, rows = largest_batch(model, policy, log)
            results["rows"] += rows
            results["largest_batch"][f"{model}/{policy}"] = best
            save()
    # [MODEL:]MESH[@GLOBAL_BATCH] (default llama-7b; batch 32: 4 sequences per device over 8)
    key = lambda r: (r.get("model", "llama-7b"), r["mesh"].split(" (")[0].replace(" ", ""),
                     r["batch"])
    asked = set()
    for entry in filter(None, args.meshes.split(";")):
        model, _, entry = entry.rpartition(":")
        mesh, _, batch = entry.partition("@")
        asked.add((model or "llama-7b", mesh, int(batch or 32)))
    if args.replan_assumed:  # asked-for rows planned before collectives could be measured
        results["mesh_rows"] = [r for r in results["mesh_rows"] if key(r) not in asked
                                or r.get("collectives_basis", "").startswith("measured")]
    done_meshes = {key(r) + (r["policy"],) for r in results["mesh_rows"]}
    for entry in filter(None, args.meshes.split(";")):
        model, _, entry = entry.rpartition(":")
        model = model or "llama-7b"
        mesh, _, batch = entry.partition("@")
        batch = int(batch or 32)
        for policy in args.policies.split(","):
            if (model, mesh, batch, policy) in done_meshes:
                continue
            p = plan(model, policy, batch, mesh)
            results["mesh_rows"].append(row(model, policy, batch, p))
            log(results["mesh_rows"][-1])
            save()
    if not results.get("extrapolation"):
        results["extrapolation"] = [extrapolation_check(m, log) for m in
                                    filter(None, args.check_extrapolation.split(","))]
    meshes = sorted({e.rpartition(":")[2].partition("@")[0]
                     for e in filter(None, args.meshes.split(";"))
                     if _devices(e.rpartition(":")[2].partition("@")[0]) == 8})
    fresh = [state_only(m, mesh, 8) for m in ("llama-7b", "llama-70b") for mesh in meshes]
    kept = [r for r in results.get("state_only", [])
            if (r["model"], r["mesh"]) not in {(f["model"], f["mesh"]) for f in fresh}]
    results["state_only"] = kept + fresh
    if ATTENTION_CHUNK and args.standard_check:
        # Are the stored standard-attention rows still what today's code plans?
        model, policy = args.standard_check.split("/")
        stored = os.path.join(ROOT, "benchmarks", "results", "h100_plan.json")
        with open(stored) as f:
            old = next(r for r in json.load(f)["rows"] if r["model"] == model
                       and r["policy"] == policy and r["batch"] == 1)
        ATTENTION_CHUNK = 0
        p = plan(model, policy, 1)
        results["standard_check"] = {"model": model, "policy": policy,
                                     "total_gib": p["memory"]["total"] / 2**30,
                                     "stored_total_gib": old["total_gib"]}
        log(results["standard_check"])
    results["jax"] = importlib.metadata.version("jax")
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    write_markdown(results, args.out + ".md")


if __name__ == "__main__":
    main()
