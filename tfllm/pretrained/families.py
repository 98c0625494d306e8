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
from typing import Callable, Dict, Optional, Tuple

import numpy as np

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
class Tensor:
    """One tensor of a Hugging Face folder (a model's or an adapter's), made from tfllm
    checkpoint variables (`tfllm.pretrained.hf_export`, `tfllm.pretrained.peft`)."""

    key: str                          # the Hugging Face name
    sources: Tuple[str, ...]          # tfllm variable paths below the model's name
    shape: Tuple[int, ...]            # the Hugging Face shape
    make: Callable[..., np.ndarray]   # (*source arrays) -> array of `shape`


@dataclass(frozen=True)
class Permuted:
    """A weight-map value whose keras-hub tensor is tfllm's with its axes permuted:
    tfllm's = np.transpose(keras-hub's, perm)."""

    path: str
    perm: Tuple[int, ...]

    def to_ours(self, theirs):
        return np.transpose(theirs, self.perm)

    def to_theirs(self, ours):
        return np.transpose(ours, np.argsort(self.perm))


def keras_hub_path(value) -> str:
    """The keras-hub variable path of a weight-map value (a path or a `Permuted`)."""
    return value.path if isinstance(value, Permuted) else value


@dataclass(frozen=True)
class Family:
    """How one keras-hub backbone class maps onto a tfllm model.

    `hf_fields(config.json, path)`, when set, reads tfllm's model section straight from
    a Hugging Face config.json: for architectures whose keras-hub backbone cannot express
    every setting transformers has (Gemma 3's layer pattern and RoPE bases).
    """

    backbone: str
    tfllm_family: str
    description: str
    model_fields: Callable[..., dict]  # (keras-hub config, max_length=None) -> fields
    backbone_kwargs: Callable[[object, dict], dict]
    weight_map: Callable[[object], Dict[str, object]]  # values: paths or `Permuted`
    understood: frozenset
    hf_fields: Optional[Callable[[dict, str], dict]] = None


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


def _plain_attention(m, backbone: str, window_ok: bool = False) -> None:
    """Refuses llama-family settings a keras-hub backbone other than Gemma3's lacks."""
    head_dim = m.head_dim or m.hidden_dim // m.num_query_heads
    bad = [f"model.{k}={getattr(m, k)}" for k in ("sliding_window_pattern",
                                                    "rope_local_theta") if getattr(m, k)]
    if m.sliding_window and not window_ok:
        bad.append(f"model.sliding_window={m.sliding_window}")
    if m.query_pre_attn_scalar and m.query_pre_attn_scalar != head_dim:
        bad.append(f"model.query_pre_attn_scalar={m.query_pre_attn_scalar}")
    if bad:
        raise PretrainedError(f"keras-hub's {backbone} cannot express {', '.join(bad)}.")


def _no_llama3(m, backbone: str) -> None:
    _plain_attention(m, backbone, window_ok=backbone == "MistralBackbone")
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
        _plain_attention(m, backbone)
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
                "sliding_window": m.sliding_window or original.get("sliding_window",
                                                                    m.max_sequence_length),
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


# ---- Gemma 3 ---------------------------------------------------------------------------
#: keras-hub's Gemma3Backbone (0.32) hard-codes what transformers' config sets: every 6th
#: layer global, RoPE bases 10,000 (local) and 1,000,000 (global).
_KH_GEMMA3 = {"pattern": 6, "local_theta": 10_000.0, "global_theta": 1_000_000.0}

#: transformers' Gemma3TextConfig defaults, for keys a config.json leaves out
_HF_GEMMA3_DEFAULTS = {"rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
                       "sliding_window": 4096, "tie_word_embeddings": True,
                       "max_position_embeddings": 131_072, "head_dim": 256,
                       "num_key_value_heads": 4, "num_attention_heads": 8}


def _gemma3_refuse(path: str, key: str, value, why: str) -> PretrainedError:
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
    raise _gemma3_refuse(path, key, shown, "tfllm implements RoPE types default, linear "
                         "and llama3 on global layers")


def _gemma3_hf_fields(c: dict, path: str) -> dict:
    """tfllm's model section of a transformers Gemma 3 text config.json, in the
    transformers 5 layout (rope_parameters per layer type, layer_types) or the
    transformers 4 one (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern)."""
    try:
        return _gemma3_hf_fields_of(c, path)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, PretrainedError):
            raise
        raise PretrainedError(f"{path}/config.json: not a Gemma 3 text config tfllm can "
                              f"read ({type(e).__name__}: {e}); the file is damaged or "
                              "incomplete.") from None


def _gemma3_hf_fields_of(c: dict, path: str) -> dict:
    where = f"{path}/config.json"
    if c.get("model_type") != "gemma3_text":
        raise PretrainedError(f"{where}: model_type {c.get('model_type')!r} (Gemma 3 with its "
                              "vision tower); tfllm imports Gemma 3 text models "
                              "(model_type gemma3_text, Gemma3ForCausalLM).")
    c = {**_HF_GEMMA3_DEFAULTS, **{k: v for k, v in c.items() if v is not None or k in (
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
            raise _gemma3_refuse(where, key, c[key], f"tfllm computes {why}")
    layers = int(c["num_hidden_layers"])
    types = c.get("layer_types")
    if types is None:
        pattern = int(c.get("sliding_window_pattern", _KH_GEMMA3["pattern"]))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise _gemma3_refuse(where, "layer_types", types, f"{layers} entries of "
                             "sliding_attention / full_attention")
    window = c.get("sliding_window") or 0
    local = [t == "sliding_attention" for t in types]
    if any(local) and not window:
        raise _gemma3_refuse(where, "sliding_window", c.get("sliding_window"),
                             "local layers need a window")
    if not c["tie_word_embeddings"]:
        raise _gemma3_refuse(where, "tie_word_embeddings", False, "every Gemma 3 is tied, "
                             "and keras-hub's converter reads no lm_head")
    pattern = _pattern_of(local)
    if pattern is None:
        raise _gemma3_refuse(where, "layer_types", types, "tfllm places global layers "
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
        raise _gemma3_refuse(where, "rope_parameters", params,
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


def _gemma3_fields(kh: dict, max_length=None) -> dict:
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
            raise _gemma3_refuse(where, key, kh.get(key), f"tfllm computes {why}")
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
        "rope_theta": _KH_GEMMA3["global_theta"], "rope_local_theta": _KH_GEMMA3["local_theta"],
        "sliding_window": int(kh["sliding_window_size"]) if sliding else 0,
        "sliding_window_pattern": _KH_GEMMA3["pattern"] if sliding else 0,
        "query_pre_attn_scalar": float(head_dim),
        "rope_scaling": "linear" if factor != 1.0 else "none", "rope_scaling_factor": factor,
        "tie_embeddings": True, "use_bias": False, "qkv_bias": None, "qk_norm": True,
        "max_sequence_length": int(max_length or DEFAULT_MAX_LENGTH),
    }


def _gemma3_kwargs(m, original) -> dict:
    """tfllm's model section -> Gemma3Backbone arguments; what keras-hub hard-codes must
    match."""
    head_dim = m.head_dim or m.hidden_dim // m.num_query_heads
    problems = []
    if m.sliding_window:
        if m.sliding_window_pattern != _KH_GEMMA3["pattern"]:
            problems.append(f"model.sliding_window_pattern={m.sliding_window_pattern} "
                            f"(keras-hub: {_KH_GEMMA3['pattern']})")
        if (m.rope_local_theta or m.rope_theta) != _KH_GEMMA3["local_theta"]:
            problems.append(f"model.rope_local_theta={m.rope_local_theta} (keras-hub: "
                            f"{_KH_GEMMA3['local_theta']:g})")
    if m.rope_theta != _KH_GEMMA3["global_theta"]:
        problems.append(f"model.rope_theta={m.rope_theta} (keras-hub: "
                        f"{_KH_GEMMA3['global_theta']:g})")
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


def _gemma3_weight_map(m) -> Dict[str, object]:
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


_GEMMA3_KEYS = frozenset({
    "vocabulary_size", "image_size", "num_layers", "num_query_heads", "num_key_value_heads",
    "hidden_dim", "intermediate_dim", "head_dim", "query_head_dim_normalize",
    "use_query_key_norm", "use_post_ffw_norm", "use_post_attention_norm",
    "attention_logit_soft_cap", "final_logit_soft_cap", "use_sliding_window_attention",
    "sliding_window_size", "local_rope_scaling_factor", "global_rope_scaling_factor",
    "vision_encoder", "layer_norm_epsilon", "use_bidirectional_attention",
    "is_embedding_model", "pooling_intermediate_dim", "embedding_dim"})


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
    Family("Gemma3Backbone", "gemma3", "Gemma 3 text models (1B; the text decoder of 4B+: "
           "local/global layers, query/key norms, GeGLU)", _gemma3_fields, _gemma3_kwargs,
           _gemma3_weight_map, _GEMMA3_KEYS, hf_fields=_gemma3_hf_fields),
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
    if model.family == "gemma3":
        return "Gemma3Backbone"
    if model.qk_norm:
        return "Qwen3Backbone"
    return "QwenBackbone" if model.qkv_bias else "Llama3Backbone"
