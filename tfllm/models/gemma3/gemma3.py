"""Gemma 3 (text): Llama's attention and RoPE with Gemma's embedding scale, zero-centred
RMSNorms before and after each sublayer, a GeGLU MLP, query/key norms, and local
(sliding-window) layers interleaved with global ones, each kind with its own RoPE base."""

from __future__ import annotations

import math

import tensorflow as tf

from tfllm.models.causal_lm import Block
from tfllm.models.common.attention import Attention
from tfllm.models.common.layers import RMSNorm
from tfllm.models.common.mlp import GatedMLP
from tfllm.models.llama.llama import Llama


class Gemma3(Llama):
    """Gemma 3's text decoder (transformers' Gemma3ForCausalLM) on `CausalLM`.

    Norm scales are stored zero-centred, as Gemma checkpoints store them (the norm
    multiplies by 1 + scale). Which layers are local comes from model.sliding_window and
    model.sliding_window_pattern; their RoPE base from model.rope_local_theta.
    """

    family_defaults = {"tie_embeddings": True, "use_bias": False}

    def __init__(self, config, dtype="float32", fp8=None, **kwargs):
        kwargs.setdefault("name", "gemma3")
        super().__init__(config, dtype=dtype, fp8=fp8, **kwargs)

    def make_norm(self, name):
        return RMSNorm(self.config.hidden_dim, self.config.norm_epsilon, zero_centered=True,
                       name=name, dtype=self.dtype_policy)

    def make_attention(self, index):
        c = self.config
        return Attention(c.hidden_dim, c.num_query_heads, self.num_key_value_heads,
                         self.head_dim, use_bias=self.use_bias,
                         init_std=c.init_std, output_init_std=self.output_init_std,
                         fp8=self.fp8, fp8_path=f"block_{index}/attention", name="attention",
                         qkv_bias=c.qkv_bias, query_chunk=c.attention_chunk,
                         qk_norm_epsilon=c.norm_epsilon, qk_norm_zero_centered=True,
                         score_divisor=c.query_pre_attn_scalar or None,
                         dtype=self.dtype_policy, **self.attention_settings(index))

    def make_mlp(self, index):
        c = self.config
        return GatedMLP(c.hidden_dim, c.intermediate_dim, use_bias=self.use_bias,
                        init_std=c.init_std, output_init_std=self.output_init_std,
                        fp8=self.fp8, fp8_path=f"block_{index}/mlp", name="mlp",
                        activation="gelu_tanh", dtype=self.dtype_policy)

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
