"""A deterministic, learnable synthetic token source (no download, no tokenizer).

Each sequence follows a fixed random permutation of the vocabulary (token t+1 is
perm[token t]) with 10% of positions replaced by uniform noise, so a model can learn
the permutation and its loss falls well below log(vocab_size). Batch `step` depends
only on (seed, step): the same on any mesh and any number of clients.
"""

from __future__ import annotations

import numpy as np


class SyntheticTokens:
    """Synthetic token batches of shape (grad_accum_steps, micro_batch, length).

    Args:
      vocab_size: tokens are in [0, vocab_size).
      length: tokens per row (the train step uses length - 1 inputs and targets).
      seed: fixes the permutation and the batches.
      noise: fraction of positions replaced by a uniform random token.
    """

    def __init__(self, vocab_size: int, length: int, seed: int = 0, noise: float = 0.1):
        self.vocab_size, self.length, self.seed, self.noise = vocab_size, length, seed, noise
        self.perm = np.random.default_rng(seed).permutation(vocab_size)

    def batch(self, step: int, global_batch: int, grad_accum_steps: int = 1) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        rows = np.empty((global_batch, self.length), np.int32)
        rows[:, 0] = rng.integers(0, self.vocab_size, global_batch)
        noise = rng.random((global_batch, self.length)) < self.noise
        random_tokens = rng.integers(0, self.vocab_size, (global_batch, self.length))
        for t in range(1, self.length):
            nxt = self.perm[rows[:, t - 1]]
            rows[:, t] = np.where(noise[:, t], random_tokens[:, t], nxt)
        micro = global_batch // grad_accum_steps
        return rows.reshape(grad_accum_steps, micro, self.length)  # (A, M, T+1)
