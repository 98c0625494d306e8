"""Low-rank adapters (LoRA) on a model's projections, named as Hugging Face names them.

`enable_lora(model, lora_config)` marks the projections that `lora.targets` names (peft's
`target_modules`: a name matches a module path or its end after a dot) before the model
is built; each then freezes its kernel W and adds two float32 weights, A (the kernel's
input dimensions x rank) and B (rank x the kernel's output dimensions), computing

    y = x W + s (dropout(x) A) B,    s = alpha / rank   (alpha / sqrt(rank) with rslora)

without ever forming W + s A B (dropout only in training: `tfllm.models.common.noise`). A takes the kernel's input-dimension layout and B its
output-dimension layout (the rank is never split), so adapters shard as their kernels
do on data, FSDP and tensor-parallel meshes. A starts random (the variance of peft's
Kaiming-uniform default), B at zero, so a fresh adapter leaves the model unchanged.

Each family names its Hugging Face modules (inside one layer) and the tfllm projections
they are (`tfllm.families.LoraNames`); `tfllm.pretrained.peft` writes and reads adapters
with the same names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

from tfllm import internals
from tfllm.config.loader import ConfigError
from tfllm.families import lora_names


class LoraError(ConfigError):
    """A LoRA setting that cannot be applied (the message names the key and the fix)."""


@dataclass(frozen=True)
class LoraSpec:
    """What one projection needs: the rank, the scale s and the dropout rate on x."""

    rank: int
    scale: float
    dropout: float = 0.0


def scale(lora_config) -> float:
    """s = alpha / rank, or alpha / sqrt(rank) with rslora."""
    r = lora_config.rank
    return lora_config.alpha / (math.sqrt(r) if lora_config.rslora else r)


def matches(module: str, target: str) -> bool:
    """peft's rule: `target` names `module` (a dotted path) or its end after a dot."""
    return module == target or module.endswith("." + target)


def targeted(family: str, targets: List[str]) -> Dict[str, Tuple[str, ...]]:
    """{Hugging Face module name in a layer: tfllm projection paths} that `targets`
    (lora.targets; empty: every projection of the family) selects.

    Raises:
      LoraError: a target that names no projection of the family.
    """
    table = lora_names(family).modules
    if not targets:
        return dict(table)
    chosen = {}
    for t in targets:
        hit = [m for m in table if matches(m, t)]
        if not hit:
            raise LoraError(f"lora.targets: '{t}' names no projection of the {family} "
                            f"family; use some of {sorted(table)} (or their last part).")
        chosen.update({m: table[m] for m in hit})
    return {m: table[m] for m in table if m in chosen}  # the table's order


def projection_paths(family: str, targets: List[str]) -> List[str]:
    """tfllm projection paths inside a block that get adapters."""
    return [p for paths in targeted(family, targets).values() for p in paths]


def enable_lora(model, lora_config) -> List[str]:
    """Marks the targeted projections of every block of `model` (not built yet) to build
    LoRA weights and freeze their kernels. Returns the marked layers' paths."""
    if lora_config.rank <= 0:
        return []
    family = model.config.family
    spec = LoraSpec(int(lora_config.rank), float(scale(lora_config)),
                    float(lora_config.dropout))
    marked = []
    for i, block in enumerate(model.blocks):
        for path in projection_paths(family, list(lora_config.targets)):
            layer = block
            for part in path.split("/"):
                layer = getattr(layer, {"output": "output_proj"}.get(part, part))
            layer.lora = spec
            marked.append(f"block_{i}/{path}")
    return marked


def freeze_base(model) -> None:
    """With adapters, only A and B train (peft's default, bias "none"): every other
    weight of the built (abstract) model is frozen before it is placed."""
    if not any(getattr(l, "lora", None) for l in internals.all_layers(model)):
        return
    for v in model.variables:
        name = v.path.rsplit("/", 1)[-1]
        if v.trainable and name not in ("lora_a", "lora_b"):
            v.trainable = False


def trainable_summary(model) -> Dict[str, int]:
    """Parameter counts: trainable (A and B), frozen, and all."""
    def count(vs):
        return sum(math.prod(v.shape) for v in vs)
    trainable = count(model.trainable_variables)
    frozen = count(v for v in model.non_trainable_variables
                   if getattr(v, "kind", None) != "fp8_state")
    return {"trainable": trainable, "frozen": frozen, "total": trainable + frozen}


def summary_line(model, lora_config) -> str:
    """The run's start-up line: what trains, and the memory the frozen weights save (no
    gradient and no AdamW moments for them: 12 bytes per weight in float32)."""
    counts = trainable_summary(model)
    marked = sum(1 for l in internals.all_layers(model) if getattr(l, "lora", None))
    saved = 12 * counts["frozen"]
    return (f"tfllm: LoRA rank {lora_config.rank} (alpha {lora_config.alpha:g}, scale "
            f"{scale(lora_config):g}{', rsLoRA' if lora_config.rslora else ''}) on {marked} "
            f"projections: {counts['trainable']:,} trainable of {counts['total']:,} "
            f"parameters ({100 * counts['trainable'] / counts['total']:.2f}%); "
            f"{saved / 2 ** 20:,.1f} MiB of float32 gradients and AdamW moments not kept "
            "for the frozen weights (whole model; each device saves its share)")
