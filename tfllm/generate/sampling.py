"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus).

Pure functions of tensors, run inside the compiled decode loop. Sampling is the
Gumbel-max trick with stateless noise keyed by (seed, step), so the same seed gives the
same tokens on every run, with or without a KV cache, on any mesh.
"""

from __future__ import annotations

import tensorflow as tf


def filter_logits(logits, top_k=None, top_p=None):
    """Logits with every token outside the top-k and the top-p nucleus set to -inf.

    Args:
      logits: (B, V) float32, already divided by the temperature.
      top_k: int32 scalar, keep the k most likely tokens (ties at the k-th are kept),
        or None for no top-k filter.
      top_p: float32 scalar, keep the smallest set of most likely tokens whose
        probability (after top-k) reaches top_p; the most likely token always stays.
        None for no top-p filter.
    """
    vocab = logits.shape[-1]
    ranked = tf.sort(logits, axis=-1, direction="DESCENDING")  # (B, V)
    rank = tf.expand_dims(tf.range(vocab), 0)  # (1, V)
    neg_inf = tf.constant(-float("inf"), logits.dtype)
    keep = tf.ones_like(ranked, tf.bool)  # (B, V) over ranks
    if top_k is not None:
        keep = rank < tf.clip_by_value(tf.cast(top_k, tf.int32), 1, vocab)
    if top_p is not None:
        probs = tf.nn.softmax(tf.where(keep, ranked, neg_inf), axis=-1)  # (B, V)
        mass_before = tf.cumsum(probs, axis=-1, exclusive=True)  # (B, V)
        # Rank 0 has mass_before 0, so it is kept for any top_p > 0.
        keep = tf.logical_and(keep, (mass_before < top_p) | (rank == 0))
    # The smallest kept logit is the cut: a min over ranks, no per-row gather.
    best = tf.reduce_max(ranked, axis=-1, keepdims=True)  # (B, 1)
    threshold = tf.reduce_min(tf.where(keep, ranked, best), axis=-1, keepdims=True)  # (B, 1)
    return tf.where(logits >= threshold, logits, neg_inf)


def next_token(logits, seed, step, temperature=None, top_k=None, top_p=None):
    """The next token of each row: argmax when temperature is None, else sampled.

    Args:
      logits: (B, V) float32.
      seed: int32 scalar, the request's seed.
      step: int32 scalar, which generated token this is (0 for the first).
      temperature: float32 scalar > 0, or None for greedy decoding.
      top_k, top_p: see `filter_logits`; None turns the filter off.

    Returns:
      (B,) int32 token ids.
    """
    if temperature is None:
        return tf.argmax(logits, axis=-1, output_type=tf.int32)
    scaled = logits / temperature
    if top_k is not None or top_p is not None:
        scaled = filter_logits(scaled, top_k, top_p)
    # Gumbel-max: argmax(logits + Gumbel noise) is a sample of softmax(logits).
    uniform = tf.random.stateless_uniform(
        tf.shape(scaled), seed=tf.stack([tf.cast(seed, tf.int32), tf.cast(step, tf.int32)]),
        minval=1e-20, maxval=1.0, dtype=tf.float32)  # (B, V)
    gumbel = -tf.math.log(-tf.math.log(uniform))
    return tf.argmax(scaled + gumbel, axis=-1, output_type=tf.int32)
