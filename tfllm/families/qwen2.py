"""Qwen2 / Qwen2.5: transformers' `qwen2`, keras-hub's QwenBackbone (q/k/v biases)."""

from __future__ import annotations

from tfllm.families import llama_layout as layout
from tfllm.families.base import Backbone, Family

MODEL_TYPE = "qwen2"
BACKBONE = "QwenBackbone"

_KEYS = frozenset({"vocabulary_size", "num_layers", "num_query_heads", "hidden_dim",
                   "intermediate_dim", "num_key_value_heads", "rope_max_wavelength",
                   "rope_scaling_factor", "layer_norm_epsilon", "tie_word_embeddings",
                   "use_sliding_window_attention", "sliding_window_size"})


def _fields(kh, max_length=None):
    window = kh.get("sliding_window_size") if kh.get("use_sliding_window_attention") \
        else None
    return layout.model_fields(kh, kh.get("tie_word_embeddings", True), True,
                               kh.get("rope_scaling_factor", 1.0), window, max_length)


def _kwargs(m, original):
    layout.no_llama3(m, BACKBONE)
    return {**layout.kwargs_common(m), "tie_word_embeddings": bool(m.tie_embeddings),
            "rope_scaling_factor": layout.linear_factor(m),
            "use_sliding_window_attention": original.get("use_sliding_window_attention",
                                                         False),
            "sliding_window_size": original.get("sliding_window_size", 32768),
            "dropout": original.get("dropout", 0.0)}


def _config_out(m, common: dict) -> dict:
    return {**layout.config_out(m, MODEL_TYPE, "Qwen2ForCausalLM", common),
            **layout.full_attention_keys(m)}


FAMILY = Family(
    model_type=MODEL_TYPE, architecture="Qwen2ForCausalLM",
    model_family=layout.MODEL_FAMILY,
    writes=layout.writes(lambda m, backbone: not m.sliding_window and not m.qk_norm
                         and m.qkv_bias),
    config_out=_config_out, tensors=layout.tensors, lora=layout.LORA,
    keras_hub=(Backbone(BACKBONE, layout.MODEL_FAMILY, "Qwen2 / Qwen2.5 (q/k/v biases)",
                        _fields, _kwargs, layout.keras_hub_weight_map, _KEYS),),
    default_backbone=layout.default_backbone(
        BACKBONE, lambda m: not m.qk_norm and bool(m.qkv_bias)),
    refused=(layout.SILU, layout.PLAIN_HEAD_DIM))
