"""The unigram baseline: the loss a model that ignores context would get.

A language model "learns something" only if its validation loss beats the cross-entropy
of unigram token frequencies estimated on the training tokens and evaluated on the
validation tokens (both with the end-of-document id after each document, like the
targets the model is trained on).
"""

from __future__ import annotations

import itertools
import math
from typing import Iterable, Optional

import numpy as np


def unigram_cross_entropy(train_ids: Iterable[Iterable[int]], eval_ids: Iterable[Iterable[int]],
                          vocab_size: int, smoothing: float = 0.5) -> float:
    """Nats per token of eval tokens under train-token unigram frequencies.

    Args:
      train_ids: token-id sequences the frequencies are counted on.
      eval_ids: token-id sequences the cross-entropy is measured on.
      vocab_size: number of ids; every id gets `smoothing` extra counts (additive
        smoothing), so unseen eval tokens have a finite cost.
      smoothing: pseudo-count per id.
    """
    counts = np.full(vocab_size, smoothing, np.float64)
    for ids in train_ids:
        counts += np.bincount(np.asarray(list(ids), np.int64), minlength=vocab_size)
    log_probs = np.log(counts) - math.log(counts.sum())
    total, n = 0.0, 0
    for ids in eval_ids:
        ids = np.asarray(list(ids), np.int64)
        total -= float(log_probs[ids].sum())
        n += ids.size
    return total / max(n, 1)


def unigram_loss(data, tokenizer, max_train_docs: Optional[int] = None) -> float:
    """The unigram baseline (nats/token) of the configured data and tokenizer.

    Args:
      data: the config's `DataConfig`.
      tokenizer: a tfllm.data.tokenizer.Tokenizer.
      max_train_docs: count frequencies on at most this many training documents.
    """
    from tfllm.data.sources import iterate_documents

    def ids(split, limit=None):
        for doc in itertools.islice(iterate_documents(data, split), limit):
            yield tokenizer.encode(doc) + [tokenizer.eod_id]
    return unigram_cross_entropy(ids("train", max_train_docs), ids("validation"),
                                 tokenizer.vocab_size)
