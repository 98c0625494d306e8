"""What the DPO step tests share: the shipped preference pairs as a config, random pairs
of token rows, adapters made to differ from their reference."""

import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "tfllm", "data", "preference_example.jsonl")
DPO = {"train.objective": "dpo", "data.format": "preference", "data.source": "text",
       "data.paths": f"[{EXAMPLE}]", "lora.rank": 4, "dpo.beta": 0.5}


def pair_batch(rng, pairs, vocab, length=17):
    """Rows 2p, 2p + 1: a shared random prompt of 3-8 tokens, then two different random
    completions of 2-8 tokens each (padded with 0), masks on the completions."""
    tokens = np.zeros((2 * pairs, length), np.int32)
    segments = np.zeros_like(tokens)
    mask = np.zeros_like(tokens)
    for p in range(pairs):
        prompt = rng.integers(1, vocab, rng.integers(3, 9))
        for r in (2 * p, 2 * p + 1):
            reply = rng.integers(1, vocab, rng.integers(2, 9))
            n = len(prompt) + len(reply)
            tokens[r, :n] = np.concatenate([prompt, reply])
            segments[r, :n] = 1
            mask[r, len(prompt):n] = 1
    return tokens, segments, mask


def randomize_adapters(model, seed=0, parallel=None):
    """B (zero at init) random too: the policy then differs from the reference."""
    rng = np.random.default_rng(seed)
    for v in model.trainable_variables:
        if "lora_b" in v.path:
            value = rng.normal(0, 0.2, v.shape).astype(np.float32)
            if parallel is not None:  # laid out as the variable
                value = parallel.shard_array(value, parallel.spec(v.path, v.shape,
                                                                  v.logical_axes))
            v.assign(value)
