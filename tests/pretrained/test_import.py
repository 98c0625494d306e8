"""Pretrained import/export: logits equal keras-hub's, on one device and on a mesh."""

import os

import numpy as np
import pytest

import tfllm.models
from tfllm.config import load_config
from tfllm.parallel import make_parallel
from tfllm.pretrained import FAMILIES, from_preset
from tests.pretrained import helpers

# float32 on both sides; the only differences are summation orders (einsum vs keras-hub's
# EinsumDense, softmax, RMSNorm) over widths <= 64 with random weights of std 0.3: the
# measured worst case is ~4e-7 of logits of magnitude ~2, so 2e-5 leaves 50x headroom and
# still catches any wrong tensor, transposition or RoPE frequency (errors of order 1).
ATOL = 2e-5


def tfllm_logits(model, ids):
    return np.asarray(model(ids), np.float32)


@pytest.mark.parametrize("name", sorted(helpers.BACKBONES))
def test_keras_hub_preset_logits_equal_keras_hub(name, tmp_path):
    lm = helpers.save_preset(name, tmp_path / "preset")
    ids = helpers.token_ids()
    model = from_preset(str(tmp_path / "preset"))
    np.testing.assert_allclose(tfllm_logits(model, ids), helpers.keras_hub_logits(lm, ids),
                               atol=ATOL, rtol=0)


def test_every_family_is_tested():
    tested = {helpers.BACKBONES[n][0].__name__ for n in helpers.BACKBONES}
    assert tested == set(FAMILIES)


def sharded_logits(model, parallel, ids):
    """The model's logits on the mesh (batch over its batch axes), gathered to host."""
    import tensorflow as tf
    from tfllm.parallel import context
    from tfllm.parallel.placement import to_numpy
    spec = parallel.batch_spec(ids.shape)
    batch = parallel.shard_array(ids, spec)

    @tf.function
    def forward(x):
        with context.use(parallel):
            return model(x)
    return to_numpy(forward(batch))


# One backbone of each kind of weight set: GPT-2 (biases, learned positions), Llama 3.1
# (llama3 RoPE, untied head), Qwen2 (q/k/v biases); the others share Llama's mapping.
@pytest.mark.parametrize("name", ["gpt2", "llama3", "qwen"])
def test_sharded_load_on_data2_model4_equals_keras_hub(name, tmp_path):
    from tensorflow.experimental import dtensor
    lm = helpers.save_preset(name, tmp_path / "preset")
    ids = helpers.token_ids(batch=2)
    axes = "mesh.axes=data=2,model=4"
    parallel = make_parallel(load_config(None, [axes]))
    model = tfllm.models.from_preset(str(tmp_path / "preset"), parallel, [axes])
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
