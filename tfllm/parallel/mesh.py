"""Device meshes from config: parsing (pure) and DTensor mesh creation.

`mesh.axes: "data=2,fsdp=2,model=2"` names the axes in order, the last varying
fastest over devices. The devices are the runtime's (`tfllm.runtime.devices.start_devices`:
the GPU gate's kind, NCCL, on CPU the host split into as many logical devices as the mesh
needs, so an 8-device mesh runs on a laptop). Multi-client runs use DTensor's own
environment (`DTENSOR_CLIENT_ID`, `DTENSOR_JOB_NAME`, `DTENSOR_JOBS`), read by
`tfllm.contracts.client_id/num_clients`.
"""

from __future__ import annotations

import math
import re
from typing import List, Optional, Sequence, Tuple

from tfllm.contracts import num_clients
from tfllm.parallel.rules import KNOWN_MESH_AXES
from tfllm.runtime.devices import MeshError, start_devices


#: the most devices a mesh holds: more than any DTensor job of today, few enough that a
#: typo (data=10**20) is refused while parsing, before any device is set up
MAX_MESH_DEVICES = 2 ** 16

#: names users coming from MaxText or torchtitan give an expert-parallel axis; tfllm has
#: none (`tfllm.parallel.rules`, the experts' rule, says why), and says where to go instead
EXPERT_AXIS_NAMES = ("expert", "experts", "ep")

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
        if name not in known and name in EXPERT_AXIS_NAMES:
            raise MeshError(f"mesh.axes: no '{name}' axis; the experts split over the axis "
                            "that carries the batch's rows (data, else fsdp: "
                            "docs/sharding.md, expert parallelism), so give their size "
                            f"there (e.g. {name}={size} -> data={size} or fsdp={size}).")
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
        and its allocator (`tfllm.runtime.environment.gpu_memory`).

    Returns:
      A `tf.experimental.dtensor.Mesh`.
    """
    from tensorflow.experimental import dtensor
    axes = parse_axes(axes_text, known)
    fixed_sizes = all(s != -1 for _, s in axes)
    need = math.prod(s for _, s in axes) if fixed_sizes else None
    kind, total = start_devices(requested_device_type, need, num_cpu_devices,
                                gpu_memory_reserve_mb, gpu_allocator, axes_text)
    axes = resolve_axes(axes, total)
    if num_clients() > 1:
        return dtensor.create_distributed_mesh(axes, device_type=kind)
    devices = [f"{kind}:{i}" for i in range(total)]
    return dtensor.create_mesh(axes, devices=devices, device_type=kind)


def mesh_shape(mesh) -> dict:
    """{axis name: size} of a DTensor mesh."""
    return {name: mesh.dim_size(name) for name in mesh.dim_names}
