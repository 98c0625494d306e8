"""Meshes, sharding rules, layouts and variable placement (the Keras 3 <-> DTensor bridge).

Floor 4 (imports the runtime and the floors below it). Owns the rules table (`rules`: which
mesh axis each logical axis takes, and a batch's layout, `batch_layout`), the meshes laid
over the devices the runtime set up (`mesh`; `tfllm.runtime.devices`), the mesh context
model code sees (`context`) and how weights are placed and gathered (`placement`, `fsdp`).
Batches are placed by `tfllm.data.feed`; agreement between clients is
`tfllm.runtime.coordination`'s.
"""

from tfllm.parallel.context import constrain, current, use
from tfllm.parallel.rules import DEFAULT_RULES, ShardingError, resolve_spec, zero1_spec


def make_parallel(mesh, model=None, optimizer=None):
    """Builds the mesh and `Parallel` setup that the config's sections describe.

    Args:
      mesh: the config's `MeshConfig` (axes, device type, CPU devices, rules table, GPU
        memory settings, gradient bucket size).
      model: the `ModelConfig`, for `remat` (attention or selective recompute the
        attention core in the backward pass, which sets how FSDP gathers lower:
        `tfllm.parallel.fsdp.configure_dtensor`); None: no recomputation.
      optimizer: the `OptimizerConfig`, for `shard_optimizer_state` (ZeRO-1); None: the
        optimizer states are laid out as their weights.
    """
    from tfllm.parallel.mesh import build_mesh
    from tfllm.parallel.placement import Parallel
    from tfllm.parallel.rules import mesh_axes_of, rules_from_config
    rules = rules_from_config(mesh.rules)
    device_mesh = build_mesh(mesh.axes, mesh.device_type, mesh.num_cpu_devices,
                             known=mesh_axes_of(rules),
                             gpu_memory_reserve_mb=mesh.gpu_memory_reserve_mb,
                             gpu_allocator=mesh.gpu_allocator)
    return Parallel(device_mesh, rules,
                    optimizer is not None and optimizer.shard_optimizer_state,
                    int(mesh.gradient_bucket_mb * 2 ** 20),
                    attention_recomputed=(model is not None
                                          and model.remat in ("attention", "selective")))
