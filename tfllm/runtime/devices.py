"""A run's devices: their kind, the GPU gate, the NCCL choice and the CPU split.

What happens to the host before a mesh is made of it (`tfllm.parallel.mesh.build_mesh`
calls `start_devices`, then lays the mesh over the devices it returns). Everything here
must run before TensorFlow initializes its devices; TensorFlow is imported lazily, so
that the config's checks (`MAX_CPU_DEVICES`) and the launcher read this module without
starting it.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Optional, Tuple

from tfllm.contracts import num_clients
from tfllm.runtime import environment, gpu_checks


class MeshError(ValueError):
    """The mesh does not fit the devices, batch or model; the message says how to fix it."""


#: the most logical devices one host's CPU is split into: each is a TensorFlow device with
#: its own threads and buffers, and a million of them exhaust the host (or segfault)
MAX_CPU_DEVICES = 256

NCCL_ENV = "DTENSOR_GPU_USE_NCCL_COMMUNICATION"
#: the device a launched worker is told to use (`tfllm launch --device`: auto, gpu or cpu)
DEVICE_ENV = "TFLLM_DEVICE"


def _gpu_count() -> int:
    import tensorflow as tf
    return len(tf.config.list_physical_devices("GPU"))


def use_nccl(environ=os.environ) -> bool:
    """Asks DTensor for NCCL collectives on a GPU mesh, unless the user said no.

    DTensor reads `DTENSOR_GPU_USE_NCCL_COMMUNICATION` when it lowers collectives: without
    it a GPU mesh runs TensorFlow's own ring collectives and splits every reduce-scatter
    into an all-reduce of the full tensor plus a slice (`LowerReduceScatterOp`,
    tensorflow/dtensor/mlir/collectives.cc). Nothing set it for a single process, so an
    8-GPU `tfllm train` ran without NCCL. An explicit `=0` is kept (a way to rule NCCL
    out when debugging a hang). Must run before `initialize_accelerator_system`, which
    reads it too.

    `TFLLM_DEVICE=cpu` (what `tfllm launch --device cpu` gives every worker;
    `tfllm.launch.device.resolve_device_env` is the launcher's side of the same rule)
    also keeps it off.

    Returns:
      Whether NCCL is asked for.
    """
    if environ.get(NCCL_ENV, "") == "0":
        return False
    if not environ.get(NCCL_ENV) and environ.get(DEVICE_ENV) == "cpu":
        environ[NCCL_ENV] = "0"
        return False
    environ[NCCL_ENV] = "1"
    return True


def _use_first_gpus(count: int) -> int:
    """Makes only the first `count` GPUs visible to TensorFlow (before it starts), so that a
    mesh smaller than the host (`tfllm generate --set mesh.axes=data=1` on an 8-GPU host)
    neither needs the others nor takes their memory: TensorFlow's allocator claims every
    visible GPU when it starts. Returns `count`."""
    import tensorflow as tf
    gpus = tf.config.list_physical_devices("GPU")
    try:
        tf.config.set_visible_devices(gpus[:count], "GPU")
    except RuntimeError:
        raise MeshError(f"mesh.axes: the mesh uses {count} of {len(gpus)} GPUs, but "
                        "TensorFlow was started before the mesh and uses all of them; set "
                        f"CUDA_VISIBLE_DEVICES to {count} GPUs or build the mesh first.") from None
    return count


def _initialize_gpus_single_client(dtensor) -> None:
    """DTensor's GPU initialization in one process: it turns NCCL on in TensorFlow's
    context (`collective_nccl`), which only takes effect before TensorFlow initializes.
    If something initialized TensorFlow first (a notebook that ran TensorFlow before the
    mesh), the mesh still works with TensorFlow's ring collectives: NCCL is taken back so
    that tfllm's own lowering choices (`fsdp._sliced_reduction`) match, and a warning
    says how to get it."""
    try:
        dtensor.initialize_accelerator_system("GPU")
    except ValueError as e:
        if "already been initialized" in str(e) and "Accelerator" in str(e):
            return  # an earlier mesh of this process did it
        os.environ[NCCL_ENV] = "0"
        warnings.warn("tfllm: TensorFlow was initialized before the GPU mesh, so DTensor "
                      "runs without NCCL collectives; build the mesh (tfllm.parallel."
                      "make_parallel) before any other TensorFlow call to use NCCL.",
                      stacklevel=4)


def device_type(requested: str = "auto") -> str:
    """GPU when present (or asked for), else CPU."""
    if requested == "auto":
        return "GPU" if _gpu_count() else "CPU"
    if requested == "GPU" and not _gpu_count():
        raise MeshError("mesh.device_type: GPU was asked for but TensorFlow sees no GPU; "
                        "install tensorflow[and-cuda] or set mesh.device_type=CPU.")
    return requested


def check_gpus(requested: str, precision_policy: str, facts=None, out=None) -> list:
    """The GPU start-up checks (`tfllm.runtime.gpu_checks`) for a run: raises `MeshError`
    with the first error's line, prints warnings, returns the findings. Skipped (returns
    []) on CPU meshes and on `auto` hosts without nvidia-smi.

    Args:
      requested: mesh.device_type.
      precision_policy: precision.policy (FP8 needs compute capability 8.9+).
      facts: `gpu_checks.HostFacts` (default: read from this host).
      out: where warnings go (default stderr).
    """
    if facts is None:
        if not gpu_checks.wanted(requested):
            return []
        facts = gpu_checks.gather()
    findings = gpu_checks.check(facts, precision_policy, requested)
    error = gpu_checks.first_error(findings)
    if error:
        raise MeshError(error + " (`tfllm doctor` checks the host)")
    for f in findings:
        if f.level == "warning":
            print(f"tfllm: warning: {f.message}", file=out or sys.stderr, flush=True)
    return findings


def setup_cpu_devices(count: int) -> int:
    """Splits the host CPU into `count` logical devices if TF is not yet initialized.

    Returns the number of logical CPU devices available afterwards.
    """
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError:
        pass  # TensorFlow is initialized already: keep what it has.
    return len(tf.config.list_logical_devices("CPU"))


def start_devices(requested: str, need: Optional[int], num_cpu_devices: int = 0,
                  gpu_memory_reserve_mb: int = 4096, gpu_allocator: str = "bfc",
                  axes_text: str = "") -> Tuple[str, int]:
    """Sets up this host's devices for a mesh of `need` devices, before TensorFlow starts.

    On CPU the host is split into logical devices; on GPU NCCL is chosen, the memory
    reserve set, and a mesh smaller than the host sees only its GPUs. A multi-client job
    starts DTensor's multi-client runtime here (coordination service, NCCL), which must
    come before anything else initializes TensorFlow.

    Args:
      requested: mesh.device_type (auto, CPU or GPU).
      need: the devices the mesh's fixed sizes ask for, or None (a -1 axis).
      num_cpu_devices: logical CPU devices per client; 0 means as many as the mesh needs.
      gpu_memory_reserve_mb, gpu_allocator: GPU memory left outside TensorFlow's pool,
        and its allocator (`tfllm.runtime.environment.gpu_memory`).
      axes_text: the `mesh.axes` string, for the error when the CPU cannot hold it.

    Returns:
      (device kind, the number of devices of the whole job to lay the mesh over).
    """
    kind = device_type(requested)
    clients = num_clients()
    if kind == "CPU":
        # A -1 axis on CPU: one logical device per core (at most 8). More logical
        # devices than cores only add overhead (benchmarks/results/cpu_devices.md).
        wanted = num_cpu_devices or max((need or min(os.cpu_count() or 1, 8)) // clients, 1)
        if wanted > MAX_CPU_DEVICES:
            raise MeshError(f"mesh.axes={axes_text} needs {wanted} logical CPU devices on "
                            f"this host; tfllm splits a CPU into at most {MAX_CPU_DEVICES}: "
                            "use smaller axes on CPU, or GPUs.")
    if kind == "GPU":
        nccl = use_nccl()
        environment.gpu_memory(gpu_memory_reserve_mb, gpu_allocator)
    from tensorflow.experimental import dtensor
    if clients > 1:
        # Multi-client: DTensor's own initialization (coordination service over gRPC,
        # NCCL on GPU when DTENSOR_GPU_USE_NCCL_COMMUNICATION=1) must come before
        # anything else initializes TensorFlow.
        local = wanted if kind == "CPU" else _gpu_count()
        dtensor.initialize_accelerator_system(
            kind, num_logical_cpu_devices=local if kind == "CPU" else None)
        return kind, local * clients
    if kind == "GPU":
        total = _gpu_count()
        if need is not None and need < total:
            total = _use_first_gpus(need)
        if nccl:
            _initialize_gpus_single_client(dtensor)
        return kind, total
    total = setup_cpu_devices(wanted)
    if need is not None and need < total:
        total = need  # e.g. tests reuse one 8-device host for smaller meshes
    return kind, total
