"""What XLA compiled of a step, read from the programs TensorFlow really executes.

Steps are compiled in one place (`tfllm.compiler.jit.compile_fn`: XLA clusters of each
device's program on a DTensor mesh, strict compilation). This module reports what came
of it (`XlaReport`): the number of clusters per device and the step's ops that stayed
outside them, read from the executed graphs (`tfllm.internals.collect_executed_graphs`),
never from the flag that was passed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from tfllm import internals
from tfllm.compiler import costs

# Ops of the executed graph that are plumbing, not computation.
_PLUMBING = {"_Arg", "_Retval", "_DeviceArg", "_DeviceRetval", "Const", "NoOp", "Identity",
             "IdentityN", "_XlaCompile", "_XlaRun", "_XlaMerge", "Switch", "Merge",
             "StatefulPartitionedCall", "PartitionedCall", "_Send", "_Recv", "_HostSend",
             "_HostRecv", "Placeholder", "VarHandleOp"}

# Kinds of work the tests and `train.jit_compile=true` require to be inside XLA.
CORE_OPS = {
    "matmul": {"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"},
    "norm": {"Rsqrt", "Mean", "SquaredDifference"},
    "softmax": {"Softmax", "LogSoftmax", "SparseSoftmaxCrossEntropyWithLogits", "Exp"},
    "optimizer": {"Sqrt", "RealDiv", "AssignVariableOp", "AssignSubVariableOp"},
}


@dataclass
class XlaReport:
    """What XLA compiled of one function, read from the graphs TensorFlow executed.

    Attributes:
      devices: the devices whose programs were read.
      clusters: XLA clusters per device (the largest count over devices).
      outside: op type -> count per device of the function's own ops left outside XLA.
      communication: ops DTensor inserted (collectives, the reshapes and slices around
        them, ops its expansion rewrote), per device; they carry no XLA mark.
      marked_ops: ops of the traced function marked for XLA (the whole step).
      whole_program: compiled as one XLA program (`tf.function(jit_compile=True)`).
      examples: op type -> a few names of the ops left outside (for error messages).
    """

    devices: List[str] = field(default_factory=list)
    clusters: int = 0
    outside: Dict[str, int] = field(default_factory=dict)
    communication: int = 0
    marked_ops: int = 0
    whole_program: bool = False
    examples: Dict[str, List[str]] = field(default_factory=dict)

    @property
    def outside_count(self) -> int:
        return sum(self.outside.values())

    @property
    def fraction(self) -> float:
        """Share of the function's own ops inside XLA clusters (1.0 for a whole program)."""
        if self.whole_program:
            return 1.0
        if not self.marked_ops or not self.clusters:
            return 0.0
        return max(0.0, 1.0 - self.outside_count / self.marked_ops)

    def core_outside(self) -> Dict[str, List[str]]:
        """{kind: op types} of the matmul/norm/softmax/optimizer ops left outside XLA."""
        found = {}
        for kind, ops in CORE_OPS.items():
            hit = sorted(op for op in self.outside if op in ops)
            if hit:
                found[kind] = hit
        return found

    def line(self) -> str:
        """One line for the progress output."""
        if self.whole_program:
            return "XLA: one compiled program (no mesh)"
        if not self.clusters:
            return "XLA: nothing compiled"
        top = ", ".join(f"{n} {op}" for op, n in Counter(self.outside).most_common(4))
        return (f"XLA: {self.clusters} clusters per device on {len(self.devices)} "
                f"device(s), {100 * self.fraction:.0f}% of the step's {self.marked_ops} ops"
                + (f"; outside XLA: {top}" if top else "")
                + (f"; {self.communication} ops inserted by DTensor (collectives) between"
                   " clusters"
                   if self.communication else ""))

    def as_dict(self) -> dict:
        return {"clusters": self.clusters, "devices": len(self.devices),
                "fraction": round(self.fraction, 4), "marked_ops": self.marked_ops,
                "outside": dict(self.outside), "communication": self.communication}


def _device_coordinate_nodes(graph) -> set:
    """Names of the nodes computed from the device id and constants only.

    DTensor's SPMD expansion computes each device's mesh coordinates and shard offsets
    from the `device_id` argument (a Div, FloorMod, a small integer MatMul with a
    constant table, slices): plumbing of the layout, not the model's work, so it is not
    counted as left outside XLA (a real matmul reads the model's tensors).
    """
    inputs = {n.name: [i.split(":")[0] for i in n.input if not i.startswith("^")]
              for n in graph.node}
    found = {n.name for n in graph.node
             if n.op == "Const" or (n.op == "_Arg" and n.name.startswith("device_id"))}
    changed = True
    while changed:
        changed = False
        for name, ins in inputs.items():
            if name not in found and ins and all(i in found for i in ins):
                found.add(name)
                changed = True
    return {n.name for n in graph.node if n.op != "Const"} & found


def report_from_graphs(graph_defs, marked_ops: int) -> XlaReport:
    """Builds an `XlaReport` from executed (post-optimization) GraphDefs.

    Args:
      graph_defs: the post-optimization graphs of the function's instantiations.
      marked_ops: how many ops of the traced function were marked for XLA.
    """
    clusters: Counter = Counter()
    outside: Dict[str, Counter] = {}
    communication: Counter = Counter()
    examples: Dict[str, Dict[str, List[str]]] = {}
    for graph in graph_defs:
        coordinates = _device_coordinate_nodes(graph)
        for node in graph.node:
            device = node.device
            if node.name in coordinates:
                continue
            if node.op == "_XlaCompile":
                clusters[device] += 1
                continue
            if node.op in _PLUMBING:
                continue
            if node.op in costs.KINDS or internals.is_dtensor_op_name(node.name):
                communication[device] += 1
                continue
            outside.setdefault(device, Counter())[node.op] += 1
            names = examples.setdefault(device, {}).setdefault(node.op, [])
            if len(names) < 3:
                names.append(node.name)
    devices = sorted(set(clusters) | set(outside) | set(communication))
    if not devices:
        return XlaReport(marked_ops=marked_ops)
    # Report the device with the most ops left outside (every device runs the same program).
    worst = max(devices, key=lambda d: (sum(outside.get(d, Counter()).values()), d))
    return XlaReport(devices=[costs.short_device(d) for d in devices],
                     clusters=max(clusters.values()) if clusters else 0,
                     outside=dict(outside.get(worst, Counter())),
                     communication=max(communication.values()) if communication else 0,
                     marked_ops=marked_ops, examples=examples.get(worst, {}))


def count_marked_ops(concrete_function) -> int:
    """Ops of a traced function that carry the XLA clustering mark (computation only)."""
    count = 0
    for op in concrete_function.graph.get_operations():
        if op.type in _PLUMBING or op.type in ("ReadVariableOp",):
            continue
        try:
            if op.get_attr("_XlaCompile"):
                count += 1
        except ValueError:
            pass
    return count


def report_of(tf_fn, args, graph_defs, parallel, jit_compile: bool,
              **kwargs) -> Optional[XlaReport]:
    """What XLA compiled of a call of `tf_fn(*args, **kwargs)` whose executed graphs were
    collected (`internals.collect_executed_graphs`); None when `jit_compile` is off."""
    if not jit_compile:
        return None
    if parallel is None:
        return XlaReport(whole_program=True)
    concrete = tf_fn.get_concrete_function(*args, **kwargs)
    return report_from_graphs(graph_defs, count_marked_ops(concrete))


def run_and_report(tf_fn, args, parallel, jit_compile: bool, **kwargs):
    """Calls `tf_fn(*args, **kwargs)` for the first time; reports what XLA compiled of it.

    Returns:
      (the function's outputs, `XlaReport` or None when `jit_compile` is off).
    """
    if not jit_compile or parallel is None:
        return tf_fn(*args, **kwargs), report_of(tf_fn, args, [], parallel, jit_compile)
    with internals.collect_executed_graphs() as graphs:
        out = tf_fn(*args, **kwargs)
    return out, report_of(tf_fn, args, graphs(), parallel, jit_compile, **kwargs)


class XlaNotCompiledError(RuntimeError):
    """`train.jit_compile=true` but the step is not (or not wholly) compiled by XLA."""


def check_compiled(report: Optional[XlaReport], what: str = "the train step") -> None:
    """Raises when XLA compiled nothing, or left matmuls/norms/softmax/updates outside."""
    if report is None or report.whole_program:
        return
    if not report.clusters:
        raise XlaNotCompiledError(
            f"train.jit_compile=true but XLA compiled no part of {what}; set "
            "train.jit_compile=false (or auto) to run TensorFlow graphs instead.")
    core = report.core_outside()
    if core:
        listed = "; ".join(f"{k}: " + ", ".join(f"{op} (e.g. {report.examples.get(op, ['?'])[0]})"
                                                for op in v) for k, v in core.items())
        raise XlaNotCompiledError(
            f"train.jit_compile=true but XLA left these ops of {what} outside its clusters "
            f"({listed}). Set train.jit_compile=false, or report this with the model.")
