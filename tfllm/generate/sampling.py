"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus).

Pure functions of tensors, run inside the compiled decode loop. Sampling is the
Gumbel-max trick with counter-based noise keyed by (seed, step, row, token), so the
same seed gives the same tokens on every run, with or without a KV cache, on any mesh.
"""

from __future__ import annotations

import tensorflow as tf


def filter_logits(logits, top_k=None, top_p=None):
    """Logits with every token outside the top-k and the top-p nucleus set to -inf.

    Args:
      logits: (B, V) float32, already divided by the temperature.
      top_k: int32 scalar, keep the k most likely tokens (ties at the k-th are kept;
        0 keeps all), or None for no top-k filter.
      top_p: float32 scalar, keep the smallest set of most likely tokens whose
        probability (after top-k) reaches top_p; the most likely token always stays
        (1.0 keeps all). None for no top-p filter.
    """
    vocab = logits.shape[-1]
    ranked = tf.sort(logits, axis=-1, direction="DESCENDING")  # (B, V)
    rank = tf.expand_dims(tf.range(vocab), 0)  # (1, V)
    neg_inf = tf.constant(-float("inf"), logits.dtype)
    keep = tf.ones_like(ranked, tf.bool)  # (B, V) over ranks
    if top_k is not None:
        top_k = tf.cast(top_k, tf.int32)
        # Arithmetic, not tf.where, on scalar settings: DTensor crashes on a scalar where.
        off = tf.cast(top_k <= 0, tf.int32)
        keep = rank < tf.minimum(top_k * (1 - off) + vocab * off, vocab)
    if top_p is not None:
        probs = tf.nn.softmax(tf.where(keep, ranked, neg_inf), axis=-1)  # (B, V)
        mass_before = tf.cumsum(probs, axis=-1, exclusive=True)  # (B, V)
        # Rank 0 has mass_before 0, so it is kept for any top_p > 0; top_p >= 1 keeps all
        # (summed mass may round to just above 1 before the last token).
        limit = top_p + 2.0 * tf.cast(top_p >= 1.0, tf.float32)  # above any mass: off
        keep = tf.logical_and(keep, (mass_before < limit) | (rank == 0))
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
      temperature: float32 scalar, 0 for greedy decoding (a tensor, so that one
        compiled program serves every setting), or None for greedy without sampling ops.
      top_k, top_p: see `filter_logits`; None leaves the filter out of the program.

    Returns:
      (B,) int32 token ids.
    """
    greedy = tf.argmax(logits, axis=-1, output_type=tf.int32)
    if temperature is None:
        return greedy
    temperature = tf.cast(temperature, tf.float32)
    on = temperature > 0
    scaled = logits / (temperature + tf.cast(tf.logical_not(on), tf.float32))  # 0 -> 1
    if top_k is not None or top_p is not None:
        scaled = filter_logits(scaled, top_k, top_p)
    # Gumbel-max: argmax(logits + Gumbel noise) is a sample of softmax(logits).
    uniform = counter_uniform(scaled.shape[0], scaled.shape[1], seed, step)  # (B, V)
    gumbel = -tf.math.log(-tf.math.log(uniform))
    sampled = tf.argmax(scaled + gumbel, axis=-1, output_type=tf.int32)
    return greedy + tf.cast(on, tf.int32) * (sampled - greedy)  # no scalar tf.where


def _mix(h):
    """murmur3's 32-bit finalizer: every input bit flips each output bit with p ~ 1/2."""
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, tf.constant(16, tf.uint32)))
    h = h * tf.constant(0x85EBCA6B, tf.uint32)
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, tf.constant(13, tf.uint32)))
    h = h * tf.constant(0xC2B2AE35, tf.uint32)
    return tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, tf.constant(16, tf.uint32)))


def counter_uniform(rows: int, columns: int, seed, step):
    """Uniform noise in (0, 1) of shape (rows, columns), a pure function of its arguments.

    A stateless counter-based generator (hash of seed, step, row, column), not
    `tf.random.stateless_uniform`: DTensor runs a random op on each shard of a sharded
    output with a per-device seed, so its values would depend on the mesh. Elementwise
    integer ops on global indices give the same numbers on every mesh, and row b's
    noise does not depend on how many rows follow it (batches padded for a mesh).

    Args:
      rows, columns: the static shape (batch, vocabulary).
      seed: int32 scalar, the request's seed.
      step: int32 scalar, the index of the token being chosen.
    """
    key = _mix(tf.bitwise.bitwise_xor(
        _mix(tf.cast(seed, tf.uint32) + tf.constant(0x9E3779B9, tf.uint32)),
        tf.cast(step, tf.uint32)))
    row = tf.expand_dims(tf.cast(tf.range(rows), tf.uint32), 1)  # (B, 1)
    column = tf.expand_dims(tf.cast(tf.range(columns), tf.uint32), 0)  # (1, V)
    counter = row * tf.constant(columns, tf.uint32) + column  # (B, V)
    bits = _mix(_mix(tf.bitwise.bitwise_xor(counter, key)) + key)
    # The top 24 bits, centred in their bucket: strictly inside (0, 1).
    top = tf.cast(tf.bitwise.right_shift(bits, tf.constant(8, tf.uint32)), tf.float32)
    return (top + 0.5) / float(1 << 24)
