"""Throughput and MFU accounting: one definition for `tfllm train` and `tfllm bench`."""

from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow as tf

from tfllm.train import bench, metrics
from tfllm.train.metrics import Throughput, mesh_peak_flops, model_flops_utilization


def test_throughput_counts_only_the_interval_steps():
    t = Throughput()
    t.add_step(0.5, 1000)
    t.add_step(0.5, 1000)
    # An evaluation or checkpoint pause between steps is never added: 2000 tokens in 1 s.
    assert t.close_interval() == 2000
    assert t.rate() == 2000  # between intervals: the last closed one
    t.add_step(2.0, 1000)  # a slower interval stands on its own, not averaged in
    assert t.close_interval() == 500


def _parallel(device_type, shape):
    devices = ["/job:localhost/replica:0/task:0/device:CPU:0"]
    mesh = SimpleNamespace(local_devices=lambda: devices)
    return SimpleNamespace(mesh=mesh, device_type=device_type, shape=shape)


def test_mesh_peak_counts_every_gpu_but_one_cpu_host():
    measured = []

    def measure(n, repeats, dtype):
        measured.append(dtype)
        return 100.0

    assert mesh_peak_flops(_parallel("GPU", {"data": 2, "model": 4}), "bfloat16", measure) == 800
    # Logical CPU devices share the host's cores: one device's peak is the host's.
    assert mesh_peak_flops(_parallel("CPU", {"data": 8}), "float32", measure) == 100
    mesh_peak_flops(_parallel("CPU", {"data": 8}), "fp8", measure)
    assert measured == [tf.bfloat16, tf.float32, tf.bfloat16]
    assert model_flops_utilization(10.0, 20.0, 400.0) == 0.5
    assert model_flops_utilization(0.0, 20.0, 400.0) == 0.0


@pytest.mark.slow
def test_bench_reports_the_same_peak_as_train(monkeypatch):
    from tfllm.config import load_config
    from tests.conftest import tiny_overrides
    monkeypatch.setattr(metrics, "measure_matmul_peak",
                        lambda n=2048, repeats=10, dtype=None: 1e9)
    cfg = load_config(None, tiny_overrides("gpt", "data=8"))
    out = bench.benchmark(cfg, steps=2, warmup=1)
    # 8 logical CPU devices share one host: the peak is the host's, not 8x it (the
    # figure `tfllm train` divides by), and the MFU follows from the same function.
    assert out["peak_flops"] == 1e9
    assert out["mfu"] == pytest.approx(out["tokens_per_s"] * out["flops_per_token"] / 1e9,
                                       rel=1e-3)
    # The cost report of the timed step: one gradient all-reduce per tensor over the 8
    # devices (tfllm sets DTENSOR_ALLREDUCE_COMBINE_OPTIMIZATION_GROUP_SIZE=1, so DTensor
    # no longer merges them into one of the whole model): the largest is the largest
    # weight's gradient.
    largest_weight = max(int(np.prod(shape)) for shape in _weight_shapes(cfg))
    assert out["costs"]["devices"] == 8 and out["costs"]["largest"]["group_size"] == 8
    assert out["costs"]["largest"]["elements"] == largest_weight < out["params"]


def _weight_shapes(cfg):
    from tfllm.models import build_model
    model = build_model(cfg, None)
    model(np.zeros((1, cfg.data.sequence_length), "int32"))
    return [v.shape for v in model.trainable_variables]
