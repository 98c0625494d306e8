"""What one train step costs in communication, read from the graphs TensorFlow executed.

The parity tests prove the numbers; they cannot see that a sharded step gathers the whole
model. This report reads the post-optimization graphs of the step's first call (the same
graphs as `tfllm.compiler.xla.XlaReport`, with or without XLA: DTensor's collectives are
TensorFlow ops between XLA clusters, never inside them) and lists, per device, every
collective: its kind, dtype, element count and bytes.

Where the numbers come from:
* Element counts: TensorFlow's graph passes leave an `_output_shapes` attribute on the
  nodes of the executed graph (DTensor sets the local, per-device shapes). The report
  reads the collective's input from its producer's attribute, and its own output
  attribute when the producer has none (an `_XlaRun` feeding it); a dimension of -1
  (unknown until run time) leaves the count unknown rather than guessed. Checked against
  the model: `fsdp=8`'s merged gather holds every sharded parameter, `data=8`'s merged
  gradient all-reduce every parameter, both padded as below (tests/compiler/test_costs.py).
* "elements" is the collective's full buffer: the input of an all-reduce, reduce-scatter
  or all-to-all, the output of an all-gather; bytes are elements x the dtype's size.
  `sent_bytes` estimates what one device sends with ring algorithms: 2(n-1)/n of the
  buffer for an all-reduce, (n-1)/n for an all-gather, reduce-scatter or all-to-all.
* Loops: a collective inside a `while` loop (lowered to Enter/Exit frames in the executed
  graph) is counted once and flagged `in_loop`; the trip count is a run-time value and is
  not read. tfllm's train step has no loop (micro-batches are unrolled).
* DTensor lowers a gather to "zero-filled full tensor + slice update + all-reduce", then
  merges independent all-reduces of one group into one whose buffer is padded to a
  multiple of 1024 elements (`tensorflow/dtensor/mlir/utils/collective_lowering.cc`,
  `dtensor_allreduce_combine_optimization.cc`). `dtensor_op` names the DTensor op the
  collective's name carries (a merged one carries the name of one of its parts).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional

import tensorflow as tf

# TensorFlow's collective ops and the kind of communication each performs.
KINDS = {
    "CollectiveReduce": "all-reduce", "CollectiveReduceV2": "all-reduce",
    "CollectiveReduceV3": "all-reduce", "NcclAllReduce": "all-reduce",
    "CollectiveGather": "all-gather", "CollectiveGatherV2": "all-gather",
    "CollectiveReduceScatterV2": "reduce-scatter",
    "CollectiveAllToAllV2": "all-to-all", "CollectiveAllToAllV3": "all-to-all",
    "CollectiveBcastSend": "broadcast", "CollectiveBcastSendV2": "broadcast",
    "CollectiveBcastRecv": "broadcast-receive", "CollectiveBcastRecvV2": "broadcast-receive",
    "NcclReduce": "reduce", "NcclBroadcast": "broadcast",
}
# Fraction of the buffer one device sends under ring algorithms, times (n-1)/n.
_RING_FACTOR = {"all-reduce": 2, "all-gather": 1, "reduce-scatter": 1, "all-to-all": 1}
# DTensor names the collectives it inserts after its own op ("DTensorAllGatherOp_...").
_DTENSOR_OP = re.compile(r"DTensor(AllGather|AllReduce|ReduceScatter|AllToAll|AllScatter)Op")
_DTENSOR_KIND = {"AllGather": "all-gather", "AllReduce": "all-reduce",
                 "ReduceScatter": "reduce-scatter", "AllToAll": "all-to-all",
                 "AllScatter": "all-scatter"}


@dataclass(frozen=True)
class Collective:
    """One collective op of one device's executed program.

    Attributes:
      name: the op's name in the executed graph.
      op: its TensorFlow op type (CollectiveReduceV2, ...).
      kind: all-reduce, all-gather, reduce-scatter, all-to-all, broadcast, ...
      dtype: the element type sent ("float32").
      elements: elements of the full buffer (see the module docstring), None if unknown.
      itemsize: bytes per element.
      group_size: devices in its group, None if not a constant.
      dtensor_op: the DTensor op it implements by its name ("all-gather" for a gather
        lowered to an all-reduce), "" when the name carries none.
      in_loop: inside a while loop: counted once, whatever the trip count.
    """

    name: str
    op: str
    kind: str
    dtype: str
    elements: Optional[int]
    itemsize: int
    group_size: Optional[int] = None
    dtensor_op: str = ""
    in_loop: bool = False

    @property
    def bytes(self) -> int:
        return (self.elements or 0) * self.itemsize

    @property
    def sent_bytes(self) -> int:
        """Bytes one device sends, ring estimate (the whole buffer when the kind has none)."""
        n = self.group_size or 1
        factor = _RING_FACTOR.get(self.kind)
        if factor is None:
            return self.bytes if self.kind != "broadcast-receive" else 0
        return factor * self.bytes * (n - 1) // n

    def describe(self) -> str:
        size = "? elements" if self.elements is None else f"{self.elements:,} elements"
        extra = [f"group {self.group_size}"] if self.group_size else []
        if self.dtensor_op and self.dtensor_op != self.kind:
            extra.append(f"DTensor {self.dtensor_op}")
        if self.in_loop:
            extra.append("in a loop")
        return (f"{self.kind} {self.dtype} of {size} ({_size(self.bytes)})"
                + (f", {', '.join(extra)}" if extra else ""))

    def as_dict(self) -> dict:
        return {**asdict(self), "bytes": self.bytes, "sent_bytes": self.sent_bytes}


@dataclass
class CostReport:
    """The communication of one train step, per device, and what XLA compiled of it.

    Attributes:
      mesh: the step runs on a DTensor mesh (False: one device, no collectives).
      devices: the devices whose executed programs were read (this client's).
      device: the reported device: the one whose collectives move the most bytes.
      collectives: that device's collectives, in graph order.
      bytes_per_device: bytes of every device's collectives per step.
      clusters: XLA clusters in that device's program (0 when nothing is compiled).
      whole_program: the step is one XLA program (`jit_compile=True` without a mesh).
      fp8_gemms: {"full", "half", "none"}: the dots of that device's XLA modules with
        both, one or no operand dequantized from FP8 (`tfllm.compiler.fp8_hlo`), or None.
      fp8_note: why `fp8_gemms` is None, or what limits it.
    """

    mesh: bool = True
    devices: List[str] = field(default_factory=list)
    device: str = ""
    collectives: List[Collective] = field(default_factory=list)
    bytes_per_device: Dict[str, int] = field(default_factory=dict)
    clusters: int = 0
    whole_program: bool = False
    fp8_gemms: Optional[Dict[str, int]] = None
    fp8_note: str = ""

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.collectives)

    @property
    def sent_bytes(self) -> int:
        return sum(c.sent_bytes for c in self.collectives)

    @property
    def largest(self) -> Optional[Collective]:
        known = [c for c in self.collectives if c.elements is not None]
        return max(known, key=lambda c: c.bytes) if known else None

    def totals(self) -> List[dict]:
        """Per (kind, dtype): count, elements and bytes per step, largest bytes first."""
        groups: Dict[tuple, dict] = {}
        for c in self.collectives:
            t = groups.setdefault((c.kind, c.dtype), {"kind": c.kind, "dtype": c.dtype,
                                                      "count": 0, "elements": 0, "bytes": 0,
                                                      "unknown": 0})
            t["count"] += 1
            t["elements"] += c.elements or 0
            t["bytes"] += c.bytes
            t["unknown"] += c.elements is None
        return sorted(groups.values(), key=lambda t: (-t["bytes"], t["kind"], t["dtype"]))

    def _compiled(self) -> str:
        if not self.whole_program and not self.clusters:
            return "no XLA"
        xla = "XLA: one program" if self.whole_program else f"XLA: {self.clusters} clusters"
        g = self.fp8_gemms
        if g is None:
            return f"{xla}; FP8 GEMMs not measured ({self.fp8_note or 'no HLO'})"
        total = g["full"] + g["half"] + g["none"]
        return (f"{xla}; FP8 GEMMs: {g['full']} full, {g['half']} half of {total} dots"
                + (f" ({self.fp8_note})" if self.fp8_note else ""))

    def line(self) -> str:
        """One line: the busiest device's collectives, the largest, XLA and FP8."""
        if not self.collectives:
            where = "no mesh" if not self.mesh else f"{len(self.devices)} device(s)"
            return f"costs: no collectives ({where}); {self._compiled()}"
        largest = self.largest
        return (f"costs: {len(self.collectives)} collectives per step on {self.device} "
                f"(busiest of {len(self.devices)}), {_size(self.bytes)}; largest: "
                + (largest.describe() if largest else "sizes unknown")
                + f"; {self._compiled()}")

    def lines(self) -> List[str]:
        """A few lines for the progress output: totals per kind and dtype, the largest."""
        if not self.collectives:
            return [self.line()]
        out = [f"costs: per step on {self.device} (busiest of {len(self.devices)} "
               f"device(s)): {len(self.collectives)} collectives, {_size(self.bytes)} "
               f"(~{_size(self.sent_bytes)} sent, ring estimate)"]
        for t in self.totals():
            unknown = f", {t['unknown']} of unknown size" if t["unknown"] else ""
            out.append(f"costs:   {t['kind']} {t['dtype']}: {t['count']} x, "
                       f"{t['elements']:,} elements, {_size(t['bytes'])}{unknown}")
        largest = self.largest
        out.append("costs:   largest: " + (largest.describe() if largest else "unknown"))
        loops = sum(c.in_loop for c in self.collectives)
        if loops:
            out.append(f"costs:   {loops} inside loops, counted once (trip count not read)")
        out.append("costs: " + self._compiled())
        return out

    def as_dict(self) -> dict:
        largest = self.largest
        return {"mesh": self.mesh, "devices": len(self.devices), "device": self.device,
                "collectives_per_step": len(self.collectives),
                "bytes_per_step": self.bytes, "sent_bytes_per_step": self.sent_bytes,
                "totals": self.totals(),
                "largest": largest.as_dict() if largest else None,
                "bytes_per_device": dict(self.bytes_per_device),
                "clusters": self.clusters, "whole_program": self.whole_program,
                "fp8_gemms": self.fp8_gemms, "fp8_note": self.fp8_note,
                "collectives": [c.as_dict() for c in self.collectives]}


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def short_device(name: str) -> str:
    """'/job:localhost/replica:0/task:0/device:CPU:3' -> 'CPU:3'."""
    return name.split("/")[-1].replace("device:", "") if name else ""


def _device_order(name: str):
    kind, _, index = short_device(name).rpartition(":")
    return (kind, int(index) if index.isdigit() else 0, name)


def _elements(node, index: int = 0) -> Optional[int]:
    """Elements of output `index` of `node` from its `_output_shapes`, None if unknown."""
    shapes = node.attr["_output_shapes"].list.shape if "_output_shapes" in node.attr else []
    if index >= len(shapes) or shapes[index].unknown_rank:
        return None
    count = 1
    for dim in shapes[index].dim:
        if dim.size < 0:
            return None
        count *= dim.size
    return count


def _constant(nodes: dict, ref: str) -> Optional[int]:
    """The integer value of a scalar Const input (through Identity ops), else None."""
    for _ in range(8):
        node = nodes.get(ref.split(":")[0])
        if node is None:
            return None
        if node.op == "Const":
            value = tf.make_ndarray(node.attr["value"].tensor)
            return int(value) if value.size == 1 else None
        if node.op != "Identity" or not node.input:
            return None
        ref = node.input[0]
    return None


def _group_size(node, nodes: dict) -> Optional[int]:
    if "group_size" in node.attr:  # CollectiveReduce, CollectiveGather (V1)
        return node.attr["group_size"].i
    if "num_devices" in node.attr:  # Nccl ops
        return node.attr["num_devices"].i
    if node.op.endswith("V2"):  # (input, group_size, ...), a BcastRecv (group_size, ...)
        data = [i for i in node.input if not i.startswith("^")]
        position = 0 if node.op.startswith("CollectiveBcastRecv") else 1
        return _constant(nodes, data[position]) if len(data) > position else None
    return None


def _full_elements(node, nodes: dict, kind: str, group: Optional[int]) -> Optional[int]:
    data = [i for i in node.input if not i.startswith("^")]
    sent = None
    if data and kind != "broadcast-receive":
        name, _, index = data[0].partition(":")
        producer = nodes.get(name)
        sent = _elements(producer, int(index or 0)) if producer is not None else None
    received = _elements(node)
    if kind == "all-gather":  # the gathered output is the buffer
        return received if received is not None else (
            sent * group if sent is not None and group else None)
    if kind == "reduce-scatter":  # the input, before scattering
        return sent if sent is not None else (
            received * group if received is not None and group else None)
    return sent if sent is not None else received


def _loop_nodes(graph) -> set:
    """Names of the nodes inside while-loop frames: reachable from an Enter without
    passing an Exit (TensorFlow lowers functional loops to these frames before running)."""
    consumers = defaultdict(list)
    for node in graph.node:
        for i in node.input:
            consumers[i.lstrip("^").split(":")[0]].append(node)
    todo = [n for n in graph.node if n.op in ("Enter", "RefEnter")]
    inside = {n.name for n in todo}
    while todo:
        for consumer in consumers[todo.pop().name]:
            if consumer.name not in inside and consumer.op not in ("Exit", "RefExit"):
                inside.add(consumer.name)
                todo.append(consumer)
    return inside


def collectives_of(graph_defs: Iterable) -> Dict[str, List[Collective]]:
    """{device: [Collective]} of executed GraphDefs, in graph order.

    Args:
      graph_defs: post-optimization GraphDefs (`tfllm.internals.collect_executed_graphs`).
    """
    found: Dict[str, List[Collective]] = defaultdict(list)
    for graph in graph_defs:
        nodes = {n.name: n for n in graph.node}
        loops = None
        for node in graph.node:
            kind = KINDS.get(node.op)
            if kind is None:
                continue
            if loops is None:
                loops = _loop_nodes(graph)
            dtype = tf.dtypes.as_dtype(node.attr["T"].type) if "T" in node.attr else None
            group = _group_size(node, nodes)
            tag = _DTENSOR_OP.search(node.name)
            found[node.device].append(Collective(
                name=node.name, op=node.op, kind=kind,
                dtype=dtype.name if dtype is not None else "unknown",
                elements=_full_elements(node, nodes, kind, group),
                itemsize=dtype.size if dtype is not None else 0, group_size=group,
                dtensor_op=_DTENSOR_KIND[tag.group(1)] if tag else "",
                in_loop=node.name in loops))
    return dict(found)


def clusters_of(graph_defs: Iterable) -> Dict[str, List[str]]:
    """{device: [XLA cluster function names]} of executed GraphDefs.

    Args:
      graph_defs: post-optimization GraphDefs, whose `_XlaCompile` ops name the clusters.
    """
    found: Dict[str, List[str]] = defaultdict(list)
    for graph in graph_defs:
        for node in graph.node:
            if node.op == "_XlaCompile":
                found[node.device].append(node.attr["function"].func.name)
    return dict(found)


def _devices(graph_defs) -> List[str]:
    return sorted({n.device for g in graph_defs for n in g.node if n.device},
                  key=_device_order)


def _busiest(collectives: Dict[str, List[Collective]], devices: List[str]) -> str:
    bytes_of = {d: sum(c.bytes for c in cs) for d, cs in collectives.items()}
    # max() keeps the first of equals: the first device in order on a symmetric mesh.
    return max(devices, key=lambda d: bytes_of.get(d, 0)) if devices else ""


def busiest_device(graph_defs: Iterable) -> str:
    """The full name of the device whose collectives move the most bytes (ties: the
    first in device order), or of the first device with a program; "" when none.

    Args:
      graph_defs: post-optimization GraphDefs of one call.
    """
    graph_defs = list(graph_defs)
    return _busiest(collectives_of(graph_defs), _devices(graph_defs))


def report_from_graphs(graph_defs, mesh: bool = True, whole_program: bool = False,
                       fp8_gemms: Optional[Dict[str, int]] = None,
                       fp8_note: str = "") -> CostReport:
    """Builds a `CostReport` from the executed (post-optimization) GraphDefs of one call.

    Args:
      graph_defs: `tfllm.internals.collect_executed_graphs()` output.
      mesh: the function ran on a DTensor mesh.
      whole_program: it is one `jit_compile=True` program (no mesh).
      fp8_gemms: FP8 dot counts of the reported device's XLA modules, or None.
      fp8_note: why they are missing, or what limits them.
    """
    graph_defs = list(graph_defs)
    collectives, devices = collectives_of(graph_defs), _devices(graph_defs)
    device = _busiest(collectives, devices)
    return CostReport(
        mesh=mesh, devices=[short_device(d) for d in devices], device=short_device(device),
        collectives=collectives.get(device, []),
        bytes_per_device={short_device(d): sum(c.bytes for c in collectives.get(d, []))
                          for d in devices},
        clusters=len(clusters_of(graph_defs).get(device, [])), whole_program=whole_program,
        fp8_gemms=fp8_gemms, fp8_note=fp8_note)
