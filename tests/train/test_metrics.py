"""Throughput and MFU accounting: one definition for `tfllm train` and `tfllm bench`."""

from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow as tf

from tfllm.train import bench, metrics
from tfllm.train.metrics import (Peak, Throughput, datasheet_peak, measure_matmul_peak,
                                 mesh_peak, model_flops_utilization)


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

    # A GPU tfllm has no datasheet figure for is timed, one device times the mesh.
    gpu = mesh_peak(_parallel("GPU", {"data": 2, "model": 4}), "bfloat16", True, measure,
                    device_name="NVIDIA H100 PCIe")
    assert gpu.flops == 800 and gpu.measured
    # Logical CPU devices share the host's cores: one device's peak is the host's.
    assert mesh_peak(_parallel("CPU", {"data": 8}), "float32", True, measure).flops == 100
    mesh_peak(_parallel("CPU", {"data": 8}), "fp8", True, measure)
    assert measured == [tf.bfloat16, tf.float32, tf.bfloat16]
    assert model_flops_utilization(10.0, 20.0, 400.0) == 0.5
    assert model_flops_utilization(0.0, 20.0, 400.0) == 0.0


def test_known_gpus_use_their_datasheet_peak_and_are_never_timed():
    def measure(n, repeats, dtype):
        raise AssertionError("a known GPU is not timed")

    h100 = mesh_peak(_parallel("GPU", {"fsdp": 8}), "bfloat16", True, measure,
                     device_name="NVIDIA H100 80GB HBM3")
    # 989.2 TFLOP/s dense bf16 per SXM H100 (NVIDIA: 989.4), 8 of them.
    assert h100.flops == pytest.approx(8 * 989.2e12, rel=1e-3) and not h100.measured
    assert "datasheet" in h100.source and "x8 GPUs" in h100.source
    # fp8 is reported against the bf16 peak (as MaxText and torchtitan do); float32
    # against TF32's, or timed when TF32 is off (IEEE float32 leaves the tensor cores).
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "fp8")[0] == h100.flops / 8
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "float32")[0] == pytest.approx(494.6e12,
                                                                                  rel=1e-3)
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "float32", tf32=False) is None
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", "bfloat16")[0] == 312e12
    # PCIe and NVL boards run at lower clocks than the SXM parts the table describes.
    for name in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "Tesla V100", ""):
        assert datasheet_peak(name, "bfloat16") is None, name


def test_a_measured_peak_rises_to_the_steps_rate_and_mfu_stays_at_most_one():
    peak = Peak(100.0, "measured: matmul")
    peak.observe(50.0)
    assert peak.flops == 100.0
    peak.observe(150.0)  # the step beat the timed matmul (CPU: fused kernels, threads)
    assert peak.flops == 150.0 and "raised" in peak.source
    sheet = Peak(100.0, "datasheet", measured=False)
    sheet.observe(150.0)  # a datasheet peak is never raised...
    assert sheet.flops == 100.0
    # ...and MFU is capped at 1 (a FLOP count that overstates is the only way past it).
    assert model_flops_utilization(15.0, 10.0, 100.0) == 1.0


def test_the_timed_peak_copies_one_element_not_the_product(monkeypatch):
    # The 2048^2 product never leaves the device inside the timed call: only a scalar
    # does (copying 16 MiB over PCIe would dominate a GPU's matmul time).
    fetched = []

    def spy(value):
        fetched.append(tuple(value.shape))
        return value.numpy().item()

    monkeypatch.setattr(metrics, "float", spy, raising=False)  # the module's float()
    flops = measure_matmul_peak(n=128, repeats=3, dtype=tf.float32, chain=4)
    assert fetched == [()] * 4 and flops > 0


@pytest.mark.slow
def test_bench_reports_the_same_peak_as_train(monkeypatch):
    from tests.harness import tiny_config
    # A peak far above what the tiny step reaches, so that it is not raised.
    monkeypatch.setattr(metrics, "measure_matmul_peak",
                        lambda n=2048, repeats=10, dtype=None: 1e12)
    cfg = tiny_config("gpt", "data=8")
    out = bench.benchmark(cfg, steps=2, warmup=1)
    # 8 logical CPU devices share one host: the peak is the host's, not 8x it (the
    # figure `tfllm train` divides by), and the MFU follows from the same function.
    assert out["peak_flops"] == 1e12 and out["peak_source"].startswith("measured")
    # bench rounds MFU to 4 decimals: 5e-5 either way.
    assert out["mfu"] == pytest.approx(out["tokens_per_s"] * out["flops_per_token"] / 1e12,
                                       abs=5e-5)
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
