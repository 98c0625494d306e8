"""A tfllm run out as a keras-hub preset (`tfllm export --format keras-hub`).

The latest checkpoint is restored onto one device, copied into the keras-hub backbone
the run was imported from (pretrained.json), or the family's default (GPT2Backbone,
Llama3Backbone, QwenBackbone with q/k/v biases; Qwen3MoeBackbone or MixtralBackbone for
a mixture of experts, also one imported from a Hugging Face folder), and written with
keras-hub's own `save_to_preset`: config, float32 weights, and, when the run has a
keras-hub tokenizer, the tokenizer and preprocessor, so that
`keras_hub.models.CausalLM.from_preset(DIR)` loads it and generates.
"""

from __future__ import annotations

import os

import numpy as np

from tfllm import files
from tfllm.confined import tree_within
from tfllm.families import (BACKBONES, Permuted, PretrainedError, Sliced, backbone_for,
                            default_backbone, keras_hub_path)
from tfllm.pretrained.importer import read_origin


def require_new_folder(out: str, workdir: str = None) -> str:
    """`tfllm.files.require_new_folder` with the pretrained formats' error."""
    return files.require_new_folder(out, PretrainedError, keep=(workdir,) if workdir else ())


def run_tokenizer_folder(config, workdir: str):
    """The run's keras-hub tokenizer folder (data.tokenizer_path), or None when the run
    has none. One inside the run (an import's WORKDIR/tokenizer) must hold only the run's
    own files: a link planted there out of the run is refused (`PretrainedError`), never
    read into the export; one elsewhere is the folder the user named."""
    d = config.data
    path = os.path.expanduser(d.tokenizer_path or "")
    if d.tokenizer != "file" or not os.path.isdir(path):
        return None
    top = os.path.abspath(workdir)
    if os.path.commonpath([top, os.path.abspath(path)]) == top:
        tree_within(path, workdir, "an export reads", PretrainedError)
    return path


def _run_tokenizer(config, workdir: str):
    """The run's tokenizer as a keras-hub tokenizer, or None when it is not one."""
    from tfllm.data.tokenizer import load_keras_hub_tokenizer
    path = run_tokenizer_folder(config, workdir)
    return None if path is None else load_keras_hub_tokenizer(path)


def export_preset(config, workdir: str, out_dir: str) -> dict:
    """Writes the run in `workdir` (latest checkpoint) as a keras-hub preset `out_dir`.

    Args:
      config: the run's config (its config.yaml).
      workdir: the run directory.
      out_dir: the preset directory; written under a temporary name, renamed last.

    Returns:
      A summary: out, step, backbone, tokenizer (true when written).
    """
    import keras_hub
    from tfllm.checkpoint.workdir import Workdir
    from tfllm.models import build_model

    if config.lora.rank:
        raise PretrainedError(f"{workdir} trains LoRA adapters (lora.rank="
                              f"{config.lora.rank}); a keras-hub preset holds plain weights: "
                              "export with --format hf --merge-lora, or the adapter alone "
                              "with --format peft.")
    out_dir = require_new_folder(out_dir, workdir)
    origin = read_origin(workdir) or {}
    name = origin.get("backbone")
    if name not in BACKBONES:  # not imported, or from a folder tfllm reads itself
        name, origin = default_backbone(config.model), {}
    family = backbone_for(name, Workdir(workdir).pretrained_file)
    if family.model_family != config.model.family:
        raise PretrainedError(f"{workdir}: a {config.model.family} model cannot be written "
                              f"as {name}.")
    kwargs = family.backbone_kwargs(config.model, origin.get("backbone_config", {}))
    untie = False
    if kwargs.get("tie_word_embeddings") and name in ("LlamaBackbone", "Llama3Backbone"):
        # keras-hub (0.32) drops tie_word_embeddings from these configs, so a tied preset
        # would load untied and fail; write the output embedding out explicitly instead.
        kwargs["tie_word_embeddings"], untie = False, True
    # one device: the preset is written whole
    model = build_model(config.model, config.precision, config.lora, seed=config.train.seed)
    meta = Workdir(workdir).restore_weights(model, config=config.checkpoint)
    backbone = getattr(keras_hub.models, name)(**kwargs, dtype="float32")
    theirs = {family.variable_name(v.path): v for v in backbone.variables
              if "seed_generator" not in v.path}
    mapping = family.weight_map(config.model)
    prefix = model.name + "/"
    values, filled = {}, {}  # keras-hub name -> its value; elements written (`Sliced`)
    for var in model.variables:
        if getattr(var, "kind", None) == "fp8_state":
            continue
        path = var.path[len(prefix):] if var.path.startswith(prefix) else var.path
        value = np.asarray(var.numpy(), np.float32)
        where = mapping.get(path, "")
        if isinstance(where, Permuted):
            value = where.to_theirs(value)
        target = theirs.get(keras_hub_path(where))
        shape = tuple(target.shape) if target is not None else None
        if isinstance(where, Sliced) and target is not None:
            part = where.index(len(shape))
            buffer = values.setdefault(target.path, np.zeros(shape, np.float32))
            count = filled.setdefault(target.path, np.zeros(shape, np.int8))
            if buffer[part].shape == value.shape:
                buffer[part], count[part] = value, count[part] + 1
                continue
        if target is None or shape != value.shape:
            raise PretrainedError(f"{name} has no variable shaped {list(value.shape)} for "
                                  f"tfllm's {path}; this model cannot be written as {name}.")
        values[target.path] = value
    for key, count in filled.items():  # the halves of one tensor fill it exactly once
        if not (count == 1).all():
            raise PretrainedError(f"{name}'s {key} is not filled exactly once by tfllm's "
                                  f"weights; this model cannot be written as {name}.")
    if untie:
        embedding = values["token_embedding/embeddings"]
        values["token_embedding/reverse_embeddings"] = np.transpose(embedding)
    by_path = {v.path: v for v in theirs.values()}
    missing = sorted(family.variable_name(p) for p in set(by_path) - set(values))
    if missing:
        raise PretrainedError(f"{name}'s weights {missing[:5]} have no tfllm counterpart.")
    for key, value in values.items():
        by_path[key].assign(value)

    tokenizer = _run_tokenizer(config, workdir)
    with files.written_atomically(out_dir) as tmp:  # keras-hub writes into that new folder
        if tokenizer is not None:
            task_cls = getattr(keras_hub.models, name.replace("Backbone", "CausalLM"))
            pre_cls = getattr(keras_hub.models,
                              name.replace("Backbone", "CausalLMPreprocessor"))
            task_cls(backbone=backbone,
                     preprocessor=pre_cls(tokenizer=tokenizer)).save_to_preset(tmp)
        else:
            backbone.save_to_preset(tmp)
    return {"out": out_dir, "step": int(meta["step"]), "backbone": name,
            "tokenizer": tokenizer is not None}
