"""Feed-forward blocks: GELU MLP (GPT) and gated MLPs (SwiGLU: Llama; GeGLU: Gemma)."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfllm.models.common.layers import Projection
from tfllm.models.common.remat import recompute

_MLP = ("activation_batch", "activation_length", "activation_mlp")
_EMBED = ("activation_batch", "activation_length", "activation_embed")


def _gelu(h):
    return tf.nn.gelu(h, approximate=True)


def _swiglu(gate, up):
    return tf.nn.silu(gate) * up


def _geglu(gate, up):
    return tf.nn.gelu(gate, approximate=True) * up


#: GatedMLP activations: silu (SwiGLU: Llama, Mistral, Qwen) or gelu_tanh (GeGLU with the
#: tanh GELU: Gemma, transformers' gelu_pytorch_tanh)
GATED_ACTIVATIONS = {"silu": _swiglu, "gelu_tanh": _geglu}


class MLP(keras.layers.Layer):
    """up (E -> F), GELU (tanh approximation, as GPT-2), down (F -> E).

    Args:
      hidden_dim: E.
      intermediate_dim: F.
      use_bias: biases on both projections.
      init_std: init of the up projection.
      output_init_std: init of the down projection (scaled for depth).
      fp8: `Fp8Settings` for FP8 projections, or None.
      fp8_path: this layer's path for `fp8.exclude` (e.g. "block_0/mlp").
    """

    def __init__(self, hidden_dim: int, intermediate_dim: int, use_bias: bool = True,
                 init_std: float = 0.02, output_init_std: float = 0.02, fp8=None,
                 fp8_path: str = "mlp", **kwargs):
        super().__init__(**kwargs)
        fp8_for = lambda name: fp8.for_layer(f"{fp8_path}/{name}") if fp8 else None
        self.recompute_activation = False  # set by the model's remat policy
        self.up = Projection("btd,df->btf", (hidden_dim, intermediate_dim), ("embed", "mlp"),
                             use_bias=use_bias, init_std=init_std, output_axes=_MLP, name="up",
                             fp8=fp8_for("up"), dtype=self.dtype_policy)
        self.down = Projection("btf,fd->btd", (intermediate_dim, hidden_dim), ("mlp", "embed"),
                               use_bias=use_bias, init_std=output_init_std, output_axes=_EMBED,
                               name="down", fp8=fp8_for("down"), dtype=self.dtype_policy)

    def build(self, input_shape=None):
        self.up.build(None)
        self.down.build(None)

    def call(self, x):
        h = self.up(x)  # (B, T, F)
        act = recompute(_gelu) if self.recompute_activation else _gelu
        return self.down(act(h))


class GatedMLP(keras.layers.Layer):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU by default.

    Args:
      hidden_dim: E.
      intermediate_dim: F.
      use_bias: biases on the projections.
      activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma).
      init_std: init of gate and up.
      output_init_std: init of down (scaled for depth).
      fp8: `Fp8Settings` for FP8 projections, or None.
      fp8_path: this layer's path for `fp8.exclude` (e.g. "block_0/mlp").
    """

    def __init__(self, hidden_dim: int, intermediate_dim: int, use_bias: bool = False,
                 init_std: float = 0.02, output_init_std: float = 0.02, fp8=None,
                 fp8_path: str = "mlp", activation: str = "silu", **kwargs):
        super().__init__(**kwargs)
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"{self.name}: activation {activation!r}; use one of "
                             f"{sorted(GATED_ACTIVATIONS)}.")
        self.activation = GATED_ACTIVATIONS[activation]
        fp8_for = lambda name: fp8.for_layer(f"{fp8_path}/{name}") if fp8 else None
        self.recompute_activation = False  # set by the model's remat policy
        kw = dict(use_bias=use_bias, init_std=init_std, output_axes=_MLP,
                  dtype=self.dtype_policy)
        self.gate = Projection("btd,df->btf", (hidden_dim, intermediate_dim), ("embed", "mlp"),
                               name="gate", fp8=fp8_for("gate"), **kw)
        self.up = Projection("btd,df->btf", (hidden_dim, intermediate_dim), ("embed", "mlp"),
                             name="up", fp8=fp8_for("up"), **kw)
        self.down = Projection("btf,fd->btd", (intermediate_dim, hidden_dim), ("mlp", "embed"),
                               use_bias=use_bias, init_std=output_init_std, output_axes=_EMBED,
                               name="down", fp8=fp8_for("down"), dtype=self.dtype_policy)

    def build(self, input_shape=None):
        for layer in (self.gate, self.up, self.down):
            layer.build(None)

    def call(self, x):
        act = recompute(self.activation) if self.recompute_activation else self.activation
        return self.down(act(self.gate(x), self.up(x)))
