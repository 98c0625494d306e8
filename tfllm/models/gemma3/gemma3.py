"""Gemma 3 (text): Llama's attention and RoPE with Gemma's embedding scale, zero-centred
RMSNorms before and after each sublayer, a GeGLU MLP, query/key norms, and local
(sliding-window) layers interleaved with global ones, each kind with its own RoPE base."""

from __future__ import annotations

import math

import tensorflow as tf

from tfllm.models.causal_lm import Block
from tfllm.models.llama.llama import Llama


class Gemma3(Llama):
    """Gemma 3's text decoder (transformers' Gemma3ForCausalLM) on `CausalLM`.

    Norm scales are stored zero-centred, as Gemma checkpoints store them (the norm
    multiplies by 1 + scale). Which layers are local comes from model.sliding_window and
    model.sliding_window_pattern; their RoPE base from model.rope_local_theta.
    """

    family_defaults = {"tie_embeddings": True, "use_bias": False}
    mlp_activation = "gelu_tanh"
    zero_centered_norms = True

    def __init__(self, config, dtype="float32", fp8=None, **kwargs):
        kwargs.setdefault("name", "gemma3")
        super().__init__(config, dtype=dtype, fp8=fp8, **kwargs)

    @property
    def qk_norm(self) -> bool:
        return True  # every Gemma 3 normalizes queries and keys

    def make_block(self, index):
        return Block(self.make_attention(index), self.make_mlp(index),
                     self.make_norm("attention_norm"), self.make_norm("mlp_norm"),
                     attention_post_norm=self.make_norm("attention_post_norm"),
                     mlp_post_norm=self.make_norm("mlp_post_norm"),
                     name=f"block_{index}", dtype=self.dtype_policy)

    def embed(self, token_ids, positions=None):
        x = self.token_embedding(token_ids)
        # sqrt(hidden_dim) rounded to the compute dtype, as transformers and keras-hub do
        return x * tf.cast(math.sqrt(self.config.hidden_dim), x.dtype)
