"""Run tfllm's exported train step with jax alone: GPU timing, memory, a profile, or a check.

Needs only python3 with jax and numpy (no TensorFlow):

    python run_step.py DIR                 # time it on the GPU (or CPU), print JSON
    python run_step.py DIR --check         # one step on check.npz, compare with TF
    python run_step.py DIR --profile OUT   # also a profiler trace of 3 steps under OUT

DIR is what `tfllm export-step --config C --out DIR [--check]` wrote. Where DIR holds
`step.jax` (a serialized `jax.export.Exported`, tfllm.plan.jax_export) the step is
deserialized and compiled through public jax APIs only, so any recent jax runs it; else
`step.hlo.pb` is compiled through the jaxlib internals of the plan extra's jax release.
Timing fills the inputs with random values of the right dtypes (token ids in [1, vocab),
weights and optimizer states small and non-zero), warms up, then times `--steps` steps,
each synchronized with the device, feeding every step's updated variables into the next.
It reports tokens/s, the median step time, TFLOP/s and MFU against the datasheet dense
bf16 peak and against a bf16 matmul measured in the same run, the device's peak memory
(where the device reports it), saves the optimized HLO and lists which dots became
cuBLAS / cuBLASLt calls (FP8 ones as `__cublas$lt$matmul$f8`).
"""

import argparse
import functools
import glob
import gzip
import json
import os
import re
import statistics
import time

import sys

import numpy as np

_STARTED = time.perf_counter()

# The XLA flags `tfllm train` sets for the step's precision policy
# (tfllm.runtime.environment.POLICY_XLA_FLAGS: FP8 GEMMs need Triton GEMMs off), added
# before jax starts its backend, which reads XLA_FLAGS once; a flag already in XLA_FLAGS
# is the user's and is kept.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tfllm.runtime import environment  # noqa: E402  (no TensorFlow in it)


def _policy_flags(argv):
    step_json = os.path.join(argv[1], "step.json") if len(argv) > 1 else ""
    if not os.path.isfile(step_json):
        return {}
    with open(step_json) as f:
        return environment.precision_flags(json.load(f)["config"]["policy"])


_policy_flags(sys.argv)
import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)  # the step has int64 parameters
import jax.numpy as jnp  # noqa: E402

# Dense bf16 tensor-core peaks from NVIDIA's datasheets (SXM parts), TFLOP/s.
DATASHEET_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


class PortableStep:
    """step.jax through public APIs: jax.export.deserialize, jax.jit, lower, compile."""

    def __init__(self, path, device, donate=()):
        # step.jax.gz: the same, compressed (prepare.py: folded constants, such as causal
        # masks, compress well)
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            exported = jax.export.deserialize(bytearray(f.read()))
        self.device = device
        shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exported.in_avals]
        # `donate`: the inputs the step updates (weights, optimizer states, counters), whose
        # buffers the updated values take, as TensorFlow's step updates its variables in
        # place: without it the device holds the old state and the new one at once, and
        # the peak memory read is the state's size above the training step's
        with jax.default_device(device):
            self.compiled = jax.jit(exported.call, donate_argnums=tuple(donate)).lower(
                *shapes).compile()

    def run(self, args):
        return list(self.compiled(*args))

    def optimized_hlo(self):
        return self.compiled.as_text()


class HloStep:
    """step.hlo.pb through the plan extra's pinned jaxlib internals (the older path)."""

    def __init__(self, path, device):
        # tfllm.plan.gpu_compile needs only jax: imported from this checkout (no
        # TensorFlow here; sys.path above)
        from tfllm import internals
        from tfllm.plan.gpu_compile import hlo_to_mlir
        with open(path, "rb") as f:
            hlo = f.read()
        jx = internals.jax_compiler()
        self.device = device
        # hlo_to_mlir drops the HLO copies of TensorFlow's returned variables, which have
        # no StableHLO form: PJRT plugins (CUDA) refuse them (see tfllm/plan/gpu_compile.py)
        with jx.make_ir_context():
            self.exe = device.client.compile_and_load(
                hlo_to_mlir(hlo), jx.native.DeviceList((device,)), jx.CompileOptions())

    def run(self, args):
        outs = self.exe.execute_sharded(args).disassemble_into_single_device_arrays()
        return [o[0] for o in outs]

    def optimized_hlo(self):
        return "\n".join(m.to_string() for m in self.exe.hlo_modules())


def compile_step(directory, backend):
    """The step of DIR compiled for the first device of `backend`: step.jax where it is
    there (any recent jax), else step.hlo.pb (the plan extra's jax)."""
    device = jax.devices(backend)[0]
    with open(os.path.join(directory, "step.json")) as f:
        donate = sorted(o["param"] for o in json.load(f)["outputs"] if o["role"] == "update")
    for name in ("step.jax", "step.jax.gz"):
        portable = os.path.join(directory, name)
        if os.path.exists(portable):
            return PortableStep(portable, device, donate)
    return HloStep(os.path.join(directory, "step.hlo.pb"), device)


def _fill_kind(param):
    """How an input is filled: token ids in [1, vocab), the spike guard off, counters at
    zero, the step at 10, Adam's second moments small and positive, FP8 scales near one,
    weights and first moments small and non-zero."""
    role = param["role"]
    if role == "optimizer_state" and param["name"].startswith("optimizer/v/"):
        return "second_moment"
    return role if role in ("batch", "loss_limit", "counter", "step", "fp8_state") else "normal"


def _fill(kind, shape, dtype, vocab, key):
    if kind == "batch":
        return jax.random.randint(key, shape, 1, vocab, dtype)  # no zeros
    if kind == "loss_limit":
        return jnp.full(shape, jnp.inf, dtype)
    if kind in ("counter", "step"):
        return jnp.full(shape, 10 if kind == "step" else 0, dtype)
    normal = jax.random.normal(key, shape, jnp.float32)
    if kind == "second_moment":
        return (jnp.abs(normal) * 1e-4 + 1e-6).astype(dtype)
    if kind == "fp8_state":
        return (jnp.abs(normal) + 0.5).astype(dtype)
    return (normal * 0.02).astype(dtype)


def random_inputs(desc, device, seed=0):
    """The step's inputs, made on `device` by jax.random: drawing them with numpy on the
    host took ~36 s per 10^9 values on a CPU core here, so llama-1b's 3.7 x 10^9 (weights
    and both Adam moments) likely took most of the first lease's 110 s bound (inferred:
    that lease timed no phases); on a GPU they should take well under a second. One small
    program per distinct (fill, shape, dtype)."""
    vocab = desc["config"]["vocab_size"]
    key = jax.device_put(jax.random.key(seed), device)
    programs, out = {}, []
    with jax.default_device(device):
        for i, p in enumerate(desc["params"]):
            spec = (_fill_kind(p), tuple(p["shape"]), jnp.dtype(p["dtype"]))
            if spec not in programs:
                programs[spec] = jax.jit(functools.partial(_fill, *spec, vocab))
            out.append(programs[spec](jax.random.fold_in(key, i)))
    return out


def run_once(step, arrays):
    return step.run([jax.device_put(a, step.device) for a in arrays])


def check(directory, compiled):
    """One step on the exported inputs; compares every output with TensorFlow's.
    `compiled`: the step from `compile_step`."""
    with open(os.path.join(directory, "step.json")) as f:
        desc = json.load(f)
    ref = np.load(os.path.join(directory, "check.npz"))
    outs = run_once(compiled, [ref[f"input/{i}"] for i in range(len(desc["params"]))])
    worst, noise_only = 0.0, []
    for out, spec in zip(outs, desc["outputs"]):
        key = (f"metric/{spec['name']}" if spec["role"] == "metric"
               else f"update/{spec['param']}")
        got, want = np.asarray(out, np.float64), np.asarray(ref[key], np.float64)
        # Error relative to the tensor's scale. The key bias and its Adam moments get a
        # gradient that is zero in exact arithmetic (softmax ignores a shift shared by
        # all keys), so they hold rounding noise only: listed, not scored.
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        if "attention/key/bias" in spec["name"]:
            noise_only.append(spec["name"])
            continue
        worst = max(worst, float(np.max(np.abs(got - want))) / (scale + 1e-12))
    loss_index = [o.get("name") for o in desc["outputs"]].index("loss")
    return {"checked_outputs": len(outs) - len(noise_only), "noise_only": noise_only,
            "max_relative_error": worst,
            "loss": float(np.asarray(outs[loss_index])), "tf_loss": float(ref["metric/loss"])}


def matmul_peak(device, n=None, repeats=10):
    # 8192-square bf16 GEMMs reach an accelerator's peak; on a CPU (where the figure only
    # exercises the runner) 1024 keeps it to a second instead of a minute.
    n = n or (8192 if device.platform != "cpu" else 1024)
    a = jax.device_put(jnp.ones((n, n), jnp.bfloat16), device)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f(a, a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n ** 3 / statistics.median(times)


def gemm_report(hlo_text):
    calls = re.findall(r'custom_call_target="([^"]+)"', hlo_text)
    return {name: calls.count(name) for name in sorted(set(calls)) if "cublas" in name
            or "cudnn" in name}


def peak_memory_gib(device):
    """The device's peak bytes in use so far, GiB (None where it reports none: CPUs)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    peak = (stats or {}).get("peak_bytes_in_use")
    return peak / 2**30 if peak is not None else None


#: GPU kernel names of matrix multiplications: cuBLAS/cuBLASLt's (sm90_xmma_gemm_*,
#: nvjet_*, cutlass*) and XLA's Triton GEMM fusions (the fusion gemm_fusion_dot.N runs
#: as the kernel gemm_fusion_dot_N)
GEMM_KERNEL = re.compile(r"gemm|xmma|nvjet|cutlass|matmul", re.I)
#: kernels shorter than this are the ones a per-kernel launch cost would dominate
SHORT_KERNEL_NS = 5000


def profile_summary(path, steps, planes="/device:", lines="Stream", top=15):
    """Where the traced steps' time went, per device plane of the trace at `path`: the
    kernels (and copies) of its `lines` (CUPTI names each CUDA stream's line "Stream
    #N(...)"), per step: count, busy ms (summed durations), span ms (first start to last
    end), the GEMMs' share of busy (`GEMM_KERNEL`: what sets the plan's GEMM efficiency
    against its roofline), the kernels under 5 us (count and ms: what a per-kernel
    launch cost would dominate), the median kernel, and the `top` names by time. Busy
    well below span means the stream waited (launch or host time); busy near span with a
    large GEMM share means slow kernels. Read with jax's own reader (no TensorFlow)."""
    from jax.profiler import ProfileData
    out = {}
    for plane in ProfileData.from_file(path).planes:
        if not plane.name.startswith(planes):
            continue
        totals, first, last, durations = {}, None, None, []
        for line in plane.lines:
            if not line.name.startswith(lines):
                continue
            for e in line.events:
                t = totals.setdefault(e.name, [0.0, 0])
                t[0] += e.duration_ns / 1e6
                t[1] += 1
                durations.append(e.duration_ns)
                first = e.start_ns if first is None else min(first, e.start_ns)
                end = e.start_ns + e.duration_ns
                last = end if last is None else max(last, end)
        if not totals:
            out[plane.name] = {"lines": [line.name for line in plane.lines]}
            continue
        ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
        short = [d for d in durations if d < SHORT_KERNEL_NS]
        out[plane.name] = {
            "events_per_step": sum(c for _, c in totals.values()) / steps,
            "busy_ms_per_step": sum(ms for ms, _ in totals.values()) / steps,
            "span_ms_per_step": (last - first) / 1e6 / steps,
            "gemm_busy_ms_per_step": sum(ms for name, (ms, _) in totals.items()
                                         if GEMM_KERNEL.search(name)) / steps,
            "short_events_per_step": len(short) / steps,
            "short_ms_per_step": sum(short) / 1e6 / steps,
            "median_event_us": statistics.median(durations) / 1e3,
            "top": [[name, ms / steps, c / steps] for name, (ms, c) in ranked[:top]]}
    return out


def progress(phase, **fields):
    """One line on stderr per phase, with the seconds since the runner started: where a
    step bounded by run_all.sh's timeout spent its time shows in the stderr it keeps."""
    line = {"t_s": round(time.perf_counter() - _STARTED, 2), "phase": phase, **fields}
    print("run_step:", json.dumps(line), file=sys.stderr, flush=True)


def time_steps(directory, backend, steps, warmup, compiled, out_dir=None, profile=None,
               phases=None):
    phases = {} if phases is None else phases
    with open(os.path.join(directory, "step.json")) as f:
        desc = json.load(f)
    device = compiled.device
    optimized = compiled.optimized_hlo()
    with open(os.path.join(out_dir or directory, f"step.optimized.{backend}.hlo.txt"),
              "w") as f:
        f.write(optimized)
    start = time.perf_counter()
    args = random_inputs(desc, device)
    for a in args:
        a.block_until_ready()
    phases["inputs_s"] = time.perf_counter() - start
    progress("inputs on the device", s=round(phases["inputs_s"], 2))
    updates = [(i, o["param"]) for i, o in enumerate(desc["outputs"]) if o["role"] == "update"]

    def one_step():
        outs = compiled.run(args)
        for o in outs:
            o.block_until_ready()
        for out_index, param in updates:
            args[param] = outs[out_index]

    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        one_step()
        if i == 0:
            phases["first_step_s"] = time.perf_counter() - start
            progress("first step", s=round(phases["first_step_s"], 3))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    phases["timed_steps_s"] = sum(times)
    step_s = statistics.median(times)
    progress("timed", steps=steps, median_ms=round(step_s * 1e3, 3))
    flops = desc["flops_per_token"] * desc["tokens_per_step"] / step_s
    kind = device.device_kind
    sheet = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in kind), None)
    result = {"device": kind, "backend": backend, **desc["config"],
              "params": desc["num_params"], "tokens_per_s": desc["tokens_per_step"] / step_s,
              "step_ms": step_s * 1e3, "tflops": flops / 1e12,
              "mfu_datasheet": flops / (sheet * 1e12) if sheet else None,
              "gemm_calls": gemm_report(optimized),
              "fp8_gemms": optimized.count("__cublas$lt$matmul$f8"),
              "peak_memory_gib": peak_memory_gib(device),
              "step_ms_all": [t * 1e3 for t in times],
              "program": "step.jax" if isinstance(compiled, PortableStep) else "step.hlo.pb",
              "steps": steps, "jax": jax.__version__, "phases_s": phases,
              "xla_flags": os.environ.get("XLA_FLAGS", "")}
    # the timing kept before the profile and the matmul reference run: run_all.sh records
    # it if the step is stopped in either
    with open(os.path.join(out_dir or directory, "result.partial.json"), "w") as f:
        json.dump(result, f)
    trace = summary = None
    if profile:  # a trace TensorBoard's profile plugin or Perfetto opens
        start = time.perf_counter()
        with jax.profiler.trace(profile):
            for _ in range(3):
                one_step()
        # also flat beside the results, gzipped: a lent machine returns files a few
        # folders deep only (the trace lies in PROFILE/plugins/profile/RUN/), and
        # `tfllm.train.profile.summary` reads it here, where TensorFlow is
        found = sorted(glob.glob(os.path.join(profile, "plugins", "profile", "*",
                                              "*.xplane.pb")))
        if found:
            trace = os.path.join(out_dir or directory, "profile.xplane.pb.gz")
            with open(found[-1], "rb") as f, gzip.open(trace, "wb") as g:
                g.write(f.read())
            summary = profile_summary(found[-1], 3)
        phases["profile_s"] = time.perf_counter() - start
        progress("profiled", s=round(phases["profile_s"], 2))
    del args  # the step's state off the device before the reference matmul
    start = time.perf_counter()
    peak = matmul_peak(device)
    phases["matmul_peak_s"] = time.perf_counter() - start
    return {**result, "matmul_peak_tflops": peak / 1e12, "mfu_measured_peak": flops / peak,
            "profile": profile, "trace": trace, "profile_summary": summary}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--backend", default="gpu" if any(
        d.platform == "gpu" for d in jax.devices()) else "cpu")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps to time (default 50; with --check, none unless given)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--check", action="store_true",
                        help="compare one step with TensorFlow's outputs (check.npz); "
                             "with --steps, then time that many steps on the same program")
    parser.add_argument("--out", help="folder for the optimized HLO (default: DIR)")
    parser.add_argument("--profile", help="write a profiler trace of 3 steps here")
    args = parser.parse_args()
    phases = {"start_s": time.perf_counter() - _STARTED}  # jax imported
    progress("jax imported", jax=jax.__version__)
    start = time.perf_counter()
    compiled = compile_step(args.directory, args.backend)
    phases["compile_s"] = time.perf_counter() - start
    progress("compiled", s=round(phases["compile_s"], 2))
    result = {}
    if args.check:
        result.update(check(args.directory, compiled))
    if not args.check or args.steps:
        result.update(time_steps(args.directory, args.backend, args.steps or 50, args.warmup,
                                 compiled, args.out, args.profile, phases))
    result["phases_s"] = phases
    print(json.dumps(result))


if __name__ == "__main__":
    main()
