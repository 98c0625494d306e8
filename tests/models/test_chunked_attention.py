"""Blocked attention (`model.attention_chunk`: tiles of queries and keys, online softmax,
tfllm.models.common.flash) equals standard attention, with packing and sliding windows, on
a mesh and a split sequence, and leaves cached generation alone."""

import numpy as np
import pytest
import tensorflow as tf

from tfllm.data import feed
from tfllm.models import build_model
from tfllm.parallel import context, make_parallel
from tfllm.internals import collect_executed_graphs
from tfllm.compiler.costs import KINDS
from tests.harness import (assert_parity, forward_on_mesh, parity_reference, parity_run,
                           tiny_config)

# At most 6 queries per chunk over 16 tokens: three uneven chunks (5, 5, 6).
CHUNK = (("model.attention_chunk", 6),)
# The training parities below run one block (half the cost of two on 2 cores): blocked
# attention is within a block; FSDP's block schedule is tests/train/test_parity.py's.
ONE_BLOCK = (("model.num_layers", 1),)


def _model(family, chunk):
    cfg = tiny_config(family, **{"model.attention_chunk": chunk})
    return build_model(cfg.model, cfg.precision, cfg.lora)


def _tokens_and_segments(batch=2, length=16, seed=0):
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, 128, (batch, length)).astype("int32")
    segments = np.repeat(np.arange(4), length // 4)[None].repeat(batch, 0).astype("int32")
    return tokens, segments


# gemma3's tiny model has a local layer (window 5 of 16 tokens): windowed tiles are skipped.
@pytest.mark.parametrize("family", ["gpt", "llama", "gemma3"])
def test_chunked_forward_and_gradients_equal_standard(family):
    tokens, segments = _tokens_and_segments()
    results = []
    for chunk in (0, 6):
        model = _model(family, chunk)
        with tf.GradientTape() as tape:
            plain = model(tokens)
            packed = model(tokens, segment_ids=segments)
            loss = tf.reduce_sum(plain * plain) + tf.reduce_sum(packed)
        grads = tape.gradient(loss, model.trainable_variables)
        results.append((plain.numpy(), packed.numpy(), [g.numpy() if not isinstance(
            g, tf.IndexedSlices) else tf.convert_to_tensor(g).numpy() for g in grads]))
    (p0, k0, g0), (p1, k1, g1) = results
    # float32; the online softmax adds and rescales each row's terms tile by tile, in
    # another order than one softmax: a few ulps, 1e-6 of logits of magnitude ~1.
    np.testing.assert_allclose(p1, p0, atol=1e-6, rtol=0)
    np.testing.assert_allclose(k1, k0, atol=1e-6, rtol=0)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, np.abs(b).max()), rtol=0)


@pytest.mark.slow
def test_chunked_training_on_a_mesh_matches_single_device():
    run = parity_run("llama", "data=2,model=4", False, CHUNK + ONE_BLOCK)
    assert_parity(run, parity_reference("llama", False, ONE_BLOCK))
    assert run["model"].blocks[0].attention.block_size == 6


def test_cached_generation_is_unchanged():
    from tfllm.generate import Generator
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    out = [Generator(_model("llama", chunk), None, jit_compile=False).generate(prompt, 6)
           for chunk in (0, 6)]
    assert [int(t) for t in out[0]] == [int(t) for t in out[1]]


# data=2,fsdp=4 splits the rows over data and the 16-token sequence over fsdp into 4
# pieces of 4 queries; chunks of 2 are cut inside every piece (two per piece).
HYBRID, PIECE_CHUNK = "data=2,fsdp=4", (("model.attention_chunk", 2),)


@pytest.mark.slow
def test_chunked_training_on_a_split_sequence_matches_single_device():
    run = parity_run("llama", HYBRID, False, PIECE_CHUNK + ONE_BLOCK)
    assert_parity(run, parity_reference("llama", False, ONE_BLOCK))


def _hybrid_model(chunk):
    cfg = tiny_config("llama", HYBRID, **{"model.attention_chunk": chunk})
    parallel = make_parallel(cfg.mesh, cfg.model, cfg.optimizer)
    return build_model(cfg.model, cfg.precision, cfg.lora, parallel=parallel), parallel


@pytest.mark.slow
def test_chunked_packing_on_a_split_sequence_under_jit():
    tokens, segments = _tokens_and_segments(batch=4, length=12, seed=3)  # pieces of 3
    segments[1, 5:] = 9  # rows split differently
    want = _model("llama", 0)(tokens, segment_ids=segments).numpy()
    model, parallel = _hybrid_model(2)
    got = forward_on_mesh(model, parallel, tokens, segments)
    np.testing.assert_allclose(got, want, atol=1e-5)  # sharded float32 sums, logits O(1)


def _forward_collectives(chunk):
    """Collective ops of one forward pass on the split-sequence mesh."""
    model, parallel = _hybrid_model(chunk)
    tokens, _ = _tokens_and_segments(batch=2, length=16)
    tokens = feed.place(parallel, tokens)

    @tf.function
    def forward(t):
        with context.use(parallel):
            return model(t)

    with collect_executed_graphs() as graphs:
        forward(tokens)
    return sum(n.op in KINDS for g in graphs() for n in g.node)


@pytest.mark.slow
def test_chunks_do_not_gather_the_queries():
    # Slicing a chunk out of the split sequence directly would all-gather the queries
    # (DTensor relayouts a sliced sharded dimension: one more collective per chunk);
    # folding keeps every chunk local, so the chunked forward pass communicates exactly
    # what the standard one does. (Backward, DTensor all-reduces each chunk's key/value
    # gradient separately: see docs/precision.md, "Blocked attention".)
    assert _forward_collectives(2) == _forward_collectives(0) > 0
