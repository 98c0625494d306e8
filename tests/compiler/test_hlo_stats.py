"""Reading compiled HLO (pure text, no jax) and the target figures."""

import pytest

from tfllm.compiler import hlo_stats
from tfllm.compiler.targets import TARGETS, get_target

# A hand-written optimized module: one cuBLAS bf16 GEMM with its workspace, one FP8 GEMM,
# a loop fusion, and a while loop of 4 trips around a fusion holding a dot.
HLO = """HloModule step, entry_computation_layout={()}

%fused_dot (p0: f32[8,16], p1: f32[16,4]) -> f32[8,4] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (q0: bf16[32,64]) -> bf16[32,64] {
  %q0 = bf16[32,64]{1,0} parameter(0)
  ROOT %add.1 = bf16[32,64]{1,0} add(%q0, %q0)
}

%body (t: (s32[], f32[8,16], f32[16,4])) -> (s32[], f32[8,16], f32[16,4]) {
  %t = (s32[], f32[8,16]{1,0}, f32[16,4]{1,0}) parameter(0)
  %a = f32[8,16]{1,0} get-tuple-element(%t), index=1
  %b = f32[16,4]{1,0} get-tuple-element(%t), index=2
  %gemm_fusion = f32[8,4]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[8,16]{1,0}, f32[16,4]{1,0}) tuple(%i, %a, %b)
}

%cond (c: (s32[], f32[8,16], f32[16,4])) -> pred[] {
  %c = (s32[], f32[8,16]{1,0}, f32[16,4]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (x: bf16[32,64], w: bf16[64,128], x8: f8e4m3fn[32,64], w8: f8e4m3fn[128,64], s: f32[], l: (s32[], f32[8,16], f32[16,4])) -> bf16[32,128] {
  %x = bf16[32,64]{1,0} parameter(0)
  %w = bf16[64,128]{1,0} parameter(1)
  %x8 = f8e4m3fn[32,64]{1,0} parameter(2)
  %w8 = f8e4m3fn[128,64]{1,0} parameter(3)
  %s = f32[] parameter(4)
  %l = (s32[], f32[8,16]{1,0}, f32[16,4]{1,0}) parameter(5)
  %cublas-gemm.1 = (bf16[32,128]{1,0}, s8[1024]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %cublas-gemm.2 = (bf16[32,128]{1,0}, s8[1024]{0}) custom-call(%x8, %w8, %s, %s), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"]}}}
  %loop_fusion = bf16[32,64]{1,0} fusion(%x), kind=kLoop, calls=%fused_add
  %while = (s32[], f32[8,16]{1,0}, f32[16,4]{1,0}) while(%l), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %gte = bf16[32,128]{1,0} get-tuple-element(%cublas-gemm.1), index=0
  ROOT %bitcast = bf16[32,128]{1,0} bitcast(%gte)
}
"""


def test_kernels_gemms_bytes_and_loop_trips():
    ks, warnings = hlo_stats.kernels(HLO)
    assert warnings == []
    by_name = {k.name: k for k in ks}
    # parameters, get-tuple-element, bitcast, tuple and the while itself launch nothing
    assert set(by_name) == {"cublas-gemm.1", "cublas-gemm.2", "loop_fusion", "gemm_fusion"}
    gemm = by_name["cublas-gemm.1"]
    assert gemm.kind == "gemm" and gemm.gemm_flops == 2 * 32 * 128 * 64
    # operands (32x64 + 64x128 bf16) + result (32x128 bf16); the s8 workspace excluded
    assert gemm.bytes == 2 * (32 * 64 + 64 * 128 + 32 * 128)
    fp8 = by_name["cublas-gemm.2"]
    assert fp8.kind == "fp8_gemm" and fp8.operand_type == "f8e4m3fn"
    assert fp8.gemm_flops == 2 * 32 * 128 * 64
    assert by_name["loop_fusion"].kind == "fusion" and by_name["loop_fusion"].gemm_flops == 0
    assert by_name["loop_fusion"].bytes == 2 * 2 * 32 * 64
    inner = by_name["gemm_fusion"]  # a dot inside a fusion, in a loop body run 4 times
    assert inner.count == 4 and inner.gemm_flops == 2 * 8 * 4 * 16


def test_summary_counts_and_roofline():
    target = TARGETS["h100"]
    s = hlo_stats.summarize(HLO, target)
    assert s["gemm_calls"] == 2 and s["fp8_gemm_calls"] == 1
    assert s["gemm_targets"] == {"__cublas$lt$matmul": 1, "__cublas$lt$matmul$f8": 1}
    assert s["fusions"] == 2 and s["kernels"] == 4 and s["kernel_launches"] == 7
    assert s["flops"] == 2 * (2 * 32 * 128 * 64) + 4 * (2 * 8 * 4 * 16)
    # these tiny kernels are memory-bound: each takes bytes / bandwidth
    ks, _ = hlo_stats.kernels(HLO)
    expect = sum(k.count * max(k.gemm_flops / target.gemm_flops(k.operand_type),
                               k.bytes / target.memory_bandwidth) for k in ks)
    assert s["roofline_s"] == pytest.approx(expect)


def test_unknown_trip_count_is_counted_once_with_a_warning():
    text = HLO.replace(', backend_config={"known_trip_count":{"n":"4"}}', "")
    ks, warnings = hlo_stats.kernels(text)
    assert [k.count for k in ks if k.name == "gemm_fusion"] == [1]
    assert len(warnings) == 1 and "unknown trip count" in warnings[0]


def test_target_peaks_match_the_datasheets():
    h100 = get_target("H100")
    # NVIDIA H100 SXM datasheet, dense: 989.4 TFLOP/s bf16, 1978.9 FP8; XLA's spec rates
    # give these within 0.05% (its matrix-unit clock is rounded).
    assert h100.bf16_flops == pytest.approx(989.4e12, rel=5e-4)
    assert h100.fp8_flops == pytest.approx(1978.9e12, rel=5e-4)
    assert h100.gemm_flops("f8e5m2") == h100.fp8_flops
    assert h100.gemm_flops("bf16") == h100.bf16_flops
    assert get_target("a100").gemm_flops("f8e4m3fn") == 312e12  # no FP8 tensor cores
    assert "device_memory_size: 84942979072" in h100.target_config()
    with pytest.raises(ValueError, match="known targets: a100, b200, h100, h200"):
        get_target("v100")


# A fusion that reads rows 0..7 of a 64-row operand (through a transpose), and one that
# reads all of it: with partial_reads the first counts the rows it slices.
SLICED = """HloModule sliced, entry_computation_layout={()}

%fused_slice (p0: bf16[64,32]) -> bf16[32,8] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %t = bf16[32,64]{1,0} transpose(%p0), dimensions={1,0}
  ROOT %s = bf16[32,8]{1,0} slice(%t), slice={[0:32], [0:8]}
}

%fused_neg (q0: bf16[64,32]) -> bf16[64,32] {
  %q0 = bf16[64,32]{1,0} parameter(0)
  ROOT %n = bf16[64,32]{1,0} negate(%q0)
}

ENTRY %main (x: bf16[64,32]) -> (bf16[32,8], bf16[64,32]) {
  %x = bf16[64,32]{1,0} parameter(0)
  %a = bf16[32,8]{1,0} fusion(%x), kind=kLoop, calls=%fused_slice
  %b = bf16[64,32]{1,0} fusion(%x), kind=kLoop, calls=%fused_neg
  ROOT %r = (bf16[32,8]{1,0}, bf16[64,32]{1,0}) tuple(%a, %b)
}
"""


@pytest.mark.parametrize("partial_reads, sliced_read", [(False, 64 * 32), (True, 8 * 32)])
def test_a_fusion_that_slices_an_operand_reads_the_slice(partial_reads, sliced_read):
    by_name = {k.name: k for k in hlo_stats.kernels(SLICED, partial_reads)[0]}
    assert by_name["a"].bytes == 2 * (sliced_read + 32 * 8)  # read + written, bf16
    assert by_name["b"].bytes == 2 * 2 * 64 * 32  # negate reads all of its operand
