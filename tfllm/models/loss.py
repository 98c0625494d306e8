"""Next-token losses: per-token NLL and the (sum, count) pair evaluation accumulates."""

from __future__ import annotations

import tensorflow as tf


def token_nll(logits, targets):
    """Per-token cross-entropy (B, T) in float32 of logits (B, T, V) and targets (B, T)."""
    logits = tf.cast(logits, tf.float32)
    lse = tf.reduce_logsumexp(logits, axis=-1)  # (B, T)
    target_logit = tf.reduce_sum(
        logits * tf.one_hot(targets, tf.shape(logits)[-1], dtype=tf.float32), -1)  # (B, T)
    return lse - target_logit


def loss_sum_and_count(logits, targets, mask=None):
    """Summed NLL and number of counted tokens, so batches combine exactly.

    Validation loss is sum(nll) / sum(count) over all batches, and perplexity
    exp(that): averaging per-batch means would weight short batches too much.

    Args:
      logits: (B, T, V).
      targets: (B, T) int token ids.
      mask: (B, T) 1 where the position counts (e.g. `packed_target_mask`), or None.

    Returns:
      (float32 scalar sum of NLL, float32 scalar token count).
    """
    nll = token_nll(logits, targets)  # (B, T)
    if mask is None:
        return tf.reduce_sum(nll), tf.cast(tf.size(nll), tf.float32)
    mask = tf.cast(mask, tf.float32)
    return tf.reduce_sum(nll * mask), tf.reduce_sum(mask)


def packed_target_mask(segment_ids, pad_id: int = 0):
    """Which next-token targets count in packed rows: same document, not padding.

    Args:
      segment_ids: (B, T + 1) int document ids of the full token rows (inputs are
        tokens[:, :-1], targets tokens[:, 1:]).
      pad_id: the segment id of padding, whose targets never count.

    Returns:
      (B, T) float32: 1 where input and target belong to the same non-pad document (a
      document's first token is not predicted from the previous document's last).
    """
    inputs, targets = segment_ids[:, :-1], segment_ids[:, 1:]  # (B, T) each
    keep = tf.logical_and(tf.equal(inputs, targets), tf.not_equal(targets, pad_id))
    return tf.cast(keep, tf.float32)
