"""Dynamic loss scaling for float16 training.

The loss is multiplied by `scale` before the backward pass and the gradients divided by
it after, so small fp16 gradients do not flush to zero. A step whose gradients are not
finite is skipped (no weight or optimizer-state change), counted, and halves the scale;
after `growth_interval` finite steps in a row the scale doubles.
"""

from __future__ import annotations

import tensorflow as tf

from tfllm.parallel.placement import new_variable


class DynamicLossScale:
    """Loss-scale state (replicated variables) and its update rule.

    Args:
      initial: the starting scale.
      growth_interval: finite steps in a row before the scale doubles.
      parallel: the sharding setup, or None.
    """

    def __init__(self, initial: float, growth_interval: int, parallel=None):
        self.growth_interval = growth_interval
        self.scale = new_variable(parallel, (), (), ("ones",), "float32", "loss_scale")
        self.scale.assign(tf.ones_like(self.scale) * initial)
        self.good_steps = new_variable(parallel, (), (), ("zeros",), "int64", "good_steps")
        self.skipped_steps = new_variable(parallel, (), (), ("zeros",), "int64", "skipped_steps")

    def variables(self) -> list:
        return [self.scale, self.good_steps, self.skipped_steps]

    def update(self, finite):
        """Adjusts the state after a step whose gradients were (not) all finite.

        Returns:
          (new scale, new skipped-step count): the values just assigned.
        """
        one = tf.ones_like(self.good_steps)
        good = tf.where(finite, self.good_steps + one, tf.zeros_like(self.good_steps))
        grow = good >= self.growth_interval
        new_scale = tf.where(finite, tf.where(grow, self.scale * 2.0, self.scale),
                             tf.maximum(self.scale * 0.5, 1.0))
        skipped = self.skipped_steps + one * tf.cast(tf.logical_not(finite), one.dtype)
        self.scale.assign(new_scale)
        self.good_steps.assign(tf.where(grow, tf.zeros_like(good), good))
        self.skipped_steps.assign(skipped)
        return new_scale, skipped


def all_finite(tensors) -> tf.Tensor:
    """Whether every element of every tensor is finite: one reduction, via the sum of
    squares (any NaN or Inf makes it non-finite)."""
    total = tf.add_n([tf.reduce_sum(tf.square(tf.cast(t, tf.float32))) for t in tensors])
    return tf.math.is_finite(total)
