"""Llama: rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, untied head."""

from __future__ import annotations

from tfllm.models.causal_lm import CausalLM
from tfllm.models.common.attention import Attention, RopeScaling
from tfllm.models.common.layers import RMSNorm
from tfllm.models.common.mlp import GatedMLP


class Llama(CausalLM):
    """Llama architecture on `CausalLM`; see `CausalLM` for the hooks and arguments."""

    family_defaults = {"tie_embeddings": False, "use_bias": False}

    def __init__(self, config, dtype="float32", fp8=None, **kwargs):
        kwargs.setdefault("name", "llama")
        super().__init__(config, dtype=dtype, fp8=fp8, **kwargs)

    def make_norm(self, name):
        return RMSNorm(self.config.hidden_dim, self.config.norm_epsilon, name=name,
                       dtype=self.dtype_policy)

    def rope_scaling(self):
        """The config's RoPE scaling as a `RopeScaling`, or None."""
        c = self.config
        if c.rope_scaling == "none":
            return None
        return RopeScaling(c.rope_scaling, c.rope_scaling_factor, c.rope_low_freq_factor,
                           c.rope_high_freq_factor, c.rope_original_max_length)

    def make_attention(self, index):
        c = self.config
        return Attention(c.hidden_dim, c.num_query_heads, self.num_key_value_heads,
                         self.head_dim, use_bias=self.use_bias, rope_theta=c.rope_theta,
                         init_std=c.init_std, output_init_std=self.output_init_std,
                         fp8=self.fp8, fp8_path=f"block_{index}/attention", name="attention",
                         rope_scaling=self.rope_scaling(), qkv_bias=c.qkv_bias,
                         query_chunk=c.attention_chunk,
                         qk_norm_epsilon=c.norm_epsilon if c.qk_norm else None,
                         dtype=self.dtype_policy)

    def make_mlp(self, index):
        c = self.config
        return GatedMLP(c.hidden_dim, c.intermediate_dim, use_bias=self.use_bias,
                        init_std=c.init_std, output_init_std=self.output_init_std,
                        fp8=self.fp8, fp8_path=f"block_{index}/mlp", name="mlp",
                        dtype=self.dtype_policy)
