"""Throughput and MFU accounting: one definition for `tfllm train` and `tfllm bench`."""

import io
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow as tf

from tfllm.train import bench, metrics
from tfllm.train.metrics import (Peak, Throughput, datasheet_peak, measure_matmul_peak,
                                 mesh_peak, model_flops_utilization)
from tfllm.train.progress import Progress


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


def test_mesh_peak_counts_every_gpu_and_a_cpu_has_none():
    measured = []

    def measure(n, repeats, dtype):
        measured.append(dtype)
        return 100.0

    # A GPU tfllm has no datasheet figure for is timed, one device times the mesh.
    gpu = mesh_peak(_parallel("GPU", {"data": 2, "model": 4}), "bfloat16", True, measure,
                    device_name="NVIDIA H100 PCIe")
    assert gpu.flops == 800 and gpu.measured
    mesh_peak(_parallel("GPU", {"data": 1}), "float32", False, measure,
              device_name="Tesla V100")
    mesh_peak(_parallel("GPU", {"data": 1}), "fp8", True, measure, device_name="")
    assert measured == [tf.bfloat16, tf.float32, tf.bfloat16]
    assert model_flops_utilization(10.0, 20.0, 400.0) == 0.5
    assert model_flops_utilization(0.0, 20.0, 400.0) == 0.0


def test_a_cpu_reports_no_mfu_and_times_nothing():
    # A peak timed on a CPU moved 2x with the host's other work: no MFU rather than one
    # that says more about the neighbours than about the step.
    def measure(n, repeats, dtype):
        raise AssertionError("a CPU's peak is not timed")

    for policy in ("float32", "bfloat16", "fp8"):
        peak = mesh_peak(_parallel("CPU", {"data": 8}), policy, True, measure)
        assert peak.flops is None and peak.source == metrics.NO_CPU_PEAK
        assert peak.mfu(20000.0, 1e6) is None
    assert "no MFU on CPU" in metrics.NO_CPU_PEAK
    assert model_flops_utilization(20000.0, 1e6, None) is None
    # The display shows "MFU -", and a run records no "mfu" (loop: `has_peak`).
    p = Progress(10, "lines", io.StringIO(), peak=peak, flops_per_token=1e6)
    assert not p.has_peak and p.mfu(20000.0) is None
    assert "MFU -" in p.line(5, {"loss": 1.0}, 20000.0, 1.0)


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


def test_mfu_above_one_is_reported_unclamped_and_warns_once(caplog):
    # 15 tokens/s x 10 FLOPs/token = 150 FLOP/s against a 100 FLOP/s datasheet peak: 1.5.
    sheet = Peak(100.0, "datasheet: NVIDIA H100 80GB HBM3, dense bf16, x1 GPUs",
                 measured=False)
    with caplog.at_level(logging.WARNING, logger="tfllm.train"):
        assert sheet.mfu(5.0, 10.0) == 0.5 and not caplog.records  # below 1: silent
        assert sheet.mfu(15.0, 10.0) == 1.5  # the real figure, not 1
        assert sheet.mfu(20.0, 10.0) == 2.0
    assert sheet.flops == 100.0  # a peak is never raised to the step's rate
    assert len(caplog.records) == 1  # one line per run, not one per logged step
    line = caplog.records[0].getMessage()
    assert "\n" not in line and "counting error" in line and "150.0%" in line
    # It names the FLOPs per token and the peak used.
    assert "10 FLOPs/token" in line and "100 FLOP/s" in line and "H100" in line
    # A timed peak (a GPU without a datasheet figure) is not raised either: the warning
    # blames the timing or the count.
    timed = Peak(100.0, "measured: 4096^3 bfloat16 matmuls on one GPU, x1")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tfllm.train"):
        assert timed.mfu(15.0, 10.0) == 1.5 and timed.flops == 100.0
    assert "timed matmul" in caplog.records[0].getMessage()
    # The display shows it too, unclamped.
    p = Progress(10, "lines", io.StringIO(), peak=sheet, flops_per_token=10.0)
    assert "MFU 150.0%" in p.line(5, {"loss": 1.0}, 15.0, 1.0)


def _model(**settings):
    fields = dict(family="llama", num_query_heads=2, num_key_value_heads=2, head_dim=4,
                  hidden_dim=8, intermediate_dim=16, num_layers=1, vocab_size=10,
                  sliding_window=0, sliding_window_pattern=0)
    return SimpleNamespace(**dict(fields, **settings))


def test_causal_attention_flops_are_half_the_full_scores_as_maxtext_counts():
    # One llama layer: E=8, H=2 heads of D=4 (kv 2), F=16, V=10; sequence T=4.
    # Dense forward per token: 2 x (q,o: 8*2*4*2=128 + k,v: 128 + MLP 3*8*16=384
    #   + head 8*10=80) = 2 x 720 = 1440.
    # Attention forward per sequence, full 4x4 scores: QK^T and AV, 2 FLOPs per MAC each,
    #   per head dimension: 4 * T*T * H*D = 4*16*8 = 512, i.e. 128 per token. Causal:
    #   T^2/2 = 8 pairs, 4*8*8 = 256 per sequence, 64 per token (half).
    # Training: 3 x (1440 + 64) = 4512; the full count would be 3 x (1440 + 128) = 4704.
    assert metrics.attention_pairs(4) == 8 == 4 * 4 / 2
    assert metrics.flops_per_token(_model(), 4) == 4512
    full, dense = 3 * (1440 + 128), 3 * 1440
    assert metrics.flops_per_token(_model(), 4) - dense == (full - dense) / 2
    # A sliding window of W=2 over T=4: T*W - W^2/2 = 6 pairs (MaxText's closed form;
    # the mask lets 1+2+2+2 = 7 through, T*W - W(W-1)/2): 4*6*8/4 = 48 per token.
    assert metrics.attention_pairs(4, window=2) == 6
    assert metrics.flops_per_token(_model(sliding_window=2), 4) == 3 * (1440 + 48)
    # A window as long as the sequence is the causal count.
    assert metrics.attention_pairs(4, window=4) == metrics.attention_pairs(4, window=9) == 8
    # Gemma 3's pattern (every 2nd layer global): layer 0 local (48), layer 1 global (64);
    # dense 2 x (2*640 + 80) = 2720.
    two = _model(num_layers=2, sliding_window=2, sliding_window_pattern=2)
    assert metrics.flops_per_token(two, 4) == 3 * (2720 + 48 + 64)


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
def test_bench_on_cpu_reports_no_peak_and_says_why():
    from tests.harness import tiny_config
    cfg = tiny_config("gpt", "data=8")
    out = bench.benchmark(cfg, steps=2, warmup=1)
    # 8 logical CPU devices share one host: no peak, no MFU, and the reason why (the
    # display of `tfllm train` shows "MFU -" from the same `mesh_peak`).
    assert out["peak_flops"] is None and out["mfu"] is None
    assert out["peak_source"] == metrics.NO_CPU_PEAK
    # The cost report of the timed step: one gradient all-reduce per block over the 8
    # devices (tfllm.parallel.blocks; DTensor merges nothing into a whole-model buffer):
    # the largest is a block's gradients, well under the model's.
    shapes = _weight_shapes(cfg)
    assert out["costs"]["devices"] == 8 and out["costs"]["largest"]["group_size"] == 8
    assert max(int(np.prod(s)) for s in shapes) <= out["costs"]["largest"]["elements"] \
        < out["params"] / 2


def _weight_shapes(cfg):
    from tfllm.models import build_model
    model = build_model(cfg.model, cfg.precision, cfg.lora)
    model(np.zeros((1, cfg.data.sequence_length), "int32"))
    return [v.shape for v in model.trainable_variables]
