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

import collections
import json
import math
import os
import re
import struct
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from tfllm import files, internals
from tfllm.families import Family, PretrainedError, Tensor, resolved, writer
from tfllm.models import model_class
from tfllm.parallel.blocks import fill_in_order
from tfllm.pretrained import peft

#: --dtype -> safetensors dtype code
DTYPES = {"float32": "F32", "bfloat16": "BF16"}


# ---- the family and its config.json -------------------------------------------------------
def resolved_section(m):
    """Model section `m` with null tie_embeddings / use_bias / qkv_bias resolved as the
    model class does (its family_defaults): what the families write."""
    return resolved(m, model_class(m.family).family_defaults)


def family_for(m, backbone: Optional[str]) -> Family:
    """The family (transformers model_type) a tfllm model section is written as.

    An imported run keeps its architecture (pretrained.json's keras-hub backbone);
    otherwise `tfllm.families.writer` picks it (GPT-2 for `gpt`, Qwen2 for a Llama with
    q/k/v biases, else Llama, ...).
    """
    return writer(resolved_section(m), backbone)


def hf_config(m, family: Family, dtype: str, bos: Optional[int],
              eos: Optional[int]) -> dict:
    """config.json for tfllm's model section `m` as `family` (transformers 5 layout)."""
    r = resolved_section(m)
    common = {"vocab_size": m.vocab_size, "bos_token_id": bos, "eos_token_id": eos,
              "tie_word_embeddings": r.tie_embeddings, "dtype": dtype, "use_cache": True}
    return family.config_out(r, common)


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
    return fill_in_order(tensors, lambda t: _nbytes(t, itemsize), max_bytes)


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
    family = family_for(m, origin.get("backbone"))
    run_dir = Workdir(workdir)
    path = run_dir.latest_checkpoint()
    if path is None:
        raise FileNotFoundError(f"{run_dir.checkpoints} holds no committed "
                                "checkpoint; train or import first.")
    reader = Reader(path)
    prefix = _model_prefix(reader.variables)
    tensors = family.tensors(resolved_section(m))
    for t in tensors:
        for s in t.sources:
            if prefix + s not in reader.variables:
                raise PretrainedError(f"{path}: holds no {prefix + s} for {t.key}; the "
                                      "checkpoint does not match the run's model config.")
    code, np_dtype = DTYPES[dtype], np.dtype(tf.as_dtype(dtype).as_numpy_dtype)

    # A stacked expert kernel feeds the E per-expert tensors written one after another:
    # it is read (and merged) once and kept until its last tensor is written, not E times.
    uses = collections.Counter(s for t in tensors for s in t.sources)
    kept: Dict[str, np.ndarray] = {}

    def source_array(s: str) -> np.ndarray:
        a = kept.get(s)
        if a is None:
            a = reader.whole(prefix + s).astype(np.float32, copy=False)
            if merge_lora:
                a = peft.merged(reader, prefix, s, a, lora, m)
        uses[s] -= 1
        if uses[s] > 0:
            kept[s] = a
        else:
            kept.pop(s, None)
        return a

    def produce(t: Tensor) -> np.ndarray:
        array = t.make(*[source_array(s) for s in t.sources])
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
            json.dump(hf_config(m, family, dtype, bos, eos), f, indent=2,
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
    summary = {"out": out, "step": reader.step, "model_type": family.model_type, "dtype": dtype,
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
    family = family_for(config.model, origin.get("backbone"))
    why = peft.peft_refusal(config.model, family, lora)
    if why:
        raise PretrainedError(f"--format peft: {why}.")
    why = peft.vllm_refusal(family, lora, config.model) if vllm_check else None
    if why:
        raise PretrainedError(f"--format peft: {why}; or pass --skip-vllm-checks for an "
                              "adapter only peft loads.")
    path = Workdir(workdir).latest_checkpoint()
    if path is None:
        raise FileNotFoundError(f"{workdir}: no committed checkpoint; train first.")
    reader = Reader(path)
    prefix = _model_prefix(reader.variables)
    tensors, patterns = peft.adapter_tensors(config.model, family, lora)
    for t in tensors:
        for s in t.sources:
            if prefix + s not in reader.variables:
                raise PretrainedError(f"{path}: holds no {prefix + s} for {t.key}; the "
                                      "checkpoint does not match the run's lora settings.")
            # The checkpoint's adapters decide the export: an A (in..., r) or B (r, out...)
            # of another rank (or size) than the config's is refused before writing.
            shape = [int(n) for n in reader.variables[prefix + s]["shape"]]
            is_a = s.endswith("/lora_a")
            rank = shape[-1] if is_a else shape[0]
            # an expert adapter holds one adapter per expert (peft's E r rows or columns)
            size = (math.prod(t.shape) // len(t.sources) if peft.expert_adapter(config.model, s)
                    else rank * (t.shape[1] if is_a else t.shape[0] // len(t.sources)))
            if rank != lora.rank or math.prod(shape) != size:
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

    config_json = peft.adapter_config(config.model, family, lora, patterns,
                                       origin.get("preset"))
    with files.written_atomically(out) as tmp:
        with files.open_for_writing(tmp, peft.ADAPTER_CONFIG) as f:
            json.dump(config_json, f, indent=2, sort_keys=True)
        _write_safetensors(tmp, peft.ADAPTER_WEIGHTS, tensors, DTYPES[dtype],
                           np_dtype.itemsize, produce)
    return {"out": out, "step": reader.step, "model_type": family.model_type, "r": lora.rank,
            "tensors": len(tensors), "bytes": sum(_nbytes(t, np_dtype.itemsize)
                                                  for t in tensors)}
