"""Throughput accounting: FLOPs per token, the peak, MFU, tokens/s.

The one owner of what MFU means: `tfllm train` and `tfllm bench` both divide the model
FLOPs they achieve by `mesh_peak`, so the same run reports the same figure. The peak is
a GPU's datasheet figure where tfllm knows the GPU, else a matmul timed on the device;
a timed peak is raised to the step's own rate if the step beats it, so MFU is at most 1.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import tensorflow as tf

from tfllm.compiler.targets import TARGETS


def count_params(model) -> int:
    """Trainable parameters (FP8 amax histories and other state excluded)."""
    return int(sum(math.prod(int(d) for d in v.shape) for v in model.trainable_variables))


def flops_per_token(model_config, sequence_length: int) -> int:
    """Training FLOPs per token: 3x the forward pass (forward + backward).

    Forward = 2 FLOPs per multiply-accumulate over every matmul weight (attention
    projections, MLP, LM head; embedding lookups are free) plus the attention score and
    value matmuls, 2 * 2 * T * H * D per layer, counted in full as PaLM and MaxText do.
    """
    c = model_config
    heads = c.num_query_heads
    kv = c.num_key_value_heads or heads
    head_dim = c.head_dim or c.hidden_dim // heads
    E, F, L, V, T = c.hidden_dim, c.intermediate_dim, c.num_layers, c.vocab_size, sequence_length
    mlp_matrices = 2 if c.family == "gpt" else 3
    per_layer = E * heads * head_dim * 2 + E * kv * head_dim * 2 + mlp_matrices * E * F
    forward = 2 * (L * per_layer + E * V) + L * 2 * 2 * T * heads * head_dim
    return 3 * forward


def measure_matmul_peak(n: int = 2048, repeats: int = 10, dtype=tf.float32,
                        chain: int = 8) -> float:
    """FLOP/s of n x n x n matmuls on the default device (median of `repeats`).

    Each timed call runs `chain` dependent matmuls on the device and returns one element:
    copying an n x n result to the host inside the timed call would time the copy (on a
    GPU, 16 MiB over PCIe takes longer than the matmul) and understate the peak.
    """
    a = tf.random.stateless_normal((n, n), seed=(1, 2), dtype=dtype)
    # Scaled by 1/sqrt(n) so that the chained products keep unit-size entries.
    b = tf.random.stateless_normal((n, n), seed=(3, 4), dtype=dtype) * (n ** -0.5)

    @tf.function
    def chained(x, y):
        for _ in range(chain):
            x = tf.matmul(x, y)
        return x[0, 0]

    float(chained(a, b))  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        float(chained(a, b))
        times.append(time.perf_counter() - start)
    return 2.0 * n ** 3 * chain / statistics.median(times)


def peak_dtype(precision_policy: str):
    """The matmul dtype whose peak MFU is measured against: float32 runs against the
    float32 peak, every mixed policy (bf16, fp16, fp8) against the dense bf16 peak."""
    return tf.float32 if precision_policy == "float32" else tf.bfloat16


# GPU names (as TensorFlow's device details give them) whose datasheet peaks tfllm knows,
# as (substring, substrings that must also be there or None, substrings that exclude,
# target). PCIe and NVL boards of the H100/H200 have lower clocks and peaks than the
# SXM parts of `tfllm.compiler.targets`; they are measured instead.
_DATASHEET_GPUS = (("H100", ("HBM3", "SXM"), ("PCIE", "NVL"), "h100"),
                   ("H200", None, ("NVL",), "h200"),
                   ("B200", None, (), "b200"),
                   ("A100", None, (), "a100"))


def datasheet_peak(device_name: str, precision_policy: str,
                   tf32: bool = True) -> Optional[Tuple[float, str]]:
    """One GPU's dense tensor-core peak for the policy, from `tfllm.compiler.targets`.

    Returns (FLOP/s, description) or None when the GPU is not in the table, or when a
    float32 run has TF32 off (IEEE float32 GEMMs do not use the tensor cores).

    Args:
      device_name: e.g. "NVIDIA H100 80GB HBM3".
      precision_policy: the config's precision.policy; fp8 counts against the bf16 peak,
        as MaxText and torchtitan report it.
      tf32: precision.tf32.
    """
    name = device_name.upper()
    for key, need, exclude, target in _DATASHEET_GPUS:
        if key not in name or any(x in name for x in exclude):
            continue
        if need and not any(x in name for x in need):
            continue
        t = TARGETS[target]
        if precision_policy == "float32":
            return (t.tf32_flops, f"datasheet: {device_name}, dense TF32") if tf32 else None
        return t.bf16_flops, f"datasheet: {device_name}, dense bf16"
    return None


@dataclass
class Peak:
    """The peak MFU is measured against.

    Args:
      flops: FLOP/s of the whole mesh.
      source: where it comes from ("datasheet: ..." or "measured: ...").
      measured: whether it was timed in this process (a timed peak can be lower than
        what the step itself reaches: on CPU the step's fused kernels and threads can beat
        one matmul; a datasheet peak is never raised).
    """

    flops: float
    source: str
    measured: bool = True

    def observe(self, achieved_flops: float) -> None:
        """Raises a measured peak to a rate the step itself reached, so that MFU never
        exceeds 100%."""
        if self.measured and achieved_flops > self.flops:
            self.flops = achieved_flops
            if "raised" not in self.source:
                self.source += "; raised to the step's own rate"


def gpu_name(device: str) -> str:
    """TensorFlow's name of the physical GPU behind a logical device string ('' if none)."""
    index = int(device.rsplit(":", 1)[-1])
    gpus = tf.config.list_physical_devices("GPU")
    if index >= len(gpus):
        return ""
    return tf.config.experimental.get_device_details(gpus[index]).get("device_name", "")


def mesh_peak(parallel, precision_policy: str, tf32: bool = True, measure=None,
              device_name=None) -> Peak:
    """The whole mesh's matmul peak.

    On GPUs whose name `datasheet_peak` knows, the datasheet's dense peak per GPU times
    the mesh's GPUs; otherwise a matmul timed on one local device (`measure_matmul_peak`).
    Logical CPU devices share the host's cores, so on CPU one device's peak is the whole
    host's; on GPU every device of every client counts.

    Args:
      parallel: the run's `tfllm.parallel.Parallel`.
      precision_policy: the config's precision.policy.
      tf32: the config's precision.tf32.
      measure: the measurement (default `measure_matmul_peak`).
      device_name: the GPU's name (default: read from TensorFlow).
    """
    measure = measure or measure_matmul_peak
    devices = 1 if parallel.device_type == "CPU" else math.prod(parallel.shape.values())
    first = parallel.mesh.local_devices()[0]
    if parallel.device_type == "GPU":
        name = gpu_name(first) if device_name is None else device_name
        known = datasheet_peak(name, precision_policy, tf32)
        if known:
            return Peak(known[0] * devices, f"{known[1]}, x{devices} GPUs", measured=False)
    dtype = peak_dtype(precision_policy)
    # A CPU's figure only has to be of the right size (it is raised to the step's own
    # rate when the step beats it): a short measurement, as every CPU run (the tests
    # included) pays for it at start-up. A GPU gets a long one.
    n, repeats = (1024, 5) if parallel.device_type == "CPU" else (4096, 10)
    with tf.device(first):
        peak = measure(n=n, repeats=repeats, dtype=dtype)
    where = "the host's cores" if parallel.device_type == "CPU" else f"one GPU, x{devices}"
    return Peak(peak * devices, f"measured: {n}^3 {dtype.name} matmuls on {where}")


def model_flops_utilization(tokens_per_s: float, flops_per_token: float,
                            peak_flops: float) -> float:
    """MFU: achieved training FLOP/s over the peak (0 when either is unknown), at most 1."""
    if not peak_flops or not tokens_per_s:
        return 0.0
    return min(1.0, tokens_per_s * flops_per_token / peak_flops)


class Throughput:
    """Tokens per second of the steps of the current logging interval.

    Only the time spent in steps (reading the batch included) counts: evaluation,
    checkpoint saves and logging between steps do not, and the interval restarts at every
    logged step, so a figure describes the recent steps, not the run's average.
    """

    def __init__(self):
        self.seconds, self.tokens, self.last = 0.0, 0, 0.0

    def add_step(self, seconds: float, tokens: int) -> None:
        self.seconds += seconds
        self.tokens += tokens

    def rate(self) -> float:
        """The current interval's tokens/s, else the last closed interval's."""
        return self.tokens / self.seconds if self.tokens and self.seconds else self.last

    def close_interval(self) -> float:
        """Ends the interval (at a logged step); returns its tokens/s."""
        self.last = self.rate()
        self.seconds, self.tokens = 0.0, 0
        return self.last
