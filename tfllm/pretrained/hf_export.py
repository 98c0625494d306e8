"""A tfllm run out as a Hugging Face Transformers folder (`tfllm export --format hf`).

The folder is what `transformers.AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load, and therefore what vLLM and SGLang serve:

* `config.json` in the current transformers layout (`rope_parameters`, transformers 5;
  transformers 4.x reads the same keys it knows and ignores the rest, so the RoPE
  scaling of such a folder is only honoured by transformers >= 5);
* `model.safetensors`, or `model-0000K-of-0000N.safetensors` shards plus
  `model.safetensors.index.json` when the weights exceed `max_shard_bytes` (the split
  transformers' own `save_pretrained(max_shard_size=...)` makes);
* the tokenizer files (keras-hub's own Hugging Face exporter writes them) and
  `generation_config.json` (the tokenizer's bos/eos ids).

Weights are read straight from the run's latest committed checkpoint, one tensor at a
time (`tfllm.checkpoint.reader`: each tensor is assembled from the blocks every client
saved), so a run sharded over any mesh and any number of clients is exported by one
process that never holds more than one tensor of the model (GPT-2's fused q/k/v: three).
No model is built and no mesh is needed. Everything is written under a temporary name
next to `out` and renamed last; an existing `out` is never replaced.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from tfllm import files, internals
from tfllm.models import model_class
from tfllm.models.llama.llama import is_local_layer
from tfllm.pretrained import peft
from tfllm.families import PretrainedError, Tensor

#: --dtype -> safetensors dtype code
DTYPES = {"float32": "F32", "bfloat16": "BF16"}


def _same(x):
    return x


def _linear(x):
    """A kernel (in, ...) or (..., out) laid out as tfllm's einsum uses it -> a
    torch nn.Linear weight (out, in)."""
    return x.T


# ---- the weight tables ------------------------------------------------------------------
def _gemma3_tensors(m) -> List[Tensor]:
    """Llama's tensors with Gemma 3's four norms per layer (its post_attention_layernorm
    follows attention; the MLP's input norm is pre_feedforward_layernorm)."""
    e = m.hidden_dim
    out = []
    for t in _llama_tensors(m, _tied(m), qk_norm=True):
        if t.key.endswith(".post_attention_layernorm.weight"):  # tfllm's mlp_norm
            layer, ours = t.key[: -len("post_attention_layernorm.weight")], t.sources[0]
            block = ours[: -len("mlp_norm/scale")]
            out += [Tensor(layer + "post_attention_layernorm.weight",
                           (block + "attention_post_norm/scale",), (e,), _same),
                    Tensor(layer + "pre_feedforward_layernorm.weight", (ours,), (e,), _same),
                    Tensor(layer + "post_feedforward_layernorm.weight",
                           (block + "mlp_post_norm/scale",), (e,), _same)]
        else:
            out.append(t)
    return out


def _llama_tensors(m, tie: bool, qk_norm: Optional[bool] = None) -> List[Tensor]:
    h, kv = m.num_query_heads, m.num_key_value_heads or m.num_query_heads
    hd = m.head_dim or m.hidden_dim // m.num_query_heads
    e, i_dim = m.hidden_dim, m.intermediate_dim
    out = [Tensor("model.embed_tokens.weight", ("token_embedding/embeddings",),
                  (m.vocab_size, e), _same)]
    for i in range(m.num_layers):
        ours, theirs = f"block_{i}/", f"model.layers.{i}."
        out += [
            Tensor(theirs + "input_layernorm.weight", (ours + "attention_norm/scale",),
                   (e,), _same),
            Tensor(theirs + "post_attention_layernorm.weight", (ours + "mlp_norm/scale",),
                   (e,), _same),
            # (E, heads, head_dim) -> (heads * head_dim, E)
            Tensor(theirs + "self_attn.q_proj.weight", (ours + "attention/query/kernel",),
                   (h * hd, e), lambda x, n=h * hd: x.reshape(-1, n).T),
            Tensor(theirs + "self_attn.k_proj.weight", (ours + "attention/key/kernel",),
                   (kv * hd, e), lambda x, n=kv * hd: x.reshape(-1, n).T),
            Tensor(theirs + "self_attn.v_proj.weight", (ours + "attention/value/kernel",),
                   (kv * hd, e), lambda x, n=kv * hd: x.reshape(-1, n).T),
            # (heads, head_dim, E) -> (E, heads * head_dim)
            Tensor(theirs + "self_attn.o_proj.weight", (ours + "attention/output/kernel",),
                   (e, h * hd), lambda x, n=h * hd: x.reshape(n, -1).T),
            Tensor(theirs + "mlp.gate_proj.weight", (ours + "mlp/gate/kernel",),
                   (i_dim, e), _linear),
            Tensor(theirs + "mlp.up_proj.weight", (ours + "mlp/up/kernel",), (i_dim, e),
                   _linear),
            Tensor(theirs + "mlp.down_proj.weight", (ours + "mlp/down/kernel",),
                   (e, i_dim), _linear),
        ]
        if m.qk_norm if qk_norm is None else qk_norm:
            out += [Tensor(f"{theirs}self_attn.{n}_norm.weight",
                           (f"{ours}attention/{a}_norm/scale",), (hd,), _same)
                    for n, a in (("q", "query"), ("k", "key"))]
        if _qkv_bias(m):
            out += [Tensor(f"{theirs}self_attn.{n}_proj.bias", (f"{ours}attention/{a}/bias",),
                           (heads * hd,), lambda x: x.reshape(-1))
                    for n, a, heads in (("q", "query", h), ("k", "key", kv),
                                        ("v", "value", kv))]
    out.append(Tensor("model.norm.weight", ("final_norm/scale",), (e,), _same))
    if not tie:
        out.append(Tensor("lm_head.weight", ("lm_head/kernel",), (m.vocab_size, e), _linear))
    return out


def _gpt2_tensors(m) -> List[Tensor]:
    e, i_dim = m.hidden_dim, m.intermediate_dim
    out = [Tensor("transformer.wte.weight", ("token_embedding/embeddings",),
                  (m.vocab_size, e), _same),
           Tensor("transformer.wpe.weight", ("position_embedding/embeddings",),
                  (m.max_sequence_length, e), _same)]

    def fused(q, k, v):  # GPT-2's Conv1D c_attn: (E, 3E), q | k | v
        return np.concatenate([t.reshape(e, -1) for t in (q, k, v)], axis=1)

    def fused_bias(q, k, v):
        return np.concatenate([t.reshape(-1) for t in (q, k, v)])

    for i in range(m.num_layers):
        ours, theirs = f"block_{i}/", f"transformer.h.{i}."
        attn = [f"{ours}attention/{n}" for n in ("query", "key", "value")]
        out += [
            Tensor(theirs + "ln_1.weight", (ours + "attention_norm/scale",), (e,), _same),
            Tensor(theirs + "ln_1.bias", (ours + "attention_norm/bias",), (e,), _same),
            Tensor(theirs + "attn.c_attn.weight", tuple(a + "/kernel" for a in attn),
                   (e, 3 * e), fused),
            Tensor(theirs + "attn.c_attn.bias", tuple(a + "/bias" for a in attn),
                   (3 * e,), fused_bias),
            # Conv1D weights are (in, out), as tfllm's kernels are: no transpose.
            Tensor(theirs + "attn.c_proj.weight", (ours + "attention/output/kernel",),
                   (e, e), lambda x: x.reshape(e, e)),
            Tensor(theirs + "attn.c_proj.bias", (ours + "attention/output/bias",), (e,),
                   _same),
            Tensor(theirs + "ln_2.weight", (ours + "mlp_norm/scale",), (e,), _same),
            Tensor(theirs + "ln_2.bias", (ours + "mlp_norm/bias",), (e,), _same),
            Tensor(theirs + "mlp.c_fc.weight", (ours + "mlp/up/kernel",), (e, i_dim), _same),
            Tensor(theirs + "mlp.c_fc.bias", (ours + "mlp/up/bias",), (i_dim,), _same),
            Tensor(theirs + "mlp.c_proj.weight", (ours + "mlp/down/kernel",), (i_dim, e),
                   _same),
            Tensor(theirs + "mlp.c_proj.bias", (ours + "mlp/down/bias",), (e,), _same),
        ]
    out += [Tensor("transformer.ln_f.weight", ("final_norm/scale",), (e,), _same),
            Tensor("transformer.ln_f.bias", ("final_norm/bias",), (e,), _same)]
    return out


# ---- the config -------------------------------------------------------------------------
def _resolved(m, field: str) -> bool:
    """A config field left null, resolved as the model class does (its family_defaults)."""
    value = getattr(m, field)
    return bool(model_class(m.family).family_defaults[field] if value is None else value)


def _tied(m) -> bool:
    return _resolved(m, "tie_embeddings")


def _qkv_bias(m) -> bool:
    """q/k/v biases as `Attention` resolves them (null: the model's use_bias)."""
    return bool(m.qkv_bias) if m.qkv_bias is not None else _resolved(m, "use_bias")


def model_type_for(m, backbone: Optional[str]) -> str:
    """The transformers model_type a tfllm model section is written as.

    An imported run keeps its architecture (pretrained.json's keras-hub backbone);
    otherwise GPT-2 for `gpt`, Qwen2 for a Llama with q/k/v biases, else Llama.
    """
    if m.family == "gpt":
        return "gpt2"
    if m.family == "gemma3":
        return "gemma3_text"
    head_dim = m.head_dim or m.hidden_dim // m.num_query_heads
    if m.query_pre_attn_scalar and m.query_pre_attn_scalar != head_dim:
        raise PretrainedError(f"model.query_pre_attn_scalar={m.query_pre_attn_scalar} (not "
                              f"head_dim {head_dim}) exists in transformers only for Gemma "
                              "3 (model.family=gemma3).")
    if m.sliding_window:  # transformers' Mistral: one window in every layer
        if (m.sliding_window_pattern or m.rope_local_theta or m.qk_norm or _qkv_bias(m)
                or _tied(m) or m.query_pre_attn_scalar):
            raise PretrainedError(
                f"model.sliding_window={m.sliding_window} on the llama family is written as "
                "Mistral, which has one window in every layer, untied embeddings and no "
                "biases, query/key norms, local RoPE base or query_pre_attn_scalar; this "
                "model has no transformers counterpart.")
        return "mistral"
    if m.qk_norm:
        if _qkv_bias(m):
            raise PretrainedError("a model with query/key norms (model.qk_norm, Qwen3) and "
                                  "q/k/v biases has no transformers counterpart.")
        return "qwen3"
    if backbone == "MistralBackbone" and not _qkv_bias(m) and not _tied(m):
        return "mistral"
    return "qwen2" if _qkv_bias(m) else "llama"


def _rope_parameters(m) -> dict:
    rope = {"rope_type": "default", "rope_theta": float(m.rope_theta)}
    if m.rope_scaling == "linear":
        rope.update(rope_type="linear", factor=float(m.rope_scaling_factor))
    elif m.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=float(m.rope_scaling_factor),
                    low_freq_factor=float(m.rope_low_freq_factor),
                    high_freq_factor=float(m.rope_high_freq_factor),
                    original_max_position_embeddings=int(m.rope_original_max_length))
    elif m.rope_scaling != "none":
        raise PretrainedError(f"model.rope_scaling={m.rope_scaling!r} has no transformers "
                              "counterpart tfllm writes (none, linear, llama3).")
    return rope


def hf_config(m, model_type: str, dtype: str, bos: Optional[int],
              eos: Optional[int]) -> dict:
    """config.json for tfllm's model section `m` as `model_type` (transformers 5 layout)."""
    common = {"vocab_size": m.vocab_size, "bos_token_id": bos, "eos_token_id": eos,
              "tie_word_embeddings": _tied(m), "dtype": dtype, "use_cache": True}
    if model_type == "gpt2":
        if not _resolved(m, "use_bias") or not _qkv_bias(m) or not _tied(m):
            raise PretrainedError("GPT-2 has biases everywhere and tied embeddings; this "
                                  "model (model.use_bias/qkv_bias/tie_embeddings) cannot be "
                                  "written as gpt2.")
        if (m.num_key_value_heads not in (0, m.num_query_heads)
                or m.head_dim not in (0, m.hidden_dim // m.num_query_heads)):
            raise PretrainedError("GPT-2 has no grouped-query heads and head_dim = "
                                  "hidden_dim / num_query_heads; this model cannot be written "
                                  "as gpt2.")
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_embd": m.hidden_dim, "n_layer": m.num_layers, "n_head": m.num_query_heads,
                "n_inner": m.intermediate_dim, "n_positions": m.max_sequence_length,
                "activation_function": "gelu_new",  # tfllm's gelu is the tanh form
                "layer_norm_epsilon": float(m.norm_epsilon),
                # tfllm trains without dropout; a model fine-tuned further in
                # transformers gets none either unless it asks.
                "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False, **common}
    if model_type == "gemma3_text":
        return _gemma3_config(m, common)
    if _resolved(m, "use_bias"):
        raise PretrainedError("model.use_bias=true (biases on every projection) has no "
                              "Llama/Mistral/Qwen2 counterpart in transformers; only q/k/v "
                              "biases (model.qkv_bias, Qwen2) are written.")
    names = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
             "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    out = {"architectures": [names[model_type]], "model_type": model_type,
           "hidden_size": m.hidden_dim, "intermediate_size": m.intermediate_dim,
           "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_query_heads,
           "num_key_value_heads": m.num_key_value_heads or m.num_query_heads,
           "head_dim": m.head_dim or m.hidden_dim // m.num_query_heads,
           "hidden_act": "silu", "max_position_embeddings": m.max_sequence_length,
           "rms_norm_eps": float(m.norm_epsilon), "rope_parameters": _rope_parameters(m),
           "attention_dropout": 0.0, **common}
    if model_type in ("llama", "qwen3"):
        out.update(attention_bias=False)
    if model_type == "llama":
        out.update(mlp_bias=False, pretraining_tp=1)
    elif model_type == "mistral":
        out["sliding_window"] = m.sliding_window or None
    else:  # qwen2, qwen3: full attention in every layer, as tfllm computes
        out.update(use_sliding_window=False, sliding_window=None,
                   max_window_layers=m.num_layers,
                   layer_types=["full_attention"] * m.num_layers)
    return out


def _gemma3_config(m, common: dict) -> dict:
    if _resolved(m, "use_bias") or _qkv_bias(m):
        raise PretrainedError("Gemma 3 has no biases; this model (model.use_bias/qkv_bias) "
                              "cannot be written as gemma3_text.")
    head_dim = m.head_dim or m.hidden_dim // m.num_query_heads
    scalar = float(m.query_pre_attn_scalar or head_dim)
    if not scalar.is_integer():
        raise PretrainedError(f"model.query_pre_attn_scalar={scalar}: transformers' "
                              "Gemma3TextConfig takes a whole number.")
    scalar = int(scalar)
    local = ["sliding_attention" if is_local_layer(m, i) else "full_attention"
             for i in range(m.num_layers)]
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_size": m.hidden_dim, "intermediate_size": m.intermediate_dim,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_query_heads,
            "num_key_value_heads": m.num_key_value_heads or m.num_query_heads,
            "head_dim": head_dim, "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": m.max_sequence_length,
            "rms_norm_eps": float(m.norm_epsilon),
            "query_pre_attn_scalar": scalar,
            "sliding_window": int(m.sliding_window) or None, "layer_types": local,
            "rope_parameters": {
                "full_attention": _rope_parameters(m),
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": float(m.rope_local_theta or m.rope_theta)}},
            "attention_bias": False, "attention_dropout": 0.0,
            "attn_logit_softcapping": None, "final_logit_softcapping": None,
            "use_bidirectional_attention": False, "pad_token_id": None, **common}


def tensors_for(m, model_type: str) -> List[Tensor]:
    """Every tensor of the Hugging Face folder, in the order written."""
    if model_type == "gpt2":
        return _gpt2_tensors(m)
    if model_type == "gemma3_text":
        return _gemma3_tensors(m)
    return _llama_tensors(m, _tied(m))


# ---- safetensors, one tensor at a time -----------------------------------------------------
def _parse_size(text) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes (transformers' max_shard_size)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.I)
    if not match:
        raise PretrainedError(f"--max-shard-size {text!r}: give a size such as 5GB, 500MB "
                              "or a number of bytes.")
    unit = (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    size = int(float(match.group(1)) * scale)
    if size <= 0:
        raise PretrainedError(f"--max-shard-size {text!r}: must be positive.")
    return size


def _nbytes(t: Tensor, itemsize: int) -> int:
    return int(np.prod(t.shape, dtype=np.int64)) * itemsize


def plan_shards(tensors: Sequence[Tensor], itemsize: int,
                max_bytes: int) -> List[List[Tensor]]:
    """Tensors in order, split where the next one would exceed `max_bytes` (a tensor
    larger than the limit gets a shard of its own, as in transformers)."""
    shards, current, size = [], [], 0
    for t in tensors:
        n = _nbytes(t, itemsize)
        if current and size + n > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += n
    if current:
        shards.append(current)
    return shards


def _write_safetensors(root: str, path: str, tensors: Sequence[Tensor], code: str,
                       itemsize: int, produce: Callable[[Tensor], np.ndarray]) -> None:
    """Writes a safetensors file `path` inside `root`: the header first (shapes are
    known), then each tensor as it is produced, so only one is in memory."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for t in tensors:
        n = _nbytes(t, itemsize)
        header[t.key] = {"dtype": code, "shape": list(t.shape),
                         "data_offsets": [offset, offset + n]}
        offset += n
    data = json.dumps(header, separators=(",", ":")).encode("utf-8")
    data += b" " * (-len(data) % 8)
    with files.open_for_writing(root, path, "wb") as f:
        f.write(struct.pack("<Q", len(data)))
        f.write(data)
        for t in tensors:
            array = produce(t)
            f.write(np.ascontiguousarray(array).tobytes())
        f.flush()
        os.fsync(f.fileno())


# ---- the export --------------------------------------------------------------------------
def _model_prefix(names) -> str:
    """'model/<model name>/' of the checkpoint's model variables."""
    for name in names:
        if name.startswith("model/") and name.endswith("/token_embedding/embeddings"):
            return name[: -len("token_embedding/embeddings")]
    raise PretrainedError("the checkpoint holds no model/.../token_embedding/embeddings; it "
                          "is not a tfllm model checkpoint.")


def _tokenizer_files(config, out: str, workdir: str
                     ) -> Tuple[bool, Optional[int], Optional[int], str]:
    """Writes the run's tokenizer as Hugging Face files into `out`.

    Returns:
      (written, bos id, eos id, why not when not written).
    """
    from tfllm.data.tokenizer import load_keras_hub_tokenizer
    from tfllm.pretrained.exporter import run_tokenizer_folder
    d = config.data
    path = run_tokenizer_folder(config, workdir)  # none of a run's files linked out of it
    if path is None:
        return False, None, None, (f"the run's tokenizer (data.tokenizer={d.tokenizer}) is "
                                   "not a keras-hub tokenizer preset")
    tokenizer = load_keras_hub_tokenizer(path)
    bos = eos = None
    if getattr(tokenizer, "start_token", None) is not None:
        bos = int(tokenizer.token_to_id(tokenizer.start_token))
    if getattr(tokenizer, "end_token", None) is not None:
        eos = int(tokenizer.token_to_id(tokenizer.end_token))
    try:
        internals.export_hf_tokenizer(tokenizer, out)
    except ValueError as e:  # a tokenizer class keras-hub cannot write
        return False, bos, eos, str(e)
    return True, bos, eos, ""


def export_hf(config, workdir: str, out: str, dtype: str = "float32",
              max_shard_size="5GB", merge_lora: bool = False) -> dict:
    """Writes the run in `workdir` (latest checkpoint) as a Hugging Face folder `out`.

    Args:
      config: the run's config (its config.yaml, or the checkpoint's).
      workdir: the run directory.
      out: the folder to create; it must not exist (or be empty).
      dtype: `float32` (the checkpoint's master weights, exactly) or `bfloat16` (rounded
        to nearest even, how most published checkpoints are stored).
      max_shard_size: the largest safetensors file, as transformers' `max_shard_size`.
      merge_lora: a run with LoRA adapters (lora.rank > 0) is written with each adapter
        merged into its kernel, W + s A B, in float32 before the cast; without it such a
        run is refused (its adapters would be dropped without a word).

    Returns:
      A summary: out, step, model_type, dtype, files, tensors, bytes, tokenizer.
    """
    import tensorflow as tf

    from tfllm.checkpoint.reader import Reader
    from tfllm.checkpoint.workdir import Workdir
    from tfllm.data.chat_template import export_template
    from tfllm.pretrained.exporter import require_new_folder
    from tfllm.pretrained.importer import read_origin

    if dtype not in DTYPES:
        raise PretrainedError(f"--dtype {dtype}: choose one of {sorted(DTYPES)}.")
    lora = config.lora
    if lora.rank and not merge_lora:
        raise PretrainedError(f"{workdir} trains LoRA adapters (lora.rank={lora.rank}): pass "
                              "--merge-lora to write merged weights, or --format peft for "
                              "the adapter alone.")
    if merge_lora and not lora.rank:
        raise PretrainedError(f"--merge-lora: {workdir} has no LoRA adapters (lora.rank=0).")
    max_bytes = _parse_size(max_shard_size)
    out = require_new_folder(out, workdir)
    m = config.model
    origin = read_origin(workdir) or {}
    model_type = model_type_for(m, origin.get("backbone"))
    run_dir = Workdir(workdir)
    path = run_dir.latest_checkpoint()
    if path is None:
        raise FileNotFoundError(f"{run_dir.checkpoints} holds no committed "
                                "checkpoint; train or import first.")
    reader = Reader(path)
    prefix = _model_prefix(reader.variables)
    tensors = tensors_for(m, model_type)
    for t in tensors:
        for s in t.sources:
            if prefix + s not in reader.variables:
                raise PretrainedError(f"{path}: holds no {prefix + s} for {t.key}; the "
                                      "checkpoint does not match the run's model config.")
    code, np_dtype = DTYPES[dtype], np.dtype(tf.as_dtype(dtype).as_numpy_dtype)

    def produce(t: Tensor) -> np.ndarray:
        arrays = [reader.whole(prefix + s).astype(np.float32, copy=False) for s in t.sources]
        if merge_lora:
            arrays = [peft.merged(reader, prefix, s, a, lora) for s, a in zip(t.sources, arrays)]
        array = t.make(*arrays)
        if tuple(array.shape) != t.shape:
            raise PretrainedError(f"{t.key}: made shape {list(array.shape)} from "
                                  f"{list(t.sources)}, transformers expects {list(t.shape)}; "
                                  "the checkpoint does not match the run's model config.")
        return array.astype(np_dtype)

    with files.written_atomically(out) as tmp:
        written, bos, eos, why = _tokenizer_files(config, tmp, workdir)
        # the run's chat template, when it has one: its own copy, never a path the
        # config names (a config.yaml anyone edited could name any file of the user's)
        export_template(config.data, tmp, run=workdir)
        with files.open_for_writing(tmp, "config.json") as f:
            json.dump(hf_config(m, model_type, dtype, bos, eos), f, indent=2,
                      sort_keys=True)
        with files.open_for_writing(tmp, "generation_config.json") as f:
            json.dump({"bos_token_id": bos, "eos_token_id": eos}, f, indent=2)
        itemsize = np_dtype.itemsize
        shards = plan_shards(tensors, itemsize, max_bytes)
        names = []
        weight_map = {}
        for k, shard in enumerate(shards):
            name = ("model.safetensors" if len(shards) == 1 else
                    f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors")
            _write_safetensors(tmp, name, shard, code, itemsize, produce)
            names.append(name)
            weight_map.update({t.key: name for t in shard})
        total = sum(_nbytes(t, itemsize) for t in tensors)
        if len(shards) > 1:
            with files.open_for_writing(tmp, "model.safetensors.index.json") as f:
                json.dump({"metadata": {"total_size": total},
                           "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    summary = {"out": out, "step": reader.step, "model_type": model_type, "dtype": dtype,
               "files": names, "tensors": len(tensors), "bytes": total, "tokenizer": written}
    if not written:
        summary["tokenizer_note"] = why
    return summary


# ---- LoRA adapters (tfllm export --format peft) -----------------------------------------
def export_peft(config, workdir: str, out: str, dtype: str = "float32",
                vllm_check: bool = True) -> dict:
    """Writes the LoRA adapters of the run in `workdir` (latest checkpoint) as a PEFT
    adapter folder `out` (new or empty): `tfllm.pretrained.peft` has the format.

    Args:
      config: the run's config (lora.rank > 0).
      workdir: the run directory.
      out: the folder to create.
      dtype: float32 or bfloat16 (the tensors' stored dtype).
      vllm_check: refuse (one line) an adapter vLLM would refuse or ignore.

    Returns:
      A summary: out, step, model_type, r, tensors, bytes.
    """
    import tensorflow as tf

    from tfllm.checkpoint.reader import Reader
    from tfllm.checkpoint.workdir import Workdir
    from tfllm.pretrained.exporter import require_new_folder
    from tfllm.pretrained.importer import read_origin

    lora = config.lora
    if lora.rank <= 0:
        raise PretrainedError(f"{workdir}: the run trains no LoRA adapters (lora.rank=0); "
                              "export its weights with --format hf.")
    if dtype not in DTYPES:
        raise PretrainedError(f"--dtype {dtype}: choose one of {sorted(DTYPES)}.")
    out = require_new_folder(out, workdir)
    origin = read_origin(workdir) or {}
    model_type = model_type_for(config.model, origin.get("backbone"))
    why = peft.vllm_refusal(model_type, lora) if vllm_check else None
    if why:
        raise PretrainedError(f"--format peft: {why}; or pass --skip-vllm-checks for an "
                              "adapter only peft loads.")
    path = Workdir(workdir).latest_checkpoint()
    if path is None:
        raise FileNotFoundError(f"{workdir}: no committed checkpoint; train first.")
    reader = Reader(path)
    prefix = _model_prefix(reader.variables)
    tensors, patterns = peft.adapter_tensors(config.model, model_type, lora)
    for t in tensors:
        for s in t.sources:
            if prefix + s not in reader.variables:
                raise PretrainedError(f"{path}: holds no {prefix + s} for {t.key}; the "
                                      "checkpoint does not match the run's lora settings.")
            # The checkpoint's adapters decide the export: an A (in..., r) or B (r, out...)
            # of another rank (or size) than the config's is refused before writing.
            shape = [int(n) for n in reader.variables[prefix + s]["shape"]]
            rank = shape[-1] if s.endswith("/lora_a") else shape[0]
            if rank != lora.rank or math.prod(shape) != rank * (
                    t.shape[1] if s.endswith("/lora_a") else t.shape[0] // len(t.sources)):
                raise PretrainedError(
                    f"{path}: {prefix + s} is {shape} (rank {rank}), not what lora.rank="
                    f"{lora.rank} and the model's sizes give for {t.key}: a checkpoint's "
                    "adapters are exported as they were trained; drop --set lora.* and "
                    "model.* overrides from tfllm export.")
    np_dtype = np.dtype(tf.as_dtype(dtype).as_numpy_dtype)

    def produce(t: Tensor) -> np.ndarray:
        arrays = [reader.whole(prefix + s).astype(np.float32) for s in t.sources]
        array = t.make(*arrays)
        if tuple(array.shape) != t.shape:  # checked above: a bug if reached
            raise RuntimeError(f"{t.key}: made {array.shape}, expected {t.shape}")
        return array.astype(np_dtype)

    config_json = peft.adapter_config(model_type, lora, patterns, origin.get("preset"))
    with files.written_atomically(out) as tmp:
        with files.open_for_writing(tmp, peft.ADAPTER_CONFIG) as f:
            json.dump(config_json, f, indent=2, sort_keys=True)
        _write_safetensors(tmp, peft.ADAPTER_WEIGHTS, tensors, DTYPES[dtype],
                           np_dtype.itemsize, produce)
    return {"out": out, "step": reader.step, "model_type": model_type, "r": lora.rank,
            "tensors": len(tensors), "bytes": sum(_nbytes(t, np_dtype.itemsize)
                                                  for t in tensors)}
