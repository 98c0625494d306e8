"""Packed documents (segment_ids), the KV-cache forward and the evaluation loss helpers."""

import numpy as np
import pytest
import tensorflow as tf

from tfllm.models import build_model, loss_sum_and_count, packed_target_mask
from tfllm.models.common import segment_mask_and_positions
from tfllm.parallel import make_parallel
from tests.harness import forward_on_mesh, sections, tiny_config

# Same weights, same tokens; only the shapes of the matmuls and reductions differ
# (a 12-token row against a 5- or 7-token one), so float32 rounding: logits are O(1).
ATOL = 1e-5


def _docs(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 128, 5), rng.integers(0, 128, 7)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_packed_documents_equal_separate_documents(family):
    model = build_model(*sections(tiny_config(family)))
    a, b = _docs()
    row = tf.constant([np.concatenate([a, b])], tf.int32)  # (1, 12)
    segments = tf.constant([[1] * 5 + [2] * 7], tf.int32)
    packed = model(row, segment_ids=segments).numpy()
    alone_a = model(tf.constant([a], tf.int32)).numpy()
    alone_b = model(tf.constant([b], tf.int32)).numpy()
    np.testing.assert_allclose(packed[:, :5], alone_a, atol=ATOL)
    # The second document starts again at position 0 and does not see the first one.
    np.testing.assert_allclose(packed[:, 5:], alone_b, atol=ATOL)
    # Without segment ids the second document does see the first: the test has teeth.
    assert np.abs(model(row).numpy()[:, 5:] - alone_b).max() > 1e-2


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_one_segment_is_the_plain_causal_model(family):
    model = build_model(*sections(tiny_config(family)))
    tokens = tf.constant(np.random.default_rng(1).integers(0, 128, (2, 9)), tf.int32)
    np.testing.assert_allclose(model(tokens, segment_ids=tf.ones((2, 9), tf.int32)).numpy(),
                               model(tokens).numpy(), atol=ATOL)


def test_segment_positions_restart_at_each_document():
    mask, positions = segment_mask_and_positions(tf.constant([[1, 1, 1, 2, 2, 0, 0]]))
    assert positions.numpy().tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert mask.numpy()[0, 4].tolist() == [False, False, False, True, True, False, False]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_cached_forward_equals_full_forward(family):
    model = build_model(*sections(tiny_config(family)))
    tokens = tf.constant(np.random.default_rng(2).integers(0, 128, (2, 10)), tf.int32)
    full = model(tokens).numpy()
    cache = model.init_cache(2, 12)
    logits, cache = model.call_with_cache(tokens[:, :6], cache, 0)  # prefill 6 tokens
    steps = [logits.numpy()]
    for i in range(6, 10):  # then one token at a time
        logits, cache = model.call_with_cache(tokens[:, i:i + 1], cache, i)
        steps.append(logits.numpy())
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=ATOL)


@pytest.mark.parametrize("family, axes", [("gpt", "data=2,model=4"),
                                          ("llama", "data=2,fsdp=2,model=2")])
def test_packing_on_a_mesh_under_jit(family, axes):
    ref_model = build_model(*sections(tiny_config(family)))
    cfg = tiny_config(family, axes)
    parallel = make_parallel(cfg.mesh, cfg.model, cfg.optimizer)
    model = build_model(*sections(cfg), parallel=parallel)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 128, (4, 12)).astype(np.int32)
    segments = np.repeat(np.array([[1] * 4 + [2] * 5 + [3] * 3]), 4, axis=0).astype(np.int32)
    segments[1] = [1] * 12  # rows split differently
    segments[2, 7:] = 2
    got = forward_on_mesh(model, parallel, tokens, segments)
    want = ref_model(tf.constant(tokens), segment_ids=tf.constant(segments)).numpy()
    np.testing.assert_allclose(got, want, atol=ATOL)  # sharded sums: float32 rounding


def test_loss_sum_and_count_combine_to_the_mean_loss():
    model = build_model(*sections(tiny_config("gpt")))
    rng = np.random.default_rng(4)
    tokens = tf.constant(rng.integers(0, 128, (2, 9)), tf.int32)
    segments = tf.constant([[1, 1, 1, 2, 2, 2, 2, 0, 0], [1] * 9], tf.int32)
    mask = packed_target_mask(segments)
    # Input->target pairs across a document boundary or into padding do not count.
    assert mask.numpy().tolist() == [[1, 1, 0, 1, 1, 1, 0, 0], [1] * 8]
    logits = model(tokens[:, :-1], segment_ids=segments[:, :-1])
    total, count = loss_sum_and_count(logits, tokens[:, 1:], mask)
    assert float(count) == 13
    mean = model.compute_lm_loss(logits, tokens[:, 1:], mask)
    np.testing.assert_allclose(float(total) / float(count), float(mean), rtol=1e-6)
    total, count = loss_sum_and_count(logits, tokens[:, 1:])
    np.testing.assert_allclose(float(total) / float(count),
                               float(model.compute_lm_loss(logits, tokens[:, 1:])), rtol=1e-6)
