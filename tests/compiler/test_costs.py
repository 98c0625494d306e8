"""The cost report of the executed step (`tfllm.compiler.costs`, `tfllm.compiler.hlo_dump`).

* pure: collectives read from hand-made executed graphs (kinds, dtypes, element counts
  from `_output_shapes`, groups, loops, the busiest device); the HLO dump's module lookup;
* real, on the 8 logical CPU devices: `fsdp=8` through `tfllm train` (its merged gather
  holds every sharded parameter; costs.json), `data=8` (the merged gradient all-reduce
  holds every parameter), a collective inside a DTensor while loop, and one XLA program
  without a mesh (no collectives; FP8 GEMMs counted from XLA's dump, in a child process).
"""

import io
import json
import math
import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.experimental import dtensor

from tests.harness import run_in_child, tiny_config
from tfllm.data import feed
from tfllm.data import SyntheticTokens
from tfllm.parallel import make_parallel
from tfllm import internals
from tfllm.compiler import costs, hlo_dump
from tfllm.compiler.reports import FirstCall
from tfllm.train.loop import train
from tfllm.train.metrics import count_params
from tfllm.train.state import build_train_state

CPU = "/job:localhost/replica:0/task:0/device:CPU:"
# DTensor merges independent all-reduces into one buffer padded to a multiple of 1024
# elements (dtensor_allreduce_combine_optimization.cc, kAllReducePadding).
PADDING = 1024


def _padded(n):
    return math.ceil(n / PADDING) * PADDING


# ---- pure: hand-made executed graphs -----------------------------------------------------
def _node(graph, name, op, device, inputs=(), shape=None, dtype=None, value=None):
    node = graph.node.add(name=name, op=op, device=CPU + str(device), input=list(inputs))
    if shape is not None:
        dims = node.attr["_output_shapes"].list.shape.add()
        for size in shape:  # -1: unknown until run time
            dims.dim.add(size=size)
    if dtype is not None:
        node.attr["T"].type = dtype.as_datatype_enum
    if value is not None:
        node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, tf.int32))
    return node


def _collective(graph, name, op, device, source, group="g", shape=None, dtype=tf.float32):
    return _node(graph, name, op, device, [source, group, "key", "instance"], shape, dtype)


def _graph():
    g = graph_pb2.GraphDef()
    for d in (0, 1):
        _node(g, f"g{d}", "Const", d, value=2)
        _node(g, f"w{d}", "ReadVariableOp", d, shape=[64, 32])
        # A merged gather: DTensor names it after one of its parts.
        _collective(g, f"x/DTensorAllGatherOp_1_{d}", "CollectiveReduceV2", d, f"w{d}",
                    group=f"g{d}", shape=[64, 32])
        _node(g, f"h{d}", "Mul", d, shape=[8, 4])
        _collective(g, f"gather{d}", "CollectiveGatherV2", d, f"h{d}", group=f"g{d}",
                    shape=[16, 4], dtype=tf.bfloat16)
    # Device 1 only: an input with no shape attribute (an XLA cluster's output), the
    # collective's own output shape is read; and one whose shape is unknown until run time.
    _node(g, "run1", "_XlaRun", 1)
    _collective(g, "reduce1", "CollectiveReduceV2", 1, "run1:1", group="g1", shape=[10])
    _node(g, "dyn1", "Mul", 1, shape=[-1, 4])
    _collective(g, "dynamic1", "CollectiveAllToAllV2", 1, "dyn1", group="g1")
    _node(g, "c/xla_compile", "_XlaCompile", 1).attr["function"].func.name = "cluster_7"
    return g


def test_collectives_are_read_per_device_with_kind_dtype_elements_and_group():
    report = costs.report_from_graphs([_graph()])
    assert report.devices == ["CPU:0", "CPU:1"]
    assert report.device == "CPU:1"  # the busiest: two more collectives
    assert report.bytes_per_device == {"CPU:0": 64 * 32 * 4 + 16 * 4 * 2,
                                       "CPU:1": 64 * 32 * 4 + 16 * 4 * 2 + 10 * 4}
    merged, gather, reduce, dynamic = report.collectives
    assert (merged.kind, merged.dtype, merged.elements, merged.group_size,
            merged.dtensor_op) == ("all-reduce", "float32", 2048, 2, "all-gather")
    # An all-gather's buffer is its gathered output (16 x 4), bf16 = 2 bytes.
    assert (gather.kind, gather.elements, gather.bytes) == ("all-gather", 64, 128)
    assert reduce.elements == 10
    assert dynamic.kind == "all-to-all" and dynamic.elements is None
    assert report.largest is merged and report.clusters == 1
    # Ring estimate: an all-reduce sends 2 (n-1)/n of its buffer, a gather (n-1)/n.
    assert merged.sent_bytes == 2048 * 4 and gather.sent_bytes == 64
    assert [(t["kind"], t["dtype"], t["count"], t["unknown"]) for t in report.totals()] == [
        ("all-reduce", "float32", 2, 0), ("all-gather", "bfloat16", 1, 0),
        ("all-to-all", "float32", 1, 1)]
    text = "\n".join(report.lines())
    assert "4 collectives, 8.4 KB" in text and "1 of unknown size" in text
    assert "largest: all-reduce float32 of 2,048 elements (8.2 KB), group 2, DTensor " \
           "all-gather" in text
    assert "XLA: 1 clusters; FP8 GEMMs not measured" in text
    assert json.loads(json.dumps(report.as_dict()))["largest"]["elements"] == 2048


def test_a_collective_in_a_loop_frame_is_flagged_and_counted_once():
    g = graph_pb2.GraphDef()
    _node(g, "g", "Const", 0, value=4)
    _node(g, "x", "Mul", 0, shape=[3])
    _node(g, "enter", "Enter", 0, ["x"], shape=[3])
    _node(g, "merge", "Merge", 0, ["enter", "next"], shape=[3])
    _collective(g, "inside", "CollectiveReduceV2", 0, "merge", shape=[3])
    _node(g, "next", "NextIteration", 0, ["inside"], shape=[3])
    _node(g, "exit", "Exit", 0, ["merge"], shape=[3])
    _collective(g, "after", "CollectiveReduceV2", 0, "exit", shape=[3])
    report = costs.report_from_graphs([g])
    assert [(c.name, c.in_loop) for c in report.collectives] == [("inside", True),
                                                                 ("after", False)]
    assert "1 inside loops, counted once" in "\n".join(report.lines())


def test_without_a_mesh_there_is_nothing_to_report_but_the_program():
    report = costs.report_from_graphs([], mesh=False, whole_program=True,
                                      fp8_gemms={"full": 3, "half": 1, "none": 2})
    assert report.line() == ("costs: no collectives (no mesh); XLA: one program; "
                             "FP8 GEMMs: 3 full, 1 half of 6 dots")
    assert report.as_dict()["largest"] is None


# One dot of two FP8 operands, one with a single FP8 operand; both are live (fp8_hlo
# leaves out dots whose value nothing uses).
_HLO = """HloModule cluster_5, entry_computation_layout={()}

ENTRY %cluster_5 (x: f32[4,8], w: f32[8,2]) -> (bf16[4,2], bf16[4,2]) {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,2]{1,0} parameter(1)
  %xq = f8e4m3fn[4,8]{1,0} convert(%x)
  %xb = bf16[4,8]{1,0} convert(%xq)
  %wq = f8e4m3fn[8,2]{1,0} convert(%w)
  %wb = bf16[8,2]{1,0} convert(%wq)
  %wp = bf16[8,2]{1,0} convert(%w)
  %full = bf16[4,2]{1,0} dot(%xb, %wb), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %half = bf16[4,2]{1,0} dot(%xb, %wp), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %out = (bf16[4,2]{1,0}, bf16[4,2]{1,0}) tuple(%full, %half)
}
"""


def test_fp8_gemms_are_counted_in_the_named_programs_modules(tmp_path):
    for i, name in enumerate(["cluster_5__XlaCompiledKernel_true__XlaNumResourceArgs_1_.1",
                              "cluster_51__XlaCompiledKernel_true_.2",
                              "a_inference__train_step_42__XlaMustCompile_true_.3"]):
        (tmp_path / f"module_000{i}.{name}.before_optimizations.txt").write_text(_HLO)
    dump = hlo_dump.HloDump(str(tmp_path), owned=False, previous_flags=None)
    found = dump.modules(["cluster_5", "__inference__train_step_42", "cluster_9"], since=0)
    assert {k: len(v) for k, v in found.items()} == {
        "cluster_5": 1, "__inference__train_step_42": 1, "cluster_9": 0}
    counts, note = hlo_dump.fp8_gemms(dump, ["cluster_5", "cluster_51"], since=0)
    assert counts == {"full": 2, "half": 2, "none": 0} and note == ""
    counts, note = hlo_dump.fp8_gemms(dump, ["cluster_9"], since=0)
    assert counts is None and "dumped none" in note
    assert hlo_dump.fp8_gemms(None, ["cluster_5"], 0)[0] is None


def test_the_dump_request_is_undone_by_stop(monkeypatch, tmp_path):
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to={tmp_path}")
    dump = hlo_dump.start()
    try:
        assert dump.directory == str(tmp_path) and not dump.owned  # the user's: read only
    finally:
        hlo_dump.stop()
    assert tmp_path.exists() and hlo_dump.current() is None
    monkeypatch.delenv("XLA_FLAGS")
    dump = hlo_dump.start()
    try:
        assert os.environ["XLA_FLAGS"] == f"--xla_dump_to={dump.directory}"
    finally:
        hlo_dump.stop()
    assert "XLA_FLAGS" not in os.environ and not os.path.exists(dump.directory)


# ---- real steps on the 8 logical CPU devices ---------------------------------------------
def _sharded_elements(model):
    total = 0
    for v in model.trainable_variables:
        layout = dtensor.fetch_layout(v.value)
        if any(s != dtensor.UNSHARDED for s in layout.sharding_specs):
            total += int(np.prod(v.shape))
    return total


@pytest.mark.slow
def test_train_on_fsdp_reports_per_weight_gathers(tmp_path):
    # Graph mode (XLA on CPU is slow to compile; the collectives are the same, see
    # test_xla's reports): tfllm train prints the report and writes costs.json.
    cfg = tiny_config("llama", "fsdp=8", **{
        "train.steps": 1, "train.eval_steps": 1, "train.jit_compile": "false",
        "train.progress": "lines"})
    out = io.StringIO()
    train(cfg, str(tmp_path / "run"), out=out)
    saved = json.loads((tmp_path / "run" / "costs.json").read_text())
    from tfllm.models import build_model
    model = build_model(cfg.model, cfg.precision, cfg.lora,
                        parallel=make_parallel(cfg.mesh, cfg.model, cfg.optimizer))
    sharded = _sharded_elements(model)
    assert sharded == count_params(model) - 5 * cfg.model.hidden_dim  # all but the norms
    block = sum(int(np.prod(v.shape)) for v in model.blocks[0].trainable_variables)
    norms = 2 * cfg.model.hidden_dim  # a block's two norm scales: replicated, not gathered
    # Each block's sharded weights travel as one buffer (tfllm.parallel.blocks; before:
    # one gather per weight, and before that one zero-padded all-reduce of all sharded
    # parameters, 90,112 elements).
    largest = saved["largest"]
    assert (largest["kind"], largest["dtype"], largest["group_size"],
            largest["elements"]) == ("all-gather", "float32", 8, block - norms)
    gathers = [c for c in saved["collectives"] if c["kind"] == "all-gather"]
    # Forward and backward (re-gathered) for every sharded weight but the embedding table.
    assert sum(c["elements"] for c in gathers) == 2 * sharded - cfg.model.vocab_size * \
        cfg.model.hidden_dim
    assert saved["devices"] == 8 and len(set(saved["bytes_per_device"].values())) == 1
    assert saved["fp8_gemms"] is None and "jit_compile=false" in saved["fp8_note"]
    printed = out.getvalue()
    assert f"largest: all-gather float32 of {block - norms:,} elements" in printed
    assert "tfllm: costs: per step on CPU:0 (busiest of 8 device(s))" in printed


def _first_step(axes, jit, **extra):
    cfg = tiny_config("llama", axes or "data=1", **extra)
    parallel = None if axes is None else make_parallel(cfg.mesh, cfg.model, cfg.optimizer)
    step = build_train_state(cfg, parallel, jit).step
    data = SyntheticTokens(cfg.model.vocab_size, cfg.data.sequence_length + 1, seed=3)
    first = FirstCall(parallel, jit)  # the first step's report
    step(feed.to_device(step.parallel, data.batch(0, cfg.train.global_batch_size, 1)),
         reader=first)
    return step, first.report.costs


@pytest.mark.slow
def test_data_parallel_step_all_reduces_each_block_once():
    step, report = _first_step("data=8", False)
    # One all-reduce per block (tfllm.parallel.blocks: its gradients packed into one
    # float32 bucket), one for the embedding, one for the final norm and head together,
    # plus the loss's scalar mean: never one per weight, never the whole model at once.
    model = step.model
    size = lambda vs: sum(int(np.prod(v.shape)) for v in vs)  # noqa: E731
    sizes = sorted(c.elements for c in report.collectives)
    expected = ([size(b.trainable_variables) for b in model.blocks]
                + [size(model.token_embedding.trainable_variables),
                   size(model.final_norm.trainable_variables)
                   + size(model.lm_head.trainable_variables), 1])
    assert sizes == sorted(expected), [c.describe() for c in report.collectives]
    assert all(c.group_size == 8 and c.dtensor_op == "all-reduce" for c in report.collectives)
    assert report.clusters == 0 and report.fp8_gemms is None


def test_a_collective_inside_a_dtensor_while_loop_is_flagged():
    mesh = dtensor.create_mesh([("x", 2)], devices=[f"CPU:{i}" for i in range(2)])
    v = dtensor.call_with_layout(tf.ones, dtensor.Layout(["x"], mesh), shape=(8,))
    s = dtensor.call_with_layout(tf.zeros, dtensor.Layout.replicated(mesh, 0), shape=())

    @tf.function
    def f(v, s):
        def body(i, s):  # non-linear in the sum: DTensor cannot move it after the loop
            return i + 1, tf.sqrt(s + tf.reduce_sum(v * s + 1.0))
        _, s = tf.while_loop(lambda i, s: i < 3, body, (tf.constant(0), s))
        return s + tf.reduce_sum(v)

    with internals.collect_executed_graphs() as graphs:
        f(v, s)
    report = costs.report_from_graphs(graphs())
    assert sorted(c.in_loop for c in report.collectives) == [False, True]
    assert all(c.elements == 1 and c.group_size == 2 for c in report.collectives)


@pytest.mark.slow
def test_one_xla_program_without_a_mesh_has_no_collectives_and_counts_fp8_gemms(request):
    if not run_in_child(request):
        return
    hlo_dump.start()  # a fresh process: before XLA's first compilation
    try:
        step, report = _first_step(None, True, **{"precision.policy": "fp8"})
    finally:
        hlo_dump.stop()
    assert report.collectives == [] and not report.mesh and report.whole_program
    # 2 layers x 7 projections x 3 dots (forward, two gradients) with two FP8 operands
    # (before XLA's optimizations the count also holds the forward einsum that fp8.py's
    # gradient re-traces for its tape: 56 today); attention's own dots and the lm head
    # are not FP8.
    assert report.fp8_gemms["full"] >= 42 and report.fp8_gemms["half"] == 0
    assert report.fp8_gemms["none"] > 0
    assert "XLA: one program; FP8 GEMMs: " in report.line()
