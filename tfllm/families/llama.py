"""Llama (1, 2, 3, 3.1, 3.2): transformers' `llama`, keras-hub's Llama and Llama3 backbones."""

from __future__ import annotations

from tfllm.families import llama_layout as layout
from tfllm.families.base import Backbone, Family, PretrainedError

MODEL_TYPE = "llama"

_KEYS = frozenset({
    "vocabulary_size", "num_layers", "num_query_heads", "hidden_dim", "intermediate_dim",
    "num_key_value_heads", "rope_max_wavelength", "rope_position_scaling_factor",
    "rope_frequency_adjustment_factor", "rope_low_freq_factor", "rope_high_freq_factor",
    "rope_pretraining_sequence_length", "layer_norm_epsilon", "tie_word_embeddings"})


def _rope_kwargs(m) -> dict:
    """Llama(3)Backbone's RoPE arguments for the tfllm config."""
    out = {"rope_position_scaling_factor": 1.0}
    if m.rope_scaling == "linear":
        out["rope_position_scaling_factor"] = m.rope_scaling_factor
    elif m.rope_scaling == "llama3":
        out.update(rope_frequency_adjustment_factor=m.rope_scaling_factor,
                   rope_low_freq_factor=m.rope_low_freq_factor,
                   rope_high_freq_factor=m.rope_high_freq_factor,
                   rope_pretraining_sequence_length=m.rope_original_max_length)
    return out


def _backbone(name: str, description: str) -> Backbone:
    def fields(kh, max_length=None):
        factor = kh.get("rope_position_scaling_factor", 1.0)
        if factor and float(factor) != 1.0:
            # keras-hub's LlamaRotaryEmbedding (0.32) ignores it, so the preset's own
            # library does not apply the scaling its config names: refuse to guess.
            raise PretrainedError(f"{name} config: rope_position_scaling_factor={factor}"
                                  " is ignored by keras-hub's own Llama layers, so what the "
                                  "preset computes is ambiguous; tfllm imports Llama presets "
                                  "with 1.0 (or llama3 scaling).")
        return layout.model_fields(kh, kh.get("tie_word_embeddings", False), False, 1.0,
                                   None, max_length)

    def kwargs(m, original):
        layout.plain_attention(m, name)
        if m.rope_scaling == "linear":
            raise PretrainedError(f"{name}'s layers ignore linear RoPE scaling; export "
                                  "this model as QwenBackbone or MistralBackbone.")
        return {**layout.kwargs_common(m), **_rope_kwargs(m),
                "tie_word_embeddings": bool(m.tie_embeddings),
                "dropout": original.get("dropout", 0.0)}
    return Backbone(name, layout.MODEL_FAMILY, description, fields, kwargs,
                    layout.keras_hub_weight_map, _KEYS)


def _config_out(m, common: dict) -> dict:
    return {**layout.config_out(m, MODEL_TYPE, "LlamaForCausalLM", common),
            "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}


FAMILY = Family(
    model_type=MODEL_TYPE, architecture="LlamaForCausalLM",
    model_family=layout.MODEL_FAMILY,
    # what no other Llama-shaped family claims: no window, query/key norm or q/k/v bias,
    # and not a run imported from Mistral that is still Mistral-shaped
    writes=layout.writes(lambda m, backbone: not (
        m.sliding_window or m.qk_norm or m.qkv_bias
        or (backbone == "MistralBackbone" and not m.tie_embeddings))),
    config_out=_config_out, tensors=layout.tensors, lora=layout.LORA,
    keras_hub=(_backbone("LlamaBackbone", "Llama 2 (and Llama 1; linear RoPE scaling)"),
               _backbone("Llama3Backbone", "Llama 3, 3.1, 3.2 (llama3 RoPE scaling, tied "
                         "embeddings of 3.2 1B/3B)")),
    default_backbone=layout.default_backbone(
        "Llama3Backbone", lambda m: not m.qk_norm and not m.qkv_bias),
    refused=(layout.SILU, layout.NO_ATTENTION_BIAS,
             ("mlp_bias", lambda v, c: not v, "no MLP biases"), layout.PLAIN_HEAD_DIM))
