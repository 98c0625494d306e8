"""Attention masks and positions for packed documents and for cached decoding.

Both are derived inside the model, so callers pass only segment ids (packing) or a
cache index and each row's first real slot (left-padded generation).
"""

from __future__ import annotations

import tensorflow as tf

from tfllm.parallel.context import constrain

# The key dimension of a mask is never sharded: every query needs all of its keys.
_MASK = ("activation_batch", "activation_length", None)

# New axes come from tf.expand_dims, never from `x[None]` indexing: inside a
# tf.while_loop DTensor fails to lay out (or crashes on) a StridedSlice with new axes.


def row_positions(token_ids):
    """(B, T) int32 positions 0 .. T-1 of every row, computed in the program.

    The training path's positions when rows are not packed. Written as a select on the
    token ids that never takes them (an id is never above +inf), so that no compiler
    can fold what depends on the positions into constants: tf.range(T) and the ops on it
    were folded by tf2xla into each layer's RoPE tables ((1, T, 1, D) float32, two per
    rotary call: 25 MB per llama-7b layer at 4096) and blocked attention's diagonal
    masks (8 MB), in the program and in its compile. From these positions XLA computes
    the tables' cosines in a fusion and the masks inside the scores' select.
    """
    token_ids = tf.convert_to_tensor(token_ids)
    length = token_ids.shape[1]  # None in a saved model's signature: read at run time
    iota = tf.expand_dims(tf.range(tf.shape(token_ids)[1] if length is None else length,
                                   dtype=tf.int32), 0)  # (1, T)
    never = tf.cast(token_ids, tf.float32) > float("inf")  # (B, T), all False
    return tf.where(never, tf.cast(token_ids, tf.int32), iota)  # (B, T)


def segment_mask_and_positions(segment_ids):
    """Causal mask restricted to each token's own segment, and positions within it.

    Documents packed into one row do not see each other, and each one's positions start
    again at 0 (MaxText's `inputs_position`). A token's position is the number of earlier
    tokens of its segment, so it equals t - (segment start) for contiguous segments.

    Args:
      segment_ids: (B, T) int; equal ids mark one document (padding may use its own id).

    Returns:
      (mask (B, T, T) bool, True where query t may see key s; positions (B, T) int32).
    """
    segment_ids = tf.convert_to_tensor(segment_ids)
    length = tf.shape(segment_ids)[1]
    causal = tf.linalg.band_part(tf.ones((length, length), tf.bool), -1, 0)  # (T, S)
    same = tf.equal(tf.expand_dims(segment_ids, 2), tf.expand_dims(segment_ids, 1))  # (B, T, S)
    mask = constrain(tf.logical_and(same, tf.expand_dims(causal, 0)), _MASK, "segment_mask")
    positions = tf.reduce_sum(tf.cast(mask, tf.int32), axis=-1) - 1  # (B, T)
    return mask, positions


def cache_mask_and_positions(batch_start, cache_index, length: int, cache_length: int):
    """Mask and positions of `length` new tokens written at cache slots index .. index+T-1.

    Rows are left-padded to a common prompt length: row b's real tokens start at slot
    `batch_start[b]`, which is its position 0; the slots before it are never seen.

    Args:
      batch_start: (B,) int32 first real slot of each row.
      cache_index: int32 scalar, the slot of the first new token.
      length: T, the number of new tokens (static).
      cache_length: S, the number of cache slots (static).

    Returns:
      (mask (B, T, S) bool; positions (B, T) int32).
    """
    query_slot = cache_index + tf.range(length)  # (T,)
    key_slot = tf.range(cache_length)  # (S,)
    causal = tf.expand_dims(key_slot, 0) <= tf.expand_dims(query_slot, 1)  # (T, S)
    real = tf.expand_dims(key_slot, 0) >= tf.expand_dims(batch_start, 1)  # (B, S)
    mask = tf.logical_and(tf.expand_dims(causal, 0), tf.expand_dims(real, 1))  # (B, T, S)
    mask = constrain(mask, _MASK, "cache_mask")
    positions = tf.expand_dims(query_slot, 0) - tf.expand_dims(batch_start, 1)  # (B, T)
    positions = tf.maximum(positions, 0)
    return mask, positions
