"""GPT (GPT-2 style): learned positions, LayerNorm, GELU MLP, tied embeddings, biases."""

from __future__ import annotations

from tfllm.models.causal_lm import CausalLM
from tfllm.models.common.attention import Attention, AttentionSettings
from tfllm.models.common.layers import LayerNorm, PositionEmbedding
from tfllm.models.common.mlp import MLP


class GPT(CausalLM):
    """GPT-2 architecture on `CausalLM`; see `CausalLM` for the hooks and arguments."""

    family_defaults = {"tie_embeddings": True, "use_bias": True}

    def __init__(self, config, dtype="float32", fp8=None, **kwargs):
        kwargs.setdefault("name", "gpt")
        super().__init__(config, dtype=dtype, fp8=fp8, **kwargs)
        self.position_embedding = PositionEmbedding(
            config.max_sequence_length, config.hidden_dim, config.init_std,
            name="position_embedding", dtype=dtype)

    def make_norm(self, name):
        return LayerNorm(self.config.hidden_dim, self.config.norm_epsilon, name=name,
                         dtype=self.dtype_policy)

    def make_attention(self, index):
        c = self.config
        return Attention(AttentionSettings(
            c.hidden_dim, c.num_query_heads, self.num_key_value_heads, self.head_dim,
            use_bias=self.use_bias, qkv_bias=c.qkv_bias, rope_theta=None,
            block_size=c.attention_chunk, init_std=c.init_std,
            output_init_std=self.output_init_std, fp8=self.fp8,
            fp8_path=f"block_{index}/attention"), name="attention", dtype=self.dtype_policy)

    def make_mlp(self, index):
        c = self.config
        return MLP(c.hidden_dim, c.intermediate_dim, use_bias=self.use_bias,
                   init_std=c.init_std, output_init_std=self.output_init_std, fp8=self.fp8,
                   fp8_path=f"block_{index}/mlp", name="mlp", dtype=self.dtype_policy)

    def build(self, input_shape=None):
        self.position_embedding.build(None)
        super().build(input_shape)

    def embed(self, token_ids, positions=None):
        x = self.token_embedding(token_ids)  # (B, T, E)
        if positions is None:
            return self.position_embedding(x)
        return self.position_embedding(x, positions=positions)
