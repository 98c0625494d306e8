"""The step time of a plan: the compiled program's roofline, corrected by named factors.

The roofline (`tfllm.compiler.hlo_stats`) prices every kernel at the target's peak FLOPs or
HBM bandwidth and nothing else: a lower bound. The estimate adds what a real step pays,
each factor a constant below with its source (also listed in
benchmarks/results/h100_plan.md):

* **GEMM efficiency**: cuBLAS reaches a fraction of the datasheet peak;
* **kernel launch gaps**: each kernel of the compiled program costs a few microseconds
  of launch and tail beyond its roofline time;
* **DTensor clusters**: on a sharded mesh TensorFlow runs many XLA clusters per device,
  split at every collective (README, "XLA on a DTensor mesh"), each dispatched by
  TensorFlow's executor;
* **NCCL by message size** (Hockney's alpha-beta model): each collective costs a latency
  plus its bytes at the link's bus bandwidth, so many small collectives cost more than
  one large one of the same bytes;
* **overlap**: the share of collective time hidden behind compute;
* **the AdamW update by the layout**: the per-device program is compiled without the
  mesh and updates every weight it computes with; on an FSDP (or ZeRO-1) layout a device
  updates only its shard.
"""

from __future__ import annotations

from typing import Optional

#: Fraction of the dense peak that cuBLAS reaches on large bf16/FP8 GEMMs on Hopper: NVIDIA
#: reports roughly 3/4 of peak for large square GEMMs ("New cuBLAS 12.0 Features and Matrix
#: Multiplication Performance on NVIDIA Hopper GPUs", NVIDIA technical blog, 2023); tile
#: quantization of small GEMMs costs more, not modelled.
GEMM_EFFICIENCY = 0.75
#: Seconds per kernel beyond its roofline time: launch latency and the tail of a kernel
#: before the next one starts on the same stream, "a few microseconds" per kernel in
#: NVIDIA's "Getting Started with CUDA Graphs" (technical blog, 2019), which measured the
#: launch overhead of short kernels without graphs; XLA on GPU does not use graphs for
#: TensorFlow's clusters.
KERNEL_GAP_S = 2e-6
#: Seconds TensorFlow's executor spends dispatching one XLA cluster (an `_XlaRun` op: look
#: up the compiled program, allocate its outputs, launch). No published figure: an
#: assumption of the order of TensorFlow's per-op overhead (tens of microseconds per op,
#: TensorFlow's performance guide, "Better performance with tf.function"), to be replaced
#: by a GPU measurement (benchmarks/gpu/).
CLUSTER_DISPATCH_S = 20e-6
#: NCCL's latency per collective on one node of 8 NVLink GPUs: nccl-tests' all_reduce_perf
#: times of small messages (8 B - 64 KiB) are flat at tens of microseconds there (NVIDIA
#: nccl-tests; reference tables such as docs.alayanew.com's "NCCL-tests in practice"); the
#: low end is taken.
NCCL_LATENCY_S = 15e-6
#: Collective time hidden behind compute: none today, because tfllm's FSDP orders every
#: gather behind a scalar all-reduce and the backward re-gather waits for its block's own
#: gradient (issue 35, items 1-2); raise it when the executed program overlaps.
OVERLAP = 0.0
#: Bytes one AdamW update moves per parameter: reads the float32 weight, gradient and two
#: moments and writes the weight and two moments (tfllm.optim: 7 x 4 bytes).
ADAMW_BYTES_PER_PARAM = 28


def adamw_seconds(params: float, memory_bandwidth: float) -> float:
    """HBM time of updating `params` parameters with AdamW."""
    return ADAMW_BYTES_PER_PARAM * params / memory_bandwidth


def step_time(result: dict, target, clusters: int = 1,
              collective_count: Optional[int] = None) -> dict:
    """The estimated step time of a plan and its parts (seconds).

    Args:
      result: the plan so far: `roofline_s`, `roofline_gemm_s`, `kernel_launches`,
        optional `collectives` ({bytes_per_device, link_bandwidth}) and
        `optimizer_update` ({program_s, layout_s}).
      target: the `tfllm.compiler.targets.Target`.
      clusters: XLA clusters the device runs per step (1: one program).
      collective_count: collectives per device per step.
    """
    gemm = result.get("roofline_gemm_s", 0.0)
    other = result["roofline_s"] - gemm
    update = result.get("optimizer_update") or {}
    # the no-mesh program updated every weight it computes with; the layout updates less
    other -= update.get("program_s", 0.0) - update.get("layout_s", 0.0)
    compute = gemm / GEMM_EFFICIENCY + other
    launches = result.get("kernel_launches", 0) * KERNEL_GAP_S
    dispatch = (clusters - 1) * CLUSTER_DISPATCH_S if clusters > 1 else 0.0
    c = result.get("collectives")
    comm = 0.0
    if c:
        comm = c["bytes_per_device"] / c["link_bandwidth"] + (collective_count or 0) * \
            NCCL_LATENCY_S
    exposed = comm * (1.0 - OVERLAP)
    return {"compute_s": compute, "gemm_s": gemm / GEMM_EFFICIENCY, "other_s": other,
            "launch_s": launches, "dispatch_s": dispatch, "collective_s": comm,
            "exposed_collective_s": exposed,
            "step_s": compute + launches + dispatch + exposed,
            "factors": {"gemm_efficiency": GEMM_EFFICIENCY, "kernel_gap_s": KERNEL_GAP_S,
                        "cluster_dispatch_s": CLUSTER_DISPATCH_S,
                        "nccl_latency_s": NCCL_LATENCY_S, "overlap": OVERLAP,
                        "clusters": clusters, "collectives": collective_count or 0}}
