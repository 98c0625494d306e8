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

Mixtures of experts: the stacked expert kernels (gate, up (E, D, F), down (E, F, D)) are
adapted as peft adapts transformers' fused expert parameters through `target_parameters`
(named `experts.gate_up_proj` and `experts.down_proj` in lora.targets): per expert e its
own A_e and B_e, A (E, in, r) and B (r, E, out) (the experts' axis where the kernel has
it), and one A for gate and up (peft's single A (r, D) per expert of gate_up_proj), so
that expert e computes x (W_e + s A_e B_e) exactly as peft's merged parameter.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

from tfllm import internals
from tfllm.config.loader import ConfigError
from tfllm.families import is_moe_layer, lora_names


class LoraError(ConfigError):
    """A LoRA setting that cannot be applied (the message names the key and the fix)."""


@dataclass(frozen=True)
class LoraSpec:
    """What one projection needs: the rank, the scale s and the dropout rate on x.

    `shares_a`: the projection has no A of its own; it takes the hidden x A of the first
    projection of its expert parameter (an up projection takes its gate's, as peft's one
    A of transformers' fused gate_up_proj), which its layer hands it (`MoeMLP`)."""

    rank: int
    scale: float
    dropout: float = 0.0
    shares_a: bool = False


@dataclass(frozen=True)
class Target:
    """One adapted Hugging Face module or expert parameter of a layer.

    Attributes:
      name: its name inside the layer ("self_attn.q_proj", "mlp.experts.gate_up_proj").
      paths: the tfllm projections inside the block it is.
      experts: a stacked expert parameter (peft's target_parameters: per expert one A
        shared by `paths`, the first path's, and a B each), else a module (an A and a B
        per path).
    """

    name: str
    paths: Tuple[str, ...]
    experts: bool = False


def scale(lora_config) -> float:
    """s = alpha / rank, or alpha / sqrt(rank) with rslora."""
    r = lora_config.rank
    return lora_config.alpha / (math.sqrt(r) if lora_config.rslora else r)


def matches(module: str, target: str) -> bool:
    """peft's rule: `target` names `module` (a dotted path) or its end after a dot."""
    return module == target or module.endswith("." + target)


def names_expert(parameter: str, target: str) -> bool:
    """Whether lora.targets entry `target` names expert parameter `parameter`: peft's rule
    with the `experts.` part named ("experts.down_proj"), so that "down_proj" stays the
    dense MLP's module, as it is for peft's target_modules."""
    return matches(parameter, target) and "experts" in target.split(".")


def _chosen(family: str, targets: List[str]) -> List[Target]:
    names = lora_names(family)
    table = [Target(m, p) for m, p in names.modules.items()] + [
        Target(m, p, experts=True) for m, p in names.experts.items()]
    if not targets:
        return table
    chosen = set()
    for t in targets:
        hit = [x.name for x in table
               if (names_expert if x.experts else matches)(x.name, t)]
        if not hit:
            raise LoraError(f"lora.targets: '{t}' names no projection of the {family} "
                            f"family; use some of {sorted(x.name for x in table)} (or their "
                            "last part; the experts' as experts.<name>).")
        chosen.update(hit)
    return [x for x in table if x.name in chosen]  # the table's order


def _present(x: Target, expert_paths, sparse: bool) -> bool:
    """Expert parameters exist on sparse layers only, the dense MLP's modules (the paths
    they share) on dense layers only."""
    if x.experts:
        return sparse
    return not (sparse and set(x.paths) & expert_paths)


def targeted(m, lora_config) -> List[List[Target]]:
    """The adapted modules and expert parameters of each layer of model section `m` that
    lora.targets selects (empty: every projection each layer has).

    Raises:
      LoraError: a target that names no projection of the family, or none that any layer
        of this model has; LoRA on the experts with lora.dropout (peft's
        target_parameters adapters take no dropout, so the adapter could not be
        exported).
    """
    targets = list(lora_config.targets)
    chosen = _chosen(m.family, targets)
    expert_paths = {p for ps in lora_names(m.family).experts.values() for p in ps}
    layers = [[x for x in chosen if _present(x, expert_paths, is_moe_layer(m, i))]
              for i in range(m.num_layers)]
    used = {x.name for layer in layers for x in layer}
    if targets:
        for x in chosen:
            if x.name in used:
                continue
            if x.experts:
                raise LoraError(f"lora.targets: {x.name} is an expert parameter, and this "
                                f"model has no mixture-of-experts layer (model.num_experts="
                                f"{getattr(m, 'num_experts', 0)}); leave it out.")
            raise LoraError(f"lora.targets: {x.name} is the dense MLP's, and every layer of "
                            "this model has experts in its place; adapt them with "
                            "experts.gate_up_proj and experts.down_proj (peft's "
                            "target_parameters).")
    experts = [x.name for x in chosen if x.experts and x.name in used]
    if experts and lora_config.dropout:
        raise LoraError(f"lora.dropout={lora_config.dropout:g} with LoRA on the experts "
                        f"({', '.join(experts)}): peft's target_parameters adapters take no "
                        "dropout (its ParamWrapper refuses lora_dropout), so the adapter could "
                        "not be exported; set lora.dropout=0, or leave the experts out of "
                        "lora.targets (e.g. [q_proj,k_proj,v_proj,o_proj]).")
    return layers


def enable_lora(model, lora_config) -> List[str]:
    """Marks the targeted projections of every block of `model` (not built yet) to build
    LoRA weights and freeze their kernels. Returns the marked layers' paths."""
    if lora_config.rank <= 0:
        return []
    spec = LoraSpec(int(lora_config.rank), float(scale(lora_config)),
                    float(lora_config.dropout))
    marked = []
    for i, (block, layer_targets) in enumerate(zip(model.blocks,
                                                   targeted(model.config, lora_config))):
        for x in layer_targets:
            for k, path in enumerate(x.paths):
                layer = block
                for part in path.split("/"):
                    layer = getattr(layer, {"output": "output_proj"}.get(part, part))
                layer.lora = dataclasses.replace(spec, shares_a=x.experts and k > 0)
                marked.append(f"block_{i}/{path}")
    return marked


def a_source(m, variable: str) -> str:
    """The tfllm variable path ("block_2/mlp/gate/lora_a") of the A that the adapter of
    projection `variable` ("block_2/mlp/up/lora_b") uses in model section `m`: its own,
    or on a sparse layer the first path's of its expert parameter (up -> gate)."""
    block, path = variable.split("/", 1)
    path = path.rsplit("/", 1)[0]
    if expert_adapter(m, variable):
        path = next(ps[0] for ps in lora_names(m.family).experts.values() if path in ps)
    return f"{block}/{path}/lora_a"


def expert_adapter(m, variable: str) -> bool:
    """Whether a tfllm variable path ("block_2/mlp/up/lora_b") is an expert adapter of
    model section `m`: an expert parameter's path on a sparse layer."""
    block, path = variable.split("/", 1)
    index = int(block.split("_")[1])
    paths = {p for ps in lora_names(m.family).experts.values() for p in ps}
    return is_moe_layer(m, index) and path.rsplit("/", 1)[0] in paths


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
