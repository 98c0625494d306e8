"""AdamW with decoupled weight decay, global-norm clipping and sharded states.

tfllm's own optimizer, not Keras's: Keras 3's Adam/AdamW produce wrong updates on
sharded DTensor variables. Each state is created directly in its layout (the
parameter's, or with ZeRO-1 further sharded over "data") and the parity tests check
the updates against a single-device reference.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfllm.optim.schedules import warmup_cosine
from tfllm.parallel.placement import Parallel, new_variable


def global_norm(grads: Sequence[tf.Tensor]):
    """sqrt(sum of squares) over all gradients, in float32."""
    return tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in grads]))


class AdamW:
    """AdamW (Loshchilov & Hutter) with a warmup-cosine schedule.

    Args:
      config: the optimizer section of the tfllm config.
      total_steps: training steps, for the default decay length.
      parallel: the sharding setup, or None for single-device states.
    """

    def __init__(self, config, total_steps: int, parallel: Optional[Parallel] = None):
        self.config = config
        self.parallel = parallel
        self.decay_steps = config.decay_steps or max(total_steps - config.warmup_steps, 0)
        self.states: List = []
        self.variables: List = []
        self.iterations = None

    def learning_rate(self, step):
        c = self.config
        return warmup_cosine(step, c.learning_rate, c.warmup_steps, self.decay_steps,
                             c.min_learning_rate_ratio)

    def decays(self, var) -> bool:
        """Whether weight decay applies to `var` (not to the excluded kinds)."""
        return self.config.weight_decay > 0 and getattr(var, "kind", "kernel") not in \
            self.config.weight_decay_exclude

    def build(self, variables) -> None:
        """Creates the step counter and (m, v) for each variable, in their layouts."""
        p = self.parallel
        self.variables = list(variables)
        self.iterations = new_variable(p, (), (), ("zeros",), "int64", "iterations")
        self.states = []
        for var in self.variables:
            spec = p.optimizer_spec(var) if p is not None else None
            m = new_variable(p, spec, var.shape, ("zeros",), "float32", var.name + "_m")
            v = new_variable(p, spec, var.shape, ("zeros",), "float32", var.name + "_v")
            self.states.append((spec, m, v))

    def state_variables(self) -> list:
        return [self.iterations] + [s for _, m, v in self.states for s in (m, v)]

    def _to(self, x, spec):
        if self.parallel is None:
            return x
        return dtensor.relayout(x, self.parallel.layout(spec))

    def apply(self, grads: Sequence[tf.Tensor], apply_update=None, norm=None):
        """Clips `grads` by global norm and applies one AdamW update (call in tf.function).

        Args:
          grads: one gradient per variable.
          apply_update: optional boolean scalar; where false (a skipped step) nothing
            changes: not the weights, the states, nor the step counter.
          norm: the gradients' global norm if the caller has it (finite), else computed
            here (on a mesh with one scalar all-reduce per set of sharded axes).

        Returns:
          (gradient norm before clipping, learning rate used).
        """
        # A blend, not tf.where: DTensor crashes on a scalar-condition where (TF 2.21).
        # new * 1 + old * 0 is exactly new (old is finite), and the reverse for 0.
        on = None if apply_update is None else tf.cast(apply_update, tf.float32)
        keep = (lambda new, old: new) if on is None else (
            lambda new, old: new * on + old * (1.0 - on))
        c = self.config
        if norm is None:
            norm = (self.parallel.global_norm(grads, self.variables) if self.parallel
                    else global_norm(grads))
        if c.clip_norm > 0:
            scale = tf.minimum(1.0, c.clip_norm / tf.maximum(norm, 1e-6))
        else:
            scale = tf.constant(1.0)
        step = self.iterations + 1
        lr = self.learning_rate(step)
        stepf = tf.cast(step, tf.float32)
        bias1 = 1.0 - tf.pow(c.beta1, stepf)
        bias2 = 1.0 - tf.pow(c.beta2, stepf)
        for var, grad, (spec, m, v) in zip(self.variables, grads, self.states):
            param_spec = self.parallel.variable_spec(var) if self.parallel else None
            # Pin the gradient to its parameter's layout first: DTensor's layout propagation
            # otherwise pulls the ZeRO-1 layout back into the backward pass's relayouts.
            g = self._to(self._to(tf.cast(grad, tf.float32), param_spec) * scale, spec)
            p = self._to(tf.convert_to_tensor(var.value), spec)
            m_new = c.beta1 * m + (1.0 - c.beta1) * g
            v_new = c.beta2 * v + (1.0 - c.beta2) * tf.square(g)
            update = (m_new / bias1) / (tf.sqrt(v_new / bias2) + c.epsilon)
            if self.decays(var):
                update = update + c.weight_decay * p
            m.assign(keep(m_new, m.read_value()))
            v.assign(keep(v_new, v.read_value()))
            new_p = keep(p - lr * update, p)
            var.assign(self._to(new_p, param_spec))  # ZeRO-1: all-gather
        one = tf.ones_like(self.iterations)
        self.iterations.assign_add(one if apply_update is None else
                                   one * tf.cast(apply_update, one.dtype))
        return norm, lr
