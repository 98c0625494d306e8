"""FP8 matmuls written with `tf.custom_gradient`, and their scaling recipes.

Forward operands (activations and weights) are quantized to E4M3 (max 448, 3 mantissa
bits); incoming gradients to E5M2 (max 57344, 2 mantissa bits). Each tensor has a
per-tensor scale chosen so that its absolute maximum (amax) maps to the format's
largest value:

* current scaling: the amax of this very tensor (the recipe PyTorch's float8 training
  and Megatron default to);
* delayed scaling: the largest amax in a history of the last N steps, with a margin of
  2**margin, as Transformer Engine's original recipe.

Casts saturate (clip to the format's range before the cast; TensorFlow's cast gives NaN
beyond it) and an all-zero tensor gets scale 1, never a division by zero.

The dequantized operands feed the dot as `convert(f8) * (1/scale)`: the pattern that
XLA's GPU compiler rewrites into a cuBLASLt FP8 GEMM on Hopper.

FP8 state (one amax history per operand) is carried in variables that the layer
passes in as inputs; the "gradient" returned for a history is its new value, which the
train step assigns (the overwrite-with-gradient pattern of Flax and Keras). So the
state is updated from the global amax of sharded tensors (DTensor reduces the max over
shards) and the optimizer never touches it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import tensorflow as tf

E4M3 = tf.dtypes.experimental.float8_e4m3fn
E5M2 = tf.dtypes.experimental.float8_e5m2
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
RECIPES = ("current", "delayed")


@dataclass(frozen=True)
class Fp8Settings:
    """Which FP8 recipe to use and where.

    Args:
      recipe: "current" or "delayed".
      history_length: amax history length (delayed scaling).
      margin: scale = fmax / (amax * 2**margin).
      exclude: layer-path substrings that stay in bf16 (e.g. "block_0/", "mlp/down").
    """

    recipe: str = "delayed"
    history_length: int = 16
    margin: int = 0
    exclude: Sequence[str] = ()

    def for_layer(self, path: str) -> Optional["Fp8Settings"]:
        """These settings, or None when `path` is excluded from FP8."""
        return None if any(p in path for p in self.exclude) else self


def scale_from_amax(amax, fmax: float, margin: int = 0):
    """fmax / (amax * 2**margin) as float32; 1 where amax is 0 (or not finite)."""
    amax = tf.cast(amax, tf.float32)
    ok = tf.logical_and(amax > 0.0, tf.math.is_finite(amax))
    safe = tf.where(ok, amax, tf.ones_like(amax))
    return tf.where(ok, fmax / (safe * (2.0 ** margin)), tf.ones_like(amax))


def quantize(x, scale, dtype, fmax: float):
    """Saturating cast of x * scale to an FP8 dtype."""
    scaled = tf.cast(x, tf.float32) * scale
    return tf.cast(tf.clip_by_value(scaled, -fmax, fmax), dtype)


def dequantize(q, scale, dtype):
    """FP8 values back to `dtype`: convert, then multiply by 1/scale."""
    return tf.cast(q, dtype) * tf.cast(1.0 / scale, dtype)


def amax(x):
    return tf.reduce_max(tf.abs(tf.cast(x, tf.float32)))


def roll_history(history, new_amax):
    """Shifts the history by one and puts `new_amax` first."""
    return tf.concat([tf.reshape(new_amax, [1]), history[:-1]], axis=0)


def fp8_einsum(equation: str, x, w, history_x, history_w, history_g, settings: Fp8Settings):
    """einsum(equation, x, w) with E4M3 operands and E5M2 output gradients.

    Args:
      equation: a two-operand einsum equation.
      x, w: the operands (any float dtype; the result has x's dtype).
      history_x, history_w, history_g: amax histories (float32, [history_length]).
      settings: the recipe.

    Returns:
      The product; its gradients w.r.t. the histories are their updated values.
    """
    delayed = settings.recipe == "delayed"

    @tf.custom_gradient
    def op(x, w, history_x, history_w, history_g):
        dtype = x.dtype
        amax_x, amax_w = amax(x), amax(w)
        if delayed:
            scale_x = scale_from_amax(tf.reduce_max(history_x), E4M3_MAX, settings.margin)
            scale_w = scale_from_amax(tf.reduce_max(history_w), E4M3_MAX, settings.margin)
        else:
            scale_x = scale_from_amax(amax_x, E4M3_MAX, settings.margin)
            scale_w = scale_from_amax(amax_w, E4M3_MAX, settings.margin)
        x_dq = dequantize(quantize(x, scale_x, E4M3, E4M3_MAX), scale_x, dtype)
        w_dq = dequantize(quantize(w, scale_w, E4M3, E4M3_MAX), scale_w, dtype)
        y = tf.einsum(equation, x_dq, w_dq)
        new_history_x = roll_history(history_x, amax_x)
        new_history_w = roll_history(history_w, amax_w)

        def grad(dy):
            amax_g = amax(dy)
            if delayed:
                scale_g = scale_from_amax(tf.reduce_max(history_g), E5M2_MAX, settings.margin)
            else:
                scale_g = scale_from_amax(amax_g, E5M2_MAX, settings.margin)
            dy_dq = dequantize(quantize(dy, scale_g, E5M2, E5M2_MAX), scale_g, dy.dtype)
            # Straight-through: gradients of the dot on the dequantized FP8 operands.
            with tf.GradientTape() as tape:
                tape.watch([x_dq, w_dq])
                y_again = tf.einsum(equation, x_dq, w_dq)
            dx, dw = tape.gradient(y_again, [x_dq, w_dq], output_gradients=dy_dq)
            return (tf.cast(dx, x.dtype), tf.cast(dw, w.dtype), new_history_x, new_history_w,
                    roll_history(history_g, amax_g))

        return y, grad

    # Read variables here, outside the custom gradient: in eager mode a variable read
    # inside it would make TensorFlow ask grad() for variable gradients (a model called
    # outside tf.function failed with "grad_fn must accept keyword argument
    # 'variables'"). In graphs the reads happen at the same point either way.
    return op(*(tf.convert_to_tensor(t) for t in (x, w, history_x, history_w, history_g)))
