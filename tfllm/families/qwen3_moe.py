"""Qwen3-MoE: transformers' `qwen3_moe` (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's
attention (query/key RMSNorm, no biases) and a mixture of experts routed by the softmax
over all experts, then the top k (renormalized when norm_topk_prob), on the layers its
decoder_sparse_step and mlp_only_layers name; the others keep a dense MLP."""

from __future__ import annotations

from tfllm.families import llama_layout as layout
from tfllm.families import moe_layout as moe
from tfllm.families.base import Family, config_reader

MODEL_TYPE = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"


def _read(c: dict, where: str) -> dict:
    shared = c.get("shared_expert_intermediate_size")
    if shared:
        moe.refuse(where, "shared_expert_intermediate_size", shared, "no shared expert")
    return {**moe.common_in(c, where), "qk_norm": True,
            # transformers 5 writes num_local_experts, transformers 4 num_experts
            "num_experts": int(c.get("num_local_experts") or c["num_experts"]),
            "moe_intermediate_dim": int(c["moe_intermediate_size"]),
            "moe_routing": "softmax_then_topk",
            "norm_topk_prob": bool(c.get("norm_topk_prob", False)),
            "decoder_sparse_step": int(c.get("decoder_sparse_step", 1)),
            "mlp_only_layers": [int(i) for i in c.get("mlp_only_layers") or []]}


def _config_out(m, common: dict) -> dict:
    return {**moe.config_out(m, MODEL_TYPE, ARCHITECTURE, common),
            "attention_bias": False, **layout.full_attention_keys(m),
            "num_experts": m.num_experts,
            "moe_intermediate_size": m.moe_intermediate_dim or m.intermediate_dim,
            "norm_topk_prob": bool(m.norm_topk_prob),
            "decoder_sparse_step": m.decoder_sparse_step,
            "mlp_only_layers": list(m.mlp_only_layers)}


def _chosen(m) -> bool:
    if not m.qk_norm:
        return False
    if m.moe_routing != "softmax_then_topk":
        moe.cannot(MODEL_TYPE, "model.moe_routing=topk_then_softmax (Mixtral's, which has "
                   "no query/key norms)")
    if m.qkv_bias:
        moe.cannot(MODEL_TYPE, "q/k/v biases")
    return True


FAMILY = Family(
    model_type=MODEL_TYPE, architecture=ARCHITECTURE, model_family=layout.MODEL_FAMILY,
    writes=moe.writes(MODEL_TYPE, _chosen), config_out=_config_out,
    tensors=moe.tensors_of(moe.QWEN3_MOE_NAMES, qk_norm=True), lora=moe.LORA,
    keras_hub=(), default_backbone=lambda m: None,
    config_in=config_reader(_read),
    tensors_in=moe.tensors_in(moe.QWEN3_MOE_NAMES, qk_norm=True))
