"""Process settings that TensorFlow and XLA read once, at start-up or at the first compile.

Each function returns the environment changes it wants and applies them to `environ`,
never overriding a variable the user set (the user's value wins, so every setting can be
tuned from the shell or a cluster template). They must run before TensorFlow creates its
GPU devices (`gpu_memory`) or before XLA's first compilation (`xla_cache`): `tfllm
train`, `eval`, `generate` and `bench` build the mesh before anything else starts
TensorFlow (tests/parallel/test_mesh.py checks this for `train`).
"""

from __future__ import annotations

import os
from typing import Dict, MutableMapping, Optional

from tfllm import files
from tfllm.runpaths import RunPaths

# TensorFlow's GPU device keeps this much memory out of its allocator's pool
# (`MinSystemMemory`, tensorflow/core/common_runtime/gpu/gpu_device.cc reads it).
RESERVE_ENV = "TF_DEVICE_MIN_SYS_MEMORY_IN_MB"
ALLOCATOR_ENV = "TF_GPU_ALLOCATOR"


def _set_default(environ: MutableMapping[str, str], name: str, value: str,
                 changes: Dict[str, str]) -> None:
    if name not in environ:
        environ[name] = value
        changes[name] = value


def gpu_memory(reserve_mb: int, allocator: str,
               environ: MutableMapping[str, str] = os.environ) -> Dict[str, str]:
    """Leaves GPU memory to NCCL and CUDA libraries that allocate outside TensorFlow.

    TensorFlow's BFC allocator takes nearly all device memory when it starts, leaving a
    reserve sized for a display and the CUDA context, not for collectives. NCCL allocates its buffers outside it when a communicator is first used (on HGX H100
    with NVLink SHARP, NVLS buffers of several GiB), and so do cuBLAS/cuDNN workspaces: a
    run that fits TensorFlow's pool can then fail with an NCCL or CUDA out-of-memory error
    at the first collective.

    Args:
      reserve_mb: MiB TensorFlow leaves outside its pool (`mesh.gpu_memory_reserve_mb`).
      allocator: `bfc` (TensorFlow's default) or `cuda_malloc_async` (CUDA's stream-
        ordered allocator, which returns freed memory to the driver, so NCCL can get it).
      environ: the process environment.

    Returns:
      The variables set (those the user had set are left as they were).
    """
    changes: Dict[str, str] = {}
    _set_default(environ, RESERVE_ENV, str(int(reserve_mb)), changes)
    if allocator == "cuda_malloc_async":
        _set_default(environ, ALLOCATOR_ENV, "cuda_malloc_async", changes)
    return changes


# TensorFlow's host allocator is a BFC allocator when this is true
# (`ProcessState::GetCPUAllocator`, tensorflow/core/common_runtime/process_state.cc, reads
# it when the first CPU device is made). Only allocators that trace their allocations put
# `MemoryAllocation` events in a profile (BFC's `AddTraceMe`): GPU devices' BFC, oneDNN's
# CPU allocator (BFC inside) and this one. TensorFlow's plain CPU allocator traces none,
# and it is the default wherever oneDNN is off: with TF_ENABLE_ONEDNN_OPTS=0, and on every
# x86 CPU without AVX512_VNNI, AVX512_BF16, AVX_VNNI or AMX (oneDNN's default,
# `IsMklEnabled`, tensorflow/core/util/port.cc).
CPU_BFC_ENV = "TF_CPU_ALLOCATOR_USE_BFC"


def traced_cpu_allocations(environ: MutableMapping[str, str] = os.environ) -> Dict[str, str]:
    """Makes the host's allocator one that a profile traces (TensorFlow's BFC allocator),
    so that a trace holds the memory peak on any CPU, oneDNN on or off; unless the user
    set CPU_BFC_ENV. Must run before TensorFlow makes its CPU devices.

    Returns:
      The variables set.
    """
    changes: Dict[str, str] = {}
    _set_default(environ, CPU_BFC_ENV, "true", changes)
    return changes


def _add_flag(environ: MutableMapping[str, str], name: str, flag: str, value: str,
              changes: Dict[str, str]) -> None:
    current = environ.get(name, "")
    if flag + "=" in current:
        return  # the user's own value wins
    environ[name] = (current + " " if current else "") + f"{flag}={value}"
    changes[name] = environ[name]


# XLA GPU flags a precision policy needs (flag, value), set for the process by
# `precision_flags`. FP8: XLA's Triton GEMM fusion, on by default, takes each dot with
# its operands' convert/scale producers into a fusion before the cuBLASLt FP8 rewrite can
# match them, and the f32 -> f8 -> bf16 convert pairs are then simplified away: the step
# runs bf16 GEMMs with no FP8 rounding at all. Measured 2026-11-30 on an H200 (jax 0.11.2,
# XLA's defaults): gpt2-small's and llama-7b's FP8 steps ran 0 `__cublas$lt$matmul$f8`
# calls and were 11% and 3% slower than bf16 (benchmarks/results/gpu_h200_2026-11-30.md);
# the same exported step compiled for an H100 without Triton GEMMs has 216 FP8 GEMMs
# (tests/plan/test_fp8_flags.py). cuBLAS still runs every other GEMM.
POLICY_XLA_FLAGS = {"fp8": (("--xla_gpu_enable_triton_gemm", "false"),)}


def policy_xla_flags(policy: str) -> str:
    """The XLA_FLAGS text `policy` needs on a GPU ("" for none)."""
    return " ".join(f"{flag}={value}" for flag, value in POLICY_XLA_FLAGS.get(policy, ()))


def precision_flags(policy: str,
                    environ: MutableMapping[str, str] = os.environ) -> Dict[str, str]:
    """Adds the XLA flags of `policy` (POLICY_XLA_FLAGS) to XLA_FLAGS, each unless the
    user set that flag. XLA reads XLA_FLAGS once, at its first compile: `tfllm train`,
    `eval`, `generate` and `bench` call this before TensorFlow starts.

    Returns:
      The variables changed.
    """
    changes: Dict[str, str] = {}
    for flag, value in POLICY_XLA_FLAGS.get(policy, ()):
        _add_flag(environ, "XLA_FLAGS", flag, value, changes)
    return changes


def xla_cache_dir(setting: str, workdir: Optional[str], client: int = 0) -> Optional[str]:
    """The directory `train.xla_cache` names, or None for no cache.

    Args:
      setting: `auto` (WORKDIR/xla_cache/client_N: compiling and autotuning the step's
        clusters takes minutes per GPU at every restart; a client of its own, so that
        clients sharing a file system never write the same file), `off`, or a directory.
      workdir: the run's workdir (None: no run directory, so `auto` means no cache).
      client: this process's DTensor client id.
    """
    # YAML reads `off` (and `no`, `false`) as a boolean, which the config stores as
    # "false": all of them mean no cache, never a folder of that name.
    if str(setting).lower() in ("off", "false", "no", "none", ""):
        return None
    if setting == "auto":
        return RunPaths(workdir).xla_cache(client) if workdir else None
    return os.path.expanduser(setting)  # a path from the config: `~` is the user's home


def xla_cache(directory: Optional[str],
              environ: MutableMapping[str, str] = os.environ) -> Dict[str, str]:
    """Persists compiled XLA programs (and GPU autotuning results) in `directory`.

    TensorFlow saves each compiled cluster there and loads it at the next start
    (`--tf_xla_persistent_cache_directory` in TF_XLA_FLAGS, keyed by the cluster's
    fingerprint and device type); XLA's GPU compiler keeps its per-fusion autotuning
    results in `directory`/autotune. TensorFlow parses TF_XLA_FLAGS once, at its first
    device query (even `tf.config.list_physical_devices`): this must run before anything
    asks TensorFlow about devices, so it cannot wait for the mesh's device type.

    Returns:
      The variables changed.
    """
    changes: Dict[str, str] = {}
    if not directory:
        return changes
    # XLA writes by path: into folders made here (no link below the cache's own folder)
    autotune = files.make_dirs(directory, "autotune")
    _add_flag(environ, "TF_XLA_FLAGS", "--tf_xla_persistent_cache_directory", directory,
              changes)
    _add_flag(environ, "XLA_FLAGS", "--xla_gpu_per_fusion_autotune_cache_dir", autotune,
              changes)
    return changes
