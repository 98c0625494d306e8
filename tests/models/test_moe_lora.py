"""LoRA on the experts of a mixture of experts (tfllm.models.lora, MoeMLP), as peft adapts
transformers' fused expert parameters through `target_parameters`.

Expert e computes x (W_e + s A_e B_e): per expert its own A_e and B_e, one A for gate and
up (peft's single lora_A of gate_up_proj), with both dispatches; only the adapters train;
what peft cannot express (its ParamWrapper takes no dropout; target_modules names no
expert) and what the model does not have are refused in one line. Parity on meshes is
tests/train/test_moe_parity.py's, peft's numbers tests/pretrained/test_peft.py's.

Tolerances: float32; the adapted model and the merged one sum the same products in
another order (x W + s (x A) B against x (W + s A B)): differences of a few ulps of the
logits (~1e-6 of values ~1); 1e-5 relative leaves 10x headroom and catches any adapter
applied to the wrong expert or path (changes of 1e-2 and more, B of std 0.5).
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.harness import sections, tiny_config
from tfllm.config import ConfigError
from tfllm.models import build_model
from tfllm.models.common.moe import MoeMLP
from tfllm.models.lora import scale, targeted, trainable_summary
from tfllm.train.metrics import flops_per_token

MOE = {"model.num_experts": 4, "model.num_experts_per_tok": 2,
       "model.moe_intermediate_dim": 32, "model.num_layers": 3,
       "model.mlp_only_layers": "[0]"}
EXPERTS = {"lora.rank": 4, "lora.alpha": 8.0,
           "lora.targets": "[q_proj,experts.gate_up_proj,experts.down_proj]"}


def _config(**extra):
    return tiny_config("llama", **{**MOE, **extra})


def _tokens():
    return tf.constant(np.random.RandomState(0).randint(0, 128, (2, 16)), tf.int32)


@pytest.mark.parametrize("dispatch", ["slots", "grouped"])
def test_expert_adapters_add_each_experts_own_update(dispatch):
    cfg = _config(**EXPERTS, **{"model.moe_dispatch": dispatch})
    model = build_model(*sections(cfg))
    plain = build_model(*sections(_config(**{"model.moe_dispatch": dispatch})))
    rng = np.random.RandomState(1)
    for v in model.variables:  # random B too, so that every adapter moves the logits
        if v.path.endswith("/lora_b"):
            v.assign(rng.normal(0, 0.5, v.shape).astype("float32"))
    s = scale(cfg.lora)
    ours = {v.path.split("/", 1)[1]: v for v in model.variables}
    for v in plain.variables:
        path = v.path.split("/", 1)[1]
        w = np.asarray(ours[path])
        layer = path[: -len("/kernel")]
        if path.endswith("/kernel") and layer + "/lora_b" in ours:
            a = np.asarray(ours[layer.replace("/up", "/gate") + "/lora_a"])
            b = np.asarray(ours[layer + "/lora_b"])
            if a.ndim == 3:  # experts: A (E, in, r), B (r, E, out), per expert
                w = w + s * np.einsum("eir,reo->eio", a, b)
            else:
                w = w + s * np.tensordot(a, b, axes=1)
        v.assign(w)
    want = np.asarray(plain(_tokens()))
    got = np.asarray(model(_tokens()))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # the adapters matter: the base model's logits are far away
    for v in plain.variables:
        v.assign(ours[v.path.split("/", 1)[1]])
    assert np.abs(np.asarray(plain(_tokens())) - want).max() > 1e-2 * np.abs(want).max()


def test_up_shares_gates_a_and_only_adapters_train():
    model = build_model(*sections(_config(**EXPERTS)))
    sparse = model.blocks[1].mlp
    assert isinstance(sparse, MoeMLP)
    assert tuple(sparse.gate.lora_a.shape) == (4, 64, 4)  # (E, D, r)
    assert tuple(sparse.gate.lora_b.shape) == (4, 4, 32)  # (r, E, F)
    assert not hasattr(sparse.up, "lora_a") and tuple(sparse.up.lora_b.shape) == (4, 4, 32)
    assert tuple(sparse.down.lora_a.shape) == (4, 32, 4)
    assert sparse.router.lora is None
    # the dense layer's MLP is not targeted (gate_proj is not in lora.targets)
    assert model.blocks[0].mlp.gate.lora is None
    names = {v.path.rsplit("/", 1)[-1] for v in model.trainable_variables}
    assert names == {"lora_a", "lora_b"}
    # per sparse layer: q (A, B), gate (A, B), up (B), down (A, B); the dense one: q
    assert len(model.trainable_variables) == 2 * 7 + 2
    counts = trainable_summary(model)
    assert counts["trainable"] == sum(int(np.prod(v.shape)) for v in model.trainable_variables)


def test_targets_resolve_per_layer_kind():
    cfg = _config(**{"lora.rank": 4})  # every projection each layer has
    layers = [[x.name for x in layer] for layer in targeted(cfg.model, cfg.lora)]
    attention = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                 "self_attn.o_proj"]
    assert layers[0] == attention + ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert layers[1] == layers[2] == attention + ["mlp.experts.gate_up_proj",
                                                  "mlp.experts.down_proj"]
    # "down_proj" names the dense MLP's module (peft's target_modules), not the experts'
    cfg = _config(**{"lora.rank": 4, "lora.targets": "[down_proj]"})
    assert [[x.name for x in layer] for layer in targeted(cfg.model, cfg.lora)] == [
        ["mlp.down_proj"], [], []]


@pytest.mark.parametrize("overrides,message", [
    ({"lora.dropout": 0.1},
     r"lora.dropout=0.1 with LoRA on the experts \(mlp.experts.gate_up_proj, "
     r"mlp.experts.down_proj\): peft's target_parameters adapters take no dropout"),
    ({"lora.targets": "[gate_proj]", "model.mlp_only_layers": "[]"},
     r"lora.targets: mlp.gate_proj is the dense MLP's, and every layer of this model has "
     r"experts in its place; adapt them with experts.gate_up_proj"),
    ({"lora.targets": "[experts.gate_proj]"}, r"'experts.gate_proj' names no projection"),
    ({"lora.targets": "[experts.down_proj]", "model.num_experts": 0},
     r"mlp.experts.down_proj is an expert parameter, and this model has no "
     r"mixture-of-experts layer"),
])
def test_what_peft_cannot_express_is_refused(overrides, message):
    cfg = _config(**{"lora.rank": 4, **overrides})
    with pytest.raises(ConfigError, match=message):
        build_model(*sections(cfg), allocate=False)


def test_flops_count_k_experts_adapters():
    cfg = _config(**{"lora.rank": 4, "lora.targets": "[experts.gate_up_proj]"})
    plain = flops_per_token(cfg.model, 16)
    adapted = flops_per_token(cfg.model, 16, cfg.lora)
    frozen = flops_per_token(cfg.model, 16, _config(**{"lora.rank": 4,
                                                       "lora.targets": "[q_proj]"}).lora)
    d, f, k, r = 64, 32, 2, 4
    q = 2 * 3 * 3 * r * (d + 64)  # q_proj's adapter (64 in, 64 out), 3 layers, 3x
    # two sparse layers: per token k experts, one A (D x r) and two Bs (r x F), 3x
    experts = 2 * 3 * 2 * k * r * (d + 2 * f)
    assert adapted - (frozen - q) == experts
    assert adapted < plain


def test_the_command_refuses_in_one_line_and_writes_nothing(tmp_path, capsys):
    from tests.harness import tiny_overrides
    from tfllm.cli.main import main
    overrides = tiny_overrides("llama", "data=2,model=4", **{
        **MOE, "lora.rank": 4, "lora.dropout": 0.1, "train.steps": 1})
    capsys.readouterr()
    assert main(["train", "--workdir", str(tmp_path / "run"),
                 *[a for o in overrides for a in ("--set", o)]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lora.dropout=0.1 with LoRA on the experts" in err[0], err
    assert "set lora.dropout=0" in err[0]
    assert list(tmp_path.iterdir()) == []


def test_fp8_expert_gemms_take_adapters():
    # precision.policy=fp8: the expert GEMMs in FP8, their adapters in the compute dtype;
    # fresh adapters (B = 0) leave the FP8 model's logits exactly, and every A and B of
    # the experts gets a gradient
    fp8 = {"precision.policy": "fp8"}
    base = build_model(*sections(_config(**fp8)))
    model = build_model(*sections(_config(**fp8, **EXPERTS)))
    np.testing.assert_array_equal(model(_tokens()), base(_tokens()))
    rng = np.random.RandomState(2)
    for v in model.variables:
        if v.path.endswith("/lora_b"):
            v.assign(rng.normal(0, 0.5, v.shape).astype("float32"))
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.cast(model(_tokens()), tf.float32)))
    grads = tape.gradient(loss, model.trainable_variables)
    for v, g in zip(model.trainable_variables, grads):
        assert g is not None and float(tf.reduce_max(tf.abs(g))) > 0, v.path
