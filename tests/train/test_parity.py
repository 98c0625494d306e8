"""The core test: sharded training equals a single-device float32 reference.

For each mesh shape, model family and jit setting (graphs, or XLA clusters of each
device's program, checked from the executed graphs), on 8 logical CPU devices: the loss
and the gathered gradients of one batch, then the losses, gradient norms and all
weights after 3 AdamW steps, against the same model on one device without DTensor.
Initial weights are bit-identical by construction (tfllm.parallel.init), so every
difference comes from sharded reductions summing in another order.
"""

import functools
import os

import numpy as np
import pytest

from tfllm.config import load_config
from tfllm.data import SyntheticTokens
from tfllm.parallel import make_parallel
from tfllm.parallel.placement import to_numpy
from tfllm.train.state import build_train_state
from tests.conftest import run_in_child, tiny_overrides

MESHES = ["data=8", "fsdp=8", "model=8", "data=2,model=4", "data=2,fsdp=2,model=2", "data=2,fsdp=4"]
STEPS = 3

# Tolerances. float32 has a unit roundoff of 6e-8; a sharded run reorders sums of at
# most a few thousand terms (hidden 64 x batch 16 x length 16), whose rounding error
# grows like sqrt(n) * eps relative to the summed magnitudes: about 1e-6 relative.
# Losses are means of well-conditioned positives: rtol 1e-5 leaves a 10x margin.
LOSS_RTOL = 1e-5
# Gradients: entries near zero carry absolute, not relative, error, so the absolute
# tolerance is 1e-5 of the largest gradient entry of that variable (10x the estimate),
# floored at 1e-6 of the largest entry of any variable: some gradients are zero in exact
# arithmetic (the key bias: softmax ignores a shift shared by all keys) and are pure
# rounding noise of the terms that cancel, which are of the model's gradient scale.
GRAD_RTOL, GRAD_ATOL_FRACTION, GRAD_ATOL_FLOOR = 1e-4, 1e-5, 1e-6
# Weights after 3 steps: AdamW's update m / (sqrt(v) + eps) is scale-free, so a gradient
# entry that is zero up to rounding (key biases; ~1e-11 here) becomes an O(lr) update
# of random sign when eps is far below it: the default eps = 1e-8 turns 1e-11 noise into
# 1e-3 * lr. The parity runs therefore use eps = 1e-6, still 1000x below the gradient
# entries that matter (~1e-3), so it changes no real update but keeps rounding noise at
# <= 1e-5 * lr. For the other entries the update inherits the gradient's 1e-4 relative
# error: 3 steps x lr (1e-2) x 1e-4 x |update| (<= ~3 with bias correction) < 1e-5.
WEIGHT_ATOL = 2e-5
PARITY_SETTINGS = (("optimizer.epsilon", 1e-6),)


def _run(family, axes, jit, extra=()):
    single = axes is None
    overrides = dict(PARITY_SETTINGS + tuple(extra))
    cfg = load_config(None, tiny_overrides(family, "data=1" if single else axes, **overrides))
    parallel = None if single else make_parallel(cfg)
    state = build_train_state(cfg, parallel, jit)  # what `tfllm train` builds
    model, optimizer, step = state.model, state.optimizer, state.step
    data = SyntheticTokens(cfg.model.vocab_size, cfg.data.sequence_length + 1, seed=7)
    t = cfg.train
    batch = lambda i: step.to_device(data.batch(i, t.global_batch_size, t.grad_accum_steps))
    loss, grads = step.loss_and_grads(batch(0))
    history = [step(batch(i)) for i in range(STEPS)]
    if jit and not single:
        # XLA really compiled the step on every device (not only the flag was passed).
        report = step.xla_report
        assert report.clusters >= 1 and len(report.devices) == parallel.mesh.num_local_devices()
        assert report.core_outside() == {}, report.examples
    weights = {v.path: to_numpy(v) for v in model.trainable_variables}
    return {"loss": loss, "grads": grads, "history": history, "weights": weights,
            "paths": [v.path for v in model.trainable_variables], "model": model,
            "optimizer": optimizer, "parallel": parallel}


@functools.lru_cache(maxsize=None)
def reference(family, jit, extra=()):
    return _run(family, None, jit, extra)


def assert_matches(run, ref):
    np.testing.assert_allclose(run["loss"], ref["loss"], rtol=LOSS_RTOL)
    scale = max(float(np.abs(g).max()) for g in ref["grads"])
    for path, g, g_ref in zip(ref["paths"], run["grads"], ref["grads"]):
        atol = max(GRAD_ATOL_FRACTION * float(np.abs(g_ref).max()), GRAD_ATOL_FLOOR * scale)
        np.testing.assert_allclose(g, g_ref, rtol=GRAD_RTOL, atol=atol, err_msg=path)
    for got, want in zip(run["history"], ref["history"]):
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=LOSS_RTOL)
        np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=LOSS_RTOL)
        assert got["learning_rate"] == want["learning_rate"]
    for path, w in ref["weights"].items():
        np.testing.assert_allclose(run["weights"][path], w, rtol=0, atol=WEIGHT_ATOL,
                                   err_msg=path)


# XLA cases: each compiles its clusters on 8 devices in a process of its own, 3-4 minutes
# on 2 cores, so two that cover every axis kind: FSDP alone (its gather gating is the
# part XLA clustering can break) and data + fsdp + model together. The other meshes run
# as graphs above; tests/train/test_xla.py checks what XLA compiles on them.
XLA_CASES = [("fsdp=8", "llama"), ("data=2,fsdp=2,model=2", "gpt")]
# Gemma 3 shares Llama's sharded layers; its own parts (window masks, four norms per
# block, embedding scale, GeGLU) are checked on the mesh that has every axis kind.
CASES = ([(axes, family, False) for axes in MESHES for family in ("gpt", "llama")]
         + [("data=2,fsdp=2,model=2", "gemma3", False)]
         + [(axes, family, True) for axes, family in XLA_CASES])


@pytest.mark.parametrize("axes,family,jit", CASES,
                         ids=[f"{a}-{f}-{'xla' if j else 'graph'}" for a, f, j in CASES])
def test_sharded_training_matches_single_device(axes, family, jit, request):
    # XLA cases compile thousands of executables: one process each. LLVM at -O0 (CPU code
    # generation only: the HLO XLA optimizes, and so the arithmetic, is the same) halves
    # the compile time; the reference in the same process is compiled the same way.
    if jit and not run_in_child(request, env={
            "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "")
                          + " --xla_backend_optimization_level=0").strip()}):
        return
    run = _run(family, axes, jit)
    assert_matches(run, reference(family, jit))
    # The training really moved the weights: parity is not two untouched models.
    ref = reference(family, jit)
    assert ref["history"][-1]["loss"] < ref["history"][0]["loss"]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_zero1_optimizer_states_match(family):
    extra = (("optimizer.shard_optimizer_state", "true"),)
    run = _run(family, "data=2,fsdp=2,model=2", False, extra)
    assert_matches(run, reference(family, False))
    # Some state really is sharded over data where its parameter is not.
    opt, par = run["optimizer"], run["parallel"]
    assert any("data" in spec and "data" not in par.variable_spec(var)
               for var, (spec, _, _) in zip(opt.variables, opt.states))


def test_gradient_accumulation_matches_one_big_batch():
    # Two micro-batches of 8 average to the gradient of the batch of 16: same tolerances.
    run = _run("llama", "data=2,model=4", False, (("train.grad_accum_steps", 2),))
    assert_matches(run, reference("llama", False))
