"""NCCL and GPU choices made on the worker's host (tfllm.launch.device, topology.pick_gpu):
pure functions, and their shell forms run under bash and dash against a fake nvidia-smi,
so no GPU is needed."""

import re
import shutil
import subprocess

import pytest

from tfllm.launch import topology as topo
from tfllm.launch.device import (NCCL_ENV, NCCL_PROBE_SH, nvidia_smi_gpu_count,
                                 resolve_device_env)
from tfllm.launch.topology import LaunchError
from tests.launch.helpers import fake_gpu_host

SHELLS = [s for s in ("bash", "dash") if shutil.which(s)]  # ssh may land in either


def _counting(gpus):
    calls = []

    def count():
        calls.append(1)
        return gpus
    return count, calls


@pytest.mark.parametrize("environ, gpus, expected, probes", [
    ({"TFLLM_DEVICE": "auto"}, 2, {NCCL_ENV: "1"}, True),
    ({"TFLLM_DEVICE": "auto"}, 0, {}, True),
    ({}, 1, {NCCL_ENV: "1"}, True),   # started without the launcher: auto
    ({"TFLLM_DEVICE": "gpu"}, 0, {NCCL_ENV: "1"}, False),
    ({"TFLLM_DEVICE": "cpu"}, 8, {NCCL_ENV: "0"}, False),
    ({"TFLLM_DEVICE": "gpu", NCCL_ENV: "0"}, 8, {}, False),  # the user's choice is kept
    ({"TFLLM_DEVICE": "auto", NCCL_ENV: ""}, 1, {NCCL_ENV: "1"}, True),  # empty = unset
])
def test_resolve_device_env(environ, gpus, expected, probes):
    count, calls = _counting(gpus)
    before = dict(environ)
    assert resolve_device_env(environ, count) == expected
    assert bool(calls) == probes  # explicit settings never run nvidia-smi
    assert environ == before      # returns the changes, applies none


def test_unknown_device_names_the_variable():
    with pytest.raises(ValueError, match="TFLLM_DEVICE='tpu' is unknown; set it to auto, "
                                         "gpu or cpu"):
        resolve_device_env({"TFLLM_DEVICE": "tpu"}, lambda: 0)


@pytest.mark.parametrize("gpus", [None, 0, 3])
def test_nvidia_smi_gpu_count_from_a_fake_listing(tmp_path, monkeypatch, gpus):
    bin_dir, _ = fake_gpu_host(tmp_path, gpus)
    monkeypatch.setenv("PATH", bin_dir)
    assert nvidia_smi_gpu_count() == (gpus or 0)  # MIG lines are not GPUs


def test_nvidia_smi_that_hangs_counts_as_none(tmp_path, monkeypatch):
    bin_dir, _ = fake_gpu_host(tmp_path, 1)
    monkeypatch.setenv("PATH", bin_dir)

    def hung(*args, **kwargs):
        assert kwargs.get("timeout"), "nvidia-smi must be called with a timeout"
        raise subprocess.TimeoutExpired(args[0], kwargs["timeout"])
    assert nvidia_smi_gpu_count(run=hung) == 0


def _sh(shell, script, bin_dir, env):
    result = subprocess.run([shutil.which(shell), "-c", script], capture_output=True,
                            text=True, timeout=30, env=dict(env, PATH=bin_dir))
    return result.returncode, result.stdout.strip(), result.stderr


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("gpus", [None, 0, 2])
@pytest.mark.parametrize("explicit", [None, "", "0"])
def test_the_shell_probe_agrees_with_resolve_device_env(tmp_path, monkeypatch, shell, gpus,
                                                        explicit):
    """hostfile mode runs NCCL_PROBE_SH on the remote host: the same rule as the Python."""
    bin_dir, _ = fake_gpu_host(tmp_path, gpus)
    env = {"TFLLM_DEVICE": "auto"}
    if explicit is not None:
        env[NCCL_ENV] = explicit
    code, out, err = _sh(shell, f'{NCCL_PROBE_SH}; echo "${{{NCCL_ENV}-unset}}"', bin_dir, env)
    assert code == 0, err
    monkeypatch.setenv("PATH", bin_dir)
    expected = dict(env, **resolve_device_env(env, nvidia_smi_gpu_count)).get(NCCL_ENV, "unset")
    assert out == expected
    assert out == ("1" if gpus and not explicit else explicit if explicit is not None
                   else "unset")  # and the rule is the intended one


# (CUDA_VISIBLE_DEVICES on the host, nvidia-smi's GPU count (None: no nvidia-smi),
#  workers per host, the GPU of each slot or the error)
PICKS = [
    ("6,7", 8, 2, ["6", "7"]),
    ("6,7,2", None, 2, ["6", "7"]),
    (None, 4, 2, ["0", "1"]),
    (None, None, 2, ["0", "1"]),  # nothing to check against: by slot
    ("6", 8, 2, "lists 1 GPU(s)"),
    ("", 8, 1, "lists 0 GPU(s)"),
    (None, 1, 2, "nvidia-smi"),
    (None, 0, 2, ["0", "1"]),  # a listing of none (a failing driver) is not checked
]


@pytest.mark.parametrize("visible, gpus, workers, expected", PICKS)
def test_pick_gpu(visible, gpus, workers, expected):
    for slot in range(workers):
        pick = lambda: topo.pick_gpu(slot, workers, visible, lambda: gpus or 0,
                                     option="--gpus-per-host")
        if isinstance(expected, str):
            with pytest.raises(LaunchError, match=re.escape(expected) + r".*--gpus-per-host"):
                pick()
        else:
            assert pick() == expected[slot]


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("visible, gpus, workers, expected", PICKS)
def test_pick_gpu_on_the_remote_host(tmp_path, shell, visible, gpus, workers, expected):
    """hostfile mode runs pick_gpu_sh on each remote host, whose own CUDA_VISIBLE_DEVICES
    is the one that counts: the GPU is an entry of it, and too few GPUs exit 2."""
    bin_dir, _ = fake_gpu_host(tmp_path, gpus)
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    for slot in range(workers):
        code, out, err = _sh(shell, topo.pick_gpu_sh(slot, workers) +
                             '; echo "$CUDA_VISIBLE_DEVICES"', bin_dir, env)
        if isinstance(expected, str):
            assert code == 2 and out == "", (out, err)
            assert expected in err and "--gpus-per-host" in err and len(err.splitlines()) == 1
        else:
            assert (code, out) == (0, expected[slot]), err
