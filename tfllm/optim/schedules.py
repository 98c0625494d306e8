"""Learning-rate schedules, computed in-graph from the step counter."""

from __future__ import annotations

import math

import tensorflow as tf


def warmup_cosine(step, peak: float, warmup_steps: int, decay_steps: int,
                  min_ratio: float):
    """Linear warmup from 0 to `peak` over `warmup_steps`, then cosine decay to
    `peak * min_ratio` over `decay_steps`, then constant.

    Args:
      step: the 1-based optimizer step (a scalar tensor or number).
      peak: peak learning rate.
      warmup_steps: steps of linear warmup (0: start at the peak).
      decay_steps: steps of cosine decay after warmup (0: no decay).
      min_ratio: final learning rate as a fraction of the peak.
    """
    step = tf.cast(step, tf.float32)
    warm = peak * step / float(max(warmup_steps, 1))
    progress = tf.clip_by_value((step - warmup_steps) / float(max(decay_steps, 1)), 0.0, 1.0)
    cosine = 0.5 * (1.0 + tf.cos(math.pi * progress))
    decayed = peak * (min_ratio + (1.0 - min_ratio) * cosine)
    if decay_steps == 0:
        decayed = tf.constant(peak, tf.float32)
    return tf.where(step <= warmup_steps, warm, decayed) if warmup_steps else decayed
