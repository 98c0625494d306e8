"""`Scorer`: the log-probability of each target token of token rows, batched and compiled,
on one device or the run's mesh.

What lm-eval's `loglikelihood` needs of a model: for a row of input ids and the ids that
follow each of them, every target's log-probability (a float32 log-softmax over the
vocabulary, as lm-eval's Hugging Face backend takes it) and whether it is the argmax.
Rows are right-padded (causal attention: padding after a position cannot change it) to a
length bucket and the batch to a fixed number of rows, so that a whole task compiles a
handful of programs, not one per request.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tfllm.compiler.jit import Retraced
from tfllm.data import feed
from tfllm.parallel import context
from tfllm.parallel.placement import to_numpy

#: the shortest padded length; longer rows go up by powers of two (to the model's limit)
MIN_BUCKET = 16


def bucket_length(length: int, limit: int) -> int:
    """The padded length of a batch whose longest row is `length` tokens: the next power
    of two from MIN_BUCKET, at most `limit` (model.max_sequence_length)."""
    padded = MIN_BUCKET
    while padded < length:
        padded *= 2
    return min(padded, max(limit, length))


class Scorer:
    """Target log-probabilities of token rows with a built `CausalLM`.

    Args:
      model: the run's model, its weights restored (`tfllm.train.saved_run.restored_run`).
      parallel: the `tfllm.parallel.Parallel` it lives on, or None.
      jit_compile: XLA-compile the forward pass.
      batch_size: rows per call (rounded up to a multiple of the mesh's batch axis).
    """

    def __init__(self, model, parallel, jit_compile: bool, batch_size: int):
        self.model = model
        # prompts of any length: the sequence is never split, weights keep their layouts
        self.parallel = parallel.for_decoding() if parallel is not None else None
        multiple = feed.batch_multiple(self.parallel)
        self.batch_size = -(-batch_size // multiple) * multiple
        self.limit = model.config.max_sequence_length
        self._score = Retraced(self._score_fn, self.parallel, jit_compile)

    def _score_fn(self, tokens, targets):
        logits = self.model(tokens)  # (B, T, V)
        # every row needs its whole vocabulary for the log-softmax and the argmax
        logits = context.constrain(tf.cast(logits, tf.float32),
                                   feed.TOKEN_AXES + (None,), "eval logits")
        log_probs = tf.nn.log_softmax(logits, axis=-1)  # (B, T, V)
        target = tf.gather(log_probs, targets, axis=2, batch_dims=2)  # (B, T)
        greedy = tf.equal(tf.argmax(logits, axis=-1, output_type=targets.dtype), targets)
        return (context.constrain(target, feed.TOKEN_AXES, "target log-probs"),
                context.constrain(greedy, feed.TOKEN_AXES, "greedy"))

    def score(self, rows: Sequence[Tuple[Sequence[int], Sequence[int]]]
              ) -> List[Tuple[np.ndarray, np.ndarray]]:
        """Log-probabilities of `rows`, each (input ids, target ids) of one length: the
        target at position t is the token that follows input t.

        Returns:
          One (float32 log-probabilities, bool argmax-is-target) per row, of its length.
        """
        out = []
        for at in range(0, len(rows), self.batch_size):
            out += self._batch(rows[at:at + self.batch_size])
        return out

    def _batch(self, rows):
        longest = max(len(inputs) for inputs, _ in rows)
        if longest > self.limit:
            raise ValueError(f"a scored row is {longest} tokens; model.max_sequence_length "
                             f"is {self.limit}.")
        length = bucket_length(longest, self.limit)
        tokens = np.zeros((self.batch_size, length), np.int32)  # (B, T) right-padded
        targets = np.zeros((self.batch_size, length), np.int32)
        for row, (inputs, target) in enumerate(rows):
            tokens[row, :len(inputs)] = inputs
            targets[row, :len(target)] = target
        log_probs, greedy = self._score(feed.place(self.parallel, tokens, feed.TOKEN_AXES,
                                                   "eval tokens"),
                                        feed.place(self.parallel, targets, feed.TOKEN_AXES,
                                                   "eval targets"))
        log_probs, greedy = to_numpy(log_probs), to_numpy(greedy)
        return [(log_probs[row, :len(inputs)], greedy[row, :len(inputs)])
                for row, (inputs, _) in enumerate(rows)]
