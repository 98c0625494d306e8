"""FP8 matmuls written with `tf.custom_gradient`, and their scaling recipes.

Forward operands (activations and weights) are quantized to E4M3 (max 448, 3 mantissa
bits); incoming gradients to E5M2 (max 57344, 2 mantissa bits). Each tensor has a
per-tensor scale chosen so that its absolute maximum (amax) maps to the format's
largest value:

* current scaling: the amax of this very tensor (the recipe PyTorch's float8 training
  and Megatron default to);
* delayed scaling: the largest amax in a history of the last N steps, with a margin of
  2**margin, as Transformer Engine's original recipe.

Casts saturate (clip to the format's range before the cast; TensorFlow's cast gives NaN
beyond it) and an all-zero tensor gets scale 1, never a division by zero.

The dequantized operands feed the dot as `convert(f8) * (1/scale)`: the pattern that
XLA's GPU compiler rewrites into a cuBLASLt FP8 GEMM on Hopper.

FP8 state (one amax history per operand) is carried in variables that the layer
passes in as inputs; the "gradient" returned for a history is its new value, which the
train step assigns (the overwrite-with-gradient pattern of Flax and Keras). So the
state is updated from the global amax of sharded tensors (DTensor reduces the max over
shards) and the optimizer never touches it.

Under delayed scaling a step's amaxes only roll the histories, so a training step does not
reduce them one by one: inside `collecting_amaxes` each einsum keeps its operands' amaxes
per device (one value per batch piece of a mesh block, no collective) in an
`AmaxCollector`, and the step reduces all of them at its end, one all-reduce of a few
floats per layout (`AmaxCollector.new_histories`) where each operand had its own scalar
all-reduce, each a NCCL call and a cut in the step's XLA clusters (11 per llama block).
The values are the same: a max is a max in any order.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import tensorflow as tf

E4M3 = tf.dtypes.experimental.float8_e4m3fn
E5M2 = tf.dtypes.experimental.float8_e5m2
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
RECIPES = ("current", "delayed")
# graph -> numbers of the fp8_einsum calls traced into it (_this_call_only)
_CALLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Fp8Settings:
    """Which FP8 recipe to use and where.

    Args:
      recipe: "current" or "delayed".
      history_length: amax history length (delayed scaling).
      margin: scale = fmax / (amax * 2**margin).
      exclude: layer-path substrings that stay in bf16 (e.g. "block_0/", "mlp/down").
      gather: FSDP gathers the weights as E4M3 bytes (`WeightCodec`).
    """

    recipe: str = "delayed"
    history_length: int = 16
    margin: int = 0
    exclude: Sequence[str] = ()
    gather: bool = True

    def for_layer(self, path: str) -> Optional["Fp8Settings"]:
        """These settings, or None when `path` is excluded from FP8."""
        return None if any(p in path for p in self.exclude) else self


def scale_from_amax(amax, fmax: float, margin: int = 0):
    """fmax / (amax * 2**margin) as float32; 1 where amax is 0 (or not finite)."""
    amax = tf.cast(amax, tf.float32)
    ok = tf.logical_and(amax > 0.0, tf.math.is_finite(amax))
    safe = tf.where(ok, amax, tf.ones_like(amax))
    return tf.where(ok, fmax / (safe * (2.0 ** margin)), tf.ones_like(amax))


def history_scale(history, fmax: float, margin: int = 0):
    """Delayed scaling: the scale of the largest amax in `history`. One definition for
    the einsum and for FSDP's FP8 gathers (`WeightCodec`), whose bytes are exact only
    if both quantize with the same scale."""
    return scale_from_amax(tf.reduce_max(history), fmax, margin)


def quantize(x, scale, dtype, fmax: float):
    """Saturating cast of x * scale to an FP8 dtype."""
    scaled = tf.cast(x, tf.float32) * scale
    return tf.cast(tf.clip_by_value(scaled, -fmax, fmax), dtype)


def dequantize(q, scale, dtype):
    """FP8 values back to `dtype`: convert, then multiply by 1/scale."""
    return tf.cast(q, dtype) * tf.cast(1.0 / scale, dtype)


def _dequantize_again(q, scale, dtype):
    """dequantize(q, scale, dtype) bit for bit, as ops that cannot be merged with it.

    For the backward pass. XLA's GPU compiler turns a dot into a cuBLASLt FP8 GEMM only
    when both operands are `convert(f8)` (times a broadcast scalar, through layout ops)
    in the module that holds the dot (`MatchFp8Param`, xla/service/gpu/transforms/
    gemm_rewriter.cc). On a DTensor mesh the step is not one XLA program: TensorFlow's
    clustering of the jit_scope-marked ops (tfllm.compiler.jit) cuts it at DTensor's
    collectives, so the backward dots of a projection sit in other clusters than its
    forward dot, and the tensors that cross are cluster parameters. A backward that
    reuses the forward's dequantized operands gets bf16 parameters; so does one that
    dequantizes again with the SAME ops: DTensor's MLIR pipeline inlines the gradient
    function and runs `mlir::createCSEPass()` right after `CreateDTensorSPMDExpansion()`
    (`CreateDTensorMLIRPass`, tensorflow/dtensor/mlir/dtensor_mlir_passes.cc), which
    merges the identical `Cast(q) -> Mul` chain into the forward's, in the forward's
    cluster.

    Here the cast reads `q` through a trailing unit dimension (ExpandDims, Squeeze after
    the scale): other ops, so CSE keeps them, that XLA lowers to reshapes (bitcasts, no
    data movement) which the GEMM rewriter looks through. The values are computed by
    `dequantize` itself, so they are those of the forward. The backward keeps only the
    FP8 bytes and the scale of each operand alive, never a bf16 copy. (An attribute
    change does not do: `Cast(Truncate=True)` is the same HLO convert but tf2xla refuses
    it for widening casts, tensorflow/compiler/tf2xla/kernels/cast_op.cc.)
    """
    return tf.squeeze(dequantize(tf.expand_dims(q, -1), scale, dtype), -1)


def _this_call_only(scale):
    """`scale` (> 0) as a value of this call alone: max(scale, -n), n new for each call.

    The value is `scale`; the constant makes the ops that depend on it differ from those
    of any other call. Needed for the input: under current scaling the projections that
    read the same tensor (q, k and v; gate and up) compute the same amax, scale and FP8
    bytes, CSE merged their quantizations, and the one `_dequantize_again` left fed
    several weight-gradient dots, which need not share its cluster (3 of the 14 backward
    dots of a llama block got a bf16 parameter on fsdp=8 under remat=full). The forward
    quantizes such an input once per projection instead, an elementwise pass each.
    Needed for the weight: under model.remat=full a projection's forward runs again in
    the backward pass, on an input made new by a data dependency on the output gradient
    (`tfllm.models.common.remat.after_gradient`) but on the same weight, so DTensor's CSE
    (_dequantize_again) merged the recomputed weight quantization into the first
    forward's, and the recomputed forward dot got its weight as a bf16 parameter of its
    cluster (6 of the 7 dots of each llama block on mesh data=1). A dependency on the input (its amax) would
    do too, but costs the delayed recipe an all-reduce before every forward dot.

    n counts the calls traced into the current graph: a program traced again, or by each
    client of a multi-client mesh, gets the same constants whatever else was traced.
    """
    calls = _CALLS.setdefault(tf.compat.v1.get_default_graph(), itertools.count(1))
    return tf.maximum(scale, -float(next(calls)))


def _einsum_gradient(equation: str, wrt: int, x, w, dy):
    """The gradient of einsum(equation, x, w) w.r.t. operand `wrt` (0: x, 1: w) for `dy`.

    The einsum is only recorded for its gradient (graphs and XLA drop it as dead code).
    """
    with tf.GradientTape() as tape:
        tape.watch((x, w)[wrt])
        y = tf.einsum(equation, x, w)
    return tape.gradient(y, (x, w)[wrt], output_gradients=dy)


def amax(x):
    return tf.reduce_max(tf.abs(tf.cast(x, tf.float32)))


def local_amax(x, keep=()):
    """max |x| (float32) over every dimension but `keep`: with the piece dimensions of a
    mesh block kept (`tfllm.parallel.blocks.Pieces`), one value per device and no
    collective; with none kept, `amax(x)`."""
    axes = [d for d in range(x.shape.rank) if d not in keep]
    return tf.reduce_max(tf.abs(tf.cast(x, tf.float32)), axis=axes)


class AmaxCollector:
    """The delayed recipe's amaxes of one training step, kept per device and reduced
    together when the step ends (see the module).

    `add` takes a history variable and an amax of one of its operands: a scalar, or a
    tensor of one value per batch piece (`local_amax`); `new_histories` gives each
    history rolled by the largest of its amaxes.
    """

    def __init__(self):
        self._partials: dict = {}  # id(variable) -> [amax tensors]

    def __bool__(self) -> bool:
        return bool(self._partials)

    def add(self, variable, partial) -> None:
        self._partials.setdefault(id(variable), []).append(partial)

    def amaxes(self, variables) -> list:
        """The step's amax (a float32 scalar) of each variable's operand, None for one
        that no einsum reported: one all-reduce per distinct partial shape (layout)."""
        groups: dict = {}  # shape -> [(index, local max of that variable's partials)]
        for i, v in enumerate(variables):
            by_shape: dict = {}
            for p in self._partials.get(id(v), ()):
                by_shape.setdefault(tuple(p.shape.as_list()), []).append(p)
            for shape, ps in by_shape.items():
                local = ps[0] if len(ps) == 1 else tf.reduce_max(tf.stack(ps), axis=0)
                groups.setdefault(shape, []).append((i, local))
        out = [None] * len(variables)
        for shape, members in groups.items():
            stacked = tf.stack([p for _, p in members], axis=-1)  # (*pieces, k)
            reduced = tf.reduce_max(stacked, axis=list(range(len(shape))))  # (k,)
            for k, (i, _) in enumerate(members):
                out[i] = reduced[k] if out[i] is None else tf.maximum(out[i], reduced[k])
        return out

    def new_histories(self, variables) -> list:
        """Each history rolled by its step's amax (kept as it was if none was reported)."""
        return [tf.convert_to_tensor(v) if a is None else roll_history(tf.convert_to_tensor(v), a)
                for v, a in zip(variables, self.amaxes(variables))]


_COLLECTING = threading.local()


@contextlib.contextmanager
def collecting_amaxes(collector: AmaxCollector):
    """Delayed-scaling einsums traced inside report their amaxes to `collector` (and
    give their histories no gradient) instead of reducing each one on its own."""
    previous = getattr(_COLLECTING, "collector", None)
    _COLLECTING.collector = collector
    try:
        yield collector
    finally:
        _COLLECTING.collector = previous


def roll_history(history, new_amax):
    """Shifts the history by one and puts `new_amax` first."""
    return tf.concat([tf.reshape(new_amax, [1]), history[:-1]], axis=0)


def fp8_einsum(equation: str, x, w, history_x, history_w, history_g, settings: Fp8Settings,
               w_amax=None, variables=None, piece_dims=None):
    """einsum(equation, x, w) with E4M3 operands and E5M2 output gradients.

    Args:
      equation: a two-operand einsum equation.
      x, w: the operands (any float dtype; the result has x's dtype).
      history_x, history_w, history_g: amax histories (float32, [history_length]).
      settings: the recipe.
      w_amax: the weight's amax when `w` arrived already quantized (an FP8 gather,
        `WeightCodec`): its values are FP8 values times 1/scale, so their own amax is
        clipped at the format's maximum and would hide a weight that outgrew its
        history; the gather carries the true one. None: amax(w).
      variables: the three history variables, which a step's `AmaxCollector` (delayed
        scaling inside `collecting_amaxes`) keys the amaxes by; None: not collected.
      piece_dims: ((dimensions of x and of the product), (dimensions of w)) that are a
        mesh block's batch pieces, one per device: collected amaxes keep them, so that
        they need no collective of their own.

    Returns:
      The product; its gradients w.r.t. the histories are their updated values, or None
      when the amaxes went to a collector.
    """
    delayed = settings.recipe == "delayed"
    collector = getattr(_COLLECTING, "collector", None)
    collector = collector if delayed and variables is not None else None
    keep_x, keep_w = piece_dims or ((), ())

    @tf.custom_gradient
    def op(x, w, history_x, history_w, history_g):
        dtype = x.dtype
        if collector is not None:  # per device; the step reduces them all at its end
            collector.add(variables[0], local_amax(x, keep_x))
            collector.add(variables[1], local_amax(w, keep_w) if w_amax is None
                          else tf.cast(w_amax, tf.float32))
        else:
            amax_x = amax(x)
            amax_w = amax(w) if w_amax is None else tf.cast(w_amax, tf.float32)
        if delayed:
            scale_x = history_scale(history_x, E4M3_MAX, settings.margin)
            scale_w = history_scale(history_w, E4M3_MAX, settings.margin)
        else:
            scale_x = scale_from_amax(amax_x, E4M3_MAX, settings.margin)
            scale_w = scale_from_amax(amax_w, E4M3_MAX, settings.margin)
        # Both scales are made this call's own (_this_call_only): under current scaling
        # the projections that read the same input (q, k, v; gate, up) compute the same
        # amax, scale and FP8 bytes, and CSE would merge their quantizations, so that
        # one dequantization in the backward fed several weight-gradient dots, which
        # need not share its cluster.
        scale_x, scale_w = _this_call_only(scale_x), _this_call_only(scale_w)
        x_q = quantize(x, scale_x, E4M3, E4M3_MAX)
        w_q = quantize(w, scale_w, E4M3, E4M3_MAX)
        y = tf.einsum(equation, dequantize(x_q, scale_x, dtype), dequantize(w_q, scale_w, dtype))
        if collector is None:
            new_history_x = roll_history(history_x, amax_x)
            new_history_w = roll_history(history_w, amax_w)

        def grad(dy):
            if collector is not None:
                collector.add(variables[2], local_amax(dy, keep_x))
            else:
                amax_g = amax(dy)
            if delayed:
                scale_g = history_scale(history_g, E5M2_MAX, settings.margin)
            else:
                scale_g = scale_from_amax(amax_g, E5M2_MAX, settings.margin)
            dy_q = quantize(dy, scale_g, E5M2, E5M2_MAX)
            # Straight-through: gradients of the dot on the dequantized FP8 operands.
            # Each gradient dot dequantizes its own two operands from the FP8 bytes
            # (_dequantize_again says why): dx from w and dy, dw from x and dy. dy gets
            # two chains because dx and dw need not share a cluster (on mesh data=1 the
            # dw dots of all projections form one cluster of their own, and a shared
            # dy dequantization reached them as a bf16 parameter).
            x_again = _dequantize_again(x_q, scale_x, dtype)
            w_again = _dequantize_again(w_q, scale_w, dtype)
            dx = _einsum_gradient(equation, 0, x_again, w_again,
                                  dequantize(dy_q, scale_g, dy.dtype))
            dw = _einsum_gradient(equation, 1, x_again, w_again,
                                  _dequantize_again(dy_q, scale_g, dy.dtype))
            if collector is not None:
                return tf.cast(dx, x.dtype), tf.cast(dw, w.dtype), None, None, None
            return (tf.cast(dx, x.dtype), tf.cast(dw, w.dtype), new_history_x, new_history_w,
                    roll_history(history_g, amax_g))

        return y, grad

    # Read variables here, outside the custom gradient: in eager mode a variable read
    # inside it would make TensorFlow ask grad() for variable gradients (a model called
    # outside tf.function failed with "grad_fn must accept keyword argument
    # 'variables'"). In graphs the reads happen at the same point either way.
    return op(*(tf.convert_to_tensor(t) for t in (x, w, history_x, history_w, history_g)))


# ---- FP8 weights on the wire ------------------------------------------------------------
# TensorFlow's Bitcast takes no float8 dtype, so an E4M3 value's byte is computed: every
# E4M3 value is exact in float32, its code is sign | exponent + 7 | 3 mantissa bits for
# normals (|v| >= 2**-6) and m for the subnormals m * 2**-9; 0x7f is NaN (there is no
# infinity in e4m3fn). FSDP moves two codes in one float16 carrier
# (`tfllm.parallel.fsdp.bytes_to_carriers`), which collectives copy bit for bit.
_E4M3_MIN_NORMAL = 2.0 ** -6


def e4m3_codes(q):
    """The byte (int32, 0..255) of each E4M3 value `q` (an E4M3 tensor)."""
    v = tf.cast(q, tf.float32)
    a = tf.abs(v)
    bits = tf.bitcast(a, tf.int32)
    exponent = tf.bitwise.right_shift(bits, 23) - 127
    mantissa = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 20), 7)
    normal = tf.bitwise.bitwise_or(tf.bitwise.left_shift(exponent + 7, 3), mantissa)
    sub = tf.cast(a * 512.0, tf.int32)
    code = tf.where(a >= _E4M3_MIN_NORMAL, normal, sub)
    code = tf.where(tf.math.is_nan(v), tf.fill(tf.shape(code), 127), code)
    sign = tf.bitwise.bitwise_and(tf.bitwise.right_shift(tf.bitcast(v, tf.int32), 31), 1)
    return tf.bitwise.bitwise_or(code, tf.bitwise.left_shift(sign, 7))


def e4m3_from_codes(codes):
    """The E4M3 values (as float32, exact) of bytes made by `e4m3_codes`."""
    c = tf.cast(codes, tf.int32)
    exponent = tf.bitwise.bitwise_and(tf.bitwise.right_shift(c, 3), 15)
    mantissa = tf.cast(tf.bitwise.bitwise_and(c, 7), tf.float32)
    # (8 + m) * 2**(e - 10); 2**(e - 10) built from its float32 exponent bits, exactly.
    power = tf.bitcast(tf.bitwise.left_shift(exponent + (127 - 10), 23), tf.float32)
    v = tf.where(exponent == 0, mantissa * (2.0 ** -9), (8.0 + mantissa) * power)
    v = tf.where(tf.bitwise.bitwise_and(c, 127) == 127, tf.fill(tf.shape(v), float("nan")), v)
    return tf.where(tf.bitwise.bitwise_and(c, 128) > 0, -v, v)


class WeightCodec:
    """How an FP8 projection's weight travels through FSDP's gathers: as E4M3 bytes.

    The weight is quantized on its shard, with the scale its `fp8_einsum` would use
    (`scale`), so the gather moves one byte per value where a bfloat16 gather moves two.
    `decode` gives the dequantized weight; the einsum quantizes it again with the same
    scale, which is exact (the relative rounding of `dequantize`, at most 3 * 2**-9, is
    far below half of E4M3's spacing, 2**-4), so its FP8 GEMMs are those of an ungathered
    weight. Gradients pass straight through, as they do for the einsum's quantization.

    Args:
      settings: the projection's `Fp8Settings`.
      history: its weight's amax history variable.
    """

    def __init__(self, settings: Fp8Settings, history):
        self.settings, self.history = settings, history

    @property
    def needs_amax(self) -> bool:
        """Whether the scale needs the weight's amax of this step (current scaling)."""
        return self.settings.recipe != "delayed"

    def scale(self, weight_amax=None):
        """The weight's E4M3 scale: from its history (delayed) or `weight_amax`."""
        if self.needs_amax:
            return scale_from_amax(weight_amax, E4M3_MAX, self.settings.margin)
        return history_scale(tf.convert_to_tensor(self.history), E4M3_MAX,
                             self.settings.margin)

    def encode(self, w, scale):
        """The bytes (int32 0..255) of `w` quantized to E4M3 with `scale`."""
        return e4m3_codes(quantize(w, scale, E4M3, E4M3_MAX))

    def decode(self, codes, scale, dtype):
        """The dequantized weight in `dtype` (as `dequantize` gives it)."""
        return dequantize(e4m3_from_codes(codes), scale, dtype)
