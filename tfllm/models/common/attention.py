"""Causal self-attention with grouped-query heads and optional rotary positions."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from tfllm.models.common.flash import flash_attention
from tfllm.models.common.layers import Projection, RMSNorm
from tfllm.models.common.remat import recompute
from tfllm.parallel.context import constrain, split_count

_HEADS = ("activation_batch", "activation_length", "activation_heads", "activation_head_dim")
_KV_HEADS = ("activation_batch", "activation_length", "activation_kv_heads",
             "activation_head_dim")
# Keys and values as the scores use them: every query needs all keys of its row, so
# their length is never split (under sequence sharding this gathers them).
_KEYS = ("activation_batch", None, "activation_kv_heads", "activation_head_dim")
_KEYS_REPEATED = ("activation_batch", None, "activation_heads", "activation_head_dim")
# Queries folded to (B, P, T/P, H, D) by the pieces their sequence is split into.
_FOLDED = ("activation_batch", "activation_length", None, "activation_heads",
           "activation_head_dim")
_FOLDED_MASK = ("activation_batch", "activation_length", None, None)
# Blocked attention's widest score tile: a query block's visible keys, up to this many,
# are one tile (one GEMM, one softmax) rather than (block, block) tiles with an online
# softmax between them: at 4096 tokens every row of tiles is one, and a pass holds at
# most (B, H, P, block, 4096) float32 scores (256 MiB at 32 heads and blocks of 512).
ROW_KEYS = 4096


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched for contexts longer than pre-training.

    Args:
      kind: "linear" (every frequency divided by `factor`, i.e. positions / factor) or
        "llama3" (Llama 3.1+: wavelengths longer than original_length / low_freq_factor
        divided by `factor`, shorter than original_length / high_freq_factor unchanged,
        a smooth blend in between).
      factor: the scaling factor.
      low_freq_factor, high_freq_factor, original_length: llama3 only.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_length: int = 8192


def rope_inverse_frequencies(dim: int, theta: float, scaling: Optional[RopeScaling] = None):
    """The (D/2,) float32 angular frequencies of RoPE over a head of width `dim`."""
    inv_freq = 1.0 / (theta ** (tf.range(0, dim, 2, dtype=tf.float32) / dim))  # (D/2,)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind != "llama3":
        raise ValueError(f"unknown RoPE scaling {scaling.kind!r}; use linear or llama3.")
    # Llama 3.1's rule (as Meta's reference and keras-hub's LlamaRotaryEmbedding).
    wavelength = 2 * math.pi / inv_freq
    low_wavelength = scaling.original_length / scaling.low_freq_factor
    high_wavelength = scaling.original_length / scaling.high_freq_factor
    scaled = tf.where(wavelength > low_wavelength, inv_freq / scaling.factor, inv_freq)
    smooth = ((scaling.original_length / wavelength - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
    return tf.where(medium, blended, scaled)


def rotary(x, theta: float, positions=None, scaling: Optional[RopeScaling] = None):
    """Applies rotary position embeddings to x of shape (B, T, H, D) (rotate-half form).

    Args:
      x: queries or keys (B, T, H, D).
      theta: the RoPE base.
      positions: (B, T) int position of each token, or None for 0 .. T-1 in every row
        (packed documents and cached decoding pass their own).
      scaling: a `RopeScaling` for long-context frequencies, or None.
    """
    length, dim = tf.shape(x)[1], x.shape[-1]
    inv_freq = rope_inverse_frequencies(dim, theta, scaling)  # (D/2,)
    if positions is None:
        angles = tf.cast(tf.range(length), tf.float32)[:, None] * inv_freq[None, :]  # (T, D/2)
        angles = tf.concat([angles, angles], axis=-1)[None, :, None, :]  # (1, T, 1, D)
    else:
        # expand_dims, not [..., None]: see tfllm.models.common.masks (DTensor loops).
        angles = tf.expand_dims(tf.cast(positions, tf.float32), -1) * inv_freq  # (B, T, D/2)
        angles = tf.expand_dims(tf.concat([angles, angles], axis=-1), 2)  # (B, T, 1, D)
    x32 = tf.cast(x, tf.float32)
    x1, x2 = tf.split(x32, 2, axis=-1)
    rotated = tf.concat([-x2, x1], axis=-1)  # (B, T, H, D)
    return tf.cast(x32 * tf.cos(angles) + rotated * tf.sin(angles), x.dtype)


@dataclass(frozen=True)
class AttentionSettings:
    """One attention layer's shape and options: a family's `make_attention` fills one per
    block (local and global layers differ by their window and RoPE), so that a new
    family's option is a field here, not one more argument of every constructor.

    Args:
      hidden_dim: width E of the residual stream.
      num_query_heads: H.
      num_key_value_heads: K (divides H); each K head serves H // K query heads.
      head_dim: D.
      use_bias: biases on the projections (GPT) or not (Llama).
      qkv_bias: biases on the query/key/value projections (default: use_bias); the
        output projection follows use_bias (Qwen2 has q/k/v biases only).
      rope_theta: apply rotary embeddings with this base, or None for none.
      rope_scaling: a `RopeScaling` of the rotary frequencies, or None.
      block_size: > 0: the training path attends blocks of this many queries, each over
        the keys it may see as tiles of up to `ROW_KEYS` keys with an online softmax
        between them, recomputed in the backward pass (`attend_blocked`); 0: one `attend`.
      init_std: init of the q/k/v projections.
      output_init_std: init of the output projection (scaled for depth).
      fp8: `Fp8Settings` for FP8 projections, or None.
      fp8_path: this layer's path for `fp8.exclude` (e.g. "block_0/attention").
      qk_norm_epsilon: an RMSNorm over each head's queries and keys (scales of head_dim
        channels, shared by the heads) before RoPE, with this epsilon (Qwen3); None: none.
      qk_norm_zero_centered: those norms multiply by (1 + scale) (Gemma 3).
      sliding_window: > 0: query t sees only keys t - sliding_window + 1 .. t (local
        attention; transformers' sliding_window); 0: all earlier keys.
      score_divisor: scores are divided by sqrt(score_divisor) (Gemma 3's
        query_pre_attn_scalar); None: by sqrt(head_dim).
    """

    hidden_dim: int
    num_query_heads: int
    num_key_value_heads: int
    head_dim: int
    use_bias: bool = False
    qkv_bias: Optional[bool] = None
    rope_theta: Optional[float] = None
    rope_scaling: Optional[RopeScaling] = None
    block_size: int = 0
    init_std: float = 0.02
    output_init_std: float = 0.02
    fp8: Optional[object] = None
    fp8_path: str = "attention"
    qk_norm_epsilon: Optional[float] = None
    qk_norm_zero_centered: bool = False
    sliding_window: int = 0
    score_divisor: Optional[float] = None


class Attention(keras.layers.Layer):
    """Multi-head causal self-attention; grouped-query when num_key_value_heads < heads.

    Args:
      settings: the layer's `AttentionSettings`.
      **kwargs: Keras layer arguments (name, dtype).
    """

    def __init__(self, settings: AttentionSettings, **kwargs):
        super().__init__(**kwargs)
        s = settings
        self.settings = s
        self.sliding_window = int(s.sliding_window)
        self.score_divisor = float(s.score_divisor or s.head_dim)
        fp8_for = lambda name: s.fp8.for_layer(f"{s.fp8_path}/{name}") if s.fp8 else None
        self.num_query_heads = s.num_query_heads
        self.num_key_value_heads = s.num_key_value_heads
        self.head_dim = s.head_dim
        self.rope_theta = s.rope_theta
        self.rope_scaling = s.rope_scaling
        self.recompute_core = False  # set by the model's remat policy
        self.block_size = s.block_size
        E, H, K, D = s.hidden_dim, s.num_query_heads, s.num_key_value_heads, s.head_dim
        kw = dict(use_bias=s.use_bias if s.qkv_bias is None else s.qkv_bias,
                  init_std=s.init_std, dtype=self.dtype_policy)
        self.query = Projection("btd,dhk->bthk", (E, H, D), ("embed", "heads", "head_dim"),
                                output_axes=_HEADS, name="query", fp8=fp8_for("query"), **kw)
        self.key = Projection("btd,dhk->bthk", (E, K, D), ("embed", "kv_heads", "head_dim"),
                              output_axes=_KV_HEADS, name="key", fp8=fp8_for("key"), **kw)
        self.value = Projection("btd,dhk->bthk", (E, K, D), ("embed", "kv_heads", "head_dim"),
                                output_axes=_KV_HEADS, name="value", fp8=fp8_for("value"),
                                **kw)
        self.output_proj = Projection(
            "bthk,hkd->btd", (H, D, E), ("heads", "head_dim", "embed"), use_bias=s.use_bias,
            init_std=s.output_init_std,
            output_axes=("activation_batch", "activation_length", "activation_embed"),
            name="output", fp8=fp8_for("output"), dtype=self.dtype_policy)
        self.query_norm = self.key_norm = None
        if s.qk_norm_epsilon is not None:
            self.query_norm = RMSNorm(D, s.qk_norm_epsilon, s.qk_norm_zero_centered,
                                      name="query_norm", dtype=self.dtype_policy)
            self.key_norm = RMSNorm(D, s.qk_norm_epsilon, s.qk_norm_zero_centered,
                                    name="key_norm", dtype=self.dtype_policy)

    def build(self, input_shape=None):
        for layer in (self.query, self.key, self.value, self.output_proj, self.query_norm,
                      self.key_norm):
            if layer is not None:
                layer.build(None)

    def keys_per_head(self, k, v, repeat: bool = True):
        """Keys and values (B, S, K, D) laid out as the scores use them (length never
        split), repeated to one per query head (B, S, H, D) for grouped queries unless
        `repeat` is False (blocked attention groups the query heads instead)."""
        groups = self.num_query_heads // self.num_key_value_heads
        k, v = constrain(k, _KEYS, "keys"), constrain(v, _KEYS, "values")  # (B, S, K, D)
        if groups > 1 and repeat:  # each K head serves `groups` consecutive query heads
            k = constrain(tf.repeat(k, groups, axis=2), _KEYS_REPEATED)  # (B, S, H, D)
            v = constrain(tf.repeat(v, groups, axis=2), _KEYS_REPEATED)  # (B, S, H, D)
        return k, v

    def attend(self, q, k, v, attention_mask=None):
        """Scaled dot-product attention; q (B,T,H,D), k/v (B,S,K,D) -> (B,T,H,D).

        Scores and softmax are float32 whatever the compute dtype.

        Args:
          q, k, v: queries, keys and values.
          attention_mask: (B, T, S) bool, True where query t may see key s; None means
            causal with S == T (the training path).
        """
        k, v = self.keys_per_head(k, v)  # (B, S, H, D)
        scores = tf.einsum("bthd,bshd->bhts", q, k)  # (B, H, T, S)
        scores = tf.cast(scores, tf.float32) / math.sqrt(self.score_divisor)
        if attention_mask is None:
            length = tf.shape(scores)[-1]
            allowed = tf.linalg.band_part(tf.ones((length, length), tf.bool), -1, 0)  # (T, S)
            if self.sliding_window:
                allowed = allowed & window_mask(tf.range(length), length, self.sliding_window)
        else:
            allowed = tf.expand_dims(attention_mask, 1)  # (B, 1, T, S)
        # -1e30, not -inf: a query that sees no key (a left-pad slot) stays finite.
        scores = tf.where(allowed, scores, tf.constant(-1e30, tf.float32))
        probs = tf.cast(tf.nn.softmax(scores, axis=-1), v.dtype)  # (B, H, T, S)
        out = tf.einsum("bhts,bshd->bthd", probs, v)  # (B, T, H, D)
        return constrain(out, _HEADS)

    def attend_blocked(self, q, k, v, attention_mask=None, positions=None):
        """`attend` over blocks of `block_size` queries, each attending the keys it may
        see as tiles of up to `ROW_KEYS` keys, with an online softmax between tiles
        (tfllm.models.common.flash): same result up to float rounding (standard
        attention's bf16 roundings), and neither pass keeps more than one tile's scores,
        so activation memory grows linearly with the sequence; key blocks the causal mask
        or the window hides entirely are skipped. Training path only (causal masks).

        When the active setup splits the sequence into P pieces (batch over data and
        fsdp), query blocks are cut inside every piece: the queries are folded to
        (B, P, T/P, H, D) and a block takes queries a .. b-1 of each piece, so each
        device attends its own queries without gathering them.

        `positions` (B, T), the rows' positions 0 .. T-1 when not packed (see
        `tfllm.models.common.masks.row_positions`), or None: the causal tiles' masks are
        computed from them, else they are constants.
        """
        batch, length, heads, dim = q.shape
        pieces = split_count(q.shape, _HEADS, 1)
        local = length // pieces
        q = constrain(tf.reshape(q, (batch, pieces, local, heads, dim)), _FOLDED)  # (B,P,L,H,D)
        k, v = self.keys_per_head(k, v, repeat=False)  # (B, S, K, D)
        window, key_length = self.sliding_window, k.shape[1]
        if attention_mask is not None:  # (B, T, S) -> (B, P, L, S)
            attention_mask = constrain(
                tf.reshape(attention_mask, (batch, pieces, local, key_length)),
                _FOLDED_MASK, "mask")
        query_pos = np.arange(pieces)[:, None] * local + np.arange(local)[None, :]  # (P, L)
        if attention_mask is None and positions is not None:  # (B, T) -> (B, P, L)
            positions = constrain(tf.reshape(positions, (batch, pieces, local)),
                                  _FOLDED_MASK[:3], "positions")

        def mask_fn(qa, qb, ka, kb):
            if attention_mask is not None:  # packed: causal within segments (and window)
                return attention_mask[:, :, qa:qb, ka:kb]  # (B, P, t, s)
            rows = query_pos[:, qa:qb, None]  # (P, t, 1): static, so a tile every one of
            keys = np.arange(ka, kb)[None, None, :]  # whose pairs is allowed gets no mask
            allowed = keys <= rows
            if window:
                allowed &= rows - keys < window
            if allowed.all():
                return None
            if positions is None:
                return tf.constant(allowed[None])  # (1, P, t, s)
            # From the row's positions (0 .. T-1, computed in the program: masks'
            # row_positions): XLA computes the tile's mask inside the scores' select
            # instead of reading a folded (t, s) constant.
            rows = tf.expand_dims(positions[:, :, qa:qb], -1)  # (B, P, t, 1)
            keys = tf.constant(np.arange(ka, kb, dtype=np.int32))  # (s,)
            allowed = keys <= rows
            if window:
                allowed &= rows - keys < window
            return allowed  # (B, P, t, s)

        def key_span(qa, qb):
            return (max(0, qa - window + 1) if window else 0, int(query_pos[-1, qb - 1]))

        out = flash_attention(q, k, v, scale=1.0 / math.sqrt(self.score_divisor),
                              block_q=self.block_size, block_k=self.block_size,
                              max_keys=max(self.block_size, ROW_KEYS),
                              mask_fn=mask_fn, key_span=key_span)  # (B, P, L, H, D)
        return constrain(tf.reshape(out, (batch, length, heads, dim)), _HEADS)

    def call(self, x, attention_mask=None, positions=None, cache=None, cache_index=None):
        """Self-attention of x (B, T, E) -> (B, T, E), or ((B, T, E), new cache) with a cache.

        Args:
          x: the normalized residual stream.
          attention_mask: (B, T, S) bool (see `attend`); required with a cache, where
            S is the cache length.
          positions: (B, T) int RoPE positions, or None for 0 .. T-1.
          cache: (keys, values), each (B, S, K, D), or None for the training path.
          cache_index: int32 scalar, the cache slot of x's first token.
        """
        q, k, v = self.query(x), self.key(x), self.value(x)  # (B,T,H,D), (B,T,K,D) x2
        if self.query_norm is not None:
            q, k = self.query_norm(q), self.key_norm(k)
        if self.rope_theta is not None:
            q = rotary(q, self.rope_theta, positions, self.rope_scaling)
            k = rotary(k, self.rope_theta, positions, self.rope_scaling)
        if self.sliding_window and attention_mask is not None:
            # (B, T, S) & (T, S): the queries are cache slots index .. index+T-1 (or row
            # positions 0 .. T-1 when training), the keys slots (positions) 0 .. S-1.
            first = 0 if cache is None else tf.cast(cache_index, tf.int32)
            query_slots = first + tf.range(tf.shape(q)[1])
            attention_mask = attention_mask & tf.expand_dims(
                window_mask(query_slots, tf.shape(attention_mask)[-1], self.sliding_window), 0)
        if cache is None:
            if self.block_size and q.shape[1] is not None and q.shape[1] > self.block_size:
                return self.output_proj(self.attend_blocked(q, k, v, attention_mask,
                                                            positions))
            attend = recompute(self.attend) if self.recompute_core else self.attend
            return self.output_proj(attend(q, k, v, attention_mask))  # (B, T, E)
        if attention_mask is None:
            raise ValueError(f"{self.name}: a cache needs an attention_mask (B, T, S); call "
                             "the model through CausalLM.call_with_cache.")
        keys = write_cache(cache[0], k, cache_index)  # (B, S, K, D)
        values = write_cache(cache[1], v, cache_index)  # (B, S, K, D)
        out = self.output_proj(self.attend(q, keys, values, attention_mask))  # (B, T, E)
        return out, (keys, values)


def window_mask(query_slots, key_length, window: int):
    """(T, S) bool: True where key slot s is within the `window` keys ending at each query's
    slot (query_slots (T,) int32): query - s < window. (Causality is the caller's mask.)"""
    return (tf.expand_dims(query_slots, 1) - tf.expand_dims(tf.range(key_length), 0)
            < window)


def write_cache(cache, new, index):
    """`cache` (B, S, K, D) with slots index .. index+T-1 replaced by `new` (B, T, K, D).

    A gather and a select rather than a one-hot matmul, so that the written values are
    bit-exact whatever the matmul precision (TF32 on GPUs), and rather than
    dynamic_update_slice, which DTensor does not lay out.
    """
    slots, length = cache.shape[1], new.shape[1]
    offset = tf.range(slots) - index  # (S,) which new token lands in each slot
    written = (offset >= 0) & (offset < length)  # (S,)
    spread = tf.gather(new, tf.clip_by_value(offset, 0, length - 1), axis=1)  # (B, S, K, D)
    out = tf.where(tf.reshape(written, (1, slots, 1, 1)), spread, cache)
    return constrain(out, _KEYS, "kv_cache")
