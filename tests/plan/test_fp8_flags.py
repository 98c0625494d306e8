"""FP8 GEMMs on a GPU need XLA's Triton GEMM fusion off, and tfllm's commands turn it off.

On an H200 with XLA's default flags (2026-11-30, jax 0.11.2) tfllm's FP8 steps ran no FP8
GEMM at all (benchmarks/results/gpu_h200_2026-11-30.md). The deviceless compile for an
H100 reproduces it on this CPU: the same exported step, with and without the flags of
`tfllm.runtime.environment.POLICY_XLA_FLAGS`.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.harness import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_JAX = importlib.util.find_spec("jax") is not None

_COMPILE = """
import json, re, sys
from tfllm.compiler.targets import TARGETS
from tfllm.plan.gpu_compile import compile_for_target
hlo = open(sys.argv[1], "rb").read()
text = compile_for_target(hlo, TARGETS["h100"].target_config())["optimized_hlo"]
calls = re.findall(r'custom_call_target="([^"]+)"', text)
print(json.dumps({"fp8_gemms": calls.count("__cublas$lt$matmul$f8"),
                  "f8_values": len(re.findall(r"f8e4m3fn\\[", text))}))
"""


def test_the_commands_add_the_fp8_flags_and_keep_the_users():
    from tfllm.runtime import environment
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/d"}
    assert environment.precision_flags("bfloat16", env) == {}
    assert environment.precision_flags("fp8", env) == {
        "XLA_FLAGS": "--xla_dump_to=/tmp/d --xla_gpu_enable_triton_gemm=false"}
    assert environment.precision_flags("fp8", env) == {}  # once
    mine = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}
    assert environment.precision_flags("fp8", mine) == {}  # the user's value wins
    assert mine["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=true"
    assert environment.policy_xla_flags("fp8") == "--xla_gpu_enable_triton_gemm=false"


def test_an_fp8_command_sets_the_flag_before_it_builds_anything(monkeypatch, capsys):
    """`tfllm bench` (as `train`, `eval` and `generate`, through `_persist_compiles`): the
    flag is in XLA_FLAGS when the benchmark starts, so before anything compiles."""
    from tfllm.cli import main as cli
    import tfllm.train.bench as bench
    monkeypatch.setattr(bench, "benchmark",
                        lambda *a, **k: {"xla_flags": os.environ["XLA_FLAGS"]})
    seen = {}
    for policy in ("fp8", "bfloat16"):
        monkeypatch.setenv("XLA_FLAGS", "")  # restored after the test
        assert cli.main(["bench", "--config", os.path.join(ROOT, "configs/tiny.yaml"),
                         "--set", f"precision.policy={policy}"]) == 0
        seen[policy] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert seen["fp8"]["xla_flags"] == "--xla_gpu_enable_triton_gemm=false"
    assert seen["bfloat16"]["xla_flags"] == ""


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_JAX, reason="jax/jaxlib not installed (pip install -e '.[plan]')")
def test_fp8_gemms_survive_an_h100_compile_only_with_the_flags(tmp_path):
    from tfllm.plan.export_step import export_step
    from tfllm.runtime import environment
    export_step(tiny_config("llama", **{"precision.policy": "fp8", "model.num_layers": 1}),
                str(tmp_path), portable=False)
    counts = {}
    for name, flags in (("xla_defaults", ""), ("tfllm", environment.policy_xla_flags("fp8"))):
        # No autotuning: there is no device to run the candidates on (the planner's flag).
        env = dict(os.environ, JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",
                   XLA_FLAGS=f"--xla_gpu_autotune_level=0 {flags}".strip())
        r = subprocess.run([sys.executable, "-c", _COMPILE, str(tmp_path / "step.hlo.pb")],
                           capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        counts[name] = json.loads(r.stdout.strip().splitlines()[-1])
    # Every projection's three GEMMs (forward, input and weight gradients) in FP8 ...
    assert counts["tfllm"]["fp8_gemms"] > 0 and counts["tfllm"]["f8_values"] > 0
    # ... and with XLA's defaults none, and no FP8 value left in the program either.
    assert counts["xla_defaults"] == {"fp8_gemms": 0, "f8_values": 0}
