"""Activation rematerialization: trade compute in the backward pass for activation memory.

A policy names which activations the backward pass gets back by recomputing them instead
of keeping them from the forward pass (`model.remat`):

* `none`: keep everything (fastest, most memory).
* `full`: keep only each block's input; the whole block (norms, projections, attention,
  MLP) runs again in the backward pass (MaxText's `full`, torchtitan's `full` AC):
  activation memory per block drops to one (B, T, E) tensor for about one extra forward.
* `selective`: keep the outputs of the matmuls (q, k, v, the attention output before its
  projection, the MLP's up/gate outputs) and recompute the cheap element-wise work
  (norms, GELU/SwiGLU) and the attention scores and softmax (Megatron's selective
  recompute plus the norms): the (B, H, T, T) scores, the largest activation at long
  sequences, are never kept, for a few percent more FLOPs.
* `attention`: recompute only the attention core (scores, softmax, probabilities x V).

Recomputation is `tf.recompute_grad`: in the backward pass the function runs again under
a tape (variables read inside, FP8 amax histories included, get their gradients through
it), so every precision and every mesh works unchanged.
"""

from __future__ import annotations

import tensorflow as tf

from tfllm.models.common import noise
from tfllm.parallel.context import outside_block

POLICIES = ("none", "full", "selective", "attention")


def recompute(fn):
    """`fn` whose activations are recomputed in the backward pass (tf.recompute_grad).

    Only floating-point tensors are differentiated inputs of the recomputed function;
    other arguments (None, masks, integer positions) are closed over. Inside, weights are
    read as variables, not taken from a sharded block's gathered tensors
    (`outside_block`): a tensor the function only captured would get no gradient.
    """
    def call(*args):
        present = [i for i, a in enumerate(args)
                   if isinstance(a, (tf.Tensor, tf.Variable)) and a.dtype.is_floating]
        seed = noise.current()  # the recomputation draws the forward pass's masks

        @tf.recompute_grad
        def inner(*tensors):
            full = list(args)
            for i, t in zip(present, tensors):
                full[i] = t
            with outside_block(), noise.noise_seed(seed):
                return fn(*full)
        return inner(*[args[i] for i in present])
    return call


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"model.remat: unknown policy {policy!r}; use one of {POLICIES}.")
    return policy
