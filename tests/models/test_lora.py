"""LoRA adapters (tfllm.models.lora): the product, what trains, and parity on meshes.

A fresh adapter leaves the model unchanged (B starts at zero); a projection computes
x W + s (x A) B with W frozen; only A and B are trainable and hold optimizer state; the
frozen weights travel in their block's one gather but get no gradient and no reduction;
a LoRA step on a mesh equals the one-device step (tests/harness.py's tolerances).
"""

import numpy as np
import pytest
import tensorflow as tf

from tfllm.config import ConfigError
from tfllm.models import build_model
from tfllm.models.lora import scale, targeted, trainable_summary
from tfllm.train.metrics import flops_per_token
from tests.harness import (LOSS_RTOL, assert_parity, first_step_costs, parity_reference,
                           parity_run, sections, tiny_config, train_step_dots)

LORA = (("lora.rank", 4), ("lora.alpha", 8.0))


def _tokens():
    return tf.constant(np.random.RandomState(0).randint(0, 128, (2, 16)), tf.int32)


@pytest.mark.parametrize("family", ["gpt", "llama", "gemma3"])
def test_a_fresh_adapter_changes_nothing_and_only_adapters_train(family):
    base = build_model(*sections(tiny_config(family)))
    model = build_model(*sections(tiny_config(family, **dict(LORA))))
    np.testing.assert_array_equal(model(_tokens()), base(_tokens()))
    names = {v.path.rsplit("/", 1)[-1] for v in model.trainable_variables}
    assert names == {"lora_a", "lora_b"}
    counts = trainable_summary(model)
    cfg = tiny_config(family, **dict(LORA))
    per_layer = sum(len(x.paths) for x in targeted(cfg.model, cfg.lora)[0])
    assert len(model.trainable_variables) == 2 * per_layer * 2  # 2 layers
    assert counts["frozen"] == sum(int(np.prod(v.shape)) for v in base.trainable_variables)


def test_a_projection_computes_x_w_plus_scaled_x_a_b():
    model = build_model(*sections(tiny_config("llama", **dict(LORA))))
    for layer, eq in ((model.blocks[0].attention.query, "btd,dhk->bthk"),
                      (model.blocks[0].attention.output_proj, "bthk,hkd->btd"),
                      (model.blocks[1].mlp.down, "btf,fd->btd")):
        rng = np.random.RandomState(1)
        layer.lora_b.assign(rng.normal(size=layer.lora_b.shape).astype("float32"))
        x = tf.constant(rng.normal(size=(2, 5) + tuple(layer.kernel.shape[:len(eq.split(",")[0]) - 2])),
                        tf.float32)
        a = np.asarray(layer.lora_a).reshape(-1, 4)
        b = np.asarray(layer.lora_b).reshape(4, -1)
        delta = (a @ b).reshape(layer.kernel.shape)  # W + s A B, formed only here
        want = tf.einsum(eq, x, layer.kernel + 2.0 * delta)  # s = 8 / 4
        np.testing.assert_allclose(layer(x), want, rtol=1e-5, atol=1e-5)


def test_scale_targets_and_refusals():
    cfg = tiny_config("llama", **dict(LORA))
    assert scale(cfg.lora) == 2.0
    cfg.lora.rslora = True
    assert scale(cfg.lora) == 4.0  # 8 / sqrt(4)
    def names(family, targets):  # layer 0's
        c = tiny_config(family, **dict(LORA), **{"lora.targets": targets})
        return [(x.name, x.paths) for x in targeted(c.model, c.lora)[0]]
    assert [n for n, _ in names("llama", ["q_proj", "self_attn.v_proj"])] == [
        "self_attn.q_proj", "self_attn.v_proj"]
    assert [n for n, _ in names("gpt", ["c_proj"])] == ["attn.c_proj", "mlp.c_proj"]  # peft's
    assert names("gpt", ["c_attn"]) == [("attn.c_attn", ("attention/query", "attention/key",
                                                         "attention/value"))]
    with pytest.raises(ConfigError, match=r"lora.targets: 'c_fc' names no projection of "
                                          r"the llama family"):
        build_model(*sections(tiny_config("llama", **dict(LORA), **{"lora.targets": ["c_fc"]})))


def test_flops_count_no_weight_gradient_for_frozen_weights():
    wide = {"model.hidden_dim": 1024, "model.intermediate_dim": 4096,
            "model.vocab_size": 32000}
    plain = tiny_config("llama", **wide)
    lora = tiny_config("llama", **dict(LORA), **wide)
    full, adapted = (flops_per_token(c.model, 16, c.lora) for c in (plain, lora))
    # Without weight gradients the matmuls cost 2/3 (attention's share here is ~0.1%);
    # rank-4 adapters on 1024-wide projections add ~1% back.
    assert 2 / 3 * full < adapted < 0.68 * full


@pytest.mark.slow  # two tiny-model steps on 8 devices: ~35-55 s on 2 cores
@pytest.mark.parametrize("axes", ["fsdp=8"])
def test_a_lora_step_on_fsdp_sends_only_adapter_gradients(axes):
    plain, _ = first_step_costs(axes, 2)
    lora, _ = first_step_costs(axes, 2, **dict(LORA))
    reduced = lambda r: sorted(c.elements for c in r.collectives  # noqa: E731
                               if "block_1_reduce" in c.name)
    gathered = lambda r: [c.elements for c in r.collectives  # noqa: E731
                          if "block_1_gather" in c.name]
    # One gather of the block: frozen kernels and adapters together.
    assert len(gathered(lora)) == 1 and gathered(lora)[0] > gathered(plain)[0]
    # Its reductions carry the adapters' gradients only (no norm scale, no kernel).
    model = build_model(*sections(tiny_config("llama", axes, **dict(LORA))), allocate=False)
    adapter_elements = sum(int(np.prod(v.shape)) for v in model.trainable_variables
                           if "/block_1/" in v.path)
    # (a reduce-scatter is an all-reduce of the whole buffer, then a slice, on CPU)
    assert sum(reduced(lora)) == adapter_elements, (reduced(lora), adapter_elements)
    assert sum(reduced(lora)) < sum(reduced(plain)) / 5


@pytest.mark.slow
@pytest.mark.parametrize("family,axes,extra", [
    # data x FSDP x tensor parallelism; tensor parallelism over 4; FSDP x TP with remat
    # (plain FSDP runs in test_a_lora_step_on_fsdp_sends_only_adapter_gradients)
    ("llama", "data=2,fsdp=2,model=2", ()),
    ("gpt", "data=2,model=4", ()),
    ("gemma3", "fsdp=4,model=2", (("model.remat", "full"),)),
])
def test_a_lora_step_on_a_mesh_matches_one_device(family, axes, extra):
    ref = parity_reference(family, False, LORA + extra)
    run = parity_run(family, axes, False, LORA + extra)
    assert_parity(run, ref)
    # only A and B moved, and the optimizer holds state for them alone
    assert all(p.rsplit("/", 1)[-1] in ("lora_a", "lora_b") for p in run["weights"])
    assert [v.path for v in run["optimizer"].variables] == run["paths"]


def test_fp8_projections_keep_fp8_gemms_and_compute_no_weight_gradient():
    # One device, XLA: FP8 projections with frozen kernels run their forward GEMMs in FP8
    # (6 in a GPT block), and of their backward GEMMs only the input gradients something
    # trainable needs (down, up and output feed adapters upstream; the block's input
    # feeds only frozen weights): 3, where full training has 6 more and 6 weight GEMMs.
    dots = train_step_dots(tiny_config("gpt", **{"precision.policy": "fp8",
                                                 "model.num_layers": 1}, **dict(LORA)))
    fp8 = sorted(d.op_name for d in dots if d.kind == "full")
    assert not [d for d in dots if d.kind == "half"]
    forward = {p for p in ("query", "key", "value", "output", "up", "down")
               for op in fp8 if f"/{p}_1/einsum/" in op}
    assert len(forward) == 6 and len(fp8) == 6 + 3, fp8


def test_dropout_masks_the_adapter_input_in_training_only():
    from tfllm.models.common.noise import dropout, noise_seed
    x = tf.ones((4, 64, 32))
    with noise_seed(tf.constant(3)):
        a, b = dropout(x, 0.25, "p"), dropout(x, 0.25, "p")
        other = dropout(x, 0.25, "q")  # another layer draws another mask
    with noise_seed(tf.constant(4)):
        later = dropout(x, 0.25, "p")  # another step or micro-batch: another mask
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, other) and not np.array_equal(a, later)
    kept = np.asarray(a)[np.asarray(a) != 0]
    np.testing.assert_allclose(kept, 1 / 0.75)  # inverted dropout keeps the expectation
    assert abs(1 - kept.size / a.numpy().size - 0.25) < 0.02
    with pytest.raises(ValueError, match="needs a step seed"):
        dropout(x, 0.25, "p")
    # The model: a forward pass under a seed (the train step's) drops; evaluation and
    # generation (no seed) never do.
    model = build_model(*sections(tiny_config("llama", **dict(LORA), **{"lora.dropout": 0.5})))
    for v in model.trainable_variables:
        if v.path.endswith("lora_b"):
            v.assign(np.random.RandomState(0).normal(size=v.shape).astype("float32"))
    plain = model(_tokens())
    np.testing.assert_array_equal(model(_tokens()), plain)
    with noise_seed(tf.constant(0)):
        dropped = model(_tokens())
    assert np.abs(np.asarray(dropped) - np.asarray(plain)).max() > 1e-3


@pytest.mark.parametrize("remat", ["full", "selective"])
def test_a_recomputed_forward_pass_draws_the_same_dropout_mask(remat):
    # One device: the same step with and without remat (which recomputes the forward pass
    # in the backward one) gives the same gradients only if the masks are redrawn equal.
    noisy = LORA + (("lora.dropout", 0.3),)
    ref = parity_reference("llama", False, noisy)
    run = parity_run("llama", None, False, noisy + (("model.remat", remat),))
    assert_parity(run, ref)
    clean = parity_reference("llama", False, LORA)
    assert run["history"][-1]["loss"] != clean["history"][-1]["loss"]  # dropout acted


@pytest.mark.slow  # two training runs on 8 devices
def test_dropout_trains_on_a_mesh():
    # DTensor draws each shard's mask from the seed and its place on the mesh, so masks
    # (not their expectation) depend on the mesh: the run is finite and repeatable. One
    # block (half the cost of two): every block's projections draw their masks alike.
    one_block = LORA + (("model.num_layers", 1),)
    noisy = one_block + (("lora.dropout", 0.3),)
    runs = [parity_run("llama", "data=2,fsdp=2,model=2", False, noisy) for _ in range(2)]
    losses = [[h["loss"] for h in r["history"]] for r in runs]
    assert np.all(np.isfinite(losses)) and losses[0] == losses[1]
    # Dropout acted: without it the mesh equals one device within LOSS_RTOL
    # (test_a_lora_step_on_a_mesh_matches_one_device). B starts at zero, so the adapters
    # (and their dropout) change the loss from the second step on: by 5.5e-4 relative at
    # the third (measured 2026-11-27), 55x the parity tolerance; 10x separates the two.
    clean = [h["loss"] for h in parity_reference("llama", False, one_block)["history"]]
    assert losses[0][0] == pytest.approx(clean[0], rel=LOSS_RTOL)
    assert losses[0][-1] != pytest.approx(clean[-1], rel=10 * LOSS_RTOL)
