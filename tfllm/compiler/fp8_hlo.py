"""Which dots of an XLA program really multiply FP8 operands: a pure-Python HLO classifier.

XLA's GPU compiler turns a dot into a cuBLASLt FP8 GEMM only when BOTH operands are
`convert(f8)` (optionally times or divided by a scalar scale) inside the same module:
one operand arriving as a bf16 parameter of the module, even one that was dequantized
from FP8 in another module, gives a bf16 GEMM. So a test of "FP8 in effect" reads the
HLO each device executes and traces every dot operand back to its FP8 convert.

An operand is FP8 when, going back from the dot through

* reshape, transpose, copy, bitcast, broadcast, a convert between float types,
* multiply by (or divide by) a scalar: a value of one element, or a broadcast of one,
* the parameters of fused and called computations (to the caller's operands), fusion
  outputs (to the fused root) and tuples,

it reaches a `convert` from an f8 type (f8e4m3fn, f8e5m2, ...) or an f8-typed value
itself (the operands of a cuBLASLt FP8 custom call in an optimized GPU module). The
main input is the `*before_optimizations.txt` modules of an `--xla_dump_to` dump; the
same tracing reads optimized modules (fusions, `__cublas$lt$matmul$f8` calls).

That is a generous reading. XLA's GPU compiler is stricter (`MatchFp8Param`,
xla/service/gpu/transforms/gemm_rewriter.cc): going back from the dot, only reshape,
transpose, copy, bitcast, broadcast, slice, dynamic-slice, pad; then at most one
multiply (or divide) by a broadcast scalar; then the convert from f8, with nothing in
between: `convert(convert(f8) -> f32) -> bf16` is a bf16 GEMM on H100 (measured with the
deviceless H100 compile of `tfllm.plan.gpu_compile`). Each dot is read both ways
(`DotOperands.gpu`, "gpu_full").

Pure Python, no TensorFlow: the HLO text parser is `tfllm.compiler.hlo_stats`'s.
"""

from __future__ import annotations

import glob
import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from tfllm.compiler.hlo_stats import Computation, Instruction, arrays, parse_module

# Ops a dequantized value may pass through on its way to a dot, unchanged in value
# (layout and shape only).
_LAYOUT_OPS = {"reshape", "transpose", "copy", "bitcast", "broadcast"}
# The ops XLA's GPU GEMM rewriter lets stand between a dequantization and its dot
# (MatchFp8Param, xla/service/gpu/transforms/gemm_rewriter.cc; select left out).
_GPU_LAYOUT_OPS = {"reshape", "transpose", "copy", "bitcast", "broadcast", "slice",
                   "dynamic-slice", "pad"}
_FLOAT = re.compile(r"^(f8|f16|bf16|f32|f64)")
_MAX_DEPTH = 64  # HLO chains between a convert and its dot are a few ops long


@dataclass(frozen=True)
class DotOperands:
    """One dot (or convolution, or GEMM library call) and the FP8 type of each operand.

    Attributes:
      computation: the computation that holds it.
      name: the instruction's name.
      op_name: TensorFlow's op name from the metadata ("" when absent).
      lhs, rhs: the f8 type each operand is dequantized from (e.g. "f8e4m3fn"), or None.
      gpu: both operands match the pattern XLA's GPU compiler rewrites into a cuBLASLt
        FP8 GEMM (module docstring).
    """

    computation: str
    name: str
    op_name: str
    lhs: Optional[str]
    rhs: Optional[str]
    gpu: bool = False

    @property
    def kind(self) -> str:
        """"full" (both operands FP8), "half" (one) or "none"."""
        n = (self.lhs is not None) + (self.rhs is not None)
        return ("none", "half", "full")[n]


def _element_type(inst: Optional[Instruction]) -> str:
    parts = arrays(inst.type_text) if inst is not None else []
    return parts[0][0] if len(parts) == 1 else ""


def _elements(inst: Instruction) -> Optional[int]:
    parts = arrays(inst.type_text)
    if len(parts) != 1:
        return None
    n = 1
    for d in parts[0][1]:
        n *= d
    return n


def _called(attrs: str) -> List[str]:
    m = re.search(r"\b(?:calls|to_apply)=(%[^\s,]+)", attrs)
    return [m.group(1)[1:]] if m else []


def _is_gemm(inst: Instruction) -> bool:
    if inst.opcode in ("dot", "convolution"):
        return True
    if inst.opcode != "custom-call":
        return False
    target = re.search(r'custom_call_target="([^"]*)"', inst.attrs)
    return bool(target) and ("matmul" in target.group(1) or "gemm" in target.group(1))


class _Tracer:
    """Follows values back to FP8 converts across the computations of one module."""

    def __init__(self, comps: Dict[str, Computation], text: str):
        self.comps = comps
        # Instruction names are unique in a module; the shared parser keeps neither the
        # ROOT mark nor a parameter's number, so both are read from the text here.
        self.roots = set(re.findall(r"^\s*ROOT %(\S+) = ", text, re.M))
        self.param_index = {name: int(i) for name, i in
                            re.findall(r"^\s*(?:ROOT )?%(\S+) = [^\n]*? parameter\((\d+)\)",
                                       text, re.M)}
        # computation name -> [(caller computation, caller instruction)]
        self.callers: Dict[str, List[Tuple[Computation, Instruction]]] = {}
        for comp in comps.values():
            for inst in comp.instructions:
                if inst.opcode in ("fusion", "call"):
                    for name in _called(inst.attrs):
                        self.callers.setdefault(name, []).append((comp, inst))

    def operand(self, comp: Computation, inst: Instruction, i: int) -> Optional[Instruction]:
        return comp.by_name.get(inst.operands[i]) if i < len(inst.operands) else None

    def scalar(self, comp: Computation, inst: Optional[Instruction], depth: int = 0) -> bool:
        """A value with one element, or a broadcast (reshape, convert, ...) of one."""
        if inst is None or depth > _MAX_DEPTH:
            return False
        if _elements(inst) == 1:
            return True
        if inst.opcode in _LAYOUT_OPS or inst.opcode == "convert":
            return self.scalar(comp, self.operand(comp, inst, 0), depth + 1)
        return False

    def fp8_source(self, comp: Computation, inst: Optional[Instruction], strict: bool = False,
                   depth: int = 0, index: Optional[int] = None,
                   scaled: bool = False) -> Optional[str]:
        """The f8 type `inst` is dequantized from, or None.

        strict: only XLA's GPU pattern (module docstring). `index` selects a tuple element
        (get-tuple-element of a multi-output fusion); `scaled`: a strict walk has passed
        the scale multiply, so the convert must come next.
        """
        if inst is None or depth > _MAX_DEPTH:
            return None
        dtype = _element_type(inst)
        if dtype.startswith("f8"):
            return dtype
        op = inst.opcode

        def nxt(i, now_scaled=scaled):
            return self.fp8_source(comp, self.operand(comp, inst, i), strict, depth + 1,
                                   scaled=now_scaled)

        # Boundaries of fused and called computations: not ops, crossed in both modes.
        if op == "get-tuple-element":
            m = re.search(r"index=(\d+)", inst.attrs)
            source = self.operand(comp, inst, 0)
            return (self.fp8_source(comp, source, strict, depth + 1, int(m.group(1)), scaled)
                    if m else None)
        if op == "tuple":
            return nxt(index) if index is not None else None
        if op in ("fusion", "call"):
            sub = next((self.comps[n] for n in _called(inst.attrs) if n in self.comps), None)
            if sub is None:
                return None
            root = next((i for i in sub.instructions if i.name in self.roots), None)
            return self.fp8_source(sub, root, strict, depth + 1, index, scaled)
        if op == "parameter":
            number = self.param_index.get(inst.name)
            callers = self.callers.get(comp.name, [])
            if number is None or not callers:
                return None  # an argument of the module: not traceable inside it
            found = {self.fp8_source(c, self.operand(c, call, number), strict, depth + 1,
                                     scaled=scaled) for c, call in callers}
            return found.pop() if len(found) == 1 else None

        source = self.operand(comp, inst, 0)
        if op == "convert":
            if strict:  # the convert from f8 itself, nothing else
                return _element_type(source) if _element_type(source).startswith("f8") else None
            return nxt(0) if _FLOAT.match(dtype) and _FLOAT.match(_element_type(source)) else None
        if strict and scaled:
            return None
        if op in (_GPU_LAYOUT_OPS if strict else _LAYOUT_OPS):
            return nxt(0)
        if op in ("multiply", "divide") and len(inst.operands) == 2:
            operands = (source, self.operand(comp, inst, 1))
            scale = (lambda i: self.scale(comp, operands[i], strict))
            if scale(1):
                return nxt(0, True)
            if op == "multiply" and scale(0):
                return nxt(1, True)
        return None

    def scale(self, comp: Computation, inst: Optional[Instruction], strict: bool) -> bool:
        """A scalar scale: a broadcast of one element (strict), or any value of one element
        or layout op or convert of one."""
        if strict:
            return (inst is not None and inst.opcode == "broadcast"
                    and self.scalar(comp, self.operand(comp, inst, 0)))
        return self.scalar(comp, inst)


def _live(comp: Computation, roots) -> set:
    """Names of the instructions of `comp` its ROOT depends on."""
    root = next((i for i in comp.instructions if i.name in roots), None)
    live, stack = set(), [root.name] if root else []
    while stack:
        name = stack.pop()
        if name in live or name not in comp.by_name:
            continue
        live.add(name)
        stack.extend(comp.by_name[name].operands)
    return live


def classify_dots(hlo_text: str) -> List[DotOperands]:
    """Every live dot, convolution and GEMM library call of an HLO module, with its FP8
    operands.

    Dead dots (whose results the computation's ROOT does not depend on) are left out:
    modules before optimization still hold them, e.g. the forward einsum that a
    gradient tape records only to differentiate it, and XLA removes them.
    """
    comps = parse_module(hlo_text)
    tracer = _Tracer(comps, hlo_text)
    out = []
    for comp in comps.values():
        live = _live(comp, tracer.roots)
        for inst in comp.instructions:
            if not _is_gemm(inst) or len(inst.operands) < 2 or inst.name not in live:
                continue
            op_name = re.search(r'op_name="([^"]*)"', inst.attrs)
            lhs, rhs = (tracer.fp8_source(comp, tracer.operand(comp, inst, i)) for i in (0, 1))
            gpu = all(tracer.fp8_source(comp, tracer.operand(comp, inst, i), strict=True)
                      for i in (0, 1))
            out.append(DotOperands(comp.name, inst.name, op_name.group(1) if op_name else "",
                                   lhs, rhs, gpu))
    return out


def summarize(dots: Sequence[DotOperands]) -> dict:
    """{"full", "half", "none"} counts, the operand types of the FP8 dots, the half ones.

    "gpu_full" counts the dots XLA's GPU compiler can rewrite into FP8 GEMMs (both
    operands in its exact pattern; at most "full"); "pairs" counts the full dots by their
    operand types ("f8e4m3fn x f8e5m2", sorted); "half_ops" lists the op names of the
    half ones (for error messages).
    """
    kinds = Counter(d.kind for d in dots)
    pairs = Counter(" x ".join(sorted((d.lhs, d.rhs))) for d in dots if d.kind == "full")
    return {"full": kinds["full"], "half": kinds["half"], "none": kinds["none"],
            "gpu_full": sum(d.gpu for d in dots), "pairs": dict(pairs),
            "half_ops": [d.op_name or d.name for d in dots if d.kind == "half"]}


def fp8_dot_counts(hlo_text: str) -> dict:
    """Dots of one HLO module with both operands FP8 ("full"), one ("half"), none.

    Args:
      hlo_text: an HLO module's text (`*before_optimizations.txt`, or optimized).

    Returns:
      {"full": n, "half": m, "none": k, "gpu_full": g, "pairs": {types: n},
       "half_ops": [op names]}.
    """
    return summarize(classify_dots(hlo_text))


def dump_fp8_dot_counts(directory: str, devices: int = 1,
                        pattern: str = "*before_optimizations.txt") -> dict:
    """fp8_dot_counts summed over the modules of an `--xla_dump_to` directory, per device.

    On a DTensor mesh in one process every device compiles its own copy of each XLA
    cluster of the same SPMD program, and the dump does not say which device a module
    belongs to: the sums over all modules are divided by `devices` (an error when they
    do not divide, i.e. the devices did not compile the same program).

    Args:
      directory: the dump directory (of ONE program: dump each program to its own).
      devices: the devices of the mesh whose clusters are in the dump.
      pattern: which module files to read.

    Returns:
      fp8_dot_counts' dict per device, plus "modules" (files read, all devices).
    """
    paths = sorted(glob.glob(os.path.join(directory, pattern)))
    dots: List[DotOperands] = []
    for path in paths:
        with open(path) as f:
            dots.extend(classify_dots(f.read()))
    total = summarize(dots)
    out = {"modules": len(paths), "half_ops": total["half_ops"]}
    for key in ("full", "half", "none", "gpu_full"):
        if total[key] % devices:
            raise ValueError(f"{total[key]} {key} dots in {directory} do not divide over "
                             f"{devices} devices: were several programs dumped there?")
        out[key] = total[key] // devices
    out["pairs"] = {k: v // devices for k, v in total["pairs"].items()}
    return out
