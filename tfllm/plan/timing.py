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
  TensorFlow's executor on the host. On a GPU the host runs ahead of the device
  (`exposed_dispatch_seconds`): a cluster is enqueued on the stream and its op returns
  before its kernels run, and only a collective makes the host wait for the device;
* **NCCL by message size** (Hockney's alpha-beta model): each collective costs a latency
  plus its bytes at the link's bus bandwidth, so many small collectives cost more than
  one large one of the same bytes;
* **overlap** (`exposed_collective_seconds`): FSDP's and data parallelism's collectives
  move block by block and are prefetched (tfllm/parallel/blocks.py: block i+1's weights
  are gathered when block i's input exists, a block's re-gather when the block after it
  starts its backward pass, its gradients reduced while the block before computes;
  tests/parallel/test_blocks.py checks that order in the executed graph), so each block's
  collectives run beside a neighbouring block's compute: only the first block's and what
  a block's collectives take beyond its compute are exposed. Tensor and sequence
  parallelism's collectives sit on the critical path: never hidden;
* **the AdamW update by the layout**: the per-device program is compiled without the
  mesh and updates every weight it computes with; on an FSDP (or ZeRO-1) layout a device
  updates only its shard.
"""

from __future__ import annotations

from typing import Optional

#: Fraction of the dense peak that GEMMs reach on Hopper, measured: an 8192-square bf16
#: GEMM compiled by XLA (jax 0.11.2) on the first lent H200 ran at 642-722 TFLOP/s in the
#: five runs of benchmarks/gpu/run_step.py, median 687 of the datasheet's 989.4
#: (benchmarks/results/gpu_h200_2026-11-30.json, `matmul_peak_tflops`; the H200's peak is
#: the H100's). It replaces the ~3/4 of NVIDIA's cuBLAS 12.0 blog (2023), which the plans
#: up to 2026-11-30 used. Tile quantization of small GEMMs costs more, not modelled.
GEMM_EFFICIENCY = 0.69
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
#: The share of a block's collectives that cannot run beside its neighbour's compute
#: (the first block's are exposed whole; see `exposed_collective_seconds`). 0: a
#: collective on its own stream (NCCL's, in TensorFlow's NcclManager and XLA) does not
#: slow the compute it overlaps; a GPU profile (`tfllm.train.profile`, overlapped_ms)
#: measures it when a GPU is lent.
OVERLAP_LOSS = 0.0
#: Bytes one AdamW update moves per parameter: reads the float32 weight, gradient and two
#: moments and writes the weight and two moments (tfllm.optim: 7 x 4 bytes).
ADAMW_BYTES_PER_PARAM = 28


def adamw_seconds(params: float, memory_bandwidth: float) -> float:
    """HBM time of updating `params` parameters with AdamW."""
    return ADAMW_BYTES_PER_PARAM * params / memory_bandwidth


def exposed_collective_seconds(comm: float, compute: float, blocks: int,
                               overlappable: bool) -> float:
    """The collective seconds a step waits for.

    With `blocks` blocks whose collectives (`comm` seconds in all) are prefetched one
    block ahead of `compute` seconds of work, block i's collectives run beside block
    i-1's compute (forward) or i+1's (backward): a step exposes the first block's share
    (nothing computes before it) and, for each other block, what its share takes beyond
    one block's compute. Collectives that are not prefetched (`overlappable` False:
    tensor or sequence parallelism, or no blocks) are all exposed.

    Args:
      comm: collective seconds per step.
      compute: compute seconds per step (kernels).
      blocks: the model's blocks (num_layers).
      overlappable: whether the mesh's collectives are the blocks' prefetched ones.
    """
    if not overlappable or blocks < 2 or comm <= 0:
        return comm
    c, k = comm / blocks, compute / blocks
    hidden_each = min(c, k) * (1.0 - OVERLAP_LOSS)
    return c + (blocks - 1) * (c - hidden_each)


def exposed_dispatch_seconds(dispatch: float, compute: float, comm: float, blocks: int,
                             overlappable: bool, waits: int) -> float:
    """The seconds of cluster dispatch the device waits for.

    On a GPU, TensorFlow's `_XlaRun` enqueues a cluster's program on the device's stream
    and returns (`RunAsync` in tensorflow/compiler/jit/kernels/xla_ops.cc; the host
    blocks only for outputs of dynamic shape, which tfllm's steps do not have), so the
    executor dispatches the next cluster while the device runs this one: the host runs
    ahead. A collective is different: NCCL's done callback runs when its kernel has
    finished (tensorflow/core/nccl/nccl_manager.cc), so the clusters that read its
    result are dispatched only then.

    * Prefetched blocks (`overlappable`): block i+1's clusters wait for its weights'
      gather, which runs beside block i's compute; once it is done the host dispatches
      them, still during block i. A block exposes what its gather plus its dispatch take
      beyond one block's compute (less what the gather alone already exposes), and the
      first block its whole dispatch (the device has nothing queued before it).
    * Collectives on the critical path (tensor or sequence parallelism) or no blocks:
      after each of the `waits` collectives the device waits for one cluster's dispatch,
      and any host time beyond the compute is exposed too.

    Assumes no device-to-host copy in the step between its clusters (one would drain
    the stream like a collective).

    Args:
      dispatch: host seconds to dispatch the step's clusters.
      compute: device compute seconds per step.
      comm: collective seconds per step.
      blocks: the model's blocks (num_layers).
      overlappable: whether the mesh's collectives are the blocks' prefetched ones.
      waits: collectives per step.
    """
    if dispatch <= 0:
        return 0.0
    if overlappable and blocks >= 2:
        h, c, k = dispatch / blocks, comm / blocks, compute / blocks
        beyond = max(0.0, c + h - k) - max(0.0, c - k)
        return min(dispatch, h + (blocks - 1) * beyond)
    return min(dispatch, waits * CLUSTER_DISPATCH_S + max(0.0, dispatch - compute))


def step_time(result: dict, target, clusters: int = 1,
              collective_count: Optional[int] = None) -> dict:
    """The estimated step time of a plan and its parts (seconds).

    Args:
      result: the plan so far: `roofline_s`, `roofline_gemm_s`, `kernel_launches`,
        optional `collectives` ({bytes_per_device, link_bandwidth}),
        `critical_collective_s` (the seconds of them on the critical path: expert
        parallelism's all-to-alls) and `optimizer_update` ({program_s, layout_s}).
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
    blocks, overlappable = result.get("blocks", 0), result.get("overlappable", False)
    # expert parallelism's all-to-alls wait on their layer's routing and its experts on
    # them: never prefetched, whatever the rest of the mesh's collectives allow
    critical = min(result.get("critical_collective_s", 0.0), comm)
    exposed = critical + exposed_collective_seconds(comm - critical, compute + launches,
                                                    blocks, overlappable)
    waited = exposed_dispatch_seconds(dispatch, compute + launches, comm, blocks,
                                      overlappable, collective_count or 0)
    return {"compute_s": compute, "gemm_s": gemm / GEMM_EFFICIENCY, "other_s": other,
            "launch_s": launches, "dispatch_s": dispatch, "exposed_dispatch_s": waited,
            "collective_s": comm, "exposed_collective_s": exposed,
            "critical_collective_s": critical,
            "step_s": compute + launches + waited + exposed,
            "factors": {"gemm_efficiency": GEMM_EFFICIENCY, "kernel_gap_s": KERNEL_GAP_S,
                        "cluster_dispatch_s": CLUSTER_DISPATCH_S,
                        "nccl_latency_s": NCCL_LATENCY_S, "overlap_loss": OVERLAP_LOSS,
                        "overlap": "prefetched by block" if result.get("overlappable")
                        else "none (collectives on the critical path)",
                        "clusters": clusters, "collectives": collective_count or 0}}
