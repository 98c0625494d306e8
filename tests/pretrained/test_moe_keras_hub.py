"""keras-hub's Qwen3MoeBackbone and MixtralBackbone presets, with keras-hub as the judge.

`tfllm import` of a preset keras-hub's `save_to_preset` wrote gives keras-hub's own
backbone + head logits, on one device (`test_import`, every backbone of `helpers`) and
on data=2,model=4 (the 4 experts split over model=4; the default data=8 cannot split
them); `tfllm export --format keras-hub` of a MoE run writes a preset keras-hub's
`Backbone.from_preset` and `CausalLM.from_preset` load with tfllm's logits, also for a
run imported from a Hugging Face folder (then transformers' logits), and `--format hf`
of a run imported from a preset gives transformers keras-hub's logits. What keras-hub's
MoE layers cannot express is refused in one line.

Tolerances: `helpers.ATOL` (2e-5 absolute: float32 on both sides, only summation
orders differ; measured ~7e-7 here) against keras-hub, `transformers_reference.REL`
against transformers. The routing is decisive with weights of std 0.3 (router logits of
order 1): a different expert choice moves logits by far more than 2e-5.
"""

import json

import numpy as np
import pytest

from tests.pretrained import helpers
from tests.pretrained import transformers_reference as ref
from tests.pretrained.logits import sharded_logits
from tests.pretrained.helpers import ATOL
from tfllm.cli.main import main
from tfllm.config import load_config
from tfllm.families import BACKBONES, PretrainedError
from tfllm.parallel import make_parallel
from tfllm.pretrained import from_preset

MESH = "mesh.axes=data=2,model=4"


def _weights(model):
    prefix = model.name + "/"
    return {v.path[len(prefix):]: np.asarray(v.numpy()) for v in model.variables}


@pytest.mark.parametrize("name", helpers.MOE)
def test_moe_preset_on_data2_model4_equals_keras_hub(name, tmp_path):
    from tensorflow.experimental import dtensor
    lm = helpers.save_preset(name, tmp_path / "preset")
    ids = helpers.token_ids(batch=2)
    parallel = make_parallel(load_config(None, [MESH]).mesh)
    model = from_preset(str(tmp_path / "preset"), parallel, [MESH])
    # The experts split over data (expert parallelism), their width over model: each
    # client reads blocks of Qwen3-MoE's gate and up, halves of one keras-hub tensor.
    for part, width in (("gate", 2), ("up", 2), ("down", 1)):
        kernel = next(v for v in model.variables
                      if v.path.endswith(f"block_0/mlp/{part}/kernel"))
        specs = dtensor.fetch_layout(kernel.value).sharding_specs
        assert specs[0] == "data" and specs[width] == "model", (part, specs)
    np.testing.assert_allclose(sharded_logits(model, parallel, ids),
                               helpers.keras_hub_logits(lm, ids), atol=ATOL, rtol=0)


def _keras_hub_loads(out, ours, ids):
    """keras-hub's Backbone.from_preset and CausalLM.from_preset give logits `ours`."""
    import keras_hub
    backbone = keras_hub.models.Backbone.from_preset(str(out))
    lm = keras_hub.models.CausalLM.from_preset(str(out))
    assert lm.backbone.__class__ is backbone.__class__
    for reloaded in (lm, type("LM", (), {"backbone": backbone})):
        np.testing.assert_allclose(helpers.keras_hub_logits(reloaded, ids), ours, atol=ATOL,
                                   rtol=0)
    return lm


@pytest.mark.slow  # three CLI commands, keras-hub and transformers loads (~30 s)
@pytest.mark.parametrize("name", helpers.MOE)
def test_import_on_a_mesh_then_export_keras_hub_round_trips(name, tmp_path):
    helpers.save_preset(name, tmp_path / "preset")
    ref.keras_hub_tokenizer("gpt2").save_to_preset(str(tmp_path / "tok"))
    assert main(["import", "--preset", str(tmp_path / "preset"), "--workdir",
                 str(tmp_path / "run"), "--set", MESH, "--tokenizer",
                 str(tmp_path / "tok")]) == 0
    origin = json.loads((tmp_path / "run" / "pretrained.json").read_text())
    assert origin["backbone"] == helpers.BACKBONES[name][0].__name__
    assert main(["export", "--workdir", str(tmp_path / "run"), "--format", "keras-hub",
                 "--out", str(tmp_path / "out")]) == 0
    ids = helpers.token_ids()
    model = from_preset(str(tmp_path / "preset"))
    ours = np.asarray(model(ids), np.float32)
    _keras_hub_loads(tmp_path / "out", ours, ids)
    # the preset's config is the source's, and its weights tfllm's bit for bit
    config = json.loads((tmp_path / "out" / "config.json").read_text())["config"]
    source = json.loads((tmp_path / "preset" / "config.json").read_text())["config"]
    for key in BACKBONES[origin["backbone"]].understood & set(source):
        assert config[key] == source[key], key
    again, first = _weights(from_preset(str(tmp_path / "out"))), _weights(model)
    assert again.keys() == first.keys()
    for key in first:
        np.testing.assert_array_equal(again[key], first[key], err_msg=key)
    # the same run as a Hugging Face folder: transformers computes keras-hub's logits
    assert main(["export", "--workdir", str(tmp_path / "run"), "--format", "hf",
                 "--out", str(tmp_path / "hf")]) == 0
    ref.assert_same_model(ref.logits(ref.load(tmp_path / "hf"), ids), ours)


@pytest.mark.slow  # transformers, two CLI commands and keras-hub loads (~30 s)
@pytest.mark.parametrize("name", helpers.MOE)
def test_hugging_face_run_exports_a_keras_hub_preset_of_transformers_model(name, tmp_path):
    # A folder tfllm reads itself (no keras-hub backbone in pretrained.json): the export
    # takes the family's backbone, and keras-hub computes transformers' logits with it.
    reference = ref.save(name, tmp_path / "hf")
    if name == "qwen3_moe":  # Qwen3-MoE's own epsilon, the one keras-hub's q/k norms use
        path = tmp_path / "hf" / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "rms_norm_eps": 1e-6}))
        reference = ref.load(tmp_path / "hf")
    ref.keras_hub_tokenizer(ref.MODELS[name][2]).save_to_preset(str(tmp_path / "tok"))
    assert main(["import", "--preset", str(tmp_path / "hf"), "--workdir",
                 str(tmp_path / "run"), "--set", MESH, "--tokenizer",
                 str(tmp_path / "tok")]) == 0
    assert main(["export", "--workdir", str(tmp_path / "run"), "--format", "keras-hub",
                 "--out", str(tmp_path / "out")]) == 0
    ids = helpers.token_ids()
    theirs = ref.logits(reference, ids)
    lm = _keras_hub_loads(tmp_path / "out", np.asarray(from_preset(str(tmp_path / "hf"))(ids)),
                          ids)
    ref.assert_same_model(helpers.keras_hub_logits(lm, ids), theirs)


@pytest.mark.parametrize("name,key,value,message", [
    # keras-hub 0.32's Qwen3MoeAttention normalizes queries/keys with 1e-6 whatever the
    # backbone's layer_norm_epsilon: tfllm (one epsilon, as transformers) cannot match it
    ("qwen3_moe", "layer_norm_epsilon", 1e-5, "query/key norms use 1e-06"),
    # training-time noise before router and experts: tfllm has no such setting
    ("mixtral", "router_jitter_noise", 0.1, "router_jitter_noise=0.1 is not implemented"),
])
def test_what_tfllm_cannot_match_in_a_preset_is_refused(name, key, value, message, tmp_path):
    cls, kwargs = helpers.BACKBONES[name]
    cls(**{**kwargs, key: value}).save_to_preset(str(tmp_path / "p"))
    with pytest.raises(PretrainedError, match=message) as error:
        from_preset(str(tmp_path / "p"))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name,overrides,message", [
    ("mixtral", {"head_dim": 16}, r"cannot express model.head_dim=16 apart from "
                                  r"hidden_dim / num_query_heads = 4"),
    ("mixtral", {"tie_embeddings": True}, "cannot express tied embeddings"),
    ("mixtral", {"moe_routing": "softmax_then_topk"}, "cannot express model.moe_routing"),
    ("qwen3_moe", {"norm_epsilon": 1e-5}, r"cannot express model.norm_epsilon=1e-05"),
    ("qwen3_moe", {"moe_capacity_factor": 1.25}, "moe_capacity_factor=1.25 .*dropless"),
])
def test_what_keras_hubs_moe_backbones_cannot_express_is_refused_on_export(
        name, overrides, message):
    from tfllm.config.schema import ModelConfig
    from tfllm.families import default_backbone, resolved
    from tfllm.models import model_class
    base = {"family": "llama", "vocab_size": 64, "hidden_dim": 16, "num_layers": 2,
            "num_query_heads": 4, "num_key_value_heads": 2, "intermediate_dim": 24,
            "num_experts": 4, "norm_epsilon": 1e-6}
    base.update({"qk_norm": True, "moe_intermediate_dim": 8} if name == "qwen3_moe" else
                {"moe_routing": "topk_then_softmax"})
    m = resolved(ModelConfig(**base), model_class("llama").family_defaults)
    backbone = BACKBONES[default_backbone(m)]
    backbone.backbone_kwargs(m, {})  # the section itself is expressible
    for k, v in overrides.items():
        setattr(m, k, v)
    with pytest.raises(PretrainedError, match=message) as error:
        backbone.backbone_kwargs(m, {})
    assert "\n" not in str(error.value)



def test_an_override_the_experts_do_not_hold_is_named(tmp_path):
    # One line naming the preset's expert tensor and the overrides (whichever of the
    # layer's experts is read first: they all disagree with a width of 8).
    helpers.save_preset("qwen3_moe", tmp_path / "preset")
    with pytest.raises(PretrainedError, match=r"qwen3_sparse_moe_block/experts/expert_"
                                              r"feedforward_.*--set\b") as error:
        from_preset(str(tmp_path / "preset"), overrides=["model.moe_intermediate_dim=8"])
    assert "\n" not in str(error.value)
