"""Throughput accounting: FLOPs per token, a measured matmul peak, MFU."""

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
