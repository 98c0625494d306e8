"""Hugging Face folders with transformers itself as the reference.

Folders are written by transformers' `save_pretrained` (not by keras-hub, whose
converters tfllm shares): tfllm's import must give transformers' float32 logits and
greedy tokens, on one device and on a mesh, in both config layouts and from bfloat16
weights; `tfllm export --format hf` must load back in transformers (model and tokenizer)
with the same logits and write the source's tensors bit for bit.
"""

import json
import os
import re

import numpy as np
import pytest

from tfllm.cli.main import main
from tfllm.pretrained import from_preset
from tests.pretrained import helpers
from tests.pretrained import transformers_reference as ref


def _tfllm_logits(model, ids):
    return np.asarray(model(ids), np.float32)


_assert_same_model = ref.assert_same_model


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ref.MODELS))
def test_import_gives_transformers_logits(name, tmp_path):
    reference = ref.save(name, tmp_path / "hf")
    ids = helpers.token_ids()
    _assert_same_model(_tfllm_logits(from_preset(str(tmp_path / "hf")), ids),
                       ref.logits(reference, ids))


@pytest.mark.parametrize("name,kind", [("llama3", "llama3"), ("gemma3", "linear")])
def test_transformers4_config_layout_imports_the_same_model(tmp_path, name, kind):
    reference = ref.save(name, tmp_path / "hf", layout="transformers4")
    with open(tmp_path / "hf" / "config.json") as f:
        config = json.load(f)
    assert "rope_parameters" not in config and config["rope_scaling"]["rope_type"] == kind
    ids = helpers.token_ids()
    _assert_same_model(_tfllm_logits(from_preset(str(tmp_path / "hf")), ids),
                       ref.logits(reference, ids))


def test_bfloat16_checkpoint_is_read_exactly(tmp_path):
    # How almost every published checkpoint is stored: tfllm widens each bfloat16 value
    # exactly, so it computes what transformers computes from the same weights in float32.
    reference = ref.save("qwen2", tmp_path / "hf", dtype="bfloat16")
    stored = ref.safetensors_of(tmp_path / "hf")
    assert str(stored["model.embed_tokens.weight"].dtype) == "bfloat16"
    model = from_preset(str(tmp_path / "hf"))
    embedding = next(v for v in model.variables if v.path.endswith("token_embedding/embeddings"))
    np.testing.assert_array_equal(
        embedding.numpy(), stored["model.embed_tokens.weight"].astype(np.float32))
    ids = helpers.token_ids()
    _assert_same_model(_tfllm_logits(model, ids), ref.logits(reference, ids))


@pytest.mark.parametrize("name", ["llama3", "qwen3", "gemma3"])
def test_import_on_a_mesh_gives_transformers_logits(name, tmp_path):
    from tfllm.config import load_config
    from tfllm.parallel import make_parallel
    from tests.pretrained.logits import sharded_logits
    reference = ref.save(name, tmp_path / "hf")
    parallel = make_parallel(load_config(None, ["mesh.axes=data=2,model=4"]).mesh)
    model = from_preset(str(tmp_path / "hf"), parallel)
    ids = helpers.token_ids()
    _assert_same_model(sharded_logits(model, parallel, ids), ref.logits(reference, ids))


def _import_then_export(tmp_path, name, *export_args):
    ref.save(name, tmp_path / "hf")
    tokenizer = []
    if name in ("qwen2", "qwen3"):  # see ref.MODELS
        ref.keras_hub_tokenizer(ref.MODELS[name][2]).save_to_preset(str(tmp_path / "tok"))
        tokenizer = ["--tokenizer", str(tmp_path / "tok")]
    assert main(["import", "--preset", str(tmp_path / "hf"), "--workdir",
                 str(tmp_path / "run"), "--set", "mesh.axes=data=2,model=4",
                 *tokenizer]) == 0
    assert main(["export", "--workdir", str(tmp_path / "run"), "--out",
                 str(tmp_path / "out"), "--format", "hf", *export_args]) == 0
    return tmp_path / "hf", tmp_path / "out"


@pytest.mark.parametrize("name", ["gpt2", "llama3", "mistral", "qwen2", "qwen3", "gemma3"])
def test_export_hf_loads_in_transformers_and_writes_the_source_tensors(name, tmp_path):
    # Imported onto data=2,model=4, so the checkpoint holds each weight in blocks.
    source, out = _import_then_export(tmp_path, name)
    theirs, ours = ref.safetensors_of(source), ref.safetensors_of(out)
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    ids = helpers.token_ids()
    _assert_same_model(ref.logits(ref.load(out), ids), ref.logits(ref.load(source), ids))
    # the tokenizer loads in transformers and encodes like the run's own
    _, transformers = ref.load_torch_transformers()
    text = "Hello world, and a longer sentence."
    hub = ref.keras_hub_tokenizer(ref.MODELS[name][2])
    assert transformers.AutoTokenizer.from_pretrained(str(out)).encode(
        text, add_special_tokens=False) == [int(i) for i in np.asarray(hub(text))]
    with open(out / "generation_config.json") as f:
        assert set(json.load(f)) >= {"bos_token_id", "eos_token_id"}
    # export -> import is exact: the re-imported model computes the same logits
    np.testing.assert_array_equal(_tfllm_logits(from_preset(str(out)), ids),
                                  _tfllm_logits(from_preset(str(source)), ids))


def test_a_sentencepiece_mistral_folder_loads_its_tokenizer_in_any_registry_order(
        tmp_path, monkeypatch):
    # keras-hub registers two tokenizer classes for MistralBackbone (SentencePiece and
    # Tekken) and chose between them in the order of a set of classes, which changes from
    # process to process: CI once loaded this folder's tokenizer.model as Tekken and failed.
    # Both orders the set can give must load the SentencePiece tokenizer.
    import keras_hub
    from keras_hub.src.utils import preset_utils

    from tfllm.data.tokenizer import load_keras_hub_tokenizer
    ref.save("mistral", tmp_path / "hf")
    expected = np.asarray(ref.keras_hub_tokenizer("sentencepiece").tokenize("def main():"))
    registered = preset_utils.list_subclasses
    for order in (list, lambda classes: list(reversed(classes))):
        monkeypatch.setattr(preset_utils, "list_subclasses",
                            lambda cls, order=order: order(registered(cls)))
        tokenizer = load_keras_hub_tokenizer(str(tmp_path / "hf"))
        assert type(tokenizer) is keras_hub.models.MistralTokenizer
        np.testing.assert_array_equal(tokenizer.tokenize("def main():"), expected)


def test_export_hf_bfloat16_in_shards_with_an_index(tmp_path):
    source, out = _import_then_export(tmp_path, "llama3", "--dtype", "bfloat16",
                                      "--max-shard-size", "40KB")
    with open(out / "model.safetensors.index.json") as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files == sorted(n for n in os.listdir(out)
                                              if n.endswith(".safetensors"))
    for name in files:  # no shard above the limit unless one tensor is
        assert os.path.getsize(out / name) < 40_000 + 4096
    torch, _ = ref.load_torch_transformers()
    theirs, ours = ref.safetensors_of(source), ref.safetensors_of(out)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in ours.values())
    for key, value in theirs.items():  # round to nearest even, as torch does
        expected = torch.from_numpy(value).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(ours[key].astype(np.float32), expected, err_msg=key)
    with open(out / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    ref.load(out)  # transformers reads the sharded folder


# keras-hub's exporter used to delete whatever --out held before writing the preset, and
# the SavedModel export whatever --out named (a user's folder, the run, "/").
@pytest.mark.parametrize("fmt", ["hf", "keras-hub", "saved-model"])
def test_export_never_writes_into_an_existing_folder(tmp_path, capsys, fmt):
    from tests.harness import snapshot_tree
    ref.save("gpt2", tmp_path / "hf")
    assert main(["import", "--preset", str(tmp_path / "hf"), "--workdir",
                 str(tmp_path / "run")]) == 0
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    run = snapshot_tree(tmp_path / "run")
    for out, why in ((tmp_path / "out", "exists and is not empty"),
                     (tmp_path / "run", "is or holds the run"),
                     (tmp_path, "is or holds the run"),
                     (tmp_path / "run" / "checkpoints", "exists and is not empty"),
                     ("/", "is the filesystem root")):
        capsys.readouterr()
        code = main(["export", "--workdir", str(tmp_path / "run"), "--out", str(out),
                     "--format", fmt])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and why in err[0], (out, err)
    assert os.listdir(tmp_path / "out") == ["mine.txt"]
    assert snapshot_tree(tmp_path / "run") == run
    assert not [n for n in os.listdir(tmp_path) if "exporting" in n or "tmp-export" in n]


@pytest.mark.parametrize("name,key,value", [
    ("llama3", "attention_bias", True),
    ("llama3", "mlp_bias", True),
    ("llama3", "hidden_act", "gelu"),
    ("llama3", "head_dim", 8),
    ("qwen2", "hidden_act", "relu"),
    ("qwen3", "attention_bias", True),
    ("gpt2", "activation_function", "relu"),
    ("gpt2", "layer_norm_epsilon", 1e-6),
    ("gpt2", "scale_attn_by_inverse_layer_idx", True),
    ("gpt2", "tie_word_embeddings", False),
    ("llama3", "quantization_config", {"quant_method": "bitsandbytes"}),
    ("gemma3", "final_logit_softcapping", 30.0),
    ("gemma3", "attn_logit_softcapping", 50.0),
    ("gemma3", "hidden_activation", "gelu"),
    ("gemma3", "use_bidirectional_attention", True),
    ("gemma3", "layer_types", ["sliding_attention", "full_attention", "full_attention"]),
    ("gemma3", "rope_parameters", {"full_attention": {"rope_type": "yarn", "factor": 4.0,
                                                      "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default",
                                                         "rope_theta": 1e4}}),
])
def test_a_setting_keras_hub_would_drop_is_refused_naming_it(name, key, value, tmp_path):
    # keras-hub 0.32's converters read none of these: imported, each would compute other
    # logits than transformers without a word.
    from tfllm.families import PretrainedError
    ref.save(name, tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config[key] = value
    path.write_text(json.dumps(config))
    with pytest.raises(PretrainedError, match=re.escape(f"{key}={value!r}")):
        from_preset(str(tmp_path / "hf"))


def test_a_damaged_gemma3_config_is_one_error_naming_the_file(tmp_path):
    from tfllm.families import PretrainedError
    ref.save("gemma3", tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config["rope_parameters"] = {"full_attention": {"rope_type": "linear"},  # no factor
                                 "sliding_attention": {"rope_type": "default"}}
    path.write_text(json.dumps(config))
    with pytest.raises(PretrainedError, match="config.json: not a Gemma 3 text config"):
        from_preset(str(tmp_path / "hf"))
