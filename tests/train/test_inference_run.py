"""`tfllm generate` and `eval` load the weights only: no AdamW moments, no loss scale."""

import numpy as np
import tensorflow as tf

from tests.harness import tiny_config
from tfllm.train.run import Run


def _bytes(variables):
    return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables)


def test_an_inference_run_holds_the_weights_and_evaluates_like_a_training_run():
    cfg = tiny_config("llama", "fsdp=2", **{
        "precision.policy": "float16", "train.eval_steps": 2})
    full = Run(cfg, train_iterator=False)
    lean = Run(cfg, train_iterator=False, inference=True)
    assert full.optimizer is not None and full.loss_scale is not None
    assert lean.optimizer is None and lean.loss_scale is None and lean.step is None
    # Training state is the weights plus AdamW's two float32 moments (and the loss scale).
    assert _bytes(full.optimizer.state_variables()) >= 2 * _bytes(full.model.trainable_variables)
    # The lean run holds the weights and nothing else.
    assert {v.path for v in lean.state_variables().values()} == \
        {v.path for v in lean.model.variables}
    # The same initial weights give the same validation loss (the same eval batches).
    assert lean.evaluate() == full.evaluate()
