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

Recomputation is a `tf.custom_gradient` whose backward pass runs the function again under
a tape (variables read inside, FP8 amax histories included, get their gradients through
it), so every precision and every mesh works unchanged. It differs from
`tf.recompute_grad` in what the recomputation waits for. Both must make it wait for the
output gradient by a data dependency (XLA and DTensor's passes drop control edges);
TensorFlow's takes `reduce_max(reshape(dy, [-1])[:1])`, and on a batch-sharded DTensor
that reshape relayouts the gradient to replicated: a float32 all-reduce of the *global*
activation per recomputed function (8 GiB per block for llama-7b's preset). Here each
input waits for the gradient of the same shape element by element
(`where(dy > inf, dy, x)`, which is `x` bit for bit, NaN included, and which XLA does not
fold), on each device's own shard: no collective. A block recomputed under `full` also
gathers its weights again after its gradient arrives (`recomputing()`), so no block's
gathered weights are kept from the forward pass to the backward one.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from tfllm.models.common import noise
from tfllm.parallel.context import outside_block

POLICIES = ("none", "full", "selective", "attention")


_state = threading.local()


def recomputing() -> bool:
    """Whether the code running is a recomputation in the backward pass."""
    return getattr(_state, "recomputing", False)


@contextlib.contextmanager
def _recomputation():
    previous = recomputing()
    _state.recomputing = True
    try:
        yield
    finally:
        _state.recomputing = previous


def after_gradient(tensors, grads):
    """`tensors`, each made to wait for the output gradients `grads` on its own devices.

    A tensor waits for the first gradient of its shape, element by element (its layout
    is the activation's, so no collective moves it); a tensor with no gradient of its
    shape is left as it is (the recomputation still waits through the others). Only
    when none has a gradient of its shape does one wait on a scalar of the first
    gradient, TensorFlow's way (a reduction: a collective on a mesh).
    """
    inf = float("inf")
    grads = [g for g in grads if g is not None]
    out, waited = [], False
    for t in tensors:
        same = next((g for g in grads if g.shape.is_fully_defined()
                     and g.shape == t.shape), None)
        if same is None:
            out.append(t)
            continue
        # dy > inf is false for every value, NaN included: t bit for bit.
        out.append(tf.where(tf.greater(same, tf.cast(inf, same.dtype)),
                            tf.cast(same, t.dtype), t))
        waited = True
    if not waited and grads and out:
        first = tf.reduce_max(tf.reshape(grads[0], [-1])[:1])
        out[0] = tf.where(tf.greater(first, tf.cast(inf, first.dtype)),
                          tf.cast(first, out[0].dtype), out[0])
    return out


def recompute(fn):
    """`fn` whose activations are recomputed in the backward pass.

    Only floating-point tensors are differentiated inputs of the recomputed function;
    other arguments (None, masks, integer positions) are closed over. Inside, weights are
    read as variables, not taken from a sharded block's gathered tensors
    (`outside_block`): a tensor the function only captured would get no gradient. The
    recomputation waits for the output gradient on each device (`after_gradient`).
    """
    def call(*args):
        present = [i for i, a in enumerate(args)
                   if isinstance(a, (tf.Tensor, tf.Variable)) and a.dtype.is_floating]
        seed = noise.current()  # the recomputation draws the forward pass's masks

        def run(tensors):
            full = list(args)
            for i, t in zip(present, tensors):
                full[i] = t
            with outside_block(), noise.noise_seed(seed):
                return fn(*full)

        @tf.custom_gradient
        def inner(*tensors):
            result = run(tensors)

            def grad(*dys, variables=None):
                variables = list(variables or ())
                waited = after_gradient(tensors, dys)
                with tf.GradientTape(watch_accessed_variables=False) as tape:
                    tape.watch(waited)
                    tape.watch(variables)
                    with _recomputation():
                        again = run(waited)
                grads = tape.gradient(tf.nest.flatten(again), waited + variables,
                                      output_gradients=list(dys),
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
                return grads[:len(waited)], grads[len(waited):]

            return result, grad

        return inner(*[tf.convert_to_tensor(args[i]) for i in present])
    return call


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"model.remat: unknown policy {policy!r}; use one of {POLICIES}.")
    return policy
