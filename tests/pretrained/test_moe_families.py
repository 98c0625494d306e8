"""Qwen3-MoE and Mixtral folders, with transformers itself as the reference.

Folders are written by transformers' `save_pretrained` (the per-expert layout it still
writes), or as transformers 5 holds the experts in memory (fused `gate_up_proj` and
`down_proj`, written here from its state dict). tfllm's import gives transformers' float32
logits (on one device and on data=2,model=4) and its auxiliary load-balancing loss;
`tfllm import` then `tfllm export --format hf` writes the source's tensors bit for bit
and transformers loads the export with the same logits. What tfllm does not compute is
refused in one line.

Tolerances: the dense families' (`transformers_reference.REL`, 1e-5 of the largest
logit: float32 on both sides, only summation orders differ). The routing is decisive
with weights of std 0.3 (router logits of order 1), so the same experts are chosen on
both sides: a different choice would move the logits by far more than 1e-5 (and the
greedy tokens are compared exactly). The aux loss is a sum over 80 tokens of products
of float32 softmax probabilities: rtol 1e-5.
"""

import json
import shutil

import numpy as np
import pytest

from tests.pretrained import helpers
from tests.pretrained import transformers_reference as ref
from tfllm.cli.main import main
from tfllm.families import PretrainedError
from tfllm.models.common.moe import collecting_router_stats, load_balancing_loss
from tfllm.pretrained import from_preset

MOE = ["mixtral", "qwen3_moe"]


def _logits(model, ids):
    return np.asarray(model(ids), np.float32)


@pytest.mark.parametrize("name", MOE)
def test_import_gives_transformers_logits_and_aux_loss(name, tmp_path):
    reference = ref.save(name, tmp_path / "hf")
    ids = helpers.token_ids()
    model = from_preset(str(tmp_path / "hf"))
    with collecting_router_stats() as stats:
        ours = _logits(model, ids)
    ref.assert_same_model(ours, ref.logits(reference, ids))
    torch, _ = ref.load_torch_transformers()
    with torch.no_grad():
        out = reference(torch.tensor(ids.astype(np.int64)), output_router_logits=True)
    sparse = 2  # qwen3_moe: layers 0 and 2 (mlp_only_layers=[1]); mixtral: both
    assert len(stats) == sparse
    np.testing.assert_allclose(float(load_balancing_loss(stats)), float(out.aux_loss),
                               rtol=1e-5)


@pytest.mark.parametrize("name", MOE)
def test_fused_expert_tensors_import_the_same_model(name, tmp_path):
    """transformers 5's in-memory layout (mlp.experts.gate_up_proj, down_proj,
    mlp.gate), as a folder may hold it."""
    from safetensors.torch import save_file
    reference = ref.save(name, tmp_path / "hf")
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(tmp_path / "hf" / "config.json", fused / "config.json")
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    ids = helpers.token_ids()
    ref.assert_same_model(_logits(from_preset(str(fused)), ids), ref.logits(reference, ids))


@pytest.mark.parametrize("name", MOE)
def test_import_on_a_mesh_then_export_hf_is_transformers_model(name, tmp_path):
    from tests.pretrained.logits import sharded_logits
    from tfllm.config import load_config
    from tfllm.parallel import make_parallel
    reference = ref.save(name, tmp_path / "hf")
    ids = helpers.token_ids()
    parallel = make_parallel(load_config(None, ["mesh.axes=data=2,model=4"]).mesh)
    ref.assert_same_model(sharded_logits(from_preset(str(tmp_path / "hf"), parallel),
                                         parallel, ids), ref.logits(reference, ids))
    ref.keras_hub_tokenizer(ref.MODELS[name][2]).save_to_preset(str(tmp_path / "tok"))
    assert main(["import", "--preset", str(tmp_path / "hf"), "--workdir",
                 str(tmp_path / "run"), "--set", "mesh.axes=data=2,model=4",
                 "--tokenizer", str(tmp_path / "tok")]) == 0
    assert main(["export", "--workdir", str(tmp_path / "run"), "--out",
                 str(tmp_path / "out"), "--format", "hf"]) == 0
    theirs, ours = ref.safetensors_of(tmp_path / "hf"), ref.safetensors_of(tmp_path / "out")
    assert sorted(ours) == sorted(theirs)  # the per-expert layout transformers writes
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    with open(tmp_path / "out" / "config.json") as f:
        config = json.load(f)
    assert config["model_type"] == name
    ref.assert_same_model(ref.logits(ref.load(tmp_path / "out"), ids),
                          ref.logits(reference, ids))


@pytest.mark.parametrize("name,key,value,message", [
    ("mixtral", "router_jitter_noise", 0.1, "router_jitter_noise=0.1 is not implemented"),
    ("qwen3_moe", "shared_expert_intermediate_size", 24, "no shared expert"),
    ("qwen3_moe", "hidden_act", "gelu", "hidden_act='gelu' is not implemented"),
    ("mixtral", "rope_parameters", {"rope_type": "linear", "factor": 2.0,
                                    "rope_theta": 1e4}, "unscaled RoPE"),
])
def test_what_tfllm_does_not_compute_is_refused(name, key, value, message, tmp_path):
    ref.save(name, tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config[key] = value
    path.write_text(json.dumps(config))
    with pytest.raises(PretrainedError, match=message):
        from_preset(str(tmp_path / "hf"))


def test_a_missing_expert_tensor_is_named(tmp_path):
    from safetensors.numpy import save_file
    ref.save("mixtral", tmp_path / "hf")
    tensors = ref.safetensors_of(tmp_path / "hf")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(PretrainedError, match=r"experts\.3\.w2\.weight"):
        from_preset(str(tmp_path / "hf"))
