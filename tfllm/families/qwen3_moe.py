"""Qwen3-MoE: transformers' `qwen3_moe` (Qwen3-30B-A3B, Qwen3-235B-A22B), keras-hub's
Qwen3MoeBackbone: Qwen3's attention (query/key RMSNorm, no biases) and a mixture of
experts routed by the softmax over all experts, then the top k (renormalized when
norm_topk_prob), on the layers its decoder_sparse_step and mlp_only_layers name; the
others keep a dense MLP.

keras-hub's Qwen3MoeBackbone routes as transformers does (softmax over all, top k,
norm_top_k_prob). Its attention normalizes queries and keys with epsilon 1e-6 whatever
layer_norm_epsilon says (0.32 does not pass it on), where transformers uses rms_norm_eps
for every norm: a preset or run with another epsilon is refused. Its training aux loss
is coefficient x each sparse layer's load-balancing loss, summed over layers; tfllm's
(transformers') is one loss over all layers' router choices together: the coefficient
carries over, the training losses differ (inference does not).
"""

from __future__ import annotations

from tfllm.families import llama_layout as layout
from tfllm.families import moe_layout as moe
from tfllm.families.base import Backbone, Family, PretrainedError, config_reader, head_dim

MODEL_TYPE = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"
BACKBONE = "Qwen3MoeBackbone"

#: keras-hub's Qwen3MoeAttention normalizes queries and keys with its default epsilon
QK_NORM_EPSILON = 1e-6

_KEYS = frozenset({"vocabulary_size", "num_layers", "num_query_heads", "num_key_value_heads",
                   "hidden_dim", "intermediate_dim", "moe_intermediate_dim", "num_experts",
                   "head_dim", "top_k", "norm_top_k_prob", "decoder_sparse_step",
                   "rope_max_wavelength", "rope_scaling_factor", "layer_norm_epsilon",
                   "tie_word_embeddings", "sliding_window_size",
                   "router_aux_loss_coefficient", "mlp_only_layers"})
_SPARSE, _DENSE = "qwen3_sparse_moe_block", "qwen3_moe_mlp"  # created without names


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


# ---- keras-hub --------------------------------------------------------------------------
def _check(kh: dict, where: str) -> None:
    eps = float(kh.get("layer_norm_epsilon", QK_NORM_EPSILON))
    if eps != QK_NORM_EPSILON:
        raise PretrainedError(f"{where}: layer_norm_epsilon={eps} with keras-hub's "
                              f"{BACKBONE}, whose query/key norms use {QK_NORM_EPSILON} "
                              "whatever it says; tfllm (as transformers) has one epsilon for "
                              "every norm, so this preset's logits cannot be matched.")


def _fields(kh, max_length=None):
    fields = layout.model_fields(kh, kh.get("tie_word_embeddings", False), False,
                                 kh.get("rope_scaling_factor", 1.0),
                                 kh.get("sliding_window_size"), max_length, qk_norm=True)
    return moe.keras_hub_fields(
        kh, fields, moe_intermediate_dim=int(kh["moe_intermediate_dim"]),
        moe_routing="softmax_then_topk", norm_topk_prob=bool(kh["norm_top_k_prob"]),
        decoder_sparse_step=int(kh["decoder_sparse_step"]),
        mlp_only_layers=[int(i) for i in kh.get("mlp_only_layers") or []],
        router_aux_loss_coef=float(kh["router_aux_loss_coefficient"]))


def _kwargs(m, original):
    layout.no_llama3(m, BACKBONE)
    moe.keras_hub_refuse(BACKBONE, (
        (m.qkv_bias or not m.qk_norm, "a model without query/key norms or with q/k/v "
         "biases (model.qk_norm=true, model.qkv_bias=null)"),
        (m.moe_routing != "softmax_then_topk", "model.moe_routing=topk_then_softmax "
         "(Mixtral's; export it as MixtralBackbone)"),
        (float(m.norm_epsilon) != QK_NORM_EPSILON, f"model.norm_epsilon={m.norm_epsilon} "
         f"(its query/key norms use {QK_NORM_EPSILON})"),
        moe.capacity_problem(m)))
    return {**layout.kwargs_common(m), "head_dim": head_dim(m),
            "moe_intermediate_dim": m.moe_intermediate_dim or m.intermediate_dim,
            "num_experts": m.num_experts, "top_k": m.num_experts_per_tok,
            "norm_top_k_prob": bool(m.norm_topk_prob),
            "decoder_sparse_step": m.decoder_sparse_step,
            "mlp_only_layers": list(m.mlp_only_layers),
            "router_aux_loss_coefficient": float(m.router_aux_loss_coef),
            "tie_word_embeddings": bool(m.tie_embeddings),
            "rope_scaling_factor": layout.linear_factor(m),
            "sliding_window_size": original.get("sliding_window_size"),
            "dropout": original.get("dropout", 0.0)}


def _weight_map(m):
    return moe.keras_hub_weight_map(m, _SPARSE, _DENSE, fused_gate_up=True)


FAMILY = Family(
    model_type=MODEL_TYPE, architecture=ARCHITECTURE, model_family=layout.MODEL_FAMILY,
    writes=moe.writes(MODEL_TYPE, _chosen), config_out=_config_out,
    tensors=moe.tensors_of(moe.QWEN3_MOE_NAMES, qk_norm=True), lora=moe.LORA,
    keras_hub=(Backbone(BACKBONE, layout.MODEL_FAMILY, "Qwen3-MoE (experts on the layers "
                        "decoder_sparse_step and mlp_only_layers name; query/key RMSNorm)",
                        _fields, _kwargs, _weight_map, _KEYS, unnamed=(_SPARSE, _DENSE),
                        check=_check),),
    default_backbone=lambda m: (BACKBONE if m.family == layout.MODEL_FAMILY
                                and m.num_experts and m.qk_norm else None),
    config_in=config_reader(_read),
    tensors_in=moe.tensors_in(moe.QWEN3_MOE_NAMES, qk_norm=True))
