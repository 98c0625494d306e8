"""Device meshes from config: parsing (pure), device setup and DTensor mesh creation.

`mesh.axes: "data=2,fsdp=2,model=2"` names the axes in order, the last varying
fastest over devices. On CPU tfllm splits the host into as many logical devices as the
mesh needs, so an 8-device mesh runs on a laptop. Multi-client runs use DTensor's own
environment (`DTENSOR_CLIENT_ID`, `DTENSOR_JOB_NAME`, `DTENSOR_JOBS`), read by
`tfllm.contracts.client_id/num_clients`.
"""

from __future__ import annotations

import math
import os
import re
from typing import List, Optional, Sequence, Tuple

from tfllm.contracts import num_clients
from tfllm.parallel import runtime_env
from tfllm.parallel.rules import KNOWN_MESH_AXES


class MeshError(ValueError):
    """The mesh does not fit the devices, batch or model; the message says how to fix it."""


#: the most devices a mesh holds: more than any DTensor job of today, few enough that a
#: typo (data=10**20) is refused while parsing, before any device is set up
MAX_MESH_DEVICES = 2 ** 16
#: the most logical devices one host's CPU is split into: each is a TensorFlow device with
#: its own threads and buffers, and a million of them exhaust the host (or segfault)
MAX_CPU_DEVICES = 256

_PAIR = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(-?\d+)\s*$")


def parse_axes(text: str, known: Sequence[str] = KNOWN_MESH_AXES) -> List[Tuple[str, int]]:
    """Parses 'data=2,fsdp=-1' into [('data', 2), ('fsdp', -1)] with checks.

    Args:
      text: comma-separated name=size pairs; at most one size may be -1.
      known: the mesh axis names the rules table uses.
    """
    if not isinstance(text, str) or not text.strip():
        raise MeshError("mesh.axes: empty; give name=size pairs such as 'data=8' or "
                        "'data=2,model=4'.")
    axes = []
    for part in text.split(","):
        m = _PAIR.match(part)
        if not m:
            raise MeshError(f"mesh.axes: '{part.strip()}' is not name=size (e.g. 'model=4').")
        name, size = m.group(1), int(m.group(2))
        if name not in known:
            raise MeshError(f"mesh.axes: unknown axis '{name}'; the rules table uses "
                            f"{', '.join(known)} (add rules in mesh.rules for others).")
        if any(name == n for n, _ in axes):
            raise MeshError(f"mesh.axes: axis '{name}' is given twice.")
        if size == 0 or size < -1:
            raise MeshError(f"mesh.axes: axis '{name}' has size {size}; use a positive size "
                            "or -1 to fill the remaining devices.")
        axes.append((name, size))
    if sum(1 for _, s in axes if s == -1) > 1:
        raise MeshError("mesh.axes: only one axis may be -1.")
    fixed = math.prod(s for _, s in axes if s != -1)
    if fixed > MAX_MESH_DEVICES:
        raise MeshError(f"mesh.axes: the sizes multiply to {fixed} devices; a mesh holds at "
                        f"most {MAX_MESH_DEVICES}: give the sizes of the job's devices (or "
                        "-1 for the rest).")
    return axes


def resolve_axes(axes: Sequence[Tuple[str, int]], num_devices: Optional[int]
                 ) -> List[Tuple[str, int]]:
    """Fills a -1 axis from the device count; checks the product when it is known."""
    fixed = math.prod(s for _, s in axes if s != -1)
    if any(s == -1 for _, s in axes):
        if num_devices is None:
            raise MeshError("mesh.axes: a -1 axis needs a known device count; give every "
                            "axis a size.")
        if num_devices % fixed:
            raise MeshError(f"mesh.axes: {num_devices} devices are not divisible by the "
                            f"fixed axes' product {fixed}.")
        return [(n, num_devices // fixed if s == -1 else s) for n, s in axes]
    if num_devices is not None and fixed != num_devices:
        raise MeshError(f"mesh.axes: the mesh has {fixed} devices but {num_devices} are "
                        "available; make the sizes multiply to the device count (or use -1).")
    return list(axes)


def _gpu_count() -> int:
    import tensorflow as tf
    return len(tf.config.list_physical_devices("GPU"))


NCCL_ENV = "DTENSOR_GPU_USE_NCCL_COMMUNICATION"


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
    # The variable name is the launcher's contract (tfllm.launch.device.DEVICE_ENV); it
    # is spelled out here because parallel/ does not import the launcher's package.
    if not environ.get(NCCL_ENV) and environ.get("TFLLM_DEVICE") == "cpu":
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
    import warnings
    try:
        dtensor.initialize_accelerator_system("GPU")
    except ValueError as e:
        if "already been initialized" in str(e) and "Accelerator" in str(e):
            return  # an earlier mesh of this process did it
        os.environ[NCCL_ENV] = "0"
        warnings.warn("tfllm: TensorFlow was initialized before the GPU mesh, so DTensor "
                      "runs without NCCL collectives; build the mesh (tfllm.parallel."
                      "make_parallel) before any other TensorFlow call to use NCCL.",
                      stacklevel=3)


def device_type(requested: str = "auto") -> str:
    """GPU when present (or asked for), else CPU."""
    if requested == "auto":
        return "GPU" if _gpu_count() else "CPU"
    if requested == "GPU" and not _gpu_count():
        raise MeshError("mesh.device_type: GPU was asked for but TensorFlow sees no GPU; "
                        "install tensorflow[and-cuda] or set mesh.device_type=CPU.")
    return requested


def check_gpus(requested: str, precision_policy: str, facts=None, out=None) -> list:
    """The GPU start-up checks (`tfllm.parallel.gpu_checks`) for a run: raises `MeshError`
    with the first error's line, prints warnings, returns the findings. Skipped (returns
    []) on CPU meshes and on `auto` hosts without nvidia-smi.

    Args:
      requested: mesh.device_type.
      precision_policy: precision.policy (FP8 needs compute capability 8.9+).
      facts: `gpu_checks.HostFacts` (default: read from this host).
      out: where warnings go (default stderr).
    """
    import sys
    from tfllm.parallel import gpu_checks
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


def build_mesh(axes_text: str, requested_device_type: str = "auto", num_cpu_devices: int = 0,
               known: Sequence[str] = KNOWN_MESH_AXES, gpu_memory_reserve_mb: int = 4096,
               gpu_allocator: str = "bfc"):
    """Creates the DTensor mesh for `mesh.axes` (single- or multi-client).

    Args:
      axes_text: the `mesh.axes` string.
      requested_device_type: auto, CPU or GPU.
      num_cpu_devices: logical CPU devices per client; 0 means as many as the mesh needs.
      known: mesh axis names the rules table uses.
      gpu_memory_reserve_mb, gpu_allocator: GPU memory left outside TensorFlow's pool,
        and its allocator (`tfllm.parallel.runtime_env.gpu_memory`).

    Returns:
      A `tf.experimental.dtensor.Mesh`.
    """
    from tensorflow.experimental import dtensor
    axes = parse_axes(axes_text, known)
    kind = device_type(requested_device_type)
    clients = num_clients()
    fixed_sizes = all(s != -1 for _, s in axes)
    need = math.prod(s for _, s in axes) if fixed_sizes else None
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
        runtime_env.gpu_memory(gpu_memory_reserve_mb, gpu_allocator)
    if clients > 1:
        # Multi-client: DTensor's own initialization (coordination service over gRPC,
        # NCCL on GPU when DTENSOR_GPU_USE_NCCL_COMMUNICATION=1) must come before
        # anything else initializes TensorFlow.
        local = wanted if kind == "CPU" else _gpu_count()
        dtensor.initialize_accelerator_system(
            kind, num_logical_cpu_devices=local if kind == "CPU" else None)
        axes = resolve_axes(axes, local * clients)
        return dtensor.create_distributed_mesh(axes, device_type=kind)
    if kind == "GPU":
        total = _gpu_count()
        if need is not None and need < total:
            total = _use_first_gpus(need)
        if nccl:
            _initialize_gpus_single_client(dtensor)
    else:
        total = setup_cpu_devices(wanted)
        if need is not None and need < total:
            total = need  # e.g. tests reuse one 8-device host for smaller meshes
    axes = resolve_axes(axes, total)
    devices = [f"{kind}:{i}" for i in range(total)]
    return dtensor.create_mesh(axes, devices=devices, device_type=kind)


def mesh_shape(mesh) -> dict:
    """{axis name: size} of a DTensor mesh."""
    return {name: mesh.dim_size(name) for name in mesh.dim_names}


def check_batch(global_batch: int, grad_accum: int, spec_axis: Optional[str], shape: dict,
                sequence_length: Optional[int] = None,
                sequence_axis: Optional[str] = None) -> None:
    """Each micro-batch must split evenly over the mesh axis that shards its rows, and the
    sequence over the axis that splits it (batch over data and fsdp together)."""
    micro = global_batch // grad_accum
    if spec_axis and micro % shape[spec_axis]:
        raise MeshError(
            f"train.global_batch_size ({global_batch}) / train.grad_accum_steps ({grad_accum}) "
            f"= {micro} sequences per micro-batch do not divide over mesh axis '{spec_axis}' "
            f"(size {shape[spec_axis]}); use a multiple of {shape[spec_axis]}.")
    if sequence_axis and sequence_length and sequence_length % shape[sequence_axis]:
        raise MeshError(
            f"data.sequence_length ({sequence_length}) does not divide over mesh axis "
            f"'{sequence_axis}' (size {shape[sequence_axis]}), which splits the sequence "
            f"because the batch's rows take '{spec_axis}'; use a multiple of "
            f"{shape[sequence_axis]}, or a mesh without both axes.")
