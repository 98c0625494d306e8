"""Gemma 3 text models (1B; the text decoder of 4B+): transformers' `gemma3_text`,
keras-hub's Gemma3Backbone, tfllm's `gemma3` model (local/global layers, query/key
norms, four norms per layer, GeGLU).

keras-hub's backbone cannot say every setting transformers has (the layer pattern, the
RoPE bases), so a Hugging Face folder's config.json is read here (`config_in`); its
weights still come through keras-hub's converter.
"""

from __future__ import annotations

from functools import partial
from typing import Dict, List, Optional

from tfllm.families import llama_layout as layout
from tfllm.families.base import (DEFAULT_MAX_LENGTH, Backbone, Family, Permuted,
                                 PretrainedError, Tensor, head_dim, layer_kinds,
                                 config_reader, rope_parameters, same)

MODEL_TYPE = "gemma3_text"
MODEL_FAMILY = "gemma3"
BACKBONE = "Gemma3Backbone"

#: keras-hub's Gemma3Backbone (0.32) hard-codes what transformers' config sets: every 6th
#: layer global, RoPE bases 10,000 (local) and 1,000,000 (global).
_KERAS_HUB = {"pattern": 6, "local_theta": 10_000.0, "global_theta": 1_000_000.0}

#: transformers' Gemma3TextConfig defaults, for keys a config.json leaves out
_HF_DEFAULTS = {"rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
                "sliding_window": 4096, "tie_word_embeddings": True,
                "max_position_embeddings": 131_072, "head_dim": 256,
                "num_key_value_heads": 4, "num_attention_heads": 8}


def _refuse(path: str, key: str, value, why: str) -> PretrainedError:
    return PretrainedError(f"{path}: {key}={value!r} is not implemented for Gemma 3 "
                           f"({why}); importing it would compute other logits.")


def _rope_global(rope: dict, path: str, key: str, shown) -> dict:
    """tfllm's RoPE fields for Gemma 3's global layers from a transformers rope dict
    (`shown`: the config value named in a refusal)."""
    kind = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
    if kind == "default":
        return {"rope_scaling": "none", "rope_scaling_factor": 1.0}
    if kind == "linear":
        return {"rope_scaling": "linear", "rope_scaling_factor": float(rope["factor"])}
    if kind == "llama3":
        return {"rope_scaling": "llama3", "rope_scaling_factor": float(rope["factor"]),
                "rope_low_freq_factor": float(rope["low_freq_factor"]),
                "rope_high_freq_factor": float(rope["high_freq_factor"]),
                "rope_original_max_length": int(rope["original_max_position_embeddings"])}
    raise _refuse(path, key, shown, "tfllm implements RoPE types default, linear "
                  "and llama3 on global layers")


def _config_in_of(c: dict, where: str) -> dict:
    """tfllm's model section of a transformers Gemma 3 text config.json, in the
    transformers 5 layout (rope_parameters per layer type, layer_types) or the
    transformers 4 one (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern)."""
    if c.get("model_type") != "gemma3_text":
        raise PretrainedError(f"{where}: model_type {c.get('model_type')!r} (Gemma 3 with its "
                              "vision tower); tfllm imports Gemma 3 text models "
                              "(model_type gemma3_text, Gemma3ForCausalLM).")
    c = {**_HF_DEFAULTS, **{k: v for k, v in c.items() if v is not None or k in (
        "sliding_window",)}}
    for key, ok, why in (
            ("hidden_activation", lambda v: v in (None, "gelu_pytorch_tanh"),
             "the tanh GELU"),
            ("hidden_act", lambda v: v in (None, "gelu_pytorch_tanh"), "the tanh GELU"),
            ("attention_bias", lambda v: not v, "no attention biases"),
            ("use_bidirectional_attention", lambda v: not v, "causal attention"),
            ("attn_logit_softcapping", lambda v: v is None, "no soft-capping"),
            ("final_logit_softcapping", lambda v: v is None, "no soft-capping")):
        if key in c and not ok(c[key]):
            raise _refuse(where, key, c[key], f"tfllm computes {why}")
    layers = int(c["num_hidden_layers"])
    types = c.get("layer_types")
    if types is None:
        pattern = int(c.get("sliding_window_pattern", _KERAS_HUB["pattern"]))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise _refuse(where, "layer_types", types, f"{layers} entries of "
                      "sliding_attention / full_attention")
    window = c.get("sliding_window") or 0
    local = [t == "sliding_attention" for t in types]
    if any(local) and not window:
        raise _refuse(where, "sliding_window", c.get("sliding_window"),
                      "local layers need a window")
    if not c["tie_word_embeddings"]:
        raise _refuse(where, "tie_word_embeddings", False, "every Gemma 3 is tied, "
                      "and keras-hub's converter reads no lm_head")
    pattern = _pattern_of(local)
    if pattern is None:
        raise _refuse(where, "layer_types", types, "tfllm places global layers "
                      "every Nth layer (model.sliding_window_pattern), or none")
    params = c.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params
                                     or "sliding_attention" in params):  # transformers 5
        full, sliding = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        global_theta = full.get("rope_theta", c.get("rope_theta", 1_000_000.0))
        local_theta = sliding.get("rope_theta", c.get("rope_local_base_freq", 10_000.0))
        rope_key = "rope_parameters"
    else:  # transformers 4
        full, sliding = c.get("rope_scaling") or {}, {}
        global_theta = c.get("rope_theta", 1_000_000.0)
        local_theta = c.get("rope_local_base_freq", 10_000.0)
        rope_key = "rope_scaling"
    if sliding.get("rope_type", "default") != "default":
        raise _refuse(where, "rope_parameters", params,
                      "tfllm's local layers use unscaled RoPE")
    fields = {
        "family": "gemma3", "vocab_size": int(c["vocab_size"]),
        "hidden_dim": int(c["hidden_size"]), "num_layers": layers,
        "num_query_heads": int(c["num_attention_heads"]),
        "num_key_value_heads": int(c["num_key_value_heads"]),
        "head_dim": int(c["head_dim"]), "intermediate_dim": int(c["intermediate_size"]),
        "norm_epsilon": float(c["rms_norm_eps"]), "rope_theta": float(global_theta),
        "rope_local_theta": float(local_theta),
        "sliding_window": int(window) if any(local) else 0,
        "sliding_window_pattern": pattern,
        "query_pre_attn_scalar": float(c["query_pre_attn_scalar"]),
        "tie_embeddings": bool(c["tie_word_embeddings"]), "use_bias": False,
        "qkv_bias": None, "qk_norm": True,
        "max_sequence_length": int(c["max_position_embeddings"]),
        **_rope_global(full, where, rope_key, c.get(rope_key)),
    }
    return fields


def _pattern_of(local) -> Optional[int]:
    """model.sliding_window_pattern giving this local/global list, or None: 0 when every
    layer is local (or none is: the window is then unused), N when layers N-1, 2N-1, ...
    are the global ones."""
    if all(local) or not any(local):
        return 0
    first = local.index(False) + 1
    expected = [(i + 1) % first != 0 for i in range(len(local))]
    return first if expected == local else None


def _fields(kh: dict, max_length=None) -> dict:
    """A keras-hub Gemma3Backbone preset (text only) -> tfllm's model section."""
    where = "Gemma3Backbone config"
    for key, ok, why in (
            ("vision_encoder", lambda v: v is None, "text only"),
            ("image_size", lambda v: v is None, "text only"),
            ("is_embedding_model", lambda v: not v, "a causal language model"),
            ("use_bidirectional_attention", lambda v: not v, "causal attention"),
            ("attention_logit_soft_cap", lambda v: v is None, "no soft-capping"),
            ("final_logit_soft_cap", lambda v: v is None, "no soft-capping"),
            ("use_post_ffw_norm", bool, "norms after the MLP, as Gemma 3"),
            ("use_post_attention_norm", bool, "norms after attention, as Gemma 3"),
            ("use_query_key_norm", bool, "query/key norms, as Gemma 3"),
            ("local_rope_scaling_factor", lambda v: float(v) == 1.0,
             "unscaled RoPE on local layers"),
            # keras-hub 0.32's Gemma3DecoderBlock passes True to its attention whatever
            # the backbone says: what such a preset computes is ambiguous
            ("query_head_dim_normalize", lambda v: v is None or bool(v),
             "scores scaled by head_dim, which keras-hub's own layers apply whatever this "
             "says")):
        if not ok(kh.get(key)):
            raise _refuse(where, key, kh.get(key), f"tfllm computes {why}")
    sliding = bool(kh.get("use_sliding_window_attention"))
    factor = float(kh.get("global_rope_scaling_factor") or 1.0)
    head_dim = int(kh["head_dim"])
    return {
        "family": "gemma3", "vocab_size": kh["vocabulary_size"],
        "hidden_dim": kh["hidden_dim"], "num_layers": kh["num_layers"],
        "num_query_heads": kh["num_query_heads"],
        "num_key_value_heads": kh["num_key_value_heads"], "head_dim": head_dim,
        "intermediate_dim": kh["intermediate_dim"],
        "norm_epsilon": float(kh["layer_norm_epsilon"]),
        "rope_theta": _KERAS_HUB["global_theta"], "rope_local_theta": _KERAS_HUB["local_theta"],
        "sliding_window": int(kh["sliding_window_size"]) if sliding else 0,
        "sliding_window_pattern": _KERAS_HUB["pattern"] if sliding else 0,
        "query_pre_attn_scalar": float(head_dim),
        "rope_scaling": "linear" if factor != 1.0 else "none", "rope_scaling_factor": factor,
        "tie_embeddings": True, "use_bias": False, "qkv_bias": None, "qk_norm": True,
        "max_sequence_length": int(max_length or DEFAULT_MAX_LENGTH),
    }


def _kwargs(m, original) -> dict:
    """tfllm's model section -> Gemma3Backbone arguments; what keras-hub hard-codes must
    match."""
    head_dim = m.head_dim or m.hidden_dim // m.num_query_heads
    problems = []
    if m.sliding_window:
        if m.sliding_window_pattern != _KERAS_HUB["pattern"]:
            problems.append(f"model.sliding_window_pattern={m.sliding_window_pattern} "
                            f"(keras-hub: {_KERAS_HUB['pattern']})")
        if (m.rope_local_theta or m.rope_theta) != _KERAS_HUB["local_theta"]:
            problems.append(f"model.rope_local_theta={m.rope_local_theta} (keras-hub: "
                            f"{_KERAS_HUB['local_theta']:g})")
    if m.rope_theta != _KERAS_HUB["global_theta"]:
        problems.append(f"model.rope_theta={m.rope_theta} (keras-hub: "
                        f"{_KERAS_HUB['global_theta']:g})")
    scalar = m.query_pre_attn_scalar or head_dim
    if scalar != head_dim:  # keras-hub 0.32's layers always scale by head_dim
        problems.append(f"model.query_pre_attn_scalar={scalar} (keras-hub: head_dim, "
                        f"{head_dim})")
    if m.rope_scaling not in ("none", "linear"):
        problems.append(f"model.rope_scaling={m.rope_scaling} (keras-hub: none or linear)")
    if m.tie_embeddings is False:
        problems.append("model.tie_embeddings=false (keras-hub's Gemma 3 is tied)")
    if problems:
        raise PretrainedError("keras-hub's Gemma3Backbone cannot express "
                              f"{'; '.join(problems)}; export this run with --format hf.")
    return {"vocabulary_size": m.vocab_size, "image_size": None,
            "num_layers": m.num_layers, "num_query_heads": m.num_query_heads,
            "num_key_value_heads": m.num_key_value_heads or m.num_query_heads,
            "hidden_dim": m.hidden_dim, "intermediate_dim": m.intermediate_dim,
            "head_dim": head_dim, "query_head_dim_normalize": True,
            "use_query_key_norm": True, "use_post_ffw_norm": True,
            "use_post_attention_norm": True,
            "use_sliding_window_attention": bool(m.sliding_window),
            "sliding_window_size": m.sliding_window or original.get("sliding_window_size",
                                                                      1024),
            "global_rope_scaling_factor": (m.rope_scaling_factor
                                           if m.rope_scaling == "linear" else 1.0),
            "local_rope_scaling_factor": 1.0, "layer_norm_epsilon": m.norm_epsilon,
            "dropout": original.get("dropout", 0)}


def _weight_map(m) -> Dict[str, object]:
    out = {"token_embedding/embeddings": "token_embedding/embeddings",
           "final_norm/scale": "final_normalization/scale"}
    for i in range(m.num_layers):
        ours, theirs = f"block_{i}/", f"decoder_block_{i}/"
        for a, b in (("attention_norm", "pre_attention_norm"),
                     ("attention_post_norm", "post_attention_norm"),
                     ("mlp_norm", "pre_ffw_norm"), ("mlp_post_norm", "post_ffw_norm")):
            out[f"{ours}{a}/scale"] = f"{theirs}{b}/scale"
        for a in ("query", "key", "value"):  # keras-hub: (heads, E, D); tfllm: (E, heads, D)
            out[f"{ours}attention/{a}/kernel"] = Permuted(
                f"{theirs}attention/{a}/kernel", (1, 0, 2))
        out[f"{ours}attention/output/kernel"] = f"{theirs}attention/attention_output/kernel"
        for a in ("query", "key"):
            out[f"{ours}attention/{a}_norm/scale"] = f"{theirs}attention/{a}_norm/scale"
        for a, b in (("gate", "ffw_gating"), ("up", "ffw_gating_2"), ("down", "ffw_linear")):
            out[f"{ours}mlp/{a}/kernel"] = f"{theirs}{b}/kernel"
    return out


_KEYS = frozenset({
    "vocabulary_size", "image_size", "num_layers", "num_query_heads", "num_key_value_heads",
    "hidden_dim", "intermediate_dim", "head_dim", "query_head_dim_normalize",
    "use_query_key_norm", "use_post_ffw_norm", "use_post_attention_norm",
    "attention_logit_soft_cap", "final_logit_soft_cap", "use_sliding_window_attention",
    "sliding_window_size", "local_rope_scaling_factor", "global_rope_scaling_factor",
    "vision_encoder", "layer_norm_epsilon", "use_bidirectional_attention",
    "is_embedding_model", "pooling_intermediate_dim", "embedding_dim"})


# ---- Hugging Face out -------------------------------------------------------------------
def _config_out(m, common: dict) -> dict:
    if m.use_bias or m.qkv_bias:
        raise PretrainedError("Gemma 3 has no biases; this model (model.use_bias/qkv_bias) "
                              "cannot be written as gemma3_text.")
    hd = head_dim(m)
    scalar = float(m.query_pre_attn_scalar or hd)
    if not scalar.is_integer():
        raise PretrainedError(f"model.query_pre_attn_scalar={scalar}: transformers' "
                              "Gemma3TextConfig takes a whole number.")
    scalar = int(scalar)
    local = ["sliding_attention" if kind == "local" else "full_attention"
             for kind in layer_kinds(m)]
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": MODEL_TYPE,
            "hidden_size": m.hidden_dim, "intermediate_size": m.intermediate_dim,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_query_heads,
            "num_key_value_heads": m.num_key_value_heads or m.num_query_heads,
            "head_dim": hd, "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": m.max_sequence_length,
            "rms_norm_eps": float(m.norm_epsilon),
            "query_pre_attn_scalar": scalar,
            "sliding_window": int(m.sliding_window) or None, "layer_types": local,
            "rope_parameters": {
                "full_attention": rope_parameters(m),
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": float(m.rope_local_theta or m.rope_theta)}},
            "attention_bias": False, "attention_dropout": 0.0,
            "attn_logit_softcapping": None, "final_logit_softcapping": None,
            "use_bidirectional_attention": False, "pad_token_id": None, **common}


def _norms(m, ours: str, theirs: str) -> List[Tensor]:
    """Four norms per layer: transformers' post_attention_layernorm follows attention; the
    MLP's input norm is pre_feedforward_layernorm."""
    e = m.hidden_dim
    return [Tensor(theirs + "input_layernorm.weight", (ours + "attention_norm/scale",),
                   (e,), same),
            Tensor(theirs + "post_attention_layernorm.weight",
                   (ours + "attention_post_norm/scale",), (e,), same),
            Tensor(theirs + "pre_feedforward_layernorm.weight", (ours + "mlp_norm/scale",),
                   (e,), same),
            Tensor(theirs + "post_feedforward_layernorm.weight",
                   (ours + "mlp_post_norm/scale",), (e,), same)]


#: Llama's layer groups, with Gemma 3's norms and its query/key norms always
_LAYER_GROUPS = (_norms, layout.attention, layout.mlp,
                 partial(layout.query_key_norms, always=True), layout.qkv_biases)


def _tensors(m) -> List[Tensor]:
    return layout.tensors(m, _LAYER_GROUPS)


FAMILY = Family(
    model_type=MODEL_TYPE, architecture="Gemma3ForCausalLM", model_family=MODEL_FAMILY,
    writes=lambda m, backbone: m.family == MODEL_FAMILY,
    config_out=_config_out, tensors=_tensors, lora=layout.LORA,
    keras_hub=(Backbone(BACKBONE, MODEL_FAMILY, "Gemma 3 text models (1B; the text decoder "
                        "of 4B+: local/global layers, query/key norms, GeGLU)", _fields,
                        _kwargs, _weight_map, _KEYS),),
    default_backbone=lambda m: BACKBONE if m.family == MODEL_FAMILY else None,
    config_in=config_reader(_config_in_of, "Gemma 3 text"))
