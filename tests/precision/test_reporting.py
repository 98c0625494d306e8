"""The training log, metrics and TensorBoard say which precision is in effect."""

import glob
import io

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.util import event_pb2

from tfllm.models import build_model
from tfllm.parallel.placement import to_numpy
from tfllm.train.loop import train
from tests.harness import metrics_records, tiny_config


def _tensorboard_scalars(workdir):
    values = {}
    for path in glob.glob(f"{workdir}/tensorboard/events.out.tfevents.*"):
        for record in tf.data.TFRecordDataset(path):
            event = event_pb2.Event.FromString(record.numpy())
            for v in event.summary.value:
                values.setdefault(v.tag, []).append(float(tf.make_ndarray(v.tensor)))
    return values


@pytest.mark.slow
def test_fp8_run_logs_recipe_and_scale_statistics(tmp_path):
    cfg = tiny_config("llama", "data=2,model=4", **{
        "precision.policy": "fp8", "precision.fp8_recipe": "current", "train.steps": 4,
        "train.log_every": 2})
    out = io.StringIO()
    train(cfg, str(tmp_path), out=out)
    assert "precision=fp8 (keras policy mixed_bfloat16), fp8 recipe=current" in out.getvalue()
    scalars = _tensorboard_scalars(tmp_path)
    for tag in ("loss", "learning_rate", "grad_norm", "tokens_per_s", "fp8/scale_x_mean",
                "fp8/scale_w_min", "fp8/scale_g_max"):
        assert tag in scalars, tag
    assert all(np.isfinite(v) and v > 0 for v in scalars["fp8/scale_w_min"])


def test_float16_run_logs_loss_scale_and_skipped_steps(tmp_path):
    cfg = tiny_config("gpt", **{
        "precision.policy": "float16", "precision.loss_scale_initial": 3e38,
        "train.steps": 2, "train.log_every": 1})
    out = io.StringIO()
    train(cfg, str(tmp_path), out=out)
    assert "dynamic loss scale from 3e+38" in out.getvalue()
    lines = metrics_records(tmp_path)
    assert [l["skipped_steps"] for l in lines if "loss" in l] == [1, 2]
    assert "skipped 2" in out.getvalue()
    assert _tensorboard_scalars(tmp_path)["skipped_steps"] == [1.0, 2.0]


def test_fp8_state_is_checkpointed_with_the_model(tmp_path):
    # FP8 histories are model variables: a checkpoint of every model variable by path
    # carries them. (tf.train.Checkpoint(model=...) does not see Keras 3 variables.)
    cfg = tiny_config("gpt", **{"precision.policy": "fp8"})
    model = build_model(cfg.model, cfg.precision, cfg.lora)
    history = model.fp8_state_variables()[0]
    history.assign(tf.range(history.shape[0], dtype=tf.float32))
    by_path = lambda m: tf.train.Checkpoint(variables={v.path: v.value for v in m.variables})
    path = by_path(model).save(str(tmp_path / "ckpt"))
    restored = build_model(cfg.model, cfg.precision, cfg.lora)
    by_path(restored).restore(path).assert_consumed()
    np.testing.assert_array_equal(to_numpy(restored.fp8_state_variables()[0]),
                                  np.arange(history.shape[0]))
