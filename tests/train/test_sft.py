"""SFT in the step: packed samples compute what they compute alone, and the masked loss is
the mean over the global batch's trained tokens however micro-batches and devices split it."""

import numpy as np
import pytest

from tests.harness import tiny_config
from tfllm.data import feed

LENGTHS = (5, 7, 4)  # three samples packed into one row of 17 tokens (16 + padding)


def packed_row(rng, vocab):
    samples = [rng.integers(1, vocab, n).astype(np.int32) for n in LENGTHS]
    tokens = np.zeros(17, np.int32)
    segments = np.zeros(17, np.int32)
    at = 0
    for s, sample in enumerate(samples, 1):
        tokens[at:at + len(sample)] = sample
        segments[at:at + len(sample)] = s
        at += len(sample)
    return samples, tokens, segments


@pytest.mark.parametrize("family", ["gpt", "llama", "gemma3"])
def test_packed_logits_and_losses_equal_unpacked(family):
    """Positions restart per sample and no sample attends to another: each sample's
    logits and per-token losses in the packed row are those of the sample alone."""
    import tensorflow as tf

    from tfllm.models.loss import token_nll
    from tfllm.train.state import build_train_state
    from tfllm.train.step import lm_forward
    cfg = tiny_config(family)
    model = build_train_state(cfg, None, False, optimizer=False).model
    samples, tokens, segments = packed_row(np.random.default_rng(0), cfg.model.vocab_size)
    mask = (segments > 0).astype(np.int32)
    mask[np.r_[0, np.cumsum(LENGTHS)[:-1]]] = 0  # a sample's first token: no target
    micro = tuple(tf.constant(a[None]) for a in (tokens, segments, mask))
    logits, targets, _ = lm_forward(model, micro, packing_mask=True)
    packed_nll = token_nll(logits, targets).numpy()[0]  # (16,)
    logits = logits.numpy()[0]
    at = 0
    for sample in samples:
        n = len(sample)
        alone = model(tf.constant(sample[None, :-1])).numpy()[0]  # (n - 1, V)
        alone_nll = token_nll(alone[None], tf.constant(sample[None, 1:])).numpy()[0]
        # float32 sums over different sequence lengths (masked keys add exact zeros):
        # rounding only
        np.testing.assert_allclose(logits[at:at + n - 1], alone, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(packed_nll[at:at + n - 1], alone_nll, rtol=1e-5,
                                   atol=1e-5)
        at += n


def chat_batch(rng, rows, vocab, length=17):
    """Token rows with uneven loss masks (rows train 1 to ~12 targets)."""
    tokens = rng.integers(1, vocab, (rows, length)).astype(np.int32)
    segments = np.ones((rows, length), np.int32)
    mask = np.zeros((rows, length), np.int32)
    for r in range(rows):
        start = rng.integers(1, length - 1)
        mask[r, start:start + rng.integers(1, 12)] = 1
    return tokens, segments, mask


def test_masked_loss_is_the_mean_over_trained_tokens_of_the_global_batch():
    """With 1, 2 and 4 micro-batches the loss and gradients are the same: the mean NLL
    over the trained targets of all 4 rows (not a mean of per-micro-batch means)."""
    from tfllm.models.loss import token_nll
    from tfllm.train.state import build_train_state
    from tfllm.train.step import lm_forward
    tokens, segments, mask = chat_batch(np.random.default_rng(1), 4, 128)
    results = []
    for accum in (1, 2, 4):
        cfg = tiny_config("gpt", **{"train.global_batch_size": 4,
                                    "train.grad_accum_steps": accum})
        step = build_train_state(cfg, None, False, packing_mask=True).step
        shape = (accum, 4 // accum, 17)
        batch = feed.to_device(None, tokens.reshape(shape), segments.reshape(shape),
                               mask.reshape(shape))
        results.append(step.loss_and_grads(batch))
        if accum == 1:
            logits, targets, _ = lm_forward(step.model, batch[0], True)
            nll = token_nll(logits, targets).numpy()
            want = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
    for loss, grads in results:
        # float32 sums in another order: rounding only
        assert loss == pytest.approx(want, rel=1e-6)
        for g, g0 in zip(grads, results[0][1]):
            np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mesh,extra", [
    ("data=2", {}),
    # full-parameter SFT on FSDP x tensor parallelism, and LoRA SFT on it
    pytest.param("fsdp=2,model=2", {}, marks=pytest.mark.slow),  # ~15-20 s each
    pytest.param("fsdp=2,model=2", {"lora.rank": 4}, marks=pytest.mark.slow),
])
def test_masked_step_on_a_mesh_equals_one_device(mesh, extra):
    """The loss mask is laid out as the tokens (DeviceFeed) and the loss normalised
    globally: a mesh with 2 micro-batches gives one device's loss and gradients."""
    from tfllm.parallel import make_parallel
    from tfllm.train.state import build_train_state
    tokens, segments, mask = chat_batch(np.random.default_rng(2), 4, 128)
    out = []
    for axes in (None, mesh):
        cfg = tiny_config("gpt", "data=1" if axes is None else axes,
                          **{"train.global_batch_size": 4, "train.grad_accum_steps": 2},
                          **extra)
        parallel = None if axes is None else make_parallel(cfg.mesh, cfg.model, cfg.optimizer)
        step = build_train_state(cfg, parallel, False, packing_mask=True).step
        shape = (2, 2, 17)
        out.append(step.loss_and_grads(feed.to_device(
            parallel, tokens.reshape(shape), segments.reshape(shape), mask.reshape(shape))))
    (loss, grads), (mesh_loss, mesh_grads) = out
    assert mesh_loss == pytest.approx(loss, rel=1e-6)  # float32 reduction order only
    for g, g0 in zip(mesh_grads, grads):
        np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-7)
