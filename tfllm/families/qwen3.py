"""Qwen3 dense models: transformers' `qwen3`, keras-hub's Qwen3Backbone (query/key
RMSNorm, no biases)."""

from __future__ import annotations

from tfllm.families import llama_layout as layout
from tfllm.families.base import Backbone, Family, PretrainedError, head_dim

MODEL_TYPE = "qwen3"
BACKBONE = "Qwen3Backbone"

_KEYS = frozenset({"vocabulary_size", "num_layers", "num_query_heads", "hidden_dim",
                   "intermediate_dim", "num_key_value_heads", "rope_max_wavelength",
                   "rope_scaling_factor", "layer_norm_epsilon", "tie_word_embeddings",
                   "sliding_window_size", "head_dim"})


def _fields(kh, max_length=None):
    factor = kh.get("rope_scaling_factor", 1.0)
    return layout.model_fields(kh, kh.get("tie_word_embeddings", True), False, factor,
                               kh.get("sliding_window_size"), max_length, qk_norm=True)


def _kwargs(m, original):
    layout.no_llama3(m, BACKBONE)
    if m.qkv_bias or not m.qk_norm:
        raise PretrainedError("Qwen3Backbone has query/key norms and no biases "
                              "(model.qk_norm=true, model.qkv_bias=null).")
    return {**layout.kwargs_common(m), "head_dim": head_dim(m),
            "tie_word_embeddings": bool(m.tie_embeddings),
            "rope_scaling_factor": layout.linear_factor(m),
            "sliding_window_size": original.get("sliding_window_size"),
            "dropout": original.get("dropout", 0.0)}


def _writes(m, backbone) -> bool:
    if m.sliding_window or not m.qk_norm:
        return False
    if m.qkv_bias:
        raise PretrainedError("a model with query/key norms (model.qk_norm, Qwen3) and "
                              "q/k/v biases has no transformers counterpart.")
    return True


def _config_out(m, common: dict) -> dict:
    return {**layout.config_out(m, MODEL_TYPE, "Qwen3ForCausalLM", common),
            "attention_bias": False, **layout.full_attention_keys(m)}


FAMILY = Family(
    model_type=MODEL_TYPE, architecture="Qwen3ForCausalLM",
    model_family=layout.MODEL_FAMILY, writes=layout.writes(_writes),
    config_out=_config_out, tensors=layout.tensors, lora=layout.LORA,
    keras_hub=(Backbone(BACKBONE, layout.MODEL_FAMILY, "Qwen3 dense models (query/key "
                        "RMSNorm)", _fields, _kwargs, layout.keras_hub_weight_map, _KEYS),),
    default_backbone=layout.default_backbone(BACKBONE, lambda m: bool(m.qk_norm)),
    refused=(layout.SILU, layout.NO_ATTENTION_BIAS))
