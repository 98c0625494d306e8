"""What the mixture-of-experts families share (Qwen3-MoE, Mixtral).

Their layers are Llama-shaped (`llama_layout`) with an experts group in place of the MLP
on sparse layers (`tfllm.families.base.is_moe_layer`). tfllm holds each projection of
a layer's experts as one stacked kernel (`tfllm.models.common.moe.MoeMLP`: gate and up
(E, D, F), down (E, F, D)) and the router as (D, E).

Hugging Face folders hold the experts in one of two layouts, both read:

* per expert, what transformers 5's `save_pretrained` still writes (and every published
  checkpoint holds): `{mlp}.experts.{j}.{gate,up,down}` nn.Linear weights (Qwen3-MoE:
  `mlp.experts.{j}.gate_proj.weight`; Mixtral: `block_sparse_moe.experts.{j}.w1.weight`
  (gate), `w3` (up), `w2` (down)) and the router `{mlp}.gate.weight` (E, D);
* fused, transformers 5's parameters as they are in memory: `mlp.experts.gate_up_proj`
  (E, 2F, D: the gate's F rows, then the up's) and `mlp.experts.down_proj` (E, D, F),
  router `mlp.gate.weight`.

tfllm writes the per-expert layout, which transformers loads (converting it to its fused
parameters) as every other library does.

These families do not go through keras-hub's converters: keras-hub 0.32's Qwen3-MoE
converter reads `num_experts` where transformers 5 writes `num_local_experts`, and both
converters assign the stacked experts outside their recorded weight map, so tfllm reads
the folder itself (`Family.tensors_in`), its tensors by the same `Tensor` lists it
writes (`tfllm.pretrained.direct`).

keras-hub presets (`Qwen3MoeBackbone`, `MixtralBackbone`, written by `save_to_preset`)
are read and written through keras-hub's own backbone (`keras_hub_weight_map`): its
router is `{block}/sparse_feedforward_gate_dense/kernel` (D, E) as tfllm's, its experts
`{block}/experts/expert_feedforward_{gate,intermediate,output}_dense` (E, D, F), (E, D,
F), (E, F, D) as tfllm's gate, up and down (Qwen3-MoE's gate and up are one (E, D, 2F)
kernel, the gate's F columns first: two `Sliced` halves). keras-hub creates the block
without a name, so Keras numbers it per process (`Backbone.unnamed`). Its experts run
on every token, weighted by the routing (zero off the top k): dropless, as transformers.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import numpy as np

from tfllm.families import llama_layout as layout
from tfllm.families.base import PretrainedError, Sliced, Tensor, is_moe_layer, linear

#: How a family names a sparse layer's tensors: the module holding router and experts,
#: and the per-expert names of gate, up and down.
Names = Dict[str, str]

QWEN3_MOE_NAMES: Names = {"block": "mlp", "gate": "gate_proj", "up": "up_proj",
                          "down": "down_proj"}
MIXTRAL_NAMES: Names = {"block": "block_sparse_moe", "gate": "w1", "up": "w3", "down": "w2"}


def _expert_width(m) -> int:
    return m.moe_intermediate_dim or m.intermediate_dim


def experts(names: Names) -> Callable:
    """A layer group: the router and each expert's projections of a sparse layer (the
    per-expert layout), or the dense MLP of a layer that is not sparse."""
    def group(m, ours: str, theirs: str) -> List[Tensor]:
        index = int(ours.split("_")[1].rstrip("/"))
        if not is_moe_layer(m, index):
            return layout.mlp(m, ours, theirs)
        d, f, e = m.hidden_dim, _expert_width(m), m.num_experts
        block = f"{theirs}{names['block']}."
        out = [Tensor(block + "gate.weight", (ours + "mlp/router/kernel",), (e, d), linear)]
        for j in range(e):
            for part, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
                out.append(Tensor(f"{block}experts.{j}.{names[part]}.weight",
                                  (f"{ours}mlp/{part}/kernel",), shape,
                                  lambda x, j=j: x[j].T))
        return out
    return group


def fused_experts(m, ours: str, theirs: str) -> List[Tensor]:
    """transformers 5's fused parameters of a sparse layer (router under `mlp.gate`)."""
    index = int(ours.split("_")[1].rstrip("/"))
    if not is_moe_layer(m, index):
        return layout.mlp(m, ours, theirs)
    d, f, e = m.hidden_dim, _expert_width(m), m.num_experts
    return [Tensor(theirs + "mlp.gate.weight", (ours + "mlp/router/kernel",), (e, d), linear),
            # gate, up (E, D, F) each -> (E, 2F, D): the gate's rows first
            Tensor(theirs + "mlp.experts.gate_up_proj",
                   (ours + "mlp/gate/kernel", ours + "mlp/up/kernel"), (e, 2 * f, d),
                   lambda g, u: np.concatenate([g.transpose(0, 2, 1), u.transpose(0, 2, 1)],
                                               axis=1)),
            Tensor(theirs + "mlp.experts.down_proj", (ours + "mlp/down/kernel",), (e, d, f),
                   lambda x: x.transpose(0, 2, 1))]


def groups(mlp_group: Callable, qk_norm: bool) -> tuple:
    """`llama_layout.LAYER_GROUPS` with `mlp_group` for the MLP."""
    out = (layout.layer_norms, layout.attention, mlp_group)
    return out + ((layout.query_key_norms,) if qk_norm else ())


def tensors_of(names: Names, qk_norm: bool):
    """A `Family.tensors`: every tensor of the folder, experts per expert."""
    return lambda m: layout.tensors(m, groups(experts(names), qk_norm))


def tensors_in(names: Names, qk_norm: bool):
    """A `Family.tensors_in`: the layout (per expert, or fused) a folder's keys use."""
    def read(m, keys) -> List[Tensor]:
        fused = any(k.endswith(".mlp.experts.gate_up_proj") for k in keys)
        return layout.tensors(m, groups(fused_experts if fused else experts(names),
                                        qk_norm))
    return read


def config_out(m, model_type: str, architecture: str, common: dict) -> dict:
    """The config.json keys every MoE model_type here has (Llama-shaped ones included)."""
    return {**layout.config_out(m, model_type, architecture, common),
            "num_experts_per_tok": m.num_experts_per_tok,
            "router_aux_loss_coef": float(m.router_aux_loss_coef),
            "output_router_logits": False}


def writes(model_type: str, chosen: Callable[[object], bool]):
    """A `Family.writes` for a llama-family section with experts that `chosen` picks."""
    def writes_(m, backbone):
        if m.family != layout.MODEL_FAMILY or not m.num_experts:
            return False
        layout.check_writable(m)
        if not chosen(m):
            return False
        if m.moe_capacity_factor:
            raise PretrainedError(f"model.moe_capacity_factor={m.moe_capacity_factor}: "
                                  f"transformers' {model_type} is dropless; export with "
                                  "--set model.moe_capacity_factor=0.")
        return True
    return writes_


def refuse(where: str, key: str, value, computes: str):
    """Raises the PretrainedError of a config.json setting tfllm does not compute."""
    raise PretrainedError(f"{where}: {key}={value!r} is not implemented (tfllm computes "
                          f"{computes}); importing it would compute other logits.")


def cannot(model_type: str, what: str):
    """Raises the PretrainedError of a model section `model_type` cannot express."""
    raise PretrainedError(f"transformers' {model_type} cannot express {what}; this mixture "
                          "of experts has no transformers counterpart.")


def common_in(c: dict, where: str) -> dict:
    """The Llama-shaped part of tfllm's model section from a MoE config.json."""
    rope = c.get("rope_parameters") or {"rope_type": "default",
                                        "rope_theta": c.get("rope_theta", 10000.0)}
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default" \
            or c.get("rope_scaling"):
        raise PretrainedError(f"{where}: rope_parameters={rope!r}, rope_scaling="
                              f"{c.get('rope_scaling')!r}: tfllm imports mixtures of experts "
                              "with unscaled RoPE (rope_type default).")
    for key, ok, what in (("hidden_act", lambda v: v in (None, "silu"), "a SiLU-gated MLP"),
                          ("attention_bias", lambda v: not v, "no attention biases"),
                          ("use_sliding_window", lambda v: not v, "full attention")):
        if not ok(c.get(key)):
            refuse(where, key, c.get(key), what)
    heads = int(c["num_attention_heads"])
    return {"family": layout.MODEL_FAMILY, "vocab_size": int(c["vocab_size"]),
            "hidden_dim": int(c["hidden_size"]), "num_layers": int(c["num_hidden_layers"]),
            "num_query_heads": heads,
            "num_key_value_heads": int(c.get("num_key_value_heads") or heads),
            "head_dim": int(c.get("head_dim") or 0),
            "intermediate_dim": int(c["intermediate_size"]),
            "norm_epsilon": float(c.get("rms_norm_eps", 1e-6)),
            "rope_theta": float(rope.get("rope_theta", 10000.0)),
            "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
            "use_bias": False, "qkv_bias": None,
            "max_sequence_length": int(c.get("max_position_embeddings", 4096)),
            "num_experts_per_tok": int(c["num_experts_per_tok"]),
            "router_aux_loss_coef": float(c.get("router_aux_loss_coef", 0.001))}


# ---- keras-hub --------------------------------------------------------------------------
def keras_hub_weight_map(m, sparse_block: str, dense_block: str = "",
                         fused_gate_up: bool = False) -> Dict[str, object]:
    """{tfllm path: keras-hub path, or a `Sliced` half} of a Llama-shaped MoE backbone:
    `layout.keras_hub_weight_map` with each sparse layer's MLP replaced by the router
    and experts under `sparse_block`, and a dense layer's MLP under `dense_block`."""
    out = layout.keras_hub_weight_map(m)
    f = _expert_width(m)
    for i in range(m.num_layers):
        ours, theirs = f"block_{i}/mlp/", f"transformer_layer_{i}/"
        dense = {p: out.pop(ours + p) for p in ("gate/kernel", "up/kernel", "down/kernel")}
        if not is_moe_layer(m, i):  # the dense MLP's names, inside `dense_block`
            inside = f"{theirs}{dense_block}/" if dense_block else theirs
            out.update({ours + p: inside + path[len(theirs):] for p, path in dense.items()})
            continue
        block = f"{theirs}{sparse_block}/"
        experts_ = block + "experts/expert_feedforward_"
        out[ours + "router/kernel"] = block + "sparse_feedforward_gate_dense/kernel"
        if fused_gate_up:  # (E, D, 2F): gate's columns, then up's
            out[ours + "gate/kernel"] = Sliced(experts_ + "gate_dense", 2, 0, f)
            out[ours + "up/kernel"] = Sliced(experts_ + "gate_dense", 2, f, 2 * f)
        else:
            out[ours + "gate/kernel"] = experts_ + "gate_dense"
            out[ours + "up/kernel"] = experts_ + "intermediate_dense"
        out[ours + "down/kernel"] = experts_ + "output_dense"
    return out


def keras_hub_fields(kh: dict, fields: dict, **moe) -> dict:
    """tfllm's model section of a keras-hub MoE backbone: the Llama-shaped `fields`
    (`layout.model_fields`) and the experts' settings `moe`, with the keras-hub names
    both backbones share (num_experts, top_k)."""
    return {**fields, "num_experts": int(kh["num_experts"]),
            "num_experts_per_tok": int(kh["top_k"]), **moe}


def keras_hub_refuse(backbone: str, problems) -> None:
    """Raises the PretrainedError of the first of `problems` ((bad, what) pairs) that
    holds: what keras-hub's `backbone` cannot express."""
    for bad, what in problems:
        if bad:
            raise PretrainedError(f"keras-hub's {backbone} cannot express {what}.")


def capacity_problem(m):
    """keras-hub's experts run on every token (dropless): a capacity factor drops."""
    return (bool(m.moe_capacity_factor), f"model.moe_capacity_factor="
            f"{m.moe_capacity_factor} (its experts are dropless: --set "
            "model.moe_capacity_factor=0)")


#: LoRA names: the attention's projections, the dense layers' MLP (peft's target_modules)
#: and the sparse layers' fused expert parameters (peft's target_parameters)
LORA = layout.LORA
