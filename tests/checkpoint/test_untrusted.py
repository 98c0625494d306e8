"""Checkpoints made by someone else: names confined to the checkpoint, tampering vs. HMAC.

Each case saves a real checkpoint with the library's Checkpointer, then edits it the way
an attacker would: the edited manifest's hashes and COMMIT's manifest_sha256 recomputed,
so the sha256 chain alone accepts it.
"""

import hashlib
import json
import os
import tempfile
import types

import numpy as np
import pytest
import tensorflow as tf

from tfllm.checkpoint import Checkpointer, CheckpointError, Reader, verify
from tfllm.data import DataError
from tfllm.data.feed import DeviceFeed


def _vars(value=0.0):
    return {"w": tf.Variable(np.full((2, 3), value, np.float32))}


def _save(directory, step=1, files=None):
    Checkpointer(str(directory)).save(step, _vars(1.0), client_files=files or {
        "iterator.json": b'{"count": 2}'})
    return directory / f"step_{step:08d}"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _forge(root, edit):
    """Applies `edit(files)` to the manifest's file table, then re-signs the chain as
    anyone can: manifest.json rewritten, COMMIT's manifest_sha256 recomputed."""
    manifest = json.loads((root / "manifest.json").read_text())
    edit(manifest["files"])
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    (root / "manifest.json").write_bytes(data)
    commit = json.loads((root / "COMMIT").read_text())
    commit["manifest_sha256"] = _sha(data)
    (root / "COMMIT").write_text(json.dumps(commit))


def _add(name, data):
    def edit(files):
        files[name] = {"sha256": _sha(data), "bytes": len(data)}
    return edit


@pytest.mark.parametrize("name", [
    "client_00000/files/../../x/y",      # the attack verified in issue 24
    "client_00000/files/a/../../../../y",
    "/tmp/y",
    "client_00000/files//etc/y",
    "client_00000/files/./y",
    "client_00000/files\\..\\..\\y",
    "../y",
    "y.json",                             # not a name the writer gives
])
def test_manifest_names_outside_the_checkpoint_are_refused(tmp_path, name):
    root = _save(tmp_path / "ckpt")
    _forge(root, _add(name, b"payload"))
    with pytest.raises(CheckpointError) as error:
        Checkpointer(str(tmp_path / "ckpt")).restore(_vars())
    message = str(error.value)
    assert "manifest.json" in message and repr(name) in message and "\n" not in message
    with pytest.raises(CheckpointError):
        verify(str(root))
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_symlink_out_of_the_checkpoint_is_refused(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not yours")
    root = _save(tmp_path / "ckpt")
    link = root / "client_00000" / "files" / "iterator.json"
    os.remove(link)
    os.symlink(secret, link)
    _forge(root, _add("client_00000/files/iterator.json", secret.read_bytes()))
    with pytest.raises(CheckpointError, match="outside .* \\(a symlink\\)"):
        Reader(str(root))


def test_a_renamed_checkpoint_is_refused(tmp_path):
    root = _save(tmp_path)
    os.rename(root, tmp_path / "step_00000009")
    with pytest.raises(CheckpointError, match="holds step 1, but the directory is named for "
                                              "step 9"):
        Reader(str(tmp_path / "step_00000009"))


def _edit_metadata(root):
    """Tampering the sha256 chain cannot see: metadata.json changed, hashes recomputed."""
    data = json.dumps({"step": 1, "config": {"model": "evil"}}).encode()
    (root / "metadata.json").write_bytes(data)
    _forge(root, _add("metadata.json", data))


def test_checksums_do_not_catch_tampering_the_hmac_does(tmp_path, monkeypatch):
    monkeypatch.setenv("TFLLM_CHECKPOINT_KEY", "k1")
    root = _save(tmp_path)
    assert "manifest_hmac_sha256" in json.loads((root / "COMMIT").read_text())
    assert Reader(str(root)).metadata()["step"] == 1  # signed and verified
    _edit_metadata(root)
    with pytest.raises(CheckpointError, match="signature does not match "
                                              "TFLLM_CHECKPOINT_KEY"):
        Reader(str(root))
    monkeypatch.delenv("TFLLM_CHECKPOINT_KEY")
    assert Reader(str(root)).metadata()["config"] == {"model": "evil"}  # sha256 alone


def test_hmac_refuses_unsigned_and_other_keys(tmp_path, monkeypatch):
    unsigned = _save(tmp_path / "a")
    monkeypatch.setenv("TFLLM_CHECKPOINT_KEY", "k1")
    with pytest.raises(CheckpointError, match="not signed, but TFLLM_CHECKPOINT_KEY is set"):
        Reader(str(unsigned))
    signed = _save(tmp_path / "b")
    monkeypatch.setenv("TFLLM_CHECKPOINT_KEY", "k2")
    with pytest.raises(CheckpointError, match="signature does not match"):
        Reader(str(signed))


@pytest.mark.parametrize("name", ["../escaped", "iterator/../../escaped", "ABSOLUTE",
                                  "escaped", "iterator.json/x"])
def test_data_state_names_are_confined_to_the_private_temp_dir(tmp_path, monkeypatch, name):
    """DeviceFeed.restore_state writes the checkpoint's iterator files into a temporary
    directory: a name from the checkpoint never reaches outside it."""
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    name = str(tmp_path / "escaped") if name == "ABSOLUTE" else name
    monkeypatch.setattr(tempfile, "tempdir", str(sandbox))
    restored = []
    stand_in = types.SimpleNamespace(
        _train=types.SimpleNamespace(restore_state=restored.append), _peeked=None)
    with pytest.raises(DataError, match="data-iterator state: .* is not a file name"):
        DeviceFeed.restore_state(stand_in, {"iterator.json": b"{}", name: b"x"})
    assert not restored
    assert sorted(os.listdir(tmp_path)) == ["sandbox"] and os.listdir(sandbox) == []
    DeviceFeed.restore_state(stand_in, {"iterator.json": b"{}", "iterator.index": b""})
    assert len(restored) == 1 and restored[0].endswith("iterator")


def _forge_index(root, edit):
    """Applies `edit(variables)` to client 0's index.json, then recomputes its hash in the
    manifest and the chain above it (as anyone can)."""
    path = root / "client_00000" / "index.json"
    index = json.loads(path.read_text())
    edit(index["variables"])
    data = json.dumps(index).encode()
    path.write_bytes(data)
    _forge(root, _add("client_00000/index.json", data))


def _block(variables):
    return variables["w"]["blocks"][0]


@pytest.mark.parametrize("edit, fragment", [
    # a second block over the first: restored twice here, and the sum of sizes then
    # exceeds the shape (with the first halved, a gap is left that no block fills)
    (lambda v: v["w"]["blocks"].append(dict(_block(v))), "overlap"),
    (lambda v: _block(v).update(size=[1, 3], nbytes=12), "cover 3 of its 6 elements"),
    (lambda v: _block(v).update(start=[1, 0]), "reaches past its shape"),
    (lambda v: v["w"].update(shape=[2, 10 ** 20]), "cover 6 of its 2000000000"),
    (lambda v: v["w"].update(shape=[-2, 3]), "not a list of at most 8 sizes"),
    (lambda v: v["w"].update(dtype="object"), "not one tfllm saves"),
    (lambda v: v["w"].update(dtype={"a": 1}), "not one tfllm saves"),  # a TypeError before
    (lambda v: _block(v).update(offset=10 ** 12), "at offset 1000000000000"),
    (lambda v: _block(v).update(nbytes=4), "says 4 bytes"),
    (lambda v: _block(v).update(start="0"), "malformed block"),
])
def test_a_crafted_index_is_refused_before_a_block_is_read(tmp_path, edit, fragment):
    root = _save(tmp_path / "ckpt")
    _forge_index(root, edit)
    variables = _vars(7.0)
    with pytest.raises(CheckpointError, match="malicious") as error:
        Checkpointer(str(tmp_path / "ckpt")).restore(variables)
    assert fragment in str(error.value) and "\n" not in str(error.value)
    assert np.all(variables["w"].numpy() == 7.0)  # untouched


@pytest.mark.parametrize("name", ["metadata.json", "COMMIT", "client_00000/shards.bin"])
def test_a_checkpoint_file_that_is_a_fifo_is_refused_without_blocking(tmp_path, name):
    root = _save(tmp_path / "ckpt")
    os.remove(root / name)
    os.mkfifo(root / name)  # opened as a file, it would wait for a writer forever
    with pytest.raises((CheckpointError, FileNotFoundError)) as error:
        Reader(str(root)).metadata()
    assert "FIFO" in str(error.value) or name == "COMMIT"


def _forge_manifest(root, edit):
    """Applies `edit(manifest)` to manifest.json (raw text in, text out), then recomputes
    COMMIT's manifest_sha256 (as anyone can)."""
    data = edit((root / "manifest.json").read_text()).encode()
    (root / "manifest.json").write_bytes(data)
    commit = json.loads((root / "COMMIT").read_text())
    commit["manifest_sha256"] = _sha(data)
    (root / "COMMIT").write_text(json.dumps(commit))


def _manifest_field(key, value):
    def edit(text):
        manifest = json.loads(text)
        manifest[key] = "@@"
        return json.dumps(manifest).replace('"@@"', value)
    return edit


@pytest.mark.parametrize("edit, fragment", [
    (_manifest_field("step", "Infinity"), "Infinity"),
    (_manifest_field("step", "NaN"), "NaN"),
    (_manifest_field("step", "1.5"), "step is 1.5"),
    (_manifest_field("step", '"1"'), "step is 1"),
    (_manifest_field("step", "1e400"), "step is inf"),
    (_manifest_field("num_clients", "1000000000"), "num_clients is 1000000000"),
    (_manifest_field("files", "5"), "malformed"),
    (lambda text: "[" * 100_000 + "]" * 100_000, "nested too deep"),
    (lambda text: "[1, 2]", "malformed"),
])
def test_a_crafted_manifest_is_one_checkpoint_error(tmp_path, edit, fragment):
    root = _save(tmp_path / "ckpt")
    _forge_manifest(root, edit)
    variables = _vars(7.0)
    with pytest.raises(CheckpointError, match="malicious") as error:
        Checkpointer(str(tmp_path / "ckpt")).restore(variables)
    assert fragment in str(error.value) and "\n" not in str(error.value), str(error.value)
    assert np.all(variables["w"].numpy() == 7.0)  # untouched


@pytest.mark.parametrize("metadata, fragment", [
    ("[1, 2]", "a JSON list, not an object"),
    ('"step"', "a JSON str, not an object"),
    ('{"step": 2}', "is not the manifest's 1"),
    ('{"step": Infinity}', "Infinity"),
    ('{"step": 1, "config": "evil"}', "config is not an object"),
    ('{"step": 1, "tokenizer": 5}', "tokenizer fingerprint"),
    ("[" * 100_000 + "]" * 100_000, "nested too deep"),
])
def test_crafted_metadata_is_one_checkpoint_error(tmp_path, metadata, fragment):
    root = _save(tmp_path / "ckpt")
    (root / "metadata.json").write_text(metadata)
    _forge(root, _add("metadata.json", metadata.encode()))
    with pytest.raises(CheckpointError, match="malicious") as error:
        Reader(str(root)).metadata()
    assert fragment in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_fuzzed_checkpoint_json_is_one_checkpoint_error_or_restores(tmp_path):
    """Seeded fuzz of the JSON files a reader parses (COMMIT, manifest, index, metadata):
    truncations, type swaps, huge and non-finite numbers; each re-signed as anyone can.
    A restore raises one CheckpointError line (or restores); never another exception."""
    import random
    rng = random.Random(48)
    swaps = ["null", "[]", "{}", '"x"', "1.5", "-1", "1e999", "NaN", "Infinity", "true",
             "123456789012345678901234567890", "[[[[[[]]]]]]", '{"a": 1}', "0"]
    for case in range(80):
        root = _save(tmp_path / f"c{case}")
        target = rng.choice(["manifest.json", "metadata.json", "client_00000/index.json",
                             "COMMIT"])
        text = (root / target).read_text()
        if rng.random() < 0.3:
            text = text[:rng.randrange(len(text))]
        else:  # one JSON value replaced by another type
            spans = [(m.start(), m.end()) for m in __import__("re").finditer(
                r'"[^"]*"|-?\d+(?:\.\d+)?|\[\]|\{\}|true|false|null', text)]
            start, end = rng.choice(spans)
            text = text[:start] + rng.choice(swaps) + text[end:]
        if target == "manifest.json":
            _forge_manifest(root, lambda _: text)
        elif target == "COMMIT":  # the top of the chain: nothing to recompute
            (root / target).write_text(text)
        else:
            (root / target).write_text(text)
            _forge(root, _add(target, text.encode()))
        variables = _vars(7.0)
        try:
            Checkpointer(str(tmp_path / f"c{case}")).restore(variables)
        except CheckpointError as error:
            assert "\n" not in str(error), str(error)
