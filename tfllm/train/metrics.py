"""Throughput accounting: FLOPs per token, a measured matmul peak, MFU, tokens/s.

The one owner of what MFU means: `tfllm train` and `tfllm bench` both divide the model
FLOPs they achieve by `mesh_peak_flops`, so the same run reports the same figure.
"""

from __future__ import annotations

import math
import statistics
import time

import tensorflow as tf


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
    mlp_matrices = 3 if c.family == "llama" else 2
    per_layer = E * heads * head_dim * 2 + E * kv * head_dim * 2 + mlp_matrices * E * F
    forward = 2 * (L * per_layer + E * V) + L * 2 * 2 * T * heads * head_dim
    return 3 * forward


def measure_matmul_peak(n: int = 2048, repeats: int = 10, dtype=tf.float32) -> float:
    """FLOP/s of an n x n x n matmul on the default device (median of `repeats`)."""
    a = tf.random.stateless_normal((n, n), seed=(1, 2), dtype=dtype)
    b = tf.random.stateless_normal((n, n), seed=(3, 4), dtype=dtype)
    matmul = tf.function(lambda x, y: tf.matmul(x, y))
    matmul(a, b).numpy()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).numpy()
        times.append(time.perf_counter() - start)
    return 2.0 * n ** 3 / statistics.median(times)


def peak_dtype(precision_policy: str):
    """The matmul dtype whose peak MFU is measured against: float32 runs against the
    float32 peak, every mixed policy (bf16, fp16, fp8) against the dense bf16 peak."""
    return tf.float32 if precision_policy == "float32" else tf.bfloat16


def mesh_peak_flops(parallel, precision_policy: str, measure=None) -> float:
    """The whole mesh's matmul peak (FLOP/s), measured on one local device.

    Logical CPU devices share the host's cores, so on CPU one device's peak is the whole
    host's; on GPU every device of every client counts.

    Args:
      parallel: the run's `tfllm.parallel.Parallel`.
      precision_policy: the config's precision.policy.
      measure: the measurement (default `measure_matmul_peak`).
    """
    measure = measure or measure_matmul_peak
    with tf.device(parallel.mesh.local_devices()[0]):
        peak = measure(n=2048, repeats=10, dtype=peak_dtype(precision_policy))
    if parallel.device_type == "CPU":
        return peak
    return peak * math.prod(parallel.shape.values())


def model_flops_utilization(tokens_per_s: float, flops_per_token: float,
                            peak_flops: float) -> float:
    """MFU: achieved training FLOP/s over the peak (0 when either is unknown)."""
    if not peak_flops or not tokens_per_s:
        return 0.0
    return tokens_per_s * flops_per_token / peak_flops


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
