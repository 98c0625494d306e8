"""What the Llama-shaped families share (Llama, Mistral, Qwen2, Qwen3; Gemma 3's tensors).

Hugging Face names their layers `model.layers.{i}.self_attn.{q,k,v,o}_proj` and
`mlp.{gate,up,down}_proj`, keras-hub `transformer_layer_{i}/...`; tfllm's `llama` model
computes them all. A family module takes these pieces and adds what is its own.

A layer's tensors come in groups (`LAYER_GROUPS`), so that a family with other
per-layer tensors (experts in place of the MLP) swaps or adds a group.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

from tfllm.families.base import (DEFAULT_MAX_LENGTH, LoraNames, PretrainedError, Tensor,
                                 head_dim, linear, rope_parameters, same)

MODEL_FAMILY = "llama"

#: LoRA: Hugging Face module name inside layer i -> tfllm projection paths inside block_i
LORA = LoraNames(
    modules={"self_attn.q_proj": ("attention/query",), "self_attn.k_proj": ("attention/key",),
             "self_attn.v_proj": ("attention/value",),
             "self_attn.o_proj": ("attention/output",),
             "mlp.gate_proj": ("mlp/gate",), "mlp.up_proj": ("mlp/up",),
             "mlp.down_proj": ("mlp/down",)},
    layer_prefix="model.layers.{i}.",
    # transformers 5's fused experts (Qwen3-MoE, Mixtral): gate_up_proj (E, 2F, D), the
    # gate's rows first, then down_proj (E, D, F), registered in this order
    experts={"mlp.experts.gate_up_proj": ("mlp/gate", "mlp/up"),
             "mlp.experts.down_proj": ("mlp/down",)})


# ---- keras-hub --------------------------------------------------------------------------
def model_fields(kh: dict, tie: bool, qkv_bias: bool, position_factor: float,
                 window: Optional[int], max_length: Optional[int],
                 qk_norm: bool = False) -> dict:
    """tfllm's model section of a keras-hub Llama-shaped backbone config."""
    fields = {
        "family": MODEL_FAMILY,
        "vocab_size": kh["vocabulary_size"],
        "hidden_dim": kh["hidden_dim"],
        "num_layers": kh["num_layers"],
        "num_query_heads": kh["num_query_heads"],
        "num_key_value_heads": kh["num_key_value_heads"],
        "head_dim": kh.get("head_dim") or 0,
        "intermediate_dim": kh["intermediate_dim"],
        "norm_epsilon": float(kh["layer_norm_epsilon"]),
        "rope_theta": float(kh["rope_max_wavelength"]),
        "tie_embeddings": bool(tie),
        "use_bias": False,
        "qkv_bias": True if qkv_bias else None,
        "qk_norm": bool(qk_norm),
        "rope_scaling": "none",
        "rope_scaling_factor": 1.0,
        "max_sequence_length": DEFAULT_MAX_LENGTH,
    }
    if kh.get("rope_frequency_adjustment_factor") is not None:  # Llama 3.1+
        fields.update(rope_scaling="llama3",
                      rope_scaling_factor=float(kh["rope_frequency_adjustment_factor"]),
                      rope_low_freq_factor=float(kh["rope_low_freq_factor"]),
                      rope_high_freq_factor=float(kh["rope_high_freq_factor"]),
                      rope_original_max_length=int(kh["rope_pretraining_sequence_length"]))
        fields["max_sequence_length"] = int(kh["rope_pretraining_sequence_length"]
                                            * kh["rope_frequency_adjustment_factor"])
    elif position_factor and float(position_factor) != 1.0:
        fields.update(rope_scaling="linear", rope_scaling_factor=float(position_factor))
    if max_length:
        fields["max_sequence_length"] = int(max_length)
    if window:
        # Sliding-window attention equals full causal attention on sequences no longer
        # than the window; tfllm has full attention only, so it stops at the window.
        fields["max_sequence_length"] = min(fields["max_sequence_length"], int(window))
    return fields


def kwargs_common(m) -> dict:
    """The backbone arguments every Llama-shaped keras-hub backbone takes."""
    return {"vocabulary_size": m.vocab_size, "num_layers": m.num_layers,
            "num_query_heads": m.num_query_heads,
            "num_key_value_heads": m.num_key_value_heads or m.num_query_heads,
            "hidden_dim": m.hidden_dim, "intermediate_dim": m.intermediate_dim,
            "rope_max_wavelength": m.rope_theta, "layer_norm_epsilon": m.norm_epsilon}


def linear_factor(m) -> float:
    """rope_scaling_factor of keras-hub's Mistral/Qwen backbones (1.0: unscaled)."""
    return m.rope_scaling_factor if m.rope_scaling == "linear" else 1.0


def keras_hub_weight_map(m) -> Dict[str, str]:
    """{tfllm path: keras-hub path} of a Llama-shaped backbone."""
    out = {"token_embedding/embeddings": "token_embedding/embeddings",
           "final_norm/scale": "sequence_output_layernorm/scale"}
    if not m.tie_embeddings:
        out["lm_head/kernel"] = "token_embedding/reverse_embeddings"
    for i in range(m.num_layers):
        ours, theirs = f"block_{i}/", f"transformer_layer_{i}/"
        out[ours + "attention_norm/scale"] = theirs + "self_attention_layernorm/scale"
        out[ours + "mlp_norm/scale"] = theirs + "feedforward_layernorm/scale"
        for a, b in (("query", "query"), ("key", "key"), ("value", "value"),
                     ("output", "attention_output")):
            out[f"{ours}attention/{a}/kernel"] = f"{theirs}self_attention/{b}/kernel"
        if m.qkv_bias:
            for a in ("query", "key", "value"):
                out[f"{ours}attention/{a}/bias"] = f"{theirs}self_attention/{a}/bias"
        if m.qk_norm:  # keras-hub's Qwen3 names
            for a in ("query", "key"):
                out[f"{ours}attention/{a}_norm/scale"] = \
                    f"{theirs}self_attention/{a}_dense_layernorm/scale"
        for a, b in (("gate", "feedforward_gate_dense"), ("up", "feedforward_intermediate_dense"),
                     ("down", "feedforward_output_dense")):
            out[f"{ours}mlp/{a}/kernel"] = f"{theirs}{b}/kernel"
    return out


def plain_attention(m, backbone: str, window_ok: bool = False) -> None:
    """Refuses llama-family settings a keras-hub backbone other than Gemma3's lacks."""
    bad = [f"model.{k}={getattr(m, k)}" for k in ("sliding_window_pattern",
                                                    "rope_local_theta") if getattr(m, k)]
    if m.sliding_window and not window_ok:
        bad.append(f"model.sliding_window={m.sliding_window}")
    if m.query_pre_attn_scalar and m.query_pre_attn_scalar != head_dim(m):
        bad.append(f"model.query_pre_attn_scalar={m.query_pre_attn_scalar}")
    if bad:
        raise PretrainedError(f"keras-hub's {backbone} cannot express {', '.join(bad)}.")


def no_llama3(m, backbone: str) -> None:
    """`plain_attention`, and no llama3 RoPE scaling (Mistral, Qwen2, Qwen3 backbones)."""
    plain_attention(m, backbone, window_ok=backbone == "MistralBackbone")
    if m.rope_scaling == "llama3":
        raise PretrainedError(f"{backbone} has no llama3 RoPE scaling; export this model as "
                              "Llama3Backbone (--set model.qkv_bias=null).")


def default_backbone(name: str, chosen: Callable[[object], bool]):
    """A `Family.default_backbone`: `name` for a llama-family section without experts
    that `chosen` picks (the mixtures of experts name theirs: `moe_layout`)."""
    return lambda m: (name if m.family == MODEL_FAMILY and not m.num_experts and chosen(m)
                      else None)


# ---- Hugging Face -----------------------------------------------------------------------
def _dims(m):
    h, kv = m.num_query_heads, m.num_key_value_heads or m.num_query_heads
    return h, kv, head_dim(m), m.hidden_dim, m.intermediate_dim


def layer_norms(m, ours: str, theirs: str) -> List[Tensor]:
    e = m.hidden_dim
    return [Tensor(theirs + "input_layernorm.weight", (ours + "attention_norm/scale",),
                   (e,), same),
            Tensor(theirs + "post_attention_layernorm.weight", (ours + "mlp_norm/scale",),
                   (e,), same)]


def attention(m, ours: str, theirs: str) -> List[Tensor]:
    h, kv, hd, e, _ = _dims(m)
    return [
        # (E, heads, head_dim) -> (heads * head_dim, E)
        Tensor(theirs + "self_attn.q_proj.weight", (ours + "attention/query/kernel",),
               (h * hd, e), lambda x, n=h * hd: x.reshape(-1, n).T),
        Tensor(theirs + "self_attn.k_proj.weight", (ours + "attention/key/kernel",),
               (kv * hd, e), lambda x, n=kv * hd: x.reshape(-1, n).T),
        Tensor(theirs + "self_attn.v_proj.weight", (ours + "attention/value/kernel",),
               (kv * hd, e), lambda x, n=kv * hd: x.reshape(-1, n).T),
        # (heads, head_dim, E) -> (E, heads * head_dim)
        Tensor(theirs + "self_attn.o_proj.weight", (ours + "attention/output/kernel",),
               (e, h * hd), lambda x, n=h * hd: x.reshape(n, -1).T)]


def mlp(m, ours: str, theirs: str) -> List[Tensor]:
    _, _, _, e, i_dim = _dims(m)
    return [Tensor(theirs + "mlp.gate_proj.weight", (ours + "mlp/gate/kernel",),
                   (i_dim, e), linear),
            Tensor(theirs + "mlp.up_proj.weight", (ours + "mlp/up/kernel",), (i_dim, e),
                   linear),
            Tensor(theirs + "mlp.down_proj.weight", (ours + "mlp/down/kernel",),
                   (e, i_dim), linear)]


def query_key_norms(m, ours: str, theirs: str, always: bool = False) -> List[Tensor]:
    """Qwen3's and Gemma 3's per-head RMSNorms of queries and keys (when model.qk_norm,
    or `always`)."""
    if not (m.qk_norm or always):
        return []
    hd = head_dim(m)
    return [Tensor(f"{theirs}self_attn.{n}_norm.weight", (f"{ours}attention/{a}_norm/scale",),
                   (hd,), same) for n, a in (("q", "query"), ("k", "key"))]


def qkv_biases(m, ours: str, theirs: str) -> List[Tensor]:
    """Qwen2's q/k/v biases (when the resolved model.qkv_bias)."""
    if not m.qkv_bias:
        return []
    h, kv, hd, _, _ = _dims(m)
    return [Tensor(f"{theirs}self_attn.{n}_proj.bias", (f"{ours}attention/{a}/bias",),
                   (heads * hd,), lambda x: x.reshape(-1))
            for n, a, heads in (("q", "query", h), ("k", "key", kv), ("v", "value", kv))]


#: a layer's tensors, group by group, in the order written
LAYER_GROUPS = (layer_norms, attention, mlp, query_key_norms, qkv_biases)


def tensors(m, groups: Sequence[Callable] = LAYER_GROUPS) -> List[Tensor]:
    """Every tensor of a Llama-shaped folder: the embedding, each layer's `groups`, the
    final norm and (untied) the output layer. `m` is resolved."""
    e = m.hidden_dim
    out = [Tensor("model.embed_tokens.weight", ("token_embedding/embeddings",),
                  (m.vocab_size, e), same)]
    for i in range(m.num_layers):
        for group in groups:
            out += group(m, f"block_{i}/", f"model.layers.{i}.")
    out.append(Tensor("model.norm.weight", ("final_norm/scale",), (e,), same))
    if not m.tie_embeddings:
        out.append(Tensor("lm_head.weight", ("lm_head/kernel",), (m.vocab_size, e), linear))
    return out


def check_writable(m) -> None:
    """Refuses a llama-family section no transformers Llama-shaped class computes."""
    if m.query_pre_attn_scalar and m.query_pre_attn_scalar != head_dim(m):
        raise PretrainedError(f"model.query_pre_attn_scalar={m.query_pre_attn_scalar} (not "
                              f"head_dim {head_dim(m)}) exists in transformers only for Gemma "
                              "3 (model.family=gemma3).")


def writes(chosen: Callable[[object, Optional[str]], bool]):
    """A `Family.writes` for a llama-family section that `chosen` picks."""
    def writes_(m, backbone):
        if m.family != MODEL_FAMILY or m.num_experts:  # experts: `moe_layout.writes`
            return False
        check_writable(m)
        return chosen(m, backbone)
    return writes_


def config_out(m, model_type: str, architecture: str, common: dict) -> dict:
    """The config.json keys every Llama-shaped model_type has."""
    if m.use_bias:
        raise PretrainedError("model.use_bias=true (biases on every projection) has no "
                              "Llama/Mistral/Qwen2 counterpart in transformers; only q/k/v "
                              "biases (model.qkv_bias, Qwen2) are written.")
    return {"architectures": [architecture], "model_type": model_type,
            "hidden_size": m.hidden_dim, "intermediate_size": m.intermediate_dim,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_query_heads,
            "num_key_value_heads": m.num_key_value_heads or m.num_query_heads,
            "head_dim": head_dim(m),
            "hidden_act": "silu", "max_position_embeddings": m.max_sequence_length,
            "rms_norm_eps": float(m.norm_epsilon), "rope_parameters": rope_parameters(m),
            "attention_dropout": 0.0, **common}


def full_attention_keys(m) -> dict:
    """Qwen2's and Qwen3's keys for full attention in every layer, as tfllm computes."""
    return {"use_sliding_window": False, "sliding_window": None,
            "max_window_layers": m.num_layers,
            "layer_types": ["full_attention"] * m.num_layers}


def heads_dim(c: dict) -> bool:
    """config.json's head_dim is hidden_size / num_attention_heads (or absent)."""
    hd = c.get("head_dim")
    return hd is None or hd * c["num_attention_heads"] == c["hidden_size"]


#: `Family.refused` entries the Llama-shaped model_types share: a SiLU-gated MLP (all),
#: no attention biases (Llama, Qwen3), head_dim = hidden_size / heads (Llama, Qwen2)
SILU = ("hidden_act", lambda v, c: v in (None, "silu"), "a SiLU-gated MLP")
NO_ATTENTION_BIAS = ("attention_bias", lambda v, c: not v,
                     "no attention biases (Qwen2 folders have q/k/v biases)")
PLAIN_HEAD_DIM = ("head_dim", lambda v, c: heads_dim(c),
                  "head_dim = hidden_size / num_attention_heads (Mistral folders may set "
                  "another)")
