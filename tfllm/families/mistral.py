"""Mistral: transformers' `mistral`, keras-hub's MistralBackbone (one sliding window in
every layer: tfllm stops at the window length, where full attention equals it)."""

from __future__ import annotations

from tfllm.families import llama_layout as layout
from tfllm.families.base import Backbone, Family, PretrainedError

MODEL_TYPE = "mistral"
BACKBONE = "MistralBackbone"

_KEYS = frozenset({"vocabulary_size", "num_layers", "num_query_heads", "hidden_dim",
                   "intermediate_dim", "num_key_value_heads", "rope_max_wavelength",
                   "rope_scaling_factor", "layer_norm_epsilon", "sliding_window",
                   "head_dim"})


def _fields(kh, max_length=None):
    return layout.model_fields(kh, False, False, kh.get("rope_scaling_factor", 1.0),
                               kh.get("sliding_window"), max_length)


def _kwargs(m, original):
    layout.no_llama3(m, BACKBONE)
    if m.tie_embeddings or m.qkv_bias:
        raise PretrainedError("MistralBackbone has untied embeddings and no biases; "
                              "export this model as Llama3Backbone or QwenBackbone.")
    return {**layout.kwargs_common(m), "head_dim": m.head_dim or None,
            "rope_scaling_factor": layout.linear_factor(m),
            "sliding_window": m.sliding_window or original.get("sliding_window",
                                                                m.max_sequence_length),
            "dropout": original.get("dropout", 0.0)}


def _writes(m, backbone) -> bool:
    if m.sliding_window:  # transformers' Mistral: one window in every layer
        if (m.sliding_window_pattern or m.rope_local_theta or m.qk_norm or m.qkv_bias
                or m.tie_embeddings or m.query_pre_attn_scalar):
            raise PretrainedError(
                f"model.sliding_window={m.sliding_window} on the llama family is written as "
                "Mistral, which has one window in every layer, untied embeddings and no "
                "biases, query/key norms, local RoPE base or query_pre_attn_scalar; this "
                "model has no transformers counterpart.")
        return True
    # a run imported from Mistral stays Mistral while it is Mistral-shaped
    return (backbone == BACKBONE and not m.qk_norm and not m.qkv_bias
            and not m.tie_embeddings)


def _config_out(m, common: dict) -> dict:
    return {**layout.config_out(m, MODEL_TYPE, "MistralForCausalLM", common),
            "sliding_window": m.sliding_window or None}


FAMILY = Family(
    model_type=MODEL_TYPE, architecture="MistralForCausalLM",
    model_family=layout.MODEL_FAMILY, writes=layout.writes(_writes),
    config_out=_config_out, tensors=layout.tensors, lora=layout.LORA,
    keras_hub=(Backbone(BACKBONE, layout.MODEL_FAMILY, "Mistral (sliding window: tfllm "
                        "stops at the window length, where full attention equals it)",
                        _fields, _kwargs, layout.keras_hub_weight_map, _KEYS),),
    default_backbone=lambda m: None,  # a llama-family run exports as Llama 3 or Qwen
    refused=(layout.SILU,))
