"""The model families tfllm imports and exports: one module each, and their registry.

A family module (`gpt2`, `llama`, `mistral`, `qwen2`, `qwen3`, `gemma3`, and the
mixtures of experts `qwen3_moe` and `mixtral`) holds everything
tfllm knows of one Hugging Face model_type (`tfllm.families.base.Family`): its
config.json fields in and out, its tensors and their orientation, its LoRA module names,
the keras-hub backbones it maps, its layer kinds. Import, export, PEFT, LoRA and the FLOP
count read them here; adding a family is its module, one line in `FAMILIES`, and its model
code (`tfllm.models`). `tests/families` fails for a family missing a piece.

This floor sits below `tfllm.models` (whose LoRA and layer kinds read it) and imports no
TensorFlow.
"""

from __future__ import annotations

from typing import Dict, Optional

from tfllm.families import gemma3, gpt2, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe
from tfllm.families.base import (DEFAULT_MAX_LENGTH, Backbone, Family, LoraNames, Permuted,
                                 PretrainedError, Sliced, Tensor, check_understood,
                                 is_local_layer, is_moe_layer, keras_hub_path, layer_kinds,
                                 resolved)

#: transformers model_type -> its family, in the order `supported()` names them
FAMILIES: Dict[str, Family] = {f.model_type: f for f in (
    gpt2.FAMILY, llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma3.FAMILY,
    qwen3_moe.FAMILY, mixtral.FAMILY)}

#: keras-hub backbone class name -> its mapping (what `tfllm import` reads)
BACKBONES: Dict[str, Backbone] = {b.name: b for f in FAMILIES.values() for b in f.keras_hub}

_FAMILY_OF_BACKBONE = {b.name: f for f in FAMILIES.values() for b in f.keras_hub}

__all__ = ["BACKBONES", "DEFAULT_MAX_LENGTH", "FAMILIES", "Backbone", "Family", "LoraNames",
           "Permuted", "PretrainedError", "Sliced", "Tensor", "backbone_for",
           "check_understood", "default_backbone", "family_of_backbone", "is_local_layer",
           "is_moe_layer", "keras_hub_path", "layer_kinds", "lora_names", "resolved",
           "supported", "writer"]


def supported() -> str:
    """One line listing the supported keras-hub backbones."""
    return ", ".join(f"{name} ({b.description})" for name, b in BACKBONES.items())


def backbone_for(name: str, source: str) -> Backbone:
    """The mapping of keras-hub backbone class `name`, or a PretrainedError naming
    `source`."""
    if name not in BACKBONES:
        raise PretrainedError(f"{source}: {name} is not an architecture tfllm can hold; "
                              f"supported: {supported()}.")
    return BACKBONES[name]


def family_of_backbone(name: str, source: str) -> Family:
    """The family whose keras-hub backbone class is `name` (`backbone_for`'s errors)."""
    backbone_for(name, source)
    return _FAMILY_OF_BACKBONE[name]


def writer(m, backbone: Optional[str] = None) -> Family:
    """The family that writes model section `m` (`resolved`) as a Hugging Face folder.

    An imported run keeps its architecture (`backbone`: pretrained.json's keras-hub
    class); otherwise GPT-2 for `gpt`, Gemma 3 for `gemma3`, and for `llama` Mistral with
    a window, Qwen3 with query/key norms, Qwen2 with q/k/v biases, else Llama.
    """
    claimed = [f for f in FAMILIES.values() if f.writes(m, backbone)]
    if len(claimed) != 1:  # the families' `writes` exclude each other
        raise PretrainedError(f"model.family={m.family}: "
                              f"{[f.model_type for f in claimed] or 'no family'} of "
                              f"{sorted(FAMILIES)} writes this model section.")
    return claimed[0]


def default_backbone(m) -> str:
    """The keras-hub backbone a tfllm model section exports to when it was not imported."""
    for family in FAMILIES.values():
        name = family.default_backbone(m)
        if name is not None:
            return name
    raise PretrainedError(f"model.family={m.family}: no keras-hub backbone of "
                          f"{sorted(BACKBONES)} holds it.")


def lora_names(model_family: str) -> LoraNames:
    """The LoRA module names of tfllm model family `model_family` (every family it
    computes names them alike: `tests/families` checks)."""
    for family in FAMILIES.values():
        if family.model_family == model_family:
            return family.lora
    raise KeyError(model_family)
