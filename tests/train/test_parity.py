"""The core test: sharded training equals a single-device float32 reference.

For each mesh shape, model family and jit setting (graphs, or XLA clusters of each
device's program, checked from the executed graphs), on 8 logical CPU devices: the loss
and the gathered gradients of one batch, then the losses, gradient norms and all
weights after 3 AdamW steps, against the same model on one device without DTensor.
Initial weights are bit-identical by construction (tfllm.parallel.init), so every
difference comes from sharded reductions summing in another order.
"""

import os

import pytest

from tests.harness import assert_parity, parity_reference, parity_run, run_in_child

# The tolerances (and why they hold) are with the harness: tests/harness.py, LOSS_RTOL to
# WEIGHT_ATOL; the runs use its PARITY_SETTINGS (AdamW epsilon 1e-6, justified there).
MESHES = ["data=8", "fsdp=8", "model=8", "data=2,model=4", "data=2,fsdp=2,model=2", "data=2,fsdp=4"]

# As graphs, GPT and Llama on every mesh, less the pairs that another test of this module
# trains on the same mesh against the same reference: data=2,fsdp=2,model=2 for both
# families with ZeRO-1 (test_zero1_optimizer_states_match: only where AdamW's states live
# changes) and Llama on data=2,model=4 with two micro-batches
# (test_gradient_accumulation_matches_one_big_batch). data=8 for GPT only: data
# parallelism replicates every weight and all-reduces the gradients, whatever the family.
GRAPH_CASES = [(axes, family) for axes in MESHES for family in ("gpt", "llama")
               if (axes, family) not in {("data=8", "llama"), ("data=2,model=4", "llama"),
                                         ("data=2,fsdp=2,model=2", "gpt"),
                                         ("data=2,fsdp=2,model=2", "llama")}]
# XLA: one case, in a process of its own (XLA on CPU compiles every device's clusters,
# 2-4 minutes on 2 cores): the mesh with every axis kind, whose FSDP gather gating is the
# part XLA clustering can break. GPT here; Llama's step is held to its graph through XLA
# on one device (tests/train/test_xla.py, tests/models/test_remat.py), and
# tests/train/test_xla.py checks what XLA compiles on the other meshes.
XLA_CASES = [("data=2,fsdp=2,model=2", "gpt")]
# Gemma 3 shares Llama's sharded layers; its own parts (window masks, four norms per
# block, embedding scale, GeGLU) are checked on the mesh that has every axis kind.
CASES = ([(axes, family, False) for axes, family in GRAPH_CASES]
         + [("data=2,fsdp=2,model=2", "gemma3", False)]
         + [(axes, family, True) for axes, family in XLA_CASES])


@pytest.mark.slow
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
    # Under XLA, the first batch's gradients are not compiled as a program of their own
    # (90 of the case's 232 CPU seconds): the graph cases compare every gradient on each
    # mesh, and the XLA step's gradients are held to the reference's through each step's
    # gradient norm and every weight after the steps (the program that trains).
    run = parity_run(family, axes, jit, grads=not jit)
    ref = parity_reference(family, jit, grads=not jit)
    assert_parity(run, ref)
    # The training really moved the weights: parity is not two untouched models.
    assert ref["history"][-1]["loss"] < ref["history"][0]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_zero1_optimizer_states_match(family):
    # Also the graph parity of both families on this mesh (left out of CASES).
    extra = (("optimizer.shard_optimizer_state", "true"),)
    run = parity_run(family, "data=2,fsdp=2,model=2", False, extra)
    assert_parity(run, parity_reference(family, False))
    # Some state really is sharded over data where its parameter is not.
    opt, par = run["optimizer"], run["parallel"]
    assert any("data" in spec and "data" not in par.variable_spec(var)
               for var, (spec, _, _) in zip(opt.variables, opt.states))


@pytest.mark.slow
def test_gradient_accumulation_matches_one_big_batch():
    # Two micro-batches of 8 average to the gradient of the batch of 16: same tolerances.
    # Also Llama's graph parity on this mesh (left out of CASES).
    run = parity_run("llama", "data=2,model=4", False, (("train.grad_accum_steps", 2),))
    assert_parity(run, parity_reference("llama", False))
