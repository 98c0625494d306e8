"""The run state as one flat {name: variable} dict with stable, mesh-independent names."""

from __future__ import annotations

from typing import Dict


def run_state_variables(model, optimizer=None, loss_scale=None) -> Dict[str, object]:
    """Every variable a run must save to resume exactly.

    Names: "model/<keras path>" for all model variables (weights and FP8 amax histories,
    which are model variables), "optimizer/iterations", "optimizer/m/<path>" and
    "optimizer/v/<path>" for AdamW's moments of each trained variable, and
    "loss_scale/{scale,good_steps,skipped_steps}" for fp16 loss scaling. Keras paths are
    independent of the mesh, so a checkpoint restores onto any mesh.

    Args:
      model: a built Keras model (`tfllm.models.build_model`).
      optimizer: a built `tfllm.optim.AdamW`, or None.
      loss_scale: a `tfllm.precision.loss_scale.DynamicLossScale`, or None.
    """
    out: Dict[str, object] = {}

    def add(name, var):
        if name in out:
            raise ValueError(f"run_state_variables: two variables are named '{name}'; give "
                             "the layers distinct names so that every Keras path is unique.")
        out[name] = var

    for var in model.variables:
        add(f"model/{var.path}", var)
    if optimizer is not None:
        if optimizer.iterations is None:
            raise ValueError("run_state_variables: the optimizer is not built; call "
                             "optimizer.build(model.trainable_variables) first.")
        add("optimizer/iterations", optimizer.iterations)
        for var, (_, m, v) in zip(optimizer.variables, optimizer.states):
            add(f"optimizer/m/{var.path}", m)
            add(f"optimizer/v/{var.path}", v)
    if loss_scale is not None:
        for name, var in (("scale", loss_scale.scale), ("good_steps", loss_scale.good_steps),
                          ("skipped_steps", loss_scale.skipped_steps)):
            add(f"loss_scale/{name}", var)
    return out
