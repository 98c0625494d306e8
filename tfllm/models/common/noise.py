"""Randomness of a training forward pass (LoRA dropout), reproducible in a recomputation.

The train step runs each micro-batch's forward pass under `noise_seed(step seed)`;
evaluation and generation never do, so dropout acts in training only. Masks are
stateless (`tf.random.stateless_uniform` of the seed and the layer's path): a forward
pass recomputed in the backward one (`tfllm.models.common.remat`, which re-enters the
seed it was called under) draws the same mask.
"""

from __future__ import annotations

import contextlib
import threading
import zlib

import tensorflow as tf

_noise = threading.local()


def current():
    """The active seed (an int scalar tensor), or None outside a training forward pass."""
    return getattr(_noise, "seed", None)


@contextlib.contextmanager
def noise_seed(seed):
    """Forward passes inside draw their dropout masks from `seed` (None: no dropout)."""
    previous = current()
    _noise.seed = seed
    try:
        yield
    finally:
        _noise.seed = previous


def dropout(x, rate: float, name: str):
    """x with a fraction `rate` of its entries zeroed and the rest scaled by 1/(1-rate),
    the mask drawn from the active seed and `name` (a layer's path)."""
    seed = current()
    if seed is None:
        raise ValueError(f"{name}: dropout needs a step seed (noise_seed); the train step "
                         "sets it.")
    salt = tf.constant(zlib.crc32(name.encode()) & 0x7FFFFFFF, tf.int64)
    keep = tf.random.stateless_uniform(tf.shape(x), tf.stack([tf.cast(seed, tf.int64), salt]),
                                       dtype=tf.float32) >= rate
    return tf.where(keep, x / tf.cast(1.0 - rate, x.dtype), tf.zeros_like(x))
