"""Model families on the `CausalLM` base, and `build_model` (floor 8).

Model code names logical axes only; the mesh is `tfllm.parallel`'s, precision
`tfllm.precision`'s. Loading pretrained weights is `tfllm.pretrained.from_preset` (a floor
above: it builds models).
"""

from __future__ import annotations

import math
from typing import Optional

from tfllm.config.schema import Config, LoraConfig, ModelConfig, PrecisionConfig
from tfllm.models.causal_lm import Block, CausalLM
from tfllm.models.gemma3 import Gemma3
from tfllm.models.gpt import GPT
from tfllm.models.llama import Llama
from tfllm.models.lora import enable_lora, freeze_base
from tfllm.models.loss import loss_sum_and_count, packed_target_mask, token_nll

FAMILIES = {"gpt": GPT, "llama": Llama, "gemma3": Gemma3}


def model_class(family: str):
    if family not in FAMILIES:
        raise ValueError(f"model.family: unknown family '{family}'; use one of {sorted(FAMILIES)}.")
    return FAMILIES[family]


def check_experts_mesh(m, parallel) -> None:
    """Refuses a mixture of experts on a mesh its dispatch cannot run on (ValueError).

    The grouped dispatch's while loop carries a TensorList, which DTensor's SPMD
    expansion cannot lay out; and expert parallelism exchanges fixed-size buffers (an
    all-to-all of static shape), while the grouped tiles' rows per expert follow the
    routing. A sequence split over a mesh axis (data x fsdp: the rules'
    activation_length) cannot be planned per sequence: DTensor fails to lay out the slot
    buffers' gradient, and gathering the sequence first gave wrong gradients. The experts
    must divide over the axis that splits them (`tfllm.parallel.rules.expert_axis`).
    """
    from tfllm.parallel.rules import expert_axis, sequence_axis
    devices = math.prod(parallel.shape.values())
    if devices > 1 and m.moe_dispatch == "grouped":
        raise ValueError(f"model.moe_dispatch=grouped runs on one device only (DTensor cannot "
                         "lay out its loop, and expert parallelism's all-to-all needs the "
                         "static capacity buffers); on the mesh "
                         f"{dict(parallel.shape)} use model.moe_dispatch=slots.")
    expert_axis(m.num_experts, parallel.rules, parallel.shape)
    axis = sequence_axis(devices, devices, parallel.rules, parallel.shape)
    if axis is not None:
        raise ValueError(f"mesh.axes {dict(parallel.shape)} splits each sequence over "
                         f"'{axis}', which a mixture of experts' dispatch cannot plan; use "
                         "data or fsdp alone for the batch (e.g. mesh.axes=fsdp=8 or "
                         "data=2,model=4).")


def build_model(model: ModelConfig, precision: Optional[PrecisionConfig] = None,
                lora: Optional[LoraConfig] = None, *, parallel=None, seed: int = 0,
                model_cls=None, allocate: bool = True, zeros: bool = False,
                frozen: bool = False) -> CausalLM:
    """Builds the model the config's sections describe, its variables created in their
    layouts.

    It takes the sections it reads, not the whole `Config`: with a config,
    `build_model(config.model, config.precision, config.lora, parallel=parallel,
    seed=config.train.seed)`.

    Args:
      model: the model section (`tfllm.config.ModelConfig`).
      precision: the precision section (`PrecisionConfig`); None: its defaults (float32).
      lora: the adapters (`LoraConfig`); None: no adapters (every weight trains).
      parallel: a `tfllm.parallel.Parallel`, or None for single-device variables.
      seed: the init seed (a config's train.seed).
      model_cls: a `CausalLM` subclass to use instead of the model section's family.
      allocate: False builds shapes only (no memory), for `tfllm layouts`.
      zeros: allocate zero-filled variables (weights that will be loaded).
      frozen: every weight non-trainable (DPO's reference copy: no gradient is taken).

    Raises:
      TypeError: a section is not one (a whole `Config`, or the old positional
        `parallel`), in one line naming the fix.
    """
    _check_sections(model, precision, lora)
    precision = PrecisionConfig() if precision is None else precision
    lora = LoraConfig() if lora is None else lora
    from tfllm.internals import forget_deferred
    from tfllm.parallel.placement import build_abstract, place_variables
    from tfllm.precision import fp8_settings, keras_policy
    from tfllm.precision.policies import apply_matmul_precision
    apply_matmul_precision(precision)  # before anything is traced
    cls = model_cls or model_class(model.family)
    built = cls(model, dtype=keras_policy(precision.policy), fp8=fp8_settings(precision))
    enable_lora(built, lora)  # before the weights exist: kernels freeze, A and B join
    build_abstract(built)
    freeze_base(built)
    if frozen:  # before the weights exist, as freeze_base
        for v in built.variables:
            v.trainable = False
    if parallel is not None and model.num_experts:
        check_experts_mesh(model, parallel)
    if parallel is not None:  # fail before allocating anything if a variable cannot be laid out
        try:
            for var in built.variables:
                parallel.variable_spec(var)
        except Exception:
            forget_deferred(built.variables)  # see place_variables
            raise
    if allocate:
        place_variables(built, parallel, seed, zeros)
    else:
        # Shapes only: Keras must not initialize these later. Left in its list of
        # variables awaiting deferred initialization, they were all allocated by the next
        # Keras model built in the process (after planning llama-7b, ~28 GB for a tiny
        # keras-hub Gemma: an out-of-memory kill in the test suite).
        forget_deferred(built.variables)
    return built


def _check_sections(model, precision, lora) -> None:
    """One line naming the fix when `build_model` is handed something other than its
    sections (a whole Config reads `config.model` deep inside otherwise)."""
    if isinstance(model, Config):
        raise TypeError("build_model takes the config's sections, not a whole Config: pass "
                        "config.model, config.precision, config.lora (and "
                        "seed=config.train.seed, parallel=... by keyword).")
    for name, value, kind in (("model", model, ModelConfig),
                              ("precision", precision, PrecisionConfig),
                              ("lora", lora, LoraConfig)):
        if value is None and name != "model" or isinstance(value, kind):
            continue
        raise TypeError(f"build_model: {name} must be a {kind.__name__} (config.{name})"
                        f"{'' if name == 'model' else ' or None'}, not "
                        f"{type(value).__name__}; parallel, seed and the options are "
                        "keyword-only (parallel=...).")

