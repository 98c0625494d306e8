"""Model families on the `CausalLM` base, and `build_model` (floor 5).

Model code names logical axes only; the mesh is `tfllm.parallel`'s, precision
`tfllm.precision`'s. Loading pretrained weights is `tfllm.pretrained.from_preset` (a floor
above: it builds models).
"""

from __future__ import annotations

from typing import Optional

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


def build_model(config, parallel=None, seed: Optional[int] = None, model_cls=None,
                allocate: bool = True, zeros: bool = False, frozen: bool = False) -> CausalLM:
    """Builds the model a config describes, its variables created in their layouts.

    Args:
      config: a full `tfllm.config.Config`.
      parallel: a `tfllm.parallel.Parallel`, or None for single-device variables.
      seed: the init seed (default: config.train.seed).
      model_cls: a `CausalLM` subclass to use instead of the config's family.
      allocate: False builds shapes only (no memory), for `tfllm layouts`.
      zeros: allocate zero-filled variables (weights that will be loaded).
      frozen: every weight non-trainable (DPO's reference copy: no gradient is taken).
    """
    from tfllm.internals import forget_deferred
    from tfllm.parallel.placement import build_abstract, place_variables
    from tfllm.precision import fp8_settings, keras_policy
    from tfllm.precision.policies import apply_matmul_precision
    apply_matmul_precision(config.precision)  # before anything is traced
    cls = model_cls or model_class(config.model.family)
    model = cls(config.model, dtype=keras_policy(config.precision.policy),
                fp8=fp8_settings(config.precision))
    enable_lora(model, config.lora)  # before the weights exist: kernels freeze, A and B join
    build_abstract(model)
    freeze_base(model)
    if frozen:  # before the weights exist, as freeze_base
        for v in model.variables:
            v.trainable = False
    if parallel is not None:  # fail before allocating anything if a variable cannot be laid out
        try:
            for var in model.variables:
                parallel.variable_spec(var)
        except Exception:
            forget_deferred(model.variables)  # see place_variables
            raise
    if allocate:
        place_variables(model, parallel, config.train.seed if seed is None else seed, zeros)
    else:
        # Shapes only: Keras must not initialize these later. Left in its list of
        # variables awaiting deferred initialization, they were all allocated by the next
        # Keras model built in the process (after planning llama-7b, ~28 GB for a tiny
        # keras-hub Gemma: an out-of-memory kill in the test suite).
        forget_deferred(model.variables)
    return model

