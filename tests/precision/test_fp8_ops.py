"""FP8 ops: numerics against float64, scaling recipes, saturation, zero handling."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfllm.precision import fp8
from tfllm.precision.fp8 import (E4M3, E4M3_MAX, E5M2, E5M2_MAX, Fp8Settings, fp8_einsum,
                                 quantize, roll_history, scale_from_amax)

# Error bounds from the formats. Round-to-nearest into a format with p explicit mantissa
# bits has relative error <= 2**-(p+1) for values in its normal range: E4M3 (p=3) 1/16,
# E5M2 (p=2) 1/8. A product of two rounded operands is off by <= (1+u)^2 - 1 ~ 2u
# relative, so |einsum(q(x), q(w)) - einsum(x, w)| <= 2u * einsum(|x|, |w|), plus the
# float32 accumulation (negligible). Values far below amax fall into the subnormal range
# and carry an absolute error instead: at most half the smallest subnormal (2**-10 for
# E4M3, 2**-17 for E5M2) divided by the scale; the bounds add it per product term.
U_E4M3, U_E5M2 = 2.0 ** -4, 2.0 ** -3
SUBNORMAL_HALF = {E4M3: 2.0 ** -10, E5M2: 2.0 ** -17}
EQUATIONS = [("btd,df->btf", (2, 5, 16), (16, 12)),
             ("btd,dhk->bthk", (2, 5, 16), (16, 3, 4)),
             ("bthk,hkd->btd", (2, 5, 3, 4), (3, 4, 16))]


def _hist(n=4):
    return tf.zeros([n], tf.float32)


def test_saturating_cast_never_gives_nan():
    x = tf.constant([1.0, 500.0, -1e6, 3e38])
    for dtype, fmax in ((E4M3, E4M3_MAX), (E5M2, E5M2_MAX)):
        q = tf.cast(quantize(x, tf.constant(1.0), dtype, fmax), tf.float32).numpy()
        assert np.all(np.isfinite(q))
        assert q[2] == -fmax and q[3] == fmax
    # TensorFlow's own cast is not saturating: that is why quantize clips first.
    assert np.isnan(tf.cast(tf.cast(tf.constant([500.0]), E4M3), tf.float32).numpy()[0])


def test_zero_tensor_gets_scale_one():
    assert float(scale_from_amax(tf.constant(0.0), E4M3_MAX)) == 1.0
    assert float(scale_from_amax(tf.constant(float("inf")), E4M3_MAX)) == 1.0
    assert float(scale_from_amax(tf.constant(2.0), E4M3_MAX, margin=1)) == E4M3_MAX / 4
    zeros = tf.zeros((2, 5, 16))
    y = fp8_einsum("btd,df->btf", zeros, tf.ones((16, 4)), _hist(), _hist(), _hist(),
                   Fp8Settings("current"))
    assert np.all(y.numpy() == 0)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
@pytest.mark.parametrize("equation, x_shape, w_shape", EQUATIONS)
def test_forward_and_gradients_within_format_bounds(recipe, equation, x_shape, w_shape):
    rng = np.random.default_rng(0)
    x64 = rng.normal(size=x_shape)
    w64 = rng.normal(size=w_shape) * 0.05
    x, w = tf.constant(x64, tf.float32), tf.constant(w64, tf.float32)
    settings = Fp8Settings(recipe, history_length=4)
    # Delayed scaling with a history that holds this step's amax gives the same scales.
    hx = tf.constant([np.abs(x64).max(), 0, 0, 0], tf.float32)
    hw = tf.constant([np.abs(w64).max(), 0, 0, 0], tf.float32)
    dy64 = rng.normal(size=np.einsum(equation, x64, w64).shape) * 1e-3
    hg = tf.constant([np.abs(dy64).max(), 0, 0, 0], tf.float32)
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = fp8_einsum(equation, x, w, hx, hw, hg, settings)
    dx, dw = tape.gradient(y, [x, w], output_gradients=tf.constant(dy64, tf.float32))

    want = np.einsum(equation, x64, w64)
    terms = np.einsum(equation, np.abs(x64), np.abs(w64))
    n_terms = np.prod([s for s, c in zip(x_shape, equation.split(",")[0])
                       if c not in equation.split("->")[1]])
    sub = SUBNORMAL_HALF[E4M3] * (np.abs(x64).max() / E4M3_MAX + np.abs(w64).max() / E4M3_MAX)
    assert np.all(np.abs(y.numpy() - want) <= 2 * U_E4M3 * terms + n_terms * sub + 1e-6)

    # Gradients: dy rounded to E5M2 and x, w to E4M3 -> u_E5M2 + u_E4M3 relative per term.
    in_x, in_w = equation.split("->")[0].split(",")
    out = equation.split("->")[1]
    want_dx = np.einsum(f"{out},{in_w}->{in_x}", dy64, w64)
    want_dw = np.einsum(f"{in_x},{out}->{in_w}", x64, dy64)
    bound_dx = (U_E5M2 + U_E4M3 + 1e-3) * np.einsum(f"{out},{in_w}->{in_x}", np.abs(dy64),
                                                    np.abs(w64))
    bound_dw = (U_E5M2 + U_E4M3 + 1e-3) * np.einsum(f"{in_x},{out}->{in_w}", np.abs(x64),
                                                    np.abs(dy64))
    sub_g = SUBNORMAL_HALF[E5M2] * np.abs(dy64).max() / E5M2_MAX * n_terms
    assert np.all(np.abs(dx.numpy() - want_dx) <= bound_dx + 4 * sub_g + 1e-9)
    assert np.all(np.abs(dw.numpy() - want_dw) <= bound_dw + 4 * sub_g + 1e-9)
    # And FP8 really is in effect: the result is not the float32 product.
    assert np.abs(y.numpy() - want).max() > 1e-5


def test_delayed_scaling_uses_history_and_returns_rolled_histories():
    x = tf.constant(np.full((1, 1, 4), 2.0), tf.float32)
    w = tf.constant(np.full((4, 2), 0.5), tf.float32)
    hx = tf.constant([1.0, 8.0, 0.0], tf.float32)  # the largest past amax is 8
    hw, hg = tf.constant([0.5, 0.0, 0.0]), tf.constant([0.0, 0.0, 0.0])
    with tf.GradientTape() as tape:
        tape.watch([hx, hw, hg])
        y = fp8_einsum("btd,df->btf", x, w, hx, hw, hg, Fp8Settings("delayed", 3, margin=1))
    new_hx, new_hw, new_hg = tape.gradient(y, [hx, hw, hg],
                                           output_gradients=tf.fill(y.shape, 3.0))
    np.testing.assert_array_equal(new_hx, [2.0, 1.0, 8.0])  # this amax first, oldest dropped
    np.testing.assert_array_equal(new_hw, [0.5, 0.5, 0.0])
    np.testing.assert_array_equal(new_hg, [3.0, 0.0, 0.0])
    # x = 2 scaled by 448 / (8 * 2): 56 is exact in E4M3, so the product is exact.
    np.testing.assert_allclose(y.numpy(), np.full((1, 1, 2), 4.0))


def test_variables_work_outside_tf_function():
    # A layer passes its kernel and amax histories as variables; eagerly (a model called
    # outside tf.function) that used to fail inside tf.custom_gradient.
    w = keras.Variable(np.full((4, 2), 0.5), dtype="float32")
    hx, hw, hg = (keras.Variable([1.0, 8.0, 0.0]), keras.Variable([0.5, 0.0, 0.0]),
                  keras.Variable([0.0, 0.0, 0.0]))
    x = tf.constant(np.full((1, 1, 4), 2.0), tf.float32)
    with tf.GradientTape() as tape:
        y = fp8_einsum("btd,df->btf", x, w, hx, hw, hg, Fp8Settings("delayed", 3, margin=1))
    dw, new_hx = tape.gradient(y, [w.value, hx.value], output_gradients=tf.fill(y.shape, 3.0))
    np.testing.assert_allclose(y.numpy(), np.full((1, 1, 2), 4.0))  # as with tensors above
    np.testing.assert_array_equal(new_hx, [2.0, 1.0, 8.0])
    assert dw.shape == (4, 2)


def test_roll_history():
    np.testing.assert_array_equal(roll_history(tf.constant([3.0, 2.0, 1.0]), 9.0), [9, 3, 2])


def test_every_e4m3_value_travels_as_its_byte_and_back():
    """FSDP's FP8 gathers move E4M3 bytes computed from values (TensorFlow's Bitcast takes
    no FP8): every one of the 256 codes, both NaNs and -0 included, must come back."""
    import ml_dtypes

    from tfllm.parallel import fsdp
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    q = tf.cast(tf.constant(values), fp8.E4M3)
    got = fp8.e4m3_codes(q).numpy()
    np.testing.assert_array_equal(got, codes.astype(np.int32))
    back = fp8.e4m3_from_codes(got).numpy()
    np.testing.assert_array_equal(back, values)  # NaN == NaN for assert_array_equal
    np.testing.assert_array_equal(np.signbit(back), np.signbit(values))
    carriers = fsdp.bytes_to_carriers(tf.constant(got.reshape(4, 64)))
    assert carriers.dtype == tf.float16 and carriers.shape == (4, 32)
    np.testing.assert_array_equal(fsdp.carriers_to_bytes(carriers).numpy().ravel(), got)
    amax = tf.constant([[0.0, 1e-30, 3.5e38], [-2.0, float("inf"), 448.0]], tf.float32)
    np.testing.assert_array_equal(
        fsdp.carriers_to_float32(fsdp.float32_to_carriers(amax)).numpy(), amax.numpy())


def test_a_weight_codec_round_trip_is_what_the_einsum_quantizes():
    """Decoding a gathered weight and quantizing it again with the same scale gives the
    same FP8 values (so FP8 gathers change bytes, not numbers)."""
    settings = fp8.Fp8Settings(recipe="current")
    codec = fp8.WeightCodec(settings, None)
    w = tf.constant(np.random.default_rng(0).normal(0, 0.05, (64, 96)), tf.bfloat16)
    scale = codec.scale(fp8.amax(w))
    dequantized = codec.decode(codec.encode(w, scale), scale, tf.bfloat16)
    direct = fp8.quantize(w, scale, fp8.E4M3, fp8.E4M3_MAX)
    again = fp8.quantize(dequantized, scale, fp8.E4M3, fp8.E4M3_MAX)
    np.testing.assert_array_equal(tf.cast(again, tf.float32).numpy(),
                                  tf.cast(direct, tf.float32).numpy())
