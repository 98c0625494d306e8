"""`build_train_state`: the model, optimizer, loss scale and step of a training run.

The one place they are put together, so that `tfllm train` (`Run`), `tfllm export-step`,
`tfllm bench` (through `Run`) and the tests train the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tfllm.models import build_model
from tfllm.optim import AdamW
from tfllm.train.dpo import DpoLoss
from tfllm.train.step import TrainStep


@dataclass
class TrainState:
    """What one training run updates.

    Args:
      model: the placed `CausalLM`.
      optimizer: AdamW, built over the model's trainable variables (None: inference).
      loss_scale: a `DynamicLossScale` under float16, else None.
      step: the `TrainStep` over them (None: inference).
      objective: DPO's `DpoLoss` (train.objective=dpo), or None (SFT).
      reference: DPO's frozen reference copy (full fine-tuning: lora.rank=0, without
        dpo.precompute_reference), or None.
    """

    model: object
    optimizer: AdamW
    loss_scale: object
    step: Optional[TrainStep]
    objective: object = None
    reference: object = None


def build_train_state(config, parallel, jit_compile: bool, model_cls=None,
                      packing_mask: bool = False, optimizer: bool = True) -> TrainState:
    """Builds the run's model (in its layouts on `parallel`, or on one device when None),
    optimizer, loss scale (float16 only) and train step.

    Args:
      config: the resolved config.
      parallel: the sharding setup, or None for one device without DTensor.
      jit_compile: XLA-compile the step.
      model_cls: a `CausalLM` subclass to use instead of the config's family.
      packing_mask: the step masks attention to each packed document.
      optimizer: False for inference (`tfllm generate`, `eval`): the model alone, with
        no AdamW (whose moments alone are twice the float32 weights), loss scale or
        train step.
    """
    sections = (config.model, config.precision, config.lora)
    model = build_model(*sections, parallel=parallel, seed=config.train.seed,
                        model_cls=model_cls)
    reference = objective = None
    if config.train.objective == "dpo":
        if (config.lora.rank == 0 and config.dpo.loss != "orpo"  # ORPO: reference-free
                and not config.dpo.precompute_reference):  # stored values instead
            # Full fine-tuning: a frozen copy in the model's layouts (no optimizer state,
            # no gradient), initialized as the model (the same seed); an imported run
            # loads the imported weights into it (`tfllm.train.loop`), and checkpoints
            # save it, so a resumed run keeps its reference.
            reference = build_model(*sections, parallel=parallel, seed=config.train.seed,
                                    model_cls=model_cls, frozen=True)
        objective = DpoLoss(config.dpo, reference)
    if not optimizer:
        return TrainState(model, None, None, None, objective, reference)
    optimizer = AdamW(config.optimizer, config.train.steps, parallel)
    optimizer.build(model.trainable_variables)
    loss_scale = None
    if config.precision.policy == "float16":
        from tfllm.precision.loss_scale import DynamicLossScale
        loss_scale = DynamicLossScale(config.precision.loss_scale_initial,
                                      config.precision.loss_scale_growth_interval, parallel)
    step = TrainStep(model, optimizer, parallel, jit_compile, loss_scale,
                     packing_mask=packing_mask, objective=objective)
    return TrainState(model, optimizer, loss_scale, step, objective, reference)
