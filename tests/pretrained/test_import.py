"""Pretrained import/export: logits equal keras-hub's, on one device and on a mesh."""

import os

import numpy as np
import pytest

from tfllm.config import load_config
from tfllm.parallel import make_parallel
from tfllm.pretrained import FAMILIES, from_preset
from tfllm.families import PretrainedError
from tests.pretrained import helpers
from tests.pretrained.helpers import ATOL
from tests.pretrained.logits import sharded_logits



def tfllm_logits(model, ids):
    return np.asarray(model(ids), np.float32)


@pytest.mark.parametrize("name", sorted(helpers.BACKBONES))
def test_keras_hub_preset_logits_equal_keras_hub(name, tmp_path):
    lm = helpers.save_preset(name, tmp_path / "preset")
    ids = helpers.token_ids()
    model = from_preset(str(tmp_path / "preset"))
    np.testing.assert_allclose(tfllm_logits(model, ids), helpers.keras_hub_logits(lm, ids),
                               atol=ATOL, rtol=0)


def test_gemma3_preset_whose_scaling_keras_hub_ignores_is_refused(tmp_path):
    # keras-hub 0.32's Gemma 3 layers scale scores by head_dim whatever
    # query_head_dim_normalize says: the preset's meaning is ambiguous, tfllm refuses.
    from tfllm.families import PretrainedError
    cls, kwargs = helpers.BACKBONES["gemma3"]
    cls(**kwargs, query_head_dim_normalize=False).save_to_preset(str(tmp_path / "p"))
    with pytest.raises(PretrainedError, match="query_head_dim_normalize=False"):
        from_preset(str(tmp_path / "p"))


def test_every_family_is_tested():
    tested = {helpers.BACKBONES[n][0].__name__ for n in helpers.BACKBONES}
    assert tested == set(FAMILIES)


# One backbone of each kind of weight set: GPT-2 (biases, learned positions), Llama 3.1
# (llama3 RoPE, untied head), Qwen2 (q/k/v biases); the others share Llama's mapping.
@pytest.mark.parametrize("name", ["gpt2", "llama3", "qwen"])
def test_sharded_load_on_data2_model4_equals_keras_hub(name, tmp_path):
    from tensorflow.experimental import dtensor
    lm = helpers.save_preset(name, tmp_path / "preset")
    ids = helpers.token_ids(batch=2)
    axes = "mesh.axes=data=2,model=4"
    parallel = make_parallel(load_config(None, [axes]).mesh)
    model = from_preset(str(tmp_path / "preset"), parallel, [axes])
    kernel = next(v for v in model.variables if v.path.endswith("block_0/mlp/up/kernel"))
    assert "model" in dtensor.fetch_layout(kernel.value).sharding_specs  # really sharded
    np.testing.assert_allclose(sharded_logits(model, parallel, ids),
                               helpers.keras_hub_logits(lm, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama3", "gpt2"])
def test_hugging_face_folder_logits_equal_keras_hub(name, tmp_path):
    # The folder is written by keras-hub's exporter (CausalLM.export_to_transformers: the
    # families with a tokenizer in helpers); the reference is the exported keras-hub model.
    lm = helpers.save_huggingface(name, tmp_path / "hf")
    assert os.path.exists(tmp_path / "hf" / "model.safetensors")
    ids = helpers.token_ids()
    model = from_preset(str(tmp_path / "hf"))
    np.testing.assert_allclose(tfllm_logits(model, ids), helpers.keras_hub_logits(lm, ids),
                               atol=ATOL, rtol=0)


def test_bfloat16_preset_is_widened_exactly(tmp_path):
    lm = helpers.save_preset("llama3", tmp_path / "preset", dtype="bfloat16")
    model = from_preset(str(tmp_path / "preset"))
    theirs = {v.path: np.asarray(v.numpy().astype(np.float32)) for v in lm.backbone.weights}
    ours = {v.path: v.numpy() for v in model.variables}
    np.testing.assert_array_equal(ours["llama/block_1/attention/query/kernel"],
                                  theirs["transformer_layer_1/self_attention/query/kernel"])
    assert ours["llama/block_1/attention/query/kernel"].dtype == np.float32


def _hf_mistral_folder(path, rng):
    """A 2-layer Mistral checkpoint folder as transformers writes it (float32 tensors)."""
    import json

    from safetensors.numpy import save_file
    hidden, inter, heads, kv, vocab, head_dim = 32, 64, 4, 2, 128, 8
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                   "hidden_size": hidden, "intermediate_size": inter,
                   "num_attention_heads": heads, "num_key_value_heads": kv,
                   "num_hidden_layers": 2, "vocab_size": vocab, "head_dim": head_dim,
                   "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": None,
                   "max_position_embeddings": 256, "tie_word_embeddings": False,
                   "hidden_act": "silu", "torch_dtype": "float32"}, f)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                       p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
                       p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                       p + "mlp.gate_proj.weight": (inter, hidden),
                       p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter)})
    # Values float16 cannot hold exactly (a 23-bit mantissa; some beyond its range).
    tensors = {k: (rng.standard_normal(s) * 0.02 + 1e-7).astype(np.float32)
               for k, s in shapes.items()}
    tensors["model.embed_tokens.weight"][0, 0] = 1e5  # float16's largest is 65504
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return tensors


def test_mistral_float32_weights_are_read_exactly_not_through_float16(tmp_path):
    # keras-hub 0.32's Mistral converter casts every tensor to float16 in its hooks; the
    # import keeps the stored float32 values bit for bit (and 1e5, past float16's range).
    theirs = _hf_mistral_folder(str(tmp_path / "hf"), np.random.default_rng(0))
    model = from_preset(str(tmp_path / "hf"))
    ours = {v.path: v.numpy() for v in model.variables}
    embedding = next(v for k, v in ours.items() if "embedding" in k and v.shape == (128, 32))
    np.testing.assert_array_equal(embedding, theirs["model.embed_tokens.weight"])
    query = next(v for k, v in ours.items() if "block_1/attention/query" in k)
    # HF (H*D, E) -> (E, H, D): transposed and reshaped by the converter's own hook.
    np.testing.assert_array_equal(
        query, theirs["model.layers.1.self_attn.q_proj.weight"].T.reshape(32, 4, 8))
    assert all(v.dtype == np.float32 for v in ours.values())


def test_transformers5_rope_parameters_import_with_their_llama3_scaling(tmp_path):
    # transformers 5 writes rope_parameters (rope_type, rope_theta, factors) instead of
    # rope_theta + rope_scaling; keras-hub's converter read only the latter and the model
    # was built unscaled, silently. The same folder in the new layout gives the same
    # logits as keras-hub's scaled model (the test length 40 passes the pre-training
    # length 16, so the scaling changes them).
    import json
    lm = helpers.save_huggingface("llama3", tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config["rope_parameters"] = {"rope_theta": config.pop("rope_theta"),
                                 **config.pop("rope_scaling")}
    path.write_text(json.dumps(config))
    ids = helpers.token_ids()
    logits = tfllm_logits(from_preset(str(tmp_path / "hf")), ids)
    np.testing.assert_allclose(logits, helpers.keras_hub_logits(lm, ids), atol=ATOL, rtol=0)
    # Both layouts at once must agree.
    config["rope_scaling"] = {**config["rope_parameters"], "factor": 4.0}
    del config["rope_scaling"]["rope_theta"]
    path.write_text(json.dumps(config))
    with pytest.raises(PretrainedError, match="rope_scaling=.*disagrees with rope_parameters"):
        from_preset(str(tmp_path / "hf"))


@pytest.mark.parametrize("rope_scaling", [{"rope_type": "linear", "factor": 2.0},
                                          {"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 64}])
def test_rope_scaling_a_converter_drops_is_refused_not_ignored(tmp_path, rope_scaling):
    # keras-hub's Mistral (and Qwen2, Llama 2) converters ignore rope_scaling: importing
    # would give an unscaled model. Refused in one error naming the key and its value.
    import json
    _hf_mistral_folder(str(tmp_path / "hf"), np.random.default_rng(0))
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config["rope_scaling"] = rope_scaling
    path.write_text(json.dumps(config))
    with pytest.raises(PretrainedError, match=r"rope_scaling=.*is not implemented for "
                                              r"model_type 'mistral'"):
        from_preset(str(tmp_path / "hf"))
