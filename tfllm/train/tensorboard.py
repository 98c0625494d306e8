"""TensorBoard event files: training scalars and FP8 scale statistics."""

from __future__ import annotations

import errno
import os

import numpy as np
import tensorflow as tf

from tfllm.parallel.placement import to_numpy
from tfllm.precision.fp8 import E4M3_MAX, E5M2_MAX

_FORMAT_MAX = {"x": E4M3_MAX, "w": E4M3_MAX, "g": E5M2_MAX}


def fp8_scale_stats(model, margin: int = 0) -> dict:
    """min / mean / max over layers of the scale each FP8 operand kind (x: inputs,
    w: weights, g: output gradients) would use next under delayed scaling."""
    scales = {}
    for var in model.fp8_state_variables():
        kind = var.name[-1]  # amax_history_x / _w / _g
        amax = float(np.max(to_numpy(var)))
        if amax > 0:
            scales.setdefault(kind, []).append(_FORMAT_MAX[kind] / (amax * 2.0 ** margin))
    out = {}
    for kind, values in scales.items():
        out.update({f"fp8/scale_{kind}_min": min(values), f"fp8/scale_{kind}_max": max(values),
                    f"fp8/scale_{kind}_mean": float(np.mean(values))})
    return out


class TensorBoard:
    """Writes scalars to WORKDIR/tensorboard (one event file per run).

    Args:
      logdir: the directory for event files.
    """

    def __init__(self, logdir: str):
        self.logdir = logdir
        with tf.device("/cpu:0"), storage_errors_named(logdir):
            self.writer = tf.summary.create_file_writer(logdir)

    def write(self, step: int, metrics: dict, model=None) -> None:
        with storage_errors_named(self.logdir):
            self._write(step, metrics, model)

    def _write(self, step: int, metrics: dict, model=None) -> None:
        values = {k: v for k, v in metrics.items() if k != "step"}
        if model is not None and model.fp8_state_variables():
            margin = model.fp8.margin if model.fp8 is not None else 0
            values.update(fp8_scale_stats(model, margin))
        with tf.device("/cpu:0"), self.writer.as_default(step=step):
            for name, value in values.items():
                if isinstance(value, list):  # per-expert counts: a histogram per layer
                    for i, row in enumerate(value):
                        tf.summary.histogram(f"{name}/sparse_layer_{i}",
                                             tf.constant(row, tf.float32))
                else:
                    tf.summary.scalar(name, float(value))
        self.writer.flush()


#: errors of the storage that TensorFlow's event writer reports only in its message
_STORAGE_ERRNOS = tuple(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EROFS,
                                    errno.EIO, errno.EACCES, errno.EFBIG) if e is not None)


class storage_errors_named:
    """TensorFlow writing by path into `logdir` (its event writer, its profiler) and
    failing on the storage ("Could not initialize events writer", "Could not flush events
    file", a full disk while a trace is written) as the OSError it was, naming the folder:
    one line and exit 74 at the command line, not TensorFlow's message without a path."""

    def __init__(self, logdir: str):
        self.logdir = logdir

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if not isinstance(error, tf.errors.OpError):
            return False
        for number in _STORAGE_ERRNOS:
            if os.strerror(number) in str(error.message):
                raise OSError(number, f"{os.strerror(number)} (TensorFlow writing there)",
                              self.logdir) from None
        return False
