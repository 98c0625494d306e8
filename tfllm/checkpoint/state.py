"""The run state as one flat {name: variable} dict with stable, mesh-independent names.

`state_name` is the one place a run-state variable gets its name: the checkpointer saves
and restores by it, `tfllm export-step` describes the step's parameters by it, and an
import writes its weights by it. The names are the checkpoints' on-disk names: changing
one would stop old checkpoints from loading.
"""

from __future__ import annotations

from typing import Dict, Optional

#: the groups of run-state variables: those with a Keras path after the group's name
#: (a model variable; a moment of a trained variable) and single ones
PATH_GROUPS = ("model", "optimizer/m", "optimizer/v", "reference")
SINGLE_NAMES = ("optimizer/iterations", "loss_scale/scale", "loss_scale/good_steps",
                "loss_scale/skipped_steps", "train/guard_skipped")


def state_name(group: str, path: Optional[str] = None) -> str:
    """The name of a run-state variable in a checkpoint (and in export-step's step.json).

    Args:
      group: "model" (a model variable: weights and FP8 amax histories), "optimizer/m" or
        "optimizer/v" (AdamW's moments of a trained variable), "reference" (a weight of
        DPO's frozen reference copy), all with `path`; or one of
        the single variables "optimizer/iterations", "loss_scale/{scale,good_steps,
        skipped_steps}" (fp16 loss scaling) and "train/guard_skipped" (the step guard's
        count), without `path`.
      path: the Keras path of the model variable (of the trained variable, for a
        moment). Keras paths do not depend on the mesh, so a checkpoint restores onto
        any mesh.

    Returns:
      "<group>/<path>", or the single variable's name.
    """
    if group in PATH_GROUPS and path:
        return f"{group}/{path}"
    if group in SINGLE_NAMES and path is None:
        return group
    raise ValueError(f"state_name({group!r}, {path!r}): a run-state variable is one of "
                     f"{', '.join(PATH_GROUPS)} with a Keras path, or one of "
                     f"{', '.join(SINGLE_NAMES)} without one.")


def model_variables(model, fp8_state: bool = True, prefix: str = "model") -> Dict[str, object]:
    """The model's variables by their run-state names: the weights alone restore from a
    checkpoint that holds more (`Reader.restore(..., strict=False)`).

    Args:
      model: a built Keras model.
      fp8_state: include the FP8 amax histories (model variables of kind "fp8_state");
        False for pretrained weights, whose run may not have used FP8.
      prefix: "model", or "reference" for DPO's reference copy (`run_state_variables`).
    """
    return _unique((state_name(prefix, var.path), var) for var in model.variables
                   if fp8_state or getattr(var, "kind", None) != "fp8_state")


def run_state_variables(model, optimizer=None, loss_scale=None,
                        guard_skipped=None, reference=None) -> Dict[str, object]:
    """Every variable a run must save to resume exactly, named by `state_name`.

    Args:
      model: a built Keras model (`tfllm.models.build_model`).
      optimizer: a built `tfllm.optim.AdamW`, or None.
      loss_scale: a `tfllm.precision.loss_scale.DynamicLossScale`, or None.
      guard_skipped: the train step's count of steps its guard skipped
        (`TrainStep.skipped`), or None.
      reference: DPO's frozen reference model (full fine-tuning), or None; saved as
        reference/<path>, so that a resumed run compares with the same reference.
    """
    return _unique(_state_items(model, optimizer, loss_scale, guard_skipped, reference))


def _state_items(model, optimizer, loss_scale, guard_skipped, reference=None):
    for var in model.variables:
        yield state_name("model", var.path), var
    if optimizer is not None:
        if optimizer.iterations is None:
            raise ValueError("run_state_variables: the optimizer is not built; call "
                             "optimizer.build(model.trainable_variables) first.")
        yield state_name("optimizer/iterations"), optimizer.iterations
        for var, (_, m, v) in zip(optimizer.variables, optimizer.states):
            yield state_name("optimizer/m", var.path), m
            yield state_name("optimizer/v", var.path), v
    if loss_scale is not None:
        for name, var in (("scale", loss_scale.scale), ("good_steps", loss_scale.good_steps),
                          ("skipped_steps", loss_scale.skipped_steps)):
            yield state_name(f"loss_scale/{name}"), var
    if guard_skipped is not None:
        yield state_name("train/guard_skipped"), guard_skipped
    if reference is not None:
        for var in reference.variables:
            yield state_name("reference", var.path), var


def _unique(items) -> Dict[str, object]:
    out: Dict[str, object] = {}
    for name, var in items:
        if name in out:
            raise ValueError(f"run_state_variables: two variables are named '{name}'; give "
                             "the layers distinct names so that every Keras path is unique.")
        out[name] = var
    return out
