"""Delayed scaling's amaxes, collected per device and reduced once per step
(tfllm.precision.fp8.AmaxCollector): the same histories as one reduction per operand,
with no scalar all-reduce per block on a mesh."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfllm.precision import fp8
from tfllm.precision.fp8 import AmaxCollector, Fp8Settings, collecting_amaxes, fp8_einsum


def test_a_collector_reduces_each_variables_partials_to_its_largest():
    a, b, c = (keras.Variable(np.array([1.0, 2.0, 3.0], np.float32)) for _ in range(3))
    amaxes = AmaxCollector()
    assert not amaxes
    amaxes.add(a, tf.constant([0.5, 4.0]))  # one value per piece
    amaxes.add(a, tf.constant([7.0, 1.0]))  # the same operand again (a recomputation)
    amaxes.add(a, tf.constant(6.0))  # a scalar (a weight's amax from its gather)
    amaxes.add(b, tf.constant([0.25, 0.0]))
    got = amaxes.amaxes([a, b, c])
    assert float(got[0]) == 7.0 and float(got[1]) == 0.25 and got[2] is None
    new = amaxes.new_histories([a, b, c])
    np.testing.assert_array_equal(new[0], [7.0, 1.0, 2.0])  # rolled, this step's first
    np.testing.assert_array_equal(new[1], [0.25, 1.0, 2.0])
    np.testing.assert_array_equal(new[2], [1.0, 2.0, 3.0])  # not reported: kept


@pytest.mark.parametrize("piece_dims", [None, ((0,), (0,))])
def test_collected_histories_are_those_the_gradients_give(piece_dims):
    # The example of test_fp8_ops' delayed-scaling test, split into two pieces along the
    # batch, with each piece's amax kept apart when piece_dims names them.
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(2, 3, 4)), tf.float32)
    w = tf.constant(rng.normal(size=(4, 5)), tf.float32)
    eq = "btd,df->btf"
    if piece_dims is not None:  # as tfllm.parallel.blocks runs it: (pieces, B/pieces, ...)
        x, w, eq = tf.reshape(x, (2, 1, 3, 4)), tf.stack([w, w]), "pbtd,pdf->pbtf"
    histories = [keras.Variable(np.array([1.0, 8.0, 0.0], np.float32)) for _ in range(3)]
    settings = Fp8Settings("delayed", 3, margin=1)
    dy = tf.constant(rng.normal(size=(2, 1, 3, 5) if piece_dims else (2, 3, 5)), tf.float32)

    def run(collect):
        amaxes = AmaxCollector()
        scope = collecting_amaxes(amaxes) if collect else contextlib.nullcontext()
        handles = [h.value for h in histories]
        with scope, tf.GradientTape() as tape:
            tape.watch([x, *handles])
            y = fp8_einsum(eq, x, w, *histories, settings, variables=histories,
                           piece_dims=piece_dims)
        dx, *new = tape.gradient(y, [x, *handles], output_gradients=dy)
        return y, dx, (amaxes.new_histories(histories) if collect else new), new

    y0, dx0, want, _ = run(False)
    y1, dx1, got, grads = run(True)
    assert grads == [None, None, None]  # the collector has them, not the gradients
    np.testing.assert_array_equal(y1, y0)  # the same scales: the same values
    np.testing.assert_array_equal(dx1, dx0)
    for g, w_ in zip(got, want):
        np.testing.assert_array_equal(g, w_)
    assert float(got[0][0]) == float(np.abs(x).max())


def test_current_scaling_and_calls_without_variables_are_not_collected():
    x, w = tf.ones((1, 2, 4)), tf.ones((4, 3))
    histories = [keras.Variable(np.zeros(3, np.float32)) for _ in range(3)]
    amaxes = AmaxCollector()
    with collecting_amaxes(amaxes):
        fp8_einsum("btd,df->btf", x, w, *histories, Fp8Settings("current", 3),
                   variables=histories)  # current scaling needs its amax at once
        fp8_einsum("btd,df->btf", x, w, *histories, Fp8Settings("delayed", 3))
    assert not amaxes


@pytest.mark.slow  # two 3-step runs on a mesh
def test_a_mesh_step_collects_the_same_histories_and_values():
    # fsdp=4, delayed scaling, FP8 gathers on (the weight's amax arrives with its gather)
    # and off (each piece's weight copy gives its own): the collector against one
    # reduction per operand, the path `collecting_amaxes` replaces. A max is exact in
    # any order and the scales come from the same histories, so every value is equal.
    from tests.harness import parity_run
    for gather in (True, False):
        settings = (("precision.policy", "fp8"), ("precision.fp8_recipe", "delayed"),
                    ("precision.fp8_gather", gather), ("model.num_layers", 1))
        runs = {}
        for collect in (True, False):
            with contextlib.ExitStack() as stack:
                if not collect:
                    from unittest import mock
                    stack.enter_context(mock.patch.object(
                        fp8, "collecting_amaxes", lambda c: contextlib.nullcontext(c)))
                runs[collect] = parity_run("llama", "fsdp=4", False, settings, grads=False)
        on, off = runs[True], runs[False]
        hist = lambda r: {v.path: np.asarray(v.numpy())  # noqa: E731
                          for v in r["model"].fp8_state_variables()}
        h_on, h_off = hist(on), hist(off)
        assert h_on.keys() == h_off.keys() and all(h.any() for h in h_on.values())
        for path, h in h_off.items():
            np.testing.assert_array_equal(h_on[path], h, err_msg=path)
        for a, b in zip(on["history"], off["history"]):
            assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
        for path, w in off["weights"].items():
            np.testing.assert_array_equal(on["weights"][path], w, err_msg=path)
