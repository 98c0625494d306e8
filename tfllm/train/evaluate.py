"""Validation loss and perplexity: the mean next-token NLL over held-out batches."""

from __future__ import annotations

import math

import tensorflow as tf

from tfllm.compiler.jit import compile_fn
from tfllm.data.errors import DataError
from tfllm.models.loss import loss_sum_and_count
from tfllm.parallel.placement import to_numpy
from tfllm.train.step import lm_forward, trained_targets


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
        total, count, correct = 0.0, 0.0, 0.0
        for micro in micro_batches:
            logits, targets, segment_ids = lm_forward(self.model, micro,
                                                      self.packing_mask)
            # Validation rows end in padding (segment 0): not counted. Chat data counts
            # its trained targets only (the loss mask is 0 on padding too).
            mask = trained_targets(micro)
            if mask is None:
                mask = None if segment_ids is None else segment_ids[:, 1:] > 0
            s, n = loss_sum_and_count(logits, targets, mask)
            total, count = total + s, count + n
            if trained_targets(micro) is not None:  # token accuracy on the trained targets
                hits = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=targets.dtype),
                                        targets), tf.float32)  # (M, T)
                correct = correct + tf.reduce_sum(hits * mask)
        return total, count, correct

    def __call__(self, batches, steps: int) -> dict:
        """Mean loss over `steps` device batches drawn from the iterable `batches`.

        Returns:
          {"eval_loss", "eval_perplexity", "eval_tokens"}; with chat data (a loss mask:
          `tfllm.data.chat`) the loss is over the trained targets only, and
          "eval_accuracy" is the fraction of them the model's argmax predicts.
        """
        total, count, correct, chat = 0.0, 0.0, 0.0, False
        for _, batch in zip(range(steps), batches):
            s, n, c = self.compiled(batch)
            total += float(to_numpy(s))
            count += float(to_numpy(n))
            correct += float(to_numpy(c))
            chat = chat or trained_targets(batch[0]) is not None
        if not count:  # batches past the end of the data are padding: fewer never help
            raise DataError("the validation data holds no text; add validation documents "
                            "(data.eval_paths, a larger data.validation_fraction, or "
                            "data.tfds_eval_split).")
        loss = total / count
        out = {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)),
               "eval_tokens": int(count)}
        if chat:  # chat data: eval_tokens are the trained (masked) targets
            out["eval_accuracy"] = correct / count
        return out
