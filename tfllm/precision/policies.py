"""Precision policies: float32, bfloat16 mixed, float16 mixed with loss scaling, fp8.

Built on Keras 3 dtype policies: `mixed_bfloat16` and `mixed_float16` give bf16/fp16
compute with float32 variables. tfllm adds what they lack: float32 softmax,
normalization statistics, logits and loss (in the layers), dynamic loss scaling for
float16 (`tfllm.precision.loss_scale`) and FP8 matmuls (`tfllm.precision.fp8`).
"""

from __future__ import annotations

from typing import Optional

from tfllm.precision.fp8 import Fp8Settings

POLICIES = ("float32", "bfloat16", "float16", "fp8")

_KERAS = {"float32": "float32", "bfloat16": "mixed_bfloat16", "float16": "mixed_float16",
          "fp8": "mixed_bfloat16"}


def keras_policy(policy: str) -> str:
    """The Keras dtype policy name behind a tfllm policy."""
    if policy not in _KERAS:
        raise ValueError(f"precision.policy: unknown policy '{policy}'; use one of {POLICIES}.")
    return _KERAS[policy]


def fp8_settings(precision_config) -> Optional[Fp8Settings]:
    """FP8 settings for the fp8 policy, else None."""
    if precision_config.policy != "fp8":
        return None
    c = precision_config
    return Fp8Settings(c.fp8_recipe, c.fp8_amax_history_length, c.fp8_margin,
                       tuple(c.fp8_exclude), c.fp8_gather)


def apply_matmul_precision(precision_config) -> None:
    """Sets TensorFlow's process-wide TF32 switch from precision.tf32.

    TensorFlow reads it when it builds each op and each XLA dot (a dot compiled with TF32
    off carries `operand_precision={highest,highest}`), so it is set before any model is
    traced; `tfllm.models.build_model` calls this.
    """
    import tensorflow as tf
    tf.config.experimental.enable_tensor_float_32_execution(bool(precision_config.tf32))


def describe(precision_config) -> str:
    """One line for the training log: the policy and, for fp8, the recipe."""
    c = precision_config
    text = f"precision={c.policy} (keras policy {keras_policy(c.policy)})"
    if c.policy == "fp8":
        text += (f", fp8 recipe={c.fp8_recipe}"
                 + (f" (amax history {c.fp8_amax_history_length}, margin {c.fp8_margin})"
                    if c.fp8_recipe == "delayed" else f" (margin {c.fp8_margin})")
                 + (f", bf16 layers: {', '.join(c.fp8_exclude)}" if c.fp8_exclude else ""))
    if c.policy == "float16":
        text += f", dynamic loss scale from {c.loss_scale_initial:g}"
    if not c.tf32:
        text += ", TF32 off (IEEE float32 matmuls)"
    return text
