"""Mixtral: transformers' `mixtral` (Mixtral 8x7B, 8x22B): Mistral's attention and a
mixture of experts in every layer, routed by the softmax over the top k router logits."""

from __future__ import annotations

from tfllm.families import llama_layout as layout
from tfllm.families import moe_layout as moe
from tfllm.families.base import Family, config_reader

MODEL_TYPE = "mixtral"
ARCHITECTURE = "MixtralForCausalLM"


def _read(c: dict, where: str) -> dict:
    if c.get("router_jitter_noise"):
        # Multiplicative noise on the router's input in training only: inference is the
        # same, but training would differ from transformers'.
        moe.refuse(where, "router_jitter_noise", c["router_jitter_noise"],
                   "no router jitter (set it to 0.0)")
    fields = {**moe.common_in(c, where), "qk_norm": False,
              "num_experts": int(c["num_local_experts"]),
              "moe_intermediate_dim": int(c["intermediate_size"]),
              "moe_routing": "topk_then_softmax", "norm_topk_prob": True,
              "decoder_sparse_step": 1, "mlp_only_layers": []}
    window = c.get("sliding_window")
    if window:  # full attention equals the window's on sequences no longer than it
        fields["max_sequence_length"] = min(fields["max_sequence_length"], int(window))
    return fields


def _config_out(m, common: dict) -> dict:
    return {**moe.config_out(m, MODEL_TYPE, ARCHITECTURE, common),
            "num_local_experts": m.num_experts, "sliding_window": None,
            "router_jitter_noise": 0.0}


def _chosen(m) -> bool:
    if m.qk_norm:
        return False
    width = m.moe_intermediate_dim or m.intermediate_dim
    problems = [what for bad, what in (
        (m.moe_routing != "topk_then_softmax", "model.moe_routing=softmax_then_topk "
         "(Qwen3-MoE's routing; its folders have query/key norms)"),
        (m.qkv_bias, "q/k/v biases"), (m.tie_embeddings, "tied embeddings"),
        (m.sliding_window, "a sliding window"),
        (m.decoder_sparse_step != 1 or m.mlp_only_layers, "dense layers (experts in every "
         "layer only)"),
        (width != m.intermediate_dim, f"model.moe_intermediate_dim={width} apart from "
         f"model.intermediate_dim={m.intermediate_dim} (one intermediate_size)")) if bad]
    if problems:
        moe.cannot(MODEL_TYPE, problems[0])
    return True


FAMILY = Family(
    model_type=MODEL_TYPE, architecture=ARCHITECTURE, model_family=layout.MODEL_FAMILY,
    writes=moe.writes(MODEL_TYPE, _chosen), config_out=_config_out,
    tensors=moe.tensors_of(moe.MIXTRAL_NAMES, qk_norm=False), lora=moe.LORA,
    keras_hub=(), default_backbone=lambda m: None,
    config_in=config_reader(_read),
    tensors_in=moe.tensors_in(moe.MIXTRAL_NAMES, qk_norm=False))
