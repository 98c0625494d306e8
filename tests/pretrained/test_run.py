"""`tfllm import` -> generate / train / export, and bad input, through the CLI entry."""

import json
import os

import numpy as np
import pytest

from tfllm.cli.main import main
from tfllm.config import load_config
from tfllm.pretrained import from_preset
from tests.harness import write_text_corpus
from tests.pretrained import helpers


def _import(preset, workdir, *extra):
    return main(["import", "--preset", str(preset), "--workdir", str(workdir), *extra])


def _weights(model):
    prefix = model.name + "/"
    return {v.path[len(prefix):]: np.asarray(v.numpy()) for v in model.variables}


def _restored(workdir, overrides=()):
    """The model of a run directory's latest checkpoint, on one device."""
    from tfllm.checkpoint import Checkpointer, run_state_variables
    from tfllm.models import build_model
    config = load_config(str(workdir / "config.yaml"), list(overrides))
    model = build_model(config.model, config.precision, config.lora, seed=config.train.seed)
    Checkpointer(str(workdir / "checkpoints"), None).restore_latest(
        run_state_variables(model), strict=False)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3", "gpt2"])
def test_import_generates_like_keras_hub_greedy(name, tmp_path, capsys):
    lm = helpers.save_preset(name, tmp_path / "preset")
    assert _import(tmp_path / "preset", tmp_path / "run", "--set",
                   "mesh.axes=data=2,model=4") == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["backbone"] == type(lm.backbone).__name__
    assert summary["mesh"] == {"data": 2, "model": 4}
    assert sorted(os.listdir(tmp_path / "run")) == [".tfllm-run", "checkpoints", "config.yaml",
                                                    "pretrained.json", "tokenizer"]
    config = (tmp_path / "run" / "config.yaml").read_text()
    if name == "llama3":
        assert "rope_scaling: llama3" in config and "norm_epsilon: 1.0e-06" in config

    # keras-hub's greedy generation from the same prompt ids, 12 new tokens
    from tfllm.generate import Generator
    prompt = [5, 17, 30, 2, 9]
    total = len(prompt) + 12
    lm.preprocessor = None
    lm.compile(sampler="greedy")
    padded = np.zeros((1, total), "int32")
    padded[0, :len(prompt)] = prompt
    mask = np.zeros((1, total), bool)
    mask[0, :len(prompt)] = True
    theirs = lm.generate({"token_ids": padded, "padding_mask": mask}, stop_token_ids=None)
    theirs = [int(t) for t in np.asarray(theirs["token_ids"])[0, len(prompt):]]
    model = _restored(tmp_path / "run")
    ours = Generator(model, None, jit_compile=False).generate(prompt, 12)
    assert [int(t) for t in ours] == theirs

    # the CLI generates text with the imported tokenizer, on a mesh
    assert main(["generate", "--workdir", str(tmp_path / "run"), "--prompt", "the cat",
                 "--max-new-tokens", "4", "--set", "mesh.axes=model=4"]) == 0
    assert capsys.readouterr().out.startswith("the cat")


@pytest.mark.slow
def test_fine_tune_starts_from_the_imported_weights_then_resumes_normally(tmp_path):
    helpers.save_preset("gpt2", tmp_path / "preset")
    assert _import(tmp_path / "preset", tmp_path / "run") == 0
    imported = _weights(_restored(tmp_path / "run"))
    write_text_corpus(tmp_path / "text")
    common = ["--set", "data.source=text", "--set", f"data.paths=[{tmp_path}/text/*.txt]",
              "--set", "data.sequence_length=16", "--set", "train.global_batch_size=4",
              "--set", "mesh.axes=data=2", "--set", "train.sample_tokens=0",
              "--set", "train.eval_every=0", "--set", "train.eval_steps=1"]
    # Learning rate 0: the fine-tuned weights must be the imported ones, bit for bit.
    assert main(["train", "--workdir", str(tmp_path / "run"), "--set", "train.steps=2",
                 "--set", "optimizer.learning_rate=0", *common]) == 0
    after = _weights(_restored(tmp_path / "run"))
    assert after.keys() == imported.keys()
    for name in imported:
        np.testing.assert_array_equal(after[name], imported[name], err_msg=name)
    # Now a normal run: it resumes (step 2 -> 4) and refuses changed data settings.
    assert main(["train", "--workdir", str(tmp_path / "run"), "--set", "train.steps=4",
                 "--set", "optimizer.learning_rate=0", *common]) == 0
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines() if '"loss"' in l]
    assert records[-1]["step"] == 4
    assert main(["train", "--workdir", str(tmp_path / "run"), "--set", "train.steps=6",
                 "--set", "optimizer.learning_rate=0", *common,
                 "--set", "data.sequence_length=8"]) == 2


@pytest.mark.slow  # keras-hub's generate compiles its sampler through XLA (~30 s)
@pytest.mark.parametrize("name", ["llama3", "gpt2", "gemma3"])
def test_export_keras_hub_loads_in_keras_hub_and_round_trips_bit_exactly(name, tmp_path):
    import keras_hub
    helpers.save_preset(name, tmp_path / "preset")
    assert _import(tmp_path / "preset", tmp_path / "run") == 0
    assert main(["export", "--workdir", str(tmp_path / "run"), "--format", "keras-hub",
                 "--out", str(tmp_path / "out")]) == 0
    reloaded = keras_hub.models.CausalLM.from_preset(str(tmp_path / "out"))
    ids = helpers.token_ids()
    model = _restored(tmp_path / "run")
    np.testing.assert_allclose(np.asarray(model(ids)), helpers.keras_hub_logits(reloaded, ids),
                               atol=2e-5, rtol=0)  # float32 on both sides, as test_import
    if name != "gemma3":  # its tokenizer (200 pieces) is smaller than the model's 288
        # ids, and keras-hub's own SentencePiece decoding fails on the ids past it
        assert reloaded.generate("the cat", max_length=12)  # keras-hub generates with it
    again = _weights(from_preset(str(tmp_path / "out")))
    first = _weights(model)
    assert again.keys() == first.keys()
    for key in first:
        np.testing.assert_array_equal(again[key], first[key], err_msg=key)  # bit-exact


# ---- bad input: exit 2, a message naming the file and tensor, nothing written --------------
def _fails(capsys, preset, workdir, *extra):
    assert _import(preset, workdir, *extra) == 2
    err = capsys.readouterr().err
    assert not os.path.exists(workdir) and not os.path.exists(str(workdir) + ".importing")
    return err


def test_unknown_family_lists_the_supported_ones(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    err = _fails(capsys, tmp_path / "hf", tmp_path / "run")
    assert "falcon" in err and "Llama3Backbone" in err and "GPT2Backbone" in err
    gemma = keras_hub_gemma(tmp_path / "gemma")
    err = _fails(capsys, gemma, tmp_path / "run")
    assert "GemmaBackbone is not an architecture tfllm can hold" in err


def keras_hub_gemma(path):
    import keras_hub
    keras_hub.models.GemmaBackbone(vocabulary_size=16, num_layers=1, num_query_heads=2,
                                   num_key_value_heads=1, hidden_dim=8, intermediate_dim=16,
                                   head_dim=4).save_to_preset(str(path))
    return path


def test_missing_tensor_names_it_and_the_file(tmp_path, capsys):
    import h5py
    helpers.save_preset("llama3", tmp_path / "preset")
    weights = tmp_path / "preset" / "model.weights.h5"
    with h5py.File(weights, "a") as f:
        name = [n for n in _datasets(f) if "_query_dense" in n][0]
        del f[name]
    err = _fails(capsys, tmp_path / "preset", tmp_path / "run")
    assert str(weights) in err and name in err and "missing" in err


def _datasets(f):
    out = []
    f.visititems(lambda n, o: out.append(n) if hasattr(o, "shape") else None)
    return out


def test_shape_mismatch_names_the_tensor(tmp_path, capsys):
    helpers.save_preset("llama3", tmp_path / "preset")
    config = json.loads((tmp_path / "preset" / "config.json").read_text())
    config["config"]["intermediate_dim"] = 48  # the weights have 64
    (tmp_path / "preset" / "config.json").write_text(json.dumps(config))
    err = _fails(capsys, tmp_path / "preset", tmp_path / "run")
    assert "feedforward_output_dense" in err and "[64, 32]" in err and "[48, 32]" in err


def test_hugging_face_dtype_and_missing_tensor(tmp_path, capsys):
    from safetensors.numpy import load_file, save_file
    helpers.save_huggingface("llama3", tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.1.mlp.up_proj.weight"] = \
        tensors["model.layers.1.mlp.up_proj.weight"].astype(np.int32)
    save_file(tensors, str(path))
    err = _fails(capsys, tmp_path / "hf", tmp_path / "run")
    assert "model.layers.1.mlp.up_proj.weight" in err and "int32" in err
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path))
    err = _fails(capsys, tmp_path / "hf", tmp_path / "run")
    assert "model.layers.1.mlp.up_proj.weight" in err


def test_an_existing_run_is_never_overwritten(tmp_path, capsys):
    helpers.save_preset("gpt2", tmp_path / "preset")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    assert _import(tmp_path / "preset", tmp_path / "run") == 2
    assert "not empty" in capsys.readouterr().err
    assert os.listdir(tmp_path / "run") == ["metrics.jsonl"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_clients_import_each_reading_its_own_blocks(tmp_path):
    """2 real clients x 4 devices import onto fsdp=8: each reads only its half of every
    sharded weight, and the run restores in one process to exactly the preset."""
    from tests.harness import run_clients, tfllm_command
    helpers.save_preset("llama3", tmp_path / "preset")
    reports = run_clients(tfllm_command("import", "--preset", str(tmp_path / "preset"),
                                        "--workdir", str(tmp_path / "run"),
                                        "--set", "mesh.axes=fsdp=8"), clients=2)
    reference = from_preset(str(tmp_path / "preset"))
    total = sum(int(np.prod(v.shape)) * 4 for v in reference.variables)
    replicated = sum(int(np.prod(v.shape)) * 4 for v in reference.variables
                     if v.path.endswith("/scale"))  # norms: not sharded, read by both
    for r in reports:
        assert r["bytes_read"] == (total - replicated) // 2 + replicated
    restored = _weights(_restored(tmp_path / "run"))
    for name, value in _weights(reference).items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)


@pytest.mark.slow
def test_hugging_face_llama_on_a_mesh_fine_tunes_generates_and_exports(tmp_path, capsys):
    """The issue's end-to-end path: a Hugging Face Llama 3.1-style folder onto
    data=2,model=4, a few fine-tuning steps there, generation, keras-hub export."""
    import keras_hub
    helpers.save_huggingface("llama3", tmp_path / "hf")
    mesh = ["--set", "mesh.axes=data=2,model=4"]
    assert _import(tmp_path / "hf", tmp_path / "run", *mesh) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["format"] == "huggingface"
    write_text_corpus(tmp_path / "text")
    assert main(["train", "--workdir", str(tmp_path / "run"), *mesh,
                 "--set", "data.source=text", "--set", f"data.paths=[{tmp_path}/text/*.txt]",
                 "--set", "data.sequence_length=16", "--set", "train.global_batch_size=4",
                 "--set", "train.steps=3", "--set", "train.sample_tokens=0",
                 "--set", "optimizer.learning_rate=1e-3", "--set", "train.eval_steps=1"]) == 0
    capsys.readouterr()
    steps = [json.loads(l)["step"] for l in (tmp_path / "run" / "metrics.jsonl").read_text()
             .splitlines() if '"loss"' in l]
    assert steps[0] == 1 and steps[-1] == 3  # a new run from the imported weights
    assert main(["generate", "--workdir", str(tmp_path / "run"), *mesh, "--prompt", "the dog",
                 "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("the dog")
    assert main(["export", "--workdir", str(tmp_path / "run"), "--format", "keras-hub",
                 "--out", str(tmp_path / "out")]) == 0
    reloaded = keras_hub.models.CausalLM.from_preset(str(tmp_path / "out"))
    assert type(reloaded.backbone).__name__ == "Llama3Backbone"
    ids = helpers.token_ids()
    trained = _restored(tmp_path / "run")
    np.testing.assert_allclose(np.asarray(trained(ids)), helpers.keras_hub_logits(reloaded, ids),
                               atol=2e-5, rtol=0)  # as in test_import


def test_an_interrupted_import_leaves_no_folder(tmp_path, monkeypatch, capsys):
    # SIGTERM in `tfllm import` unwinds as Ctrl-C does (tfllm.cli.main turns it into a
    # KeyboardInterrupt: tests/cli/test_paths_and_failures.py sends the real signal to an
    # export): raised while the weights load, after WORKDIR.importing holds the marker,
    # the tokenizer and the template files, it leaves neither that folder nor the run.
    from tfllm.pretrained import importer
    helpers.save_preset("gpt2", tmp_path / "preset")
    seen = []

    def interrupted(model, source):
        seen.append(sorted(os.listdir(str(tmp_path / "run") + ".importing")))
        raise KeyboardInterrupt
    monkeypatch.setattr(importer, "load_weights", interrupted)
    from tfllm.contracts import HARD_STOP_EXIT_CODE
    assert _import(tmp_path / "preset", tmp_path / "run") == HARD_STOP_EXIT_CODE
    assert "tfllm import: interrupted" in capsys.readouterr().err
    assert seen and seen[0]  # the import's folder existed, with files, when interrupted
    assert sorted(os.listdir(tmp_path)) == ["preset"]
