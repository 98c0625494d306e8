"""Atomic commit, cleanup, max_to_keep, corruption detection and fallback."""

import errno
import json
import os
import shutil
import threading

import numpy as np
import pytest
import tensorflow as tf

from tfllm.checkpoint import Checkpointer, CheckpointError, cleanup, latest, verify
from tfllm.checkpoint import checkpointer, storage
from tfllm.config.schema import CheckpointConfig
from tfllm.contracts import io_failure


def _vars(value=0.0):
    return {"w": tf.Variable(np.full((4, 8), value, np.float32)),
            "step": tf.Variable(np.int64(value))}


def _value(variables):
    return float(variables["w"].numpy()[0, 0])


def test_partial_checkpoints_are_ignored_and_cleaned(tmp_path):
    Checkpointer(str(tmp_path)).save(10, _vars(1.0))
    # A save that crashed before commit (tmp dir), one renamed but without COMMIT, and
    # one with a torn COMMIT rename (only COMMIT.part).
    shutil.copytree(tmp_path / "step_00000010", tmp_path / "step_00000020.tmp-0badc0de")
    shutil.copytree(tmp_path / "step_00000010", tmp_path / "step_00000030")
    os.remove(tmp_path / "step_00000030" / "COMMIT")
    shutil.copytree(tmp_path / "step_00000030", tmp_path / "step_00000040")
    (tmp_path / "step_00000040" / "COMMIT.part").write_text("{")
    assert latest(str(tmp_path)) == str(tmp_path / "step_00000010")
    removed = cleanup(str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == [
        "step_00000020.tmp-0badc0de", "step_00000030", "step_00000040"]
    assert sorted(os.listdir(tmp_path)) == ["step_00000010"]


def test_checkpointer_cleans_up_on_start(tmp_path):
    os.makedirs(tmp_path / "step_00000005.tmp-12345678" / "client_00000")
    ckpt = Checkpointer(str(tmp_path))
    assert ckpt.latest_step() is None and os.listdir(tmp_path) == []


def test_max_to_keep_deletes_the_oldest(tmp_path):
    ckpt = Checkpointer(str(tmp_path), config=CheckpointConfig(max_to_keep=2))
    for step in (1, 2, 3, 4):
        ckpt.save(step, _vars(step))
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000004"]
    assert ckpt.latest_step() == 4


def test_resaving_a_step_replaces_it(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, _vars(1.0))
    ckpt.save(1, _vars(2.0))
    target = _vars()
    ckpt.restore_latest(target)
    assert _value(target) == 2.0 and os.listdir(tmp_path) == ["step_00000001"]


def _corrupt(path, how):
    data = bytearray(open(path, "rb").read())
    if how == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 3] ^= 0x01
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("rel,how", [("client_00000/shards.bin", "truncate"),
                                     ("client_00000/shards.bin", "flip"),
                                     ("client_00000/index.json", "flip"),
                                     ("metadata.json", "truncate"),
                                     ("manifest.json", "flip")])
def test_corruption_is_an_error_naming_the_file(tmp_path, rel, how):
    Checkpointer(str(tmp_path)).save(1, _vars(1.0), {"note": "x" * 100})
    path = tmp_path / "step_00000001" / rel
    _corrupt(path, how)
    target = _vars()
    with pytest.raises(CheckpointError, match=str(path)):
        Checkpointer(str(tmp_path)).restore_latest(target)
    assert _value(target) == 0.0  # nothing was assigned from the corrupt checkpoint
    with pytest.raises(CheckpointError, match=str(path)):
        verify(str(tmp_path / "step_00000001"))


def test_fallback_restores_the_previous_checkpoint_with_a_warning(tmp_path):
    Checkpointer(str(tmp_path)).save(1, _vars(1.0))
    Checkpointer(str(tmp_path)).save(2, _vars(2.0))
    _corrupt(tmp_path / "step_00000002" / "client_00000" / "shards.bin", "flip")
    target = _vars()
    with pytest.raises(CheckpointError, match="shards.bin"):
        Checkpointer(str(tmp_path), config=CheckpointConfig(on_corruption="error")
                     ).restore_latest(target)
    fallback = Checkpointer(str(tmp_path), config=CheckpointConfig(on_corruption="fallback"))
    with pytest.warns(RuntimeWarning, match="step 2 failed verification.*shards.bin"):
        metadata = fallback.restore_latest(target)
    assert metadata["step"] == 1 and _value(target) == 1.0


def test_fallback_fails_when_every_checkpoint_is_corrupt(tmp_path):
    Checkpointer(str(tmp_path)).save(1, _vars(1.0))
    _corrupt(tmp_path / "step_00000001" / "client_00000" / "shards.bin", "truncate")
    ckpt = Checkpointer(str(tmp_path), config=CheckpointConfig(on_corruption="fallback"))
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointError, match="every committed"):
        ckpt.restore_latest(_vars())


def test_manifest_lists_every_file_with_its_hash(tmp_path):
    Checkpointer(str(tmp_path)).save(3, _vars(1.0), client_files={"a/b.txt": b"hi"})
    root = tmp_path / "step_00000003"
    manifest = json.loads((root / "manifest.json").read_text())
    on_disk = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert on_disk - set(manifest["files"]) == {"COMMIT", "manifest.json"}
    assert manifest["files"]["client_00000/files/a/b.txt"]["bytes"] == 2
    assert verify(str(root))


def test_bad_client_file_names_and_metadata_are_rejected(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    with pytest.raises(CheckpointError, match="'../x' is not a relative path"):
        ckpt.save(1, _vars(), client_files={"../x": b""})
    with pytest.raises(CheckpointError, match="leave 'step' out"):
        ckpt.save(1, _vars(), metadata={"step": 2})


@pytest.mark.parametrize("failure, io", [
    (OSError(errno.ENOSPC, "No space left on device", "manifest.json"), True),
    (OSError(errno.EACCES, "Permission denied", "manifest.json"), True),
    (CheckpointError("timed out waiting for the done.* tokens"), False),
])
def test_the_waiting_clients_fail_as_client_0_does(tmp_path, monkeypatch, failure, io):
    """Client 0's commit fails: client 1, waiting for it, fails at once with an error the
    command maps to the same exit code (74 for a failed storage, else 2)."""
    monkeypatch.setattr(checkpointer, "agree_nonce", lambda mesh, n: "0badc0de")

    def commit(*args, **kwargs):
        raise failure
    monkeypatch.setattr(storage, "commit", commit)
    errors = {}
    # Built before either saves, client 0 first, as in a run: client 0's constructor
    # removes uncommitted saves, which must not race with client 1's writing (the save's
    # collective nonce, replaced here, orders them in a run).
    checkpointers = [Checkpointer(str(tmp_path), client_id=client, num_clients=2,
                                  barrier_timeout_s=60) for client in (0, 1)]

    def save(client):
        try:
            checkpointers[client].save(1, _vars(1.0))
        except CheckpointError as e:
            errors[client] = e
    other = threading.Thread(target=save, args=(1,))
    other.start()
    save(0)
    other.join(timeout=60)
    assert sorted(errors) == [0, 1]
    assert [io_failure(errors[c]) is not None for c in (0, 1)] == [io, io]
    assert "client 0 failed to commit step 1" in str(errors[1])
    assert str(failure) in str(errors[1])
    if io:
        assert io_failure(errors[1]).errno == failure.errno
    assert latest(str(tmp_path)) is None


def test_a_failure_marker_without_its_text_still_says_the_storage_failed(tmp_path):
    # A full disk may let the marker be created but not written.
    (tmp_path / storage.FAILED_IO).write_text("")
    with pytest.raises(CheckpointError, match="no details were written") as caught:
        storage.wait_committed(str(tmp_path), str(tmp_path), 1, "0badc0de", timeout_s=5)
    assert io_failure(caught.value).errno == errno.EIO


def test_a_failure_marker_appears_with_its_text(tmp_path, monkeypatch):
    """The marker's name appears only with its text (a waiting client polls for the name
    and once read it empty, CI's flake): written beside it, then renamed."""
    seen = []
    replace = os.replace

    def watched(src, dst, **dir_fds):  # names inside tmp_path (tfllm.files renames by fd)
        seen.append((os.path.exists(tmp_path / dst),
                     json.loads((tmp_path / src).read_text())["errno"]))
        replace(src, dst, **dir_fds)
    monkeypatch.setattr(os, "replace", watched)
    storage.mark_failed(str(tmp_path), OSError(errno.ENOSPC, "full"),
                        OSError(errno.ENOSPC, "full"))
    assert seen == [(False, errno.ENOSPC)]
    assert sorted(os.listdir(tmp_path)) == [storage.FAILED_IO]
    with pytest.raises(CheckpointError, match="full") as caught:
        storage.wait_committed(str(tmp_path), str(tmp_path), 1, "0badc0de", timeout_s=5)
    assert io_failure(caught.value).errno == errno.ENOSPC
