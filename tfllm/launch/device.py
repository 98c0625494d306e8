"""Whether a worker asks DTensor for NCCL: decided on the worker's own host.

`DTENSOR_GPU_USE_NCCL_COMMUNICATION=1` belongs in every worker whose host has GPUs, and
only there. `--device auto` was once resolved by running nvidia-smi where the launcher
runs, which in hostfile mode is a login node: one without GPUs turned NCCL off for every
GPU worker, a GPU login node turned it on for CPU workers. The rule now lives here once,
in two forms:

- `resolve_device_env(environ, gpu_count)`, for Python: the launcher applies it where it
  runs on the workers' host (local, slurm, env modes), and the worker itself applies it
  before TensorFlow starts (tfllm's mesh), from `TFLLM_DEVICE`, which the launcher sets.
- `NCCL_PROBE_SH`, the same rule for `auto` in POSIX shell, which hostfile mode runs on
  each remote host before the command (see `topology.remote_script`).

Imports nothing heavy: the launcher runs on login nodes before TensorFlow is needed.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Callable, Dict, Mapping

# What `tfllm launch --device` asked for, in every worker (auto, gpu or cpu), and DTensor's
# switch between NCCL and TensorFlow's own collectives on GPU meshes: the worker's side of
# the rule (`tfllm.runtime.devices.use_nccl`) owns both names.
from tfllm.runtime.devices import DEVICE_ENV, NCCL_ENV

DEVICES = ("auto", "gpu", "cpu")

#: `resolve_device_env` for TFLLM_DEVICE=auto, as POSIX shell run on a remote host. A
#: value set there already (non-empty) is kept; MIG lines of `nvidia-smi -L` start with
#: spaces, so '^GPU' counts physical GPUs as `nvidia_smi_gpu_count` does.
NCCL_PROBE_SH = (f'if [ -z "${{{NCCL_ENV}-}}" ] && command -v nvidia-smi >/dev/null 2>&1 && '
                 f'nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then export {NCCL_ENV}=1; fi')


def nvidia_smi_gpu_count(run=subprocess.run) -> int:
    """The GPUs `nvidia-smi -L` lists on this host; 0 without the tool or when it fails.

    Args:
      run: `subprocess.run` (tests pass a fake).
    """
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        # A wedged driver can make nvidia-smi hang: a launcher must not hang with it.
        out = run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU") for line in out.splitlines())


def resolve_device_env(environ: Mapping[str, str],
                       gpu_count: Callable[[], int]) -> Dict[str, str]:
    """The NCCL setting a worker on this host needs: the variables to set, {} for none.

    Rules, in order: a non-empty DTENSOR_GPU_USE_NCCL_COMMUNICATION is the user's choice
    and is kept ({}); TFLLM_DEVICE=gpu sets it to 1 and cpu to 0 (an explicit 0 keeps
    NCCL off even where the mesh lands on GPUs); auto (or unset: a process started
    without the launcher) sets 1 when this host has a GPU and leaves it unset otherwise.
    Call it on the worker's host before TensorFlow initializes (DTensor reads the
    variable when it initializes the accelerators).

    Args:
      environ: the worker's environment (not modified).
      gpu_count: returns this host's GPU count; called only for auto, so an explicit
        setting never probes (e.g. `nvidia_smi_gpu_count`, or TensorFlow's physical GPUs).

    Returns:
      The variables to set, e.g. {"DTENSOR_GPU_USE_NCCL_COMMUNICATION": "1"}.
    """
    device = environ.get(DEVICE_ENV) or "auto"
    if device not in DEVICES:
        raise ValueError(f"{DEVICE_ENV}='{device}' is unknown; set it to auto, gpu or cpu "
                         "(tfllm launch --device)")
    if environ.get(NCCL_ENV):
        return {}
    if device == "cpu":
        return {NCCL_ENV: "0"}
    if device == "gpu" or gpu_count() > 0:
        return {NCCL_ENV: "1"}
    return {}
