"""RoPE tables and blocked attention's causal masks are computed in the program, never
folded into constants (tfllm.models.common.masks.row_positions): llama-7b's one-layer
step at 4096 carried 33.6 MB of them per layer (12 (1, T, 1, D) float32 tables and 32
(512, 512) masks); now 0.07 MB of constants in all."""

import re

import numpy as np
import pytest
import tensorflow as tf

from tests.harness import tiny_config

LENGTH, CHUNK = 64, 16


def _constants(hlo: str):
    """(dtype, element count) of every array constant of an HLO module's text."""
    out = []
    for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\][^ ]* constant\(", hlo):
        out.append((dtype, int(np.prod([int(d) for d in dims.split(",") if d]))))
    return out


@pytest.mark.slow  # two XLA compiles of a training step
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_training_step_folds_no_rope_table_or_mask(family):
    from tfllm.models import build_model
    from tfllm.models.loss import token_nll
    cfg = tiny_config(family, **{"data.sequence_length": LENGTH,
                                 "model.max_sequence_length": LENGTH,
                                 "model.attention_chunk": CHUNK})
    model = build_model(cfg.model, cfg.precision, cfg.lora, seed=0)
    tokens = tf.constant(np.random.default_rng(0).integers(0, 128, (2, LENGTH + 1)),
                         tf.int32)

    @tf.function(jit_compile=True)
    def step(tokens):
        with tf.GradientTape() as tape:
            logits = model(tokens[:, :-1])
            loss = tf.reduce_mean(token_nll(logits, tokens[:, 1:]))
        return loss, tape.gradient(loss, model.trainable_variables)

    hlo = step.experimental_get_compiler_ir(tokens)(stage="hlo")
    head_dim = cfg.model.hidden_dim // cfg.model.num_query_heads
    table = LENGTH * head_dim  # elements of one RoPE table (T, D)
    tile = CHUNK * CHUNK  # elements of one diagonal tile's mask
    big = [c for c in _constants(hlo) if c[1] >= min(table, tile)]
    # Before: (1, T, 1, D) float32 tables (two per rotary call) and (1, 1, t, s) pred
    # masks (one per diagonal tile and pass). What may remain: the (T,) position iota.
    assert all(n <= LENGTH for _, n in big), big
    assert "cosine" in hlo and "sine" in hlo  # the tables are computed


def test_row_positions_are_the_positions_of_every_row():
    from tfllm.models.common.masks import row_positions
    ids = tf.constant([[5, 0, 7], [1, 2, 3]])
    np.testing.assert_array_equal(row_positions(ids), [[0, 1, 2], [0, 1, 2]])
    # a saved model's signature leaves the length unknown (tfllm export)
    traced = tf.function(row_positions, input_signature=[tf.TensorSpec((None, None), tf.int32)])
    np.testing.assert_array_equal(traced(ids), [[0, 1, 2], [0, 1, 2]])
