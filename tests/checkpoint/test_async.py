"""Asynchronous saves: same bytes as synchronous ones, values of the step, errors surface."""

import threading

import numpy as np
import pytest
import tensorflow as tf

from tfllm.checkpoint import Checkpointer, CheckpointError, storage
from tfllm.config.schema import CheckpointConfig

ASYNC = CheckpointConfig(async_save=True)


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_async_writes_the_same_bytes_as_sync(tmp_path, source_run):
    parallel, variables, _ = source_run
    Checkpointer(str(tmp_path / "sync"), parallel).save(2, variables, {"a": 1}, {"f": b"x"})
    ckpt = Checkpointer(str(tmp_path / "async"), parallel, ASYNC)
    ckpt.save(2, variables, {"a": 1}, {"f": b"x"})
    ckpt.wait()
    sync, asyn = (_files(tmp_path / d / "step_00000002") for d in ("sync", "async"))
    assert sorted(sync) == sorted(asyn)
    # COMMIT differs by the save's nonce only.
    assert all(sync[n] == asyn[n] for n in sync if n != "COMMIT")


def test_async_saves_the_values_of_the_step(tmp_path):
    var = tf.Variable(np.arange(6, dtype=np.float32))
    ckpt = Checkpointer(str(tmp_path), config=ASYNC)
    ckpt.save(1, {"w": var})
    var.assign(tf.zeros(6))  # training goes on while the thread writes
    ckpt.wait()
    ckpt.restore_latest({"w": var})
    np.testing.assert_array_equal(var.numpy(), np.arange(6, dtype=np.float32))


CALLED = threading.Event()


def _failing_write(*args, **kwargs):
    CALLED.set()
    raise OSError("disk full (injected)")


def test_async_error_surfaces_at_wait(tmp_path, monkeypatch):
    ckpt = Checkpointer(str(tmp_path), config=ASYNC)
    monkeypatch.setattr(storage, "write_client", _failing_write)
    ckpt.save(1, {"w": tf.Variable(1.0)})  # returns: the error happens in the thread
    with pytest.raises(CheckpointError, match="disk full"):
        ckpt.wait()
    ckpt.wait()  # reported once
    assert ckpt.latest_step() is None
    assert Checkpointer(str(tmp_path)).removed  # the partial tmp dir is cleaned at start


def test_async_error_surfaces_at_the_next_save(tmp_path, monkeypatch):
    ckpt = Checkpointer(str(tmp_path), config=ASYNC)
    monkeypatch.setattr(storage, "write_client", _failing_write)
    CALLED.clear()
    ckpt.save(1, {"w": tf.Variable(1.0)})
    assert CALLED.wait(60)  # the thread hit the injected error before the patch is undone
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="disk full"):
        ckpt.save(2, {"w": tf.Variable(1.0)})
    ckpt.save(3, {"w": tf.Variable(1.0)})
    ckpt.wait()
    assert ckpt.latest_step() == 3

