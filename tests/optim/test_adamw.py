"""tfllm's AdamW against a float64 numpy reference on one device, and its schedule."""

import numpy as np
import pytest
import tensorflow as tf

from tfllm.config import load_config
from tfllm.optim import AdamW, warmup_cosine


class _Var:
    """A stand-in for a Keras variable: a tf.Variable plus tfllm's `kind` tag."""

    def __init__(self, value, kind, name):
        self.value = tf.Variable(value, dtype=tf.float32, name=name)
        self.kind, self.name, self.shape = kind, name, value.shape

    def assign(self, x):
        self.value.assign(x)


def _reference(params, grads_per_step, c, lrs, decays):
    """Textbook AdamW (Loshchilov & Hutter) with global-norm clipping, in float64."""
    params = [p.astype(np.float64) for p in params]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for t, (grads, lr) in enumerate(zip(grads_per_step, lrs), start=1):
        norm = np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads))
        scale = min(1.0, c.clip_norm / max(norm, 1e-6)) if c.clip_norm else 1.0
        for i, g in enumerate(grads):
            g = g.astype(np.float64) * scale
            m[i] = c.beta1 * m[i] + (1 - c.beta1) * g
            v[i] = c.beta2 * v[i] + (1 - c.beta2) * g * g
            update = (m[i] / (1 - c.beta1 ** t)) / (np.sqrt(v[i] / (1 - c.beta2 ** t)) + c.epsilon)
            if decays[i]:
                update = update + c.weight_decay * params[i]
            params[i] = params[i] - lr * update
    return params


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_adamw_matches_float64_reference(clip):
    c = load_config(None, [f"optimizer.clip_norm={clip}", "optimizer.warmup_steps=2",
                           "optimizer.learning_rate=0.1", "optimizer.weight_decay=0.3"]).optimizer
    rng = np.random.default_rng(0)
    kinds = ["kernel", "bias", "norm", "embedding", "kernel"]
    init = [rng.normal(size=(4, 3)).astype(np.float32) for _ in kinds]
    variables = [_Var(x, k, f"v{i}") for i, (x, k) in enumerate(zip(init, kinds))]
    opt = AdamW(c, total_steps=6)
    opt.build(variables)
    grads = [[rng.normal(size=(4, 3)).astype(np.float32) for _ in kinds] for _ in range(6)]
    apply = tf.function(lambda gs: opt.apply(gs))
    lrs, norms = [], []
    for step_grads in grads:
        norm, lr = apply([tf.constant(g) for g in step_grads])
        lrs.append(float(lr))
        norms.append(float(norm))
    decays = [k == "kernel" for k in kinds]  # default exclusions: bias, norm, embedding
    want = _reference(init, grads, c, lrs, decays)
    # float32 arithmetic against float64: 6 steps of O(1) updates, each with relative
    # rounding ~1e-7; lr 0.1 -> absolute error well under 1e-5.
    for var, w in zip(variables, want):
        np.testing.assert_allclose(var.value.numpy(), w, atol=1e-5)
    np.testing.assert_allclose(norms[0], np.sqrt(sum((g ** 2).sum() for g in grads[0])),
                               rtol=1e-6)
    assert int(opt.iterations.numpy()) == 6
    # Excluded kinds really are not decayed: with zero gradients only decay would move them.
    assert [opt.decays(v) for v in variables] == decays


def test_warmup_cosine_schedule():
    lr = lambda s: float(warmup_cosine(s, 1.0, 10, 100, 0.1))
    assert lr(1) == pytest.approx(0.1) and lr(10) == pytest.approx(1.0)
    assert lr(60) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-6)  # halfway through the decay
    assert lr(110) == pytest.approx(0.1) and lr(500) == pytest.approx(0.1)
    assert float(warmup_cosine(5, 2.0, 0, 0, 0.1)) == pytest.approx(2.0)  # constant
    values = [lr(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone decay
