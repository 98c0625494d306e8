"""Validation loss and perplexity: the mean next-token NLL over held-out batches."""

from __future__ import annotations

import math

from tfllm.compiler.jit import compile_fn
from tfllm.data.errors import DataError
from tfllm.models.loss import loss_sum_and_count
from tfllm.parallel.placement import to_numpy
from tfllm.train.step import lm_forward


class Evaluator:
    """Compiles a forward-only step that sums the NLL and counts tokens.

    Args:
      model: a built `tfllm.models.CausalLM`.
      parallel: the sharding setup, or None.
      jit_compile: XLA-compile the step.
      packing_mask: pass segment ids to the model (documents do not attend to each other).
    """

    def __init__(self, model, parallel, jit_compile: bool, packing_mask: bool = False):
        self.model, self.parallel, self.packing_mask = model, parallel, packing_mask
        #: the compiled sums of one batch (a `tf.function` of its micro-batches)
        self.compiled = compile_fn(self._nll_sum, parallel, jit_compile)

    def _nll_sum(self, micro_batches):
        total, count = 0.0, 0.0
        for micro in micro_batches:
            logits, targets, segment_ids = lm_forward(self.model, micro,
                                                      self.packing_mask)
            # Validation rows end in padding (segment 0): not counted.
            mask = None if segment_ids is None else segment_ids[:, 1:] > 0
            s, n = loss_sum_and_count(logits, targets, mask)
            total, count = total + s, count + n
        return total, count

    def __call__(self, batches, steps: int) -> dict:
        """Mean loss over `steps` device batches drawn from the iterable `batches`.

        Returns:
          {"eval_loss", "eval_perplexity", "eval_tokens"}.
        """
        total, count = 0.0, 0.0
        for _, batch in zip(range(steps), batches):
            s, n = self.compiled(batch)
            total += float(to_numpy(s))
            count += float(to_numpy(n))
        if not count:  # batches past the end of the data are padding: fewer never help
            raise DataError("the validation data holds no text; add validation documents "
                            "(data.eval_paths, a larger data.validation_fraction, or "
                            "data.tfds_eval_split).")
        loss = total / count
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)),
                "eval_tokens": int(count)}
