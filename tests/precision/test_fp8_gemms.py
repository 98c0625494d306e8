"""Every FP8 projection runs three FP8 GEMMs in the XLA each device executes, on every mesh.

Parity tests cannot see it: a backward dot that gets one operand as bf16 computes the
same numbers, as a bf16 GEMM. What is checked is the HLO each device compiles (XLA dumps
of one fp8 train step of the tiny llama, read by `tfllm.compiler.fp8_hlo`): the forward
dot (E4M3 x E4M3) and the input- and weight-gradient dots (E4M3 x E5M2) of each FP8
projection have both operands dequantized from FP8 in their own module, in the pattern
XLA's GPU compiler turns into cuBLASLt FP8 GEMMs. Without a mesh the step is one XLA
program; on a DTensor mesh TensorFlow's clustering cuts it into per-device clusters
(tfllm.compiler.xla), where the backward dots used to get bf16 parameters (14 of 42 FP8
dots on data=2,model=2 before fp8_einsum re-dequantized in the backward).
"""

import json
import os
import subprocess
import sys

import pytest

from tfllm.compiler.fp8_hlo import dump_fp8_dot_counts
from tests.harness import LONG_TF_HANG_S, ROOT

E4M3, E5M2 = "f8e4m3fn", "f8e5m2"
# name: (mesh axes, None without a mesh; recipe; remat[; more settings])
CASES = {
    "no_mesh": (None, "delayed", "none"),
    # Tensor parallelism: each device's GEMMs take its column or row of each kernel.
    # model=2, not data=2,model=2 (where the bf16 backward dots were found): DTensor
    # compiles every device's clusters (4 devices: 544 modules, 53 s of the process's
    # 114; model=2: 14 s, AMD EPYC, 2026-11-29), and model=2 is the stricter check:
    # with the backward dequantizing through `dequantize` itself (CSE merges it into
    # the forward's), model=2 gets 14 bf16 backward dots, data=2,model=2 none.
    "model2_delayed": ("model=2", "delayed", "none"),
    # Current scaling under remat=full on an FSDP mesh: the projections that read the
    # same input (q, k, v; gate, up) compute the same scale and FP8 bytes, and before
    # fp8_einsum made each call's scales its own, CSE merged them, so 3 of the 14
    # backward dots got a bf16 parameter. It also covers the recomputed forward, whose
    # weight quantization CSE merged into the first forward's (6 of 7 dots on data=1).
    # CSE works inside each device's cluster, whatever the device count: fsdp=2 shows it
    # as fsdp=8 did, for 52 CPU seconds of compilation instead of 148.
    "fsdp2_current_remat_full": ("fsdp=2", "current", "full"),
    # One sparse block (4 experts, top 2): its gate, up and down are batched einsums over
    # the experts' slots (E, C); on fsdp=2 the experts split over fsdp (expert
    # parallelism: each device's GEMMs take its own experts' kernels, never gathered, and
    # the tokens' slots arrive by all-to-all). The router's dot stays bf16 (not an FP8
    # projection).
    "moe_fsdp2_delayed": ("fsdp=2", "delayed", "none", {
        "model.num_experts": 4, "model.num_experts_per_tok": 2,
        "model.moe_intermediate_dim": 32, "model.mlp_only_layers": "[]"}),
}
TIMEOUT_S = LONG_TF_HANG_S  # bounds a hang only: one process, four cases (~60 s idle)
# CPU code generation at LLVM -O0: the HLO read here is XLA's input, which this does not
# change. data=2,model=2 alone took 94 s instead of 156 s (AMD EPYC, 2026-11-27). The four
# cases: 6, 14, 34 and 26 CPU seconds (AMD EPYC, 2026-11-29; 5.6 s of start-up).
XLA_COMPILE_FLAGS = "--xla_backend_optimization_level=0"


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """One child process (XLA reads XLA_FLAGS once, at start) runs every case."""
    out = tmp_path_factory.mktemp("fp8_gemms")
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS=f"--xla_dump_to={out / 'all'} --xla_dump_hlo_as_text "
                         + XLA_COMPILE_FLAGS)
    run = subprocess.run([sys.executable, "-m", "tests.precision.fp8_step_dumps", str(out),
                          json.dumps(CASES)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return out, json.loads((out / "cases.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_each_fp8_projection_has_three_fp8_gemms_per_device(dumps, case):
    out, cases = dumps
    projections, devices = cases[case]["projections"], cases[case]["devices"]
    # q, k, v, output, gate, up, down of the one block (the experts' for the MoE case)
    assert projections == 7
    counts = dump_fp8_dot_counts(str(out / case), devices=devices)
    assert counts["modules"] >= devices, counts  # XLA really compiled the step
    forward = counts["pairs"].get(f"{E4M3} x {E4M3}", 0)
    if CASES[case][2] == "full":
        # remat=full runs the block's forward again in the backward pass: a recomputed
        # forward dot per projection whose output the backward needs, FP8 as well (6 of
        # 7: mlp/down's, which only meets the residual add, is pruned).
        assert projections < forward <= 2 * projections, counts
    else:
        assert forward == projections, counts
    assert counts["half"] == 0, counts["half_ops"]
    # Operand types: the forward E4M3 x E4M3, both gradients E4M3 x E5M2 ...
    assert counts["pairs"] == {f"{E4M3} x {E4M3}": forward,
                               f"{E4M3} x {E5M2}": 2 * projections}, counts
    assert counts["full"] == forward + 2 * projections
    # ... each in the exact pattern of XLA's GPU GEMM rewriter.
    assert counts["gpu_full"] == counts["full"], counts
