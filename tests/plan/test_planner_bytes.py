"""The planner counts a fusion's operand by what the fusion reads of it (its slices), as
XLA's GPU performance model does: blocked attention's tiles slice their blocks out of
whole queries and gradients, and counting each such read whole over-counts their bytes."""

from tfllm.compiler import hlo_stats
from tfllm.plan import planner
from tfllm.compiler.targets import get_target

# One fusion reads rows 0..7 of a 64-row operand (through a transpose): 8 of 64 rows.
HLO = """HloModule sliced, entry_computation_layout={()}

%fused_slice (p0: bf16[64,32]) -> bf16[32,8] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %t = bf16[32,64]{1,0} transpose(%p0), dimensions={1,0}
  ROOT %s = bf16[32,8]{1,0} slice(%t), slice={[0:32], [0:8]}
}

ENTRY %main (x: bf16[64,32]) -> bf16[32,8] {
  %x = bf16[64,32]{1,0} parameter(0)
  ROOT %a = bf16[32,8]{1,0} fusion(%x), kind=kLoop, calls=%fused_slice
}
"""


def test_the_planner_counts_a_sliced_operand_by_its_slices(monkeypatch, tmp_path):
    desc = {"params": [], "num_params": 0, "fp8_projections": 0, "flops_per_token": 0,
            "tokens_per_step": 1}
    compiled = {"optimized_hlo": HLO, "compile_s": 0.0, "jax": "-",
                "memory": {"arguments": 0, "outputs": 0, "alias": 0, "temp": 0,
                           "generated_code": 0}}
    monkeypatch.setattr(planner, "export_in_child", lambda *a, **k: desc)
    monkeypatch.setattr(planner, "compile_in_child", lambda *a, **k: compiled)
    target = get_target("h100")
    from tests.harness import tiny_config
    result = planner.plan_program(tiny_config("gpt"), target, keep_dir=str(tmp_path))
    sliced = 2 * (8 * 32 + 32 * 8)  # bf16: the 8 rows read, the slice written
    assert result["bytes"] == sliced
    whole = hlo_stats.summarize(HLO, target)["bytes"]
    assert whole == 2 * (64 * 32 + 32 * 8) > result["bytes"]
    assert result["roofline_s"] == sliced / target.memory_bandwidth


def test_standard_attention_is_compiled_with_the_triton_softmax(monkeypatch, tmp_path):
    # gpt2-small's 1 x 2048 step moved 18% more bytes without the rewriter (a GPU on
    # XLA's defaults has it); blocked attention's compile is its slow case
    from tests.harness import tiny_config
    standard = tiny_config("gpt", **{"model.attention_chunk": 0})
    blocked = tiny_config("gpt", **{"model.attention_chunk": 8,
                                    "data.sequence_length": 32,
                                    "model.max_sequence_length": 32})
    assert planner.triton_softmax(standard) and not planner.triton_softmax(blocked)
    runs = []
    monkeypatch.setattr(planner.subprocess, "run", lambda cmd, **k: runs.append(cmd) or (
        _ for _ in ()).throw(RuntimeError("stop")))
    for config in (standard, blocked):
        try:
            planner.compile_in_child(str(tmp_path / "step.hlo.pb"), get_target("h100"),
                                     softmax=planner.triton_softmax(config))
        except RuntimeError:
            pass
    assert ["--triton-softmax" in cmd for cmd in runs] == [True, False]


def test_gpu_compile_turns_the_rewriter_off_unless_asked():
    from tfllm.plan import gpu_compile
    keep = gpu_compile.xla_flags("--xla_dump_to=x", ["gpu_compile", "s.pb", "--triton-softmax"])
    off = gpu_compile.xla_flags("", ["gpu_compile", "s.pb"])
    assert gpu_compile.NO_TRITON_SOFTMAX not in keep and keep.startswith("--xla_dump_to=x")
    assert gpu_compile.NO_TRITON_SOFTMAX in off
    assert all(f in keep and f in off for f in gpu_compile.PLAN_XLA_FLAGS)
