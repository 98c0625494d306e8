"""Validation loss and perplexity: the mean next-token NLL over held-out batches; with
DPO (train.objective=dpo) the DPO loss and TRL's reward metrics over held-out pairs."""

from __future__ import annotations

import math

import tensorflow as tf

from tfllm.compiler.jit import compile_fn
from tfllm.data.errors import DataError
from tfllm.models.common.moe import SUMMED_METRICS
from tfllm.models.loss import loss_sum_and_count
from tfllm.parallel.placement import to_numpy
from tfllm.train.dpo import real_pairs
from tfllm.train.step import lm_forward, trained_targets


class Evaluator:
    """Compiles a forward-only step that sums the NLL and counts tokens.

    Args:
      model: a built `tfllm.models.CausalLM`.
      parallel: the sharding setup, or None.
      jit_compile: XLA-compile the step.
      packing_mask: pass segment ids to the model (documents do not attend to each other).
      objective: the run's `tfllm.train.dpo.DpoLoss` (DPO), or None (SFT).
    """

    def __init__(self, model, parallel, jit_compile: bool, packing_mask: bool = False,
                 objective=None):
        self.model, self.parallel, self.packing_mask = model, parallel, packing_mask
        self.objective = objective
        #: the compiled sums of one batch (a `tf.function` of its micro-batches)
        self.compiled = compile_fn(self._nll_sum if objective is None else self._pair_sums,
                                   parallel, jit_compile)

    def _pair_sums(self, micro_batches):
        """{name: summed over pairs} of the DPO loss and metrics, and "pairs" (DPO)."""
        sums = {}
        for micro in micro_batches:
            loss, metrics = self.objective(
                self.model, micro, lambda m, x: lm_forward(m, x, self.packing_mask))
            pairs = tf.reduce_sum(real_pairs(micro))
            for name, value in {"loss": loss, **metrics, "pairs": 1.0}.items():
                if name in SUMMED_METRICS:  # a step's counts, not a held-out mean
                    continue
                sums[name] = sums.get(name, 0.0) + value * pairs
        return sums

    def _pairs(self, batches, steps: int) -> dict:
        """DPO: {"eval_loss", "eval_rewards/chosen", ..., "eval_pairs"}, means over the
        held-out pairs (TRL's evaluate names)."""
        sums = {}
        for _, batch in zip(range(steps), batches):
            for name, value in self.compiled(batch).items():
                sums[name] = sums.get(name, 0.0) + float(to_numpy(value))
        if not sums.get("pairs"):
            raise DataError("the validation data holds no preference pair; add pairs "
                            "(data.eval_paths or a larger data.validation_fraction).")
        pairs = sums.pop("pairs")
        return {**{f"eval_{k}": v / pairs for k, v in sums.items()}, "eval_pairs": int(pairs)}

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
        if self.objective is not None:
            return self._pairs(batches, steps)
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
