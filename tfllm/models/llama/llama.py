"""Llama: rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, untied head."""

from __future__ import annotations

from tfllm.families import is_local_layer, is_moe_layer
from tfllm.models.causal_lm import CausalLM
from tfllm.models.common.attention import Attention, AttentionSettings, RopeScaling
from tfllm.models.common.layers import RMSNorm
from tfllm.models.common.mlp import GatedMLP
from tfllm.models.common.moe import MoeMLP


class Llama(CausalLM):
    """Llama architecture on `CausalLM`; see `CausalLM` for the hooks and arguments."""

    family_defaults = {"tie_embeddings": False, "use_bias": False}
    #: the gated MLP's activation (`tfllm.models.common.mlp.GATED_ACTIVATIONS`)
    mlp_activation = "silu"
    #: RMSNorm scales applied as (1 + scale), stored zero-centred (Gemma)
    zero_centered_norms = False

    def __init__(self, config, dtype="float32", fp8=None, **kwargs):
        kwargs.setdefault("name", "llama")
        super().__init__(config, dtype=dtype, fp8=fp8, **kwargs)

    def make_norm(self, name):
        return RMSNorm(self.config.hidden_dim, self.config.norm_epsilon,
                       zero_centered=self.zero_centered_norms, name=name,
                       dtype=self.dtype_policy)

    def rope_scaling(self):
        """The config's RoPE scaling as a `RopeScaling`, or None."""
        c = self.config
        if c.rope_scaling == "none":
            return None
        return RopeScaling(c.rope_scaling, c.rope_scaling_factor, c.rope_low_freq_factor,
                           c.rope_high_freq_factor, c.rope_original_max_length)

    def is_local(self, index: int) -> bool:
        """Whether block `index` attends within model.sliding_window (see the config)."""
        return is_local_layer(self.config, index)

    def attention_settings(self, index: int) -> AttentionSettings:
        """Block `index`'s attention: local and global layers differ (a local layer has the
        window, model.rope_local_theta and no RoPE scaling)."""
        c = self.config
        local = self.is_local(index)
        return AttentionSettings(
            c.hidden_dim, c.num_query_heads, self.num_key_value_heads, self.head_dim,
            use_bias=self.use_bias, qkv_bias=c.qkv_bias,
            rope_theta=(c.rope_local_theta or c.rope_theta) if local else c.rope_theta,
            rope_scaling=None if local else self.rope_scaling(),
            block_size=c.attention_chunk, init_std=c.init_std,
            output_init_std=self.output_init_std, fp8=self.fp8,
            fp8_path=f"block_{index}/attention",
            qk_norm_epsilon=c.norm_epsilon if self.qk_norm else None,
            qk_norm_zero_centered=self.zero_centered_norms,
            sliding_window=c.sliding_window if local else 0,
            score_divisor=c.query_pre_attn_scalar or None)

    def make_attention(self, index):
        return Attention(self.attention_settings(index), name="attention",
                         dtype=self.dtype_policy)

    @property
    def qk_norm(self) -> bool:
        """Whether attention normalizes queries and keys (model.qk_norm)."""
        return self.config.qk_norm

    def make_mlp(self, index):
        c = self.config
        if is_moe_layer(c, index):  # Qwen3-MoE, Mixtral
            return MoeMLP(c.hidden_dim, c.moe_intermediate_dim or c.intermediate_dim,
                          c.num_experts, c.num_experts_per_tok, routing=c.moe_routing,
                          normalize_top_k=c.norm_topk_prob,
                          capacity_factor=c.moe_capacity_factor or None,
                          dispatch=c.moe_dispatch, init_std=c.init_std,
                          output_init_std=self.output_init_std,
                          activation=self.mlp_activation,
                          fp8=self.fp8, fp8_path=f"block_{index}/mlp", name="mlp", dtype=self.dtype_policy)
        return GatedMLP(c.hidden_dim, c.intermediate_dim, use_bias=self.use_bias,
                        init_std=c.init_std, output_init_std=self.output_init_std,
                        fp8=self.fp8, fp8_path=f"block_{index}/mlp", name="mlp",
                        activation=self.mlp_activation, dtype=self.dtype_policy)
