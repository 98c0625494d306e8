"""The FP8 dot classifier on hand-written HLO (no TensorFlow, no compilation)."""

import pytest

from tfllm.compiler.fp8_hlo import classify_dots, dump_fp8_dot_counts, fp8_dot_counts

# The shape of a `*before_optimizations.txt` cluster of tfllm's fp8 step: a forward dot on
# two dequantized operands (one through a reshape and a transpose, the scale a broadcast
# bf16 scalar), a backward dot whose E4M3 operand is a bf16 parameter of the module (the
# case a mesh used to produce), a dot whose E4M3 operand goes through float32 and a divide
# by a scalar, an FP8 operand times a full tensor (not a scale), a plain bf16 dot, and a
# dead dot (its result unused: left out, as XLA removes it).
BEFORE = """HloModule cluster_1, entry_computation_layout={()}

%max (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] maximum(%a, %b)
}

ENTRY %cluster_1 (x: f32[4,8], w: f32[8,2], s: f32[], xdq: bf16[4,8], g: bf16[4,2], t: bf16[4,8]) -> bf16[4,2] {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,2]{1,0} parameter(1)
  %s = f32[] parameter(2)
  %xdq = bf16[4,8]{1,0} parameter(3)
  %g = bf16[4,2]{1,0} parameter(4)
  %t = bf16[4,8]{1,0} parameter(5)
  %xq = f8e4m3fn[4,8]{1,0} convert(%x)
  %xb = bf16[4,8]{1,0} convert(%xq)
  %si = bf16[] convert(%s)
  %sb = bf16[4,8]{1,0} broadcast(%si), dimensions={}
  %xs = bf16[4,8]{1,0} multiply(%xb, %sb)
  %wq = f8e4m3fn[8,2]{1,0} convert(%w)
  %wb = bf16[8,2]{1,0} convert(%wq)
  %sb2 = bf16[8,2]{1,0} broadcast(%si), dimensions={}
  %ws = bf16[8,2]{1,0} multiply(%sb2, %wb)
  %wr = bf16[2,8]{1,0} reshape(%ws)
  %wt = bf16[8,2]{0,1} transpose(%wr), dimensions={1,0}
  %fwd = bf16[4,2]{1,0} dot(%xs, %wt), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_type="Einsum" op_name="q/einsum/Einsum"}
  %gq = f8e5m2[4,2]{1,0} convert(%g)
  %gb = bf16[4,2]{1,0} convert(%gq)
  %dw = bf16[8,2]{1,0} dot(%xdq, %gb), lhs_contracting_dims={0}, rhs_contracting_dims={0}, metadata={op_type="Einsum" op_name="grad/einsum/Einsum_1"}
  %x32 = f32[4,8]{1,0} convert(%xq)
  %sbc = f32[4,8]{1,0} broadcast(%s), dimensions={}
  %xd = f32[4,8]{1,0} divide(%x32, %sbc)
  %xd16 = bf16[4,8]{1,0} convert(%xd)
  %dw2 = bf16[8,2]{1,0} dot(%xd16, %gb), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %xt = bf16[4,8]{1,0} multiply(%xb, %t)
  %mixed = bf16[4,2]{1,0} dot(%xt, %wt), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %dead = bf16[4,2]{1,0} dot(%xs, %wt), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %plain = bf16[4,2]{1,0} dot(%t, %dw), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %out = (bf16[4,2]{1,0}, bf16[4,2]{1,0}, bf16[8,2]{1,0}, bf16[4,2]{1,0}) tuple(%fwd, %plain, %dw2, %mixed)
}
"""


def test_before_optimizations_dots():
    by_name = {d.name: d for d in classify_dots(BEFORE)}
    assert "dead" not in by_name
    assert (by_name["fwd"].lhs, by_name["fwd"].rhs) == ("f8e4m3fn", "f8e4m3fn")
    assert by_name["fwd"].op_name == "q/einsum/Einsum"
    assert (by_name["dw"].lhs, by_name["dw"].rhs) == (None, "f8e5m2")
    assert (by_name["dw2"].lhs, by_name["dw2"].rhs) == ("f8e4m3fn", "f8e5m2")
    # ... but XLA's GPU rewriter wants the f8 convert right under the scale multiply:
    # through float32 it is a bf16 GEMM on H100.
    assert by_name["fwd"].gpu and not by_name["dw2"].gpu and not by_name["dw"].gpu
    # times a tensor that is not a scalar scale: not a dequantization
    assert (by_name["mixed"].lhs, by_name["mixed"].rhs) == (None, "f8e4m3fn")
    assert by_name["plain"].kind == "none"  # a dot's output is no dequantization
    counts = fp8_dot_counts(BEFORE)
    assert {k: counts[k] for k in ("full", "half", "none", "gpu_full")} == {
        "full": 2, "half": 2, "none": 1, "gpu_full": 1}
    assert counts["pairs"] == {"f8e4m3fn x f8e4m3fn": 1, "f8e4m3fn x f8e5m2": 1}
    assert "grad/einsum/Einsum_1" in counts["half_ops"]


def test_integer_converts_and_plain_dots_are_not_fp8():
    text = """HloModule m

ENTRY %e (a: s8[2,2], b: f32[2,2]) -> f32[2,2] {
  %a = s8[2,2]{1,0} parameter(0)
  %b = f32[2,2]{1,0} parameter(1)
  %af = f32[2,2]{1,0} convert(%a)
  ROOT %d = f32[2,2]{1,0} dot(%af, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    counts = fp8_dot_counts(text)
    assert (counts["full"], counts["half"], counts["none"]) == (0, 0, 1)


# An optimized module: the dequantizing converts fused into loop fusions (one a
# multi-output fusion read through get-tuple-element), the dot inside a fusion of its
# own whose parameters lead back to the caller, and a cuBLASLt FP8 call on f8 operands.
OPTIMIZED = """HloModule m, is_scheduled=true

%deq (p0: f8e4m3fn[4,8], p1: f32[]) -> (bf16[4,8], f32[]) {
  %p0 = f8e4m3fn[4,8]{1,0} parameter(0)
  %c = bf16[4,8]{1,0} convert(%p0)
  %p1 = f32[] parameter(1)
  %cs = bf16[] convert(%p1)
  %b = bf16[4,8]{1,0} broadcast(%cs), dimensions={}
  %m = bf16[4,8]{1,0} multiply(%c, %b)
  ROOT %t = (bf16[4,8]{1,0}, f32[]) tuple(%m, %p1)
}

%deqw (q0: f8e5m2[8,2]) -> bf16[8,2] {
  %q0 = f8e5m2[8,2]{1,0} parameter(0)
  ROOT %c2 = bf16[8,2]{1,0} convert(%q0)
}

%gemm (r0: bf16[4,8], r1: bf16[8,2]) -> bf16[4,2] {
  %r0 = bf16[4,8]{1,0} parameter(0)
  %r1 = bf16[8,2]{1,0} parameter(1)
  ROOT %d = bf16[4,2]{1,0} dot(%r0, %r1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %e (x: f8e4m3fn[4,8], w: f8e5m2[8,2], s: f32[], w8: f8e4m3fn[2,8]) -> bf16[4,2] {
  %x = f8e4m3fn[4,8]{1,0} parameter(0)
  %w = f8e5m2[8,2]{1,0} parameter(1)
  %s = f32[] parameter(2)
  %w8 = f8e4m3fn[2,8]{1,0} parameter(3)
  %f1 = (bf16[4,8]{1,0}, f32[]) fusion(%x, %s), kind=kLoop, calls=%deq
  %g1 = bf16[4,8]{1,0} get-tuple-element(%f1), index=0
  %f2 = bf16[8,2]{1,0} fusion(%w), kind=kLoop, calls=%deqw
  %dot_fusion = bf16[4,2]{1,0} fusion(%g1, %f2), kind=kCustom, calls=%gemm
  %one = f32[] constant(1)
  ROOT %lt = (bf16[4,2]{1,0}, s8[1024]{0}) custom-call(%x, %w8, %one, %one), custom_call_target="__cublas$lt$matmul$f8"
}
"""


def test_optimized_module_fusions_and_cublaslt_calls():
    by_name = {d.name: d for d in classify_dots(OPTIMIZED)}
    assert set(by_name) == {"d", "lt"}
    assert (by_name["d"].lhs, by_name["d"].rhs) == ("f8e4m3fn", "f8e5m2")
    assert (by_name["lt"].lhs, by_name["lt"].rhs) == ("f8e4m3fn", "f8e4m3fn")
    assert by_name["d"].gpu and by_name["lt"].gpu


def test_dump_directory_counts_per_device(tmp_path):
    for i in range(2):  # two devices, each compiled the same cluster
        (tmp_path / f"module_000{i}.cluster_{i}.before_optimizations.txt").write_text(BEFORE)
    (tmp_path / "module_0000.cluster_0.cpu_after_optimizations.txt").write_text(OPTIMIZED)
    counts = dump_fp8_dot_counts(str(tmp_path), devices=2)
    assert (counts["full"], counts["half"], counts["none"], counts["gpu_full"],
            counts["modules"]) == (2, 2, 1, 1, 2)
    assert counts["pairs"] == {"f8e4m3fn x f8e4m3fn": 1, "f8e4m3fn x f8e5m2": 1}
    with pytest.raises(ValueError, match="do not divide over 4 devices"):
        dump_fp8_dot_counts(str(tmp_path), devices=4)


def test_strict_reading_wants_the_scale_right_over_the_convert():
    text = """HloModule m

ENTRY %e (a: f8e4m3fn[4,8], s: bf16[]) -> bf16[4,4] {
  %a = f8e4m3fn[4,8]{1,0} parameter(0)
  %s = bf16[] parameter(1)
  %c = bf16[4,8]{1,0} convert(%a)
  %r = bf16[4,8]{1,0} reshape(%c)
  %b = bf16[4,8]{1,0} broadcast(%s), dimensions={}
  %m = bf16[4,8]{1,0} multiply(%r, %b)
  %ok = bf16[4,8]{1,0} multiply(%b, %c)
  %t = bf16[8,4]{0,1} transpose(%ok), dimensions={1,0}
  ROOT %d = bf16[4,4]{1,0} dot(%m, %t), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    (dot,) = classify_dots(text)
    assert (dot.lhs, dot.rhs) == ("f8e4m3fn", "f8e4m3fn")  # generous: both
    assert not dot.gpu  # a reshape between the convert and its scale: not rewritten
