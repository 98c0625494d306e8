"""The first call of a compiled step, read: what XLA compiled and what the step costs.

A step computes; it does not report. Whoever runs it asks for the report of its first
call once, by handing the step a `FirstCall` for that call (`tfllm.train.loop`,
`tfllm bench`, `tfllm plan`'s measured collectives):

    first = FirstCall(parallel, jit_compile)
    metrics = step(batch, reader=first)  # the step calls first(compiled, args)
    first.report.xla, first.report.costs

The report is read from the graphs TensorFlow executed in that call (the first call
instantiates the programs, so only it can be read): `xla.XlaReport` (clusters per
device, the step's ops left outside XLA, checked by `xla.check_compiled`) and
`costs.CostReport` (every collective per device; the FP8 GEMMs of the programs XLA
compiled, from the HLO `hlo_dump` captured).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import tensorflow as tf

from tfllm import internals
from tfllm.compiler import costs, hlo_dump, xla


@dataclass
class StepReport:
    """What one compiled step's first call showed.

    Attributes:
      xla: what XLA compiled of it (None when `jit_compile` is off).
      costs: its collectives and FP8 GEMMs.
    """

    xla: Optional[xla.XlaReport]
    costs: costs.CostReport


class FirstCall:
    """Runs a compiled function's first call and reads what it executed (`report`).

    Args:
      parallel: the `tfllm.parallel.Parallel` the function runs on, or None (one device,
        one XLA program when compiled).
      jit_compile: whether the function is XLA-compiled.
    """

    def __init__(self, parallel, jit_compile: bool):
        self.parallel, self.jit_compile = parallel, jit_compile
        #: the `StepReport`, once the call has run
        self.report: Optional[StepReport] = None

    def __call__(self, compiled: Callable, args: tuple):
        """`compiled(*args)`, read; returns its outputs. Raises
        `xla.XlaNotCompiledError` when `jit_compile` is on but XLA left the step's core
        work outside its clusters."""
        since = time.time()
        with internals.collect_executed_graphs() as graphs:
            out = compiled(*args)
        self.report = read(compiled, args, graphs(), self.parallel, self.jit_compile, since)
        xla.check_compiled(self.report.xla)
        return out


def read(compiled, args: tuple, graph_defs, parallel, jit_compile: bool,
         since: float) -> StepReport:
    """The report of a call of `compiled(*args)` whose executed graphs were collected.

    Args:
      compiled: the `tf.function` that ran.
      args: its arguments (the traced function is looked up by them).
      graph_defs: the executed graphs (`tfllm.internals.collect_executed_graphs`).
      parallel: the mesh setup, or None.
      jit_compile: whether `compiled` is XLA-compiled.
      since: `time.time()` before the call: older HLO modules of the dump are not its own.
    """
    mesh = parallel is not None
    if not jit_compile:
        fp8, note = None, "no XLA: train.jit_compile=false"
    else:
        # FP8 GEMMs of the busiest device's clusters, or of the one program (no mesh).
        names = (costs.clusters_of(graph_defs).get(costs.busiest_device(graph_defs), [])
                 if mesh else [tf.compat.as_str(compiled.get_concrete_function(*args).name)])
        fp8, note = hlo_dump.fp8_gemms(hlo_dump.current(), names, since)
    return StepReport(
        xla=xla.report_of(compiled, args, graph_defs, parallel, jit_compile),
        costs=costs.report_from_graphs(graph_defs, mesh,
                                       whole_program=jit_compile and not mesh,
                                       fp8_gemms=fp8, fp8_note=note))
