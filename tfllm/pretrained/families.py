"""The keras-hub architectures tfllm can hold, and how their configs and weights map.

One `Family` per keras-hub backbone class. keras-hub converts Hugging Face configs and
weights into its own backbones; a family here maps that backbone onto a tfllm model:

* `model_fields(kh)`: the keras-hub backbone config -> tfllm's `model` section;
* `backbone_kwargs(model, original)`: the inverse, for export (keys tfllm does not model,
  such as dropout, come from the imported config when there is one);
* `weight_map(model)`: {tfllm variable path (without the model name): keras-hub variable
  path}. Shapes are equal on both sides (keras-hub's einsum kernels are laid out like
  tfllm's), so weights copy without reshaping.

`FAMILIES` is the single list of what `tfllm import` supports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

#: keras-hub config keys that change nothing tfllm computes (dropout is off at inference
#: and tfllm trains without it; name/dtype/trainable are Keras bookkeeping).
_IGNORED = {"name", "trainable", "dtype", "dropout"}

#: Context length assumed when a keras-hub preset (unlike a Hugging Face config) does not
#: state one; `--set model.max_sequence_length=N` changes it.
DEFAULT_MAX_LENGTH = 4096


class PretrainedError(ValueError):
    """A preset or checkpoint tfllm cannot import or export; the message names the file,
    the tensor or setting, and the fix."""


@dataclass(frozen=True)
class Family:
    """How one keras-hub backbone class maps onto a tfllm model."""

    backbone: str
    tfllm_family: str
    description: str
    model_fields: Callable[..., dict]  # (keras-hub config, max_length=None) -> fields
    backbone_kwargs: Callable[[object, dict], dict]
    weight_map: Callable[[object], Dict[str, str]]
    understood: frozenset


def _check_understood(family: "Family", kh: dict, source: str) -> None:
    unknown = sorted(k for k in kh if k not in family.understood and k not in _IGNORED)
    if unknown:
        raise PretrainedError(
            f"{source}: the {family.backbone} config sets {unknown}, which tfllm's "
            f"{family.tfllm_family} model does not implement; supported settings: "
            f"{sorted(family.understood)}.")


# ---- the Llama family: Llama 2/3/3.1/3.2, Mistral, Qwen2 ----------------------------------
def _llama_fields(kh: dict, tie: bool, qkv_bias: bool, position_factor: float,
                  window: Optional[int], max_length: Optional[int],
                  qk_norm: bool = False) -> dict:
    fields = {
        "family": "llama",
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


def _llama_kwargs_common(m) -> dict:
    return {"vocabulary_size": m.vocab_size, "num_layers": m.num_layers,
            "num_query_heads": m.num_query_heads,
            "num_key_value_heads": m.num_key_value_heads or m.num_query_heads,
            "hidden_dim": m.hidden_dim, "intermediate_dim": m.intermediate_dim,
            "rope_max_wavelength": m.rope_theta, "layer_norm_epsilon": m.norm_epsilon}


def _llama_weight_map(m) -> Dict[str, str]:
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


def _rope_llama_kwargs(m) -> dict:
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


def _no_llama3(m, backbone: str) -> None:
    if m.rope_scaling == "llama3":
        raise PretrainedError(f"{backbone} has no llama3 RoPE scaling; export this model as "
                              "Llama3Backbone (--set model.qkv_bias=null).")


_LLAMA_KEYS = frozenset({
    "vocabulary_size", "num_layers", "num_query_heads", "hidden_dim", "intermediate_dim",
    "num_key_value_heads", "rope_max_wavelength", "rope_position_scaling_factor",
    "rope_frequency_adjustment_factor", "rope_low_freq_factor", "rope_high_freq_factor",
    "rope_pretraining_sequence_length", "layer_norm_epsilon", "tie_word_embeddings"})


def _llama_family(backbone: str, description: str) -> Family:
    def fields(kh, max_length=None):
        factor = kh.get("rope_position_scaling_factor", 1.0)
        if factor and float(factor) != 1.0:
            # keras-hub's LlamaRotaryEmbedding (0.32) ignores it, so the preset's own
            # library does not apply the scaling its config names: refuse to guess.
            raise PretrainedError(f"{backbone} config: rope_position_scaling_factor={factor}"
                                  " is ignored by keras-hub's own Llama layers, so what the "
                                  "preset computes is ambiguous; tfllm imports Llama presets "
                                  "with 1.0 (or llama3 scaling).")
        return _llama_fields(kh, kh.get("tie_word_embeddings", False), False, 1.0, None,
                             max_length)

    def kwargs(m, original):
        if m.rope_scaling == "linear":
            raise PretrainedError(f"{backbone}'s layers ignore linear RoPE scaling; export "
                                  "this model as QwenBackbone or MistralBackbone.")
        return {**_llama_kwargs_common(m), **_rope_llama_kwargs(m),
                "tie_word_embeddings": bool(m.tie_embeddings),
                "dropout": original.get("dropout", 0.0)}
    return Family(backbone, "llama", description, fields, kwargs, _llama_weight_map,
                  _LLAMA_KEYS)


def _mistral_family() -> Family:
    def fields(kh, max_length=None):
        return _llama_fields(kh, False, False, kh.get("rope_scaling_factor", 1.0),
                             kh.get("sliding_window"), max_length)

    def kwargs(m, original):
        _no_llama3(m, "MistralBackbone")
        if m.tie_embeddings or m.qkv_bias:
            raise PretrainedError("MistralBackbone has untied embeddings and no biases; "
                                  "export this model as Llama3Backbone or QwenBackbone.")
        return {**_llama_kwargs_common(m), "head_dim": m.head_dim or None,
                "rope_scaling_factor": (m.rope_scaling_factor
                                        if m.rope_scaling == "linear" else 1.0),
                "sliding_window": original.get("sliding_window", m.max_sequence_length),
                "dropout": original.get("dropout", 0.0)}
    keys = frozenset({"vocabulary_size", "num_layers", "num_query_heads", "hidden_dim",
                      "intermediate_dim", "num_key_value_heads", "rope_max_wavelength",
                      "rope_scaling_factor", "layer_norm_epsilon", "sliding_window",
                      "head_dim"})
    return Family("MistralBackbone", "llama", "Mistral (sliding window: tfllm stops at the "
                  "window length, where full attention equals it)", fields, kwargs,
                  _llama_weight_map, keys)


def _qwen_family() -> Family:
    def fields(kh, max_length=None):
        window = kh.get("sliding_window_size") if kh.get("use_sliding_window_attention") \
            else None
        return _llama_fields(kh, kh.get("tie_word_embeddings", True), True,
                             kh.get("rope_scaling_factor", 1.0), window, max_length)

    def kwargs(m, original):
        _no_llama3(m, "QwenBackbone")
        return {**_llama_kwargs_common(m), "tie_word_embeddings": bool(m.tie_embeddings),
                "rope_scaling_factor": (m.rope_scaling_factor
                                        if m.rope_scaling == "linear" else 1.0),
                "use_sliding_window_attention": original.get("use_sliding_window_attention",
                                                             False),
                "sliding_window_size": original.get("sliding_window_size", 32768),
                "dropout": original.get("dropout", 0.0)}
    keys = frozenset({"vocabulary_size", "num_layers", "num_query_heads", "hidden_dim",
                      "intermediate_dim", "num_key_value_heads", "rope_max_wavelength",
                      "rope_scaling_factor", "layer_norm_epsilon", "tie_word_embeddings",
                      "use_sliding_window_attention", "sliding_window_size"})
    return Family("QwenBackbone", "llama", "Qwen2 / Qwen2.5 (q/k/v biases)", fields,
                  kwargs, _llama_weight_map, keys)


def _qwen3_family() -> Family:
    def fields(kh, max_length=None):
        factor = kh.get("rope_scaling_factor", 1.0)
        return _llama_fields(kh, kh.get("tie_word_embeddings", True), False, factor,
                             kh.get("sliding_window_size"), max_length, qk_norm=True)

    def kwargs(m, original):
        _no_llama3(m, "Qwen3Backbone")
        if m.qkv_bias or not m.qk_norm:
            raise PretrainedError("Qwen3Backbone has query/key norms and no biases "
                                  "(model.qk_norm=true, model.qkv_bias=null).")
        return {**_llama_kwargs_common(m), "head_dim": m.head_dim or m.hidden_dim //
                m.num_query_heads, "tie_word_embeddings": bool(m.tie_embeddings),
                "rope_scaling_factor": (m.rope_scaling_factor
                                        if m.rope_scaling == "linear" else 1.0),
                "sliding_window_size": original.get("sliding_window_size"),
                "dropout": original.get("dropout", 0.0)}
    keys = frozenset({"vocabulary_size", "num_layers", "num_query_heads", "hidden_dim",
                      "intermediate_dim", "num_key_value_heads", "rope_max_wavelength",
                      "rope_scaling_factor", "layer_norm_epsilon", "tie_word_embeddings",
                      "sliding_window_size", "head_dim"})
    return Family("Qwen3Backbone", "llama", "Qwen3 dense models (query/key RMSNorm)",
                  fields, kwargs, _llama_weight_map, keys)


# ---- GPT-2 -------------------------------------------------------------------------------
def _gpt2_fields(kh: dict, max_length=None) -> dict:
    return {"family": "gpt", "vocab_size": kh["vocabulary_size"],
            "hidden_dim": kh["hidden_dim"], "num_layers": kh["num_layers"],
            "num_query_heads": kh["num_heads"], "num_key_value_heads": 0, "head_dim": 0,
            "intermediate_dim": kh["intermediate_dim"],
            "max_sequence_length": kh["max_sequence_length"],
            "norm_epsilon": 1e-5,  # keras-hub's GPT2Backbone (and GPT-2) use 1e-5
            "tie_embeddings": True, "use_bias": True, "qkv_bias": None,
            "rope_scaling": "none"}


def _gpt2_kwargs(m, original) -> dict:
    if (m.family != "gpt" or m.tie_embeddings is False or m.use_bias is False
            or m.qkv_bias is False or m.num_key_value_heads not in (0, m.num_query_heads)
            or m.head_dim not in (0, m.hidden_dim // m.num_query_heads)):
        raise PretrainedError("GPT2Backbone needs tied embeddings, biases, no grouped-query "
                              "heads and head_dim = hidden_dim / num_query_heads.")
    if abs(m.norm_epsilon - 1e-5) > 1e-12:
        raise PretrainedError(f"GPT2Backbone's LayerNorm epsilon is 1e-5; this model uses "
                              f"model.norm_epsilon={m.norm_epsilon}.")
    return {"vocabulary_size": m.vocab_size, "num_layers": m.num_layers,
            "num_heads": m.num_query_heads, "hidden_dim": m.hidden_dim,
            "intermediate_dim": m.intermediate_dim,
            "max_sequence_length": m.max_sequence_length,
            "dropout": original.get("dropout", 0.0)}


def _gpt2_weight_map(m) -> Dict[str, str]:
    out = {"token_embedding/embeddings": "token_embedding/embeddings",
           "position_embedding/embeddings": "position_embedding/embeddings",
           "final_norm/scale": "layer_norm/gamma", "final_norm/bias": "layer_norm/beta"}
    for i in range(m.num_layers):
        ours, theirs = f"block_{i}/", f"transformer_layer_{i}/"
        for a, b in (("attention_norm", "self_attention_layer_norm"),
                     ("mlp_norm", "feedforward_layer_norm")):
            out[f"{ours}{a}/scale"] = f"{theirs}{b}/gamma"
            out[f"{ours}{a}/bias"] = f"{theirs}{b}/beta"
        for a, b in (("attention/query", "self_attention/query"),
                     ("attention/key", "self_attention/key"),
                     ("attention/value", "self_attention/value"),
                     ("attention/output", "self_attention/attention_output"),
                     ("mlp/up", "feedforward_intermediate_dense"),
                     ("mlp/down", "feedforward_output_dense")):
            out[f"{ours}{a}/kernel"] = f"{theirs}{b}/kernel"
            out[f"{ours}{a}/bias"] = f"{theirs}{b}/bias"
    return out


FAMILIES: Dict[str, Family] = {f.backbone: f for f in (
    Family("GPT2Backbone", "gpt", "GPT-2", _gpt2_fields, _gpt2_kwargs, _gpt2_weight_map,
           frozenset({"vocabulary_size", "num_layers", "num_heads", "hidden_dim",
                      "intermediate_dim", "max_sequence_length"})),
    _llama_family("LlamaBackbone", "Llama 2 (and Llama 1; linear RoPE scaling)"),
    _llama_family("Llama3Backbone", "Llama 3, 3.1, 3.2 (llama3 RoPE scaling, tied "
                  "embeddings of 3.2 1B/3B)"),
    _mistral_family(),
    _qwen_family(),
    _qwen3_family(),
)}


def supported() -> str:
    """One line listing the supported keras-hub backbones."""
    return ", ".join(f"{name} ({f.description})" for name, f in FAMILIES.items())


def family_for(backbone: str, source: str) -> Family:
    """The `Family` of a keras-hub backbone class name, or a PretrainedError."""
    if backbone not in FAMILIES:
        raise PretrainedError(f"{source}: {backbone} is not an architecture tfllm can hold; "
                              f"supported: {supported()}.")
    return FAMILIES[backbone]


def default_backbone(model) -> str:
    """The keras-hub backbone a tfllm model config exports to when it was not imported."""
    if model.family == "gpt":
        return "GPT2Backbone"
    if model.qk_norm:
        return "Qwen3Backbone"
    return "QwenBackbone" if model.qkv_bias else "Llama3Backbone"
