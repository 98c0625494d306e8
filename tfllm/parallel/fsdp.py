"""FSDP with ZeRO-3 semantics on DTensor: gather each weight just before use, re-gather it
in the backward pass, reduce-scatter its gradient, and never keep a gathered copy alive.

Left to itself, DTensor gathers an FSDP-sharded weight where its relayout is written and
keeps the gathered copy for the backward pass, so a whole model's worth of gathered
weights is alive on every device at once (measured: one float32 all-reduce of every
sharded parameter at the start of the step, `../shared/notes/dtensor-costs.md`). Three
things change that here:

* **Order.** A forward gather takes a data dependency on the model's *gate* (`gate`:
  the input of the block one ahead, so block i+1's weights travel while block i
  computes); a backward re-gather on the layer's incoming gradient (`zero_after`).
  TensorFlow's executor runs an op as soon as its inputs are ready; without the
  dependency every gather, which only reads a variable, is ready at the start of the
  step (and control dependencies do not survive DTensor's lowering).
* **Lifetime.** `gathered_product` runs a layer's product (an einsum, an FP8 einsum) on
  the gathered weight under one `tf.custom_gradient` whose backward pass gathers the weight
  again (after the incoming gradient, so it happens when that layer's backward runs) and
  recomputes the product's gradients from it. The forward's gathered copy is dead as
  soon as the forward product has run: only the shard and the layer's input are kept.
* **Bytes.** The gather moves the compute dtype: a bfloat16 or float16 weight travels as
  float16 bits (`tf.bitcast`, exact: a gather does no arithmetic) through DTensor's
  `CollectiveGatherV2` lowering (`LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2`, set by
  `configure_dtensor`); without it DTensor lowers each gather to a zero-padded float32
  all-reduce and its combining pass merges all independent ones into one.
  Gradients are reduced in float32 (the weight's gradient is cast up before its
  relayout back to the sharded layout: an all-reduce plus slice on CPU, a reduce-scatter
  under NCCL).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable

import tensorflow as tf
from tensorflow.experimental import dtensor

# DTensor reads these at every lowering (tensorflow/dtensor/cc/dtensor_utils.cc), so they
# take effect for any function traced after `configure_dtensor`.
_GATHER_V2 = "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"
DTENSOR_SETTINGS = {
    # DTensorAllGather -> CollectiveGatherV2 (int32/int64/f16/f32/f64; other dtypes keep
    # the zero-padded all-reduce): gathers move the weight's bytes once, are not merged
    # by the all-reduce combining pass, and need no zero-filled full-size buffer.
    _GATHER_V2: "1",
    # DTensor's all-reduce combining pass merges every independent all-reduce of a group
    # into one buffer (`DTensorAllReduceCombineOptimization`): on data=2,fsdp=4 the
    # gradients of the whole model became one float32 all-reduce, a full copy of the model
    # on every device. One all-reduce per tensor keeps every collective at most one
    # weight's size, at the price of more, smaller collectives.
    "DTENSOR_ALLREDUCE_COMBINE_OPTIMIZATION_GROUP_SIZE": "1",
}

_USER_SET = {name for name in DTENSOR_SETTINGS if name in os.environ}


def configure_dtensor(mesh_shape=None, attention_recomputed: bool = False) -> dict:
    """Sets the DTensor lowering settings FSDP needs, unless the user set them; returns
    the values in effect.

    Args:
      mesh_shape: {axis: size} of the mesh about to be used.
      attention_recomputed: whether the model recomputes its attention core in the
        backward pass (`model.remat` attention or selective). DTensor's
        CollectiveGatherV2 lowering fails on one gather of that recomputation when data,
        fsdp and model are all > 1 (TF 2.21, `LowerAllGatherOpToCollective` in
        tensorflow/dtensor/mlir/collectives.cc: "'tf.Reshape' op requires 'output'
        number of elements to match", measured on the tiny gpt of tests/models/
        test_remat.py). Only there the gather lowering stays DTensor's default
        (zero-padded all-reduce; bfloat16 weights then travel upcast to float32); every
        other mesh and policy gathers in 16 bits.
    """
    sizes = mesh_shape or {}
    three_axes = all(sizes.get(a, 1) > 1 for a in ("data", "fsdp", "model"))
    for name, value in DTENSOR_SETTINGS.items():
        if name in _USER_SET:
            continue
        if name == _GATHER_V2 and three_axes and attention_recomputed:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return {name: os.environ.get(name) for name in DTENSOR_SETTINGS}


def gathers_as_collective() -> bool:
    """Whether gathers lower to CollectiveGatherV2 (else to DTensor's all-reduce)."""
    return _GATHER_V2 in os.environ


_state = threading.local()  # the active gate, per thread


class _Gate:
    """The tensors gathers wait for, and the zero computed from them (made once)."""

    def __init__(self, tensors):
        self.tensors = tuple(t for t in tensors if t is not None)
        self._zero = None

    def zero(self):
        if self._zero is None and self.tensors:
            self._zero = zero_after(self.tensors)
        return self._zero


def _current_gate():
    return getattr(_state, "gate", None)


@contextlib.contextmanager
def gate(tensors):
    """Gathers created inside wait for `tensors` (e.g. the previous block's input)."""
    previous = _current_gate()
    _state.gate = _Gate(tensors)
    try:
        yield
    finally:
        _state.gate = previous


def zero_after(tensors):
    """An int32 scalar 0 that can only be computed once `tensors` exist.

    Control dependencies cannot order a gather: DTensor converts the function to MLIR's
    functional form (`CreateExecutorDialectToFunctionalConversionPass` in
    tensorflow/dtensor/mlir/dtensor_mlir_passes.cc), which drops control edges between
    ops without side effects, and rebuilds them at the end only between side-effecting
    ops in program order; a variable read has no data inputs, so its gather lands at the
    start of the program. A data dependency survives every pass. The zero is made with
    integer bit operations (`bits & 0`), so NaN or Inf in the tensors cannot leak into the
    weight; summing the tensors costs one read of them and a scalar all-reduce.
    """
    total = tf.add_n([tf.cast(tf.reduce_sum(tf.stop_gradient(t)), tf.float32)
                      for t in tensors])
    return tf.bitwise.bitwise_and(tf.bitcast(total, tf.int32), tf.constant(0, tf.int32))


# Integer types of the same width, to OR a zero into a weight's bits exactly.
_BITS = {tf.float32: tf.int32, tf.bfloat16: tf.int16, tf.float16: tf.int16,
         tf.float64: tf.int64}


def _after(w, zero):
    """`w`, bit for bit, as a value that depends on `zero` (see `zero_after`)."""
    if zero is None:
        return w
    bits = _BITS[w.dtype]
    return tf.bitcast(tf.bitwise.bitwise_or(tf.bitcast(w, bits), tf.cast(zero, bits)),
                      w.dtype)


# Dtypes moved as float16 bits: DTensor's CollectiveGatherV2 lowering (and TF's NCCL path)
# do not take bfloat16; a gather only copies, so the bits are exact.
_AS_FLOAT16 = (tf.bfloat16,)


def moves_as_float16(dtype) -> bool:
    """Whether a relayout moves `dtype` as float16 bits: bfloat16, where gathers lower to
    real gathers (the all-reduce lowering adds zeros in float32, which would not carry
    float16 bit patterns of bfloat16 values exactly)."""
    return dtype in _AS_FLOAT16 and gathers_as_collective()


def _gather(w, compute_layout, zero=None):
    """`w` relayouted to `compute_layout`; not before `zero` exists (see `zero_after`)."""
    w = _after(w, zero)
    if moves_as_float16(w.dtype):
        bits = dtensor.relayout(tf.bitcast(w, tf.float16), compute_layout)
        return tf.bitcast(bits, w.dtype)
    return dtensor.relayout(w, compute_layout)


def bytes_to_carriers(codes):
    """(..., 2n) bytes (int32 0..255) -> (..., n) float16 carriers, two bytes each: the
    collective gather (and NCCL) takes no 8-bit dtype, and copies a carrier bit for bit."""
    shape = codes.shape.as_list()
    pairs = tf.reshape(codes, shape[:-1] + [shape[-1] // 2, 2])
    word = pairs[..., 0] + tf.bitwise.left_shift(pairs[..., 1], 8)
    return tf.bitcast(tf.cast(word, tf.uint16), tf.float16)


def carriers_to_bytes(carriers):
    """Inverse of `bytes_to_carriers`."""
    word = tf.cast(tf.bitcast(carriers, tf.uint16), tf.int32)
    pairs = tf.stack([tf.bitwise.bitwise_and(word, 255), tf.bitwise.right_shift(word, 8)], -1)
    shape = carriers.shape.as_list()
    return tf.reshape(pairs, shape[:-1] + [2 * shape[-1]])


def float32_to_carriers(x):
    """(..., n) float32 -> (..., 2n) float16 carriers: low halves, then high halves.
    (DTensor's layout rule for a Bitcast that changes the rank fails: every bitcast here
    keeps the element width.)"""
    bits = tf.bitcast(x, tf.int32)
    halves = [tf.bitwise.bitwise_and(bits, 0xFFFF),
              tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 16), 0xFFFF)]
    return tf.bitcast(tf.cast(tf.concat(halves, -1), tf.uint16), tf.float16)


def carriers_to_float32(carriers):
    """Inverse of `float32_to_carriers`."""
    words = tf.cast(tf.bitcast(carriers, tf.uint16), tf.int32)
    n = carriers.shape[-1] // 2
    bits = tf.bitwise.bitwise_or(words[..., :n], tf.bitwise.left_shift(words[..., n:], 16))
    return tf.bitcast(bits, tf.float32)


def relayout_16bit(x, layout):
    """`dtensor.relayout(x, layout)` that moves a bfloat16 tensor as float16 bits.

    DTensor's collective gather (and NCCL) take no bfloat16: left as it is, a bfloat16
    activation gathered for attention's keys and values travels as a zero-padded float32
    all-reduce, 4x the bytes of a 16-bit gather. A relayout only copies (gather, slice or
    all-to-all), so the bits arrive exact. Its gradient is DTensor's own rule for a
    relayout, `relayout_like` back to the input's layout, on float16 bits as well.
    Other dtypes, and meshes without the collective gather lowering, relayout as usual.
    """
    if not moves_as_float16(x.dtype):
        return dtensor.relayout(x, layout)

    @tf.custom_gradient
    def op(x):
        y = tf.bitcast(dtensor.relayout(tf.bitcast(x, tf.float16), layout), x.dtype)

        def grad(dy):
            if dy.dtype not in _AS_FLOAT16:
                return dtensor.relayout_like(dy, x)
            return tf.bitcast(dtensor.relayout_like(tf.bitcast(dy, tf.float16), x), dy.dtype)
        return y, grad
    return op(x)


def _gate_zero():
    state = _current_gate()
    return state.zero() if state is not None else None


def _sliced_reduction(layout) -> bool:
    """Whether DTensor reduce-scatters to `layout` as an all-reduce plus a slice."""
    return not (layout.mesh.device_type().upper() == "GPU"
                and os.environ.get("DTENSOR_GPU_USE_NCCL_COMMUNICATION") == "1")


def _copy(x):
    """`x`, bit for bit, in a buffer of its own.

    Elementwise ops (even `x | 0`, `x * 1`) forward their input's buffer, a slice's
    alias included, and DTensor has no layout rule for `DeepCopy`; a cast allocates.
    Through int64 every float32 bit pattern survives (a float64 round trip would
    flush denormals on CPU).
    """
    bits = tf.cast(tf.bitcast(x, tf.int32), tf.int64)
    return tf.bitcast(tf.cast(bits, tf.int32), tf.float32)


def _scatter(grad, shard_layout, dtype):
    """A full weight gradient back to the shard layout, summed in float32.

    Without NCCL (CPU meshes, GPU meshes without `DTENSOR_GPU_USE_NCCL_COMMUNICATION`)
    DTensor lowers the reduce-scatter to an all-reduce of the full gradient and a slice
    (`LowerReduceScatterOp`, tensorflow/dtensor/mlir/collectives.cc). The all-reduce
    works in place in the gradient's buffer and TensorFlow's slice of the first
    dimension aliases it, so each shard would keep its whole full-size gradient alive
    until the optimizer has run: on fsdp=8 every device then holds the full gradient
    of the model at the global-norm step. `_copy` gives the shard a buffer of its own.
    """
    reduced = dtensor.relayout(tf.cast(grad, tf.float32), shard_layout)
    return tf.cast(_copy(reduced) if _sliced_reduction(shard_layout) else reduced, dtype)


def gather(w, shard_layout, compute_layout):
    """The weight `w` (sharded) in `compute_layout`, for consumers whose gradient does not
    need the weight itself (embedding lookups, bias adds); its gradient comes back
    reduced in float32 to the shard layout."""

    @tf.custom_gradient
    def op(w):
        def grad(dy):
            return _scatter(tf.convert_to_tensor(dy), shard_layout, w.dtype)
        return _gather(w, compute_layout, _gate_zero()), grad

    return op(tf.convert_to_tensor(w))


def gathered_product(fn: Callable, x, w, shard_layout, compute_layout, extra=()):
    """fn(x, gathered w, *extra) whose backward gathers `w` again instead of keeping it.

    Args:
      fn: the product, e.g. `lambda x, w: tf.einsum(eq, x, w)`; differentiable in all its
        arguments (it may be a `tf.custom_gradient` such as the FP8 einsum, whose
        "gradients" for `extra` pass through unchanged).
      x: the input (its gradient is returned).
      w: the weight's shard (a tensor in `shard_layout`).
      shard_layout, compute_layout: `w`'s layout and the one `fn` computes with.
      extra: more tensors `fn` takes (FP8 amax histories); gradients pass through.
    """

    @tf.custom_gradient
    def op(x, w, *extra):
        y = fn(x, _gather(w, compute_layout, _gate_zero()), *extra)

        def grad(dy):
            w_full = _gather(w, compute_layout, zero_after([dy]))
            with tf.GradientTape() as tape:
                tape.watch([x, w_full, *extra])
                # Only this product's gradient ops run: its forward value is unused (the
                # gradients of an einsum read its inputs, not its output) and is pruned.
                y_again = fn(x, w_full, *extra)
            grads = tape.gradient(y_again, [x, w_full, *extra], output_gradients=dy)
            dw = _scatter(grads[1], shard_layout, w.dtype)
            return (grads[0], dw, *grads[2:])

        return y, grad

    return op(*(tf.convert_to_tensor(t) for t in (x, w, *extra)))
