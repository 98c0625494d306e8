"""Round trips and restores onto other meshes: bit-identical global values."""

import numpy as np
import pytest
import tensorflow as tf

from tfllm.checkpoint import Checkpointer, CheckpointError, Reader, state_name
from tfllm.config.schema import CheckpointConfig
from tests.checkpoint.helpers import assert_same, build_run, gathered


def test_state_name_is_the_one_naming_of_the_run_state():
    # The checkpoints' on-disk names: old checkpoints load only while these stay.
    assert state_name("model", "gpt/block_0/mlp/kernel") == "model/gpt/block_0/mlp/kernel"
    assert state_name("optimizer/m", "gpt/a/kernel") == "optimizer/m/gpt/a/kernel"
    assert state_name("optimizer/v", "gpt/a/kernel") == "optimizer/v/gpt/a/kernel"
    assert state_name("optimizer/iterations") == "optimizer/iterations"
    assert state_name("train/guard_skipped") == "train/guard_skipped"
    for group, path in (("optimizer", "a"), ("model", None), ("optimizer/iterations", "a"),
                        ("loss_scale", None)):
        with pytest.raises(ValueError, match="a run-state variable is one of"):
            state_name(group, path)


def test_run_state_names_cover_model_optimizer_and_loss_scale(source_run):
    _, variables, values = source_run
    assert "optimizer/iterations" in variables and "loss_scale/scale" in variables
    model = [n for n in variables if n.startswith("model/")]
    assert len([n for n in variables if n.startswith("optimizer/m/")]) == len(model)
    assert values["optimizer/iterations"] == 1  # one step taken: the states are not zeros
    assert all(np.any(values[n] != 0) for n in variables if n.startswith("optimizer/v/"))


def test_round_trip_same_mesh(tmp_path, source_run):
    parallel, variables, values = source_run
    ckpt = Checkpointer(str(tmp_path), parallel)
    ckpt.save(5, variables, {"seed": 1}, {"data/iterator.json": b'{"pos": 3}'})
    _, parallel2, fresh = build_run("data=2,model=4")
    restorer = Checkpointer(str(tmp_path), parallel2)
    files = []
    assert restorer.restore_latest(fresh, client_files=files.append) == {"seed": 1, "step": 5}
    assert files == [{"data/iterator.json": b'{"pos": 3}'}]
    assert_same(gathered(fresh), values)


def test_each_shard_is_written_once(tmp_path, source_run):
    """Replicas are deduplicated: the saved blocks of every variable tile it exactly."""
    parallel, variables, _ = source_run
    Checkpointer(str(tmp_path), parallel).save(1, variables)
    reader = Reader(str(tmp_path / "step_00000001"))
    for name, entry in reader.variables.items():
        elements = sum(int(np.prod(b["size"])) for b in entry["blocks"])
        assert elements == int(np.prod(entry["shape"])), name
    # The replicated scalar step counter: one block, not one per device.
    assert len(reader.variables["optimizer/iterations"]["blocks"]) == 1


@pytest.mark.parametrize("axes,extra", [("fsdp=8", {}), ("model=8", {}), (None, {}),
                                        ("data=4,model=2",
                                         {"optimizer.shard_optimizer_state": True})])
def test_restore_onto_another_mesh(tmp_path_factory, source_run, axes, extra):
    parallel, variables, values = source_run
    directory = tmp_path_factory.getbasetemp() / "data2_model4"
    if not directory.exists():
        Checkpointer(str(directory), parallel).save(1, variables)
    _, target_parallel, fresh = build_run(axes, **extra)
    Checkpointer(str(directory), target_parallel).restore_latest(fresh)
    assert_same(gathered(fresh), values)


def _plain(**shapes_dtypes):
    return {n: tf.Variable(np.arange(np.prod(s)).reshape(s).astype(d))
            for n, (s, d) in shapes_dtypes.items()}


def test_shape_and_dtype_mismatch_names_the_variable(tmp_path):
    Checkpointer(str(tmp_path)).save(1, _plain(w=((4, 8), "float32"), b=((8,), "float32")))
    ckpt = Checkpointer(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"w: .*shape \[4, 8\].*shape \[4, 4\]"):
        ckpt.restore_latest(_plain(w=((4, 4), "float32"), b=((8,), "float32")))
    with pytest.raises(CheckpointError, match=r"b: .*dtype float32.*dtype float64"):
        ckpt.restore_latest(_plain(w=((4, 8), "float32"), b=((8,), "float64")))


def test_missing_and_unexpected_variables_are_errors(tmp_path):
    Checkpointer(str(tmp_path)).save(1, _plain(w=((2,), "float32"), old=((2,), "float32")))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \['new'\].*"
                                              r"unexpected in the checkpoint \['old'\]"):
        Checkpointer(str(tmp_path)).restore_latest(_plain(w=((2,), "float32"),
                                                          new=((2,), "float32")))


def test_no_checkpoint_restores_nothing(tmp_path):
    assert Checkpointer(str(tmp_path), config=CheckpointConfig()).restore_latest({}) is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn", "int32", "bool"])
def test_every_dtype_round_trips_bit_exactly(tmp_path, dtype):
    """Raw bytes, not .npy: numpy has no bfloat16/float8 of its own (ml_dtypes does)."""
    tf_dtype = tf.as_dtype(dtype)
    values = tf.cast(tf.reshape(tf.range(-12, 12, dtype=tf.float32) / 4, (4, 6)), tf_dtype)
    Checkpointer(str(tmp_path)).save(1, {"x": tf.Variable(values)})
    target = {"x": tf.Variable(tf.cast(tf.zeros((4, 6)), tf_dtype))}
    Checkpointer(str(tmp_path)).restore_latest(target)
    np.testing.assert_array_equal(target["x"].numpy(), values.numpy())


def test_fp8_state_and_bf16_weights_restore_onto_another_mesh(tmp_path):
    _, parallel, variables = build_run("data=2,model=4", **{"precision.policy": "fp8"})
    histories = [n for n in variables if "amax" in n or "history" in n]
    assert histories, "run_state_variables must carry the FP8 amax histories"
    for i, name in enumerate(histories):  # non-default state
        var = variables[name]
        var.assign(tf.ones_like(var.value) * (i + 1))
    values = gathered(variables)
    Checkpointer(str(tmp_path), parallel).save(1, variables)
    _, target_parallel, fresh = build_run("model=8", **{"precision.policy": "fp8"})
    Checkpointer(str(tmp_path), target_parallel).restore_latest(fresh)
    assert_same(gathered(fresh), values)
