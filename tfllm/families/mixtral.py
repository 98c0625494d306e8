"""Mixtral: transformers' `mixtral` (Mixtral 8x7B, 8x22B), keras-hub's MixtralBackbone:
Mistral's attention and a mixture of experts in every layer, routed by the softmax over
the top k router logits.

keras-hub's MixtralBackbone takes the softmax over all experts, then the top k,
renormalized: equal to transformers' routing in exact arithmetic (they differ by
rounding). It has untied embeddings, head_dim = hidden_dim / num_query_heads and one
intermediate_dim for its experts, so tfllm refuses to export a model outside those. Its
router_jitter_noise multiplies the tokens by U(1 - j, 1 + j) in training, before router
and experts, as transformers' does; tfllm has no jitter setting and refuses j > 0 (as for
a Hugging Face folder). Its training aux loss is router_aux_loss_coef x each layer's
load-balancing loss, summed over layers; tfllm's (transformers') is one loss over all
layers' router choices together: the coefficient carries over, the training losses
differ (inference does not).
"""

from __future__ import annotations

from tfllm.families import llama_layout as layout
from tfllm.families import moe_layout as moe
from tfllm.families.base import Backbone, Family, config_reader, head_dim

MODEL_TYPE = "mixtral"
ARCHITECTURE = "MixtralForCausalLM"
BACKBONE = "MixtralBackbone"

_KEYS = frozenset({"vocabulary_size", "num_layers", "num_query_heads", "hidden_dim",
                   "intermediate_dim", "num_key_value_heads", "num_experts", "top_k",
                   "router_jitter_noise", "rope_max_wavelength", "rope_scaling_factor",
                   "layer_norm_epsilon", "router_aux_loss_coef", "sliding_window",
                   "output_router_logits"})
_SPARSE = "mixtral_sparse_moe_block"  # created without a name


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


def _problems(m):
    """(bad, what) of what Mixtral (transformers' and keras-hub's) cannot express."""
    width = m.moe_intermediate_dim or m.intermediate_dim
    return ((m.moe_routing != "topk_then_softmax", "model.moe_routing=softmax_then_topk "
             "(Qwen3-MoE's routing; its folders have query/key norms)"),
            (m.qkv_bias, "q/k/v biases"), (m.tie_embeddings, "tied embeddings"),
            (m.sliding_window, "a sliding window"),
            (m.decoder_sparse_step != 1 or m.mlp_only_layers, "dense layers (experts in "
             "every layer only)"),
            (width != m.intermediate_dim, f"model.moe_intermediate_dim={width} apart from "
             f"model.intermediate_dim={m.intermediate_dim} (one intermediate_size)"))


def _chosen(m) -> bool:
    if m.qk_norm:
        return False
    problems = [what for bad, what in _problems(m) if bad]
    if problems:
        moe.cannot(MODEL_TYPE, problems[0])
    return True


# ---- keras-hub --------------------------------------------------------------------------
def _check(kh: dict, where: str) -> None:
    for key, computes in (("router_jitter_noise", "no router jitter (set it to 0.0)"),
                          ("output_router_logits", "layers that return hidden states only")):
        if kh.get(key):
            moe.refuse(where, key, kh[key], computes)


def _fields(kh, max_length=None):
    fields = layout.model_fields(kh, False, False, kh.get("rope_scaling_factor", 1.0),
                                 kh.get("sliding_window"), max_length)
    return moe.keras_hub_fields(
        kh, fields, moe_intermediate_dim=int(kh["intermediate_dim"]),
        moe_routing="topk_then_softmax", norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], router_aux_loss_coef=float(kh["router_aux_loss_coef"]))


def _kwargs(m, original):
    layout.no_llama3(m, BACKBONE)
    moe.keras_hub_refuse(BACKBONE, (
        (m.qk_norm, "query/key norms (Qwen3-MoE's; export it as Qwen3MoeBackbone)"),
        *_problems(m),
        (head_dim(m) * m.num_query_heads != m.hidden_dim, f"model.head_dim={head_dim(m)} "
         f"apart from hidden_dim / num_query_heads = {m.hidden_dim // m.num_query_heads}"),
        moe.capacity_problem(m)))
    return {**layout.kwargs_common(m), "num_experts": m.num_experts,
            "top_k": m.num_experts_per_tok, "router_jitter_noise": 0.0,
            "rope_scaling_factor": layout.linear_factor(m),
            "router_aux_loss_coef": float(m.router_aux_loss_coef),
            # full attention unless the preset it came from had a window (tfllm then
            # stops at it, where the two are equal)
            "sliding_window": original.get("sliding_window"),
            "dropout": original.get("dropout", 0.0)}


def _weight_map(m):
    return moe.keras_hub_weight_map(m, _SPARSE)


FAMILY = Family(
    model_type=MODEL_TYPE, architecture=ARCHITECTURE, model_family=layout.MODEL_FAMILY,
    writes=moe.writes(MODEL_TYPE, _chosen), config_out=_config_out,
    tensors=moe.tensors_of(moe.MIXTRAL_NAMES, qk_norm=False), lora=moe.LORA,
    keras_hub=(Backbone(BACKBONE, layout.MODEL_FAMILY, "Mixtral (experts in every layer; "
                        "sliding window: tfllm stops at the window length)", _fields,
                        _kwargs, _weight_map, _KEYS, unnamed=(_SPARSE,), check=_check),),
    default_backbone=lambda m: (BACKBONE if m.family == layout.MODEL_FAMILY
                                and m.num_experts and not m.qk_norm else None),
    config_in=config_reader(_read),
    tensors_in=moe.tensors_in(moe.MIXTRAL_NAMES, qk_norm=False))
