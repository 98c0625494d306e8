"""Building blocks that declare the logical axes of their weights.

Every weight is created through `add_param`, which records on the Keras variable:

* `logical_axes`: one logical name per dimension (see `tfllm.parallel.rules`);
* `init`: how to initialize it (`("normal", std)`, `("zeros",)` or `("ones",)`),
  which `tfllm.parallel.placement` turns into the same values on any mesh;
* `kind`: kernel, bias, norm or embedding (weight decay uses it).

Layers create their weights in `build()` from their constructor arguments, so a model
can be built without data, and under `keras.StatelessScope` without allocating memory.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import keras
import tensorflow as tf

from tfllm.models.common import adapters, noise
from tfllm.models.common.remat import recompute
from tfllm.parallel.context import apply_weight, constrain, gather_weight, weight_product

INIT_KINDS = ("normal", "zeros", "ones")


def _keras_initializer(init):
    """A Keras initializer equivalent in distribution to a tfllm init spec."""
    if init[0] == "normal":
        return keras.initializers.RandomNormal(stddev=init[1])
    return init[0]


def add_param(layer: keras.layers.Layer, name: str, shape: Sequence[int],
              logical_axes: Sequence[Optional[str]], init: Tuple, kind: str,
              trainable: bool = True):
    """Adds a weight to `layer` and records its logical axes, init and kind.

    Args:
      layer: the owning layer (call from its `build`).
      name: the weight's name inside the layer, e.g. "kernel".
      shape: its global shape.
      logical_axes: one logical axis name (or None: never sharded) per dimension.
      init: ("normal", std), ("zeros",) or ("ones",).
      kind: "kernel", "bias", "norm", "embedding", or "fp8_state" (amax histories:
        float32 whatever the compute dtype, updated by the train step, not the optimizer).
      trainable: whether the optimizer updates it.
    """
    if init[0] not in INIT_KINDS:
        raise ValueError(f"{layer.name}/{name}: unknown init {init!r}; use one of {INIT_KINDS}.")
    if len(logical_axes) != len(shape):
        raise ValueError(f"{layer.name}/{name}: {len(shape)}-d shape {tuple(shape)} needs one "
                         f"logical axis per dimension, got {tuple(logical_axes)}.")
    var = layer.add_weight(name=name, shape=tuple(shape), initializer=_keras_initializer(init),
                           trainable=trainable, autocast=kind != "fp8_state",
                           dtype="float32" if kind == "fp8_state" else None)
    var.logical_axes = tuple(logical_axes)
    var.init = tuple(init)
    var.kind = kind
    return var


class Projection(keras.layers.Layer):
    """A dense projection written as an einsum, with named kernel and bias axes.

    Example: the query projection maps (B, T, E) to (B, T, H, D) with
    `Projection("btd,dhk->bthk", (E, H, D), ("embed", "heads", "head_dim"))`.

    Args:
      equation: einsum equation "input,kernel->output".
      kernel_shape: shape of the kernel.
      kernel_axes: logical axes of the kernel.
      use_bias: add a bias shaped like the output's trailing kernel dimensions.
      init_std: standard deviation of the kernel's normal init.
      output_axes: logical axes to constrain the output to (None: no constraint).
      fp8: `tfllm.precision.Fp8Settings` to compute the einsum in FP8, or None.
    """

    def __init__(self, equation: str, kernel_shape, kernel_axes, use_bias: bool = False,
                 init_std: float = 0.02, output_axes=None, fp8=None, **kwargs):
        super().__init__(**kwargs)
        self.fp8 = fp8
        self.equation = equation
        self.kernel_shape = tuple(kernel_shape)
        self.kernel_axes = tuple(kernel_axes)
        self.use_bias = use_bias
        self.init_std = init_std
        self.output_axes = output_axes
        #: a `tfllm.models.lora.LoraSpec` set before build (`enable_lora`), or None
        self.lora = None
        inputs, output = equation.split("->")
        x_letters, kernel_letters = inputs.split(",")
        # The bias covers the output dimensions that come from the kernel.
        self._bias_dims = [i for i, c in enumerate(kernel_letters) if c in output
                           and c not in x_letters]
        # LoRA: A spans the kernel's contracted (input) dimensions, B its output ones.
        self._in_dims = [i for i, c in enumerate(kernel_letters) if c in x_letters]
        self._out_dims = [i for i, c in enumerate(kernel_letters) if c in output]
        r = next(c for c in "rzyxwvu" if c not in equation)
        mid = "".join(c for c in x_letters if c in output) + r
        self._lora_equations = (
            f"{x_letters},{''.join(kernel_letters[i] for i in self._in_dims)}{r}->{mid}",
            f"{mid},{r}{''.join(kernel_letters[i] for i in self._out_dims)}->{output}")

    def build(self, input_shape=None):
        lora = self.lora
        self.kernel = add_param(self, "kernel", self.kernel_shape, self.kernel_axes,
                                ("normal", self.init_std), "kernel", trainable=lora is None)
        if lora is not None:
            fan_in = 1
            for i in self._in_dims:
                fan_in *= self.kernel_shape[i]
            # peft's default A init is Kaiming-uniform(a=sqrt(5)): U(-1/sqrt(fan_in), ..),
            # variance 1 / (3 fan_in); B starts at zero.
            if not lora.shares_a:  # else the hidden x A comes with the input (`call`)
                self.lora_a = add_param(
                    self, "lora_a", [self.kernel_shape[i] for i in self._in_dims] + [lora.rank],
                    [self.kernel_axes[i] for i in self._in_dims] + [None],
                    ("normal", (3.0 * fan_in) ** -0.5), "kernel")
                # Imported weights fill the model (built with zeros); adapters start so.
                self.lora_a.init_when_loading = True
            self.lora_b = add_param(
                self, "lora_b", [lora.rank] + [self.kernel_shape[i] for i in self._out_dims],
                [None] + [self.kernel_axes[i] for i in self._out_dims], ("zeros",), "kernel")
            self.lora_b.init_when_loading = True
        if self.use_bias:
            self.bias = add_param(self, "bias", [self.kernel_shape[i] for i in self._bias_dims],
                                  [self.kernel_axes[i] for i in self._bias_dims], ("zeros",),
                                  "bias")
        if self.fp8 is not None:  # amax histories of input, kernel and output gradient
            n = self.fp8.history_length
            self.fp8_history = [add_param(self, f"amax_history_{t}", (n,), (None,), ("zeros",),
                                          "fp8_state", trainable=False) for t in "xwg"]
            if self.fp8.gather:  # FSDP gathers the kernel as E4M3 bytes (parallel.blocks)
                from tfllm.precision.fp8 import WeightCodec
                self.kernel.gather_codec = WeightCodec(self.fp8, self.fp8_history[1])

    def call(self, x, lora_hidden=None):
        """y = x W (+ s h B with an adapter, h = x A or `lora_hidden`) (+ bias).

        Args:
          x: the input.
          lora_hidden: the adapter's hidden x A (`lora_hidden`) of the projection whose A
            this one shares (`LoraSpec.shares_a`); None computes this one's own.
        """
        if self.fp8 is not None:
            from tfllm.precision.fp8 import fp8_einsum

            def einsum(eq, x, w, *h, **kw):  # kw: w_amax, piece_dims (parallel.blocks)
                return fp8_einsum(eq, x, w, *h, self.fp8, variables=self.fp8_history, **kw)
            einsum.per_piece_amax = True
            extra = tuple(self.fp8_history)
        else:
            einsum = lambda eq, x, w: tf.einsum(eq, x, w)  # noqa: E731
            extra = ()
        product = lambda x, w, *h: einsum(self.equation, x, w, *h)  # noqa: E731
        y = weight_product(product, x, self.kernel, self.kernel_axes, self.name, extra,
                           equation=self.equation, einsum=einsum)
        if self.lora is not None and not adapters.disabled():  # off: DPO's reference
            y = y + self._adapter(x, lora_hidden)
        if self.use_bias:
            y = apply_weight(lambda y, b: y + b, y, self.bias, self.bias.logical_axes,
                             self.name)
        if self.output_axes is not None:
            y = constrain(y, self.output_axes, self.name)
        return y


    def lora_hidden(self, x):
        """dropout(x) A: the adapter's rank-r hidden (dropout in training only)."""
        if self.lora.shares_a:
            raise ValueError(f"{self.name}: its adapter shares another projection's A; "
                             "call it with that projection's lora_hidden.")
        if self.lora.dropout and noise.current() is not None:  # training
            x = noise.dropout(x, self.lora.dropout, self.path)
        to_a = self._lora_equations[0]
        return weight_product(lambda x, w: tf.einsum(to_a, x, w), x, self.lora_a,
                              self.lora_a.logical_axes, self.name, equation=to_a,
                              einsum=tf.einsum)

    def _adapter(self, x, h=None):
        """s (x A) B: the low-rank update, in the compute dtype like the kernel's product."""
        to_b = self._lora_equations[1]
        if h is None:
            h = self.lora_hidden(x)
        h = weight_product(lambda x, w: tf.einsum(to_b, x, w), h, self.lora_b,
                           self.lora_b.logical_axes,
                           self.name, equation=to_b, einsum=tf.einsum)
        return h * tf.cast(self.lora.scale, h.dtype)


class TokenEmbedding(keras.layers.Layer):
    """Token embedding table (V, E); `attend` gives logits against it (tied heads)."""

    def __init__(self, vocab_size: int, hidden_dim: int, init_std: float = 0.02, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.hidden_dim, self.init_std = vocab_size, hidden_dim, init_std

    def build(self, input_shape=None):
        self.embeddings = add_param(self, "embeddings", (self.vocab_size, self.hidden_dim),
                                    ("vocab", "embed"), ("normal", self.init_std), "embedding")

    def call(self, token_ids):
        table = gather_weight(self.embeddings, ("vocab", "embed"), self.name)  # (V, E)
        x = tf.gather(table, token_ids)  # (B, T, E)
        return constrain(x, ("activation_batch", "activation_length", "activation_embed"))

    def attend(self, x):
        logits = weight_product(lambda x, table: tf.einsum("btd,vd->btv", x, table),  # (V, E)
                                x, self.embeddings, ("vocab", "embed"), self.name)  # (B, T, V)
        return constrain(logits, ("activation_batch", "activation_length", "activation_vocab"))


class PositionEmbedding(keras.layers.Layer):
    """Learned absolute positions (L, E), added for the first T positions (or given ones)."""

    def __init__(self, max_length: int, hidden_dim: int, init_std: float = 0.02, **kwargs):
        super().__init__(**kwargs)
        self.max_length, self.hidden_dim, self.init_std = max_length, hidden_dim, init_std

    def build(self, input_shape=None):
        self.embeddings = add_param(self, "embeddings", (self.max_length, self.hidden_dim),
                                    ("position", "embed"), ("normal", self.init_std), "embedding")

    def call(self, x, positions=None):
        """x (B, T, E) plus the embedding of positions (B, T), or of 0 .. T-1 when None."""
        table = gather_weight(self.embeddings, ("position", "embed"), self.name)  # (L, E)
        if positions is None:
            return x + table[:tf.shape(x)[1]]  # (T, E) broadcast over the batch
        added = tf.gather(table, positions)  # (B, T, E)
        return x + constrain(added, ("activation_batch", "activation_length",
                                     "activation_embed"), self.name)


class LayerNorm(keras.layers.Layer):
    """LayerNorm over the last axis; statistics in float32 whatever the compute dtype."""

    def __init__(self, hidden_dim: int, epsilon: float = 1e-5, **kwargs):
        super().__init__(**kwargs)
        self.hidden_dim, self.epsilon = hidden_dim, epsilon
        self.recompute = False  # set by the model's remat policy

    def build(self, input_shape=None):
        self.scale = add_param(self, "scale", (self.hidden_dim,), ("norm",), ("ones",), "norm")
        self.bias = add_param(self, "bias", (self.hidden_dim,), ("norm",), ("zeros",), "norm")

    def call(self, x):
        return recompute(self._normalize)(x) if self.recompute else self._normalize(x)

    def _normalize(self, x):
        x32 = tf.cast(x, tf.float32)
        mean, var = tf.nn.moments(x32, axes=[-1], keepdims=True)
        y = (x32 - mean) * tf.math.rsqrt(var + self.epsilon)
        y = apply_weight(lambda y, s: y * tf.cast(s, tf.float32), y, self.scale, ("norm",),
                         self.name)
        y = apply_weight(lambda y, b: y + tf.cast(b, tf.float32), y, self.bias, ("norm",),
                         self.name)
        return tf.cast(y, x.dtype)


class RMSNorm(keras.layers.Layer):
    """RMSNorm over the last axis; statistics in float32.

    Args:
      hidden_dim: the normalized width.
      epsilon: added to the mean square.
      zero_centered: the output is multiplied by (1 + scale), scale initialized to zeros
        (Gemma's convention, stored as Gemma checkpoints store it); else by scale, ones.
    """

    def __init__(self, hidden_dim: int, epsilon: float = 1e-5, zero_centered: bool = False,
                 **kwargs):
        super().__init__(**kwargs)
        self.hidden_dim, self.epsilon = hidden_dim, epsilon
        self.zero_centered = zero_centered
        self.recompute = False  # set by the model's remat policy

    def build(self, input_shape=None):
        init = ("zeros",) if self.zero_centered else ("ones",)
        self.scale = add_param(self, "scale", (self.hidden_dim,), ("norm",), init, "norm")

    def call(self, x):
        return recompute(self._normalize)(x) if self.recompute else self._normalize(x)

    def _normalize(self, x):
        x32 = tf.cast(x, tf.float32)
        y = x32 * tf.math.rsqrt(tf.reduce_mean(tf.square(x32), -1, keepdims=True) + self.epsilon)
        shift = 1.0 if self.zero_centered else 0.0

        def scaled(y, s):
            return y * (shift + tf.cast(s, tf.float32))

        return tf.cast(apply_weight(scaled, y, self.scale, ("norm",), self.name), x.dtype)
