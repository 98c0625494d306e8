"""GPU start-up checks, from faked driver listings, builds and library failures."""

import subprocess

import pytest

from tfllm.runtime import gpu_checks
from tfllm.runtime.gpu_checks import Gpu, HostFacts
from tfllm.runtime.devices import MeshError, check_gpus

# TensorFlow 2.21's wheel: machine code up to sm_89, Hopper only as PTX (compute_90).
BUILD = {"is_cuda_build": True, "cuda_version": "12.5.1",
         "cuda_compute_capabilities": ["sm_60", "sm_70", "sm_80", "sm_89", "compute_90"]}
H100 = Gpu("NVIDIA H100 80GB HBM3", (9, 0), "560.35.03")
A100 = Gpu("NVIDIA A100-SXM4-80GB", (8, 0), "535.104.05")
CACHE = {"CUDA_CACHE_PATH": "/scratch/cuda-cache", "CUDA_CACHE_MAXSIZE": "4294967296"}


def _facts(gpus, tf_gpus=None, env=CACHE, build=BUILD, errors=None, version="2.21.0"):
    return HostFacts(list(gpus), len(gpus) if tf_gpus is None else tf_gpus, version,
                     dict(build), dict(errors or {}), dict(env))


def _levels(findings):
    return [f.level for f in findings]


def test_a_healthy_hopper_host_passes():
    findings = gpu_checks.check(_facts([H100] * 8), "fp8", "auto")
    assert "error" not in _levels(findings) and "warning" not in _levels(findings)
    assert "8 GPU(s) usable" in findings[-1].message


def test_gpus_the_driver_lists_but_tensorflow_cannot_use_name_the_library():
    findings = gpu_checks.check(_facts([H100] * 8, tf_gpus=0,
                                       errors={"libcudnn.so.9": "not found"}), "bfloat16")
    error = gpu_checks.first_error(findings)
    assert "TensorFlow sees none" in error and "libcudnn.so.9: not found" in error
    assert "tensorflow[and-cuda]" in error  # the fix
    cpu_build = gpu_checks.check(_facts([H100], build={"is_cuda_build": False}))
    assert "CPU build" in gpu_checks.first_error(cpu_build)


def test_a_driver_too_old_for_the_wheels_ptx_fails_before_the_first_kernel():
    old = Gpu("NVIDIA H100 80GB HBM3", (9, 0), "550.54.15")
    error = gpu_checks.first_error(gpu_checks.check(_facts([old])))
    assert "driver 550.54.15 is too old" in error and "R555" in error
    # The same driver runs an A100, for which the wheel has machine code.
    assert gpu_checks.first_error(gpu_checks.check(_facts([A100]))) is None


def test_the_ptx_jit_warm_up_is_announced_with_the_cache_settings():
    findings = gpu_checks.check(_facts([H100], env={}))
    warning = next(f.message for f in findings if f.level == "warning")
    assert "JIT-compiles" in warning and "CUDA_CACHE_PATH" in warning
    assert "CUDA_CACHE_MAXSIZE=4294967296" in warning
    assert gpu_checks.first_error(findings) is None  # slow, not wrong


def test_fp8_below_compute_capability_8_9_is_an_error():
    error = gpu_checks.first_error(gpu_checks.check(_facts([A100]), "fp8"))
    assert "precision.policy=fp8" in error and "8.0" in error and "bfloat16" in error
    assert gpu_checks.first_error(gpu_checks.check(_facts([A100]), "bfloat16")) is None


def test_tensorflow_outside_the_written_range_and_a_missing_gpu():
    assert "2.22.0" in gpu_checks.first_error(
        gpu_checks.check(_facts([H100], version="2.22.0")))
    assert "lists no GPU" in gpu_checks.first_error(gpu_checks.check(_facts([]), "fp8", "GPU"))
    assert gpu_checks.check(_facts([]), "fp8", "auto")[0].level == "ok"


def test_a_run_stops_with_one_line_and_prints_warnings(capsys):
    with pytest.raises(MeshError, match="too old.*tfllm doctor"):
        check_gpus("auto", "bfloat16", _facts([Gpu("NVIDIA H100", (9, 0), "535.1")]))
    check_gpus("GPU", "bfloat16", _facts([H100], env={}))
    assert "tfllm: warning: TensorFlow has no machine code" in capsys.readouterr().err


def test_nvidia_smi_output_is_parsed(monkeypatch):
    monkeypatch.setattr(gpu_checks.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    out = "NVIDIA H100 80GB HBM3, 9.0, 560.35.03\nNVIDIA H100 80GB HBM3, 9.0, 560.35.03\n"
    fake = lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=out, stderr="")
    assert gpu_checks.driver_gpus(fake) == [H100, H100]
    monkeypatch.setattr(gpu_checks.shutil, "which", lambda name: None)
    assert gpu_checks.driver_gpus(fake) == []


def test_the_doctor_command_prints_every_check_and_exits_2_on_an_error(monkeypatch, capsys):
    from tfllm.cli.main import main
    assert main(["doctor"]) == 0  # this host: no GPU
    assert capsys.readouterr().out.strip() == "ok: no GPU: meshes run on the CPU"
    # FP8 asked for on A100s (compute capability 8.0): one error line, exit 2
    monkeypatch.setattr(gpu_checks, "gather", lambda: _facts([A100] * 8))
    assert main(["doctor", "--set", "precision.policy=fp8"]) == 2
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines].count("error") == 1
    assert any(line.startswith("error:") and "8.9" in line for line in lines), lines
