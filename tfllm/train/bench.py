"""`tfllm bench`: time the compiled train step of a config; report medians and MFU."""

from __future__ import annotations

import statistics
import time

from tfllm.compiler import hlo_dump
from tfllm.compiler.reports import FirstCall
from tfllm.train.metrics import count_params, flops_per_token, mesh_peak


def benchmark(config, steps: int = 20, warmup: int = 3, repeats: int = 1) -> dict:
    """Runs `warmup` untimed steps, then `steps` timed steps, `repeats` times.

    Returns:
      tokens_per_s and step_ms from the median step time over all timed steps, params,
      flops_per_token, peak_flops and peak_source (`tfllm.train.metrics.mesh_peak`: a
      datasheet figure for known GPUs, else matmuls timed in this run; on CPU None and
      why), mfu (unclamped: above 1 it also logs a warning; None on CPU), what XLA
      compiled ("xla") and the step's cost report ("costs", `CostReport.as_dict()`).
    """
    import copy
    from tfllm.train.run import Run
    config = copy.deepcopy(config)
    config.data.source = "synthetic"  # the step is timed, not the input pipeline
    run = Run(config, capture_hlo=True)
    t = config.train
    tokens_per_step = t.global_batch_size * config.data.sequence_length
    batches = [run.feed.train_batch(i) for i in range(4)]  # input preparation is not timed
    started = time.perf_counter()
    first = FirstCall(run.parallel, run.jit_compile)  # reads what XLA compiled, the costs
    run.step(batches[0], reader=first)  # the first call traces and compiles
    first_step_s = time.perf_counter() - started
    hlo_dump.stop()  # the cost report has read it
    for i in range(1, warmup):
        run.step(batches[i % len(batches)])
    times = []
    for _ in range(repeats):
        for i in range(steps):
            start = time.perf_counter()
            run.step(batches[i % len(batches)])  # returns numpy: synchronizes the devices
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    fpt = flops_per_token(config.model, config.data.sequence_length, config.lora)
    peak = mesh_peak(run.parallel, config.precision.policy, config.precision.tf32)
    tokens_per_s = tokens_per_step / step_s
    mfu = peak.mfu(tokens_per_s, fpt)  # as `tfllm train`'s progress computes it
    return {
        "tokens_per_s": round(tokens_per_s, 1),
        "step_ms": round(step_s * 1000, 2),
        "params": count_params(run.model),
        "flops_per_token": fpt,
        "peak_flops": round(peak.flops, 1) if peak.flops else None,
        "peak_source": peak.source,
        "mfu": round(mfu, 4) if mfu is not None else None,
        "jit_compile": run.jit_compile,
        "first_step_s": round(first_step_s, 2),
        "xla": first.report.xla.as_dict() if first.report.xla else None,
        "costs": first.report.costs.as_dict(),
        "precision": config.precision.policy,
        "mesh": config.mesh.axes,
        "steps": steps * repeats,
    }
