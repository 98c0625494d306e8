"""Sampling functions on hand-made logits."""

import numpy as np
import tensorflow as tf

from tfllm.generate.sampling import counter_uniform, filter_logits, next_token

LOGITS = tf.math.log(tf.constant([[0.5, 0.2, 0.15, 0.1, 0.05]]))  # probabilities


def _kept(filtered):
    return np.isfinite(filtered.numpy()[0]).tolist()


def test_top_k_and_top_p_keep_the_right_tokens():
    assert _kept(filter_logits(LOGITS, top_k=tf.constant(2))) == [True, True] + [False] * 3
    # Nucleus 0.8: 0.5 + 0.2 = 0.7 < 0.8, so the third token (reaching 0.85) is kept too.
    assert _kept(filter_logits(LOGITS, top_p=tf.constant(0.8))) == [True] * 3 + [False] * 2
    assert _kept(filter_logits(LOGITS, top_p=tf.constant(0.5))) == [True] + [False] * 4
    assert _kept(filter_logits(LOGITS, top_p=tf.constant(1e-9))) == [True] + [False] * 4
    # top-p on the renormalized top-3 (0.59, 0.24, 0.18): 0.59 + 0.24 >= 0.8 keeps 2.
    both = filter_logits(LOGITS, top_k=tf.constant(3), top_p=tf.constant(0.8))
    assert _kept(both) == [True, True] + [False] * 3


def test_sampled_frequencies_follow_the_distribution():
    logits = tf.tile(LOGITS, [4000, 1])  # 4000 rows: independent draws
    tokens = next_token(logits, tf.constant(0), tf.constant(0), tf.constant(1.0)).numpy()
    freq = np.bincount(tokens, minlength=5) / len(tokens)
    # Binomial standard error at n=4000 is <= 0.008: 0.03 is ~4 sigma.
    np.testing.assert_allclose(freq, [0.5, 0.2, 0.15, 0.1, 0.05], atol=0.03)
    assert next_token(LOGITS, 0, 0).numpy().tolist() == [0]  # greedy


def test_counter_noise_is_uniform_and_independent_of_batch_size():
    u = counter_uniform(64, 1000, tf.constant(7), tf.constant(3)).numpy()
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.01 and abs(u.std() - 12 ** -0.5) < 0.01
    np.testing.assert_array_equal(counter_uniform(2, 1000, 7, 3).numpy(), u[:2])
    assert not np.array_equal(counter_uniform(2, 1000, 7, 4).numpy(), u[:2])
