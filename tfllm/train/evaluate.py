"""Validation loss and perplexity: the mean next-token NLL over held-out batches."""

from __future__ import annotations

import math

import tensorflow as tf

from tfllm.parallel import context
from tfllm.parallel.placement import to_numpy


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
        self._sums = tf.function(self._nll_sum, jit_compile=jit_compile)

    def _nll_sum(self, micro_batches):
        with context.use(self.parallel):
            total, count = 0.0, 0.0
            for micro in micro_batches:
                tokens, segment_ids = micro if isinstance(micro, (tuple, list)) else (
                    micro, None)
                inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (M, T) each
                if segment_ids is not None and self.packing_mask:
                    logits = self.model(inputs, segment_ids=segment_ids[:, :-1])
                else:
                    logits = self.model(inputs)  # (M, T, V) float32
                if segment_ids is None:
                    mask = tf.ones_like(targets, tf.float32)
                else:  # validation rows end in padding (segment 0): not counted
                    mask = tf.cast(segment_ids[:, 1:] > 0, tf.float32)
                n = tf.reduce_sum(mask)
                mean = self.model.compute_lm_loss(logits, targets, mask)
                total, count = total + mean * tf.maximum(n, 1.0), count + n
            return total, count

    def __call__(self, batches, steps: int) -> dict:
        """Mean loss over `steps` device batches drawn from the iterable `batches`.

        Returns:
          {"eval_loss", "eval_perplexity", "eval_tokens"}.
        """
        total, count = 0.0, 0.0
        for _, batch in zip(range(steps), batches):
            s, n = self._sums(batch)
            total += float(to_numpy(s))
            count += float(to_numpy(n))
        if not count:
            raise ValueError("the validation data gave no batches; add validation text or "
                             "lower train.eval_steps.")
        loss = total / count
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)),
                "eval_tokens": int(count)}
