"""Read a compiled GPU program (optimized HLO text): kernels, GEMMs, bytes, a roofline time.

Pure Python, no TensorFlow or jax. The compile-only client has no cost analysis
(`GetCostAnalysis` is UNIMPLEMENTED there), so FLOPs and bytes are counted from the
optimized HLO here:

* a **kernel** is each instruction of the scheduled computations that launches work on the
  device: fusions, library calls (cuBLAS/cuBLASLt/cuDNN custom calls), copies and other
  unfused ops. Parameters, tuples, get-tuple-element, bitcasts and constants move no data.
  Computations called by `while` (trip count from `known_trip_count`), `call` and
  `conditional` are descended into; fused computations are not kernels of their own.
* a kernel's **bytes** are its operands' bytes plus its outputs' bytes (cuBLAS workspace
  buffers excluded): what it reads from and writes to device memory, assuming no reuse
  through the L2 cache. Fusions that read only a slice of an operand are over-counted,
  unless `partial_reads` is set: then a fusion operand that the fused computation only
  slices (through bitcasts, reshapes and transposes) counts the bytes of its slices.
* **GEMM FLOPs** are 2 * (output elements) * (contracted elements) of every cuBLAS call
  and of every `dot` inside a fusion.

The roofline time of a kernel is max(GEMM FLOPs / peak for its operand type, bytes /
memory bandwidth): each kernel bound by the slower of its math and its memory traffic,
kernels run one after the other (XLA's GPU runtime runs one stream by default), and no
launch overheads (XLA launches the step as CUDA graphs). It is a lower bound on the step
time: real GEMMs reach ~60-80% of peak and real kernels ~80% of bandwidth.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                 "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                 "c128": 16, "s4": 0.5, "u4": 0.5, "token": 0}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%(\S+) \(.*\) -> .* \{$")
_NO_WORK = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant",
            "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency"}
_CONTAINERS = {"while", "call", "conditional", "async-start", "async-done"}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")


def _element_bytes(dtype: str) -> float:
    if dtype.startswith("f8") or dtype.startswith("f4"):
        return 1 if dtype.startswith("f8") else 0.5
    return ELEMENT_BYTES.get(dtype, 4)


def arrays(type_text: str) -> List[Tuple[str, Tuple[int, ...]]]:
    """[(element type, dims)] of every array in an HLO type (tuples flattened)."""
    return [(t, tuple(int(d) for d in dims.split(",") if d))
            for t, dims in _ARRAY.findall(type_text) if t in ELEMENT_BYTES
            or t.startswith("f8") or t.startswith("f4")]


def type_bytes(type_text: str) -> float:
    return sum(math.prod(d) * _element_bytes(t) for t, d in arrays(type_text))


@dataclass
class Instruction:
    name: str
    type_text: str
    opcode: str
    operands: List[str]
    attrs: str
    number: Optional[int] = None  # a parameter's index


@dataclass
class Computation:
    name: str
    is_entry: bool
    instructions: List[Instruction] = field(default_factory=list)
    by_name: Dict[str, Instruction] = field(default_factory=dict)


def _split_balanced(text: str, start: int) -> int:
    """Index just past the bracket group that opens at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _parse_instruction(line: str) -> Optional[Instruction]:
    line = line.strip()
    if line.startswith("ROOT "):
        line = line[5:]
    m = re.match(r"%(\S+) = ", line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):  # tuple type
        end = _split_balanced(rest, 0)
    else:
        end = rest.index(" ")
        if "{" in rest[:end] and not rest[:end].endswith("}"):  # layout with spaces
            end = _split_balanced(rest, rest.index("{"))
    type_text, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([a-z][a-z0-9-]*)\(", rest)
    if not op:
        return None
    close = _split_balanced(rest, op.end() - 1)
    operand_text = rest[op.end():close - 1]
    operands = re.findall(r"%([^\s,()]+)", operand_text)
    number = int(operand_text) if op.group(1) == "parameter" else None
    return Instruction(m.group(1), type_text, op.group(1), operands, rest[close:], number)


def parse_module(text: str) -> Dict[str, Computation]:
    """{computation name: Computation} of an HLO module's text."""
    comps: Dict[str, Computation] = {}
    current = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = Computation(header.group(2), bool(header.group(1)))
            comps[current.name] = current
            continue
        if current is None:
            continue
        if line.startswith("}"):
            current = None
            continue
        inst = _parse_instruction(line)
        if inst:
            current.instructions.append(inst)
            current.by_name[inst.name] = inst
    return comps


@dataclass
class Kernel:
    """One launched kernel and its roofline inputs."""
    name: str
    kind: str  # "gemm", "fp8_gemm", "fusion", "collective", "copy", or the opcode
    target: str  # custom-call target or fusion kind
    gemm_flops: float
    bytes: float
    operand_type: str
    count: int  # how many times one step runs it (loop trip counts)
    op_name: str

    def seconds(self, target) -> float:
        math_s = self.gemm_flops / target.gemm_flops(self.operand_type) if self.gemm_flops else 0.0
        return max(math_s, self.bytes / target.memory_bandwidth) * self.count


def _called(attrs: str, key: str) -> List[str]:
    m = re.search(key + r"=\{?([^,}]+(?:, *%[^,}]+)*)\}?", attrs)
    return re.findall(r"%([^\s,}]+)", m.group(1)) if m else []


def _dot_flops(out_type: str, lhs_type: str, attrs: str) -> float:
    out = arrays(out_type)
    lhs = arrays(lhs_type)
    if not out or not lhs:
        return 0.0
    m = re.search(r'lhs_contracting_dim(?:ension)?s"?[:=]\s*[\[{]([^\]}]*)[\]}]', attrs)
    dims = [int(d) for d in re.findall(r"\d+", m.group(1))] if m else []
    contracted = math.prod(lhs[0][1][d] for d in dims) if dims else 1
    return 2.0 * math.prod(out[0][1]) * contracted


def _fusion_dot_flops(comps, name: str) -> float:
    comp = comps.get(name)
    if comp is None:
        return 0.0
    flops = 0.0
    for inst in comp.instructions:
        if inst.opcode == "dot" and inst.operands:
            lhs = comp.by_name.get(inst.operands[0])
            flops += _dot_flops(inst.type_text, lhs.type_text if lhs else "", inst.attrs)
        elif inst.opcode == "fusion":
            for sub in _called(inst.attrs, "calls"):
                flops += _fusion_dot_flops(comps, sub)
    return flops


def _trip_count(attrs: str) -> Optional[int]:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
    return int(m.group(1)) if m else None


_RELAYOUTS = {"bitcast", "reshape", "transpose", "copy"}


def _sliced_bytes(comp: Computation, number: int) -> Optional[float]:
    """Bytes a fused computation reads of its parameter `number` when it only slices it
    (through relayouts), else None (it reads all of it)."""
    param = next((i for i in comp.instructions
                  if i.opcode == "parameter" and i.number == number), None)
    if param is None:
        return None
    users: Dict[str, List[Instruction]] = {}
    for inst in comp.instructions:
        for o in inst.operands:
            users.setdefault(o, []).append(inst)
    total, frontier = 0.0, [param.name]
    while frontier:
        name = frontier.pop()
        for user in users.get(name, []):
            if user.opcode in _RELAYOUTS:
                frontier.append(user.name)
            elif user.opcode in ("slice", "dynamic-slice") and user.operands[0] == name:
                total += type_bytes(user.type_text)
            else:
                return None
    return total


def kernels(text: str, partial_reads: bool = False) -> Tuple[List[Kernel], List[str]]:
    """The kernels one step launches, and warnings (e.g. loops of unknown trip count).

    `partial_reads`: a fusion operand that the fusion only slices counts its slices'
    bytes, not the whole operand's.
    """
    comps = parse_module(text)
    entry = next((c for c in comps.values() if c.is_entry), None)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    out: List[Kernel] = []
    warnings: List[str] = []

    def operand_bytes(comp, inst):
        fused = _called(inst.attrs, "calls") if inst.opcode == "fusion" else []
        total = 0.0
        for number, o in enumerate(inst.operands):
            if o not in comp.by_name:
                continue
            full = type_bytes(comp.by_name[o].type_text)
            read = (_sliced_bytes(comps[fused[0]], number)
                    if partial_reads and fused and fused[0] in comps else None)
            total += full if read is None else min(full, read)
        return total

    def visit(comp: Computation, count: int):
        for inst in comp.instructions:
            if inst.opcode in _NO_WORK:
                continue
            if inst.opcode in _CONTAINERS:
                mult = count
                if inst.opcode == "while":
                    trips = _trip_count(inst.attrs)
                    if trips is None:
                        warnings.append(f"{inst.name}: loop of unknown trip count, counted once")
                    mult = count * (trips or 1)
                    called = _called(inst.attrs, "body") + _called(inst.attrs, "condition")
                else:
                    called = (_called(inst.attrs, "to_apply") + _called(inst.attrs, "calls")
                              + _called(inst.attrs, "branch_computations"))
                for name in called:
                    if name in comps:
                        visit(comps[name], mult)
                continue
            op_name = re.search(r'op_name="([^"]*)"', inst.attrs)
            op_name = op_name.group(1) if op_name else ""
            lhs = comp.by_name.get(inst.operands[0]) if inst.operands else None
            lhs_type = arrays(lhs.type_text)[0][0] if lhs and arrays(lhs.type_text) else ""
            out_bytes = type_bytes(inst.type_text)
            flops, kind, target = 0.0, inst.opcode, ""
            if inst.opcode == "custom-call":
                target = re.search(r'custom_call_target="([^"]*)"', inst.attrs).group(1)
                if "cublas" in target or "gemm" in target:
                    kind = "fp8_gemm" if "f8" in target else "gemm"
                    results = arrays(inst.type_text)
                    flops = _dot_flops(inst.type_text, lhs.type_text if lhs else "",
                                       inst.attrs)
                    # the trailing s8 buffer of a cuBLAS call is its workspace
                    if len(results) > 1 and results[-1][0] == "s8":
                        out_bytes -= math.prod(results[-1][1])
            elif inst.opcode == "fusion":
                kind_attr = re.search(r"kind=(\w+)", inst.attrs)
                target = kind_attr.group(1) if kind_attr else ""
                for name in _called(inst.attrs, "calls"):
                    flops += _fusion_dot_flops(comps, name)
                kind = "gemm_fusion" if flops else "fusion"
            elif inst.opcode.startswith(COLLECTIVES):
                kind = "collective"
            elif inst.opcode == "dot":
                flops = _dot_flops(inst.type_text, lhs.type_text if lhs else "", inst.attrs)
                kind = "gemm"
            out.append(Kernel(inst.name, kind, target, flops,
                              operand_bytes(comp, inst) + out_bytes, lhs_type, count, op_name))

    visit(entry, 1)
    return out, warnings


def summarize(text: str, target, partial_reads: bool = False) -> dict:
    """Counts, FLOPs, bytes and the roofline time of one compiled step for `target`
    (`partial_reads`: as in `kernels`)."""
    ks, warnings = kernels(text, partial_reads)
    calls = re.findall(r'custom_call_target="([^"]+)"', text)
    gemm_targets = sorted({c for c in calls if "cublas" in c})
    gemm_s = sum(k.seconds(target) for k in ks if k.gemm_flops)
    total_s = sum(k.seconds(target) for k in ks)
    by_op: Dict[str, float] = {}
    for k in ks:
        by_op[k.kind] = by_op.get(k.kind, 0.0) + k.seconds(target)
    top = sorted(ks, key=lambda k: -k.seconds(target))[:10]
    return {
        "gemm_calls": sum(calls.count(t) for t in gemm_targets),
        "gemm_targets": {t: calls.count(t) for t in gemm_targets},
        "fp8_gemm_calls": calls.count("__cublas$lt$matmul$f8"),
        "fusions": sum(1 for k in ks if k.kind in ("fusion", "gemm_fusion")),
        "kernels": len(ks),
        "kernel_launches": sum(k.count for k in ks),
        "flops": sum(k.gemm_flops * k.count for k in ks),
        "fp8_flops": sum(k.gemm_flops * k.count for k in ks if k.kind == "fp8_gemm"),
        "bytes": sum(k.bytes * k.count for k in ks),
        "roofline_s": total_s,
        "roofline_gemm_s": gemm_s,
        "roofline_by_kind_s": by_op,
        "top_kernels": [{"name": k.name, "kind": k.kind, "op": k.op_name[-80:],
                         "ms": 1e3 * k.seconds(target)} for k in top],
        "warnings": warnings,
    }
