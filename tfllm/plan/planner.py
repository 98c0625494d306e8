"""`tfllm plan`: compile a config's train step for a GPU target on a machine without one.

1. The one-device train step that `tfllm train` runs (its precision policy, batch,
   sequence length and grad accumulation; `jit_compile=True`) is lowered to HLO by
   `tfllm.plan.export_step`, in this process (TensorFlow).
2. A child process (jax only: two XLA builds never share a process) compiles it with
   jaxlib's compile-only CUDA client for the target (`tfllm.plan.gpu_compile`).
3. Memory comes from XLA's buffer assignment of the compiled program; kernels, FLOPs,
   bytes and the roofline time from its optimized HLO (`tfllm.compiler.hlo_stats`).

Models too large to hold on this host (their variables must exist to be lowered) are
planned from two compiles of the same model with 1 and 2 layers: every figure is then
a + b * num_layers, exact for parameters and kernel counts, close for temporaries
(checked against full compiles in benchmarks/results/h100_plan.md). The result says so.

Sharded meshes are planned per device from the per-device shapes (`tfllm.plan.sharded`);
their collectives are measured on the executed CPU program of the same mesh at a tiny
scale (`tfllm.plan.measured`), with the layout's formula beside them as the assumed
figure. Where the mesh moves weights block by block, one block's program as a device
runs it (its gathered weights and its prefetched neighbour's, the recomputation under
remat, float32 weight gradients; `tfllm.plan.block_program`) is compiled too: the block
buffers counted are XLA's, and its temporaries are printed beside the fit model's
recomputed block. The fit model (`tfllm.footprint.fit`, the arithmetic that `tfllm train`
checks) is printed beside the compile as the cross-check. Every figure says where it
comes from (`sources`): compiled, measured, assumed.

The compile takes minutes, not hours, because the planner's flags turn off XLA's Triton
softmax rewriter for blocked attention (`tfllm.plan.gpu_compile.NO_TRITON_SOFTMAX`: its
tiling search was 88% of a blocked-attention layer's compile and grew with the batch);
standard attention keeps it, as a GPU running XLA's defaults does (`triton_softmax`).
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import json
import math
import os
import subprocess
import sys
from typing import Optional, Tuple

from tfllm import files
from tfllm.parallel.mesh import MeshError
from tfllm.compiler import hlo_stats
from tfllm.compiler.targets import Target, get_target
from tfllm.plan import timing
from tfllm.plan.result import Memory, PlanResult, StepEstimate
from tfllm.plan.sharded import MeshFigures


class PlanError(RuntimeError):
    """The step could not be compiled for the target (the message says why)."""


def _host_memory() -> int:
    """Bytes of host memory (Linux MemTotal: the same answer on every run), or 8 GiB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


# Host bytes per parameter while the step is lowered: float32 weights and AdamW's two
# float32 moments exist as variables (12 bytes); tracing allocates nothing more.
HOST_BYTES_PER_PARAM = 12


def triton_softmax(config) -> bool:
    """Whether the plan's compile keeps XLA's Triton softmax rewriter: when the model's
    attention is standard at its sequence length (not blocked), as on a GPU; blocked
    attention's compile is the rewriter's slow case and barely moves without it
    (`tfllm.plan.gpu_compile.NO_TRITON_SOFTMAX`)."""
    chunk = config.model.attention_chunk
    return not 0 < chunk < config.data.sequence_length


def compile_in_child(hlo_path: str, target: Target, timeout: float = 1800,
                     softmax: bool = False) -> dict:
    """Runs `tfllm.plan.gpu_compile` in a child process; returns its result + HLO text.
    `softmax`: keep XLA's Triton softmax rewriter (`triton_softmax`)."""
    work = os.path.dirname(hlo_path)
    config_path = os.path.join(work, f"{target.name}.txtpb")
    files.write_atomically(work, config_path, target.target_config())
    out = os.path.join(work, f"compiled_{target.name}.json")
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # TensorFlow's flags (e.g. dumps) are not the planner's
    r = subprocess.run([sys.executable, "-m", "tfllm.plan.gpu_compile", hlo_path,
                        "--target-config", config_path, "--out", out]
                       + (["--triton-softmax"] if softmax else []),
                       capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        tail = "\n".join(l for l in r.stderr.splitlines()
                         if not l.startswith(("I0000", "W0000", "E0000")))[-3000:]
        if "pip install -e '.[plan]'" in tail:
            raise PlanError(tail.splitlines()[-1].split("Error: ", 1)[-1])
        raise PlanError(f"compiling the step for {target.name} failed:\n{tail}")
    with open(out) as f:
        result = json.load(f)
    with open(os.path.splitext(out)[0] + ".hlo.txt") as f:
        result["optimized_hlo"] = f.read()
    return result


def _param_bytes(params) -> int:
    sizes = {"float32": 4, "int32": 4, "int64": 8, "bfloat16": 2, "float16": 2}
    total = 0
    for p in params:
        n = 1
        for d in p["shape"]:
            n *= d
        total += n * sizes[p["dtype"]]
    return total


def _export(kind: str, config, work: str) -> dict:
    """Runs in the export child (`export_in_child`): writes the step or the block."""
    if kind == "step":
        from tfllm.plan.export_step import export_step
        # No step.jax: the plan compiles step.hlo.pb itself (converting it twice for
        # nothing cost each plan a second MLIR pass over the whole step)
        return export_step(config, work, portable=False)
    from tfllm.plan.block_program import export_block
    return export_block(config, work)


def export_in_child(kind: str, config, work: str) -> dict:
    """Lowers the step ("step") or one block's program ("block") of `config` to HLO in
    `work`, in a child process; returns its description.

    A child, not this process: what an export allocates is not all given back when it
    returns (measured: a 1-layer llama step of 83M parameters left 0.8 GB of its 0.9 GB
    of variables and AdamW moments resident after `keras.backend.clear_session()`, a
    collection and `malloc_trim`, nine of its tf.Variables still referenced), and
    llama-7b's preset was killed for memory exporting its 2-layer step (12.8 GB resident
    on a 23 GB host) while its 1-layer export was still held. A child's pages go back
    when it ends.
    """
    import concurrent.futures
    import multiprocessing
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(_export, kind, config, work).result()
        except concurrent.futures.process.BrokenProcessPool:
            raise PlanError(f"exporting the {kind} program for the plan ended its process "
                            "(killed for memory? the export holds the model's variables "
                            "and AdamW moments: 12 bytes per parameter of the exported "
                            "layers, plus TensorFlow's own)") from None


def plan_program(config, target: Target, keep_dir: Optional[str] = None) -> dict:
    """Compiles the config's one-device step for `target`; returns the raw figures."""
    with files.temporary_folder("tfllm-plan-") as tmp:
        work = keep_dir or tmp
        desc = export_in_child("step", config, work)
        compiled = compile_in_child(os.path.join(work, "step.hlo.pb"), target,
                                    softmax=triton_softmax(config))
    stats = hlo_stats.summarize(compiled["optimized_hlo"], target, partial_reads=True)
    m = compiled["memory"]
    return {
        "memory": {"arguments": m["arguments"], "outputs": m["outputs"],
                   "alias": m["alias"], "temp": m["temp"],
                   # outputs that alias their arguments (updated variables) need no
                   # second buffer
                   "total": m["arguments"] + m["outputs"] - m["alias"] + m["temp"]
                   + m["generated_code"]},
        "step_parameter_bytes": _param_bytes(desc["params"]),
        "num_params": desc["num_params"],
        "fp8_projections": desc["fp8_projections"],
        "model_flops": desc["flops_per_token"] * desc["tokens_per_step"],
        "tokens_per_step": desc["tokens_per_step"],
        "compile_s": compiled["compile_s"],
        "jax": compiled["jax"],
        **stats,
    }


def plan_block(local, target: Target, keep_dir: Optional[str] = None) -> dict:
    """Compiles one block's program as a mesh device runs it (`tfllm.plan.block_program`:
    the gathered weights of the block and its prefetched neighbour, the recomputation
    under remat, the float32 weight gradients) for `target`; returns its memory parts
    (`block_memory`) with its compile time and kernel count."""
    from tfllm.plan.block_program import block_memory
    with files.temporary_folder("tfllm-plan-block-") as tmp:
        work = keep_dir or tmp
        desc = export_in_child("block", local, work)
        compiled = compile_in_child(os.path.join(work, "block.hlo.pb"), target,
                                    softmax=triton_softmax(local))
    stats = hlo_stats.summarize(compiled["optimized_hlo"], target, partial_reads=True)
    return dict(block_memory(desc, compiled["memory"]), compile_s=compiled["compile_s"],
                kernels=stats["kernels"], flops=stats["flops"], bytes=stats["bytes"],
                micro_rows=desc["micro_rows"],
                remat=desc["remat"])


_LINEAR = ("gemm_calls", "fp8_gemm_calls", "fusions", "kernels", "kernel_launches", "flops",
           "fp8_flops", "bytes", "roofline_s", "roofline_gemm_s", "step_parameter_bytes",
           "num_params", "fp8_projections", "model_flops")


def _extrapolate(one: dict, two: dict, layers: int) -> dict:
    """Each figure as a + b * layers through the 1- and 2-layer plans."""
    out = copy.deepcopy(two)
    line = lambda a, b: a + (b - a) * (layers - 1)
    for key in _LINEAR:
        out[key] = line(one[key], two[key])
    for key in ("arguments", "outputs", "alias", "temp", "total"):
        out["memory"][key] = int(line(one["memory"][key], two["memory"][key]))
    out["compile_s"] = one["compile_s"] + two["compile_s"]  # the time both compiles took
    out["gemm_targets"] = {k: int(line(one["gemm_targets"].get(k, 0), v))
                           for k, v in two["gemm_targets"].items()}
    out["roofline_by_kind_s"] = {k: line(one["roofline_by_kind_s"].get(k, 0.0), v)
                                 for k, v in two["roofline_by_kind_s"].items()}
    return out


def _combine(fn, *plans) -> dict:
    """A plan whose every extrapolated figure is fn(the plans' figures) (`_LINEAR`, memory,
    GEMM targets, roofline by kind); the rest as the last plan's, compile times summed."""
    out = copy.deepcopy(plans[-1])
    for key in _LINEAR:
        out[key] = fn(*(p[key] for p in plans))
    for key in ("arguments", "outputs", "alias", "temp", "total"):
        out["memory"][key] = int(fn(*(p["memory"][key] for p in plans)))
    for group in ("gemm_targets", "roofline_by_kind_s"):
        keys = set().union(*(p[group] for p in plans))
        out[group] = {k: fn(*(p[group].get(k, 0) for p in plans)) for k in keys}
    out["gemm_targets"] = {k: int(v) for k, v in out["gemm_targets"].items()}
    out["compile_s"] = sum(p["compile_s"] for p in plans)
    return out


def expert_points(m) -> Optional[Tuple[int, int]]:
    """The expert counts a mixture of experts is compiled with when it is extrapolated
    (`plan`): (E1, 2 E1), E1 = max(8, k x ceil(capacity factor)): at E1 a capacity
    factor's slots, ceil(factor T k / E), are not yet clipped at T, so the slots buffer
    (E x C rows) is the same at E1, 2 E1 and E, as dropless slots and the grouped tiles
    are linear in E. None when every layer is not sparse (a 1-layer program would then
    hold no experts) or E is not above 2 E1."""
    if not m.num_experts or m.decoder_sparse_step != 1 or m.mlp_only_layers:
        return None
    e1 = max(8, m.num_experts_per_tok * math.ceil(max(m.moe_capacity_factor, 1.0)))
    return (e1, 2 * e1) if m.num_experts > 2 * e1 else None


def _extrapolate_experts(local, target: Target, n_layers: int) -> dict:
    """A mixture of experts too large to export even one layer of (Qwen3-30B-A3B's
    layer and 151936-entry embeddings: 1.2B parameters, 15 GB of variables and AdamW
    moments on the host) from three small compiles: 1 and 2 layers of E1 experts, 1
    layer of E2. A layer's figures (memory, FLOPs, bytes, kernels) are linear in E: its
    expert weights, their gradients and moments, the router's E columns and the grouped
    dispatch's padding tiles; the embeddings and head do not depend on E. So the
    1-layer figures are taken on the line through E1 and E2 at E, the 2-layer ones
    moved by twice that change (two layers of experts), then the line through 1 and 2
    layers at the model's depth, as dense presets are."""
    m = local.model
    e1, e2 = expert_points(m)
    one, two, wide = (plan_program(_with_layers(local, n, e), target)
                      for n, e in ((1, e1), (2, e1), (1, e2)))
    at = (m.num_experts - e1) / (e2 - e1)
    one_e = _combine(lambda a, b: a + (b - a) * at, one, wide)
    two_e = _combine(lambda a, a_e, b: b + 2 * (a_e - a), one, one_e, two)
    result = _combine(lambda a, b: a + (b - a) * (n_layers - 1), one_e, two_e)
    result["compile_s"] = one["compile_s"] + two["compile_s"] + wide["compile_s"]
    return result


def _with_layers(config, layers: int, experts: Optional[int] = None):
    c = copy.deepcopy(config)
    c.model.num_layers = layers
    if experts is not None:
        c.model.num_experts = experts
    return c


def plan(config, target_name: str = "h100", layers: str = "auto", devices=None,
         collectives: str = "measured") -> PlanResult:
    """The plan of one device of the config's mesh for the target (see module docstring).

    Args:
      config: a loaded tfllm config.
      target_name: one of `tfllm.compiler.targets.TARGETS`.
      layers: "full" compiles the whole model; "extrapolate" compiles 1 and 2 layers;
        "auto" extrapolates when the model's variables would take more than half of
        this host's memory.
      devices: the device count, for a mesh axis of -1 (default 1).
      collectives: "measured" runs the tiny step of the mesh on CPU devices (a child
        process, about a minute on 2 cores); "assumed" uses the layout's formula only.
    """
    from tfllm.footprint import layout as footprint
    from tfllm.plan import sharded
    target = get_target(target_name)
    try:
        mesh_plan = footprint.mesh_plan(config, devices)
    except MeshError as e:  # e.g. llama-7b's fsdp=-1,model=8 on the default 1 device
        raise MeshError(f"{e} For tfllm plan, --devices N sets the device count that a -1 "
                        f"axis takes (default 1), e.g. --devices 8.") from None
    local = mesh_plan.local
    n_layers = local.model.num_layers
    host_need = HOST_BYTES_PER_PARAM * footprint.param_count(local)
    if layers not in ("auto", "full", "extrapolate"):
        raise ValueError(f"--layers must be auto, full or extrapolate, not {layers!r}")
    extrapolate = (layers == "extrapolate" or layers == "auto"
                   and host_need > 0.5 * _host_memory()) and n_layers > 2
    if extrapolate and expert_points(local.model):
        result = _extrapolate_experts(local, target, n_layers)
        e1, e2 = expert_points(local.model)
        method = (f"extrapolated from 1- and 2-layer compiles of {e1} experts and a 1-layer "
                  f"compile of {e2} to {n_layers} layers of {local.model.num_experts}")
    elif extrapolate:
        one = plan_program(_with_layers(local, 1), target)
        two = plan_program(_with_layers(local, 2), target)
        result = _extrapolate(one, two, n_layers)
        method = f"extrapolated from 1- and 2-layer compiles to {n_layers} layers"
    else:
        result = plan_program(local, target)
        method = "compiled in full"
    if collectives not in ("measured", "assumed"):
        raise ValueError(f"collectives must be measured or assumed, not {collectives!r}")
    figures = None
    if mesh_plan.devices > 1:
        block = None
        if mesh_plan.has_blocks:
            block = plan_block(local, target)
            result["compile_s"] += block["compile_s"]
        measured_collectives = None
        # tfllm.plan.measured scales a tiny step's collectives by the dense weights and
        # activations they carry; an MoE's all-to-alls and expert kernels are none of
        # them (a tiny fsdp=2 MoE measured 0 bytes): the layout's formula, all-to-alls
        # included
        if collectives == "measured" and not config.model.num_experts:
            _return_freed_memory()  # the measuring child needs what the export freed
            from tfllm.plan import measured
            measured_collectives = measured.measure(config, dict(mesh_plan.shape),
                                                    sharded.LINK_BANDWIDTH[target.name])
        figures = sharded.mesh_figures(config, mesh_plan, footprint.mesh_plan(local),
                                       target, measured=measured_collectives, block=block)
    return finish(result, figures, config, target, method,
                  fit=fit_cross_check(config, devices, target))


def fit_cross_check(config, devices, target: Target) -> dict:
    """The fit model's arithmetic of the same config (`tfllm.footprint.fit.estimate`, what
    `tfllm train` and `tfllm doctor` check), printed beside the compile's figures."""
    from tfllm.footprint import fit
    e = fit.estimate(config, devices, target.name)
    return {"peak": e.peak, "state": e.state, "gradients": e.gradients,
            "gather_buffers": e.gather_buffers, "activations": e.activations,
            "workspace": fit.WORKSPACE_BYTES, "fits": e.fits, "detail": e.detail}


def _return_freed_memory() -> None:
    """Hands the heap pages freed since the export back to the system: glibc keeps them,
    and the planning process of llama-1b on fsdp=8 held 16 GB it no longer used while
    its measuring child ran (a 23 GB host)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        pass


def figure_sources(mesh: Optional[MeshFigures], fit: bool) -> dict:
    """Where each figure of a plan comes from: compiled, measured, modelled or assumed.

    Args:
      mesh: the mesh device's figures (`tfllm.plan.sharded.mesh_figures`), None on one
        device.
      fit: whether the fit model's cross-check is in the plan.
    """
    program = ("the no-mesh program at one device's shapes (not DTensor's per-device "
               "clusters)" if mesh else "the step's one XLA program")
    out = {"compute": f"compiled: {program}",
           "memory": f"compiled: XLA's buffer assignment of {program}",
           "step time": "modelled: the compiled roofline with GEMM efficiency, kernel gaps"
                        + (", cluster dispatch, NCCL latency and bandwidth, and the "
                           "overlap the blocks' prefetch allows" if mesh else "")
                        + " (tfllm.plan.timing)"}
    if mesh:
        compiled_blocks = mesh.memory.block_buffers is not None
        out["memory"] += ("; state: exact bytes of the layout; float32 gradients: the "
                          "mesh device's shards in place of the program's whole set "
                          "(tfllm.footprint.layout.gradients); block buffers: " + (
            "compiled: XLA's buffer assignment of one block's program as the mesh runs "
            "it (tfllm.plan.block_program: gathered weights of the block and its "
            "prefetched neighbour, float32 weight gradients; its recomputation's "
            "temporaries beside them)" if compiled_blocks else
            "modelled from the model's blocks (tfllm/parallel/blocks.py's schedule)"))
        out["collectives"] = mesh.collectives.basis
        out["optimizer update"] = ("modelled: AdamW's bytes of the device's shard of the "
                                   "layout, replacing the no-mesh program's full update")
        out["clusters"] = mesh.clusters_basis or (
            "assumed: one XLA cluster per collective + 1 (DTensor splits the device's "
            "program at each)")
    if fit:
        out["fit model"] = "arithmetic: tfllm.footprint.fit.estimate (the cross-check)"
    return out


def _timing_figures(program, mesh: Optional[MeshFigures]) -> dict:
    """The figures `tfllm.plan.timing.step_time` reads: the compiled program's, with the
    mesh's collectives, blocks and optimizer update."""
    out = dict(program)
    if mesh is not None:
        out.update(collectives=mesh.collectives.as_json(), blocks=mesh.blocks,
                   overlappable=mesh.overlappable,
                   critical_collective_s=_critical_seconds(mesh),
                   optimizer_update=dict(mesh.optimizer_update))
    return out


def _critical_seconds(mesh: MeshFigures) -> float:
    """Seconds of the mesh's collectives that no prefetch can hide: expert parallelism's
    all-to-alls (the layout's figure: they are never measured)."""
    assumed = mesh.collectives_assumed or mesh.collectives
    return sum(t.bytes for t in assumed.traffic
               if t.axis.endswith("(experts)")) / assumed.link_bandwidth


def estimate_time(program, mesh: Optional[MeshFigures], target: Target) -> StepEstimate:
    """The plan's roofline lower bound, step-time estimate, tokens/s and MFU from what it
    compiled and measured (pure arithmetic: `benchmarks/retime_plan.py` re-times stored
    plans with it)."""
    figures = _timing_figures(program, mesh)
    collective_s = mesh.collectives.seconds if mesh else 0.0
    critical = min(figures.get("critical_collective_s", 0.0), collective_s)
    # the roofline lower bound as before, then the estimate with named factors
    # (the collectives the blocks' prefetch cannot hide behind even the roofline compute)
    roofline_step_s = program["roofline_s"] + critical + timing.exposed_collective_seconds(
        collective_s - critical, program["roofline_s"], mesh.blocks if mesh else 0,
        mesh.overlappable if mesh else False)
    step_time = timing.step_time(figures, target, mesh.clusters if mesh else 1,
                                 mesh.collective_count if mesh else None)
    step_s = step_time["step_s"]
    # MFU as tfllm reports it: model FLOPs (6N + causal attention at half, MaxText's
    # count: tfllm.train.metrics.flops_per_token) against the dense bf16 peak
    return StepEstimate(
        roofline_step_s=roofline_step_s, step_time=step_time, step_s=step_s,
        tokens_per_s=program["tokens_per_step"] * (mesh.batch_shards if mesh else 1)
        / step_s,
        mfu=program["model_flops"] / (step_s * target.bf16_flops))


def retime(result: PlanResult, target: Target) -> PlanResult:
    """`result` with its step time estimated again by today's model."""
    return dataclasses.replace(result, estimate=estimate_time(result.program, result.mesh,
                                                              target))


def finish(program: dict, mesh: Optional[MeshFigures], config, target: Target,
           method: str, fit: Optional[dict] = None) -> PlanResult:
    """The plan: the compiled program's figures with the mesh's, the device's fit, the
    step-time estimate and identification."""
    compiled = program["memory"]
    program = {k: v for k, v in program.items() if k != "memory"}
    arguments, outputs, alias = (compiled[k] for k in ("arguments", "outputs", "alias"))
    total, total_low = compiled["total"], None
    if mesh is not None:
        mm = mesh.memory
        arguments, outputs, alias = (v + mm.state_difference
                                     for v in (arguments, outputs, alias))
        total = (arguments + outputs - alias + compiled["temp"] + mm.counted
                 - mm.gradients.subtracted)
        if mm.gradients.subtracted == 0 and mm.gradients.excess:
            # one micro-batch: where in the backward pass the peak falls is not known
            # from the compile's total; the total stays the compile's (an upper bound)
            # and the bound with every excess byte gone is printed beside it
            total_low = total - mm.gradients.excess
    device = target.device_memory_bytes
    # TensorFlow leaves mesh.gpu_memory_reserve_mb outside its pool (NCCL, cuBLAS)
    reserve = config.mesh.gpu_memory_reserve_mb * 2 ** 20
    usable = device - reserve
    memory = Memory(arguments=arguments, outputs=outputs, alias=alias,
                    temp=compiled["temp"], total=total, device=device, reserve=reserve,
                    usable=usable, margin=usable - total, fits=usable - total >= 0,
                    total_low=total_low)
    identity = {
        "target": target.name, "device": target.description,
        "peaks": {"bf16_flops": target.bf16_flops, "fp8_flops": target.fp8_flops,
                  "tf32_flops": target.tf32_flops,
                  "memory_bandwidth": target.memory_bandwidth,
                  "source": f"XLA spec {target.spec_file}"},
        "model": {"family": config.model.family, "num_layers": config.model.num_layers,
                  "hidden_dim": config.model.hidden_dim, "remat": config.model.remat},
        "policy": config.precision.policy,
        "global_batch_size": config.train.global_batch_size,
        "grad_accum_steps": config.train.grad_accum_steps,
        "sequence_length": config.data.sequence_length,
        "method": method,
        "cost_source": "counted from the optimized HLO (the compile-only client has no "
                       "cost analysis)",
    }
    return PlanResult(program=program, memory=memory, mesh=mesh,
                      estimate=estimate_time(program, mesh, target), fit=fit,
                      sources=figure_sources(mesh, fit is not None), identity=identity)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def _step_parts(e: StepEstimate) -> str:
    t = e.step_time
    ms = lambda s: f"{s * 1e3:.3g}"  # noqa: E731
    parts = [f"GEMMs {ms(t['gemm_s'])} at {t['factors']['gemm_efficiency']:.0%} of peak",
             f"other kernels {ms(t['other_s'])}", f"launch gaps {ms(t['launch_s'])}"]
    if t["dispatch_s"]:
        waited = t.get("exposed_dispatch_s", t["dispatch_s"])
        parts.append(f"{t['factors']['clusters']:,} clusters {ms(waited)} of "
                     f"{ms(t['dispatch_s'])} dispatch exposed")
    if t["collective_s"]:
        critical = t.get("critical_collective_s", 0.0)
        parts.append(f"{t['factors']['collectives']:,} collectives "
                     f"{ms(t['exposed_collective_s'])} of {ms(t['collective_s'])} exposed "
                     f"({t['factors']['overlap']}"
                     + (f"; the experts' all-to-alls, {ms(critical)}, on the critical path"
                        if critical else "") + ")")
    return ", ".join(parts)


def _fit_text(f) -> str:
    d = f["detail"]
    return (f"{_gib(f['peak'])} ({'fits' if f['fits'] else 'does not fit'}; arithmetic, "
            f"tfllm.footprint.fit: state {_gib(f['state'])}, gradients {_gib(f['gradients'])}, "
            f"block buffers {_gib(f['gather_buffers'])}, activations "
            f"{_gib(f['activations'])} of which logits {_gib(d.get('logits', 0))} and "
            f"recomputed block {_gib(d.get('recomputed_block', 0))})")


def _gradients_text(g, total_low: Optional[int]) -> str:
    held = (f"the program's float32 gradients are {_gib(g.program)}, a mesh device "
            f"keeps its shards, {_gib(g.device)}")
    if g.subtracted:
        return (f"-{_gib(g.subtracted)} from the total ({held}; under accumulation "
                "at least one whole set is alive at the compiled peak)")
    return (f"not subtracted ({held}; with one micro-batch the compile does not say how "
            f"many were alive at its peak): {_gib(total_low)} at least")


def _mesh_rows(p: PlanResult) -> list:
    """The memory rows a mesh adds: gradients and block buffers."""
    if p.mesh is None:
        return []
    mm, rows = p.mesh.memory, []
    if mm.gradients.excess:
        rows.append(("  gradients", _gradients_text(mm.gradients, p.memory.total_low)))
    b = mm.buffers
    if mm.block_buffers is not None and p.fit is not None:
        bp = mm.block_program
        rows.append(("  block buffers", f"{_gib(mm.block_buffers)} (compiled: one block's "
                     f"program, {_gib(bp['weights'])} gathered weights of it and "
                     f"its neighbour + {_gib(bp['gradients'])} float32 "
                     f"gradients; modelled: {_gib(b.bytes)}"
                     + (f", at {b.unit}, larger than a block: counted)"
                        if mm.counted != mm.block_buffers else ")")))
        rows.append(("  one block's backward", f"{_gib(bp['recompute'])} of "
                     f"temporaries (compiled, remat={bp['remat']}, in the step's "
                     f"temporaries above; modelled: "
                     f"{_gib(p.fit['detail'].get('recomputed_block', 0))} recomputed block)"))
    elif b.bytes and mm.block_buffers is None:
        rows.append(("  block buffers", f"{_gib(b.bytes)} (modelled, at {b.unit}: "
                     f"gathered 16-bit weights {_gib(b.gathered)} + partial gradients "
                     f"{_gib(b.partials)} + the float32 reduction buffer "
                     f"{_gib(b.gradient)}, tfllm/parallel/blocks.py)"))
    return rows


def format_plan(p: PlanResult) -> str:
    """The short human table of a plan."""
    m, g, i, e = p.memory, p.program, p.identity, p.estimate
    fits = (f"fits, {_gib(m.margin)} to spare" if m.fits
            else f"DOES NOT FIT: {_gib(-m.margin)} over")
    rows = [
        ("target", f"{i['device']} ({i['target']})"),
        ("program", f"{i['model']['family']} {i['model']['num_layers']} layers, "
                    f"{i['policy']}, batch {i['global_batch_size']} x "
                    f"{i['sequence_length']}, grad accum {i['grad_accum_steps']}"),
        ("mesh", p.mesh.note if p.mesh else "one device"),
        ("method", i["method"]),
        ("memory / device", f"{_gib(m.total)} of {_gib(m.usable)} ({_gib(m.device)} "
                            f"less mesh.gpu_memory_reserve_mb {_gib(m.reserve)}): {fits}"),
        ("  arguments", _gib(m.arguments)),
        ("  outputs", f"{_gib(m.outputs)} ({_gib(m.alias)} aliased to arguments)"),
        ("  temporaries", f"{_gib(m.temp)} (activations and workspace, remat="
                          f"{i['model'].get('remat', 'none')})"),
        *_mesh_rows(p),
        *([("fit model", _fit_text(p.fit))] if p.fit is not None else []),
        ("GEMMs", f"{g['gemm_calls']:.0f} cuBLAS calls, {g['fp8_gemm_calls']:.0f} FP8 "
                  f"({g['fp8_projections']:.0f} FP8 projections)"),
        ("kernels", f"{g['kernels']:.0f} ({g['fusions']:.0f} fusions)"),
        ("FLOPs / step", f"{g['flops'] / 1e9:,.1f} GFLOP in GEMMs "
                         f"(model: {g['model_flops'] / 1e9:,.1f})"),
        ("bytes / step", f"{g['bytes'] / 1e9:.1f} GB"),
        ("est. step", f"{e.step_s * 1e3:.3g} ms ({_step_parts(e)}), "
                      f"{e.tokens_per_s:,.0f} tokens/s; roofline lower bound "
                      f"{e.roofline_step_s * 1e3:.3g} ms"),
        ("est. MFU", f"{100 * e.mfu:.0f}% of dense bf16 peak"),
        ("compile", f"{g['compile_s']:.1f} s"),
        ("figures", "; ".join(f"{k}: {v}" for k, v in p.sources.items())),
    ]
    at = next(n for n, r in enumerate(rows) if r[0] == "GEMMs")
    if p.mesh is not None:
        for c in (p.mesh.collectives_assumed, p.mesh.collectives):
            if c is None:
                continue
            label = c.basis.split(":")[0]
            rows.insert(at, (f"collectives ({label})",
                             f"{c.bytes_per_device / 1e9:.2f} GB/device/step ({c.detail}), "
                             f"{c.seconds * 1e3:.1f} ms at {c.link_bandwidth / 1e9:.0f} GB/s"))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
