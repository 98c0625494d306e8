"""`tfllm plan`: tiny's train step compiled for an H100 by jaxlib's compile-only client."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tfllm.config import load_config
from tfllm.plan.planner import format_plan, plan
from tests.harness import ROOT, run_tfllm, shared_xla_dump, tiny_config, tiny_overrides

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins") is None,
    reason="the plan extra is not installed (pip install -e '.[plan]')")


def tiny(family="llama", **extra):
    return tiny_config(family, **extra)


# Each plan exports and compiles a step (~25 s on 2 cores): the plans several tests
# read are made once.
@pytest.fixture(scope="module")
def bf16_plan():
    return plan(tiny(**{"precision.policy": "bfloat16"}))


def _assert_fp8_gemms(program, projections):
    """The FP8 figures of a plan of the tiny llama (2 blocks) with `projections` FP8
    projections."""
    assert program["fp8_projections"] == projections
    # forward, input gradient and weight gradient of every FP8 projection are cuBLASLt
    # FP8 GEMMs; nothing else is
    assert program["fp8_gemm_calls"] == 3 * projections
    # attention, LM head, bf16 layers
    assert program["gemm_calls"] > program["fp8_gemm_calls"]
    # the GEMMs' FLOPs are at least the model's (6N + causal attention at half, tfllm's
    # MFU numerator): standard attention also computes the masked half of the scores
    # (+2.7% for tiny GPT); this llama's head_dim of 4 is padded to 8 by XLA for cuBLAS,
    # which doubles its attention GEMMs: +7.3% over the model's count, bounded by 10%
    assert program["model_flops"] <= program["flops"] <= 1.1 * program["model_flops"]


# Every projection FP8 (q, k, v, o + gate, up, down = 7 per llama block, the LM head never
# FP8): test_cli_prints_one_json_object_and_rejects_unknown_targets plans that config
# through `tfllm plan --json` and reads the same figures (one plan, not two).
@pytest.mark.slow
def test_fp8_plans_three_fp8_gemms_per_projection_and_keeps_excluded_ones_bf16():
    p = plan(tiny(**{"precision.policy": "fp8", "precision.fp8_exclude": "[mlp/]"}))
    # "mlp/" keeps 3 of each block's 7 projections in bf16: 4 of 7 in each of 2 blocks
    _assert_fp8_gemms(p.program, 8)


@pytest.mark.slow
def test_bfloat16_plans_no_fp8_gemm_and_arguments_are_the_step_parameters(bf16_plan):
    p = bf16_plan
    g = p.program
    assert g["fp8_gemm_calls"] == 0 and g["fp8_projections"] == 0 and g["gemm_calls"] > 0
    m = p.memory
    # XLA's argument buffers are exactly the step's parameters: batch, float32 weights,
    # AdamW moments, step counters
    assert m.arguments == p.program["step_parameter_bytes"]
    # every updated variable is written in place of its argument
    assert m.alias > 0.9 * m.arguments
    # fits against what TensorFlow can use: the device less mesh.gpu_memory_reserve_mb
    assert m.usable == m.device - 4096 * 2**20
    assert m.fits and m.margin == m.usable - m.total
    # the modelled step is the roofline plus its named factors: never below it; one
    # device runs one program (no cluster dispatch, no collectives)
    t = p.estimate.step_time
    assert p.estimate.step_s == t["step_s"] > p.estimate.roofline_step_s
    assert t["dispatch_s"] == 0 and t["collective_s"] == 0
    assert t["step_s"] == pytest.approx(t["gemm_s"] + t["other_s"] + t["launch_s"])
    assert p.sources["compute"] == "compiled: the step's one XLA program"
    assert 0 < p.estimate.mfu < 1 and p.estimate.step_s > 0
    assert "fits" in format_plan(p)


@pytest.mark.slow
def test_temporaries_grow_with_the_batch(bf16_plan):
    small = bf16_plan  # batch 16
    large = plan(tiny(**{"precision.policy": "bfloat16", "train.global_batch_size": 128}))
    assert large.memory.temp > small.memory.temp
    assert large.memory.arguments > small.memory.arguments  # the batch only
    assert large.program["flops"] == pytest.approx(8 * small.program["flops"])


@pytest.mark.slow
def test_a_step_that_cannot_fit_says_by_how_much():
    # (1024 x 16 heads x 2048 x 2048) float32 attention probabilities alone are 256 GiB
    p = plan(tiny(**{"model.max_sequence_length": 2048, "data.sequence_length": 2048,
                     "train.global_batch_size": 1024}))
    m = p.memory
    assert not m.fits and m.margin < -m.device
    assert m.margin == m.usable - m.total  # usable: less the NCCL reserve
    text = format_plan(p)
    assert f"DOES NOT FIT: {-m.margin / 2**30:.2f} GiB over" in text


@pytest.mark.slow
def test_a_sharded_mesh_is_planned_per_device(bf16_plan):
    # fsdp=4: the mesh whose tiny steps tests/plan/test_measured.py measures, run once
    # for both (tests/plan/conftest.py); tests/plan/test_sharded.py plans the other meshes
    # (model, data, the sequence split) without a compile.
    p = plan(tiny(**{"precision.policy": "bfloat16", "mesh.axes": "fsdp=4"}))
    one = bf16_plan
    assert p.devices == 4 and "per device" in p.mesh.note
    # state is split 4 ways except the small replicated norms, and the batch 4 ways
    assert p.memory.arguments < 0.5 * one.memory.arguments
    assert p.mesh.batch_shards == 4
    c, assumed = p.mesh.collectives, p.mesh.collectives_assumed
    assert "fsdp: all-gather weights" in assumed.detail
    # measured on the executed CPU program of fsdp=4 (tests/plan/test_measured.py)
    assert c.basis.startswith("measured") and c.bytes_per_device > 0
    assert p.mesh.clusters_basis.startswith("measured")
    # the lower bound waits for what the blocks' prefetch cannot hide behind the roofline
    # compute (tfllm.plan.timing.exposed_collective_seconds): at least one block's share
    from tfllm.plan import timing
    assert p.mesh.overlappable and p.mesh.blocks == p.identity["model"]["num_layers"]
    exposed = timing.exposed_collective_seconds(c.seconds, p.program["roofline_s"],
                                                p.mesh.blocks, True)
    assert c.seconds / p.mesh.blocks <= exposed <= c.seconds
    assert p.estimate.roofline_step_s == pytest.approx(p.program["roofline_s"] + exposed)
    assert p.estimate.step_s > p.estimate.roofline_step_s  # tfllm.plan.timing's factors
    text = format_plan(p)
    assert "collectives (measured)" in text and "collectives (assumed)" in text
    assert "memory: compiled" in text and "block buffers" in text


@pytest.mark.slow
def test_extrapolating_over_layers_matches_the_full_compile():
    cfg = tiny(**{"model.num_layers": 4})
    full = plan(cfg, layers="full")
    est = plan(cfg, layers="extrapolate")
    assert est.method.startswith("extrapolated")
    for key in ("arguments", "outputs", "alias"):  # state is linear in the layers
        assert getattr(est.memory, key) == getattr(full.memory, key)
    for key in ("gemm_calls", "num_params", "flops"):
        assert est.program[key] == full.program[key]
    # temporaries: XLA's buffer assignment is not exactly linear in the layers; 10%
    # (measured: within a few percent on gpt2-small and llama-1b, see h100_plan.md)
    assert est.memory.temp == pytest.approx(full.memory.temp, rel=0.1)


def test_a_mesh_that_needs_more_devices_names_the_flag():
    from tfllm.parallel.mesh import MeshError
    with pytest.raises(MeshError, match="--devices N"):
        plan(tiny(**{"mesh.axes": "fsdp=-1,model=8"}))


@pytest.mark.slow
def test_cli_prints_one_json_object_and_rejects_unknown_targets(tmp_path):
    env = dict(os.environ)  # as it is: TensorFlow's log level not changed
    # The tiny llama with every projection FP8: 2 blocks x 7. (Tiny GPT's FP8 plan, 36
    # FP8 GEMMs of 2 x 6 projections, is notebook 03's table, compared on each fresh run.)
    r = run_tfllm("plan", "--json", *sum((["--set", o] for o in tiny_overrides(
        "llama", **{"precision.policy": "fp8", "precision.fp8_exclude": "[]"})), []),
        env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["target"] == "h100"
    _assert_fp8_gemms(out, 14)
    r = run_tfllm("plan", "--target", "v100", env=env)
    assert r.returncode == 2 and "invalid choice: 'v100'" in r.stderr


# In a jax-only child: compile each HLO module DTensor handed to XLA for the H100 and sum
# the GEMM FLOPs of its backward (gradient_tape) kernels.
_CLUSTER_FLOPS = r"""
import glob, json, os, sys
from jax._src.lib import xla_client
from tfllm.compiler import hlo_stats
from tfllm.plan.gpu_compile import compile_for_target
from tfllm.compiler.targets import TARGETS
target = TARGETS["h100"]
backward, compiled = 0.0, 0
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*before_optimizations.txt"))):
    text = open(path).read()
    if " dot(" not in text:
        continue
    proto = xla_client.hlo.hlo_module_from_text(text).as_serialized_hlo_module_proto()
    result = compile_for_target(proto, target.target_config())
    compiled += 1
    kernels, _ = hlo_stats.kernels(result["optimized_hlo"])
    backward += sum(k.gemm_flops * k.count for k in kernels if "gradient_tape" in k.op_name)
print(json.dumps({"backward_flops": backward, "compiled": compiled}))
"""


@pytest.mark.slow
def test_dtensor_clusters_compile_for_h100_and_match_the_per_device_plan(tmp_path,
                                                                        tmp_path_factory):
    # The fsdp=2 run tests/train/test_xla.py reads as well (its LLAMA arguments: one
    # block): one run per session.
    _, modules = shared_xla_dump(tmp_path_factory, "fsdp=2", (
        "--set", "model.family=llama", "--set", "model.num_key_value_heads=2",
        "--set", "model.num_layers=1"))
    assert modules
    dump = tmp_path / "xla_dump"
    dump.mkdir()
    for name, text in modules.items():
        (dump / name).write_text(text)
    env = dict(os.environ, JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",
               XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false")
    r = subprocess.run([sys.executable, "-c", _CLUSTER_FLOPS, str(dump)],
                       capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    clusters = json.loads(r.stdout.strip().splitlines()[-1])
    assert clusters["compiled"] > 0
    cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"),
                      ["model.family=llama", "model.num_key_value_heads=2", "mesh.axes=fsdp=2",
                       "model.num_layers=1"])
    # The GEMM FLOPs are the per-device program's, whatever the collectives: "assumed"
    # skips the tiny DTensor steps that measure them (tests/plan/test_measured.py).
    p = plan(cfg, collectives="assumed")
    # The backward half of the step (input and weight gradients: 2/3 of its GEMM FLOPs)
    # exists only in the train step's clusters (the run's evaluation is forward only).
    # Over the 2 devices it equals what the plan computes for one device, times 2.
    assert clusters["backward_flops"] / 2 == pytest.approx(p.program["flops"] * 2 / 3,
                                                           rel=1e-9)


@pytest.mark.slow
def test_remat_policies_trade_temporaries_for_compute(bf16_plan):
    """XLA really keeps fewer activations under remat (it does not merge the recomputed
    forward back into the saved one), and the recomputation costs GEMMs."""
    base = bf16_plan
    full = plan(tiny(**{"precision.policy": "bfloat16", "model.remat": "full"}))
    assert full.identity["model"]["remat"] == "full" and "remat=full" in format_plan(full)
    assert full.memory.temp < base.memory.temp
    # The recomputed forward's GEMMs: more than the step's, at most one more forward
    # (a third of forward + backward) plus the attention GEMMs.
    assert base.program["flops"] < full.program["flops"] <= 1.4 * base.program["flops"]
