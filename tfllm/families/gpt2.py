"""GPT-2: transformers' `gpt2`, keras-hub's GPT2Backbone, tfllm's `gpt` model."""

from __future__ import annotations

from typing import Dict, List

import numpy as np

from tfllm.families.base import Backbone, Family, LoraNames, PretrainedError, Tensor, same

MODEL_TYPE = "gpt2"
MODEL_FAMILY = "gpt"
BACKBONE = "GPT2Backbone"

#: GPT-2's fused query/key/value (`attn.c_attn`) is three tfllm projections.
LORA = LoraNames(
    modules={"attn.c_attn": ("attention/query", "attention/key", "attention/value"),
             "attn.c_proj": ("attention/output",), "mlp.c_fc": ("mlp/up",),
             "mlp.c_proj": ("mlp/down",)},
    layer_prefix="transformer.h.{i}.", fan_in_fan_out=True,  # Conv1D: (in, out)
    vllm_refusal=("vLLM's GPT-2 takes no LoRA adapters: export merged weights (--format hf "
                  "--merge-lora)"))


# ---- keras-hub --------------------------------------------------------------------------
def _fields(kh: dict, max_length=None) -> dict:
    return {"family": MODEL_FAMILY, "vocab_size": kh["vocabulary_size"],
            "hidden_dim": kh["hidden_dim"], "num_layers": kh["num_layers"],
            "num_query_heads": kh["num_heads"], "num_key_value_heads": 0, "head_dim": 0,
            "intermediate_dim": kh["intermediate_dim"],
            "max_sequence_length": kh["max_sequence_length"],
            "norm_epsilon": 1e-5,  # keras-hub's GPT2Backbone (and GPT-2) use 1e-5
            "tie_embeddings": True, "use_bias": True, "qkv_bias": None,
            "rope_scaling": "none"}


def _kwargs(m, original) -> dict:
    if (m.family != MODEL_FAMILY or m.tie_embeddings is False or m.use_bias is False
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


def _weight_map(m) -> Dict[str, str]:
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


# ---- Hugging Face -----------------------------------------------------------------------
def _config_out(m, common: dict) -> dict:
    if not m.use_bias or not m.qkv_bias or not m.tie_embeddings:
        raise PretrainedError("GPT-2 has biases everywhere and tied embeddings; this "
                              "model (model.use_bias/qkv_bias/tie_embeddings) cannot be "
                              "written as gpt2.")
    if (m.num_key_value_heads not in (0, m.num_query_heads)
            or m.head_dim not in (0, m.hidden_dim // m.num_query_heads)):
        raise PretrainedError("GPT-2 has no grouped-query heads and head_dim = "
                              "hidden_dim / num_query_heads; this model cannot be written "
                              "as gpt2.")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": MODEL_TYPE,
            "n_embd": m.hidden_dim, "n_layer": m.num_layers, "n_head": m.num_query_heads,
            "n_inner": m.intermediate_dim, "n_positions": m.max_sequence_length,
            "activation_function": "gelu_new",  # tfllm's gelu is the tanh form
            "layer_norm_epsilon": float(m.norm_epsilon),
            # tfllm trains without dropout; a model fine-tuned further in
            # transformers gets none either unless it asks.
            "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, **common}


def _tensors(m) -> List[Tensor]:
    e, i_dim = m.hidden_dim, m.intermediate_dim
    out = [Tensor("transformer.wte.weight", ("token_embedding/embeddings",),
                  (m.vocab_size, e), same),
           Tensor("transformer.wpe.weight", ("position_embedding/embeddings",),
                  (m.max_sequence_length, e), same)]

    def fused(q, k, v):  # GPT-2's Conv1D c_attn: (E, 3E), q | k | v
        return np.concatenate([t.reshape(e, -1) for t in (q, k, v)], axis=1)

    def fused_bias(q, k, v):
        return np.concatenate([t.reshape(-1) for t in (q, k, v)])

    for i in range(m.num_layers):
        ours, theirs = f"block_{i}/", f"transformer.h.{i}."
        attn = [f"{ours}attention/{n}" for n in ("query", "key", "value")]
        out += [
            Tensor(theirs + "ln_1.weight", (ours + "attention_norm/scale",), (e,), same),
            Tensor(theirs + "ln_1.bias", (ours + "attention_norm/bias",), (e,), same),
            Tensor(theirs + "attn.c_attn.weight", tuple(a + "/kernel" for a in attn),
                   (e, 3 * e), fused),
            Tensor(theirs + "attn.c_attn.bias", tuple(a + "/bias" for a in attn),
                   (3 * e,), fused_bias),
            # Conv1D weights are (in, out), as tfllm's kernels are: no transpose.
            Tensor(theirs + "attn.c_proj.weight", (ours + "attention/output/kernel",),
                   (e, e), lambda x: x.reshape(e, e)),
            Tensor(theirs + "attn.c_proj.bias", (ours + "attention/output/bias",), (e,),
                   same),
            Tensor(theirs + "ln_2.weight", (ours + "mlp_norm/scale",), (e,), same),
            Tensor(theirs + "ln_2.bias", (ours + "mlp_norm/bias",), (e,), same),
            Tensor(theirs + "mlp.c_fc.weight", (ours + "mlp/up/kernel",), (e, i_dim), same),
            Tensor(theirs + "mlp.c_fc.bias", (ours + "mlp/up/bias",), (i_dim,), same),
            Tensor(theirs + "mlp.c_proj.weight", (ours + "mlp/down/kernel",), (i_dim, e),
                   same),
            Tensor(theirs + "mlp.c_proj.bias", (ours + "mlp/down/bias",), (e,), same),
        ]
    out += [Tensor("transformer.ln_f.weight", ("final_norm/scale",), (e,), same),
            Tensor("transformer.ln_f.bias", ("final_norm/bias",), (e,), same)]
    return out


FAMILY = Family(
    model_type=MODEL_TYPE, architecture="GPT2LMHeadModel", model_family=MODEL_FAMILY,
    writes=lambda m, backbone: m.family == MODEL_FAMILY,
    config_out=_config_out, tensors=_tensors, lora=LORA,
    keras_hub=(Backbone(BACKBONE, MODEL_FAMILY, "GPT-2", _fields, _kwargs, _weight_map,
                        frozenset({"vocabulary_size", "num_layers", "num_heads",
                                   "hidden_dim", "intermediate_dim",
                                   "max_sequence_length"})),),
    default_backbone=lambda m: BACKBONE if m.family == MODEL_FAMILY else None,
    refused=(
        ("activation_function", lambda v, c: v in (None, "gelu_new", "gelu_pytorch_tanh"),
         "the tanh GELU"),
        ("layer_norm_epsilon", lambda v, c: v is None or abs(v - 1e-5) < 1e-12,
         "LayerNorm epsilon 1e-5"),
        ("n_inner", lambda v, c: v is None or v == 4 * c["n_embd"], "an MLP of 4 x n_embd"),
        ("scale_attn_by_inverse_layer_idx", lambda v, c: not v,
         "the same attention scale in every layer"),
        ("scale_attn_weights", lambda v, c: v is None or v,
         "attention scaled by 1/sqrt(head_dim)"),
        ("tie_word_embeddings", lambda v, c: v is None or v,
         "the output layer tied to the token embedding")))
