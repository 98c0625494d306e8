"""Presets made by someone else: weight-map names and links confined to the preset folder.

Each crafted preset would import *successfully* without the checks (its weight map points
at a complete weights file outside the folder); with them `tfllm import` exits 2 with one
line naming the weight map and the name, and writes nothing.
"""

import json
import os
import shutil

import h5py
import pytest

from tfllm.cli.main import main
from tests.pretrained import helpers


def _import(capsys, preset, workdir):
    code = main(["import", "--preset", str(preset), "--workdir", str(workdir)])
    err = capsys.readouterr().err.strip()
    assert not os.path.exists(workdir) and not os.path.exists(str(workdir) + ".importing")
    return code, err


def _datasets(path):
    out = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda n, o: out.append(n) if isinstance(o, h5py.Dataset) else None)
    return out


@pytest.fixture(scope="module")
def gpt2_preset(tmp_path_factory):
    path = tmp_path_factory.mktemp("presets") / "gpt2"
    helpers.save_preset("gpt2", path)
    return path


def _copy(preset, to):
    shutil.copytree(preset, to)
    return to


@pytest.mark.parametrize("name", ["../outside.weights.h5", "/ABS/outside.weights.h5",
                                  "sub/../../outside.weights.h5"])
def test_keras_sharded_weight_map_names_stay_in_the_preset(gpt2_preset, tmp_path, capsys,
                                                           name):
    preset = _copy(gpt2_preset, tmp_path / "preset")
    outside = tmp_path / "outside.weights.h5"
    os.replace(preset / "model.weights.h5", outside)  # the complete weights, outside
    name = name.replace("/ABS", str(tmp_path))
    groups = {"/" + d.rsplit("/", 1)[0]: name for d in _datasets(outside)}
    (preset / "model.weights.json").write_text(json.dumps({"weight_map": groups}))
    code, err = _import(capsys, preset, tmp_path / "run")
    assert code == 2, err
    assert "model.weights.json" in err and repr(name) in err and "plain file name" in err
    assert len(err.splitlines()) == 1


def test_a_weights_file_linked_from_outside_is_refused(gpt2_preset, tmp_path, capsys):
    preset = _copy(gpt2_preset, tmp_path / "preset")
    outside = tmp_path / "outside.weights.h5"
    os.replace(preset / "model.weights.h5", outside)
    os.symlink(outside, preset / "model.weights.h5")
    code, err = _import(capsys, preset, tmp_path / "run")
    assert code == 2 and "'model.weights.h5' resolves to" in err and "(a symlink)" in err
    assert len(err.splitlines()) == 1


def test_hugging_face_index_names_stay_in_the_folder(tmp_path, capsys):
    from safetensors import safe_open
    helpers.save_huggingface("gpt2", tmp_path / "hf")
    outside = tmp_path / "outside.safetensors"
    os.replace(tmp_path / "hf" / "model.safetensors", outside)
    with safe_open(str(outside), framework="np") as f:
        keys = list(f.keys())
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "../outside.safetensors" for k in keys}}))
    code, err = _import(capsys, tmp_path / "hf", tmp_path / "run")
    assert code == 2, err
    assert "model.safetensors.index.json" in err and "'../outside.safetensors'" in err
    assert len(err.splitlines()) == 1


def _as_hf_cache(folder, cache):
    """`folder` laid out as huggingface_hub caches a download: every file a link from
    snapshots/REV/ to ../../blobs/HASH."""
    repository = cache / "models--org--tiny"
    snapshot = repository / "snapshots" / "0123abc"
    os.makedirs(repository / "blobs")
    os.makedirs(snapshot)
    for i, name in enumerate(sorted(os.listdir(folder))):
        os.replace(folder / name, repository / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / name)
    return snapshot


def test_a_hugging_face_cache_snapshot_imports_but_links_leave_only_into_its_blobs(
        tmp_path, capsys):
    # A download kept in huggingface_hub's cache (no --local-dir) is a folder of links
    # into the repository's blobs/: those are followed; a link out of the repository not.
    helpers.save_huggingface("gpt2", tmp_path / "hf")
    snapshot = _as_hf_cache(tmp_path / "hf", tmp_path / "cache")
    assert main(["import", "--preset", str(snapshot), "--workdir",
                 str(tmp_path / "run")]) == 0, capsys.readouterr().err
    outside = tmp_path / "outside.safetensors"
    os.replace(os.path.realpath(snapshot / "model.safetensors"), outside)
    os.remove(snapshot / "model.safetensors")
    os.symlink(outside, snapshot / "model.safetensors")
    code, err = _import(capsys, snapshot, tmp_path / "run2")
    assert code == 2 and "'model.safetensors' resolves to" in err, err
    assert len(err.splitlines()) == 1


@pytest.fixture
def unsafe_deserialization():
    """The process switched Keras' safe mode off (as a user's own script may), restored
    afterwards (Keras keeps the switch in its global state)."""
    import keras
    from keras.src.backend.common import global_state
    before = global_state.get_global_attribute("safe_mode_saving")
    keras.config.enable_unsafe_deserialization()
    yield
    global_state.set_global_attribute("safe_mode_saving", before)


def test_preset_tokenizers_load_in_safe_mode(gpt2_preset, tmp_path, capsys,
                                             unsafe_deserialization):
    from tfllm.data import DataError
    from tfllm.data.tokenizer import load_keras_hub_tokenizer
    assert load_keras_hub_tokenizer(str(gpt2_preset)).end_token_id is not None  # loads
    preset = _copy(gpt2_preset, tmp_path / "preset")
    # A tokenizer.json that is a serialized Python function (marshalled bytecode): safe
    # mode refuses it before decoding it; without safe mode Keras would unmarshal it.
    (preset / "tokenizer.json").write_text(json.dumps(
        {"class_name": "__lambda__", "config": {"value": "AAAA"}, "module": "builtins"}))
    with pytest.raises(DataError, match="Requested the deserialization of a Python lambda"):
        load_keras_hub_tokenizer(str(preset))
    code, err = _import(capsys, preset, tmp_path / "run")
    assert code == 2 and "Python lambda" in err and len(err.splitlines()) == 1
