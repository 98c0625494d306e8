"""Compile an exported XLA program for a GPU target with jaxlib's compile-only client.

Runs with jax alone (no TensorFlow), here on a machine without a GPU and in
`benchmarks/gpu/run_step.py` on a real one:

    python -m tfllm.plan.gpu_compile STEP.hlo.pb --target h100 --out RESULT.json

writes the compiled program's memory figures, the optimized HLO (`RESULT.hlo.txt`) and
the compile time.

Why the copies are removed: the HLO that TensorFlow's tf2xla bridge builds returns each
updated variable through an HLO `copy` (metadata `op_name="XLA_Retvals"`; 146 of them in
tiny's fp8 step, one per returned variable). HLO -> MLIR turns them into `mhlo.copy`,
which has no StableHLO form, and PJRT plugins (the CUDA one included, deviceless or not)
take their program as portable StableHLO, so the compile fails with "failed to legalize
operation 'mhlo.copy'". A copy is the identity on values; XLA inserts the copies its
buffer assignment needs by itself. So `remove_copies` forwards each copy's operand to its
users and erases it.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from tfllm import files, internals

# Compile flags for deviceless planning:
# * no autotuning (it would run kernels on a device);
# * cuBLAS / cuBLASLt for GEMMs instead of Triton fusions, whose tiles are chosen by
#   autotuning and otherwise default to small ones; this is also how FP8 dots become
#   `__cublas$lt$matmul$f8` calls;
# * no Triton softmax rewriter. Where the compile's time goes (measured 2026-11-29 with
#   TF_CPP_VMODULE=hlo_pass_pipeline=1 and gdb stack samples, jax 0.10.2): in
#   priority-fusion, which searches Triton tilings (SymbolicTileAnalysis) for every
#   producer or consumer next to the rewriter's Triton fusions (blocked attention's
#   tiles are many such neighbours). llama-7b's
#   preset layer at batch 1 x 4096: priority-fusion 462 of a 524 s compile with it, 4.5
#   of 51 s without (load 3-16 on 2 cores); at the preset's 2 x 16 x 4096 per GPU it
#   had not finished in 13 CPU-minutes, and takes 220 s without. The program barely moves
#   (890 -> 901 kernels: the 5 Triton softmax fusions become 16 ordinary ones; HBM bytes
#   -0.1%, roofline -0.1%, temporaries +1.5 KB of 1.9 GB); benchmarks/results/h100_plan.md.
#   Standard attention's (T x T) softmax is another matter: the rewriter makes it one
#   Triton fusion, and without it gpt2-small's step at 1 x 2048 moved 18% more bytes
#   (26.54 -> 31.50 GB, roofline 8.46 -> 9.94 ms; measured 2026-11-29 on the same
#   exported step), which a GPU running XLA's defaults would not. So the planner keeps
#   the rewriter (`--triton-softmax`) for programs without blocked attention, whose
#   compiles it barely slows (gpt2-small: 34 s with it, 31 without).
PLAN_XLA_FLAGS = ("--xla_gpu_autotune_level=0", "--xla_gpu_enable_triton_gemm=false")
NO_TRITON_SOFTMAX = "--xla_disable_hlo_passes=triton-softmax-rewriter"


def xla_flags(given: str, argv) -> str:
    """XLA_FLAGS for the compile: those `given`, the planner's, and the Triton softmax
    rewriter turned off unless `argv` asks to keep it (`--triton-softmax`)."""
    keep = "--triton-softmax" in argv
    return " ".join((given,) + PLAN_XLA_FLAGS + (() if keep else (NO_TRITON_SOFTMAX,))).strip()


def remove_copies(module) -> int:
    """Erases every `mhlo.copy` of an MLIR module (forwarding its operand); returns how many."""
    copies = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.operation.name == "mhlo.copy":
                        copies.append(inner)
                    walk(inner.operation)

    walk(module.operation)
    for op in copies:
        op.result.replace_all_uses_with(op.operands[0])
        op.operation.erase()
    return len(copies)


def hlo_to_mlir(hlo_proto: bytes):
    """A serialized HloModuleProto as an MLIR module that PJRT plugins accept.

    Must be called inside `tfllm.internals.jax_compiler().make_ir_context()`.
    """
    jx = internals.jax_compiler()
    module = jx.ir.Module.parse(jx.native.mlir.hlo_to_stablehlo(hlo_proto))
    remove_copies(module)
    return module


def compile_for_target(hlo_proto: bytes, target_config: str) -> dict:
    """Compiles for one GPU described by `target_config` (a GpuTargetConfigProto text).

    Returns:
      {"memory": {arguments, outputs, alias, temp, generated_code} in bytes,
       "optimized_hlo": text, "compile_s": seconds, "jax": version}
    """
    jx = internals.jax_compiler()
    import jax
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                            topology="1x1x1")
    client = topology.devices[0].client
    start = time.perf_counter()
    with jx.make_ir_context():
        module = hlo_to_mlir(hlo_proto)
        exe = client.compile(module, jx.native.DeviceList(tuple(topology.devices[:1])),
                             jx.CompileOptions())
    compile_s = time.perf_counter() - start
    stats = exe.get_compiled_memory_stats()
    return {
        "memory": {"arguments": stats.argument_size_in_bytes,
                   "outputs": stats.output_size_in_bytes,
                   "alias": stats.alias_size_in_bytes,
                   "temp": stats.temp_size_in_bytes,
                   "generated_code": stats.generated_code_size_in_bytes},
        "optimized_hlo": "\n".join(m.to_string() for m in exe.hlo_modules()),
        "compile_s": compile_s,
        "jax": jax.__version__,
    }


def compile_for_cpu(hlo_proto: bytes) -> dict:
    """Compiles for this host's CPU with jaxlib's CPU client: XLA's own memory figures
    of the program as the CPU backend would run it (`benchmarks/remat.py`).

    Returns:
      {"memory": {arguments, outputs, alias, temp, generated_code} in bytes,
       "compile_s": seconds, "jax": version}
    """
    jx = internals.jax_compiler()
    import jax

    device = jax.devices("cpu")[0]
    start = time.perf_counter()
    with jx.make_ir_context():
        module = hlo_to_mlir(hlo_proto)
        exe = device.client.compile_and_load(module, jx.native.DeviceList((device,)),
                                             jx.CompileOptions())
    stats = exe.get_compiled_memory_stats()
    return {"memory": {"arguments": stats.argument_size_in_bytes,
                       "outputs": stats.output_size_in_bytes,
                       "alias": stats.alias_size_in_bytes,
                       "temp": stats.temp_size_in_bytes,
                       "generated_code": stats.generated_code_size_in_bytes},
            "compile_s": time.perf_counter() - start, "jax": jax.__version__}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hlo", help="A serialized HloModuleProto (step.hlo.pb).")
    parser.add_argument("--target-config", required=True,
                        help="A GpuTargetConfigProto text file.")
    parser.add_argument("--out", required=True, help="Where to write the JSON result.")
    parser.add_argument("--triton-softmax", action="store_true",
                        help="Keep XLA's Triton softmax rewriter (read before jax starts, "
                             "see NO_TRITON_SOFTMAX).")
    args = parser.parse_args(argv)
    with open(args.hlo, "rb") as f:
        hlo = f.read()
    with open(args.target_config) as f:
        config = f.read()
    result = compile_for_target(hlo, config)
    out = os.path.abspath(args.out)  # in the planner's folder: the root of these writes
    files.write_atomically(os.path.dirname(out), os.path.splitext(out)[0] + ".hlo.txt",
                           result.pop("optimized_hlo"))
    files.write_atomically(os.path.dirname(out), out, json.dumps(result))
    return 0


if __name__ == "__main__":
    # The CUDA plugin checks the driver and CUDA libraries on load; compile-only use needs
    # neither. Must be set before jax loads its plugins.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    # XLA reads its flags once, when the backend starts: set them before jax does.
    import sys
    os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""), sys.argv)
    raise SystemExit(main())
